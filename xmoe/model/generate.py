"""KV-cached sampling from a Transformer: greedy, temperature, top-p (nucleus), a token budget, an end token.

Legend: B batch, S prompt length, V vocab.

One prefill forward over the prompt fills the cache; every later step feeds only the newest token. Greedy
(temperature 0) takes the argmax, ties to the lowest id as torch.argmax does (and Hugging Face's greedy search).
Sampling divides the logits by the temperature, keeps the smallest set of most likely tokens whose probability
reaches ``top_p`` (the most likely token always stays), renormalises and draws with ``generator``.
"""

from __future__ import annotations

import torch

from xmoe.model.attention import KVCache
from xmoe.model.transformer import Transformer


def _check(model: Transformer, prompt_BS: torch.Tensor, max_new_tokens: int, temperature: float, top_p: float) -> None:
    if prompt_BS.ndim != 2 or prompt_BS.shape[1] == 0 or prompt_BS.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"prompt must be a non-empty integer tensor (batch, seq); got {tuple(prompt_BS.shape)} {prompt_BS.dtype}"
        )
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) must be >= 0")
    if not temperature >= 0:
        raise ValueError(f"temperature ({temperature}) must be >= 0 (0: greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p ({top_p}) must be in (0, 1]")
    limit = model.cfg.max_seq_len
    if prompt_BS.shape[1] + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({prompt_BS.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"max_seq_len ({limit}); shorten the prompt or ask for fewer tokens"
        )


def sample_next(
    logits_BV: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Next token ids (B,) from the last position's logits."""
    if temperature == 0:
        return logits_BV.argmax(-1)
    probs_BV = torch.softmax(logits_BV.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
        # keep a token while the mass before it is below top_p: the smallest prefix reaching top_p
        keep_BV = (sorted_BV.cumsum(-1) - sorted_BV) < top_p
        sorted_BV = sorted_BV * keep_BV
        probs_BV = torch.zeros_like(probs_BV).scatter_(-1, order_BV, sorted_BV)
    return torch.multinomial(probs_BV / probs_BV.sum(-1, keepdim=True), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_BS: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    pad_id: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The prompt followed by up to ``max_new_tokens`` generated tokens, (B, S + n).

    With ``eos_id``, a sequence that produced it is finished: its later positions hold ``pad_id`` (default
    ``eos_id``), and generation stops early once every sequence is finished. The model runs in eval mode.
    """
    _check(model, prompt_BS, max_new_tokens, temperature, top_p)
    pad_id = eos_id if pad_id is None else pad_id
    was_training = model.training
    model.eval()
    try:
        cache = KVCache(model.cfg.num_layers)
        out_BS = prompt_BS
        logits_BSV = model(prompt_BS, cache=cache)
        done_B = torch.zeros(prompt_BS.shape[0], dtype=torch.bool, device=prompt_BS.device)
        for step in range(max_new_tokens):
            next_B = sample_next(logits_BSV[:, -1], temperature, top_p, generator).to(prompt_BS.dtype)
            if eos_id is not None:
                assert pad_id is not None  # eos_id when not given
                next_B = torch.where(done_B, torch.full_like(next_B, pad_id), next_B)
                done_B |= next_B == eos_id
            out_BS = torch.cat((out_BS, next_B[:, None]), dim=1)
            if (eos_id is not None and bool(done_B.all())) or step == max_new_tokens - 1:
                break
            logits_BSV = model(next_B[:, None], cache=cache)
        return out_BS
    finally:
        model.train(was_training)
