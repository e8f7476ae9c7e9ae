"""The balance losses and the expert bias count real tokens only, in each scope (xmoe/moe/balance.py): against a
float64 loop over the routing probabilities and counts, masked positions against the same batch without them,
gradient accumulation against one big batch, two gloo ranks against one process with both ranks' tokens.

Only the auxiliary losses reach the router here: the layer's output is multiplied by 0 before backward, so every
router gradient compared is the balance (and z-) loss's, with the scale the optimizer step gives it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_utils import run_distributed

from xmoe.config import MoEConfig
from xmoe.moe.layer import MoELayer
from xmoe.moe.step import MoEStep

CPU = torch.device("cpu")
E, K, H = 8, 2, 16
COEF, Z_COEF = 0.1, 0.01


def make_layer(scope: str, score_func: str = "softmax", **kw) -> MoELayer:
    torch.manual_seed(0)
    cfg = MoEConfig(
        hidden_size=H,
        ffn_hidden_size=8,
        num_experts=E,
        top_k=K,
        score_func=score_func,
        aux_loss_coef=COEF,
        balance_scope=scope,
        kernel_backend="torch",
        **kw,
    )
    layer = MoELayer(cfg)
    with torch.no_grad():  # larger router weights: decisive, tie-free routing
        layer.router.weight.normal_(0, 0.5)
    return layer


def data(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(*shape, H, generator=torch.Generator().manual_seed(seed))


def mask(shape: tuple[int, ...], seed: int, keep: float = 0.7) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) < keep


# ---- the float64 reference: plain loops over tokens and experts -------------------------------------------------


def ref_probs(weight: torch.Tensor, x: torch.Tensor, score_func: str) -> torch.Tensor:
    """(T, E) float64 distributions the balance loss averages, differentiable in ``weight`` (float64)."""
    logits = x.reshape(-1, H).double() @ weight.T
    if score_func == "softmax":
        return torch.softmax(logits, -1)
    s = torch.sigmoid(logits)
    return s / s.sum(-1, keepdim=True)


def routed_ids(layer: MoELayer, x: torch.Tensor) -> list[list[int]]:
    """Each token's K experts, as the router picks them (the routing decisions the losses count)."""
    with torch.no_grad():
        return layer.router(x.reshape(-1, H)).expert_ids_TK.tolist()


def ref_group_loss(p, ids, valid, groups: list[list[int]]):
    """coef * mean over groups with real tokens of sum_e E/(K n) count_e * mean_t p_te, by loops."""
    total, used = 0.0, 0
    for group in groups:
        real = [t for t in group if valid[t]]
        if not real:
            continue
        for e in range(E):
            count = sum(1 for t in real for k in range(K) if ids[t][k] == e)
            total = total + E / (K * len(real)) * count * sum(p[t, e] for t in real) / len(real)
        used += 1
    return COEF * total / max(used, 1)


def ref_global_losses(micro):
    """The global scope's loss of each micro-batch a: ``micro[a]`` lists each rank's (p, ids, valid); frequencies from
    every rank's real tokens of micro-batches 1..a, mean probabilities over micro-batch a's real tokens."""
    counts, real = [0] * E, 0
    losses = []
    for ranks in micro:
        for _, ids, valid in ranks:
            for t, v in enumerate(valid):
                if v:
                    real += 1
                    for e in ids[t]:
                        counts[e] += 1
        tokens = [(p[t], True) for p, _, valid in ranks for t in range(len(valid)) if valid[t]]
        loss = 0.0
        for e in range(E):
            mean_p = sum(pt[e] for pt, _ in tokens) / len(tokens)
            loss = loss + E / K * counts[e] / real * mean_p
        losses.append(COEF * loss)
    return losses


def step_grad(layer: MoELayer, xs, masks, **step_kw):
    """One optimizer step of len(xs) micro-batches through the seam: (mean aux loss, router gradient, the step)."""
    layer.router.weight.grad = None
    step = MoEStep(layer, len(xs), CPU, **step_kw)
    with step:
        for x, m in zip(xs, masks, strict=True):
            step.set_real_tokens(m)
            (layer(x) * 0).sum().backward()
            step.end_micro_batch()
    stats = step.finish()
    return stats.aux, layer.router.weight.grad.clone(), stats


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("scope", ["sequence", "micro_batch", "global"])
def test_each_scope_matches_a_float64_loop(scope, score_func):
    layer = make_layer(scope, score_func)
    shape = (3, 8)
    xs = [data(shape, 1), data(shape, 2)]
    masks = [mask(shape, 3), mask(shape, 4)]
    masks[1][2] = False  # a sequence with no real token: it takes no part
    aux, grad, _ = step_grad(layer, xs, masks)

    weight = layer.router.weight.detach().double().requires_grad_(True)
    probs = [ref_probs(weight, x, score_func) for x in xs]
    ids = [routed_ids(layer, x) for x in xs]
    valid = [m.reshape(-1).tolist() for m in masks]
    if scope == "global":
        losses = ref_global_losses([[(p, i, v)] for p, i, v in zip(probs, ids, valid, strict=True)])
    else:
        seq_len = shape[1]
        groups = [list(range(b * seq_len, (b + 1) * seq_len)) for b in range(shape[0])]
        if scope == "micro_batch":
            groups = [list(range(shape[0] * seq_len))]
        losses = [ref_group_loss(p, i, v, groups) for p, i, v in zip(probs, ids, valid, strict=True)]
    objective = sum(losses) / len(losses)  # each micro-batch's loss gets 1 / A, as the LM loss
    objective.backward()
    assert aux.item() == pytest.approx(objective.item(), rel=1e-5)
    assert rel_err(grad, weight.grad) < 1e-5


@pytest.mark.parametrize("scope", ["sequence", "micro_batch", "global"])
def test_masked_positions_count_as_if_removed(scope):
    layer = make_layer(scope)
    x, m = data((3, 8), 5), mask((3, 8), 6)
    aux, grad, stats = step_grad(layer, [x], [m])

    # the same tokens without the masked ones, outside a step (every token real, gradient 1): each sequence alone
    # for "sequence" (a 2-D input is one sequence; the loss is the mean over them), the batch as one input otherwise
    pieces = [x[b][m[b]] for b in range(3)] if scope == "sequence" else [x[m]]
    layer.router.weight.grad = None
    want_aux, want_load = torch.zeros(()), torch.zeros(E, dtype=torch.long)
    for piece in pieces:
        (layer(piece) * 0).sum().backward()
        want_aux += layer.last_stats["aux_loss"] / len(pieces)
        want_load += layer.last_stats["tokens_per_expert"]
    assert aux.item() == pytest.approx(want_aux.item(), rel=1e-6)
    assert rel_err(grad, layer.router.weight.grad / len(pieces)) < 1e-6
    assert torch.equal(stats.load_LE[0], want_load)  # the loads count the real tokens only
    assert stats.rows == m.numel() * K  # while the experts computed every token's rows


def test_z_loss_counts_real_tokens_only():
    layer = make_layer("micro_batch", z_loss_coef=Z_COEF)
    layer.cfg.aux_loss_coef = 0.0
    x, m = data((3, 8), 7), mask((3, 8), 8)
    aux, grad, _ = step_grad(layer, [x], [m])
    layer.router.weight.grad = None
    (layer(x[m]) * 0).sum().backward()
    assert aux.item() == pytest.approx(layer.last_stats["z_loss"].item(), rel=1e-6)
    assert rel_err(grad, layer.router.weight.grad) < 1e-6


@pytest.mark.parametrize("scope", ["sequence", "global"])
def test_accumulation_equals_one_big_batch_where_the_scope_says(scope):
    """Scope "sequence": A micro-batches are the big batch's sequences, whatever they hold. Scope "global": exact
    whenever the micro-batches route alike, as A copies of one micro-batch (the step's frequencies never change)."""
    layer = make_layer(scope)
    if scope == "sequence":
        xs, masks = [data((2, 8), 10 + a) for a in range(3)], [mask((2, 8), 20 + a) for a in range(3)]
    else:
        xs, masks = [data((2, 8), 10)] * 3, [mask((2, 8), 20)] * 3
    aux, grad, _ = step_grad(layer, xs, masks)
    big_aux, big_grad, _ = step_grad(layer, [torch.cat(xs)], [torch.cat(masks)])
    assert aux.item() == pytest.approx(big_aux.item(), rel=1e-6)
    assert rel_err(grad, big_grad) < 1e-6


def test_micro_batch_scope_accumulates_each_micro_batch_alone():
    layer = make_layer("micro_batch")
    xs, masks = [data((2, 8), 30 + a) for a in range(3)], [mask((2, 8), 40 + a) for a in range(3)]
    aux, grad, _ = step_grad(layer, xs, masks)
    alone = [step_grad(layer, [x], [m]) for x, m in zip(xs, masks, strict=True)]
    assert aux.item() == pytest.approx(sum(a.item() for a, _, _ in alone) / 3, rel=1e-6)
    assert rel_err(grad, sum(g for _, g, _ in alone) / 3) < 1e-6
    big_aux, _, _ = step_grad(layer, [torch.cat(xs)], [torch.cat(masks)])
    assert abs(aux.item() - big_aux.item()) > 1e-4 * big_aux.item()  # not the big batch's: the scope is each one


def test_expert_bias_moves_by_the_real_tokens_counts():
    layer = make_layer("global", bias_update_rate=0.01)
    x, m = data((2, 12), 50), mask((2, 12), 51, keep=0.5)
    valid = m.reshape(-1).tolist()

    def loads(ids, only_real):
        return torch.tensor(
            [sum(1 for t in range(len(ids)) if valid[t] or not only_real for e in ids[t] if e == j) for j in range(E)]
        ).float()

    cold = int(loads(routed_ids(layer, x), True).argmin())
    with torch.no_grad():  # all the padding goes to the least loaded expert: counted, it would be the most loaded
        x[~m] = 4 * layer.router.weight[cold]
    ids = routed_ids(layer, x)
    real, every = loads(ids, True), loads(ids, False)
    assert real[cold] < real.mean() and every[cold] > every.mean()  # the mask decides which way it moves
    step_grad(layer, [x], [m])
    assert torch.equal(layer.router.expert_bias, 0.01 * torch.sign(real.mean() - real))


def test_the_training_step_counts_positions_with_a_target():
    from xmoe.config import ModelConfig
    from xmoe.model.loss import IGNORE_INDEX
    from xmoe.model.transformer import Transformer
    from xmoe.train.step import forward_backward

    moe = MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=E, top_k=K, aux_loss_coef=COEF)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, moe=moe, max_seq_len=16))
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        tokens = torch.randint(0, 50, (2, 13), generator=gen)
        targets = tokens[:, 1:].clone()
        targets[0, 7:] = IGNORE_INDEX  # a padded tail
        batches.append((tokens[:, :-1], targets))
    _, step = forward_backward(model, model, iter(batches), 2, CPU, autocast=False)
    stats = step.finish()
    real = sum(int((t != IGNORE_INDEX).sum()) for _, t in batches)
    assert stats.load_LE.sum(1).tolist() == [K * real] * 2  # each of the 2 MoE layers: the real tokens' slots
    assert stats.rows == 2 * K * 2 * 2 * 12


# ---- two gloo ranks against one process with both ranks' tokens ------------------------------------------------


def _rank_data(rank: int):
    """Two micro-batches per rank; rank 1 holds fewer real tokens than rank 0."""
    xs = [data((2, 6), 100 + 10 * rank + a) for a in range(2)]
    masks = [mask((2, 6), 200 + 10 * rank + a, keep=0.8 if rank == 0 else 0.4) for a in range(2)]
    return xs, masks


def _two_ranks(rank: int, world: int, want_aux: float, want_grad: torch.Tensor, want_bias: torch.Tensor) -> None:
    import torch.distributed as dist

    layer = make_layer("global", bias_update_rate=0.01, z_loss_coef=Z_COEF)
    xs, masks = _rank_data(rank)
    aux, grad, _ = step_grad(layer, xs, masks)
    dist.all_reduce(grad)  # data parallelism's average of the gradients
    dist.all_reduce(aux)
    assert (aux / world).item() == pytest.approx(want_aux, rel=1e-6)
    assert rel_err(grad / world, want_grad) < 1e-6
    assert torch.equal(layer.router.expert_bias, want_bias)  # moved by every rank's real tokens, identically


def test_global_scope_over_two_gloo_ranks_equals_one_process():
    layer = make_layer("global", bias_update_rate=0.01, z_loss_coef=Z_COEF)
    per_rank = [_rank_data(r) for r in range(2)]
    # one process: micro-batch a holds both ranks' micro-batch a, as one (T, H) input
    xs = [torch.cat([per_rank[r][0][a].reshape(-1, H) for r in range(2)]) for a in range(2)]
    masks = [torch.cat([per_rank[r][1][a].reshape(-1) for r in range(2)]) for a in range(2)]
    aux, grad, _ = step_grad(layer, xs, masks)
    run_distributed(_two_ranks, 2, aux.item(), grad, layer.router.expert_bias.clone())


# ---- the scope's name in configs -----------------------------------------------------------------------------


def test_older_configs_name_the_scope_by_its_new_name(tmp_path, capsys):
    from xmoe.cli import main
    from xmoe.config import ModelConfig, RunConfig
    from xmoe.infer import model_config_from_dict
    from xmoe.train.resume import resume_mismatches

    with pytest.raises(ValueError, match="balance_scope"):
        MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=E, top_k=K, balance_scope="batch")
    with pytest.raises(SystemExit):
        main(["train", "--out", str(tmp_path / "r"), "--set", "moe.aux_loss_type=seq", "--dry-run"])
    assert "moe.aux_loss_type is now called moe.balance_scope" in capsys.readouterr().err
    # what a checkpoint written before stores: aux_loss_type "seq" / "batch"
    moe = MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=E, top_k=K, balance_scope="sequence")
    model = ModelConfig(vocab_size=32, hidden_size=H, num_layers=2, num_heads=2, moe=moe)
    saved = dataclasses.asdict(model)
    saved["moe"] = {**{k: v for k, v in saved["moe"].items() if k != "balance_scope"}, "aux_loss_type": "seq"}
    assert model_config_from_dict(saved) == model
    run = RunConfig(model=dataclasses.replace(model, moe=dataclasses.replace(moe, balance_scope="global")))
    saved["moe"]["aux_loss_type"] = "batch"
    assert resume_mismatches({"model": saved}, run, {}) == [
        "model.moe.balance_scope: checkpoint 'micro_batch', now 'global'"
    ]


def test_a_multi_token_prediction_block_counts_positions_with_a_target_at_its_depth():
    from xmoe.config import ModelConfig
    from xmoe.model.loss import IGNORE_INDEX
    from xmoe.model.transformer import Transformer
    from xmoe.train.step import forward_backward

    moe = MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=E, top_k=K, aux_loss_coef=COEF)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, hidden_size=32, num_layers=1, num_heads=4, moe=moe, max_seq_len=16, mtp_depth=2)
    model = Transformer(cfg)
    tokens = torch.randint(0, 50, (2, 13), generator=torch.Generator().manual_seed(0))
    targets = tokens[:, 1:].clone()
    targets[0, 7:] = IGNORE_INDEX  # a padded tail
    targets[1, 2] = IGNORE_INDEX  # and one ignored target inside a row
    _, step = forward_backward(model, model, iter([(tokens[:, :-1], targets)]), 1, CPU, autocast=False)
    stats = step.finish()
    B, S = targets.shape

    def with_target(d: int) -> int:  # positions i whose target d ahead exists and counts (a plain loop)
        return sum(1 for b in range(B) for i in range(S - d) if targets[b, i + d] != IGNORE_INDEX)

    # the main layer, then the MTP blocks of depth 1 and 2: each its own positions' slots
    assert stats.load_LE.sum(1).tolist() == [K * with_target(0), K * with_target(1), K * with_target(2)]
    assert with_target(1) < with_target(0)
