"""The conformance suite: every backend of the registry against a float64 oracle.

A ``Case`` builds the keyword arguments of one public op (fresh random inputs for a
dtype). ``run_case`` calls one backend's implementation directly on outputs poisoned
with NaN, compares every output with the oracle under docs/ops.md's tolerances, then calls
the public op with that backend forced on freshly built identical inputs and requires
bitwise the same outputs (the dispatch path and run-to-run determinism); where dispatch
picks that backend by itself, so must the public op's first automatic call and its cached
second one. A backend that cannot run here, or refuses the case, is skipped with its reason.

The cases are real model shapes of docs/ops.md scaled down (fewer tokens and heads, real D
and Dh), odd sizes, every modulation form, strided, expanded and misaligned views,
GQA/MQA, partial rotary, position offsets and empty inputs. Used by
tests/conformance and by ``ditops check``.
"""

from __future__ import annotations

import inspect
import zlib
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from .backends import reference
from .dispatch import device_info, dispatcher
from .dispatch.selector import choose
from .examples import HeadSpec, RowSpec, build
from .ops import OPS, PUBLIC, ordered_arguments

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # atol = rtol (docs/ops.md)

OUTPUT_NAMES = {
    "norm_scale_shift": ("y",),
    "residual_norm_scale_shift": ("y", "residual_out"),
    "norm_scale_shift_select": ("y", "gate_out"),
    "residual_norm_scale_shift_select": ("y", "residual_out", "gate_out"),
    "add_gate_norm": ("out",),
    "add_gate_norm_scale": ("out", "y"),
    "qk_norm_rope_": ("q", "k"),
    "rope_": ("q", "k"),
}


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


# The cases: specs of ditops/examples.py, the one argument builder.

ROW_SPECS = {
    "wan1.3b-fp32-mod": RowSpec(1, 40, 1536, "batch3", "batch3", "batch3", param_dtype=torch.float32),
    "hunyuan-chunked-mod": RowSpec(2, 24, 3072),
    "flux2-rms": RowSpec(1, 16, 6144, norm="rms", affine=False),
    "odd-d1000-token-mod": RowSpec(2, 7, 1000, "token", "token1", "token"),
    "wide-d8200": RowSpec(1, 3, 8200),  # rows held by several warps (the compiled kernels' widest class)
    "d4104-rms": RowSpec(2, 3, 4104, "vector", "batch", "token", norm="rms"),
    "per-frame": RowSpec(1, 12, 256, "frame", "frame", "frame", param_dtype=torch.float32),
    "scalar-and-vector": RowSpec(2, 5, 128, "scalar", "vector", "scalar1"),
    "vector3-rms": RowSpec(1, 9, 384, "vector3", "vector", "vector3", norm="rms"),
    "strided-x": RowSpec(2, 6, 512, layout="strided"),
    "expanded-mod": RowSpec(2, 6, 256, "token_expanded", "batch", "token_expanded"),
    "misaligned": RowSpec(1, 5, 200, "batch", "batch", "batch", layout="misaligned", norm="rms"),
    "two-d-x": RowSpec(1, 11, 320, "vector", "batch", "token1", two_d=True),
    "gate-none": RowSpec(2, 4, 192, gate=None),
    "nan-inf": RowSpec(2, 4, 96, special_values=True),
    "empty": RowSpec(2, 0, 256),
}

SELECT_SPECS = {
    "qwen-edit": RowSpec(1, 32, 3072, param_dtype=torch.float32),
    "sets-of-two-dtypes": RowSpec(2, 6, 256, param_dtype=torch.float16, set1_dtype=torch.bfloat16),
    "odd-d1000": RowSpec(2, 9, 1000),
    "d4104": RowSpec(1, 5, 4104),
    "strided-x": RowSpec(2, 6, 512, layout="strided"),
    "misaligned": RowSpec(1, 5, 200, layout="misaligned"),
    "empty": RowSpec(1, 0, 128),
}

GATE_NORM_SPECS = {
    "z-image": RowSpec(1, 24, 3840, norm="rms", param_dtype=torch.float32, affine=False),
    "odd-d1000-layer": RowSpec(2, 7, 1000, gate="token"),
    "wide-d8200-rms": RowSpec(1, 3, 8200, norm="rms"),
    "per-frame": RowSpec(1, 12, 256, gate="frame", scale="frame", norm="rms"),
    "scalar-gate": RowSpec(2, 5, 128, gate="scalar", scale="vector", norm="layer"),
    "strided-x": RowSpec(2, 6, 512, layout="strided", norm="rms"),
    "misaligned": RowSpec(1, 5, 200, layout="misaligned", norm="rms"),
    "empty": RowSpec(2, 0, 64),
}


HEAD_SPECS = {
    "flux-image-tokens": HeadSpec((1, 24), 4, 4, 128, position_offset=8),
    "llm-gqa-neox": HeadSpec((33,), 8, 2, 128, interleaved=False, positions=torch.int64),
    "dh80-int32-positions": HeadSpec((2, 9), 4, 4, 80, positions=torch.int32),
    "dh96-mqa-neox": HeadSpec((17,), 4, 1, 96, interleaved=False, positions=torch.int64),
    # a NeoX head of Dh 80 is 5 lanes of the CUDA kernel, 6 heads a 32-lane segment: 7 q heads
    # cross a segment's end
    "dh80-gqa-neox": HeadSpec((19,), 7, 3, 80, interleaved=False, positions=torch.int64),
    "partial-rotary": HeadSpec((2, 6), 2, 2, 128, rotary_dim=64, interleaved=False, position_offset=3),
    "partial-rotary-interleaved": HeadSpec((12,), 3, 3, 64, rotary_dim=32),
    # 2 * 64 rotated + 256 passed-through values per head: a tile of 2048 holds 5 heads, and a
    # block of heads must be a power of two (found by the GPU fuzz, seed 17, case 272).
    "partial-rotary-dh256": HeadSpec((3,), 8, 1, 256, rotary_dim=112, interleaved=False),
    "qkv-views": HeadSpec((2, 7), 4, 2, 128, layout="qkv", positions=torch.int64),
    "misaligned": HeadSpec((5,), 2, 2, 64, layout="misaligned"),
    "bf16-cache": HeadSpec((10,), 2, 2, 256, cache_dtype=torch.bfloat16),
    "dh256-gqa-neox": HeadSpec((2, 3), 5, 2, 256, interleaved=False),
    "dh16-neox": HeadSpec((6,), 3, 3, 16, interleaved=False, positions=torch.int32),
    "empty": HeadSpec((0,), 2, 2, 128),
}

ROPE_ONLY_SPECS = {"k-none": HeadSpec((2, 5), 3, 3, 64, k_none=True)}


def _cases() -> list:
    cases = []
    specs = {
        "norm_scale_shift": ROW_SPECS,
        "residual_norm_scale_shift": ROW_SPECS,
        "norm_scale_shift_select": SELECT_SPECS,
        "residual_norm_scale_shift_select": SELECT_SPECS,
        "add_gate_norm": GATE_NORM_SPECS,
        "add_gate_norm_scale": GATE_NORM_SPECS,
    }
    for op, op_specs in specs.items():
        for name, spec in op_specs.items():
            if spec.gate is None and op != "residual_norm_scale_shift":
                continue
            cases.append(Case(op, name, lambda dtype, device, g, op=op, spec=spec: build(op, spec, dtype, device, g)))
    for op, op_specs in (("qk_norm_rope_", HEAD_SPECS), ("rope_", {**HEAD_SPECS, **ROPE_ONLY_SPECS})):
        for name, spec in op_specs.items():
            cases.append(Case(op, name, lambda dtype, device, g, op=op, spec=spec: build(op, spec, dtype, device, g)))
    return cases


CASES = _cases()


# The oracle and the comparison.


def _widen(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().to(torch.float64, copy=True)
    return value


def oracle(op: str, arguments: dict, dtype: torch.dtype) -> tuple:
    """The expected outputs in float64. Where docs/ops.md stores an intermediate (residual_out,
    out) and normalises it as stored, the oracle rounds it to ``dtype`` at the same point,
    then normalises with the call's own norm, affine parameters and eps (defaults filled in)."""
    wide = {name: _widen(value) for name, value in arguments.items()}
    ordered, _ = ordered_arguments(op, **wide)
    named = dict(zip(inspect.signature(PUBLIC[op]).parameters, ordered))
    expected = getattr(reference, op)(*ordered)
    expected = expected if isinstance(expected, tuple) else (expected,)
    stored = lambda t: t.to(dtype).to(torch.float64)  # noqa: E731
    if op == "residual_norm_scale_shift":
        y = reference.norm_scale_shift(stored(expected[1]), named["scale"], named["shift"], named["weight"],
                                       named["bias"], named["norm"], named["eps"])
        return y, expected[1]
    if op == "residual_norm_scale_shift_select":
        selection = {key: named[key] for key in ("index", "scale0", "shift0", "gate0", "scale1", "shift1", "gate1",
                                                 "weight", "bias", "eps")}
        y, gate = reference.norm_scale_shift_select(stored(expected[1]), **selection)
        return y, expected[1], gate
    if op == "add_gate_norm_scale":
        zero_shift = torch.zeros((), dtype=torch.float64, device=expected[0].device)
        y = reference.norm_scale_shift(stored(expected[0]), named["scale"], zero_shift, named["weight2"],
                                       named["bias2"], named["norm"], named["eps"])
        return expected[0], y
    if op in ("qk_norm_rope_", "rope_"):
        return tuple(t for t in expected if t is not None)
    return expected


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


def implementations_of(op: str, backend: str) -> list:
    """The backend's enabled implementations of op, in registry order (a backend may have
    several, e.g. one preferred for a size class and a general one after another backend)."""
    return [implementation for implementation in dispatcher().implementations[op] if implementation.name == backend]


def _results(op: str, arguments: dict, outputs: tuple) -> tuple:
    if op in ("qk_norm_rope_", "rope_"):
        return tuple(t for t in (arguments["q"], arguments["k"]) if t is not None)
    return outputs


def _bitwise_equal(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Equal values, NaN where NaN (torch.equal alone calls NaN unequal)."""
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
            implementation.function(*ordered, *outputs)
    except Exception as error:  # a crash on valid input is a failure of the backend, reported like one
        return Outcome("fail", f"raised {type(error).__name__}: {error}")
    actual = _results(op, arguments, outputs)
    names = OUTPUT_NAMES[op]
    problems = [problem for name, a, e in zip(names, actual, expected) if (problem := compare(name, a, e, dtype))]

    calls = [(f"the public op with backend={backend!r}", {"backend": backend})]
    if automatic and features is not None and choose(op, features) is implementation:
        # What dispatch picks by itself: the first such call builds its plan, the second finds it
        # (the cached call, in C where dispatch/cached_call.c was built), as users' calls run.
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
