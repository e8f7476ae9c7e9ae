"""The planner's predictions (xmoe/plan/step_time.py) beside the multi-GPU benchmarks' measurements: one MoE layer
call from the compute measured for it (bench_ep.py), and a whole model's step under each overlap mode from its
measured overlap-off step (bench_train_multi_gpu.py --mode overlap).

# T tokens per GPU, P ranks in the EP group (one per GPU), E experts, K top-k

The network is the planner's default (xmoe/plan/comm.py's Network: 300 GB/s per GPU and 5 us a stage inside a node,
25 GB/s and 10 us between nodes); routing uniform. Nothing here is measured: the callers pass their measurements.
"""

from __future__ import annotations

from xmoe.config import ModelConfig, MoEConfig
from xmoe.plan.comm import Network, estimate_comm
from xmoe.plan.overlap import OVERLAP_MODES
from xmoe.plan.step_time import Techniques, compute_model, count_exchange_ms, exchange_ms, predict_step

TARGET_ERROR = 0.15  # the planner's prediction within 15% of each measured time


def layer_config(moe: MoEConfig, tokens: int) -> ModelConfig:
    """A one-layer model around ``moe``: all the planner needs to model one MoE layer call of ``tokens`` tokens."""
    return ModelConfig(
        vocab_size=2, hidden_size=moe.hidden_size, num_layers=1, num_heads=1, moe=moe, max_seq_len=tokens
    )


def predict_layer(
    moe: MoEConfig,
    tokens: int,
    *,
    ep: int,
    gpus_per_node: int,
    mode: str,
    chunks: int,
    compute_ms: float,
    experts_fwd_ms: float,
) -> dict:
    """One layer call, forward + backward, at EP ``ep`` (``gpus_per_node`` GPUs a node), given the layer's compute
    alone (``compute_ms``: no all-to-all, no count exchange) and its routed experts' forward (``experts_fwd_ms``).
    Returns pred_ms (the call), pred_exposed_ms (communication no compute hides), pred_comm_ms (the network busy),
    or pred_note where the planner refuses the measurements (said why)."""
    cfg = layer_config(moe, tokens)
    est = estimate_comm(cfg, ep, gpus_per_node=gpus_per_node, ep=ep, tokens_per_gpu=tokens, network=Network())
    try:
        compute = compute_model(cfg, tokens, ep=ep, compute_ms=compute_ms, experts_ms=experts_fwd_ms)
    except ValueError as e:
        return {"pred_note": str(e)}
    tech = Techniques("pft", mode, max(2, chunks), moe.dispatch_dtype)
    pred = predict_step(est, compute, tech, top_k=moe.top_k)
    return {"pred_ms": pred.step_ms, "pred_exposed_ms": pred.exposed_ms, "pred_comm_ms": pred.network_ms}


def predict_model(
    cfg: ModelConfig,
    tokens: int,
    *,
    world: int,
    ep: int,
    gpus_per_node: int,
    off_ms: float,
    tflops: float,
    chunks: int = 2,
) -> dict[str, float] | str:
    """The planner's step (ms) of ``cfg`` under each overlap mode, one micro-batch of ``tokens`` per GPU, from the
    measured overlap-off step ``off_ms``: the compute is ``off_ms`` less the planner's own exposed time of "off"
    (nothing overlaps there, so that exposure does not depend on the compute), the experts' share of it at
    ``tflops``. A string says why there is no prediction (the planner refused the numbers)."""
    moe = cfg.moe
    est = estimate_comm(cfg, world, gpus_per_node=gpus_per_node, ep=ep, tokens_per_gpu=tokens, network=Network())
    base = Techniques(moe.dispatcher if moe.dispatcher == "rbd" else "pft", "off", max(2, chunks), moe.dispatch_dtype)
    try:
        probe = compute_model(cfg, tokens, ep=ep, tflops=tflops)
        exposed_off = predict_step(est, probe, base, top_k=moe.top_k).exposed_ms
        compute = compute_model(cfg, tokens, ep=ep, compute_ms=off_ms - exposed_off, tflops=tflops)
    except ValueError as e:
        return str(e)
    return {
        mode: predict_step(
            est, compute, Techniques(base.dispatcher, mode, base.chunks, base.dispatch_dtype), top_k=moe.top_k
        ).step_ms
        for mode in OVERLAP_MODES
    }


def predict_exchanges(
    moe: MoEConfig, tokens: int, *, ep: int, gpus_per_node: int, dispatcher: str, max_nodes: int, network: Network
) -> tuple[float, float]:
    """(forward, forward + backward) ms of one layer call's exchanges alone (count exchange, dispatch, combine; with
    the backward: their reverse exchanges) by ``dispatcher`` ("pft": flat; "rbd") under node limit ``max_nodes``."""
    cfg = layer_config(moe, tokens)
    est = estimate_comm(
        cfg,
        ep,
        gpus_per_node=gpus_per_node,
        ep=ep,
        tokens_per_gpu=tokens,
        network=network,
        max_nodes_per_token=max_nodes,
    )
    tech = Techniques(dispatcher, "off", 2, moe.dispatch_dtype, est.max_nodes_per_token)
    net = exchange_ms(est, tech, 1.0, moe.top_k)
    fwd = count_exchange_ms(est, tech, moe.num_experts // ep) + net["dispatch"] + net["combine"]
    return fwd, fwd + net["combine_bwd"] + net["dispatch_bwd"]
