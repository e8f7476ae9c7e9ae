"""`xmoe export`, `xmoe eval` and `xmoe generate`: using a model from a run directory or a Hugging Face directory.

A SOURCE is either a Hugging Face model directory (config.json + safetensors) or an xmoe run directory (its
latest checkpoint, or the one ``--step`` names). Text goes through the source's ``tokenizer.json`` when it has
one (a run started with ``--init-from`` keeps the imported one), else it is byte-level (one token per byte).
`eval` and `generate` build the model with the kernels section the run recorded in the checkpoint's meta.json (a
Hugging Face directory, which has none: the environment's defaults), resolved for their device as a run's is.
A run trained with FP8 experts is read on a device without FP8 matrix instructions (a CPU) with its experts
unquantised (its weights are full precision), saying so on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from xmoe.checks import missing, writing
from xmoe.config import KernelConfig, ModelConfig, MoEConfig
from xmoe.model_config import upgrade_moe_fields

# torch and the checkpoint readers are imported inside the commands: `xmoe --help` builds these parsers without them
# what an export writes into a Hugging Face directory, and so what --overwrite removes from one
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "model.safetensors.index.json",
)


def model_config_from_dict(values: dict) -> ModelConfig:
    """A ModelConfig from its asdict() form (as a run's checkpoint meta.json stores it)."""
    return ModelConfig(**{**values, "moe": MoEConfig(**upgrade_moe_fields(values["moe"]))})


def _run_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The checkpoint of ``step`` in a run directory, or its newest whose files check out."""
    from xmoe.train.rundir import RunDir

    return RunDir(run_dir).checkpoint(step)


def load_source(
    source: str,
    step: int | None = None,
    device: str = "cpu",
    *,
    compute: bool = True,
    check: Callable[[ModelConfig], None] | None = None,
):
    """(model in eval mode, tokenizer path or None, imported HF config or None, the kernels section it was built
    with: KernelConfig) of a SOURCE (``compute``: for a forward on ``device``, not only its weights).
    A run that is still training may prune the checkpoint being read: it is pinned while read (and picked again if
    it went first). ``check``: called with the model's config before anything is allocated (the memory
    pre-flight)."""
    from xmoe.hf.checkpoint import RUN_HF_CONFIG, RUN_TOKENIZER, read_json
    from xmoe.train.rundir import RunDir

    path = Path(source)
    if not path.exists():
        raise missing(path, "source", "pass an xmoe run directory or a Hugging Face directory")
    if (path / "config.json").is_file():
        return _load_hf_dir(path, step, device, check)
    run_dir = RunDir(path)
    if not run_dir.has_checkpoints():
        raise FileNotFoundError(
            f"{path} is neither a Hugging Face directory (config.json) nor an xmoe run directory (checkpoints/)"
        )
    from xmoe.kernels.choice import recorded_config

    def read(found: Path):  # built with the kernels section of the meta.json of the checkpoint whose weights are read
        meta = run_dir.read_meta(found)
        return _run_model(found, meta, device, recorded_config(meta["config"]), check)

    # the note once, for the checkpoint read (a read retried after a prune builds the model again)
    model, kernels, note = run_dir.read_pinned(lambda: _run_checkpoint(path, step), read)
    if note and compute:
        print(note, file=sys.stderr)
    hf_file, tokenizer = path / RUN_HF_CONFIG, path / RUN_TOKENIZER
    imported = (
        read_json(hf_file, "copy the config.json of the directory the run was imported from to it")
        if hf_file.is_file()
        else None
    )
    return model.eval(), str(tokenizer) if tokenizer.is_file() else None, imported, kernels


def _prompt_ids(args: argparse.Namespace, tokenizer: str | None, vocab: int) -> list[int]:
    """The prompt's token ids: --prompt-ids as given, or --prompt tokenised; each inside the vocabulary."""
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--prompt-ids ({args.prompt_ids!r}) must be comma-separated integers") from None
        if not ids:
            raise ValueError(f"--prompt-ids ({args.prompt_ids!r}) holds no token id; give at least one")
    else:
        assert args.prompt is not None  # the parser requires --prompt or --prompt-ids
        ids = _encode(args.prompt, tokenizer)
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    return ids


def _end_token(eos: int | None, hf: dict | None, vocab: int) -> int | None:
    """--eos-id (-1: none), else the imported model's eos_token_id."""
    if eos is not None and not -1 <= eos < vocab:
        raise ValueError(
            f"--eos-id ({eos}) is outside the vocabulary [0, {vocab}): no token could end the text; "
            "pass -1 for no end token"
        )
    if eos is None and hf is not None and isinstance(hf.get("eos_token_id"), int):
        eos = hf["eos_token_id"]
    return eos


def _load_hf_dir(path: Path, step: int | None, device: str, check: Callable[[ModelConfig], None] | None):
    """load_source's result for a Hugging Face directory: its sizes checked before anything is allocated; the
    environment's kernels section (it records none)."""
    from xmoe.hf.checkpoint import RUN_TOKENIZER, check_sizes, read_model_config
    from xmoe.parallel.build import build_model

    if step is not None:
        raise ValueError(f"--step ({step}) applies to run directories; {path} is a Hugging Face directory")
    hf, cfg = read_model_config(path)
    check_sizes(path, hf, cfg)  # before anything is allocated
    if check is not None:
        check(cfg)
    kernels = KernelConfig()  # a Hugging Face directory records none: the environment's defaults
    model = build_model(cfg, device, init_from=str(path), kernels=kernels).model
    model.hf_config = hf  # type: ignore[assignment]  # a plain attribute (nn.Module's __setattr__ takes modules)
    tokenizer = path / RUN_TOKENIZER
    return model.eval(), str(tokenizer) if tokenizer.is_file() else None, hf, kernels


def _kernels(model, kernels, num_tokens: int, device: str):
    """What the kernel choice ``kernels`` of a loaded model (built with it) comes to on ``device`` (fp32, as eval and
    generate compute) for ``num_tokens`` tokens per forward: its record."""
    import torch

    from xmoe.kernels.choice import resolve_layer

    return resolve_layer(model.cfg.moe, kernels, num_tokens, torch.device(device), torch.float32)


def _run_model(
    found: Path, meta: dict, device: str, kernels: KernelConfig, check: Callable[[ModelConfig], None] | None = None
):
    """(the model of run checkpoint ``found``, built from the config of its ``meta`` (meta.json's) with the kernels
    section ``kernels``, that section, a note for the user or None): FP8 experts that cannot run on ``device`` are
    set aside, and the note says so."""
    from xmoe.parallel.build import build_model
    from xmoe.train.checkpoint import load_checkpoint

    cfg = model_config_from_dict(meta["config"]["model"])
    note = None
    if cfg.moe.fp8 == "experts":
        import torch

        from xmoe.kernels.choice import fp8_refusal

        refusal = fp8_refusal(torch.device(device))
        # the weights are full precision: the experts run unquantised, which the user is told (the refusal without
        # the fix it ends with, which is for training)
        if refusal:
            cfg = replace(cfg, moe=replace(cfg.moe, fp8="off"))
            note = (
                f"xmoe: note: {found} was trained with FP8 experts (moe.fp8='experts'), which cannot run on "
                f"{device} ({refusal.rsplit(': ', 1)[0]}); its experts run unquantised, so results can differ "
                "slightly from a run on a GPU with FP8 matrix instructions"
            )
    if kernels.wgrad == "fp8" and cfg.moe.fp8 != "experts":  # FP8 experts set aside on this device
        kernels = replace(kernels, wgrad="auto")  # no weight gradient runs here; "fp8" needs FP8 experts
    if check is not None:
        check(cfg)
    # meta build with the recorded kernels section, then the checkpoint's values over the initial ones
    model = build_model(cfg, device, kernels=kernels).model
    load_checkpoint(found, model, restore_rng=False, restore_extra=False)
    return model, kernels, note


def _encode(text: str, tokenizer: str | None) -> list[int]:
    if tokenizer is None:
        return list(text.encode("utf-8"))
    from xmoe.train.data import load_tokenizer

    return load_tokenizer(tokenizer)[0].encode(text).ids


def _decode(ids: list[int], tokenizer: str | None) -> str:
    if tokenizer is None:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    from xmoe.train.data import load_tokenizer

    return load_tokenizer(tokenizer)[0].decode(ids)


def _add_fit_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fit",
        choices=("check", "off"),
        default="check",
        help="memory pre-flight before the model is built: check (default: refuse a model and input predicted "
        "not to fit the device's free memory), off",
    )


def _memory_check(args: argparse.Namespace, tokens: int, cache_tokens: int, what: str):
    """load_source's check: the memory pre-flight (xmoe/train/preflight.py) of a forward over ``tokens`` tokens
    with a KV cache of ``cache_tokens``; ``what`` names the flags that set them."""
    import torch

    from xmoe.train.preflight import check_inference

    def check(cfg: ModelConfig) -> None:
        check_inference(cfg, tokens, torch.device(args.device), args.fit, cache_tokens=cache_tokens, what=what)

    return check


# ------------------------------------------------------------------------------------------------ export


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="xmoe run directory (its checkpoints/)")
    p.add_argument("--hf", required=True, metavar="OUT_DIR", help="Hugging Face directory to write")
    p.add_argument("--step", type=int, help="checkpoint step to export (default: the latest)")
    p.add_argument(
        "--family",
        help="qwen3_moe, qwen2_moe, mixtral, olmoe, deepseek_v3 or deepseek_v2 (default: the imported one, else "
        "inferred from the architecture)",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="shard size limit in GiB (index past it)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the model files of a Hugging Face directory already at --hf (else it must be empty)",
    )


def _check_export_target(out: Path, overwrite: bool) -> None:
    """Refuse a target inside a run directory (its readers would take the export for the run), and a non-empty
    one unless ``overwrite`` (then it must be a model directory: its model files are replaced)."""
    from xmoe.train.rundir import RunDir

    for parent in (out.resolve(), *out.resolve().parents):
        if RunDir(parent).is_run():
            raise ValueError(
                f"--hf {out} is inside the run directory {parent}, where eval, export and generate "
                f"would read it instead of the run's checkpoints; write it elsewhere, e.g. --hf "
                f"{parent.with_name(parent.name + '-hf')}"
            )
    if out.exists() and not out.is_dir():
        raise ValueError(f"--hf {out} is a file; pass a directory")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries and not overwrite:
        raise ValueError(
            f"--hf {out} is not empty ({', '.join(entries[:4])}{', ...' if len(entries) > 4 else ''}); "
            "pass --overwrite to replace the model in it, or choose an empty or new directory"
        )
    if entries and not (out / "config.json").is_file():
        raise ValueError(
            f"--overwrite replaces a Hugging Face model directory, and {out} holds no config.json; "
            "choose an empty or new directory"
        )


def _move_into(staged: Path, out: Path) -> None:
    """Replace ``out``'s model files by those written to ``staged`` (a sibling), then remove ``staged``: a failed
    export never leaves ``out`` half written, and no stale shard, index or config of an earlier one stays."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    old = [p for p in out.iterdir() if p.name in MODEL_FILES or p.name.endswith(".safetensors")]
    trash = staged.with_name(staged.name + "-old")
    trash.mkdir()
    for path in old:
        path.rename(trash / path.name)
    for path in staged.iterdir():
        path.rename(out / path.name)
    staged.rmdir()
    shutil.rmtree(trash)


def run_export(args: argparse.Namespace) -> Path:
    import math
    import secrets
    import shutil

    import torch

    from xmoe.hf.checkpoint import RUN_TOKENIZER, save_pretrained

    if (Path(args.run_dir) / "config.json").is_file():
        raise ValueError(f"{args.run_dir} is already a Hugging Face directory; export takes an xmoe run directory")
    if not (args.max_shard_gb > 0 and math.isfinite(args.max_shard_gb)):
        raise ValueError(f"--max-shard-gb ({args.max_shard_gb:g}) must be a number of GiB > 0, e.g. 5")
    out = Path(args.hf)
    _check_export_target(out, args.overwrite)
    model, tokenizer, hf, _ = load_source(args.run_dir, args.step, compute=False)  # weights only
    family = args.family or (hf or {}).get("model_type")
    staged = out.parent / f".{out.name}.tmp-{secrets.token_hex(4)}"
    try:
        save_pretrained(
            model,
            staged,
            family=family,
            base_config=hf,
            dtype=getattr(torch, args.dtype),
            max_shard_bytes=int(args.max_shard_gb * 2**30),
        )
        if tokenizer is not None:
            with writing(staged / RUN_TOKENIZER):
                shutil.copyfile(tokenizer, staged / RUN_TOKENIZER)  # its mode from the umask, as the model files
        _move_into(staged, out)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    print(f"wrote {out} ({json.loads((out / 'config.json').read_text())['model_type']})")
    return out


# -------------------------------------------------------------------------------------------------- eval


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="xmoe run directory or Hugging Face directory")
    p.add_argument("--data", required=True, help=".txt (tokenized with the source's tokenizer), .npy or .bin")
    p.add_argument("--step", type=int, help="run checkpoint step (default: the latest)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per window")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward")
    p.add_argument("--max-windows", type=int, default=0, help="evaluate at most this many windows (0: all)")
    p.add_argument("--device", default="cpu")
    _add_fit_argument(p)


def run_eval(args: argparse.Namespace) -> dict:
    import torch

    from xmoe.train.cli import check_device
    from xmoe.train.evaluate import bits_per_byte, evaluate, perplexity, text_bytes_of, validation_windows

    args.device = check_device(args.device)
    for name in ("seq_len", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be >= 1")
    if args.max_windows < 0:
        raise ValueError(f"--max-windows ({args.max_windows}) must be >= 0 (0: every window)")
    tokens = args.batch_size * args.seq_len
    model, tokenizer, _, kernels = load_source(
        args.source, args.step, args.device, check=_memory_check(args, tokens, 0, "--batch-size or --seq-len")
    )
    if args.seq_len > model.cfg.max_seq_len:
        raise ValueError(f"--seq-len ({args.seq_len}) exceeds the model's max_seq_len ({model.cfg.max_seq_len})")
    text = args.data.endswith(".txt")
    windows = validation_windows(
        args.data, args.seq_len, model.cfg.vocab_size, args.max_windows, tokenizer=tokenizer or "bytes"
    )
    choice = _kernels(model, kernels, args.batch_size * args.seq_len, args.device)
    result: dict[str, Any] = evaluate(model, windows, args.batch_size, torch.device(args.device))
    num_bytes = text_bytes_of(windows, tokenizer) if text else None
    result.update(
        perplexity=perplexity(result["loss"]),
        bits_per_byte=bits_per_byte(result["loss"], result["tokens"], num_bytes),
        windows=len(windows),
        kernels=choice.record(),
    )
    print(json.dumps(result))
    return result


# ---------------------------------------------------------------------------------------------- generate


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="xmoe run directory or Hugging Face directory")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--eos-id", type=int, help="stop at this token (default: the HF config's eos_token_id; -1: at none)")
    p.add_argument("--step", type=int, help="run checkpoint step (default: the latest)")
    p.add_argument("--ids", action="store_true", help="print the generated token ids instead of text")
    p.add_argument("--device", default="cpu")
    _add_fit_argument(p)


def run_generate(args: argparse.Namespace) -> list[int]:
    import torch

    from xmoe.model.generate import generate
    from xmoe.train.cli import check_device

    args.device = check_device(args.device)
    if not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed ({args.seed}) must be in [0, 2**63)")
    if args.prompt is not None and not args.prompt:
        raise ValueError("--prompt is empty; give at least one character of text (or token ids with --prompt-ids)")
    # the prompt's tokens, at most its bytes before it is tokenised: the prefill's forward and the cache to fill
    prompt_tokens = (
        len(args.prompt_ids.split(",")) if args.prompt_ids is not None else len((args.prompt or "").encode())
    )
    check = _memory_check(
        args, prompt_tokens, prompt_tokens + max(args.max_new_tokens, 0), "the prompt or --max-new-tokens"
    )
    model, tokenizer, hf, _ = load_source(args.source, args.step, args.device, check=check)
    ids = _prompt_ids(args, tokenizer, model.cfg.vocab_size)
    eos = _end_token(args.eos_id, hf, model.cfg.vocab_size)
    prompt = torch.tensor([ids], dtype=torch.long, device=args.device)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    out = generate(
        model,
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        eos_id=eos,
        generator=generator,
    )[0, len(ids) :].tolist()
    print(",".join(map(str, out)) if args.ids else _decode(ids + out, tokenizer))
    sys.stdout.flush()
    return out
