"""Seeded differential fuzzing: random calls of every op, on every backend that runs here (each
forced with ``backend=``, and the automatic choice), against the float64 oracle of
ditops.conformance under docs/ops.md's tolerances.

``fuzz_case(seed, index)`` draws one call from its own random stream: the op; shapes (odd
and real sizes, GQA/MQA, partial rotary); dtypes of the activations and, separately, of the
other tensors; every modulation form of docs/ops.md, as strided and expanded views; activations
contiguous, row-strided, at a storage offset, or with batch and token axes swapped; norms,
affine weights, eps, gate activation; RoPE positions (int32/int64), offsets, layouts, k=None,
caches with a row per head.
A failure prints the call and the one line that replays it.

On a GPU: ``DITOPS_FUZZ_CASES`` cases per backend (default 2000) with outputs allocated over
NaN-poisoned memory, in SHARDS tests per backend that pytest-xdist runs side by side (each
new Triton specialization compiles on the CPU: one process alone took over nine minutes).
On CPU (CI): a few cases, the Triton kernels in Triton's interpreter on a simulated sm_90,
so that the generator itself stays exercised. ``DITOPS_FUZZ_SEED`` picks the seed (default
17); ``DITOPS_RELIABILITY_OUT`` names a JSON file that gets the summary.
"""

import contextlib
import os
import random
import zlib

import pytest
import torch
from reliability_summary import record

import ditops
from ditops import conformance
from ditops.dispatch import simulated_device
from ditops.ops import PUBLIC
from ditops.opspec import SPECS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
SEED = int(os.environ.get("DITOPS_FUZZ_SEED", "17"))
CASES = int(os.environ.get("DITOPS_FUZZ_CASES", "2000" if DEVICE == "cuda" else "6"))
SHARDS = 8 if DEVICE == "cuda" else 1
# Largest activation (elements) a case builds: the interpreter runs every program in Python.
MAX_ELEMENTS = 1 << 18 if DEVICE == "cuda" else 1 << 12

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
HIDDEN = (1, 2, 3, 7, 8, 16, 24, 64, 96, 100, 128, 200, 256, 384, 512, 1000, 1024, 1536, 3072, 3840, 4104, 5120, 8200)
HEAD = (2, 4, 8, 16, 32, 64, 80, 96, 128, 256)
MODULATION_FORMS = ("scalar", "scalar1", "vector", "vector2", "vector3", "batch", "batch_view", "batch_strided",
                    "batch3", "token", "token1", "token_expanded", "frame")
# The interpreter rounds float32 to bfloat16 toward zero (see tests/conformance): the ops that
# normalise a stored bfloat16 intermediate are fuzzed in bfloat16 on the GPU only.
STORED_INTERMEDIATE = {"residual_norm_scale_shift", "residual_norm_scale_shift_select", "add_gate_norm_scale",
                       "residual_norm_scale_shift_fp8", "residual_norm_scale_shift_select_fp8", "add_gate_norm_scale_fp8"}


class Draw:
    """The random stream of one case: Python's for the structure, a torch generator for values."""

    def __init__(self, seed: int, index: int):
        self.rng = random.Random(f"ditops-fuzz-{seed}-{index}")
        self.values = torch.Generator().manual_seed(zlib.crc32(f"{seed}-{index}".encode()))

    def choice(self, options):
        return self.rng.choice(options)

    def chance(self, probability: float) -> bool:
        return self.rng.random() < probability

    def randn(self, *shape, dtype):
        """Random values (never zeros) on DEVICE; built on CPU so every device gets the same ones."""
        return torch.randn(shape, generator=self.values, dtype=torch.float64).to(device=DEVICE, dtype=dtype)

    def activation(self, shape, dtype, heads: bool = False):
        """A tensor of ``shape`` in a random layout that docs/ops.md allows: the last dim has stride 1
        and, for q/k (``heads``), heads are Dh apart; rows and tokens may be anywhere."""
        layout = self.choice(("contiguous", "contiguous", "row_strided", "offset", "swapped"))
        row_dims = 2 if heads else 1  # the trailing dims that stay packed
        if layout == "row_strided":  # tokens of a wider buffer
            width = _count(shape[-row_dims:])
            buffer = self.randn(*shape[:-row_dims], width + self.choice((1, 8, 24)), dtype=dtype)[..., :width]
            return buffer.unflatten(-1, shape[-row_dims:]) if heads else buffer
        if layout == "offset":  # a view starting a few elements into its storage
            offset = self.choice((1, 2, 3, 8))
            return self.randn(_count(shape) + offset, dtype=dtype)[offset:].view(shape)
        if layout == "swapped" and len(shape) - row_dims >= 2:  # batch and token axes swapped in memory
            return self.randn(shape[1], shape[0], *shape[2:], dtype=dtype).transpose(0, 1)
        return self.randn(*shape, dtype=dtype)

    def modulation(self, form, batch, tokens, hidden, dtype, frames):
        scaled = lambda *shape: self.randn(*shape, dtype=dtype) * 0.5  # noqa: E731  (1 + scale stays away from 0)
        forms = {
            "scalar": lambda: scaled(),
            "scalar1": lambda: scaled(1),
            "vector": lambda: scaled(hidden),
            "vector2": lambda: scaled(1, hidden),
            "vector3": lambda: scaled(1, 1, hidden),
            "batch": lambda: scaled(batch, hidden),
            "batch_view": lambda: scaled(batch, 6, hidden)[:, self.rng.randrange(6)],
            "batch_strided": lambda: scaled(batch, hidden + 8)[:, :hidden],
            "batch3": lambda: scaled(batch, 1, hidden),
            "token": lambda: scaled(batch, tokens, hidden),
            "token1": lambda: scaled(1, tokens, hidden),
            "token_expanded": lambda: scaled(batch, 1, hidden).expand(batch, tokens, hidden),
            "frame": lambda: scaled(batch, frames, 1, hidden),
        }
        return forms[form]()


def _count(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _row_case(op, draw: Draw, dtype):
    hidden = draw.choice(HIDDEN)
    batch = draw.choice((1, 1, 2, 3))
    tokens_max = max(1, MAX_ELEMENTS // (hidden * batch))
    frames = draw.choice((1, 2, 3))
    tokens = frames * draw.rng.randint(1, max(1, min(64, tokens_max) // frames))
    param = draw.choice((dtype, dtype, torch.float32) + FLOATS)
    # A 2-D x [N, D] is B=1, S=N: every modulation form still applies.
    two_d = batch == 1 and op in ("norm_scale_shift", "residual_norm_scale_shift", "add_gate_norm", "add_gate_norm_scale") and draw.chance(0.2)
    shape = (tokens, hidden) if two_d else (batch, tokens, hidden)
    mod = lambda: draw.modulation(draw.choice(MODULATION_FORMS), batch, tokens, hidden, param, frames)  # noqa: E731
    affine = lambda: draw.randn(hidden, dtype=param) if draw.chance(0.7) else None  # noqa: E731
    if op in ("norm_scale_shift_select", "residual_norm_scale_shift_select"):
        index = (torch.rand((batch, tokens), generator=draw.values) > 0.5).to(device=DEVICE, dtype=draw.choice((torch.int64, torch.int32, torch.bool)))
        arguments = dict(x=draw.activation(shape, dtype), index=index)
        for name in ("scale0", "shift0", "gate0", "scale1", "shift1", "gate1"):
            arguments[name] = draw.modulation(draw.choice(("batch", "batch_view", "batch_strided")), batch, tokens, hidden, param, frames)
        arguments.update(weight=affine(), bias=affine(), eps=draw.choice((1e-6, 1e-5)))
        if op == "residual_norm_scale_shift_select":
            arguments.update(residual=draw.activation(shape, dtype), residual_gate=draw.activation(shape, dtype))
        return arguments
    norm = draw.choice(("layer", "rms"))
    bias = lambda: affine() if norm == "layer" else None  # noqa: E731
    eps = draw.choice((1e-6, 1e-5, 1e-3))
    if op == "norm_scale_shift":
        return dict(x=draw.activation(shape, dtype), scale=mod(), shift=mod(), weight=affine(), bias=bias(), norm=norm, eps=eps)
    if op == "residual_norm_scale_shift":
        return dict(x=draw.activation(shape, dtype), residual=draw.activation(shape, dtype), gate=mod() if draw.chance(0.8) else None,
                    scale=mod(), shift=mod(), weight=affine(), bias=bias(), norm=norm, eps=eps)
    arguments = dict(x=draw.activation(shape, dtype), branch=draw.activation(shape, dtype), gate=mod(), weight=affine(), bias=bias(),
                     norm=norm, eps=eps, gate_act=draw.choice((None, "tanh")))
    if op == "add_gate_norm_scale":
        arguments.update(scale=mod(), weight2=affine(), bias2=bias())
    return arguments


def _head_case(op, draw: Draw, dtype):
    head_size = draw.choice(HEAD)
    rotary_dim = head_size if draw.chance(0.6) else 2 * draw.rng.randint(1, head_size // 2)
    q_heads = draw.choice((1, 2, 3, 4, 8))
    k_heads = draw.choice((q_heads, 1, 2))
    leading = (draw.rng.randint(1, 40),) if draw.chance(0.5) else (draw.choice((1, 2)), draw.rng.randint(1, 24))
    tokens = leading[-1]
    while _count(leading) * (q_heads + k_heads) * head_size > MAX_ELEMENTS and leading[-1] > 1:
        leading = (*leading[:-1], leading[-1] // 2)
        tokens = leading[-1]
    if draw.chance(0.3):  # q and k as views of one fused qkv buffer
        width = (q_heads + 2 * k_heads) * head_size
        qkv = draw.randn(*leading, width, dtype=dtype)
        q = qkv[..., : q_heads * head_size].unflatten(-1, (q_heads, head_size))
        k = qkv[..., q_heads * head_size : (q_heads + k_heads) * head_size].unflatten(-1, (k_heads, head_size))
    else:
        q = draw.activation((*leading, q_heads, head_size), dtype, heads=True)
        k = draw.activation((*leading, k_heads, head_size), dtype, heads=True)
    offset = draw.choice((0, 0, 3, 17))
    rows = offset + tokens + draw.choice((0, 5))
    angles = torch.rand((rows, rotary_dim // 2), generator=draw.values, dtype=torch.float64) * 6.3
    cache = torch.cat([angles.cos(), angles.sin()], dim=1).to(device=DEVICE, dtype=draw.choice((torch.float32, torch.float32) + FLOATS))
    positions = None
    if draw.chance(0.4):  # the offset applies only without positions
        offset = 0
        positions = torch.randint(0, rows, leading, generator=draw.values).to(device=DEVICE, dtype=draw.choice((torch.int32, torch.int64)))
    arguments = dict(q=q, k=k, cos_sin_cache=cache, positions=positions, interleaved=draw.chance(0.5),
                     rotary_dim=None if rotary_dim == head_size and draw.chance(0.5) else rotary_dim, position_offset=offset)
    if op == "qk_norm_rope_":
        arguments.update(q_weight=draw.randn(head_size, dtype=draw.choice(FLOATS)), k_weight=draw.randn(head_size, dtype=draw.choice(FLOATS)),
                         eps=draw.choice((1e-6, 1e-5)))
    elif draw.chance(0.2):
        arguments["k"] = None
    if q_heads == k_heads and draw.chance(0.25):  # drawn last: the other cases draw what they drew before
        items = (leading[0],) if len(leading) == 2 and draw.chance(0.5) else ()  # a table per batch item
        angles = torch.rand((*items, rows, q_heads, rotary_dim // 2), generator=draw.values, dtype=torch.float64) * 6.3
        arguments["cos_sin_cache"] = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device=DEVICE, dtype=cache.dtype)
    return arguments


# The FP8 forms of the row ops: a case of the op becomes one of them after its arguments are
# drawn (the cases of the other ops draw exactly what they drew before these forms existed).
FP8_FORMS = {"norm_scale_shift": ("norm_scale_shift_fp8", "quantize_fp8"),
             "residual_norm_scale_shift": ("residual_norm_scale_shift_fp8",),
             "norm_scale_shift_select": ("norm_scale_shift_select_fp8",),
             "residual_norm_scale_shift_select": ("residual_norm_scale_shift_select_fp8",),
             "add_gate_norm_scale": ("add_gate_norm_scale_fp8",)}


def _fp8_form(op: str, arguments: dict, draw: Draw) -> tuple:
    """(op, arguments) of an FP8 form: the format (None: the device's), a static scale now and then."""
    op = draw.choice(FP8_FORMS[op])
    static = torch.tensor(draw.choice((1e-3, 0.05, 1.0)), device=DEVICE) if draw.chance(0.2) else None
    fp8 = dict(fp8_dtype=draw.choice((None, torch.float8_e4m3fn, torch.float8_e4m3fnuz)), static_scale=static)
    if op == "quantize_fp8":
        return op, dict(x=arguments["x"], activation=draw.choice((None, "gelu_tanh")), **fp8)
    return op, dict(arguments, **fp8)


def fuzz_case(seed: int, index: int) -> tuple:
    """(op, dtype, keyword arguments of ditops.<op>) of case ``index`` of ``seed``."""
    draw = Draw(seed, index)
    op = draw.choice(sorted(name for name in PUBLIC if not SPECS[name].quantized))
    dtype = draw.choice(FLOATS)
    build = _head_case if op in ("qk_norm_rope_", "rope_") else _row_case
    arguments = build(op, draw, dtype)
    if op in FP8_FORMS and draw.chance(0.5):
        op, arguments = _fp8_form(op, arguments, draw)
    return op, dtype, arguments


def describe_call(op: str, arguments: dict, backend) -> str:
    """The call as text: every tensor's shape, strides, storage offset and dtype."""

    def show(value):
        if isinstance(value, torch.Tensor):
            return (f"<{str(value.dtype).removeprefix('torch.')} {list(value.shape)} stride {list(value.stride())} "
                    f"offset {value.storage_offset()}>")
        return repr(value)

    shown = ", ".join(f"{name}={show(value)}" for name, value in arguments.items())
    return f"ditops.{op}({shown}, backend={backend!r})"


def run_fuzz_case(seed: int, index: int, backend) -> tuple:
    """("pass" | "refused" | "fail" | "skip", detail) for one case on one backend (None: automatic).
    The automatic choice runs the case twice, on fresh arguments: the first call builds its
    plan, the second finds it (the cached call, in C where dispatch/cached_call.c was built)."""
    op, dtype, arguments = fuzz_case(seed, index)
    if INTERPRETED and dtype == torch.bfloat16 and op in STORED_INTERMEDIATE:
        return "skip", "interpreter rounding"
    if INTERPRETED and backend == "triton" and SPECS[op].quantized:
        return "skip", "the interpreter's FP8 conversion (tests/conformance)"
    expected = conformance.oracle(op, arguments, dtype)
    factor = conditioning(op, arguments, expected)
    for call in ("first call",) if backend is not None else ("first call", "cached call"):
        if call == "cached call":
            arguments = fuzz_case(seed, index)[2]
        _poison_allocator(arguments)
        try:
            result = PUBLIC[op](**arguments, backend=backend)
        except ditops.BackendUnavailable as error:
            if backend is None:  # the reference always accepts: automatic dispatch never refuses
                return "fail", f"automatic dispatch refused: {error}"
            return "refused", str(error).splitlines()[0]
        except Exception as error:  # a crash on valid input is a failure, reported with the call
            return "fail", f"{call} raised {type(error).__name__}: {error}"
        if op in ("qk_norm_rope_", "rope_"):
            actual = tuple(t for t in (arguments["q"], arguments["k"]) if t is not None)
        else:
            actual = result if isinstance(result, tuple) else (result,)
        problems = conformance.compare_results(op, actual, conformance.as_stored(op, arguments, dtype, expected, actual),
                                               dtype, factor)
        if problems:
            return "fail", f"{call}: " + "; ".join(problems)
    return "pass", ""


def conditioning(op: str, arguments: dict, expected: tuple) -> float:
    """How much this case's LayerNorm rows amplify float32 rounding, at least 1: the largest
    |mean| / sqrt(var + eps) over the rows normalized. Subtracting a rounded mean from values
    ``kappa`` times larger than the row's spread errs by about kappa ulps of the result, in any
    float32 implementation: a random 2-wide row of variance 2e-7 < eps gave 13 ulps (seed 17,
    case 1770). RMSNorm and RoPE subtract nothing: 1. ``conformance.compare`` widens only the
    norm-wise bound, by the float32 arithmetic's share; the element-wise tolerances stay, and a
    wrong index or a missed element is off by O(1), far beyond either."""
    layer = op in ("norm_scale_shift_select", "residual_norm_scale_shift_select") or arguments.get("norm") == "layer"
    if op in ("qk_norm_rope_", "rope_") or not layer:
        return 1.0
    if op.startswith("residual_"):
        normalized = [expected[1]]  # residual_out, as stored
    elif op.startswith("add_gate_norm"):
        normalized = [arguments["branch"]] + ([expected[0]] if op == "add_gate_norm_scale" else [])
    else:
        normalized = [arguments["x"]]
    factor = 1.0
    for rows in normalized:
        rows = rows.to(torch.float64)
        mean = rows.mean(-1)
        spread = (rows.var(-1, unbiased=False) + arguments["eps"]).sqrt()
        factor = max(factor, float((mean.abs() / spread).max()) if rows.numel() else 1.0)
    return factor


def _poison_allocator(arguments: dict) -> None:
    """Fills freed device memory with NaN, so that outputs the op allocates next start as NaN
    (the caching allocator hands the same blocks back) and an unwritten element shows."""
    if DEVICE != "cuda":
        return
    largest = max(t.numel() for t in arguments.values() if isinstance(t, torch.Tensor))
    for dtype in FLOATS:
        for _ in range(3):
            torch.full((largest,), float("nan"), dtype=dtype, device=DEVICE)


def backends_here() -> list:
    """Every backend that runs on this machine, then None (the automatic choice) on a GPU. On
    CPU, Triton runs interpreted on a simulated sm_90 and the automatic choice is left out (on
    that simulated device it would pick backends that need a real GPU)."""
    runnable = []
    for backend in conformance.backends():
        with _device_for(backend):
            if not conformance.unavailable_reason(backend, DEVICE):
                runnable.append(backend)
    return runnable + ([None] if DEVICE == "cuda" else [])


def _device_for(backend):
    return simulated_device("sm_90") if INTERPRETED and backend == "triton" else contextlib.nullcontext()


def test_the_generator_is_deterministic_and_covers_every_op():
    ops, forms = set(), set()
    for index in range(200):
        op, dtype, arguments = fuzz_case(SEED, index)
        ops.add(op)
        again = fuzz_case(SEED, index)[2]
        for name, value in arguments.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, again[name]) and value.stride() == again[name].stride(), (index, name)
                forms.add(value.storage_offset() > 0)
    assert ops == set(PUBLIC)
    assert forms == {True, False}, "storage offsets must be drawn"


@pytest.mark.parametrize("shard", range(SHARDS))
@pytest.mark.parametrize("backend", backends_here(), ids=lambda backend: backend or "auto")
def test_fuzz_against_the_float64_oracle(backend, shard):
    counts = {"pass": 0, "refused": 0, "fail": 0, "skip": 0}
    failures = []
    indices = range(shard, CASES, SHARDS)
    with _device_for(backend):
        for index in indices:
            status, detail = run_fuzz_case(SEED, index, backend)
            counts[status] += 1
            if status == "fail":
                op, _, arguments = fuzz_case(SEED, index)
                failures.append(
                    f"case {index}: {detail}\n  call: {describe_call(op, arguments, backend)}\n"
                    f"  replay: python -c \"import sys; sys.path.insert(0, 'tests'); import test_fuzz; "
                    f"print(test_fuzz.run_fuzz_case({SEED}, {index}, {backend!r}))\""
                )
    section = f"fuzz/{backend or 'auto'}" + (f" shard {shard + 1} of {SHARDS}" if SHARDS > 1 else "")
    record(section, {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
                     "seed": SEED, "cases": len(indices), **counts, "failures": failures[:20]})
    assert counts["pass"] + counts["refused"] + counts["skip"] == len(indices), "\n".join(failures[:10])
    assert counts["pass"] > 0, f"no case ran on {backend}: {counts}"
