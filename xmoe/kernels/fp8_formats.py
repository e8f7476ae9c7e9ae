"""The FP8 formats the routed experts' FP8 path quantises into, and which one a device multiplies in.

Formats (``FORMATS``): e4m3fn (NVIDIA sm_89 and newer, AMD gfx950) and e4m3fnuz (AMD gfx942, bias 8, no negative
zero, largest value 240). ``fp8_format(device)`` names the one a device multiplies in, and refuses devices with no
FP8 matrix instructions, naming the device and the fix. Nothing here imports Triton; the quantisers and their
layouts are in fp8_quant.py (which re-exports these names).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xmoe.kernels._common import interpreting


@dataclass(frozen=True)
class Fp8Format:
    name: str
    dtype: torch.dtype  # its torch dtype (Triton: float8e4nv, float8e4b8)
    max: float  # largest finite value
    min_exp: int  # exponent of the smallest normal value (subnormals below share its spacing)

    def storage(self) -> torch.dtype:
        """What quantised tensors are held in: the FP8 dtype, or float32 holding its values under the interpreter."""
        return torch.float32 if interpreting() else self.dtype


FORMATS = {
    "e4m3fn": Fp8Format("e4m3fn", torch.float8_e4m3fn, 448.0, -6),
    "e4m3fnuz": Fp8Format("e4m3fnuz", torch.float8_e4m3fnuz, 240.0, -7),
}

FIX = "set moe.fp8='off' (xmoe train --fp8 off) to run the experts in bf16"


@torch.compiler.assume_constant_result  # a property of the device: a constant to torch.compile, traced once
def _format_name(device_type: str, device_index: int) -> str:
    if device_type != "cuda":
        if device_type == "cpu" and interpreting():
            return "e4m3fn"  # tests: the kernels in Triton's interpreter, FP8 values held in float32
        raise ValueError(
            f"moe.fp8='experts' needs a GPU with FP8 matrix instructions; a {device_type} device has none: {FIX}"
        )
    props = torch.cuda.get_device_properties(device_index)
    if torch.version.hip is not None:
        arch = props.gcnArchName.split(":")[0]
        if arch == "gfx942":
            return "e4m3fnuz"
        if arch == "gfx950":
            return "e4m3fn"
        raise ValueError(
            f"moe.fp8='experts' needs FP8 matrix instructions (AMD gfx942 or gfx950); {props.name} "
            f"({arch}) has none: {FIX}"
        )
    if (props.major, props.minor) >= (8, 9):
        return "e4m3fn"
    raise ValueError(
        f"moe.fp8='experts' needs FP8 matrix instructions (NVIDIA sm_89 or newer: Ada, Hopper, "
        f"Blackwell); {props.name} (sm_{props.major}{props.minor}) has none: {FIX}"
    )


def fp8_format(device: torch.device) -> Fp8Format:
    """The FP8 format this device's matrix instructions take; ValueError naming the device and the fix if none."""
    return FORMATS[_format_name(device.type, device.index or 0)]


def _format(fmt: str) -> Fp8Format:
    if fmt not in FORMATS:
        raise ValueError(f"FP8 format {fmt!r} must be one of {sorted(FORMATS)}")
    return FORMATS[fmt]


def format_constexprs(fmt: Fp8Format) -> dict:
    """The kernels' compile-time description of a format."""
    return dict(FP8_MAX=fmt.max, MIN_EXP=fmt.min_exp)
