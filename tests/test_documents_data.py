"""Documents on the data side (data.documents = "mask"): the loader's segments and targets against plain-Python
references, the model fed them computing what each document computes alone, and a masked run that resumes bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_mixture import _records
from test_train import train

from xmoe.data.prepare import prepare
from xmoe.data.prepared import PreparedSet
from xmoe.train.loader import TokenLoader
from xmoe.train.mixture import PreparedDataset, open_data


def _docs_set(d: Path, count: int = 120, seed: int = 0) -> str:
    """A byte-level prepared set of ``count`` short documents (3 to 40 bytes), in several shards."""
    rng = np.random.default_rng(seed)
    texts = ["".join(rng.choice(list("abcdefgh "), size=rng.integers(3, 40))) for _ in range(count)]
    d.mkdir(parents=True, exist_ok=True)
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepare([str(d / "docs.jsonl")], d / "set", shard_bytes=1024, progress=False)
    return str(d / "set")


def _index_starts(directory: str) -> set[int]:
    """Global positions where documents start, read from the shards' .idx files."""
    m = json.loads((Path(directory) / "manifest.json").read_text())
    out, offset = set(), 0
    for shard in m["shards"]:
        out.update(offset + int(s) for s in np.fromfile(Path(directory) / "shards" / f"{shard['name']}.idx", "<i8"))
        offset += shard["tokens"]
    return out


def test_prepared_set_segments_and_targets_match_a_python_reference(tmp_path):
    directory = _docs_set(tmp_path)
    starts = _index_starts(directory)
    ds = PreparedDataset(PreparedSet(directory), "set", seq_len=48, vocab_size=256, seed=2)
    loader = TokenLoader(ds, 8, documents="mask")
    for step in range(3):
        inputs, targets = batch = next(loader)
        assert batch.segments_BS is not None and batch.segments_BS.dtype == torch.int32
        window_starts = ds._starts(0, np.arange(step * 8, step * 8 + 8))
        for row, s in enumerate(window_starts.tolist()):
            segment, expected_seg, expected_tgt = 0, [], []
            for p in range(48):
                if p > 0 and s + p in starts:  # a document starts here: a new segment (never at the row's first)
                    segment += 1
                expected_seg.append(segment)
                nxt = ds.prepared.read(s + p + 1, 1)[0]
                expected_tgt.append(-100 if s + p + 1 in starts else nxt)
            assert batch.segments_BS[row].tolist() == expected_seg
            assert targets[row].tolist() == expected_tgt
            # the targets masked are the end-of-document tokens' (byte 0, which text never holds)
            assert ((targets[row] == -100) == (inputs[row] == 0)).all()


def test_token_file_segments_come_from_the_end_token(tmp_path):
    rng = np.random.default_rng(1)
    tokens = rng.integers(8, 50, size=2000)
    tokens[rng.random(2000) < 0.08] = 7  # 7 ends a document and appears nowhere else
    np.save(tmp_path / "t.npy", tokens)
    with pytest.raises(ValueError, match=r"set data\.eos_id"):
        TokenLoader(open_data(str(tmp_path / "t.npy"), seq_len=32), 4, documents="mask")
    loader = TokenLoader(open_data(str(tmp_path / "t.npy"), seq_len=32, eos_id=7), 4, documents="mask")
    for _ in range(3):
        inputs, targets = batch = next(loader)
        for row in range(4):
            x = inputs[row].tolist()
            expected = [sum(1 for q in range(p) if x[q] == 7) for p in range(32)]
            assert batch.segments_BS[row].tolist() == expected
            assert [t == -100 for t in targets[row].tolist()] == [v == 7 for v in x]
    concat = next(TokenLoader(open_data(str(tmp_path / "t.npy"), seq_len=32, eos_id=7), 4))
    assert concat.segments_BS is None and not (concat[1] == -100).any()  # "concat": nothing changes


def test_masked_rows_compute_what_each_document_computes_alone(tmp_path):
    from xmoe.model.presets import get_preset
    from xmoe.model.transformer import Transformer

    directory = _docs_set(tmp_path)
    loader = TokenLoader(open_data(directory, seq_len=64, vocab_size=256, seed=0), 3, documents="mask")
    inputs, targets = batch = next(loader)
    torch.manual_seed(0)
    cfg = get_preset("tiny")
    model = Transformer(cfg).double()
    loss = model(inputs, targets, segments_BS=batch.segments_BS)
    nats, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for row in range(3):
            seg = batch.segments_BS[row]
            for k in seg.unique().tolist():
                where = seg == k  # one document's positions, run as a row of its own from position 0
                logits = model(inputs[row][where][None])[0]
                t = targets[row][where]
                nats += torch.nn.functional.cross_entropy(logits, t, ignore_index=-100, reduction="sum")
                count += int((t != -100).sum())
    # the model in float64, its loss head in fp32 (as always): agreement to fp32 rounding
    assert loss.item() == pytest.approx((nats / count).item(), rel=1e-6)


def test_masked_run_resumes_bitwise_with_validation(tmp_path):
    directory = _docs_set(tmp_path)
    val = _docs_set(tmp_path / "val", count=60, seed=5)
    extra = ["--data", directory, "--val-data", val, "--set", "data.documents=mask", "--eval-every", "2"]
    extra += ["--set", "train.val_windows=4", "--log-every", "1", "--ckpt-every", "2"]
    full, part = tmp_path / "full", tmp_path / "part"
    train(full, "--steps", "4", *extra)
    train(part, "--steps", "2", *extra)
    train(part, "--steps", "4", "--resume", *extra)
    a, b = _records(full), _records(part)
    assert all(a[s]["loss"] == b[s]["loss"] for s in range(1, 5)) and a[4]["val_loss"] == b[4]["val_loss"]
    meta = json.loads((part / "checkpoints" / "step_000004" / "meta.json").read_text())
    assert meta["config"]["data"]["documents"] == "mask"
