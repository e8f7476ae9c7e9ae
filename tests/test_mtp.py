"""Multi-token prediction (xmoe/model/mtp.py): the loss and every gradient against a float64 reference written as a
plain loop from the DeepSeek-V3 description (depths 1 and 2, ignored targets, documents), depth 0 as before, the
parameter / FLOP / memory counts by hand, tensor parallelism on gloo, and generation without the modules. The Hugging
Face side (export, import, transformers' own MTP layer) is in test_mtp_hf.py.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from dist_utils import run_distributed

from xmoe.config import ModelConfig, MoEConfig
from xmoe.model.loss import IGNORE_INDEX
from xmoe.model.transformer import Transformer

H, VOCAB, S = 32, 37, 15
WEIGHT = 0.3


def _cfg(depth: int, **kw) -> ModelConfig:
    moe = MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=4, top_k=2, num_shared_experts=1)
    kw = dict(mtp_depth=depth, mtp_loss_weight=WEIGHT) | kw
    return ModelConfig(
        vocab_size=VOCAB, hidden_size=H, num_layers=2, num_heads=4, num_kv_heads=2, first_k_dense=1,
        ffn_hidden_size=24, max_seq_len=24, moe=moe, **kw,
    )  # fmt: skip


def _model(depth: int, seed: int = 0, **kw) -> Transformer:
    model = Transformer(_cfg(depth, **kw), loss_chunk_tokens=0)
    model.init_weights(seed=seed)  # keyed by parameter name: the main model's values do not depend on depth
    return model


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _row_sums(ref: Transformer, tokens_S: torch.Tensor, targets_S: torch.Tensor):
    """One document as a row of its own, float64, loops over positions: (main CE sum, count), and per depth d the
    (CE sum, count) of predicting t_{i+d+1} from the module's hidden state at i, over positions i + d < n.

    h^0 = final_norm(blocks(Emb(t))); h^d_i = norm_d(Block_d(eh_proj([enorm(Emb(t_{i+d})); hnorm(h^{d-1}_i)])))
    for i < n - d (the block runs over those positions only, causal); P^d_i = softmax(head(h^d_i))."""
    n = tokens_S.shape[0]
    cos, sin = ref.rope_cos, ref.rope_sin
    embedded = ref.embed(tokens_S[None])
    h = embedded
    for block in ref.layers:
        h = block(h, cos[:n], sin[:n])
    h = ref.norm(h)[0]

    def ce_sums(h_NH, targets_N):
        total, count = torch.zeros((), dtype=torch.float64), 0
        for i in range(h_NH.shape[0]):
            if targets_N[i] != IGNORE_INDEX:
                total = total - torch.log_softmax(ref.head(h_NH[i]), -1)[targets_N[i]]
                count += 1
        return total, count

    sums = [ce_sums(h, targets_S)]
    for d, module in enumerate(ref.mtp, 1):
        m = n - d  # positions with a token d ahead
        if m <= 0:
            sums.append((torch.zeros((), dtype=torch.float64), 0))
            continue
        rows = []
        for i in range(m):
            e = module.enorm(embedded[0, i + d])
            rows.append(module.eh_proj(torch.cat((e, module.hnorm(h[i])))))
        x = torch.stack(rows)[None]
        h = module.norm(module.block(x, cos[:m], sin[:m]))[0]
        sums.append(ce_sums(h, targets_S[d : d + m]))
    return sums


def _reference(ref: Transformer, tokens, targets, lengths):
    """(main loss, mean over depths of L_d, objective main + w / D * sum_d L_d), float64, documents run alone."""
    per_depth = None
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            sums = _row_sums(ref, tokens[b, start : start + n], targets[b, start : start + n])
            per_depth = (
                sums if per_depth is None else [(a + s, c + k) for (a, c), (s, k) in zip(per_depth, sums, strict=True)]
            )
            start += n
    losses = [total / max(count, 1) for total, count in per_depth]
    main, depths = losses[0], losses[1:]
    mean = sum(depths) / len(depths)
    return main, mean, main + WEIGHT * mean


@pytest.mark.parametrize(
    "depth, documents",
    [(1, None), (2, None), (2, [[6, 1, 8], [15], [2, 13]])],
    ids=["depth1", "depth2", "depth2_documents"],
)
def test_loss_and_gradients_equal_a_float64_loop(depth: int, documents) -> None:
    model = _model(depth)
    ref = copy.deepcopy(model).double()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (3, S), generator=gen)
    targets = torch.randint(0, VOCAB, (3, S), generator=gen)
    targets[0, 4] = targets[1, 13] = targets[2, 0] = IGNORE_INDEX  # ignored targets stay ignored at every depth
    lengths = documents or [[S]] * 3
    segments = None
    if documents:
        segments = torch.stack(
            [torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(row)]) for row in documents]
        )

    loss = model(tokens, targets, segments_BS=segments)
    loss.backward()
    want_main, want_mean, want_objective = _reference(ref, tokens, targets, lengths)
    want_objective.backward()

    assert _rel(loss.detach(), want_main) < 1e-6  # the value is the next-token loss
    got_mean = model.take_mtp_loss()
    assert got_mean is not None and _rel(got_mean, want_mean) < 1e-6
    assert model.take_mtp_loss() is None  # taken
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():  # the gradient is the objective's, MTP modules and main model alike
        assert _rel(p.grad, want[name].grad) < 1e-5, name
    assert model.mtp[0].eh_proj.weight.grad.norm() > 0


def test_each_depths_moe_layer_counts_the_positions_with_a_target_at_its_depth() -> None:
    """The training step marks each MTP block's real tokens by the model's own depth targets: position i counts at
    depth d when i + d < S, target i + d is not ignored and input i + d is in i's document (a loop here); the loads
    of one step, per MoE layer, are K slots per real token."""
    from xmoe.train.loader import Batch
    from xmoe.train.step import forward_backward

    depth, documents = 2, [[6, 1, 8], [15], [2, 13]]
    model = _model(depth)
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (3, S), generator=gen)
    targets = torch.randint(0, VOCAB, (3, S), generator=gen)
    targets[0, 4] = targets[1, 13] = targets[2, 0] = IGNORE_INDEX
    segments = torch.stack(
        [torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(row)]) for row in documents]
    )
    want = [[[targets[b, i].item() != IGNORE_INDEX for i in range(S)] for b in range(3)]]
    for d in range(1, depth + 1):
        want.append(
            [
                [
                    i + d < S and targets[b, i + d] != IGNORE_INDEX and segments[b, i + d] == segments[b, i]
                    for i in range(S)
                ]
                for b in range(3)
            ]
        )
    valid, ahead = model.real_tokens(targets, segments)
    assert ahead is not None and sorted(ahead) == [1, 2]
    for got, mask in zip([valid, ahead[1], ahead[2]], want, strict=True):
        assert got.tolist() == mask
    assert _model(0).real_tokens(targets)[1] is None

    _, moe = forward_backward(model, model, iter([Batch(tokens, targets, segments)]), 1, torch.device("cpu"), False)
    stats = moe.finish()
    K = model.cfg.moe.top_k
    assert stats.load_LE is not None
    # the main model's one MoE layer, then one per depth
    assert stats.load_LE.sum(dim=1).tolist() == [K * sum(map(sum, mask)) for mask in want]


def test_depth_zero_is_the_model_without_prediction_modules() -> None:
    plain, with_mtp = _model(0), _model(1, mtp_loss_weight=0.0)
    assert not [n for n, _ in plain.named_parameters() if "mtp" in n]
    names = [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in with_mtp.named_parameters()][: len(names)] == names  # the modules come last
    tokens = torch.randint(0, VOCAB, (2, S + 1), generator=torch.Generator().manual_seed(2))
    a, b = plain(tokens[:, :-1], tokens[:, 1:]), with_mtp(tokens[:, :-1], tokens[:, 1:])
    assert torch.equal(a, b)
    a.backward()
    b.backward()  # weight 0: the modules add nothing to the main model's gradients
    for (name, p), q in zip(plain.named_parameters(), with_mtp.parameters(), strict=False):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-9), name
    assert plain.take_mtp_loss() is None and with_mtp.take_mtp_loss() is not None


def test_evaluation_and_generation_run_no_prediction_module() -> None:
    from xmoe.model.generate import generate

    plain, with_mtp = _model(0).eval(), _model(2).eval()
    tokens = torch.randint(0, VOCAB, (2, S + 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(plain(tokens[:, :-1], tokens[:, 1:]), with_mtp(tokens[:, :-1], tokens[:, 1:]))
    assert with_mtp.take_mtp_loss() is None
    prompt = tokens[:, :4]
    assert torch.equal(generate(plain, prompt, 6), generate(with_mtp, prompt, 6))


def test_parameters_flops_and_planned_memory_count_the_modules_by_hand() -> None:
    from xmoe.model.counting import count_params, flops_per_token
    from xmoe.model.flops import FlopDims, forward_macs
    from xmoe.plan.trainer_memory import estimate_trainer_memory

    E, F_e, K, F_s, V, G, D_h = 4, 16, 2, 16, VOCAB, 2, H // 4
    attention = H * D_h * (2 * 4 + 2 * G)  # wq, wo (4 heads) and wk, wv (2 kv heads) of width 8
    moe_block = E * H + E * 3 * H * F_e + 3 * H * F_s  # router, routed and shared experts
    module = 2 * H * H + 3 * H + attention + 2 * H + moe_block  # eh_proj, 3 norms, the block (2 norms)
    for depth in (1, 2):
        cfg = _cfg(depth)
        assert count_params(cfg).total == count_params(_cfg(0)).total + depth * module
        assert count_params(cfg).total == Transformer(cfg).num_params()
        active = count_params(cfg).active - count_params(_cfg(0)).active
        assert active == depth * (module - (E - K) * 3 * H * F_e)
        # FLOPs per token at seq s: each module's block (a causal attention of s(s+1)/2 pairs), projection and head
        s = 10
        extra = forward_macs(FlopDims.from_model_config(cfg, s), 1)
        base = forward_macs(FlopDims.from_model_config(_cfg(0), s), 1)
        macs = sum(extra.values()) - sum(base.values())
        per_module = s * (2 * H * H + attention + E * H + K * 3 * H * F_e + 3 * H * F_s + V * H)
        per_module += 4 * (D_h + D_h) * s * (s + 1) // 2
        assert macs == depth * per_module
        fwd = flops_per_token(cfg, s).forward - flops_per_token(_cfg(0), s).forward
        assert fwd == pytest.approx(2 * depth * per_module / s, rel=1e-12)
        # the one-GPU plan holds the modules' states (fp32 weights, AdamW moments, the experts' bf16 copies)
        plan, bare = (estimate_trainer_memory(c, micro_batch=2, seq_len=s) for c in (cfg, _cfg(0)))
        assert plan.states - bare.states == 12 * depth * module + 2 * depth * E * 3 * H * F_e
        assert plan.total > bare.total + plan.states - bare.states


def test_fsdp_units_hold_each_module_once() -> None:
    from xmoe.config import ParallelConfig
    from xmoe.model.counting import count_params
    from xmoe.plan.fsdp_memory import _fsdp_units

    par = ParallelConfig(dp=1, ep=1, tp=1)
    for depth in (0, 2):
        units = _fsdp_units(_cfg(depth), par, "bf16")
        assert sum(u.numel for u in units.all()) == count_params(_cfg(depth)).total
        assert len(units.layers) == 2 + depth


@pytest.mark.parametrize(
    "kw, match",
    [(dict(mtp_depth=-1), "mtp_depth"), (dict(mtp_loss_weight=float("nan")), "mtp_loss_weight")],
)
def test_bad_mtp_settings_are_refused(kw: dict, match: str) -> None:
    cfg = _cfg(1)
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(cfg, **kw)


def _tp_body(rank: int, world_size: int) -> None:
    from xmoe.config import ParallelConfig
    from xmoe.parallel.dims import ParallelDims
    from xmoe.parallel.ssmb import apply_ssmb
    from xmoe.parallel.tensor import apply_tensor_parallel

    tokens = torch.randint(0, VOCAB, (2, S + 1), generator=torch.Generator().manual_seed(4))
    ref = _model(2)
    ref(tokens[:, :-1], tokens[:, 1:]).backward()
    dims = ParallelDims.from_config(ParallelConfig(tp=world_size), world_size).build_mesh("cpu")
    with pytest.raises(ValueError, match="sequence parallelism does not run multi-token prediction"):
        apply_tensor_parallel(_model(2), dims, sequence_parallel=True)
    model = apply_tensor_parallel(_model(2), dims)
    apply_ssmb(model, dims)
    assert model.mtp[1].block.attn.wq.weight.to_local().shape[0] == 32 // world_size  # heads split
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert _rel(model.take_mtp_loss(), ref.take_mtp_loss()) < 1e-6
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        assert _rel(grad, ref_grads[name]) < 1e-5, (rank, name)


def test_prediction_modules_under_tensor_parallelism_equal_one_process() -> None:
    run_distributed(_tp_body, 2)


def _loss_and_grads(model: Transformer, tokens: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach(), model.take_mtp_loss(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_recompute_and_compiled_regions_cover_the_prediction_blocks() -> None:
    from xmoe.parallel import regions

    torch._dynamo.reset()
    tokens = torch.randint(0, VOCAB, (2, S + 1), generator=torch.Generator().manual_seed(5))
    model = _model(2)
    want_loss, want_mtp, want = _loss_and_grads(model, tokens)
    assert len(regions.blocks(model)) == 4  # two layers, two prediction blocks
    regions.apply_recompute(model, "full")
    for block in regions.blocks(model):
        # the attention branches only: the CPU experts' loop is sized on the host, so the MoE branch compiles in
        # many parts there (slow; test_regions.py compiles it on the Triton path)
        block.attn_branch = torch.compile(block.attn_branch, fullgraph=True, backend="aot_eager")
    got_loss, got_mtp, got = _loss_and_grads(model, tokens)
    assert _rel(got_loss, want_loss) < 1e-6 and _rel(got_mtp, want_mtp) < 1e-6
    for name in want:
        assert _rel(got[name], want[name]) < 1e-5, name


def _ep_body(rank: int, world_size: int) -> None:
    from xmoe.config import ParallelConfig
    from xmoe.parallel.build import build_model
    from xmoe.parallel.dims import ParallelDims

    cfg = dataclasses.replace(_cfg(1), moe=dataclasses.replace(_cfg(1).moe, kernel_backend="torch"))
    tokens = torch.randint(0, VOCAB, (2, S + 1), generator=torch.Generator().manual_seed(6))
    ref = build_model(cfg, "cpu", seed=3, loss_chunk_tokens=0).model
    want_loss, want_mtp, want = _loss_and_grads(ref, tokens)
    dims = ParallelDims.from_config(ParallelConfig(dp=1, ep=world_size), world_size, rank=rank).build_mesh("cpu")
    built = build_model(cfg, "cpu", dims, seed=3, loss_chunk_tokens=0)  # experts over "ep", FSDP2 units
    loss = built.wrapped(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert _rel(loss.detach(), want_loss) < 1e-6 and _rel(built.model.take_mtp_loss(), want_mtp) < 1e-6
    for name, p in built.model.named_parameters():
        assert _rel(p.grad.full_tensor(), want[name]) < 1e-5, (rank, name)


def test_prediction_modules_under_expert_parallelism_and_fsdp_equal_one_process() -> None:
    run_distributed(_ep_body, 2)


def test_plan_memory_takes_the_depth() -> None:
    import argparse

    from xmoe.plan.cli import model_config

    args = argparse.Namespace(preset="tiny", layers=2, mtp_depth=2)
    assert (model_config(args).mtp_depth, model_config(args).num_layers) == (2, 2)
