"""The CUDA backend: the kernels of ditops/csrc compiled at run time by NVRTC for the exact
arch of the device, cached on disk (ditops/kernel_cache.py), loaded and launched through
cuda-python on torch's current stream. Launch shapes and argument packing are shared with the
ROCm backend (ditops/backends/compiled.py); who may call it is in configs/registry.yaml."""

from __future__ import annotations

from typing import Optional

from ...dispatch.device import DeviceInfo
from ..compiled import CompiledOps
from .driver import bind, launch


def available(device: DeviceInfo) -> Optional[str]:
    if device.vendor != "cuda":
        return "compiles CUDA C++ for NVIDIA GPUs only"
    try:
        from cuda.bindings import driver, nvrtc  # noqa: F401
    except ImportError as error:
        return f"needs cuda-python (pip install cuda-python): {error}"
    return None


# One kernel per op, named as the op: what the registry looks up (dispatch/contract.py).
KERNELS = CompiledOps(launch, bind)  # the op launches, for benchmarks/call_overhead.py
norm_scale_shift = KERNELS.kernel(KERNELS.norm_scale_shift_launch)
residual_norm_scale_shift = KERNELS.kernel(KERNELS.residual_norm_scale_shift_launch)
norm_scale_shift_select = KERNELS.kernel(KERNELS.norm_scale_shift_select_launch)
residual_norm_scale_shift_select = KERNELS.kernel(KERNELS.residual_norm_scale_shift_select_launch)
add_gate_norm = KERNELS.kernel(KERNELS.add_gate_norm_launch)
add_gate_norm_scale = KERNELS.kernel(KERNELS.add_gate_norm_scale_launch)
qk_norm_rope_ = KERNELS.kernel(KERNELS.qk_norm_rope__launch)
rope_ = KERNELS.kernel(KERNELS.rope__launch)
norm_scale_shift_fp8 = KERNELS.kernel(KERNELS.norm_scale_shift_fp8_launch)
residual_norm_scale_shift_fp8 = KERNELS.kernel(KERNELS.residual_norm_scale_shift_fp8_launch)
quantize_fp8 = KERNELS.kernel(KERNELS.quantize_fp8_launch)
norm_scale_shift_select_fp8 = KERNELS.kernel(KERNELS.norm_scale_shift_select_fp8_launch)
residual_norm_scale_shift_select_fp8 = KERNELS.kernel(KERNELS.residual_norm_scale_shift_select_fp8_launch)
add_gate_norm_scale_fp8 = KERNELS.kernel(KERNELS.add_gate_norm_scale_fp8_launch)
