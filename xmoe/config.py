"""Typed configuration for every xmoe component.

One dataclass per component, validated on construction (the checks in xmoe/checks.py): a value a user can get
wrong raises ``ValueError`` naming the value and the fix. Presets are plain functions returning configs. The model's
own configs (``MoEConfig``, ``ModelConfig``) live in xmoe/model_config.py and are re-exported here; this module
adds how a run trains (``TrainConfig``), is laid out (``ParallelConfig``), computes (``KernelConfig``), what it
trains on (``DataConfig``), and ``RunConfig``, all of them together.
"""

from __future__ import annotations

import argparse
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import ClassVar, Literal, TypeVar, get_args

from xmoe.checks import check_types, positive
from xmoe.checks import missing as missing  # re-exported: the commands import it from here
from xmoe.model_config import ModelConfig as ModelConfig  # re-exported with the run's configs: one import for all
from xmoe.model_config import MoEConfig as MoEConfig
from xmoe.model_config import yarn_mscale as yarn_mscale

WgradEngine = Literal["auto", "triton", "grouped_mm", "fp8"]
Placement = Literal["ep_first", "dp_first"]
EpOverlap = Literal["auto", "off", "shared", "chunks"]
OPTIMIZERS = ("auto", "torch", "triton")  # train.optimizer: xmoe/train/optim.py's build_optimizer
RECOMPUTE_MODES = ("none", "moe", "full")  # cheapest first: the planner's search prefers them in this order
COMPILE_MODES = ("auto", "on", "off")
# `xmoe train --fit`: the memory pre-flight (xmoe/train/preflight.py) refuses, adapts the run, or is skipped
FIT_MODES = ("check", "auto", "off")


@dataclass
class ParallelConfig:
    """Parallel degrees. world = dp * ep * tp; see xmoe/parallel/dims.py for how the mesh is laid out.

    ``placement``: "ep_first" packs an EP group into consecutive ranks (inside a node when it fits);
    "dp_first" strides it across nodes. ``gpus_per_node`` = None reads LOCAL_WORLD_SIZE from the launcher.
    ``timeout``: seconds a collective waits for the slowest rank before the run fails (every process group's
    timeout; torch's default is 30 minutes, which a frozen rank makes the others wait in silence).
    ``ep_overlap``: what overlaps the expert-parallel all-to-alls (xmoe/moe/routed.py): "off", "shared" (the shared
    experts), "chunks" (``ep_chunks`` chunks of a layer's tokens pipelined against each other's expert GEMMs), or
    "auto": the planner's choice for the run's layout (nothing to overlap with ep == 1).
    """

    dp: int = 1
    ep: int = 1
    tp: int = 1
    gpus_per_node: int | None = None
    placement: Placement = "ep_first"
    sequence_parallel: bool = False  # with tp > 1: norms on 1/tp of the positions (Megatron-style SP)
    timeout: float = 1800.0
    ep_overlap: EpOverlap = "auto"
    ep_chunks: int = 2
    section: ClassVar[str] = "parallel"

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("dp", "ep", "tp"):
            positive(name, getattr(self, name))
        if self.gpus_per_node is not None:
            positive("gpus_per_node", self.gpus_per_node)
        positive("timeout", self.timeout)
        if self.placement not in ("ep_first", "dp_first"):
            raise ValueError(f"placement ({self.placement!r}) must be 'ep_first' or 'dp_first'")
        if self.ep_overlap not in get_args(EpOverlap):
            raise ValueError(f"ep_overlap ({self.ep_overlap!r}) must be one of {', '.join(get_args(EpOverlap))}")
        positive("ep_chunks", self.ep_chunks)
        if self.sequence_parallel and self.tp == 1:
            warnings.warn("sequence_parallel does nothing with tp == 1", stacklevel=2)

    @property
    def world_size(self) -> int:
        return self.dp * self.ep * self.tp


@dataclass
class TrainConfig:
    """Optimisation and run settings for ``xmoe train``."""

    steps: int = 300
    global_batch_size: int = 16  # sequences per optimizer step, summed over data-parallel ranks
    micro_batch_size: int = 0  # sequences per forward pass per rank (0: global / dp, no accumulation)
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    ckpt_every: int = 100  # 0: no checkpoints (benchmark runs)
    keep_last: int = 2
    tensorboard: bool = False
    eval_every: int = 0  # validation loss every N steps (0: at the end only), when there is validation data
    val_fraction: float = 0.0  # hold out this fraction of the data for validation (0: none, unless --val-data)
    val_windows: int = 64  # validation windows of seq_len tokens evaluated each time (0: all)
    compile: str = "auto"  # torch.compile regions: "auto" (GPU without EP/TP), "on", "off"
    recompute: str = "none"  # activation recompute: "none", "moe" (MoE FFN branches), "full" (whole blocks)
    # AdamW's implementation: "auto" (xmoe's Triton AdamW on a GPU with plain tensors and the Triton backend, else
    # torch's), "torch" (torch's: fused on a GPU), "triton" (xmoe's, or an error where it cannot run)
    optimizer: str = "auto"
    # a step whose loss or gradient norm is not finite: 0 stops the run at once (the check rides on the logging
    # and checkpoint steps' existing host syncs); N > 0 skips up to N such steps in a row without updating the
    # weights (this needs one host sync per step) and stops at the (N+1)-th
    nonfinite_skips: int = 0
    # the same run twice gives the same bits on a GPU too (torch's deterministic algorithms, SDPA's flash and
    # plain kernels only, the compiler's choices made without timing them); may cost speed
    deterministic: bool = False
    section: ClassVar[str] = "train"

    def __post_init__(self) -> None:
        check_types(self)
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"train.compile ({self.compile!r}) must be 'auto', 'on' or 'off'")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"train.recompute ({self.recompute!r}) must be 'none', 'moe' or 'full'")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"train.optimizer ({self.optimizer!r}) must be 'auto', 'torch' or 'triton'")
        for name in ("steps", "global_batch_size", "seq_len", "lr", "log_every", "keep_last"):
            positive(name, getattr(self, name))
        if not 0 <= self.seed < 2**63:  # torch.manual_seed takes a 64-bit signed integer
            raise ValueError(f"seed ({self.seed}) must be in [0, 2**63)")
        if self.nonfinite_skips < 0:
            raise ValueError(f"nonfinite_skips ({self.nonfinite_skips}) must be >= 0 (0: stop at the first)")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be in [0, 1)")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"weight_decay ({self.weight_decay}) must be a finite number >= 0")
        if self.ckpt_every < 0:
            raise ValueError(f"ckpt_every ({self.ckpt_every}) must be >= 0 (0 disables checkpoints)")
        if self.micro_batch_size < 0:
            raise ValueError(f"micro_batch_size ({self.micro_batch_size}) must be >= 0 (0: no accumulation)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio ({self.min_lr_ratio}) must be in [0, 1]")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be >= 0")
        if self.eval_every < 0 or self.val_windows < 0:
            raise ValueError(f"eval_every ({self.eval_every}) and val_windows ({self.val_windows}) must be >= 0")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction ({self.val_fraction}) must be in [0, 1) (0: no held-out data)")
        if not (self.grad_clip >= 0 and math.isfinite(self.grad_clip)):
            raise ValueError(f"grad_clip ({self.grad_clip}) must be finite and >= 0 (0 disables clipping)")


_Choice = TypeVar("_Choice", bound=str)


def _from_env(name: str, field_name: str, choices: tuple[_Choice, ...], default: _Choice) -> _Choice:
    """The environment's default of ``kernels.<field_name>``, checked when a KernelConfig is made."""
    value = os.environ.get(name) or default
    if value not in choices:
        raise ValueError(
            f"{name} ({value!r}) must be one of {', '.join(choices)} (it sets the default of "
            f"kernels.{field_name}); set one of them or unset it"
        )
    return value


@dataclass
class KernelConfig:
    """How the Triton kernels compute (docs/kernels.md, "Kernel choices"): speed, memory and rounding, never the
    model. Defaults come from the environment (XMOE_WGRAD, XMOE_AUTOTUNE=1), read when the config is made; the
    trainer applies its run's choice to the kernels (``xmoe.kernels.choice``) and records what it resolved to; the
    other commands that run the model apply theirs (docs/kernels.md, "Kernel choices").

    ``wgrad``: what computes the fused backward's weight gradients: "auto" (torch._grouped_mm over gathered rows on
    sm_90 in bf16 with at least 128 experts per rank averaging at most 1024 rows, the Triton kernels elsewhere),
    "triton", "grouped_mm" (wherever torch._grouped_mm runs: bf16, H and F multiples of 8), or "fp8" (with
    moe.fp8 = "experts" only: the weight gradients in FP8 too, from operands quantised in 128 x 1 groups).
    ``autotune``: on a GPU, time every tile candidate of a shape class at its first launch and keep the fastest
    (cached in $XMOE_CACHE_DIR, default ~/.cache/xmoe) instead of the shipped table or the heuristic."""

    wgrad: WgradEngine = field(default_factory=lambda: _from_env("XMOE_WGRAD", "wgrad", get_args(WgradEngine), "auto"))
    autotune: bool = field(default_factory=lambda: _from_env("XMOE_AUTOTUNE", "autotune", ("0", "1"), "0") == "1")
    section: ClassVar[str] = "kernels"

    def __post_init__(self) -> None:
        check_types(self)


def add_kernel_arguments(p: argparse._ActionsContainer, when: str = "") -> None:
    """--wgrad and --autotune, the kernels section's flags, their help starting with ``when`` (e.g. "with --measure: ").
    `xmoe train` merges them into its config (xmoe/train/run_config.py); the other commands take ``kernel_config``."""
    p.add_argument(
        "--wgrad",
        choices=get_args(WgradEngine),
        help=f"{when}what computes the Triton backward's weight gradients (kernels.wgrad; default $XMOE_WGRAD, "
        "else auto: torch._grouped_mm on sm_90 GPUs with >= 128 experts per rank, else Triton; fp8: in FP8, "
        "with --fp8 experts only)",
    )
    p.add_argument(
        "--autotune",
        action=argparse.BooleanOptionalAction,
        help=f"{when}time every tile candidate of each new GPU kernel shape and keep the fastest (kernels.autotune;"
        " default on if XMOE_AUTOTUNE=1, else off: the shipped tile table or the heuristic)",
    )


def check_fp8_wgrad(moe: MoEConfig, kernels: KernelConfig) -> None:
    """FP8 weight gradients exist only for FP8 experts: refused otherwise, naming both settings and the fix."""
    if kernels.wgrad == "fp8" and moe.fp8 != "experts":
        raise ValueError(
            "kernels.wgrad='fp8' computes the FP8 experts' weight gradients in FP8 and needs moe.fp8='experts' "
            "(--fp8 experts); with bf16 experts set kernels.wgrad to auto, triton or grouped_mm (--wgrad)"
        )


def kernel_config(args: argparse.Namespace) -> KernelConfig:
    """The kernels section of a command without a run config: its --wgrad and --autotune over the environment's
    defaults."""
    return KernelConfig(**{k: v for k in ("wgrad", "autotune") if (v := getattr(args, k, None)) is not None})


@dataclass
class DataConfig:
    """What a run trains on: ``path``, "markov[:opt=value,...]" (the synthetic source), a .npy / .bin / .txt file,
    a prepared set (`xmoe data prepare`) or a weighted mixture of files and sets ("0.7:data/web,0.3:data/code",
    docs/data.md); ``val_path``, validation data of the same kinds, a mixture evaluated source by source (None:
    train.val_fraction of ``path``, or none); ``tokenizer``, for .txt files: "bytes" or a tokenizers JSON file;
    ``documents``: "concat" (windows run across documents) or "mask" (each batch says where documents start; the
    model attends within a document and restarts its positions there); ``eos_id``: the end-of-document token of
    token and text files, for "mask" (prepared sets record theirs)."""

    path: str = "markov"
    val_path: str | None = None
    tokenizer: str = "bytes"
    documents: Literal["concat", "mask"] = "concat"
    eos_id: int | None = None
    section: ClassVar[str] = "data"

    def __post_init__(self) -> None:
        check_types(self)
        for name, fix in (
            ("path", "'markov', a .npy / .bin / .txt file, a prepared set or a mixture"),
            ("val_path", "a file, 'markov' or null"),
            ("tokenizer", "'bytes' or a tokenizers JSON file"),
        ):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"data.{name} ({value!r}) is empty; name {fix}")
        if self.eos_id is not None and self.eos_id < 0:
            raise ValueError(f"data.eos_id ({self.eos_id}) must be a token id >= 0, or null")


@dataclass
class RunConfig:
    """Everything one ``xmoe train`` run needs (a TOML file's worth: docs/example_run.toml): the model, how it is
    trained and laid out, its data, and where the model starts. ``init_from``: a Hugging Face directory whose
    weights replace the seeded initialisation (``model`` is then its architecture); ``preset``: the name of the
    preset ``model`` was made from, which labels the run's header and plot ("" for none)."""

    model: ModelConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    init_from: str | None = None
    preset: str = ""
    section: ClassVar[str] = ""  # its own fields are top-level keys of a config file

    def __post_init__(self) -> None:
        check_types(self)
        check_fp8_wgrad(self.model.moe, self.kernels)

    def batch_layout(self) -> tuple[int, int, int]:
        """(sequences per data-parallel rank per step, per micro-batch, micro-batches per step). Data is sharded over
        dp x ep ranks (TP peers read the same tokens); raises ValueError when the batch does not split evenly."""
        t, ranks = self.train, self.parallel.dp * self.parallel.ep
        if t.global_batch_size % ranks:
            raise ValueError(
                f"global batch ({t.global_batch_size}) must be divisible by the {ranks} data-parallel "
                "ranks; change --batch-size"
            )
        local = t.global_batch_size // ranks
        micro = t.micro_batch_size or local
        if local % micro:
            raise ValueError(f"per-rank batch ({local}) must be divisible by micro_batch_size ({micro})")
        if t.seq_len > self.model.max_seq_len:
            raise ValueError(f"seq_len ({t.seq_len}) exceeds the model's max_seq_len ({self.model.max_seq_len})")
        return local, micro, local // micro
