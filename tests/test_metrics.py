"""FLOP formulas against independent counts, MFU lookup, helpers, and MetricsLogger files/resume."""

import importlib.util
import io
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from xmoe.model import flops
from xmoe.model.flops import FlopDims, paper_train_flops, train_flops
from xmoe.train import metrics
from xmoe.train.metrics import MetricsLogger, format_progress, load_imbalance, peak_memory_bytes

# B sequences, S seq len, T = B*S tokens, H hidden, E experts, K top-k, F expert ffn, V vocab


def _tiny_dims(**kw):
    base = dict(
        hidden_size=8,
        num_layers=3,
        num_moe_layers=2,
        num_heads=2,
        vocab_size=11,
        seq_len=5,
        num_experts=4,
        top_k=2,
        expert_ffn_size=6,
        dense_ffn_size=12,
        num_shared_experts=1,
        num_kv_heads=1,
    )
    base.update(kw)
    return FlopDims(**base)


def _reference_step(d: FlopDims, B: int, capacity: int) -> int:
    """Forward + backward of a plain-loop MoE transformer with exactly the matmuls the formula describes.

    Causal attention loops over query positions and multiplies only by keys <= query, so FlopCounterMode
    sees the causal half. Experts keep their first ``capacity`` routed rows and drop the rest.
    Returns the routed rows processed (FLOPs are counted by the caller's FlopCounterMode).
    """
    g = torch.Generator().manual_seed(0)
    H, S, hd, nh, nkv = d.hidden_size, d.seq_len, d.head_dim, d.num_heads, d.num_kv_heads

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.3).requires_grad_()

    def swiglu(x_TH, w1, w3, w2):
        return (F.silu(x_TH @ w1) * (x_TH @ w3)) @ w2

    emb_VH = w(d.vocab_size, H)
    h_BSH = emb_VH[torch.randint(d.vocab_size, (B, S), generator=g)]
    rows = 0
    for layer in range(d.num_layers):
        q = (h_BSH @ w(H, nh * hd)).view(B, S, nh, hd)
        k = (h_BSH @ w(H, nkv * hd)).view(B, S, nkv, hd)
        v = (h_BSH @ w(H, nkv * hd)).view(B, S, nkv, hd)
        out = torch.zeros(B, S, nh, hd)
        for b in range(B):
            for head in range(nh):
                kv = head * nkv // nh
                for i in range(S):
                    scores = q[b, i, head][None] @ k[b, : i + 1, kv].T  # [1, i+1]: causal keys only
                    out[b, i, head] = (scores.softmax(-1) @ v[b, : i + 1, kv])[0]
        h_BSH = h_BSH + out.reshape(B, S, nh * hd) @ w(nh * hd, H)
        x_TH = h_BSH.reshape(B * S, H)
        if layer < d.num_layers - d.num_moe_layers:
            y_TH = swiglu(x_TH, w(H, d.dense_ffn_size), w(H, d.dense_ffn_size), w(d.dense_ffn_size, H))
        else:
            probs_TE = (x_TH @ w(H, d.num_experts)).softmax(-1)
            weight_TK, expert_TK = probs_TE.topk(d.top_k, dim=-1)
            y_TH = torch.zeros_like(x_TH)
            for e in range(d.num_experts):
                tok, slot = (expert_TK == e).nonzero(as_tuple=True)
                tok, slot = tok[:capacity], slot[:capacity]  # dropped slots never reach the expert
                rows += len(tok)
                f = d.expert_ffn_size
                y_e = swiglu(x_TH[tok], w(H, f), w(H, f), w(f, H)) * weight_TK[tok, slot, None]
                y_TH = y_TH.index_add(0, tok, y_e)
            for _ in range(d.num_shared_experts):
                f = d.expert_ffn_size
                y_TH = y_TH + swiglu(x_TH, w(H, f), w(H, f), w(f, H))
        h_BSH = h_BSH + y_TH.view(B, S, H)
    logits = h_BSH @ w(H, d.vocab_size)
    F.cross_entropy(logits.flatten(0, 1), torch.zeros(B * S, dtype=torch.long)).backward()
    return rows


@pytest.mark.parametrize("capacity", [100, 3])  # dropless, and with dropped slots
def test_train_flops_match_flop_counter(capacity):
    d, B = _tiny_dims(), 2
    with FlopCounterMode(display=False) as counter:
        rows = _reference_step(d, B, capacity)
    dropless_rows = B * d.seq_len * d.num_moe_layers * d.top_k
    assert (rows == dropless_rows) == (capacity == 100)
    assert train_flops(d, B, routed_rows=rows) == counter.get_total_flops()
    if capacity == 100:
        assert train_flops(d, B) == counter.get_total_flops()  # default: dropless


def test_forward_macs_by_hand():
    # H=8, 3 layers (1 dense), 2 heads of 4, 1 kv head, T = 2*5 = 10 tokens, V=11, E=4, K=2, F=6, S=1.
    macs = flops.forward_macs(_tiny_dims(), num_sequences=2, routed_rows=30)
    assert macs == {
        "attn_proj": 10 * 3 * 8 * 4 * (2 * 2 + 2 * 1),  # q and o: 2 heads; k and v: 1 kv head
        "attn_scores": 3 * 2 * 2 * (2 * 4) * 15,  # 15 = 5*6/2 causal (query, key) pairs per sequence
        "dense_ffn": 10 * 1 * 3 * 8 * 12,
        "router": 10 * 2 * 8 * 4,
        "shared_experts": 10 * 2 * 1 * 3 * 8 * 6,
        "routed_experts": 30 * 3 * 8 * 6,
        "lm_head": 10 * 11 * 8,
        "mtp_proj": 0,
    }


def test_paper_formula_small_preset():
    # Small preset: seq 2048, hidden 2048, ffn 1408, 16 heads (head_dim 128), 64 experts, top-6, 28 layers.
    vocab = 32000  # not given with the preset; any value, counted once
    d = FlopDims(
        hidden_size=2048,
        num_layers=28,
        num_moe_layers=28,
        num_heads=16,
        vocab_size=vocab,
        seq_len=2048,
        num_experts=64,
        top_k=6,
        expert_ffn_size=1408,
        dense_ffn_size=1,
    )
    per_token_layer = 4 * 2048**2 + 2 * 128 * 16 * 2048 + 2 * 1408 * 2048 * 6
    assert per_token_layer == 59_768_832
    flops = paper_train_flops(d, num_sequences=4)
    assert flops == 6 * 4 * 2048 * (28 * per_token_layer + vocab * 2048)
    assert 10e9 < flops / (4 * 2048) < 11e9  # ~10.4 GFLOP per trained token
    # xmoe counts SwiGLU's third matrix and the router but only causal attention: ~20 % more here.
    assert 1.1 < train_flops(d, 4) / flops < 1.3
    # 8 GPUs, 0.5 s per step -> TFLOP/s per GPU as the paper reports it
    assert flops / (0.5 * 8) / 1e12 == pytest.approx(21.37, rel=1e-3)


def test_flop_dims_from_model_config():
    from xmoe.config import ModelConfig, MoEConfig

    cfg = ModelConfig(
        vocab_size=50,
        hidden_size=16,
        num_layers=4,
        num_heads=2,
        first_k_dense=1,
        moe=MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, num_shared_experts=1),
    )
    d = FlopDims.from_model_config(cfg, seq_len=32)
    assert (d.num_moe_layers, d.head_dim, d.num_kv_heads, d.dense_ffn_size) == (3, 8, 2, cfg.ffn_hidden_size)


def test_peak_flops_table(monkeypatch):
    assert metrics.peak_flops("cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, peak in [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("AMD Instinct MI250X", 191.5e12),
        ("AMD Instinct MI300X", 1307e12),
        ("NVIDIA GeForce GTX 1080", None),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert metrics.peak_flops() == peak, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert metrics.mfu(494.5e12) == pytest.approx(0.5)


def test_helpers():
    assert load_imbalance(torch.tensor([3, 3, 3, 3])) == 1.0
    assert load_imbalance(torch.tensor([8, 0, 0, 0])) == 4.0
    assert load_imbalance(torch.zeros(4)) == 1.0
    assert load_imbalance(torch.tensor([[2, 2], [3, 1]])) == 1.5  # worst layer
    assert peak_memory_bytes("cpu") > 10 * 2**20  # a process with torch loaded holds > 10 MiB
    values = dict(
        loss=3.2141,
        aux_loss=0.01,
        lr=2.9e-3,
        tokens_per_s=12_345.0,
        tflops=0.05,
        mem_bytes=1.2 * 2**30,
        imbalance=1.3111,
    )
    assert format_progress(40, 300, values) == (
        "step 40/300 | loss 3.214 | aux 0.010 | lr 2.9e-03 | 12.3k tok/s | 0.05 TFLOP/s | mem 1.2 GiB | imbalance 1.31"
    )


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_logger_writes_jsonl_plot_and_summary(tmp_path):
    out = io.StringIO()
    log = MetricsLogger(tmp_path, rank=0, total_steps=5, stream=out, progress_bar=False)
    for step in range(1, 6):
        log.log(step, loss=torch.tensor(4.0 - step * 0.5), lr=1e-3, tokens_per_s=1000.0 * step, mem_bytes=2**30)
    assert [r["step"] for r in _read(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]  # flushed before finish
    summary = log.finish(floor=1.0, baseline=3.5)
    assert "step 3/5 | loss 2.500 | lr 1.0e-03 | 3.0k tok/s | mem 1.0 GiB" in out.getvalue()
    assert summary["final_loss"] == 1.5 and summary["best_loss"] == 1.5 and summary["steps"] == 5
    assert summary["mean_tokens_per_s"] == 3500.0  # first record (start-up) excluded
    assert json.loads((tmp_path / "summary.json").read_text())["references"] == {
        "floor (entropy rate)": 1.0,
        "baseline (unigram entropy)": 3.5,
    }
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "summary:" in out.getvalue()


def test_logger_resume_drops_later_records(tmp_path):
    first = MetricsLogger(tmp_path, rank=0, total_steps=8, stream=io.StringIO(), progress_bar=False)
    for step in range(1, 7):
        first.log(step, loss=float(step))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')  # torn line: the crash hit mid-write
    resumed = MetricsLogger(tmp_path, rank=0, total_steps=8, stream=io.StringIO(), progress_bar=False, resume_step=4)
    assert [r["step"] for r in _read(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    for step in range(5, 9):
        resumed.log(step, loss=float(step))
    records = _read(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    elapsed = [r["elapsed_s"] for r in records]
    assert elapsed == sorted(elapsed)  # cumulative across the resume
    assert resumed.finish()["best_loss"] == 1.0  # summary covers the pre-resume records too


def test_logger_other_ranks_and_tqdm(tmp_path, capsys):
    quiet = MetricsLogger(tmp_path / "r1", rank=1, total_steps=3)
    quiet.log(1, loss=1.0)
    assert quiet.finish() == {} and not (tmp_path / "r1").exists()
    bar = MetricsLogger(tmp_path / "r0", rank=0, total_steps=3, progress_bar=True)
    for step in (1, 2, 3):
        bar.log(step, loss=1.0 / step, imbalance=1.5)
    bar.finish()
    assert "3/3" in capsys.readouterr().err


def test_tensorboard_optional(tmp_path):
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.warns(UserWarning, match="pip install tensorboard"):
            log = MetricsLogger(
                tmp_path, rank=0, total_steps=2, tensorboard=True, progress_bar=False, stream=io.StringIO()
            )
    else:
        log = MetricsLogger(tmp_path, rank=0, total_steps=2, tensorboard=True, progress_bar=False, stream=io.StringIO())
    log.log(1, loss=math.nan)  # NaN losses still log (as JSON NaN) and do not break the summary
    assert math.isnan(_read(tmp_path / "metrics.jsonl")[0]["loss"])
    assert log.finish()["best_loss"] is None
