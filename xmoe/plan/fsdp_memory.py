"""The FSDP2 layout's memory (ep or tp > 1): the units one rank holds, and every moment of a training step that can
hold its peak, as bytes by term. Letters and conventions: ``memory.py``'s docstring ("Layout", "The peak").
"""

from __future__ import annotations

from dataclasses import dataclass

from xmoe.config import ModelConfig, ParallelConfig
from xmoe.model.counting import block_kinds, count_params
from xmoe.plan.terms import (
    ADAM_BYTES,
    GRAD_BYTES,
    LOSS_CHUNK_TOKENS,
    MASTER_BYTES,
    RESIDUAL_BYTES,
    _adam_step,
    _keeps,
    _LayerActivations,
    activation_bytes,
    mtp_activations,
    norm_activations,
)


@dataclass(frozen=True)
class _Unit:
    """One FSDP2 unit on one rank: ``numel`` parameters before sharding (after TP and EP), sharded over ``group``
    ranks, its weights gathered (and their gradients made) at ``width`` bytes per element."""

    numel: float
    group: int
    width: int

    @property
    def shard(self) -> float:
        return self.numel / self.group

    @property
    def weights(self) -> float:
        """Bytes of its gathered weights; as many for its unsharded gradients and for its all-gather buffer."""
        return self.width * self.numel

    @property
    def reduce_input(self) -> float:
        """Bytes of the fp32 reduce-scatter input of its gradients (FSDP2 keeps one such buffer in flight)."""
        return GRAD_BYTES * self.numel

    @property
    def reduced(self) -> float:
        return GRAD_BYTES * self.shard


_NO_UNIT = _Unit(0.0, 1, 0)


@dataclass(frozen=True)
class _LayerUnits:
    block: _Unit  # attention, norms, dense FFN or shared experts (and the router on CPUs)
    experts: _Unit | None  # the routed experts of an MoE layer
    router: _Unit | None  # the router's fp32 unit of an MoE layer (GPUs)
    moe_side: float  # parameters of the block's MoE part (ffn norm, shared experts, CPU router): gradients first


@dataclass(frozen=True)
class _Units:
    layers: list[_LayerUnits]
    root: _Unit  # final norm and head (+ the embedding on CPUs or when tied)
    embed: _Unit | None  # the untied embedding's fp32 unit (GPUs)
    head: float  # head parameters (V x H): its gradient lives from the loss to the root's reduce-scatter

    def all(self) -> list[_Unit]:
        units = [self.root] + ([self.embed] if self.embed else [])
        for layer in self.layers:
            units += [u for u in (layer.block, layer.experts, layer.router) if u]
        return units

    def experts(self) -> list[_Unit]:
        return [layer.experts for layer in self.layers if layer.experts]


def _fsdp_units(cfg: ModelConfig, par: ParallelConfig, precision: str) -> _Units:
    """The FSDP2 units of one rank (expert_parallel.apply_expert_parallel), from the one parameter count."""
    parts = count_params(cfg, expert_matrices=3).total_by_part
    H, V, moe, kinds = cfg.hidden_size, cfg.vocab_size, cfg.moe, block_kinds(cfg)
    n_moe = sum(kinds)
    gpu, b = precision == "bf16", activation_bytes(precision)
    dense_group = par.dp * par.ep
    attention = parts["attention"] / len(kinds) / par.tp + 2 * H  # TP-split projections (+ q/k norms), two norms
    shared = parts["shared_experts"] / n_moe if n_moe else 0.0
    router = moe.num_experts * H
    layers = []
    for i, is_moe in enumerate(kinds):
        # a multi-token-prediction module is one unit with its block: its projection and norms join the block's
        own = attention + (parts["mtp"] / cfg.mtp_depth if i >= cfg.num_layers else 0.0)
        if not is_moe:
            layers.append(
                _LayerUnits(_Unit(own + 3 * H * cfg.ffn_hidden_size / par.tp, dense_group, b), None, None, 0.0)
            )
            continue
        experts = _Unit(3 * (moe.num_experts // par.ep) * H * moe.ffn_hidden_size, par.dp, b)
        in_block = 0 if gpu else router
        block = _Unit(own + shared + in_block, dense_group, b)
        layers.append(
            _LayerUnits(block, experts, _Unit(router, dense_group, 4) if gpu else None, H + shared + in_block)
        )
    tied = cfg.tie_embeddings
    embed_in_root = tied or not gpu
    # a tied embedding keeps the root an fp32 unit (the residual stream starts in fp32)
    root = _Unit(V * H + H + (V * H if embed_in_root and not tied else 0), dense_group, 4 if tied else b)
    embed = None if embed_in_root else _Unit(V * H, dense_group, 4)
    return _Units(layers, root, embed, V * H)


def _fsdp_moments(
    cfg: ModelConfig,
    par: ParallelConfig,
    units: _Units,
    acts: _LayerActivations,
    recompute: str,
    precision: str,
    kernel: str,
    ssmb: bool,
) -> list[tuple[str, dict[str, float]]]:
    """Every moment of one FSDP2 training step that can hold its peak, as (label, bytes by term): the loss, each
    layer's FFN and attention branches in backward order, the end of backward, the optimizer step."""
    H, V, L, moe = cfg.hidden_size, cfg.vocab_size, len(units.layers), cfg.moe
    b, T, tp = activation_bytes(precision), acts.tokens, par.tp
    P = sum(u.shard for u in units.all())
    base = {"params": MASTER_BYTES * P, "optimizer": ADAM_BYTES * P}
    moments: list[tuple[str, dict[str, float]]] = []

    def at(label: str, **terms: float) -> None:
        moments.append((label, base | terms))

    residual = RESIDUAL_BYTES * T * H
    attn_b, moe_b, dense_b = (sum(d.values()) for d in (acts.attention, acts.moe, acts.dense))
    plans = [
        _keeps(recompute, attn_b, moe_b if layer.experts else dense_b, residual, layer.experts is not None)
        for layer in units.layers
    ]
    # a multi-token-prediction module keeps its norms' and projection's activations beside its block's, until its
    # attention branch's backward is done (never recomputed)
    mtp = mtp_activations(T, H, b)
    for i in range(cfg.num_layers, L):
        kept, ffn_regen, ffn_done, attn_regen, attn_done = plans[i]
        plans[i] = (kept + mtp, ffn_regen, ffn_done, attn_regen, attn_done + mtp)
    tail = norm_activations(T, H) + b * T * H  # the final norm, the head's input
    left = sum(plan[0] for plan in plans)
    root, head_grad = units.root.weights, units.root.width * units.head
    # the loss: the log-softmax's backward (bf16 logits, fp32 log-probabilities and both gradients, or all fp32),
    # then the head's weight gradient beside the logits' (with several chunks, added into the earlier chunks')
    chunk = min(T, LOSS_CHUNK_TOKENS)
    more = float(T > chunk)
    # each multi-token-prediction depth's loss holds its own head gradient from forward to the losses' backward
    held = cfg.mtp_depth * more * head_grad
    first = units.layers[-1].block.weights  # the root's backward prefetches the last block
    at(
        "loss backward",
        gathered=root,
        prefetch=first,
        grads=more * head_grad + held,
        activations=left + tail,
        transient=12 * chunk * V,
    )
    at(
        "head gradient",
        gathered=root,
        prefetch=first,
        grads=(1 + more) * head_grad + held,
        activations=left + tail,
        transient=b * chunk * V,
    )
    # expert rows' gradients in the grouped SwiGLU's backward: in and out (N x H each), and of h1 / h3
    rows_grad = b * acts.rows * (2 * H + (moe.ffn_hidden_size if kernel == "torch" else 2 * moe.ffn_hidden_size))
    # the combine's backward: the rows' output gradients, and on the torch path fp32 products (and fp32 copies of
    # them and of the expert outputs when b < 4) for the rows' and the weights' gradients; Triton: two row tensors
    NH = acts.rows * H
    combine_grad = (b + 8 + (8 if b < 4 else 0)) * NH if kernel == "torch" else 2 * b * NH
    reduced, in_flight = 0.0, 0.0
    for i in reversed(range(L)):
        layer, (_, ffn_regen, ffn_done, attn_regen, attn_done) = units.layers[i], plans[i]
        block, experts, router = layer.block, layer.experts, layer.router or _NO_UNIT
        nxt = units.layers[i - 1].block.weights if i else (units.embed.weights if units.embed else 0.0)
        if not experts:  # a dense block: one unit, one stage
            at(
                f"layer {i} block backward",
                gathered=root + block.weights,
                prefetch=nxt,
                grads=head_grad + reduced,
                grads_unit=block.weights,
                reduce_buffer=in_flight,
                activations=left + ffn_regen,
                transient=2 * residual + 2 * b * T * cfg.ffn_hidden_size / tp,
            )
            reduced, in_flight, left = reduced + block.reduced, block.reduce_input, left - ffn_done - attn_done
            continue
        # the MoE branch's backward: the combine's first (the experts' all-gather prefetched; the shared experts'
        # gradients made), which frees its buffer; then w2's gradient, then w1's and w3's, by which time the torch
        # path's separate ops have freed the hidden tensors (one Triton op keeps them to its end); SSMB averages each
        # weight's gradient over tp into a new tensor, one weight at a time
        moe_side = block.width * layer.moe_side
        at(
            f"layer {i} MoE backward",
            gathered=root + block.weights,
            prefetch=experts.weights + router.weights,
            grads=head_grad + reduced,
            reduce_buffer=in_flight,
            activations=left + ffn_regen,
            grads_unit=moe_side,
            transient=residual + combine_grad,
        )
        average = experts.weights / 3 if ssmb and tp > 1 else 0.0
        live = left + ffn_regen - acts.moe.get("combine_buffer", 0.0)
        hidden = acts.moe.get("expert_hidden", 0.0) if kernel == "torch" else 0.0
        for grads_made, freed in ((experts.weights / 3, 0.0), (experts.weights, hidden)):
            at(
                f"layer {i} MoE backward",
                gathered=root + block.weights,
                gathered_own=experts.weights + router.weights,
                prefetch=nxt,
                grads=head_grad + reduced,
                reduce_buffer=in_flight,
                activations=live - freed,
                grads_unit=grads_made + router.weights + moe_side,
                transient=residual + rows_grad + average,
            )
        reduced += experts.reduced + router.reduced
        in_flight = (router if layer.router else experts).reduce_input
        left -= ffn_done
        at(
            f"layer {i} attention backward",
            gathered=root + block.weights,
            prefetch=nxt,
            grads=head_grad + reduced,
            grads_unit=block.weights,
            reduce_buffer=in_flight,
            activations=left + attn_regen,
            transient=2 * residual + 4 * b * T * H / tp,
        )
        reduced, in_flight, left = reduced + block.reduced, block.reduce_input, left - attn_done
    root_grads = head_grad if units.embed else units.root.weights  # the embedding's own, on CPUs or when tied
    embed = units.embed or _NO_UNIT
    # the embedding's gradient, then (in the final callback) the root's reduce-scatter: its gathered weights are
    # freed first and the buffer in flight released, the gradients copied into an fp32 input; then the embedding's
    at(
        "embedding backward",
        gathered=root,
        gathered_own=embed.weights,
        grads=root_grads + reduced,
        grads_unit=embed.weights,
        reduce_buffer=in_flight,
    )
    at(
        "root reduce-scatter",
        gathered_own=embed.weights,
        grads=root_grads + reduced,
        grads_unit=embed.weights,
        reduce_buffer=units.root.reduce_input,
    )
    if units.embed:
        at(
            "embedding reduce-scatter",
            grads=reduced + units.root.reduced,
            grads_unit=embed.weights,
            reduce_buffer=embed.reduce_input,
        )
    at("optimizer step", grads=GRAD_BYTES * P, adam_step=_adam_step(cfg, par, precision, sharded=True))
    return moments
