"""Training on prepared sets and mixtures: the window order, the mixture's proportions, per-source losses, and a run
that resumes bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train import torchrun, train

from xmoe.data.prepare import prepare
from xmoe.data.prepared import PreparedSet
from xmoe.train.loader import TokenLoader
from xmoe.train.mixture import BLOCK, MixtureDataset, PreparedDataset, apportion, open_data, permute


def _prepared(d: Path, kind: str, docs: int = 300, seed: int = 0) -> str:
    """A prepared set of ``docs`` byte-level documents: "web" (words) or "code" (short functions)."""
    rng = np.random.default_rng([seed, kind == "web"])
    words = "the a of and to in is was for on with as by at from".split()
    if kind == "web":
        texts = [" ".join(rng.choice(words, size=rng.integers(5, 60))) for _ in range(docs)]
    else:
        texts = [f"def f{i}(x):\n    return x * {i + seed}\n" for i in range(docs)]
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{kind}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepare([str(d / f"{kind}.jsonl")], d / kind, shard_bytes=4096, progress=False)  # several shards
    return str(d / kind)


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4097])
def test_permute_is_a_keyed_bijection_evaluated_anywhere(n):
    full = permute(np.arange(n), n, [5, 0])
    assert sorted(full.tolist()) == list(range(n))
    picks = np.random.default_rng(n).integers(0, n, size=min(n, 50))
    np.testing.assert_array_equal(permute(picks, n, [5, 0]), full[picks])  # any subset, any order: the same map
    if n > 16:
        assert not np.array_equal(permute(np.arange(n), n, [5, 1]), full)  # another key, another order


def test_prepared_epochs_visit_every_window_once(tmp_path):
    prepared = PreparedSet(_prepared(tmp_path, "web"))
    stream = prepared.read(0, prepared.num_tokens)
    ds = PreparedDataset(prepared, "web", seq_len=32, vocab_size=256, seed=3)
    assert ds.epoch_size == (prepared.num_tokens - 1) // 32
    orders = set()
    for epoch in range(3):
        rows = ds.samples(epoch, np.arange(ds.epoch_size))
        starts = np.sort(ds._starts(epoch, np.arange(ds.epoch_size)))
        np.testing.assert_array_equal(starts, starts[0] + 32 * np.arange(ds.epoch_size))  # each window once
        for row, start in zip(rows[:20], ds._starts(epoch, np.arange(20)), strict=True):
            np.testing.assert_array_equal(row, stream[start : start + 33])
        orders.add(tuple(ds._starts(epoch, np.arange(ds.epoch_size))))
    assert len(orders) == 3
    again = PreparedDataset(PreparedSet(prepared.directory), "web", seq_len=32, vocab_size=256, seed=3)
    np.testing.assert_array_equal(again.samples(2, np.arange(7, 19)), ds.samples(2, np.arange(7, 19)))


def test_apportion_keeps_every_source_within_one_sample():
    w = np.array([0.7, 0.2, 0.1 - 1e-9, 1e-9])
    w /= w.sum()
    for total in (0, 1, 5, 999, BLOCK, 7 * BLOCK + 3):
        counts = apportion(w, total)
        assert counts.sum() == total and (np.abs(counts - w * total) < 1).all()


def test_mixture_follows_its_weights_and_is_a_function_of_seed_and_position(tmp_path):
    web, code = _prepared(tmp_path, "web"), _prepared(tmp_path, "code")
    mix = open_data(f"0.7:{web},0.3:{code}", seq_len=16, vocab_size=256, seed=4)
    assert isinstance(mix, MixtureDataset) and mix.source_names == ["web", "code"]
    n = 3 * BLOCK + 1234
    sources = mix.draw(0, np.arange(n)).sources_N
    assert sources is not None
    for blocks in (1, 2, 3):  # after whole blocks: within one sample of the weight (the apportionment)
        assert abs((sources[: blocks * BLOCK] == 0).sum() - 0.7 * blocks * BLOCK) < 1
    # any prefix: the slots of a block are shuffled, so a part of a block is a draw without replacement from it;
    # its count is within 1 + 5 binomial standard deviations of the weight (a looser bound than hypergeometric)
    for prefix in (100, 1000, 5000, BLOCK + 777, n):
        count, sigma = (sources[:prefix] == 0).sum(), np.sqrt(prefix * 0.7 * 0.3)
        assert abs(count - 0.7 * prefix) <= 1 + 5 * sigma, (prefix, count)
    # a function of (seed, position): positions asked in any grouping, by a new object, give the same rows
    again = open_data(f"0.7:{web},0.3:{code}", seq_len=16, vocab_size=256, seed=4)
    picks = np.array([5, BLOCK + 3, 17, 2 * BLOCK + 40])
    whole = mix.draw(0, np.arange(n))
    np.testing.assert_array_equal(again.draw(0, picks).tokens_NS1, whole.tokens_NS1[picks])
    other = open_data(f"0.7:{web},0.3:{code}", seq_len=16, vocab_size=256, seed=5)
    assert not np.array_equal(other.draw(0, np.arange(64)).tokens_NS1, whole.tokens_NS1[:64])
    # each source walks its own order: its k-th slot takes its k-th sample, epoch after epoch
    web_ds = mix.sources[0]
    k = np.arange((sources[:4000] == 0).sum())
    epoch, within = np.divmod(k, web_ds.epoch_size)
    expected = np.concatenate([web_ds.samples(int(e), within[epoch == e]) for e in np.unique(epoch)])
    np.testing.assert_array_equal(whole.tokens_NS1[:4000][sources[:4000] == 0], expected)


def test_mixture_errors(tmp_path):
    web = _prepared(tmp_path, "web")
    with pytest.raises(ValueError, match="has no weight; write WEIGHT:PATH"):
        open_data(f"0.5:{web},{web}", seq_len=16)
    with pytest.raises(ValueError, match="needs a weight > 0"):
        open_data(f"0:{web},1:{web}", seq_len=16)
    with pytest.raises(ValueError, match="weight below 1/16384"):
        open_data(f"1:{web},0.00001:{web}", seq_len=16)
    with pytest.raises(ValueError, match="more than the model's vocab_size"):
        open_data(web, seq_len=16, vocab_size=100)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "prepare.json").write_text("{}")
    with pytest.raises(ValueError, match="is unfinished"):
        open_data(str(tmp_path / "half"), seq_len=16)


def test_source_losses_equal_a_float64_reference(tmp_path):
    from xmoe.model.presets import get_preset
    from xmoe.model.transformer import Transformer
    from xmoe.train.source_loss import SourceLosses

    web, code = _prepared(tmp_path, "web"), _prepared(tmp_path, "code")
    loader = TokenLoader(open_data(f"0.5:{web},0.5:{code}", seq_len=32, vocab_size=256, seed=1), 6)
    inputs, targets = batch = next(loader)
    targets[0, :5] = -100  # ignored targets count in neither sum
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"), loss_chunk_tokens=64)  # chunked head loss, as in training
    losses = SourceLosses(["web", "code"], torch.device("cpu"))
    with losses.watching(model, targets, batch.sources_B):
        loss = model(inputs, targets)
    got = losses.take()
    assert not losses.take().any()  # take restarts the counters
    with torch.no_grad():
        logits = model(inputs).double()
    nats = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    nats = nats.view(targets.shape).sum(1)
    valid = (targets != -100).sum(1).double()
    for i in range(2):
        rows = batch.sources_B == i
        assert got[i, 1] == valid[rows].sum()
        assert got[i, 0].item() == pytest.approx(nats[rows].sum().item(), rel=1e-5)
    assert (got[:, 0].sum() / got[:, 1].sum()).item() == pytest.approx(loss.item(), rel=1e-5)


def _records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_mixture_training_resumes_bitwise_and_logs_each_source(tmp_path, capsys):
    web, code = _prepared(tmp_path, "web"), _prepared(tmp_path, "code")
    held_out = [_prepared(tmp_path / "val", kind, docs=100, seed=1) for kind in ("web", "code")]
    data = [
        "--data",
        f"0.7:{web},0.3:{code}",
        "--val-data",
        f"0.5:{held_out[0]},0.5:{held_out[1]}",
        "--eval-every",
        "2",
    ]
    extra = [*data, "--set", "train.val_windows=4", "--log-every", "1", "--ckpt-every", "2"]
    full, part = tmp_path / "full", tmp_path / "part"
    train(full, "--steps", "4", *extra)
    train(part, "--steps", "2", *extra)
    train(part, "--steps", "4", "--resume", *extra)
    a, b = _records(full), _records(part)
    keys = ("loss", "loss/web", "loss/code")
    assert all(a[s][k] == b[s][k] for s in range(1, 5) for k in keys), (a, b)  # exactly equal
    assert a[4]["val_loss/web"] == b[4]["val_loss/web"] and a[4]["val_loss/code"] == b[4]["val_loss/code"]
    assert a[4]["val_loss"] == pytest.approx(0.5 * a[4]["val_loss/web"] + 0.5 * a[4]["val_loss/code"])
    meta = json.loads(next((part / "checkpoints").glob("step_000004/meta.json")).read_text())
    stored = meta["config"]["data"]["mixture"]
    assert stored["web"]["manifest_sha256"] == PreparedSet(web).manifest_sha256 and stored["code"]["weight"] == 0.3
    # another set under the same name is refused: the manifest's hash differs
    _prepared(tmp_path / "other", "code", docs=200)
    other = [*extra[:1], f"0.7:{web},0.3:{tmp_path / 'other' / 'code'}", *extra[2:]]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train(part, "--steps", "6", "--resume", *other)
    assert "data.mixture.code.manifest_sha256: checkpoint" in capsys.readouterr().err


def test_train_refuses_what_it_cannot_do(tmp_path, capsys):
    web = _prepared(tmp_path, "web")
    with pytest.raises(SystemExit):
        train(tmp_path / "r1", "--steps", "1", "--data", web, "--val-fraction", "0.1")
    assert "prepare validation data of its own and pass it with --val-data" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train(tmp_path / "r2", "--steps", "1", "--set", "data.documents=mask")
    assert "needs to know where documents start" in capsys.readouterr().err


def test_data_parallel_mixture_logs_the_same_per_source_losses(tmp_path):
    """Two gloo ranks each hold half of every batch; their per-source sums are added over the ranks at each log."""
    web, code = _prepared(tmp_path, "web"), _prepared(tmp_path, "code")
    args = ["--steps", "3", "--log-every", "1", "--ckpt-every", "100", "--data", f"0.6:{web},0.4:{code}"]
    single, dp = tmp_path / "single", tmp_path / "dp"
    train(single, *args)
    torchrun(2, dp, "--dp", "2", *args)
    a, b = _records(single), _records(dp)
    for step in (1, 2, 3):
        for key in ("loss", "loss/web", "loss/code"):
            # same global batch: only reduction order and the per-rank balance loss differ
            assert abs(a[step][key] - b[step][key]) < 2e-3 * abs(a[step][key]), (step, key, a[step], b[step])
