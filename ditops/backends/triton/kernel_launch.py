"""One Triton kernel launch as data, and the three ways ditops issues it.

A backend function of this package computes a ``KernelLaunch`` (kernel, grid, arguments,
launch settings) from an op's arguments and outputs; it never launches by itself. Then:
- ``run`` launches it through Triton's normal ``kernel[grid](...)`` path (the uncached way,
  and the only one under the interpreter or on AMD);
- ``trace`` hands it to torch.compile through ``torch.library.wrap_triton``, so that Inductor
  launches the kernel from its own generated code;
- ``bind`` compiles it once and returns a launcher pre-bound to the compiled kernel, for
  every later call with the same call signature (ditops/ops.py keys its plans on that).
"""

from __future__ import annotations

import operator
import os
from typing import Callable, NamedTuple, Optional

import torch

from ...dispatch.signature import pointer_index


class KernelLaunch(NamedTuple):
    kernel: object  # a triton.jit function
    grid: tuple
    arguments: tuple  # positional, in the kernel's parameter order
    constexprs: dict  # the remaining parameters by name, plus num_warps


def run(launch: KernelLaunch) -> None:
    launch.kernel[launch.grid](*launch.arguments, **launch.constexprs)


def trace(launch: KernelLaunch) -> None:
    torch.library.wrap_triton(launch.kernel)[launch.grid](*launch.arguments, **launch.constexprs)


_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


def bound_launch_refusal() -> Optional[str]:
    """Why ``bind`` makes no launchers in this process (each launch then goes through
    Triton's own ``kernel[grid]``), or None."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1"
    if torch.version.hip is not None:
        return "ROCm torch: Triton's AMD backend specializes on buffer sizes"
    return None


def bind(launch: KernelLaunch, values: tuple, device_index: int) -> Optional[Callable[[tuple, tuple], None]]:
    """A launcher for every call whose tensors have this call's shapes, strides, dtypes,
    device and 16-byte alignment class: Triton's compiled kernel is specialized on exactly
    those (pointer and integer divisibility by 16, integers equal to 1), so the kernel
    compiled for this call is the one Triton would pick for each of them.

    ``values`` are the call's arguments and outputs; every tensor the launch passes must be
    one of them, found by identity at exactly one place: the launcher,
    ``launcher(values, pointers)``, takes a later call's data pointers (``pointers``: those
    of the tensors among its values, in order) and puts them in the same places. Returns
    None where no such launcher can be made: the interpreter, AMD (Triton's AMD backend also
    specializes on buffer sizes, which a call signature does not hold), a derived tensor, a
    tensor passed at two places, or a Triton whose launch path differs.

    The launcher calls the compiled kernel's C launcher directly: what Triton's own
    ``kernel[grid]`` does after its per-call argument specialization, cache key and binding,
    which cost more than the launch itself (tens of microseconds per call).
    """
    if bound_launch_refusal() is not None:
        return None
    from triton import knobs

    names = launch.kernel.arg_names
    by_name = dict(zip(names, launch.arguments))
    by_name.update((k, v) for k, v in launch.constexprs.items() if k not in _LAUNCH_OPTIONS)
    if set(by_name) != set(names):
        return None
    # The kernel's arguments, each an index into (a call's data pointers + this call's
    # constants): one C-level itemgetter lays out a later call's arguments. Pointers, not
    # tensors: Triton's C launcher takes an int as it is, where for a tensor it calls
    # data_ptr() and asks the driver about the pointer (cuPointerGetAttribute), every launch.
    pointer_count = sum(isinstance(value, torch.Tensor) for value in values)
    constants, indices = [], []
    for name in names:
        argument = by_name[name]
        if isinstance(argument, torch.Tensor):
            index = pointer_index(values, argument)
            if index is None:
                return None
        else:  # the plan keeps no tensor of this call alive
            index = pointer_count + len(constants)
            constants.append(argument)
        indices.append(index)
    constants = tuple(constants)
    layout = operator.itemgetter(*indices)
    with torch.cuda.device(device_index):
        compiled = launch.kernel.warmup(*launch.arguments, grid=launch.grid, **launch.constexprs)
        compiled._init_handles()  # loads the module on this device now, not inside a later capture
    grid = launch.grid  # the launcher holds the grid, never ``launch``: its arguments are this call's tensors
    grid_x, grid_y, grid_z = (tuple(grid) + (1, 1))[:3]
    c_launcher, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    current_stream = torch._C._cuda_getCurrentRawStream
    hooks = knobs.runtime

    def launcher(call_values: tuple, pointers: tuple) -> None:
        arguments = layout(pointers + constants)
        stream = current_stream(device_index)
        enter_hook, exit_hook = hooks.launch_enter_hook, hooks.launch_exit_hook
        if _hooked(enter_hook, exit_hook):  # a profiler (e.g. proton) sees the launch as Triton's own
            c_launcher(grid_x, grid_y, grid_z, stream, function, metadata,
                       compiled.launch_metadata(grid, stream, *arguments), enter_hook, exit_hook, *arguments)
        else:
            c_launcher(grid_x, grid_y, grid_z, stream, function, metadata, None, None, None, *arguments)

    return launcher


def _hooked(enter_hook, exit_hook) -> bool:
    """Whether any of Triton's launch hooks would do anything. Since Triton 3.5 the hooks are
    ``HookChain`` objects, never None: an empty chain is skipped, as are the launch metadata
    built for it (host time that Triton's own launch spends too, and a bare launch does not)."""
    return bool((enter_hook is not None and getattr(enter_hook, "calls", True))
                or (exit_hook is not None and getattr(exit_hook, "calls", True)))
