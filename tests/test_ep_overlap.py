"""Expert parallelism with its all-to-alls overlapped (moe/routed.py, the dispatchers' posted exchanges): an MoE layer
sharded over 4 gloo ranks, flat and RBD (2 nodes of 2), overlap off / shared / chunks, equals one process running
every rank's tokens through the whole layer, outputs and every gradient; with overlap on it equals overlap off.
Ranks and chunks with no tokens take part like the others."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed

H, F, E, K = 12, 6, 8, 3
WORLD = 4
MODES = [("off", 1), ("shared", 2), ("chunks", 2), ("chunks", 3)]


def _layer(dispatcher: str, gate: bool, dispatch_dtype: str = "bf16"):
    from xmoe.config import MoEConfig
    from xmoe.moe.layer import MoELayer

    cfg = MoEConfig(
        hidden_size=H,
        ffn_hidden_size=F,
        num_experts=E,
        top_k=K,
        num_shared_experts=1,
        shared_expert_gate=gate,
        aux_loss_coef=0.01,
        kernel_backend="torch",
        dispatcher=dispatcher,
        dispatch_dtype=dispatch_dtype,
    )
    torch.manual_seed(0)
    return MoELayer(cfg).double()


def _fake_quant(x):
    """What FP8 dispatch makes of each routed row (quantised per row: a token's copies all alike), gradient straight
    through."""
    from xmoe.kernels.fp8_rows import dequantize_rows, quantize_rows

    return x + (dequantize_rows(*quantize_rows(x.detach(), "e4m3fn"), x.dtype) - x).detach()


def _inputs(rank: int, tokens: list[int]):
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens[rank], H, generator=gen, dtype=torch.float64)
    g = torch.randn(tokens[rank], H, generator=gen, dtype=torch.float64)
    return x, g


def _reference(dispatcher: str, gate: bool, tokens: list[int], dispatch_dtype: str = "bf16"):
    """One process, all experts: each rank's tokens through the layer, its loss's gradients, summed over ranks for
    the experts (their owner receives every rank's rows), per rank for the replicated router and shared experts.
    With FP8 dispatch the routed experts take the rows quantised and dequantised, the router and shared experts not."""
    layer = _layer("pft", gate)
    if dispatch_dtype == "fp8":
        experts = layer.experts.forward
        layer.experts.forward = lambda x, *args, **kwargs: experts(_fake_quant(x), *args, **kwargs)
    per_rank = []
    for r in range(WORLD):
        x, g = _inputs(r, tokens)
        x.requires_grad_(True)
        layer.zero_grad()
        out = layer(x)
        (out * g).sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        per_rank.append((out.detach(), x.grad.clone(), grads))
    experts = {n: sum(pr[2][n] for pr in per_rank) / WORLD for n in ("experts.w1", "experts.w3", "experts.w2")}
    return per_rank, experts


def _run(rank, world, dispatcher, gate, tokens, modes, results, dispatch_dtype="bf16"):
    from xmoe.config import ParallelConfig
    from xmoe.parallel.dims import ParallelDims
    from xmoe.parallel.expert_parallel import shard_experts

    cfg = ParallelConfig(ep=WORLD, gpus_per_node=2)
    dims = ParallelDims.from_config(cfg, world, num_experts=E).build_mesh("cpu")
    per_rank, experts = _reference(dispatcher, gate, tokens, dispatch_dtype)
    ref_out, ref_dx, ref_grads = per_rank[rank]
    tol = 1e-12 if dispatcher == "pft" else 1e-6  # RBD sums a row's partials across GPUs in fp32 (rbd.md)
    outs = {}
    for mode, chunks in modes:
        layer = _layer(dispatcher, gate, dispatch_dtype)
        shard_experts(torch.nn.Sequential(layer), dims, mode, chunks)
        x, g = _inputs(rank, tokens)
        x.requires_grad_(True)
        out = layer(x)
        (out * g).sum().backward()
        outs[(mode, chunks)] = out.detach()
        assert _rel(out, ref_out) < tol, (mode, chunks, _rel(out, ref_out))
        assert _rel(x.grad, ref_dx) < tol, (mode, chunks)
        for name, p in layer.named_parameters():
            got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            want = experts.get(name, ref_grads[name])
            assert _rel(got, want) < tol, (mode, chunks, name, _rel(got, want))
        stats = layer.dispatcher.stats
        if dispatcher == "rbd":
            assert stats.calls == (chunks if mode == "chunks" else 1)
        elif dispatch_dtype == "fp8":  # a row on the wire: H values and one fp32 scale per 128 of them
            combine = stats.rows_received * H * 8  # the combine sends back float64 rows
            assert stats.bytes_sent == stats.rows_sent * (H + 4) + combine, stats
    for (mode, _chunks), out in outs.items():  # the shared experts' overlap moves no addition: bitwise
        if mode == "shared" and ("off", 1) in outs:
            assert torch.equal(out, outs[("off", 1)])
    results[rank] = True


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item() if b.numel() else float((a - b).abs().sum())


@pytest.mark.parametrize("dispatcher", ["pft", "rbd"])
def test_overlap_modes_equal_one_process(dispatcher):
    run_distributed(_run, WORLD, dispatcher, True, [11, 7, 13, 9], MODES, {}, timeout_s=120)


@pytest.mark.parametrize("dispatcher", ["pft", "rbd"])
def test_fp8_dispatch_equals_one_process_on_quantised_rows(dispatcher):
    modes = [("off", 1), ("chunks", 2)]
    run_distributed(_run, WORLD, dispatcher, False, [11, 7, 0, 9], modes, {}, "fp8", timeout_s=120)


def test_empty_ranks_and_empty_chunks_take_part():
    # rank 1 routes nothing; rank 3 has fewer tokens than chunks, so its third chunk is empty
    run_distributed(_run, WORLD, "rbd", False, [6, 0, 5, 2], [("off", 1), ("chunks", 3)], {}, timeout_s=120)
    run_distributed(_run, WORLD, "pft", False, [6, 0, 5, 2], [("shared", 2), ("chunks", 3)], {}, timeout_s=120)


def test_chunks_refuse_a_capacity_factor():
    from xmoe.config import MoEConfig
    from xmoe.moe.layer import MoELayer

    layer = MoELayer(MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, capacity_factor=1.25))
    with pytest.raises(ValueError, match="capacity factor"):
        layer.set_overlap("chunks", 2)
    with pytest.raises(ValueError, match="ep_overlap"):
        layer.set_overlap("sideways")
    layer.set_overlap("shared")
    assert layer.overlap_mode == "shared"


def _order(rank, world, mode, results):
    """The events of one layer call, forward then backward: exchanges posted and waited for, the shared experts'
    halves and each chunk's experts, forward and backward (hooks on their outputs' gradients)."""
    from xmoe.config import ParallelConfig
    from xmoe.dispatch import comm
    from xmoe.parallel.dims import ParallelDims
    from xmoe.parallel.expert_parallel import shard_experts

    log: list[tuple[str, int]] = []
    post, wait = comm.Exchange.post, comm.Exchange.wait
    tags = iter(range(1000))

    def logged_post(self, *args):
        self.__dict__.setdefault("tag", next(tags))
        log.append(("post", self.tag))
        return post(self, *args)

    def logged_wait(self):
        log.append(("wait", self.tag))
        return wait(self)

    comm.Exchange.post, comm.Exchange.wait = logged_post, logged_wait
    dims = ParallelDims.from_config(ParallelConfig(ep=2), world, num_experts=E).build_mesh("cpu")
    layer = _layer("pft", False)
    shard_experts(torch.nn.Sequential(layer), dims, mode, 2)

    def traced(name, fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            out.register_hook(lambda _: log.append((name + " backward", 0)))
            return out

        return call

    layer.experts.forward = traced("experts", layer.experts.forward)
    layer.shared_experts.up = traced("shared up", layer.shared_experts.up)
    layer.shared_experts.down = traced("shared down", layer.shared_experts.down)
    x, _ = _inputs(rank, [9, 9])
    out = layer(x.requires_grad_(True))
    log.append(("backward", -1))
    out.sum().backward()
    comm.Exchange.post, comm.Exchange.wait = post, wait
    results[rank] = log


def _inside(log, name, start):
    """True where event ``name`` (after index ``start``) runs while an exchange posted after ``start`` is in flight."""
    at = next(i for i, e in enumerate(log) if i >= start and e[0] == name)
    posted = {tag for kind, tag in log[start:at] if kind == "post"}
    waited = {tag for kind, tag in log[start:at] if kind == "wait"}
    return bool(posted - waited)


@pytest.mark.parametrize("mode", ["shared", "chunks"])
def test_backward_overlaps_as_forward_does(mode):
    """What the forward places between a post and its wait, the backward runs while the reverse exchange travels."""
    import multiprocessing

    results = multiprocessing.Manager().dict()
    run_distributed(_order, 2, mode, results, timeout_s=60)
    log = results[0]
    backward = log.index(("backward", -1))
    for name in ("shared up", "shared down"):
        assert _inside(log, name + " backward", backward), (name, log)
    if mode == "chunks":  # one chunk's experts-backward runs while another chunk's gradients travel
        assert _inside(log, "experts backward", backward), log


def _fp8_layer(dispatcher: str, dispatch_dtype: str):
    from xmoe.config import MoEConfig
    from xmoe.moe.layer import MoELayer

    cfg = MoEConfig(
        hidden_size=128,
        ffn_hidden_size=64,
        num_experts=E,
        top_k=2,
        num_shared_experts=1,
        kernel_backend="triton",
        fp8="experts",
        dispatcher=dispatcher,
        dispatch_dtype=dispatch_dtype,
    )
    torch.manual_seed(0)
    return MoELayer(cfg)


def _fp8_experts_run(rank, world, dispatcher, results):
    """FP8 dispatch into FP8 experts (Triton's interpreter): the experts take the rows as they arrive; one process
    runs the same layer with every expert local, its FP8 experts quantising the same rows themselves."""
    from xmoe.config import ParallelConfig
    from xmoe.parallel.dims import ParallelDims
    from xmoe.parallel.expert_parallel import shard_experts

    dims = ParallelDims.from_config(ParallelConfig(ep=world, gpus_per_node=2), world, num_experts=E).build_mesh("cpu")
    gen = torch.Generator().manual_seed(100 + rank)
    x, g = torch.randn(2, 10, 128, generator=gen), torch.randn(2, 10, 128, generator=gen)
    ref = _fp8_layer("pft", "bf16")  # one process: the local fused FP8 path
    x_ref = x.clone().requires_grad_(True)
    out_ref = ref(x_ref)
    (out_ref * g).sum().backward()
    layer = _fp8_layer(dispatcher, "fp8")
    shard_experts(torch.nn.Sequential(layer), dims, "chunks", 2)
    x.requires_grad_(True)
    out = layer(x)
    (out * g).sum().backward()
    # forward: the same FP8 operands, so fp32 rounding apart; backward: the grouped experts quantise the gradient
    # rows they receive, w_n * g[token], where the one-process fused experts quantise g per token and apply w_n
    # after, so their FP8 rounding differs (a fraction of e4m3's 2^-4 relative step; measured 0.1% for the input
    # gradient); the combine weights' gradient is <g, y> here and <g w2^T, a> in FP8 there (measured 2.9%)
    assert _rel(out, out_ref) < 1e-5, _rel(out, out_ref)
    assert _rel(x.grad, x_ref.grad) < 1e-2, _rel(x.grad, x_ref.grad)
    assert _rel(layer.router.weight.grad, ref.router.weight.grad) < 5e-2
    results[rank] = True


@pytest.mark.parametrize("dispatcher", ["pft", "rbd"])
def test_fp8_dispatch_into_fp8_experts_equals_one_process(dispatcher):
    run_distributed(_fp8_experts_run, WORLD, dispatcher, {}, timeout_s=300)
