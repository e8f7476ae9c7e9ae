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


def _block_weights(cfg: ModelConfig, parts: dict[str, int]) -> list[tuple[float, float]]:
    """Parameters of each block as (attention branch, FFN branch), from the one parameter count (attention variants,
    shared-expert widths included); a multi-token-prediction block's FFN share with its module's projection and
    norms."""
    kinds, H = block_kinds(cfg), cfg.hidden_size
    n_moe = sum(kinds)
    attn_w = parts["attention"] / len(kinds) + 2 * H  # + the block's two RMSNorm weights
    moe_w = (parts["routed_experts"] + parts["router"] + parts["shared_experts"]) / max(1, n_moe)
    dense_w = parts["dense_ffn"] / max(1, len(kinds) - n_moe)
    mtp_w = parts["mtp"] / max(1, cfg.mtp_depth)
    return [
        (attn_w, (moe_w if is_moe else dense_w) + (mtp_w if i >= cfg.num_layers else 0.0))
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
    """The peak of an fp32 replica's backward (``_fp32_replica``; the bf16 trainer's is ``_branch_walk``): the loss
    chunk at its start, then block by block top-down, each freeing its saved activations while its gradients appear
    (with ``accumulating`` every gradient exists throughout, in ``start_grads``). ``blocks``: (saved, rebuilt in
    backward, gradient bytes, transient) per block, bottom first."""
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


@dataclass(frozen=True)
class _BlockBackward:
    """What one block of the bf16 trainer holds and makes during its backward (bytes): ``_keeps``'s five terms
    (kept while it waits; rebuilt for and freed after its FFN branch, then its attention branch), the fp32 gradients
    of each branch, and the bf16 weight gradients each branch's backward makes: all of them at once before they
    are added into fp32 (``ffn_cast``, ``attn_cast``), and of the FFN's routed experts the one bf16 matrix still
    waiting when the last of its fp32 gradients is made (``ffn_cast_last``: the experts' backward returns all three
    at once, and moe/weights.py adds them into fp32 one matrix at a time)."""

    kept: float
    ffn_rebuilt: float
    ffn_freed: float
    attn_rebuilt: float
    attn_freed: float
    ffn_grad: float
    attn_grad: float
    ffn_cast: float
    ffn_cast_last: float
    attn_cast: float


def _branch_walk(
    states: float,
    blocks: list[_BlockBackward],
    start_grads: float,
    tail: float,
    loss_chunk: float,
    act_grad: float,
    accumulating: bool = False,
) -> TrainerMemory:
    """The peak of the bf16 trainer's backward, branch by branch: the loss chunk at its start, then each block
    top-down, its FFN branch before its attention branch. Two moments per branch: inside its backward (what it
    keeps and rebuilt, every bf16 weight gradient it makes, the gradients of the blocks above) and after it (its
    saved tensors freed, its fp32 gradients made, the last bf16 matrix waiting). ``act_grad``: the activation
    gradients alive throughout (the fp32 residual stream's and the branch input's). With ``accumulating`` every
    gradient exists throughout, in ``start_grads``."""
    saved_left = sum(blk.kept for blk in blocks)
    best = TrainerMemory(states, start_grads, saved_left + tail, loss_chunk, 0)
    grads = start_grads

    def moment(grads_now: float, saved_now: float, working: float, j: int) -> None:
        nonlocal best
        here = TrainerMemory(states, grads_now, saved_now, working + act_grad, j)
        if here.total > best.total:
            best = here

    for j, blk in enumerate(reversed(blocks), 1):
        ffn_grad, attn_grad = (0.0, 0.0) if accumulating else (blk.ffn_grad, blk.attn_grad)
        moment(grads, saved_left + blk.ffn_rebuilt, blk.ffn_cast, j)
        grads += ffn_grad
        saved_left -= blk.ffn_freed
        # after the FFN: its last bf16 expert matrix waiting, then the attention's bf16 weight gradients
        moment(grads, saved_left + blk.attn_rebuilt, max(blk.ffn_cast_last, blk.attn_cast), j)
        grads += attn_grad
        saved_left -= blk.attn_freed
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
    * the last micro-batch's backward walks the blocks top-down, each block's FFN branch before its attention
      branch (``_branch_walk``): the LM head's fp32 gradient first, then each branch frees its saved activations
      while its fp32 parameter gradients appear (with ``accumulation`` > 1 every gradient exists from the first
      micro-batch on). The peak is the largest sum of gradients plus activations left plus the transient of the
      branch in hand (its bf16 weight gradients before they are added into fp32, with recompute its activations
      rebuilt, and the activation gradients); or the loss chunk's logits at the start of backward. On the small
      shape at micro-batch 8 it is the moment after the first block's FFN: every gradient but that block's
      attention's, its attention's saved tensors, one bf16 expert matrix's gradient;
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
    # the fp32 residual stream's gradient and the bf16 gradient of the branch's input, alive beside each branch
    act_grad = (RESIDUAL_BYTES + b) * T * H
    return _branch_walk(states, blocks, start_grads, tail, loss_chunk, act_grad, accumulating)


def _trainer_blocks(
    cfg: ModelConfig, parts: dict[str, int], T: int, recompute: str, compiled: bool, fused: bool, b: int
) -> list[_BlockBackward]:
    """Per block of the trainer's model, bottom first: what its backward holds and makes (_BlockBackward)."""
    H, moe = cfg.hidden_size, cfg.moe
    blocks: list[_BlockBackward] = []
    for i, (is_moe, (attn_w, ffn_w)) in enumerate(zip(block_kinds(cfg), _block_weights(cfg, parts), strict=True)):
        attn, ffn = block_activations(cfg, T, i, compiled=compiled, fused=fused, b=b)
        kept, ffn_rebuilt, ffn_freed, attn_rebuilt, attn_freed = _keeps(
            recompute, attn, ffn, RESIDUAL_BYTES * T * H, is_moe
        )
        if i >= cfg.num_layers:  # a multi-token-prediction module's own norms and projection are never recomputed
            extra = mtp_activations(T, H, b)
            kept, attn_freed = kept + extra, attn_freed + extra
        # the routed experts' bf16 copies get their gradients from one autograd node, three matrices at once
        matrix = moe.num_experts * H * moe.ffn_hidden_size if is_moe else 0.0
        blocks.append(
            _BlockBackward(
                kept,
                ffn_rebuilt,
                ffn_freed,
                attn_rebuilt,
                attn_freed,
                ffn_grad=GRAD_BYTES * ffn_w,
                attn_grad=GRAD_BYTES * attn_w,
                ffn_cast=b * ffn_w,
                ffn_cast_last=b * matrix,
                attn_cast=b * attn_w,
            )
        )
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
    weights = [attn_w + ffn_w for attn_w, ffn_w in _block_weights(cfg, parts)]
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
