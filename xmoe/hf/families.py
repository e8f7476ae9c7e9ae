"""Hugging Face model families: their config.json <-> xmoe's ModelConfig (their tensor names: names.py).

# E experts, H hidden, F expert ffn, R rotary features

Supported ``model_type``s: qwen3_moe, qwen2_moe, mixtral, olmoe, deepseek_v3, deepseek_v2. What each one fixes:

  family       attention                router                                    other
  qwen3_moe    GQA, per-head q/k norm   softmax top-k, renormalised if norm_topk  dense layers: mlp_only_layers
  qwen2_moe    GQA, q/k/v biases        softmax top-k, renormalised if norm_topk  one shared expert of its own
                                                                                  width, sigmoid-gated
  mixtral      GQA                      softmax top-k, always renormalised        experts named w1/w2/w3
  olmoe        GQA, q/k norm over proj  softmax top-k, renormalised if norm_topk
  deepseek_v3  MLA, interleaved rotary  sigmoid + score bias, group-limited,      shared experts, first_k_dense
                                        renormalised, x routed_scaling_factor
  deepseek_v2  MLA, interleaved rotary  softmax, group-limited (group max) or     shared experts, first_k_dense
                                        greedy, x routed_scaling_factor, never
                                        renormalised

A field xmoe cannot honour (a rope scaling type, biases in attention, sliding windows, clip_qkv, MoE layers
that are not a prefix-free run...) is refused with a ValueError naming it: an import is exact or it fails.
"""

from __future__ import annotations

from typing import Any

from xmoe.config import ModelConfig, MoEConfig
from xmoe.model_config import QKNorm

FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "deepseek_v2", "qwen2_moe")
QWEN = ("qwen3_moe", "qwen2_moe")
ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
}
DEEPSEEK = ("deepseek_v3", "deepseek_v2")
SCORE_BIAS_FAMILIES = ("deepseek_v3",)  # the ones whose checkpoints hold the router's score-correction bias
_QK_NORMS: dict[str, QKNorm] = {"qwen3_moe": "head", "olmoe": "proj"}  # the families with q/k norms; others: none


def _refuse(family: str, field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{family}: config field {field}={value!r} is not supported: {why}")


def _rope(hf: dict, family: str) -> dict:
    """ModelConfig's rotary fields from ``rope_parameters`` (transformers >= 5) or the older ``rope_theta`` and
    ``rope_scaling``: plain rotary embeddings or YaRN."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    where = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope_type = params.get("rope_type", params.get("type", "default"))
    out = {"rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if rope_type == "default":
        return out
    if rope_type != "yarn":
        raise _refuse(family, f"{where}.rope_type", rope_type, "rotary embeddings are plain ('default') or 'yarn'")
    for field, ok in (("attention_factor", None), ("truncate", True), ("partial_rotary_factor", 1.0)):
        if params.get(field, ok) != ok:
            raise _refuse(
                family, f"{where}.{field}", params[field], "xmoe's YaRN derives it as transformers' default does"
            )
    if not params.get("original_max_position_embeddings"):
        raise _refuse(
            family, f"{where}.original_max_position_embeddings", None, "YaRN needs the pre-training context length"
        )
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or hf["max_position_embeddings"] / original
    return dict(
        out,
        rope_scaling="yarn",
        rope_factor=float(factor),
        rope_original_max_len=int(original),
        rope_beta_fast=float(params.get("beta_fast") or 32),
        rope_beta_slow=float(params.get("beta_slow") or 1),
        rope_mscale=float(params.get("mscale") or 0),
        rope_mscale_all_dim=float(params.get("mscale_all_dim") or 0),
    )


def _rope_parameters(cfg: ModelConfig) -> dict:
    if cfg.rope_scaling == "none":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {
        "rope_type": "yarn",
        "rope_theta": cfg.rope_theta,
        "factor": cfg.rope_factor,
        "original_max_position_embeddings": cfg.rope_original_max_len,
        "beta_fast": cfg.rope_beta_fast,
        "beta_slow": cfg.rope_beta_slow,
        "mscale": cfg.rope_mscale,
        "mscale_all_dim": cfg.rope_mscale_all_dim,
    }


def _check_common(hf: dict, family: str) -> None:
    checks = [
        ("hidden_act", "silu", "experts are SwiGLU (silu)"),
        ("attention_bias", False, "no attention biases"),
        ("mlp_bias", False, "no FFN biases"),
        ("clip_qkv", None, "q/k/v clipping is not implemented"),
        ("use_sliding_window", False, "attention is full causal"),
        ("sliding_window", None, "full causal"),
        ("moe_layer_freq", 1, "every layer after the dense prefix is MoE"),
        ("decoder_sparse_step", 1, "every layer after the dense prefix is MoE"),
    ]
    for field, ok, why in checks:
        value = hf.get(field, ok)
        if field == "sliding_window" and family in QWEN and not hf.get("use_sliding_window"):
            continue  # Qwen stores a window size but uses it only with use_sliding_window
        if value != ok:
            raise _refuse(family, field, value, why)


def model_config_from_hf(hf: dict, max_seq_len: int | None = None, mtp_depth: int | None = None) -> ModelConfig:
    """xmoe ModelConfig of a Hugging Face config.json (a dict). ``mtp_depth``: the multi-token-prediction modules
    to build (None: deepseek_v3's ``num_nextn_predict_layers``; checkpoint.read_model_config gives the number the
    checkpoint holds)."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r} is not supported; supported families: {', '.join(FAMILIES)}")
    _check_common(hf, family)
    H, layers = hf["hidden_size"], hf["num_hidden_layers"]
    common = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=H,
        num_layers=layers,
        num_heads=hf["num_attention_heads"],
        max_seq_len=max_seq_len or hf.get("max_position_embeddings", 4096),
        **_rope(hf, family),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
    )
    moe_common = dict(hidden_size=H, top_k=hf["num_experts_per_tok"], init_std=common["init_std"])
    if family in DEEPSEEK:
        return _deepseek_config(hf, family, common, moe_common, mtp_depth)
    return _softmax_family_config(hf, family, common, moe_common)


def _deepseek_config(hf: dict, family: str, common: dict, moe_common: dict, mtp_depth: int | None) -> ModelConfig:
    """DeepSeek-V2 / V3: latent attention, shared experts, group-limited (V3: sigmoid, bias-corrected) routing."""
    v3 = family == "deepseek_v3"
    if v3 and hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise _refuse(family, "scoring_func", hf["scoring_func"], "DeepSeek-V3 routing scores are sigmoids")
    method = hf.get("topk_method", "noaux_tc" if v3 else "greedy")
    if method not in (("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")):
        raise _refuse(
            family,
            "topk_method",
            method,
            "DeepSeek-V3 routes by 'noaux_tc', DeepSeek-V2 by 'greedy' or 'group_limited_greedy'",
        )
    if not hf.get("n_shared_experts"):
        raise _refuse(family, "n_shared_experts", hf.get("n_shared_experts"), "DeepSeek models have shared experts")
    grouped = v3 or method == "group_limited_greedy"
    moe = MoEConfig(
        ffn_hidden_size=hf["moe_intermediate_size"],
        num_experts=hf["n_routed_experts"],
        num_shared_experts=hf["n_shared_experts"],
        score_func="sigmoid" if v3 else "softmax",
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)) if v3 else False,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        num_expert_groups=(hf.get("n_group") or 1) if grouped else 1,
        topk_groups=(hf.get("topk_group") or 1) if grouped else 1,
        **moe_common,
    )
    return ModelConfig(
        moe=moe,
        ffn_hidden_size=hf["intermediate_size"],
        first_k_dense=hf.get("first_k_dense_replace", 0),
        attention="mla",
        q_lora_rank=hf.get("q_lora_rank") or 0,
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        latent_norm_eps=1e-6,
        mtp_depth=(hf.get("num_nextn_predict_layers") or 0 if mtp_depth is None else mtp_depth) if v3 else 0,
        **common,
    )


def _softmax_family_config(hf: dict, family: str, common: dict, moe_common: dict) -> ModelConfig:
    """Mixtral, OLMoE, Qwen2-MoE and Qwen3-MoE: softmax routing; Qwen's leading dense layers, Qwen2-MoE's gated shared
    expert."""
    H = common["hidden_size"]
    num_experts = hf["num_local_experts"] if family == "mixtral" else hf.get("num_experts", hf.get("num_local_experts"))
    if num_experts is None:
        raise _refuse(family, "num_experts", None, "the config must give the number of routed experts")
    expert_ffn = hf["intermediate_size"] if family in ("mixtral", "olmoe") else hf["moe_intermediate_size"]
    norm_topk = True if family == "mixtral" else bool(hf.get("norm_topk_prob", False))
    first_k_dense = 0
    shared = {}
    if family == "qwen2_moe":
        shared = dict(
            num_shared_experts=1, shared_ffn_hidden_size=hf["shared_expert_intermediate_size"], shared_expert_gate=True
        )
    if family in QWEN:
        dense = sorted(hf.get("mlp_only_layers") or [])
        if dense != list(range(len(dense))):
            raise _refuse(family, "mlp_only_layers", dense, "dense layers must be the first ones (0, 1, ..., k-1)")
        first_k_dense = len(dense)
    head_dim = hf.get("head_dim") or 0
    if head_dim == H // hf["num_attention_heads"]:
        head_dim = 0
    moe = MoEConfig(
        ffn_hidden_size=expert_ffn, num_experts=num_experts, norm_topk_prob=norm_topk, **shared, **moe_common
    )
    return ModelConfig(
        moe=moe,
        ffn_hidden_size=hf.get("intermediate_size", 0) if first_k_dense else 0,
        qkv_bias=family == "qwen2_moe" and bool(hf.get("qkv_bias", True)),
        first_k_dense=first_k_dense,
        num_kv_heads=hf.get("num_key_value_heads") or 0,
        attn_head_dim=head_dim,
        qk_norm=_QK_NORMS.get(family, "none"),
        **common,
    )


def infer_family(cfg: ModelConfig) -> str:
    """The family whose layout expresses ``cfg`` (MLA: deepseek_v3 with sigmoid scores, else deepseek_v2; q/k norm
    per head: qwen3_moe, per projection: olmoe; a gated shared expert: qwen2_moe; otherwise mixtral)."""
    if cfg.attention == "mla":
        return "deepseek_v3" if cfg.moe.score_func == "sigmoid" else "deepseek_v2"
    if cfg.moe.shared_expert_gate:
        return "qwen2_moe"
    return {"head": "qwen3_moe", "proj": "olmoe"}.get(cfg.qk_norm, "mixtral")


def fitting_family(cfg: ModelConfig) -> str:
    """``infer_family(cfg)`` when that family can express ``cfg``, else the first that can; a ValueError saying
    what keeps each family from expressing it when none can."""
    best = infer_family(cfg)
    reasons = {family: _problems(cfg, family) for family in (best, *(f for f in FAMILIES if f != best))}
    fits = [family for family, problems in reasons.items() if not problems]
    if fits:
        return fits[0]
    raise ValueError(
        "no Hugging Face family xmoe writes can express this model; "
        + "; ".join(f"{family}: {', '.join(problems)}" for family, problems in reasons.items())
        + ". Export a model whose "
        "architecture one family has, e.g. one trained with --init-from a Hugging Face directory"
    )


def _problems(cfg: ModelConfig, family: str) -> list[str]:
    """What keeps ``family`` from expressing ``cfg`` (empty when it can)."""
    moe = cfg.moe
    want_attention = "mla" if family in DEEPSEEK else "mha"
    want_qk_norm = _QK_NORMS.get(family, "none")
    problems = []
    if cfg.attention != want_attention:
        problems.append(f"attention={cfg.attention!r} (the family needs {want_attention!r})")
    if cfg.attention == "mha" and cfg.qk_norm != want_qk_norm:
        problems.append(f"qk_norm={cfg.qk_norm!r} (the family needs {want_qk_norm!r})")
    if cfg.qkv_bias and family != "qwen2_moe":
        problems.append("qkv_bias=True (the family has no attention biases)")
    if cfg.mtp_depth and family != "deepseek_v3":
        problems.append(f"mtp_depth={cfg.mtp_depth} (only deepseek_v3 stores multi-token-prediction modules)")
    if cfg.mtp_depth and not cfg.has_moe:
        problems.append("mtp_depth with every layer dense (DeepSeek-V3's prediction modules are MoE layers)")
    if family == "deepseek_v3":
        if moe.score_func != "sigmoid" or moe.num_shared_experts == 0:
            problems.append("moe.score_func must be 'sigmoid' with num_shared_experts >= 1")
    elif family == "deepseek_v2":
        if moe.score_func != "softmax" or moe.num_shared_experts == 0 or moe.norm_topk_prob:
            problems.append("moe.score_func must be 'softmax' with num_shared_experts >= 1 and norm_topk_prob False")
    elif family == "qwen2_moe":
        if moe.score_func != "softmax" or moe.num_expert_groups > 1 or not moe.shared_expert_gate:
            problems.append(
                "moe.score_func must be 'softmax' with no expert groups and one gated shared expert "
                "(moe.shared_expert_gate)"
            )
    else:
        if moe.score_func != "softmax" or moe.num_shared_experts or moe.num_expert_groups > 1:
            problems.append("moe.score_func must be 'softmax' with no shared experts and no expert groups")
        if moe.shared_expert_gate and family != "qwen2_moe":
            problems.append("moe.shared_expert_gate=True (only qwen2_moe gates its shared expert)")
        if moe.routed_scaling_factor != 1.0:
            problems.append(f"moe.routed_scaling_factor={moe.routed_scaling_factor} (the family has none)")
        if family == "mixtral" and not moe.norm_topk_prob:
            problems.append("moe.norm_topk_prob=False (Mixtral always renormalises)")
        if family in ("mixtral", "olmoe") and cfg.first_k_dense:
            problems.append(f"first_k_dense={cfg.first_k_dense} (the family has no dense layers)")
    return problems


def hf_config_from_model(cfg: ModelConfig, family: str, base: dict | None = None) -> dict:
    """A config.json for ``cfg`` in ``family``'s terms; ``base`` (an imported config.json) keeps its other fields
    (token ids, generation settings). Refuses a model the family cannot express, naming the field."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not supported; choose one of {', '.join(FAMILIES)}")
    problems = _problems(cfg, family)
    if problems:
        raise ValueError(f"this model cannot be written as {family}: " + "; ".join(problems))
    moe = cfg.moe
    out = dict(base or {})
    for stale in ("rope_scaling", "torch_dtype", "quantization_config"):
        out.pop(stale, None)
    out.update(
        architectures=[ARCHITECTURES[family]],
        model_type=family,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters=_rope_parameters(cfg),
        rope_theta=cfg.rope_theta,  # where transformers < 5 reads it
        tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="silu",
        attention_bias=False,
        initializer_range=cfg.init_std,
        num_experts_per_tok=moe.top_k,
    )
    if family in DEEPSEEK:
        return _deepseek_fields(out, cfg, family)
    return _softmax_family_fields(out, cfg, family)


def _deepseek_fields(out: dict, cfg: ModelConfig, family: str) -> dict:
    """``out`` with DeepSeek-V2 / V3's routing, latent attention and multi-token-prediction fields."""
    moe = cfg.moe
    out.update(
        n_routed_experts=moe.num_experts,
        n_shared_experts=moe.num_shared_experts,
        moe_intermediate_size=moe.ffn_hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        first_k_dense_replace=cfg.first_k_dense,
        n_group=moe.num_expert_groups,
        topk_group=moe.topk_groups,
        norm_topk_prob=moe.norm_topk_prob,
        routed_scaling_factor=moe.routed_scaling_factor,
        q_lora_rank=cfg.q_lora_rank or None,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_interleave=True,
        head_dim=cfg.qk_rope_head_dim,
        qk_head_dim=cfg.head_dim,
    )
    if family == "deepseek_v2":
        out.pop("rope_interleave")  # V2's rotary is always interleaved
        out.update(
            topk_method="group_limited_greedy" if moe.num_expert_groups > 1 else "greedy",
            n_group=moe.num_expert_groups if moe.num_expert_groups > 1 else None,
            topk_group=moe.topk_groups if moe.num_expert_groups > 1 else None,
        )
    else:
        out["num_nextn_predict_layers"] = cfg.mtp_depth
    return out


def _softmax_family_fields(out: dict, cfg: ModelConfig, family: str) -> dict:
    """``out`` with Mixtral's, OLMoE's or Qwen's expert fields."""
    moe = cfg.moe
    out.update(head_dim=cfg.head_dim)
    if family == "mixtral":
        out.update(num_local_experts=moe.num_experts, intermediate_size=moe.ffn_hidden_size)
    elif family == "olmoe":
        out.update(
            num_experts=moe.num_experts, intermediate_size=moe.ffn_hidden_size, norm_topk_prob=moe.norm_topk_prob
        )
    else:
        if family == "qwen2_moe":
            out.update(
                shared_expert_intermediate_size=moe.shared_width, qkv_bias=cfg.qkv_bias, use_sliding_window=False
            )
        out.update(
            num_experts=moe.num_experts,
            moe_intermediate_size=moe.ffn_hidden_size,
            intermediate_size=cfg.ffn_hidden_size
            if cfg.first_k_dense
            else out.get("intermediate_size", cfg.ffn_hidden_size),
            norm_topk_prob=moe.norm_topk_prob,
            mlp_only_layers=list(range(cfg.first_k_dense)),
            decoder_sparse_step=1,
        )
    return out
