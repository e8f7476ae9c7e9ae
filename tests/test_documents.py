"""Document-masked attention (xmoe/model/documents.py, ``Transformer.forward(segments_BS=...)``).

The reference runs each document alone, as a row of its own, through a float64 copy of the model: a row of several
documents must give the same logits, loss and gradients (every attention variant; rotary positions restart at each
document, which the reference gets by starting every document at position 0). The FlexAttention block mask GPUs take
is checked against FlexAttention's own ``create_block_mask`` and its attention against the dense mask; TP (with SSMB,
and with sequence parallelism) on 2 gloo ranks, recompute and compiled regions against one eager process.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed

from xmoe.config import ModelConfig, MoEConfig
from xmoe.model.attention import KVCache
from xmoe.model.documents import (
    Documents,
    document_attention,
    document_block_mask,
    document_mask_mod,
    document_visible,
    rotary_positions,
)
from xmoe.model.transformer import Transformer
from xmoe.parallel import regions

H, VOCAB = 32, 37
VARIANTS = {
    "mha": dict(num_heads=4),
    "gqa": dict(num_heads=4, num_kv_heads=2),
    "qk_norm_head": dict(num_heads=4, num_kv_heads=2, attn_head_dim=16, qk_norm="head"),
    "qk_norm_proj": dict(num_heads=4, num_kv_heads=2, qk_norm="proj"),
    "mla": dict(
        num_heads=4, attention="mla", q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4,
        v_head_dim=5,
    ),
}  # fmt: skip
# three rows of 17 positions: documents of 5, 1 and 11; one document; 8 and 9
DOC_LENGTHS = [[5, 1, 11], [17], [8, 9]]


def _cfg(variant: str = "gqa", **kw) -> ModelConfig:
    moe = MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=4, top_k=2, num_shared_experts=1)
    return ModelConfig(
        vocab_size=VOCAB, hidden_size=H, num_layers=2, first_k_dense=1, ffn_hidden_size=24, max_seq_len=24, moe=moe,
        **VARIANTS[variant], **kw,
    )  # fmt: skip


def _segments(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack(
        [torch.cat([torch.full((n,), d, dtype=torch.int32) for d, n in enumerate(row)]) for row in lengths]
    )


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _per_document_reference(ref: Transformer, tokens, targets, lengths):
    """Float64: each document through ``ref`` as a row of its own; (logits (B, S, V), summed cross-entropy)."""
    rows, loss = [], torch.zeros((), dtype=torch.float64)
    for b, row in enumerate(lengths):
        start, pieces = 0, []
        for n in row:
            logits = ref(tokens[b : b + 1, start : start + n])[0]
            loss = loss + F.cross_entropy(logits, targets[b, start : start + n], reduction="sum")
            pieces.append(logits)
            start += n
        rows.append(torch.cat(pieces))
    return torch.stack(rows), loss


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_row_of_documents_equals_each_document_alone(variant: str) -> None:
    torch.manual_seed(0)
    model = Transformer(_cfg(variant), loss_chunk_tokens=0)
    ref = copy.deepcopy(model).double()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (3, 17), generator=gen)
    targets = torch.randint(0, VOCAB, (3, 17), generator=gen)
    segments = _segments(DOC_LENGTHS)

    logits = model(tokens, segments_BS=segments)
    loss = model(tokens, targets, segments_BS=segments)
    (loss * targets.numel()).backward()  # the summed cross-entropy, as the reference sums it
    want_logits, want_loss = _per_document_reference(ref, tokens, targets, DOC_LENGTHS)
    want_loss.backward()

    assert _rel(logits, want_logits) < 1e-5
    assert abs(loss.item() * targets.numel() / want_loss.item() - 1) < 1e-6
    want_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert _rel(p.grad, want_grads[name].grad) < 1e-5, name


def test_the_reference_tells_documents_apart() -> None:
    # without segments, the same rows differ from their documents alone: the test above can fail
    torch.manual_seed(0)
    model = Transformer(_cfg(), loss_chunk_tokens=0)
    tokens = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(1))
    want, _ = _per_document_reference(copy.deepcopy(model).double(), tokens, tokens, DOC_LENGTHS)
    assert _rel(model(tokens), want) > 1e-2


def test_each_document_gets_the_rotary_tables_it_gets_alone() -> None:
    # Rotary scores depend on relative positions only, so logits cannot show the restart (beyond rounding); the
    # tables that reach attention can: each document's rows are those the document gets as a row of its own
    torch.manual_seed(0)
    model = Transformer(_cfg())
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    model.layers[1].attn.register_forward_pre_hook(lambda module, args: seen.append(args[1:3]))
    tokens = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(1))
    model(tokens, segments_BS=_segments(DOC_LENGTHS))
    cos_B1SD2, sin_B1SD2 = seen.pop()
    for b, row in enumerate(DOC_LENGTHS):
        start = 0
        for n in row:
            model(tokens[b : b + 1, start : start + n])
            cos_SD2, sin_SD2 = seen.pop()
            assert torch.equal(cos_B1SD2[b, 0, start : start + n], cos_SD2)
            assert torch.equal(sin_B1SD2[b, 0, start : start + n], sin_SD2)
            start += n


def test_rotary_positions_restart_at_each_document() -> None:
    segments = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 2, 3, 3, 3], [0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    want = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 0, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
    assert torch.equal(rotary_positions(segments), want)


@pytest.mark.parametrize("variant", ["gqa", "mla"])
def test_one_document_per_row_equals_the_plain_causal_path(variant: str) -> None:
    torch.manual_seed(0)
    model = Transformer(_cfg(variant), loss_chunk_tokens=0)
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    zeros = torch.zeros(2, 20, dtype=torch.int32)
    plain, docs = model(tokens, tokens), model(tokens, tokens, segments_BS=zeros)
    assert _rel(docs, plain) < 1e-6
    assert _rel(model(tokens, segments_BS=zeros), model(tokens)) < 1e-6


def _block_sets(num, indices, num_q: int, num_kv: int) -> torch.Tensor:
    """(B, nQ, nK) bool from BlockMask's ordered layout (counts and leading indices)."""
    B = num.shape[0]
    dense = torch.zeros(B, num_q, num_kv, dtype=torch.bool)
    for b in range(B):
        for i in range(num_q):
            dense[b, i, indices[b, 0, i, : num[b, 0, i]].long()] = True
    return dense


@pytest.mark.parametrize("seq", [1, 16, 47, 64, 100])
def test_block_mask_equals_flex_attentions_own(seq: int) -> None:
    from torch.nn.attention.flex_attention import create_block_mask

    gen = torch.Generator().manual_seed(seq)
    rows = [
        torch.randint(0, 4, (seq,), generator=gen).sort().values,  # a few documents
        torch.randint(0, seq, (seq,), generator=gen).sort().values,  # many short ones
        torch.zeros(seq, dtype=torch.int64),  # one
        torch.arange(seq),  # every position its own document
    ]
    segments = torch.stack(rows).to(torch.int32)
    segments -= segments[:, :1].clone()
    mine = document_block_mask(segments, block_size=16)
    want = create_block_mask(document_mask_mod(segments), 4, None, seq, seq, device="cpu", BLOCK_SIZE=16)
    n = -(-seq // 16)
    assert mine.shape == want.shape
    for got_pair, want_pair in (
        ((mine.kv_num_blocks, mine.kv_indices), (want.kv_num_blocks, want.kv_indices)),
        ((mine.full_kv_num_blocks, mine.full_kv_indices), (want.full_kv_num_blocks, want.full_kv_indices)),
    ):
        assert torch.equal(_block_sets(*got_pair, n, n), _block_sets(*want_pair, n, n))
    # the transposed (query-block) layout the backward reads, derived from ours by BlockMask itself
    assert torch.equal(mine.q_num_blocks, want.q_num_blocks)
    assert torch.equal(mine.full_q_num_blocks, want.full_q_num_blocks)


def test_flex_attention_with_the_block_mask_equals_the_dense_mask() -> None:
    # FlexAttention runs forward-only on CPUs: its mask function against the dense mask the CPU path uses
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    segments = _segments(DOC_LENGTHS)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 17, 8, generator=gen, dtype=torch.float64)
    k, v = torch.randn(3, 2, 17, 8, generator=gen, dtype=torch.float64), torch.randn(3, 2, 17, 6, generator=gen)
    v = v.double()
    positions = rotary_positions(segments)
    dense = document_attention(q, k, v, Documents(positions, visible_B1SS=document_visible(segments)), 0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is unfused
        flex = flex_attention(q, k, v, block_mask=document_block_mask(segments, 16), scale=0.3, enable_gqa=True)
    assert _rel(flex, dense) < 1e-12


@pytest.mark.parametrize(
    "segments, match",
    [
        (torch.zeros(2, 9, dtype=torch.int32), r"shape \(2, 9\) must equal the tokens' shape \(2, 8\)"),
        (torch.zeros(2, 8), "int32 tensor.*got torch.float32"),
        ([[0] * 8] * 2, "int32 tensor.*got list"),
        (torch.tensor([[0, 0, 1, 1, 2, 2, 2, 2], [0, 0, 1, 1, 0, 1, 1, 1]], dtype=torch.int32), "row 1 holds 0 at "),
        (torch.tensor([[-1] * 8, [0] * 8], dtype=torch.int32), "row 0 starts at -1"),
    ],
)
def test_bad_segments_are_refused_in_one_line(segments, match: str) -> None:
    model = Transformer(_cfg())
    tokens = torch.zeros(2, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match=match) as err:
        model(tokens, segments_BS=segments)
    assert "\n" not in str(err.value)


def test_segments_with_a_kv_cache_are_refused() -> None:
    model = Transformer(_cfg()).eval()
    tokens = torch.zeros(1, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="KV cache"), torch.no_grad():
        model(tokens, cache=KVCache(2), segments_BS=torch.zeros(1, 4, dtype=torch.int32))


def _loss_and_grads(model, tokens, segments):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, tokens.roll(-1, dims=1), segments_BS=segments)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["moe", "full"])
def test_recompute_with_documents_gives_the_gradients_of_none(mode: str) -> None:
    torch.manual_seed(0)
    model = Transformer(_cfg())
    tokens = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(4))
    want_loss, want = _loss_and_grads(model, tokens, _segments(DOC_LENGTHS))
    regions.apply_recompute(model, mode)
    got_loss, got = _loss_and_grads(model, tokens, _segments(DOC_LENGTHS))
    assert torch.equal(got_loss, want_loss) and got.keys() == want.keys()
    for name in want:
        assert _rel(got[name], want[name]) < 1e-6, name


def test_compiled_regions_take_documents_without_graph_break_or_recompile() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Transformer(_cfg())
    tokens = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(5))
    other = _segments([[2, 15], [9, 8], [1, 1, 1, 14]])
    want = [_loss_and_grads(model, tokens, s) for s in (_segments(DOC_LENGTHS), other)]
    counter = CompileCounterWithBackend("aot_eager")
    for block in regions.blocks(model):
        block.attn_branch = torch.compile(block.attn_branch, fullgraph=True, backend=counter)
    for segments, (want_loss, want_grads) in zip((_segments(DOC_LENGTHS), other), want, strict=True):
        got_loss, got = _loss_and_grads(model, tokens, segments)
        assert _rel(got_loss, want_loss) < 1e-6
        for name in want_grads:
            assert _rel(got[name], want_grads[name]) < 1e-5, name
    assert counter.frame_count == 1  # both blocks' attention, both batches: one compiled graph


def _tp_body(rank: int, world_size: int, sequence_parallel: bool) -> None:
    from xmoe.config import ParallelConfig
    from xmoe.parallel.dims import ParallelDims
    from xmoe.parallel.ssmb import apply_ssmb
    from xmoe.parallel.tensor import apply_tensor_parallel

    def build():
        torch.manual_seed(0)
        cfg = _cfg("gqa")
        cfg.moe.kernel_backend = "torch"
        return Transformer(cfg, loss_chunk_tokens=0)

    gen = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=gen)
    segments = _segments([[3, 9, 4], [16]])  # 16 inputs per row: seq divisible by tp for sequence parallelism
    ref = build()
    ref_logits = ref(tokens[:, :-1], segments_BS=segments)
    ref(tokens[:, :-1], tokens[:, 1:], segments_BS=segments).backward()
    dims = ParallelDims.from_config(ParallelConfig(tp=world_size), world_size).build_mesh("cpu")
    model = apply_tensor_parallel(build(), dims, sequence_parallel=sequence_parallel)
    apply_ssmb(model, dims)
    assert _rel(model(tokens[:, :-1], segments_BS=segments), ref_logits) < 1e-5
    model(tokens[:, :-1], tokens[:, 1:], segments_BS=segments).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        assert _rel(grad, ref_grads[name]) < 1e-5, (rank, sequence_parallel, name)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp_ssmb", "sequence_parallel"])
def test_documents_under_tensor_parallelism_equal_one_process(sequence_parallel: bool) -> None:
    run_distributed(_tp_body, 2, sequence_parallel)


def test_the_flex_path_runs_inside_compiled_regions(monkeypatch) -> None:
    # The GPU path on the CPU, forward only (FlexAttention has no CPU backward): Documents with a block mask, the
    # compiled flex_attention traced into each compiled attention region, a new batch's mask without a recompile
    import warnings

    from torch._dynamo.testing import CompileCounterWithBackend

    from xmoe.model import documents

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Transformer(_cfg("gqa")).eval()
    tokens = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(7))
    batches = (_segments(DOC_LENGTHS), _segments([[2, 15], [9, 8], [1, 1, 1, 14]]))
    with torch.no_grad():
        want = [model(tokens, segments_BS=s) for s in batches]
        monkeypatch.setattr(documents, "uses_flex", lambda device: True)
        counter = CompileCounterWithBackend("eager")
        for block in regions.blocks(model):
            block.attn_branch = torch.compile(block.attn_branch, fullgraph=True, backend=counter)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager FlexAttention warns that it is unfused
            got = [model(tokens, segments_BS=s) for s in batches]
    assert Documents.build(batches[0], tokens).block_mask is not None
    assert all(_rel(g, w) < 1e-6 for g, w in zip(got, want, strict=True))
    assert counter.frame_count == 1
