"""Loading cubins and launching them with the CUDA driver API (cuda.bindings.driver), on
torch's current stream and in the primary context of the tensors' device, which is the one
torch itself uses."""

from __future__ import annotations

import torch

from ..compiled import Binary, Instance, PackedArguments, cached_binary
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

    return cached_binary("cuda", nvrtc.version(), arch, instance, lambda: nvrtc.code_of(instance, arch))


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
    attributes = driver.CUfunction_attribute
    if instance.shared:
        # past 48 KB with the static shared memory a launch needs the kernel's leave; its loads go to
        # shared memory (cp.async.cg), not through L1: all of that memory as shared memory
        _check(driver.cuFuncSetAttribute(function, attributes.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, instance.shared),
               f"{instance.name_expression}'s shared memory")
        _check(driver.cuFuncSetAttribute(function, attributes.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100),
               f"{instance.name_expression}'s carveout")
    return function


def function(instance: Instance, device_index: int):
    key = (device_index, instance)
    loaded = _functions.get(key)
    if loaded is None:
        loaded = _functions[key] = _load(instance, device_index)
    return loaded


def bind(instance: Instance, device_index: int):
    """A launcher of instance on the device and that device's current stream:
    (grid, packed-arguments address) -> None, the function loaded once."""
    from cuda.bindings import driver

    kernel = function(instance, device_index)
    block, shared = instance.block, instance.shared
    current_stream = torch._C._cuda_getCurrentRawStream
    launch_kernel = driver.cuLaunchKernel
    success = driver.CUresult.CUDA_SUCCESS
    stale_context = (driver.CUresult.CUDA_ERROR_INVALID_CONTEXT, driver.CUresult.CUDA_ERROR_INVALID_HANDLE)

    def launch(grid: tuple, parameters: int) -> None:
        stream = current_stream(device_index)
        result = launch_kernel(kernel, *grid, block, 1, 1, shared, stream, parameters, 0)
        if result[0] != success:
            if result[0] in stale_context:  # a thread that never used this device, or another device's context
                _make_context_current(device_index)
                result = launch_kernel(kernel, *grid, block, 1, 1, shared, stream, parameters, 0)
            _check(result, f"launching {instance.name_expression}")

    return launch


def launch(instance: Instance, grid: tuple, arguments: PackedArguments, device_index: int) -> None:
    """Launches instance on the device and that device's current stream."""
    bind(instance, device_index)(grid, arguments.address)
