"""Will a run fit the memory there is, and which changes would make it fit: the predictions behind the pre-flight of
`xmoe train`, `xmoe eval` and `xmoe generate` (xmoe/train/preflight.py compares them with the device's free memory).

# T tokens per micro-batch, H hidden, F expert ffn, E experts, K top-k, V vocabulary, L layers, P parameters

``predict_train_peak``: a run's peak per rank, in what the device runs out of. On a GPU the caching allocator's
allocated bytes: one GPU, trainer_memory.estimate_trainer_memory (compiled regions as `xmoe train` resolves them);
several ranks, memory.estimate_memory in bf16 (FSDP2 or DDP) plus NCCL_RESERVE. On a CPU the resident memory the
process gains once its model is built: the planner's live tensor bytes of the fp32 run (the eager replica of
trainer_memory, or an FSDP2 rank) times CPU_RSS_FACTOR plus CPU_RSS_BASE, what the host allocator and the libraries
loaded on first use add beyond the tensors (measured: docs/planning.md, "Pre-flight").
``train_fixes``: changes the planner has checked fit a budget, cheapest first (the layout search's order: fewest
memory-saving tricks, then the largest micro-batch): a smaller micro-batch, recompute, more GPUs with expert
parallelism, fewer layers. ``predict_inference_peak``: a forward without gradients (`xmoe eval`, `generate`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from xmoe.config import RECOMPUTE_MODES, ModelConfig, RunConfig, TrainConfig

GIB = 2**30
WARN_MARGIN = 0.05  # a prediction this close to the memory there is warns, and the changes offered stay below it
# the CPU trainer's peak resident memory beyond what the process held before it built the model, against the
# planner's live tensor bytes: 0.90-1.17x of 1.2 x live + 0.2 GiB over runs of 0.06 to 2.6 GiB live
# (docs/planning.md, "Pre-flight"): glibc keeps freed activations mapped, and the first step loads libraries
CPU_RSS_FACTOR = 1.2
CPU_RSS_BASE = 0.2 * GIB
NCCL_RESERVE = 1.0 * GIB  # several GPU ranks: NCCL's buffers, made after the pre-flight reads the free memory
MAX_EP = 1024  # the most GPUs a "more GPUs" suggestion names


@dataclass(frozen=True)
class Fix:
    """A change the planner has checked: ``flags`` to pass, the predicted ``peak`` per rank with it, and ``run``
    the changed RunConfig where this process can apply it itself (``--fit auto``); None where it needs another
    launch (more GPUs) or changes the model (fewer layers)."""

    flags: str
    peak: float
    run: RunConfig | None


def _kernel(run: RunConfig, device_type: str) -> str:
    """The expert kernels' saved tensors: "triton" (2 F-wide per row) or "torch" (4), as the backend resolves."""
    backend = run.model.moe.kernel_backend
    if device_type == "cuda":
        return "torch" if backend == "torch" else "triton"
    return "triton" if backend == "triton" else "torch"


def predict_train_peak(run: RunConfig, device_type: str) -> float:
    """Bytes one rank of ``run`` peaks at on a ``device_type`` ("cuda" or "cpu") device: the module docstring.
    ValueError where the batch does not split (RunConfig.batch_layout) or the planner cannot lay the run out."""
    from xmoe.plan.memory import estimate_memory
    from xmoe.plan.trainer_memory import estimate_trainer_memory

    _, micro, accum = run.batch_layout()
    cfg, t, par = run.model, run.train, run.parallel
    kernel = _kernel(run, device_type)
    padded = cfg.moe.dispatcher == "padded"
    gpu = device_type == "cuda"
    if gpu and par.world_size == 1:
        return estimate_trainer_memory(
            cfg,
            micro_batch=micro,
            seq_len=t.seq_len,
            recompute=t.recompute,
            accumulation=accum,
            compiled=t.compile != "off",  # "auto" compiles on one GPU
            fused=kernel == "triton" and not padded,
        ).total
    m = estimate_memory(
        cfg,
        par,
        micro_batch=micro,
        seq_len=t.seq_len,
        recompute=t.recompute,
        padded=padded,
        kernel=kernel,
        precision="bf16" if gpu else "fp32",
        reserve_gib=0.0,
        accumulation=accum,
    )
    if gpu:
        return m.peak + NCCL_RESERVE
    return CPU_RSS_FACTOR * m.peak + CPU_RSS_BASE


def _divisors_desc(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)}, reverse=True)


def _batch_fixes(run: RunConfig, device_type: str, budget: float) -> list[Fix]:
    """For each recompute mode from the run's own on, the largest micro-batch (a divisor of the per-rank batch, at
    most the run's) that fits ``budget``: the changes this process can make itself."""
    local, micro, _ = run.batch_layout()
    t = run.train
    fixes = []
    for mode in RECOMPUTE_MODES[RECOMPUTE_MODES.index(t.recompute) :]:
        for mb in (d for d in _divisors_desc(local) if d <= micro):
            if mode == t.recompute and mb == micro:
                continue
            changed = dataclasses.replace(run, train=dataclasses.replace(t, micro_batch_size=mb, recompute=mode))
            peak = predict_train_peak(changed, device_type)
            if peak <= budget:
                flags = [f"--micro-batch-size {mb}"] if mb != micro else []
                flags += [f"--recompute {mode}"] if mode != t.recompute else []
                fixes.append(Fix(" ".join(flags), peak, changed))
                break
    return fixes


def _expert_parallel_fix(run: RunConfig, budget: float) -> Fix | None:
    """GPUs: the smallest expert-parallel degree (a power of two dividing E, above the run's) at which one rank of
    ``run`` on dp x ep' x tp GPUs fits ``budget``, the per-rank batch split as the trainer splits it."""
    par, E = run.parallel, run.model.moe.num_experts
    ep = par.ep * 2
    while ep <= min(E, MAX_EP):
        world = par.dp * ep * par.tp
        if E % ep == 0 and run.train.global_batch_size % (par.dp * ep) == 0:
            local = run.train.global_batch_size // (par.dp * ep)
            micro = run.train.micro_batch_size if local % max(run.train.micro_batch_size, 1) == 0 else 0
            changed = dataclasses.replace(
                run,
                parallel=dataclasses.replace(par, ep=ep, gpus_per_node=par.gpus_per_node or min(world, 8)),
                train=dataclasses.replace(run.train, micro_batch_size=micro),
            )
            try:
                peak = predict_train_peak(changed, "cuda")
            except ValueError:  # a layout the planner cannot lay out (e.g. not whole nodes): try the next
                peak = float("inf")
            if peak <= budget:
                return Fix(f"--ep {ep} on {world} GPUs (torchrun)", peak, None)
        ep *= 2
    return None


def _layers_fix(run: RunConfig, device_type: str, budget: float) -> Fix | None:
    """The most layers (fewer than the model's) with which ``run`` fits ``budget``, at its own micro-batch and
    recompute or, where none fits so, at micro-batch 1 with full recompute; None for an imported model (its layers
    are its weights) or where not even one layer fits."""
    cfg = run.model
    if run.init_from or cfg.num_layers < 2:
        return None
    t = run.train
    for micro, mode in ((t.micro_batch_size, t.recompute), (1, "full")):
        train = dataclasses.replace(t, micro_batch_size=micro, recompute=mode)

        def with_layers(n: int, train: TrainConfig = train) -> RunConfig:
            model = dataclasses.replace(cfg, num_layers=n, first_k_dense=min(cfg.first_k_dense, n))
            return dataclasses.replace(run, model=model, train=train)

        low, high = 0, cfg.num_layers - 1  # the answer is in [low, high]; 0: none fits
        while low < high:  # the peak grows with the layers: bisect
            mid = (low + high + 1) // 2
            if predict_train_peak(with_layers(mid), device_type) <= budget:
                low = mid
            else:
                high = mid - 1
        if low:
            flags = [f"--set model.num_layers={low}"]
            if train != t:
                flags += [f"--micro-batch-size {micro}", f"--recompute {mode}"]
            return Fix(" ".join(flags), predict_train_peak(with_layers(low), device_type), None)
    return None


def train_fixes(run: RunConfig, device_type: str, budget: float, *, same_model: bool = False) -> list[Fix]:
    """Changes to ``run`` whose predicted peak per rank is at most ``budget`` bytes, cheapest first: a smaller
    micro-batch, then each recompute mode with the largest micro-batch that fits (``Fix.run`` set: --fit auto
    applies the first), then more GPUs with expert parallelism (GPUs only: ranks on one host share its memory),
    then fewer layers (not with ``same_model``: a resume must keep the model)."""
    fixes = _batch_fixes(run, device_type, budget)
    if device_type == "cuda":
        fixes += [f for f in (_expert_parallel_fix(run, budget),) if f]
    if not same_model:
        fixes += [f for f in (_layers_fix(run, device_type, budget),) if f]
    return fixes


def predict_inference_peak(cfg: ModelConfig, tokens: int, device_type: str, *, cache_tokens: int = 0) -> float:
    """Bytes a forward without gradients over ``tokens`` tokens peaks at (`xmoe eval`, a generation's prefill), fp32
    weights as eval and generate hold them: the weights, one tensor more while a checkpoint is read into them (the
    embedding's size), the largest of one layer's working tensors and the head's logits, and a KV cache of
    ``cache_tokens`` positions. On a CPU as predict_train_peak counts resident memory."""
    from xmoe.model.counting import count_params
    from xmoe.plan.terms import LOSS_CHUNK_TOKENS

    H, V, L, moe = cfg.hidden_size, cfg.vocab_size, cfg.num_layers, cfg.moe
    T, K, E, F = tokens, moe.top_k, moe.num_experts, moe.ffn_hidden_size
    weights = 4 * count_params(cfg).total
    # residual, normed input, q, k, v and the attention output; router scores; the routed rows in and out and the
    # experts' three F-wide tensors; the shared experts' and the dense FFN's four F-wide tensors
    layer = 4 * T * (6 * H + 2 * E + K * (2 * H + 3 * F) + 4 * max(moe.shared_width, cfg.ffn_hidden_size))
    logits = 4 * T * V + 8 * min(T, LOSS_CHUNK_TOKENS) * V
    cache = 2 * 4 * L * cache_tokens * cfg.kv_heads * cfg.head_dim
    live = weights + 4 * V * H + max(layer, logits) + cache
    return live if device_type == "cuda" else CPU_RSS_FACTOR * live + CPU_RSS_BASE


def gib(n: float) -> str:
    """Bytes as GiB with the digits a comparison needs (MiB below 0.1 GiB)."""
    if n < 0.1 * GIB:
        return f"{n / 2**20:.0f} MiB"
    return f"{n / GIB:.1f} GiB" if n >= 10 * GIB else f"{n / GIB:.2f} GiB"
