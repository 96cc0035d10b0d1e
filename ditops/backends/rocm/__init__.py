"""The ROCm backend: the kernels of ditops/csrc (the CUDA backend's sources) compiled at run
time by hiprtc for the device's gfx arch, cached on disk (ditops/kernel_cache.py), loaded and
launched through hip-python on torch's current stream. Launch shapes and argument packing are
the CUDA backend's (ditops/backends/compiled.py); ditops/csrc/portability.cuh makes the
kernels correct for 64-wide wavefronts. Who may call it is in configs/registry.yaml.

Never run on AMD hardware: compiled for gfx90a (hiprtc) and gfx942 (clang) in CI."""

from __future__ import annotations

from typing import Optional

from ...dispatch.constraints import RELEASES
from ...dispatch.device import DeviceInfo
from ..compiled import CompiledOps
from . import hiprtc
from .driver import bind, launch


def available(device: DeviceInfo) -> Optional[str]:
    """Refused unless hiprtc really loads through hip-python here (hiprtc.load_error): the
    Triton backend then serves, and ``ditops info`` / ``explain`` show why."""
    if device.vendor != "rocm":
        return "compiles HIP for AMD GPUs only"
    return hiprtc.load_error()


# registry.yaml's min_rocm compares each arch's oldest ROCm release with the one loaded here.
RELEASES["rocm"] = hiprtc.rocm_release


# One kernel per op, named as the op: what the registry looks up (dispatch/contract.py).
_COMPILED = CompiledOps(launch, bind)
norm_scale_shift = _COMPILED.kernel(_COMPILED.norm_scale_shift_launch)
residual_norm_scale_shift = _COMPILED.kernel(_COMPILED.residual_norm_scale_shift_launch)
norm_scale_shift_select = _COMPILED.kernel(_COMPILED.norm_scale_shift_select_launch)
residual_norm_scale_shift_select = _COMPILED.kernel(_COMPILED.residual_norm_scale_shift_select_launch)
add_gate_norm = _COMPILED.kernel(_COMPILED.add_gate_norm_launch)
add_gate_norm_scale = _COMPILED.kernel(_COMPILED.add_gate_norm_scale_launch)
qk_norm_rope_ = _COMPILED.kernel(_COMPILED.qk_norm_rope__launch)
rope_ = _COMPILED.kernel(_COMPILED.rope__launch)
norm_scale_shift_fp8 = _COMPILED.kernel(_COMPILED.norm_scale_shift_fp8_launch)
residual_norm_scale_shift_fp8 = _COMPILED.kernel(_COMPILED.residual_norm_scale_shift_fp8_launch)
quantize_fp8 = _COMPILED.kernel(_COMPILED.quantize_fp8_launch)
norm_scale_shift_select_fp8 = _COMPILED.kernel(_COMPILED.norm_scale_shift_select_fp8_launch)
residual_norm_scale_shift_select_fp8 = _COMPILED.kernel(_COMPILED.residual_norm_scale_shift_select_fp8_launch)
add_gate_norm_scale_fp8 = _COMPILED.kernel(_COMPILED.add_gate_norm_scale_fp8_launch)
