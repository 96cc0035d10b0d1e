"""Loading cubins and launching them with the CUDA driver API (cuda.bindings.driver), on
torch's current stream and in the primary context of the tensors' device, which is the one
torch itself uses."""

from __future__ import annotations

import torch

from ..compiled import Binary, Instance, cached_binary, pack_arguments
from . import nvrtc

_functions: dict = {}  # (device index, Instance) -> CUfunction


class LaunchError(RuntimeError):
    pass


def _check(result, what: str) -> tuple:
    from cuda.bindings import driver

    error, *values = result
    if error != driver.CUresult.CUDA_SUCCESS:
        raise LaunchError(f"{what} failed: {error.name}")
    return tuple(values)


def arch_of(device_index: int) -> str:
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


def cubin(instance: Instance, arch: str) -> Binary:
    """The instance's cubin for arch, from the disk cache or compiled now."""

    def compile_now() -> tuple:
        compiled = nvrtc.compile_instance(instance, arch)
        return compiled.cubin, compiled.lowered_name

    return cached_binary("cuda", nvrtc.version(), arch, instance, compile_now)


def _make_context_current(device_index: int) -> None:
    """Binds the device's primary context (torch's) to this thread: threads that have not
    yet used the device through torch have none, and driver calls need one."""
    from cuda.bindings import driver

    torch.cuda.init()
    _check(driver.cuInit(0), "cuInit")
    (device,) = _check(driver.cuDeviceGet(device_index), "cuDeviceGet")
    (context,) = _check(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    _check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")


def _load(instance: Instance, device_index: int):
    from cuda.bindings import driver

    binary, lowered, _ = cubin(instance, arch_of(device_index))
    _make_context_current(device_index)
    (module,) = _check(driver.cuModuleLoadData(binary), f"loading {instance.name_expression}")
    (function,) = _check(driver.cuModuleGetFunction(module, lowered), f"finding {instance.name_expression}")
    return function


def function(instance: Instance, device_index: int):
    key = (device_index, instance)
    loaded = _functions.get(key)
    if loaded is None:
        loaded = _functions[key] = _load(instance, device_index)
    return loaded


def launch(instance: Instance, grid: tuple, arguments: list, like: torch.Tensor) -> None:
    """Launches instance on like's device and that device's current stream."""
    from cuda.bindings import driver

    device_index = like.get_device()
    kernel = function(instance, device_index)
    keep_alive, parameters = pack_arguments(arguments)
    stream = torch._C._cuda_getCurrentRawStream(device_index)
    result = driver.cuLaunchKernel(kernel, *grid, instance.block, 1, 1, 0, stream, parameters, 0)
    if result[0] == driver.CUresult.CUDA_ERROR_INVALID_CONTEXT or result[0] == driver.CUresult.CUDA_ERROR_INVALID_HANDLE:
        _make_context_current(device_index)  # a thread that never used this device, or another device's context
        result = driver.cuLaunchKernel(kernel, *grid, instance.block, 1, 1, 0, stream, parameters, 0)
    _check(result, f"launching {instance.name_expression}")
    del keep_alive
