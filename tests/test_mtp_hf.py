"""Multi-token prediction through Hugging Face deepseek_v3 checkpoints (num_nextn_predict_layers): export and import
keep every MTP weight bit-exact in the published layout (layer num_hidden_layers: enorm, hnorm, eh_proj,
shared_head.norm, the block, and copies of the embedding and head), transformers reads the main model back with the
same logits, and transformers' own MTP layer (transformers.modeling_layers.MtpModel, its speculative-decoding
drafter) computes from the exported weights the depth-1 logits xmoe computes.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hf_models import VOCAB, rel_err, saved_reference
from safetensors.torch import load_file

from xmoe.hf import load_pretrained, save_pretrained
from xmoe.hf.checkpoint import load_weights, read_config, read_model_config
from xmoe.hf.families import hf_config_from_model, model_config_from_hf
from xmoe.model.mtp import shift_left
from xmoe.model.transformer import Transformer

transformers = pytest.importorskip("transformers")
S = 11


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    """A tiny deepseek_v3 written by transformers: its config declares one MTP module, its weights hold none."""
    directory = tmp_path_factory.mktemp("deepseek_v3")
    saved_reference("deepseek_v3", directory)
    return directory


def _with_mtp(reference_dir, depth: int = 1) -> Transformer:
    """xmoe's model of the reference's architecture with ``depth`` MTP modules, every tensor away from its init."""
    model = Transformer(model_config_from_hf(read_config(reference_dir), mtp_depth=depth))
    model.init_weights(seed=5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
        for layer in model.moe_layers():
            layer.router.expert_bias.normal_(0, 0.05)
    return model.eval()


def _depth_logits(model: Transformer, tokens: torch.Tensor, depth: int = 1) -> torch.Tensor:
    """The logits module ``depth`` gives position i for token i + depth + 1 (positions with a token depth ahead)."""
    S = tokens.shape[1]
    cos, sin = model.rope_cos[:S], model.rope_sin[:S]
    h = embedded = model.embed(tokens)
    for block in model.layers:
        h = block(h, cos, sin)
    h = model.norm(h)
    for d in range(1, depth + 1):
        h = model.mtp[d - 1](h, shift_left(embedded, d), cos, sin)
    return model.head(h)[:, : S - depth]


def test_export_and_import_keep_every_mtp_weight_bit_exact(reference_dir, tmp_path) -> None:
    model = _with_mtp(reference_dir, depth=2)
    save_pretrained(model, tmp_path)
    hf = read_config(tmp_path)
    assert hf["num_nextn_predict_layers"] == 2 and hf["num_hidden_layers"] == 3
    files = load_file(tmp_path / "model.safetensors")
    for d, layer in enumerate((3, 4)):
        h = f"model.layers.{layer}."
        assert torch.equal(files[h + "eh_proj.weight"], model.mtp[d].eh_proj.weight)
        assert torch.equal(files[h + "shared_head.norm.weight"], model.mtp[d].norm.weight)
        assert torch.equal(files[h + "embed_tokens.weight"], model.embed.weight)
        assert torch.equal(files[h + "shared_head.head.weight"], model.head.weight)
        assert torch.equal(files[h + "mlp.experts.3.down_proj.weight"], model.mtp[d].block.ffn.experts.w2[3].T)
        assert h + "mlp.gate.e_score_correction_bias" in files
    back = load_pretrained(tmp_path)
    assert back.cfg.mtp_depth == 2
    want = model.state_dict()
    got = back.state_dict()
    assert got.keys() == want.keys() and any(k.startswith("mtp.1.block.ffn.router.expert_bias") for k in got)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_transformers_reads_the_main_model_and_its_mtp_layer_agrees(reference_dir, tmp_path) -> None:
    from transformers.modeling_layers import MtpModel

    model = _with_mtp(reference_dir)
    save_pretrained(model, tmp_path)
    tokens = torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(1))
    main = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel_err(main(tokens).logits, model(tokens)) < 1e-5
    # transformers' drafter: its block read as a fourth layer of the same checkpoint, its own tensors by name
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    config.num_hidden_layers = 4
    four = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, config=config, dtype=torch.float32)
    drafter = MtpModel(main, 1).eval()
    layer = drafter.layers[0]
    layer.mtp_block.load_state_dict(four.model.layers[3].state_dict())
    files = load_file(tmp_path / "model.safetensors")
    with torch.no_grad():
        for theirs, name in (
            ("enorm", "enorm"),
            ("hnorm", "hnorm"),
            ("eh_proj", "eh_proj"),
            ("post_norm", "shared_head.norm"),
        ):
            getattr(layer, theirs).weight.copy_(files[f"model.layers.3.{name}.weight"])
        hidden = main(tokens, output_hidden_states=True).hidden_states[-1]  # after the final norm
        positions = torch.arange(1, S)[None].expand(2, -1)
        drafted = drafter.forward_layer(0, hidden[:, :-1], positions, None, input_ids=tokens[:, 1:])
        want = main.lm_head(drafted)
        # xmoe's rotary positions start one lower: rotary scores are relative, so only rounding differs
        assert rel_err(_depth_logits(model, tokens), want) < 1e-5


def test_a_checkpoint_without_mtp_weights_imports_without_modules(reference_dir, caplog) -> None:
    assert read_config(reference_dir).get("num_nextn_predict_layers") == 1  # transformers' default
    with caplog.at_level(logging.DEBUG, logger="xmoe"):
        _, cfg = read_model_config(reference_dir)
    assert cfg.mtp_depth == 0 and "declares 1 multi-token-prediction module" in caplog.text


def test_modules_a_checkpoint_lacks_keep_their_initial_values(reference_dir, caplog) -> None:
    cfg = model_config_from_hf(read_config(reference_dir), mtp_depth=1)  # adding MTP to a trained model
    model = Transformer(cfg)
    model.init_weights(seed=2)
    before = {n: p.clone() for n, p in model.named_parameters() if n.startswith("mtp.")}
    with caplog.at_level(logging.WARNING, logger="xmoe"):
        load_weights(model, reference_dir)
    assert "holds no multi-token-prediction module 0" in caplog.text
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n.startswith("mtp."))
    assert rel_err(model.embed.weight, load_pretrained(reference_dir).embed.weight) == 0


def test_families_without_mtp_refuse_to_store_it(reference_dir) -> None:
    cfg = model_config_from_hf(read_config(reference_dir), mtp_depth=1)
    with pytest.raises(ValueError, match="only deepseek_v3 stores multi-token-prediction modules"):
        hf_config_from_model(cfg, "deepseek_v2")
