"""xmoe.hf against transformers: imported logits, exported checkpoints read back by transformers, shards, experts
read per rank, refused configurations, and no transformers import at xmoe import time."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from hf_models import FAMILIES, VOCAB, build_reference, load_reference, rel_err, saved_reference
from safetensors.torch import load_file, save_file

from xmoe.hf import load_pretrained, save_pretrained
from xmoe.hf.families import model_config_from_hf


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    """(family, directory written by transformers, the transformers model)."""
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, saved_reference(request.param, directory)


def tokens(batch: int = 2, seq: int = 19, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_imported_logits_match_transformers(family_dir) -> None:
    _family, directory, ref = family_dir
    model = load_pretrained(directory)
    x = tokens()
    with torch.no_grad():
        assert rel_err(model(x), ref(x).logits) < 1e-5


def test_exported_checkpoint_loads_in_transformers_with_the_same_logits(family_dir, tmp_path) -> None:
    _family, directory, ref = family_dir
    save_pretrained(load_pretrained(directory), tmp_path)
    back = load_reference(tmp_path)
    assert type(back) is type(ref)
    x = tokens(seed=1)
    with torch.no_grad():
        assert rel_err(back(x).logits, ref(x).logits) < 1e-5
    # the files use the published per-expert layout, tensor for tensor the ones transformers wrote
    ours, theirs = load_file(tmp_path / "model.safetensors"), load_file(directory / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_sharded_export_writes_an_index_and_reloads(tmp_path) -> None:
    ref = saved_reference("deepseek_v3", tmp_path / "ref")
    model = load_pretrained(tmp_path / "ref")
    save_pretrained(model, tmp_path / "out", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and not (tmp_path / "out" / "model.safetensors").exists()
    assert all((tmp_path / "out" / f).stat().st_size <= 20_000 + 8192 for f in files)  # + safetensors header
    x = tokens(seed=2)
    with torch.no_grad():
        want = ref(x).logits
        assert rel_err(load_pretrained(tmp_path / "out")(x), want) < 1e-5
        assert rel_err(load_reference(tmp_path / "out")(x).logits, want) < 1e-5


def test_a_rank_reads_only_its_experts(tmp_path) -> None:
    saved_reference("mixtral", tmp_path)
    full = load_pretrained(tmp_path)
    # remove experts 0 and 1 from the file: a rank owning experts 2..3 must not need them
    tensors = load_file(tmp_path / "model.safetensors")
    kept = {k: v for k, v in tensors.items() if ".experts.0." not in k and ".experts.1." not in k}
    save_file(kept, tmp_path / "model.safetensors", metadata={"format": "pt"})
    part = load_pretrained(tmp_path, experts=range(2, 4))
    for a, b in zip(full.moe_layers(), part.moe_layers(), strict=False):
        for w in ("w1", "w3", "w2"):
            assert torch.equal(getattr(a.experts, w)[2:], getattr(b.experts, w)[2:])
    with pytest.raises(ValueError, match="missing"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(model_type="llama"), "model_type"),
        (
            dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}),
            "rope_parameters.rope_type",
        ),
        (dict(rope_parameters=None, rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "original_max_position"),
        (
            dict(
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 1e4,
                    "factor": 4.0,
                    "attention_factor": 1.5,
                    "original_max_position_embeddings": 16,
                }
            ),
            "attention_factor",
        ),
        (dict(clip_qkv=8.0), "clip_qkv"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias"),
    ],
)
def test_unsupported_fields_are_refused_by_name(change: dict, field: str) -> None:
    hf = build_reference("olmoe").config.to_dict()
    hf.update(change)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        model_config_from_hf(hf)


def test_export_refuses_a_model_the_family_cannot_express(tmp_path) -> None:
    saved_reference("qwen3_moe", tmp_path / "q")
    model = load_pretrained(tmp_path / "q")
    with pytest.raises(ValueError, match=r"mixtral.*qk_norm"):
        save_pretrained(model, tmp_path / "out", family="mixtral")


def _edit_config(directory, drop: str = "", **values) -> None:
    config = json.loads((directory / "config.json").read_text())
    config = {k: v for k, v in {**config, **values}.items() if k != drop}
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "damage, file, message",
    [
        (
            lambda d: (d / "model.safetensors.index.json").write_text('{"metadata": {}}'),
            "model.safetensors.index.json",
            "has no weight_map",
        ),
        (
            lambda d: (d / "model.safetensors.index.json").write_text("{not json"),
            "model.safetensors.index.json",
            "is not valid JSON",
        ),
        (
            lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:3000]),
            "model.safetensors",
            "is not a readable safetensors file",
        ),
        (
            lambda d: (d / "model.safetensors").write_bytes(bytes(64)),
            "model.safetensors",
            "is not a readable safetensors file",
        ),
        (lambda d: _edit_config(d, hidden_size="32"), "config.json", "numbers written as strings (hidden_size: '32')"),
        (lambda d: (d / "config.json").write_text("{corrupt"), "config.json", "is not valid JSON"),
        (lambda d: _edit_config(d, drop="num_hidden_layers"), "config.json", "lacks the field 'num_hidden_layers'"),
    ],
)
def test_damaged_model_files_are_named(tmp_path, damage, file, message) -> None:
    saved_reference("mixtral", tmp_path)
    damage(tmp_path)
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        load_pretrained(tmp_path)
    assert str(tmp_path / file) in str(info.value)


def test_export_of_a_model_no_family_fits_says_why_for_each(tmp_path) -> None:
    from xmoe.model.presets import get_preset
    from xmoe.model.transformer import Transformer

    with pytest.raises(ValueError, match="no Hugging Face family xmoe writes can express this model") as info:
        save_pretrained(Transformer(get_preset("tiny")), tmp_path)  # shared experts without a gate, a dense layer
    assert all(f"{family}: " in str(info.value) for family in FAMILIES)


def test_bf16_import_keeps_weights_close(tmp_path) -> None:
    saved_reference("olmoe", tmp_path)
    model = load_pretrained(tmp_path, dtype=torch.bfloat16)
    assert model.embed.weight.dtype == torch.bfloat16 and model.rope_cos.dtype == torch.float32


def test_xmoe_never_imports_transformers() -> None:
    code = (
        "import sys, xmoe, xmoe.hf, xmoe.cli, xmoe.infer, xmoe.model.generate, xmoe.train.trainer; "
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_tied_embeddings_round_trip(tmp_path) -> None:
    import transformers

    cfg = build_reference("qwen3_moe").config
    cfg.tie_word_embeddings = True
    torch.manual_seed(3)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ref.save_pretrained(tmp_path / "ref")
    model = load_pretrained(tmp_path / "ref")
    assert model.head.weight is model.embed.weight
    save_pretrained(model, tmp_path / "out")
    x = tokens(seed=4)
    with torch.no_grad():
        assert rel_err(load_reference(tmp_path / "out")(x).logits, ref(x).logits) < 1e-5


def test_export_refuses_a_score_bias_the_family_cannot_store(tmp_path) -> None:
    saved_reference("olmoe", tmp_path / "o")
    model = load_pretrained(tmp_path / "o")
    model.moe_layers()[0].router.expert_bias[1] = 0.25
    with pytest.raises(ValueError, match="expert_bias"):
        save_pretrained(model, tmp_path / "out")


@pytest.mark.parametrize(
    "family, yarn",
    [
        (
            "deepseek_v3",
            dict(
                factor=4.0,
                original_max_position_embeddings=8,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=0.707,
            ),
        ),  # DeepSeek-V2-Lite's mscale pair: cos/sin and softmax rescaled
        ("deepseek_v2", dict(factor=4.0, original_max_position_embeddings=8, mscale=0.707, mscale_all_dim=0.707)),
        ("qwen3_moe", dict(factor=3.0, original_max_position_embeddings=6)),  # magnitude 0.1 ln(factor) + 1
    ],
)
def test_yarn_rotary_matches_transformers_past_the_original_context(family: str, yarn: dict, tmp_path) -> None:
    import transformers
    from hf_models import hf_config

    cfg = hf_config(family)
    cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, **yarn}
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.15) if p.ndim > 1 else p.copy_(1 + 0.3 * torch.randn_like(p))
    ref.save_pretrained(tmp_path / "ref")
    model = load_pretrained(tmp_path / "ref")
    assert model.cfg.rope_scaling == "yarn"
    x = tokens(seq=40, seed=6)  # 5x the original context
    with torch.no_grad():
        want = ref(x).logits
        assert rel_err(model(x), want) < 1e-5
        save_pretrained(model, tmp_path / "out")
        assert rel_err(load_reference(tmp_path / "out")(x).logits, want) < 1e-5
