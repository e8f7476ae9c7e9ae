"""The public API the README shows, and logging: library code logs (rank 0 shown by the CLI), it never prints."""

import ast
import io
import logging
import re
from pathlib import Path

import pytest
import torch

import xmoe
from xmoe.log import RankZeroFilter, configure_logging

ROOT = Path(__file__).resolve().parents[1]
# modules that are command-line front ends: printing is their job
CLI_MODULES = {
    "xmoe/cli.py",
    "xmoe/train/cli.py",
    "xmoe/plan/cli.py",
    "xmoe/data/cli.py",
    "xmoe/bench.py",
    "xmoe/infer.py",
}


def test_public_names_are_the_module_objects():
    from xmoe.config import DataConfig, KernelConfig, ModelConfig, MoEConfig, ParallelConfig, RunConfig, TrainConfig
    from xmoe.kernels.choice import resolve_kernels
    from xmoe.model.presets import get_preset
    from xmoe.model.transformer import Transformer
    from xmoe.moe.layer import MoELayer
    from xmoe.parallel.build import build_model
    from xmoe.train.trainer import Trainer

    expected = dict(
        MoEConfig=MoEConfig,
        MoELayer=MoELayer,
        ModelConfig=ModelConfig,
        ParallelConfig=ParallelConfig,
        RunConfig=RunConfig,
        TrainConfig=TrainConfig,
        Transformer=Transformer,
        get_preset=get_preset,
        Trainer=Trainer,
        DataConfig=DataConfig,
        KernelConfig=KernelConfig,
        build_model=build_model,
        resolve_kernels=resolve_kernels,
    )
    for name, obj in expected.items():
        assert getattr(xmoe, name) is obj, name
        assert name in xmoe.__all__
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        xmoe.nonsense  # noqa: B018


@pytest.mark.parametrize("doc", ["README.md", "docs/usage.md"])
def test_python_examples_run(doc, capsys):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)
    assert blocks, f"{doc} shows no Python example"
    torch.manual_seed(0)
    for block in blocks:
        scope: dict = {}
        exec(compile(block, doc, "exec"), scope)
    assert scope["y"].shape == (4, 128, 512)
    assert scope["loss"].item() > 0 and all(p.grad is not None for p in scope["model"].parameters())


def test_version_is_written_once():
    assert re.fullmatch(r"\d+\.\d+\.\d+", xmoe.__version__)
    assert "version = " not in (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.dynamic]")[0]


def _record(**extra) -> logging.LogRecord:
    record = logging.LogRecord("xmoe.x", logging.INFO, __file__, 1, "hello", None, None)
    record.__dict__.update(extra)
    return record


def test_rank_zero_filter(monkeypatch):
    keep = RankZeroFilter()
    monkeypatch.setenv("RANK", "0")
    assert keep.filter(_record())
    monkeypatch.setenv("RANK", "3")
    assert not keep.filter(_record())
    assert keep.filter(_record(all_ranks=True))


def test_configure_logging_prints_rank_zero_once(monkeypatch, capsys):
    logger = configure_logging()
    configure_logging()  # idempotent: still one handler, one line per record
    child = logging.getLogger("xmoe.train.trainer")
    monkeypatch.setenv("RANK", "0")
    child.info("from rank zero")
    monkeypatch.setenv("RANK", "1")
    child.info("from rank one")
    child.debug("below the level")
    assert capsys.readouterr().out == "from rank zero\n"
    assert logger.propagate is False


def _bare_prints(path: Path) -> list[int]:
    """Line numbers of print() calls that write to the process's stdout (no file= argument)."""
    tree = ast.parse(path.read_text())
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "print"
        and not any(k.arg == "file" for k in node.keywords)
    ]


def test_library_code_does_not_print():
    found = {}
    for path in sorted((ROOT / "xmoe").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in CLI_MODULES and _bare_prints(path):
            found[rel] = _bare_prints(path)
    assert found == {}, f"use logging.getLogger(__name__) instead of print in library code: {found}"
    assert _bare_prints(ROOT / "xmoe" / "bench.py"), "the checker finds a CLI module's prints"


def test_metrics_logger_lines_go_to_the_log_without_a_stream(tmp_path, monkeypatch, capsys):
    from xmoe.train.metrics import MetricsLogger

    configure_logging()
    monkeypatch.setenv("RANK", "0")
    log = MetricsLogger(tmp_path, rank=0, total_steps=1, progress_bar=False)
    log.log(1, loss=2.5)
    log.finish()
    out = capsys.readouterr().out
    assert "loss 2.500" in out and "summary: steps 1" in out
    buf = io.StringIO()
    log = MetricsLogger(tmp_path / "b", rank=0, total_steps=1, progress_bar=False, stream=buf)
    log.log(1, loss=2.5)
    assert "loss 2.500" in buf.getvalue() and capsys.readouterr().out == ""
