"""Generation: `xmoe generate` greedy equals transformers' greedy generate; the KV cache equals full recomputation;
nucleus sampling draws from the renormalised nucleus."""

from __future__ import annotations

import pytest
import torch
from hf_models import FAMILIES, VOCAB, saved_reference

from xmoe.cli import main
from xmoe.hf import load_pretrained
from xmoe.model.generate import generate, sample_next

PROMPT = [5, 17, 3, 44, 9, 30, 12]


@pytest.mark.parametrize("family", FAMILIES)
def test_xmoe_generate_greedy_equals_transformers(family: str, tmp_path, capsys) -> None:
    ref = saved_reference(family, tmp_path)
    main(["generate", str(tmp_path), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "20", "--ids"])
    ours = [int(t) for t in capsys.readouterr().out.strip().split(",")]
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False)[0, len(PROMPT) :].tolist()
    assert ours == theirs
    assert len(ours) == 20 or ours[-1] == ref.config.eos_token_id


def test_cached_generation_equals_recomputing_every_step(tmp_path) -> None:
    saved_reference("deepseek_v3", tmp_path)
    model = load_pretrained(tmp_path)
    prompt = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(0))
    out = generate(model, prompt, 12)
    seq = prompt
    with torch.no_grad():
        for _ in range(12):
            seq = torch.cat((seq, model(seq)[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(out, seq)


def test_sampling_is_seeded_and_a_tiny_top_p_is_greedy(tmp_path) -> None:
    saved_reference("olmoe", tmp_path)
    model = load_pretrained(tmp_path)
    prompt = torch.tensor([PROMPT])

    def draw(seed: int, **kw) -> torch.Tensor:
        return generate(model, prompt, 10, generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(draw(1, temperature=1.0), draw(1, temperature=1.0))
    assert not torch.equal(draw(1, temperature=5.0), draw(2, temperature=5.0))
    assert torch.equal(draw(3, temperature=1.0, top_p=1e-6), generate(model, prompt, 10))


def test_top_p_draws_from_the_renormalised_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.05, 0.3, 0.15]]))
    # top_p 0.7: 0.5 alone is short of it, 0.5 + 0.3 reaches it -> nucleus {0, 2} with probabilities 5/8, 3/8
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next(logits, 1.0, 0.7, gen) for _ in range(4000)]).flatten()
    freq = torch.bincount(draws, minlength=4).double() / draws.numel()
    assert freq[1] == 0 and freq[3] == 0
    assert abs(freq[0].item() - 5 / 8) < 0.03


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(max_new_tokens=100), "max_seq_len"),
    ],
)
def test_bad_generation_arguments_raise(kw: dict, match: str, tmp_path) -> None:
    saved_reference("mixtral", tmp_path)
    model = load_pretrained(tmp_path, max_seq_len=32)
    args = dict(max_new_tokens=4) | kw
    with pytest.raises(ValueError, match=match):
        generate(model, torch.tensor([PROMPT]), args.pop("max_new_tokens"), **args)
