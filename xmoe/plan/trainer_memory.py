"""The memory of a whole replica: `xmoe train` on one GPU (``estimate_trainer_memory``: fp32 weights, AdamW, the
experts' bf16 copies, compiled regions), the same backward walk over eager fp32 blocks on a CPU, and a DDP rank's
(the replica plus its gradient buckets). Letters and conventions: ``memory.py``'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

from xmoe.config import RECOMPUTE_MODES, ModelConfig
from xmoe.model.counting import block_kinds, count_params
from xmoe.model.flops import attention_matrix_params
from xmoe.plan.rank_run import RankRun
from xmoe.plan.terms import (
    ADAM_BYTES,
    GRAD_BYTES,
    LOSS_CHUNK_TOKENS,
    MASTER_BYTES,
    RESIDUAL_BYTES,
    _adam_step,
    _keeps,
    attention_activations,
    dense_ffn_activations,
    moe_activations,
    mtp_activations,
    norm_activations,
)


@dataclass(frozen=True)
class TrainerMemory:
    """Peak bytes of `xmoe train` on one GPU (see estimate_trainer_memory); ``total`` is the predicted peak."""

    states: float  # fp32 parameters, AdamW moments, bf16 expert weight copies held for the step
    grads: float  # fp32 gradients alive at the peak
    activations: float  # saved activations alive at the peak
    working: float  # the backward's transient at the peak (recomputed block, bf16 weight gradients, loss chunk)
    blocks_done: int  # blocks whose backward has run at the peak (0: the peak is at the start of backward)

    @property
    def total(self) -> float:
        return self.states + self.grads + self.activations + self.working


def block_activations(
    cfg: ModelConfig, T: int, i: int, *, compiled: bool = True, fused: bool = True, b: int = 2
) -> tuple[float, float]:
    """(attention branch, FFN branch) bytes block ``i`` of `xmoe train`'s model saves for T tokens, autocast bf16
    (blocks in forward order, the multi-token-prediction blocks last: counting.block_kinds).

    Each branch keeps its fp32 residual input (RMSNorm's backward reads it) and the bf16 weight copies autocast
    made for its matmuls; compiled regions keep RMSNorm's fp32 1/rms only beyond that (the compiler rebuilds the
    normalised tensor), eager RMSNorm its fp32 copies (norm_activations). ``fused``: the one-rank Triton path
    (gather, experts and combine in one op) keeps no dispatch or combine buffer, only the bf16 tokens it reads."""
    H, moe = cfg.hidden_size, cfg.moe
    norm = 4 * T if compiled else norm_activations(T, H)
    attn = dict(attention_activations(T, H, cfg.num_heads, 1, b), norm=norm)
    attn_bytes = sum(attn.values()) + b * attention_matrix_params(cfg) + 4 * T * H
    if not block_kinds(cfg)[i]:
        ffn = dict(dense_ffn_activations(T, H, cfg.ffn_hidden_size, 1, b), norm=norm)
        return attn_bytes, sum(ffn.values()) + b * 3 * H * cfg.ffn_hidden_size + 4 * T * H
    ffn = dict(moe_activations(moe, T, kernel="triton" if fused else "torch", b=b), norm=norm)
    if fused:
        ffn["dispatch_buffer"], ffn["combine_buffer"] = b * T * H, 0.0
    shared_w = 3 * H * moe.shared_width
    return attn_bytes, sum(ffn.values()) + b * shared_w + 4 * T * H


def _block_weights(cfg: ModelConfig, parts: dict[str, int]) -> list[float]:
    """Parameters of each block, from the one parameter count (attention variants, shared-expert widths included);
    a multi-token-prediction block with its module's projection and norms."""
    kinds, H = block_kinds(cfg), cfg.hidden_size
    n_moe = sum(kinds)
    attn_w = parts["attention"] / len(kinds) + 2 * H  # + the block's two RMSNorm weights
    moe_w = (parts["routed_experts"] + parts["router"] + parts["shared_experts"]) / max(1, n_moe)
    dense_w = parts["dense_ffn"] / max(1, len(kinds) - n_moe)
    mtp_w = parts["mtp"] / max(1, cfg.mtp_depth)
    return [
        attn_w + (moe_w if is_moe else dense_w) + (mtp_w if i >= cfg.num_layers else 0.0)
        for i, is_moe in enumerate(kinds)
    ]


def _backward_walk(
    states: float,
    blocks: list[tuple[float, float, float, float]],
    start_grads: float,
    tail: float,
    loss_chunk: float,
    accumulating: bool = False,
) -> TrainerMemory:
    """The peak of a replica's backward: the loss chunk at its start, then block by block top-down, each freeing
    its saved activations while its gradients appear (with ``accumulating`` every gradient exists throughout, in
    ``start_grads``). ``blocks``: (saved, rebuilt in backward, gradient bytes, transient) per block, bottom first."""
    saved_left = sum(saved for saved, *_ in blocks)
    best = TrainerMemory(states, start_grads, saved_left + tail, loss_chunk, 0)
    grads = start_grads
    for j, (saved, regen, grad_bytes, transient) in enumerate(reversed(blocks), 1):
        made = 0.0 if accumulating else grad_bytes  # this block's gradients appear as it runs
        here = TrainerMemory(states, grads + made, saved_left, regen + transient, j)
        if here.total > best.total:
            best = here
        grads += made
        saved_left -= saved
    return best


def estimate_trainer_memory(
    cfg: ModelConfig,
    *,
    micro_batch: int,
    seq_len: int | None = None,
    recompute: str = "none",
    accumulation: int = 1,
    compiled: bool = True,
    fused: bool = True,
) -> TrainerMemory:
    """The peak of one `xmoe train` step on one GPU, in the trainer's own precision layout:

    * states: fp32 parameters (4 B), AdamW's two fp32 moments (8 B), and the bf16 copies of the routed experts made
      once per step (2 B per expert weight);
    * the last micro-batch's backward walks the blocks top-down (``_backward_walk``): the LM head's fp32 gradient
      first, then each block frees its saved activations while its fp32 parameter gradients appear (with
      ``accumulation`` > 1 every gradient exists from the first micro-batch on). The peak is the largest sum of
      gradients plus activations of the blocks left plus the transient of the block in hand: its bf16 weight
      gradients before they are added into fp32, and with recompute its activations rebuilt; or the loss chunk's
      logits at the start of backward;
    * saved activations per block: block_activations. "moe" keeps the MoE branch's fp32 input instead of its
      activations, "full" only each block's fp32 input.
    benchmarks/memory_fit.py measures the peaks this predicts (docs/training-speed.md has the table).
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute ({recompute!r}) must be one of {RECOMPUTE_MODES}")
    if micro_batch < 1 or accumulation < 1:
        raise ValueError(f"micro_batch ({micro_batch}) and accumulation ({accumulation}) must be >= 1")
    seq_len = cfg.max_seq_len if seq_len is None else seq_len
    H, _L, V = cfg.hidden_size, cfg.num_layers, cfg.vocab_size
    T, b = micro_batch * seq_len, 2
    parts = count_params(cfg, expert_matrices=3).total_by_part
    total_params = sum(parts.values())
    states = 12 * total_params + 2 * parts["routed_experts"]
    blocks = _trainer_blocks(cfg, parts, T, recompute, compiled, fused, b)
    accumulating = accumulation > 1
    head = parts["head"] or parts["embedding"]
    start_grads = 4 * total_params if accumulating else 4 * head
    # the final norm's input, and the head's input (or, with the loss in chunks, h's gradient in the compute dtype,
    # which model/loss.py holds instead: the same bytes)
    tail = 4 * T * H + b * T * H
    # one chunk's bf16 logits, fp32 softmax and gradients (made at the end of the forward, model/loss.py, beside
    # what the backward starts with: the same sum), and the fp32 head gradient each multi-token-prediction depth's
    # loss made in its forward, until the losses' backward adds them into the head's
    loss_chunk = 12 * min(T, LOSS_CHUNK_TOKENS) * V + 4 * head * cfg.mtp_depth
    return _backward_walk(states, blocks, start_grads, tail, loss_chunk, accumulating)


def _trainer_blocks(
    cfg: ModelConfig, parts: dict[str, int], T: int, recompute: str, compiled: bool, fused: bool, b: int
) -> list[tuple[float, float, float, float]]:
    """Per block of the trainer's model: (saved, rebuilt in backward, fp32 gradient bytes, bf16 weight-gradient
    transient)."""
    H = cfg.hidden_size
    blocks: list[tuple[float, float, float, float]] = []
    kinds = block_kinds(cfg)
    for i, weights in enumerate(_block_weights(cfg, parts)):
        is_moe = kinds[i]
        attn, ffn = block_activations(cfg, T, i, compiled=compiled, fused=fused, b=b)
        saved: float
        regen: float
        if recompute == "full":
            saved, regen = 4 * T * H, attn + ffn
        elif recompute == "moe" and is_moe:
            saved, regen = attn + 4 * T * H, ffn
        else:
            saved, regen = attn + ffn, 0.0
        if i >= cfg.num_layers:  # a multi-token-prediction module's own norms and projection are never recomputed
            saved += mtp_activations(T, H, b)
        blocks.append((saved, regen, 4 * weights, b * weights))
    return blocks


def _fp32_replica(run: RankRun) -> TrainerMemory:
    """estimate_trainer_memory's walk for an fp32 eager replica (the trainer on a CPU): no casts, fp32 gradients
    made directly, and each block's activation gradients (as in fsdp_memory's step_moments) as its transient; with
    ``run.accumulation`` > 1 every gradient exists throughout the last micro-batch's backward."""
    cfg, acts = run.cfg, run.acts
    H, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
    T, b, moe = acts.tokens, 4, cfg.moe
    parts = count_params(cfg, expert_matrices=3).total_by_part
    residual = RESIDUAL_BYTES * T * H
    rows_grad = b * acts.rows * (2 * H + (moe.ffn_hidden_size if run.kernel == "torch" else 2 * moe.ffn_hidden_size))
    weights = _block_weights(cfg, parts)
    attn_b, moe_b, dense_b = (sum(d.values()) for d in (acts.attention, acts.moe, acts.dense))
    blocks = []
    for i, is_moe in enumerate(block_kinds(cfg)):
        kept, regen, *_ = _keeps(run.recompute, attn_b, moe_b if is_moe else dense_b, residual, is_moe)
        kept += mtp_activations(T, H, b) if i >= L else 0.0
        transient = residual + (rows_grad if is_moe else 2 * b * T * cfg.ffn_hidden_size)
        blocks.append((kept, regen, GRAD_BYTES * weights[i], transient))
    tail = norm_activations(T, H) + b * T * H
    head = parts["head"] or parts["embedding"]
    loss = 12 * min(T, LOSS_CHUNK_TOKENS) * V + GRAD_BYTES * head * cfg.mtp_depth  # as estimate_trainer_memory
    accumulating = run.accumulation > 1
    start = sum(parts.values()) if accumulating else head
    return _backward_walk(12 * sum(parts.values()), blocks, GRAD_BYTES * start, tail, loss, accumulating)


def _replica_peak(run: RankRun) -> tuple[str, dict[str, float]]:
    """The peak of a whole replica: the trainer on one process, or a DDP rank (the same plus DDP's fp32 gradient
    buckets, as large as the gradients): the larger of backward's and the optimizer step's. bf16:
    estimate_trainer_memory (compiled regions, as the trainer runs them with ep = tp = 1 on a GPU); fp32: the same
    backward walk over the eager fp32 blocks."""
    cfg, par = run.cfg, run.parallel
    parts = count_params(cfg, expert_matrices=3).total_by_part
    P = sum(parts.values())
    if run.precision == "bf16":
        m = estimate_trainer_memory(
            cfg,
            micro_batch=run.micro_batch,
            seq_len=run.seq_len,
            recompute=run.recompute,
            accumulation=run.accumulation,
            fused=run.kernel == "triton",
        )
    else:
        m = _fp32_replica(run)
    buckets = GRAD_BYTES * P if par.world_size > 1 else 0.0
    states = {"params": MASTER_BYTES * P, "optimizer": ADAM_BYTES * P, "buckets": buckets}
    backward = states | {
        "casts": m.states - 12 * P,
        "grads": m.grads,
        "activations": m.activations,
        "transient": m.working,
    }
    step = states | {"grads": GRAD_BYTES * P, "adam_step": _adam_step(cfg, par, run.precision, sharded=False)}
    blocks = cfg.num_layers + cfg.mtp_depth
    where = f"backward, {m.blocks_done} of {blocks} blocks done" if m.blocks_done else "loss backward"
    return max((where, backward), ("optimizer step", step), key=lambda moment: sum(moment[1].values()))
