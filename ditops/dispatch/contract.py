"""What a backend provides for each op it implements: a ``Kernel``.

ditops/ops.py calls a kernel three ways:
- ``run(*values)``: the op's arguments in the order of its signature, then the new output
  tensors to write (none for the in-place ops). Every backend provides it.
- ``bind(values, device_index)``: a launcher pre-bound for every later call with this call's
  signature (shapes, strides, dtypes, device, alignment class), ``launcher(values, pointers)``
  taking a later call's values and the data pointers of its tensors; or None where the
  backend cannot pre-bind (ops.py then calls ``run``). Optional.
- ``trace(*values)``: the call traced into a torch.compile graph as a node Inductor launches
  itself (Triton's ``wrap_triton``). Optional: ``traces`` says whether a kernel has it; one
  that has not is recorded in the graph as the library op.

A backend module names its kernels explicitly, one module-level name per op (the registry
looks them up by the op's name, or by an entry's ``function``); a plain function there is a
kernel with ``run`` alone.
"""

from __future__ import annotations

from typing import Callable, Optional


class Kernel:
    """One op of one backend: ``run``, and optionally ``bind`` and ``trace`` (see the module
    docstring). Called like ``run``."""

    __slots__ = ("run", "_bind", "_trace")

    def __init__(self, run: Callable, bind: Optional[Callable] = None, trace: Optional[Callable] = None):
        self.run, self._bind, self._trace = run, bind, trace

    def __call__(self, *values) -> None:
        self.run(*values)

    def bind(self, values: tuple, device_index: int) -> Optional[Callable[[tuple, tuple], None]]:
        return self._bind(values, device_index) if self._bind is not None else None

    @property
    def traces(self) -> bool:
        return self._trace is not None

    def trace(self, *values) -> None:
        self._trace(*values)


def as_kernel(function: Callable) -> Kernel:
    """A module's op function as a kernel: itself where it is one, else ``run`` alone."""
    return function if isinstance(function, Kernel) else Kernel(function)
