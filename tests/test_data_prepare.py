"""`xmoe data prepare` and `xmoe data info`: shards against a plain-Python tokenization of the inputs, resuming a killed
run, workers, and one line for each kind of bad input."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from xmoe.cli import main
from xmoe.data.prepare import FAULT_ENV, prepare
from xmoe.data.prepared import PreparedSet

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["first document\nwith two lines", "zweites Dokument: é, ü, 字", "", "third one", "x" * 300]


def _write_inputs(d: Path, parquet: bool = False) -> list[Path]:
    """A folder of two text files, a .jsonl (with a blank line and an empty document), a .jsonl.gz and, when asked,
    a .parquet; returns the inputs in the order prepare reads them."""
    (d / "texts").mkdir(parents=True)
    (d / "texts" / "a.txt").write_text(DOCS[0], encoding="utf-8")
    (d / "texts" / "b.md").write_text(DOCS[1], encoding="utf-8")
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(DOCS)]
    (d / "c.jsonl").write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n", encoding="utf-8")
    with gzip.open(d / "d.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps({"text": t}) for t in DOCS[::-1]) + "\n")
    inputs = [d / "texts", d / "c.jsonl", d / "d.jsonl.gz"]
    if parquet:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": DOCS[1:4]}), d / "e.parquet", row_group_size=2)
        inputs.append(d / "e.parquet")
    return inputs


def _documents(parquet: bool) -> list[str]:
    """The documents of _write_inputs in order, empty ones included (prepare skips them)."""
    return [DOCS[0], DOCS[1], *DOCS, *DOCS[::-1], *(DOCS[1:4] if parquet else [])]


def _reference(docs: list[str], encode, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, document starts) of the stream: each non-empty document's ids, then the end-of-document id."""
    tokens: list[int] = []
    starts = []
    for doc in docs:
        ids = encode(doc)
        if ids:
            starts.append(len(tokens))
            tokens += [*ids, eos]
    return np.array(tokens), np.array(starts)


def _stream(out: Path) -> tuple[np.ndarray, np.ndarray]:
    """The prepared set's tokens and global document starts, read from the shard files themselves."""
    m = json.loads((out / "manifest.json").read_text())
    tokens, starts, offset = [], [], 0
    for shard in m["shards"]:
        t = np.fromfile(out / "shards" / f"{shard['name']}.bin", dtype=m["dtype"])
        tokens.append(t)
        starts.append(np.fromfile(out / "shards" / f"{shard['name']}.idx", dtype="<i8") + offset)
        offset += len(t)
    return np.concatenate(tokens), np.concatenate(starts)


def _bpe(path: Path, special: str = "<|endoftext|>") -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]", special], show_progress=False)
    tok.train_from_iterator(DOCS * 20, trainer)
    tok.save(str(path))
    return path


@pytest.mark.parametrize("parquet", [False, True])
def test_bytes_shards_equal_a_plain_python_tokenization(tmp_path, parquet):
    if parquet:
        pytest.importorskip("pyarrow", reason="Parquet input is the optional extra xmoe[parquet]")
    inputs = _write_inputs(tmp_path, parquet)
    m = prepare([str(p) for p in inputs], tmp_path / "out", progress=False)
    docs = _documents(parquet)
    expected_tokens, expected_starts = _reference(docs, lambda t: list(t.encode()), eos=0)
    tokens, starts = _stream(tmp_path / "out")
    np.testing.assert_array_equal(tokens, expected_tokens)
    np.testing.assert_array_equal(starts, expected_starts)
    assert m["tokens"] == len(tokens) and m["documents"] == len(starts) and m["dtype"] == "uint16"
    assert m["skipped_empty"] == docs.count("")
    # the manifest's content hashes are the files' own SHA-256
    import hashlib

    for source in m["sources"]:
        assert source["sha256"] == hashlib.sha256(Path(source["path"]).read_bytes()).hexdigest()
    # the reader: the stream and where documents start, across shard edges
    prepared = PreparedSet(tmp_path / "out")
    np.testing.assert_array_equal(prepared.read(3, len(tokens) - 5), tokens[3:-2])
    mask = np.zeros(len(tokens), dtype=bool)
    mask[starts] = True
    np.testing.assert_array_equal(prepared.document_starts(1, len(tokens) - 1), mask[1:])


def test_tokenizers_json_shards_and_split_jsonl(tmp_path):
    from tokenizers import Tokenizer

    tok_path = _bpe(tmp_path / "tok.json")
    tok = Tokenizer.from_file(str(tok_path))
    docs = [f"{DOCS[i % 5]} number {i}" for i in range(200)]
    (tmp_path / "big.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    # 1 KiB shards: the file splits into byte ranges that begin and end inside lines
    m = prepare([str(tmp_path / "big.jsonl")], tmp_path / "out", str(tok_path), shard_bytes=1024, progress=False)
    assert len(m["shards"]) > 5 and m["sources"][0]["parts"] == len(m["shards"])
    eos = tok.token_to_id("<|endoftext|>")
    expected_tokens, expected_starts = _reference(docs, lambda t: tok.encode(t, add_special_tokens=False).ids, eos)
    tokens, starts = _stream(tmp_path / "out")
    np.testing.assert_array_equal(tokens, expected_tokens)
    np.testing.assert_array_equal(starts, expected_starts)
    assert m["eos_id"] == eos and m["vocab_size"] == tok.get_vocab_size()
    # two workers write the same bytes
    prepare([str(tmp_path / "big.jsonl")], tmp_path / "two", str(tok_path), shard_bytes=1024, workers=2, progress=False)
    assert (tmp_path / "two" / "manifest.json").read_bytes() == (tmp_path / "out" / "manifest.json").read_bytes()


def _prepare_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "xmoe", "data", "prepare", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=120)


def test_killed_prepare_resumes_to_the_same_output(tmp_path):
    lines = "".join(json.dumps({"text": f"{DOCS[i % 5]} {i}" * 30}) + "\n" for i in range(120))
    (tmp_path / "in.jsonl").write_text(lines)
    args = [str(tmp_path / "in.jsonl"), "--shard-size", "16K", "--workers", "1"]
    whole = _prepare_cli(*args, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    # the run is killed while writing its third shard: two finished shards, one half-written, no manifest
    killed = _prepare_cli(*args, "--out", str(tmp_path / "part"), env={FAULT_ENV: "2"})
    assert killed.returncode == 17
    shards = tmp_path / "part" / "shards"
    assert {p.name for p in shards.glob("*.json")} == {"00000.json", "00001.json"}
    assert list(shards.glob("00002.bin.tmp-*")) and not (tmp_path / "part" / "manifest.json").exists()
    with pytest.raises(ValueError, match="unfinished"):
        PreparedSet(tmp_path / "part")
    (shards / "00001.bin").write_bytes(b"\1\2" + (shards / "00001.bin").read_bytes()[2:])  # a damaged shard is redone
    done = _prepare_cli(*args, "--out", str(tmp_path / "part"))
    assert done.returncode == 0, done.stderr
    assert not list(shards.glob("*.tmp-*"))
    whole_files = sorted(p.relative_to(tmp_path / "whole") for p in (tmp_path / "whole").rglob("*") if p.is_file())
    part_files = sorted(p.relative_to(tmp_path / "part") for p in (tmp_path / "part").rglob("*") if p.is_file())
    assert whole_files == part_files
    for name in whole_files:
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "part" / name).read_bytes(), name
    # with several workers, one dying is one line, and the next run finishes the set
    two = [*args[:-1], "2", "--out", str(tmp_path / "two")]
    died = _prepare_cli(*two, env={FAULT_ENV: "3"})
    assert died.returncode == 2 and "a worker process died" in died.stderr and "\n" not in died.stderr.strip()
    assert _prepare_cli(*two).returncode == 0
    assert (tmp_path / "two" / "manifest.json").read_bytes() == (tmp_path / "whole" / "manifest.json").read_bytes()
    # other options into the same directory are refused, not mixed in
    other = _prepare_cli(*args[:-2], "--out", str(tmp_path / "part"), "--field", "body")
    assert other.returncode == 2 and "holds a prepare of other inputs or options (field" in other.stderr


def _error_line(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["data", "prepare", *args, "--workers", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_bad_input_is_one_line_naming_the_file_and_line(tmp_path, capsys):
    out = str(tmp_path / "out")

    def bad(name: str, data: bytes) -> str:
        path = tmp_path / name
        path.write_bytes(data)
        return str(path)

    err = _error_line(capsys, bad("bin.txt", b"text\nmore\0binary"), "--out", out + "1")
    assert "bin.txt, line 2: binary data" in err
    err = _error_line(capsys, bad("latin.txt", b"ok\nok\ncaf\xe9\n"), "--out", out + "2")
    assert "latin.txt, line 3: invalid UTF-8 (byte 0xe9); re-encode" in err
    err = _error_line(capsys, bad("j.jsonl", b'{"text": "a"}\n{"text": "b"}\n{"text": oops}\n'), "--out", out + "3")
    assert "j.jsonl, line 3: invalid JSON" in err and "fix or remove the line" in err
    err = _error_line(capsys, bad("f.jsonl", b'{"text": "a"}\n\n{"body": "b"}\n'), "--out", out + "4")
    assert "f.jsonl, line 3: no field 'text' (its fields: body); pass --field NAME" in err
    err = _error_line(capsys, bad("l.jsonl", b'["text"]\n'), "--out", out + "5")
    assert "l.jsonl, line 1: a JSON list, not an object" in err
    err = _error_line(capsys, bad("n.jsonl", b'{"text": 3}\n'), "--out", out + "6")
    assert "n.jsonl, line 1: field 'text' is int, not a string" in err
    err = _error_line(capsys, bad("z.jsonl.gz", gzip.compress(b'{"text": "a"}\n' * 50)[:-12]), "--out", out + "7")
    assert "z.jsonl.gz" in err and "not a readable gzip file" in err
    err = _error_line(capsys, bad("u.csv", b"a,b\n"), "--out", out + "8")
    assert "u.csv is not .txt, .md, .jsonl, .jsonl.gz or .parquet" in err
    # a later byte range of a split file still names the line
    rows = b"".join(b'{"text": "row %d"}\n' % i for i in range(100)) + b"{broken\n"
    err = _error_line(capsys, bad("s.jsonl", rows), "--out", out + "9", "--shard-size", "256")
    assert "s.jsonl, line 101: invalid JSON" in err


def test_token_beyond_the_vocabulary_and_tokenizer_errors(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    _bpe(hf / "tokenizer.json", special="</s>")
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (hf / "config.json").write_text(json.dumps({"vocab_size": 20}))  # fewer embedding rows than the tokenizer has
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": DOCS[1]}) + "\n")
    err = _error_line(capsys, str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "o1"), "--tokenizer", str(hf))
    assert "t.jsonl, line" in err and "is beyond the vocabulary (20)" in err
    err = _error_line(capsys, str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "o2"), "--tokenizer", "nope.json")
    assert "tokenizer 'nope.json' not found" in err
    plain = _bpe(tmp_path / "plain.json", special="<sep>")
    err = _error_line(capsys, str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "o3"), "--tokenizer", str(plain))
    assert "to end documents with; name its end-of-document token with --eos-token" in err
    m = prepare([str(tmp_path / "t.jsonl")], tmp_path / "o4", str(plain), eos_token="<sep>", progress=False)
    assert m["tokenizer"]["eos_token"] == "<sep>"


def test_parquet_errors(tmp_path, capsys, monkeypatch):
    pa = pytest.importorskip("pyarrow", reason="Parquet input is the optional extra xmoe[parquet]")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a", None]}), tmp_path / "p.parquet")
    err = _error_line(capsys, str(tmp_path / "p.parquet"), "--out", str(tmp_path / "o1"))
    assert "p.parquet: no column 'text' (its columns: body); pass --field NAME" in err
    err = _error_line(capsys, str(tmp_path / "p.parquet"), "--out", str(tmp_path / "o2"), "--field", "body")
    assert "p.parquet, row 2: column 'body' is null" in err
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as without the extra installed
    err = _error_line(capsys, str(tmp_path / "p.parquet"), "--out", str(tmp_path / "o3"), "--field", "body")
    assert "pip install 'xmoe[parquet]'" in err


def test_info_describes_and_verifies(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello")
    main(["data", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out")])
    capsys.readouterr()
    main(["data", "info", str(tmp_path / "out"), "--verify"])
    text = capsys.readouterr().out
    assert "6 (uint16), 1 documents" in text and "verified" in text and "a.txt (5 bytes" in text
    shard = tmp_path / "out" / "shards" / "00000.bin"
    shard.write_bytes(b"\7" + shard.read_bytes()[1:])
    with pytest.raises(SystemExit):
        main(["data", "info", str(tmp_path / "out"), "--verify"])
    assert "00000.bin: crc32" in capsys.readouterr().err
    shard.write_bytes(b"")
    with pytest.raises(ValueError, match=r"shard file 00000\.bin is 0 bytes, not 12"):
        PreparedSet(tmp_path / "out")
