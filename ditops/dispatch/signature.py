"""Call signatures: which later calls may reuse a launch plan (ditops/ops.py), checked cheaply.

A plan is built for one call (validated, its implementation chosen, its launcher bound) and
reused by every later call with the same **signature**: the op, the backend override in
force, grad mode, the simulated device, each argument's type and each non-tensor argument's
value, and for every tensor its Python type, dispatch keys, device, dtype, sizes, strides,
requires_grad and data pointer modulo 16 bytes (the alignment class). That is everything
validation, the dispatcher's features and the backends' launchers read from a call, so a
call that would fail validation never finds a plan. Tensor values are not in it: the checks
that read values or pointers stay per call, in the plan.

Checking the signature is most of what a cached call costs, so it is split in two:
1. a key (``selector.signature_key``, Python): everything but the tensors' metadata, plus the
   first argument's shape so that one key holds few plans;
2. per plan under that key, a guard over the tensors (``tensor_guard``): PyTorch's C++ ``TensorGuards``,
   the check Dynamo runs before a compiled graph, compares type, dispatch keys, device,
   dtype, sizes, strides and requires_grad of every tensor in one call (0.2 us for three
   tensors on a 2-core CPU machine; reading the same in Python took 1.2 us). The pointers'
   low bits are compared here. Where PyTorch lacks ``TensorGuards`` the same metadata is
   compared in Python.
"""

from __future__ import annotations

import functools
import operator
import threading
from typing import Callable

from torch import Tensor

from .features import MAX_ALIGNMENT

try:  # private to Dynamo, public in its use there since torch 2.1
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - every torch this project supports has it
    _TensorGuards = None

MAX_PLANS = 4096  # plans kept; past this the oldest key is dropped with its plans
_LOW_BITS = MAX_ALIGNMENT - 1
_data_ptr = Tensor.data_ptr
_reduce, _or = functools.reduce, operator.or_


def _python_guard(tensors: tuple) -> Callable:
    """``TensorGuards.check`` in Python, for a torch without it."""

    def metadata(t):
        return type(t), t.layout, t.device, t.dtype, t.shape, t.stride(), t.requires_grad

    expected = tuple(map(metadata, tensors))
    return lambda *call: tuple(map(metadata, call)) == expected


def tensor_guard(tensors: tuple) -> Callable:
    """``check(*tensors) -> bool``: whether other tensors have these tensors' metadata."""
    if _TensorGuards is None:
        return _python_guard(tensors)
    firsts = [i for i, t in enumerate(tensors) if not any(t is u for u in tensors[:i])]
    unique = tuple(tensors[i] for i in firsts)
    # Concrete sizes and strides: None there would mean a dynamic dimension, left unchecked.
    check = _TensorGuards(
        *unique,
        dynamic_dims_sizes=[list(t.shape) for t in unique],
        dynamic_dims_strides=[list(t.stride()) for t in unique],
    ).check
    if len(unique) == len(tensors):
        return check
    # TensorGuards refuses a tensor passed twice (Dynamo's guards are built on distinct
    # tensors), so a call such as norm_scale_shift(x, m, m) would never find its plan. Its
    # guard checks the distinct tensors, and that each repeat is again the same tensor.
    repeats = [(i, next(j for j in firsts if tensors[j] is tensors[i])) for i in range(len(tensors)) if i not in firsts]
    firsts_of = _getter(firsts)

    def check_with_repeats(*call) -> bool:
        return all(call[i] is call[j] for i, j in repeats) and check(*firsts_of(call))

    return check_with_repeats


def _low_bits(tensors: tuple) -> tuple:
    """Each tensor's data pointer modulo MAX_ALIGNMENT: its alignment class."""
    return tuple(_data_ptr(t) & _LOW_BITS for t in tensors)


def data_pointers(arguments: tuple) -> tuple:
    """The data pointers of the tensors among ``arguments``, in order (what ``find`` returns)."""
    return tuple(_data_ptr(a) for a in arguments if isinstance(a, Tensor))


def pointer_index(values: tuple, tensor: Tensor):
    """Where ``tensor`` (found by identity) is among the tensors of ``values``: its index in
    ``data_pointers(values)``. None where it is not there, or where it is there more than
    once: a later call with the same signature may pass two different tensors there, and a
    launcher bound to one of the places would launch the wrong one's pointer."""
    places = [i for i, value in enumerate(value for value in values if isinstance(value, Tensor)) if value is tensor]
    return places[0] if len(places) == 1 else None


def _getter(positions: list) -> Callable:
    if len(positions) == 1:  # itemgetter of one position returns the item, not a tuple
        position = positions[0]
        return lambda arguments: (arguments[position],)
    return operator.itemgetter(*positions)


class PlanTable:
    """Plans by signature, shared by threads: a lookup takes no lock (it reads a dict and
    immutable tuples), adding a plan does. Holds at most ``MAX_PLANS`` plans; the key added
    first is dropped first."""

    def __init__(self) -> None:
        self._by_key: dict = {}  # key -> tuple of entries (see find), in insertion order
        self._count = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._count

    def find(self, signature_key: tuple, arguments: tuple):
        """``(plan, pointers)`` for a call with this key and these arguments, or None.
        ``pointers``: the data pointers of the call's tensor arguments, in argument order,
        read once here for the alignment class and handed on to the launch."""
        # Each entry: (the tensor arguments' positions, the same as an itemgetter, TensorGuards'
        # check, whether every pointer was aligned, each pointer modulo MAX_ALIGNMENT, the plan).
        for _, tensors_of, check, aligned, low_bits, plan in self._by_key.get(signature_key, ()):
            tensors = tensors_of(arguments)
            if check(*tensors):
                pointers = tuple(map(_data_ptr, tensors))
                if _reduce(_or, pointers) & _LOW_BITS:
                    if tuple(pointer & _LOW_BITS for pointer in pointers) == low_bits:
                        return plan, pointers
                elif aligned:
                    return plan, pointers
        return None

    def add(self, signature_key: tuple, arguments: tuple, plan) -> None:
        positions = [i for i, argument in enumerate(arguments) if isinstance(argument, Tensor)]
        tensors_of = _getter(positions)
        tensors = tensors_of(arguments)
        low_bits = _low_bits(tensors)
        entry = (tuple(positions), tensors_of, tensor_guard(tensors), not any(low_bits), low_bits, plan)
        with self._lock:
            while self._count >= MAX_PLANS and self._by_key:
                self._count -= len(self._by_key.pop(next(iter(self._by_key))))
            self._by_key[signature_key] = self._by_key.get(signature_key, ()) + (entry,)
            self._count += 1
