"""The conformance suite: every backend of the registry against a float64 oracle.

A ``Case`` builds the keyword arguments of one public op (fresh random inputs for a
dtype). ``run_case`` calls one backend's implementation directly on outputs poisoned
with NaN, compares every output with the oracle under docs/ops.md's tolerances, then calls
the public op with that backend forced on freshly built identical inputs and requires
bitwise the same outputs (the dispatch path and run-to-run determinism); where dispatch
picks that backend by itself, so must the public op's first automatic call and its cached
second one. A backend that cannot run here, or refuses the case, is skipped with its reason.

The cases are each op spec's ``conformance`` inputs (ditops/opspec.py): real model shapes
scaled down, odd sizes, every modulation form, strided, expanded and misaligned views,
GQA/MQA, partial rotary, position offsets and empty inputs. Used by tests/conformance and by
``ditops check``.
"""

from __future__ import annotations

import inspect
import zlib
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from .dispatch import device_info, dispatcher
from .dispatch.selector import choose
from .ops import OPS, PUBLIC, ordered_arguments
from .opspec import FP8_DTYPES, SPECS

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # atol = rtol (docs/ops.md)

@dataclass(frozen=True)
class Case:
    op: str
    name: str
    build: Callable  # (dtype, device, generator) -> keyword arguments of the public op

    @property
    def id(self) -> str:
        return f"{self.op}-{self.name}"

    def arguments(self, dtype: torch.dtype, device) -> dict:
        """Fresh inputs; the same (case, dtype) always gives the same values."""
        seed = zlib.crc32(f"{self.id}-{dtype}".encode())
        return self.build(dtype, torch.device(device), torch.Generator().manual_seed(seed))


class Outcome(NamedTuple):
    status: str  # "pass", "fail" or "skip"
    detail: str = ""


def _cases(which: str = "conformance") -> list:
    """Each op's conformance inputs (ditops/opspec.py; ``which``: or its long_conformance), built by its spec."""
    return [
        Case(op, name, lambda dtype, device, g, spec=spec, inputs=inputs: spec.build(inputs, dtype, device, g))
        for op, spec in SPECS.items()
        for name, inputs in getattr(spec, which).items()
    ]


CASES = _cases()
LONG_CASES = _cases("long_conformance")  # checked on GPUs (OpSpec.long_conformance)


# The oracle and the comparison.


def _widen(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().to(torch.float64, copy=True)
    return value


def _widened(op: str, arguments: dict) -> dict:
    """Every argument of the call by name, floating-point tensors as float64 copies."""
    ordered, _ = ordered_arguments(op, **{name: _widen(value) for name, value in arguments.items()})
    return dict(zip(inspect.signature(SPECS[op].signature).parameters, ordered))


def oracle(op: str, arguments: dict, dtype: torch.dtype, stored: Optional[torch.Tensor] = None) -> tuple:
    """The expected outputs in float64 (the op spec's ``expected``: where docs/ops.md stores an
    intermediate and normalises it as stored, it is rounded to ``dtype`` at the same point, or
    taken as ``stored``, a backend's, see as_stored)."""
    return SPECS[op].expected(_widened(op, arguments), dtype, stored)


def as_stored(op: str, arguments: dict, dtype: torch.dtype, expected: tuple, actual: tuple) -> tuple:
    """``expected`` with the outputs an op computes from its stored intermediate (its spec's
    ``intermediate``) derived from the intermediate as the backend stored it (in ``actual``, the
    call's results); the intermediate keeps its own expectation. float32 and float64 may round
    an element of it to neighbouring values of dtype, and the element moves its row's
    statistics: one bfloat16 ulp of one of 512 values moved a row's FP8 scale by 68 float32
    ulps (tests/test_fuzz.py, seed 17, case 333 on an H200)."""
    name = SPECS[op].intermediate
    if name is None:
        return expected
    # the spec's oracle reads the float64 intermediate off the results it is given, which
    # ``expected`` holds where the reference's results do: the reference is not run again
    return SPECS[op].oracle(_widened(op, arguments), expected, dtype, actual[SPECS[op].result_names.index(name)])


def compare(name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
            conditioning: float = 1.0) -> Optional[str]:
    """None if ``actual`` meets docs/ops.md's tolerances against the float64 ``expected``, else why not.

    ``conditioning`` (>= 1): how much the inputs' rows amplify the float32 arithmetic's
    rounding (a LayerNorm row of tiny variance around a large mean: tests/test_fuzz.py); the
    norm-wise bound grows by 4 float32 eps for each unit above 1, the output's own rounding
    (4 eps of its dtype) is unchanged."""
    if actual.shape != expected.shape or actual.dtype != dtype:
        return f"{name}: got {list(actual.shape)} {actual.dtype}, wanted {list(expected.shape)} {dtype}"
    if actual.numel() == 0:
        return None
    actual = actual.to(torch.float64)
    unexpected_nan = actual.isnan() & ~expected.isnan()
    if unexpected_nan.any():
        return f"{name}: {int(unexpected_nan.sum())} NaN where the reference has none (unwritten or wrong)"
    tolerance = TOLERANCES[dtype]
    close = torch.isclose(actual, expected, rtol=tolerance, atol=tolerance, equal_nan=True)
    if not close.all():
        where = (~close).nonzero()[0].tolist()
        return (
            f"{name}: {int((~close).sum())} elements off by more than atol=rtol={tolerance}, "
            f"first at {where}: {actual[tuple(where)].item():.6g} vs {expected[tuple(where)].item():.6g}"
        )
    finite = expected.isfinite()
    relative = (actual[finite] - expected[finite]).norm() / expected[finite].norm().clamp_min(1e-30)
    limit = 4 * torch.finfo(dtype).eps + 4 * torch.finfo(torch.float32).eps * (conditioning - 1)
    if relative > limit:
        amplified = f" + 4 eps32 x {conditioning - 1:.3g} (conditioning)" if conditioning != 1.0 else ""
        return f"{name}: ||out - ref|| / ||ref|| = {relative:.3g} > 4 eps{amplified} = {limit:.3g}"
    return None


def compare_fp8(name: str, actual: torch.Tensor, expected: torch.Tensor, conditioning: float = 1.0) -> Optional[str]:
    """None if FP8 values ``actual`` round the float64 ``expected`` (the values divided by their
    scale, saturated) to within half a step of the format at each value, NaN exactly where
    expected has NaN; else why not. The float32 arithmetic before the rounding may move a value
    across a rounding boundary: 1e-5 of the format's range is allowed for it (float32's
    tolerance, relative to the row's largest value, which maps to the range's end), times
    ``conditioning`` (compare's)."""
    if actual.shape != expected.shape or actual.dtype not in FP8_DTYPES:
        return f"{name}: got {list(actual.shape)} {actual.dtype}, wanted {list(expected.shape)} FP8"
    if actual.numel() == 0:
        return None
    values = actual.to(torch.float64)
    wrong_nan = values.isnan() != expected.isnan()
    if wrong_nan.any():
        return f"{name}: {int(wrong_nan.sum())} elements NaN in one of actual and reference but not the other"
    info = torch.finfo(actual.dtype)
    step = info.eps * torch.exp2(torch.floor(torch.log2(expected.abs().clamp_min(info.tiny))))
    error = (values - expected).abs().nan_to_num(0.0)
    off = error > 0.5 * step + 1e-5 * info.max * conditioning
    if off.any():
        where = off.nonzero()[0].tolist()
        return (f"{name}: {int(off.sum())} elements beyond half an FP8 step of the reference, first at {where}: "
                f"{values[tuple(where)].item():.6g} vs {expected[tuple(where)].item():.6g}")
    return None


def compare_results(op: str, actual: tuple, expected: tuple, dtype: torch.dtype, conditioning: float = 1.0) -> list:
    """Every problem of a call's results against the oracle's: an FP8 output (an op spec's
    ``quantized``) by compare_fp8, its scales as float32 values, the rest by compare."""
    spec = SPECS[op]
    dtypes = [dtype] * len(actual)
    if spec.quantized:
        dtypes[:2] = None, torch.float32
    return [problem for name, a, e, wanted in zip(spec.result_names, actual, expected, dtypes)
            if (problem := compare_fp8(name, a, e, conditioning) if wanted is None else compare(name, a, e, wanted, conditioning))]


def implementations_of(op: str, backend: str) -> list:
    """The backend's enabled implementations of op, in registry order (a backend may have
    several, e.g. one preferred for a size class and a general one after another backend)."""
    return [implementation for implementation in dispatcher().implementations[op] if implementation.name == backend]


def _results(op: str, arguments: dict, outputs: tuple) -> tuple:
    """What a call gave: its new outputs, or the tensors an in-place op wrote (None left out)."""
    mutates = SPECS[op].mutates
    return tuple(t for t in (arguments[name] for name in mutates) if t is not None) if mutates else outputs


def _bitwise_equal(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Equal values, NaN where NaN (torch.equal alone calls NaN unequal); FP8 bit for bit."""
    if first.element_size() == 1 and first.is_floating_point():
        return torch.equal(first.view(torch.uint8), second.view(torch.uint8))
    return torch.equal(first.isnan(), second.isnan()) and torch.equal(first.nan_to_num(), second.nan_to_num())


def run_case(case: Case, backend: str, dtype: torch.dtype, device="cpu", automatic: bool = True) -> Outcome:
    """Checks one backend on one case and dtype (see the module docstring). ``automatic``: where
    dispatch picks this backend's implementation by itself, the public op without an override
    must give the same bits too, on its first call and on its cached second call."""
    op = case.op
    implementations = implementations_of(op, backend)
    if not implementations:
        return Outcome("skip", f"{backend} has no enabled implementation of {op}")
    arguments = case.arguments(dtype, device)
    ordered, _ = ordered_arguments(op, **arguments)
    features = OPS[op].check(*ordered)
    implementation = implementations[0]
    if features is not None:  # the first that accepts, as a forced backend= call picks
        refusals = [candidate.refusal(features) for candidate in implementations]
        if all(refusals):  # one line per distinct reason: a backend's entries often refuse alike
            return Outcome("skip", "; ".join(dict.fromkeys(refusals)))
        implementation = implementations[refusals.index(None)]
    expected = oracle(op, arguments, dtype)
    outputs = tuple(torch.full_like(t, float("nan")) for t in OPS[op].outputs(*ordered))
    try:
        if features is not None:
            implementation.kernel.run(*ordered, *outputs)
    except Exception as error:  # a crash on valid input is a failure of the backend, reported like one
        return Outcome("fail", f"raised {type(error).__name__}: {error}")
    actual = _results(op, arguments, outputs)
    names = SPECS[op].result_names
    problems = compare_results(op, actual, as_stored(op, arguments, dtype, expected, actual), dtype)

    calls = [(f"the public op with backend={backend!r}", {"backend": backend})]
    if automatic and features is not None and choose(op, features) is implementation:
        # What dispatch picks by itself: the first such call builds its plan, the second finds it,
        # as users' calls run.
        calls += [(f"the {which} automatic call of the public op", {}) for which in ("first", "second")]
    for described, override in calls:
        again = case.arguments(dtype, device)
        public = PUBLIC[op](**again, **override)
        public = _results(op, again, public if isinstance(public, tuple) else (public,))
        for name, first, second in zip(names, actual, public):
            if not _bitwise_equal(first, second):
                problems.append(f"{name}: {described} is not bitwise equal to the direct call")
    return Outcome("fail", "; ".join(problems)) if problems else Outcome("pass")


def backends() -> list:
    """Every backend named by the registry, in registry order."""
    return list(dispatcher().registry.backends)


def unavailable_reason(backend: str, device) -> Optional[str]:
    """Why ``backend`` cannot run on ``device`` at all, or None."""
    return dispatcher().registry.backends[backend].refusal(device_info(device))
