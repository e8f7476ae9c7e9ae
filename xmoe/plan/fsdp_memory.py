"""The FSDP2 layout's memory (ep or tp > 1): the units one rank holds, and every moment of a training step that can
hold its peak, as bytes by term. Letters and conventions: ``memory.py``'s docstring ("Layout", "The peak").
"""

from __future__ import annotations

from dataclasses import dataclass

from xmoe.config import ModelConfig, ParallelConfig
from xmoe.model.counting import block_kinds, count_params
from xmoe.plan.rank_run import RankRun
from xmoe.plan.terms import (
    ADAM_BYTES,
    GRAD_BYTES,
    LOSS_CHUNK_TOKENS,
    MASTER_BYTES,
    RESIDUAL_BYTES,
    _adam_step,
    _keeps,
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


class _BackwardWalk:
    """One FSDP2 step walked backward, moment by moment: what stays gathered, prefetched, reduced and in flight, and
    the activations still held (``left``), as the backward frees them layer by layer."""

    def __init__(self, run: RankRun, units: _Units) -> None:
        cfg, acts, kernel = run.cfg, run.acts, run.kernel
        H, L, moe = cfg.hidden_size, len(units.layers), cfg.moe
        self.run, self.cfg, self.units = run, cfg, units
        self.b, self.T, self.tp = run.b, run.tokens, run.parallel.tp
        self.params = sum(u.shard for u in units.all())
        self.adam_step = _adam_step(cfg, run.parallel, run.precision, sharded=True)  # the optimizer step's transient
        self.base = {"params": MASTER_BYTES * self.params, "optimizer": ADAM_BYTES * self.params}
        self.moments: list[tuple[str, dict[str, float]]] = []
        self.residual = RESIDUAL_BYTES * self.T * H
        attn_b, moe_b, dense_b = (sum(d.values()) for d in (acts.attention, acts.moe, acts.dense))
        self.plans = [
            _keeps(run.recompute, attn_b, moe_b if layer.experts else dense_b, self.residual, layer.experts is not None)
            for layer in units.layers
        ]
        # a multi-token-prediction module keeps its norms' and projection's activations beside its block's, until
        # its attention branch's backward is done (never recomputed)
        mtp = mtp_activations(self.T, H, self.b)
        for i in range(cfg.num_layers, L):
            kept, ffn_regen, ffn_done, attn_regen, attn_done = self.plans[i]
            self.plans[i] = (kept + mtp, ffn_regen, ffn_done, attn_regen, attn_done + mtp)
        self.left = sum(plan[0] for plan in self.plans)
        self.root, self.head_grad = units.root.weights, units.root.width * units.head
        # expert rows' gradients in the grouped SwiGLU's backward: in and out (N x H each), and of h1 / h3
        F = moe.ffn_hidden_size
        self.rows_grad = self.b * acts.rows * (2 * H + (F if kernel == "torch" else 2 * F))
        # the combine's backward: the rows' output gradients, and on the torch path fp32 products (and fp32 copies
        # of them and of the expert outputs when b < 4) for the rows' and the weights' gradients; Triton: two row
        # tensors
        NH = acts.rows * H
        b = self.b
        self.combine_grad = (b + 8 + (8 if b < 4 else 0)) * NH if kernel == "torch" else 2 * b * NH
        self.reduced, self.in_flight = 0.0, 0.0

    def at(self, label: str, **terms: float) -> None:
        self.moments.append((label, self.base | terms))

    def step_moments(self) -> list[tuple[str, dict[str, float]]]:
        """Every moment of one FSDP2 training step that can hold its peak, as (label, bytes by term): the loss, each
        layer's FFN and attention branches in backward order, the end of backward, the optimizer step."""
        self.loss()
        for i in reversed(range(len(self.units.layers))):
            if self.units.layers[i].experts:
                self.moe_layer(i)
            else:
                self.dense_layer(i)
        self.end_of_backward()
        self.at("optimizer step", grads=GRAD_BYTES * self.params, adam_step=self.adam_step)
        return self.moments

    def loss(self) -> None:
        """The loss: the log-softmax's backward (bf16 logits, fp32 log-probabilities and both gradients, or all
        fp32), then the head's weight gradient beside the logits' (with several chunks, added into the earlier
        chunks')."""
        cfg, T, head_grad = self.cfg, self.T, self.head_grad
        tail = norm_activations(T, cfg.hidden_size) + self.b * T * cfg.hidden_size  # the final norm, the head's input
        chunk = min(T, LOSS_CHUNK_TOKENS)
        more = float(T > chunk)
        # each multi-token-prediction depth's loss holds its own head gradient from forward to the losses' backward
        held = cfg.mtp_depth * more * head_grad
        first = self.units.layers[-1].block.weights  # the root's backward prefetches the last block
        V, root, left = cfg.vocab_size, self.root, self.left
        self.at(
            "loss backward",
            gathered=root,
            prefetch=first,
            grads=more * head_grad + held,
            activations=left + tail,
            transient=12 * chunk * V,
        )
        self.at(
            "head gradient",
            gathered=root,
            prefetch=first,
            grads=(1 + more) * head_grad + held,
            activations=left + tail,
            transient=self.b * chunk * V,
        )

    def _next_weights(self, i: int) -> float:
        """What layer i's backward prefetches: the block before it, or the embedding."""
        units = self.units
        return units.layers[i - 1].block.weights if i else (units.embed.weights if units.embed else 0.0)

    def dense_layer(self, i: int) -> None:
        """A dense block: one unit, one stage."""
        block, (_, ffn_regen, ffn_done, _, attn_done) = self.units.layers[i].block, self.plans[i]
        self.at(
            f"layer {i} block backward",
            gathered=self.root + block.weights,
            prefetch=self._next_weights(i),
            grads=self.head_grad + self.reduced,
            grads_unit=block.weights,
            reduce_buffer=self.in_flight,
            activations=self.left + ffn_regen,
            transient=2 * self.residual + 2 * self.b * self.T * self.cfg.ffn_hidden_size / self.tp,
        )
        self.reduced, self.in_flight = self.reduced + block.reduced, block.reduce_input
        self.left = self.left - ffn_done - attn_done

    def moe_layer(self, i: int) -> None:
        """The MoE branch's backward: the combine's first (the experts' all-gather prefetched; the shared experts'
        gradients made), which frees its buffer; then w2's gradient, then w1's and w3's, by which time the torch
        path's separate ops have freed the hidden tensors (one Triton op keeps them to its end); SSMB averages each
        weight's gradient over tp into a new tensor, one weight at a time. Then the attention branch's."""
        layer, (_, ffn_regen, ffn_done, attn_regen, attn_done) = self.units.layers[i], self.plans[i]
        block, experts, router = layer.block, layer.experts, layer.router or _NO_UNIT
        assert experts is not None
        root, nxt, acts = self.root, self._next_weights(i), self.run.acts
        moe_side = block.width * layer.moe_side
        self.at(
            f"layer {i} MoE backward",
            gathered=root + block.weights,
            prefetch=experts.weights + router.weights,
            grads=self.head_grad + self.reduced,
            reduce_buffer=self.in_flight,
            activations=self.left + ffn_regen,
            grads_unit=moe_side,
            transient=self.residual + self.combine_grad,
        )
        average = experts.weights / 3 if self.run.ssmb and self.tp > 1 else 0.0
        live = self.left + ffn_regen - acts.moe.get("combine_buffer", 0.0)
        hidden = acts.moe.get("expert_hidden", 0.0) if self.run.kernel == "torch" else 0.0
        for grads_made, freed in ((experts.weights / 3, 0.0), (experts.weights, hidden)):
            self.at(
                f"layer {i} MoE backward",
                gathered=root + block.weights,
                gathered_own=experts.weights + router.weights,
                prefetch=nxt,
                grads=self.head_grad + self.reduced,
                reduce_buffer=self.in_flight,
                activations=live - freed,
                grads_unit=grads_made + router.weights + moe_side,
                transient=self.residual + self.rows_grad + average,
            )
        self.reduced += experts.reduced + router.reduced
        self.in_flight = (router if layer.router else experts).reduce_input
        self.left -= ffn_done
        self.at(
            f"layer {i} attention backward",
            gathered=root + block.weights,
            prefetch=nxt,
            grads=self.head_grad + self.reduced,
            grads_unit=block.weights,
            reduce_buffer=self.in_flight,
            activations=self.left + attn_regen,
            transient=2 * self.residual + 4 * self.b * self.T * self.cfg.hidden_size / self.tp,
        )
        self.reduced, self.in_flight = self.reduced + block.reduced, block.reduce_input
        self.left = self.left - attn_done

    def end_of_backward(self) -> None:
        """The embedding's gradient, then (in the final callback) the root's reduce-scatter: its gathered weights
        are freed first and the buffer in flight released, the gradients copied into an fp32 input; then the
        embedding's."""
        units, reduced = self.units, self.reduced
        root_grads = self.head_grad if units.embed else units.root.weights  # the embedding's own, CPUs or tied
        embed = units.embed or _NO_UNIT
        self.at(
            "embedding backward",
            gathered=self.root,
            gathered_own=embed.weights,
            grads=root_grads + reduced,
            grads_unit=embed.weights,
            reduce_buffer=self.in_flight,
        )
        self.at(
            "root reduce-scatter",
            gathered_own=embed.weights,
            grads=root_grads + reduced,
            grads_unit=embed.weights,
            reduce_buffer=units.root.reduce_input,
        )
        if units.embed:
            self.at(
                "embedding reduce-scatter",
                grads=reduced + units.root.reduced,
                grads_unit=embed.weights,
                reduce_buffer=embed.reduce_input,
            )
