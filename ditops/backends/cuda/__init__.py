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


# One function per op, named as the op: what the registry looks up.
KERNELS = CompiledOps(launch, bind)  # the op launches, for benchmarks/call_overhead.py
globals().update(KERNELS.functions())
