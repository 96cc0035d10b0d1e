"""Loading code objects and launching them with the HIP module API (hip-python), on torch's
current stream (ROCm builds of torch expose AMD GPUs as torch.cuda). Not yet run on AMD
hardware: everything up to the launch call runs in CI."""

from __future__ import annotations

import torch

from ...dispatch.device import device_of
from ..compiled import Binary, Instance, PackedArguments, cached_binary
from . import hiprtc

_functions: dict = {}  # (device index, Instance) -> hipFunction_t


class LaunchError(RuntimeError):
    pass


def _check(result, what: str) -> tuple:
    from hip import hip

    error, *values = result if isinstance(result, tuple) else (result,)
    if error != hip.hipError_t.hipSuccess:
        raise LaunchError(f"{what} failed: {error.name}")
    return tuple(values)


def code_object(instance: Instance, arch: str) -> Binary:
    """The instance's code object for arch, from the disk cache or compiled now."""

    def compile_now() -> tuple:
        compiled = hiprtc.compile_instances([instance], arch)
        return compiled.code, compiled.lowered_names[instance]

    return cached_binary("rocm", hiprtc.version(), arch, instance, compile_now)


def function(instance: Instance, device_index: int):
    from hip import hip

    key = (device_index, instance)
    loaded = _functions.get(key)
    if loaded is None:
        code, lowered, _ = code_object(instance, device_of(device_index).arch)
        with torch.cuda.device(device_index):  # the module belongs to the current device's context
            (module,) = _check(hip.hipModuleLoadData(code), f"loading {instance.name_expression}")
            (loaded,) = _check(hip.hipModuleGetFunction(module, lowered), f"finding {instance.name_expression}")
        _functions[key] = loaded
    return loaded


def bind(instance: Instance, device_index: int):
    """A launcher of instance on the device and that device's current stream:
    (grid, packed-arguments address) -> None, the function loaded once."""
    from hip import hip

    kernel = function(instance, device_index)
    block = instance.block
    current_stream = torch._C._cuda_getCurrentRawStream

    def launch(grid: tuple, parameters: int) -> None:
        result = hip.hipModuleLaunchKernel(kernel, *grid, block, 1, 1, instance.shared, current_stream(device_index), parameters, None)
        _check(result, f"launching {instance.name_expression}")

    return launch


def launch(instance: Instance, grid: tuple, arguments: PackedArguments, device_index: int) -> None:
    """Launches instance on the device and that device's current stream."""
    with torch.cuda.device(device_index):  # HIP launches on the current device's context
        bind(instance, device_index)(grid, arguments.address)
