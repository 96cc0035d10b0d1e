"""The benchmark cases: each op spec's ``bench`` inputs (ditops/opspec.py: the real shapes
of docs/ops.md, laid out as the models pass them, plus a small latency case), and the CPU run's
stand-ins. ``minimum_bytes`` counts the fewest bytes an op must move: each distinct input
element read once, each output written once (an FP8 output: a byte per value, 4 per row's scale).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..inputs import HeadSpec
from ..opspec import SPECS, BenchShape

@dataclass(frozen=True)
class BenchCase:
    op: str
    model: str
    shape: str  # e.g. "B1 S32760 D1536"
    build: Callable  # (device, dtype, generator) -> keyword arguments of ditops.<op>; the generator may live on the GPU
    quick: bool = False  # part of `ditops bench --quick`


def case(op: str, shape: BenchShape) -> BenchCase:
    """One of an op spec's benchmark inputs as a case."""
    spec = SPECS[op]
    return BenchCase(op, shape.model, shape.shape,
                     lambda device, dtype, generator: spec.build(shape.inputs, dtype, device, generator), shape.quick)


CASES = [case(op, shape) for op, spec in SPECS.items() for shape in spec.bench]

CPU_ROWS = dict(batch=1, tokens=256, hidden=512)  # the CPU run's stand-in shapes
CPU_HEADS = dict(leading=(256,), q_heads=4, k_heads=4, head_size=64, positions=None)


def cpu_case(case: BenchCase) -> BenchCase:
    """The same op, layout and norm at a shape a CPU runs in milliseconds."""
    spec = SPECS[case.op]
    shape = next(shape for shape in spec.bench if (shape.model, shape.shape) == (case.model, case.shape))
    if isinstance(shape.inputs, HeadSpec):
        inputs = dataclasses.replace(shape.inputs, **CPU_HEADS)
        text = f"T{inputs.leading[0]} H{inputs.q_heads} Dh{inputs.head_size}" + ("" if inputs.interleaved else " neox")
    else:
        inputs = dataclasses.replace(shape.inputs, affine=True, **CPU_ROWS)
        text = f"B{inputs.batch} S{inputs.tokens}{f' P{inputs.prefix}' if inputs.prefix else ''} D{inputs.hidden}"
    return BenchCase(case.op, case.model + " (CPU stand-in)", text,
                     lambda device, dtype, generator: spec.build(inputs, dtype, device, generator), case.quick)


def _distinct_bytes(t: Optional[torch.Tensor]) -> int:
    """Bytes of the distinct elements a tensor addresses (broadcast dimensions, stride 0, count once)."""
    if t is None:
        return 0
    elements = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            elements *= size
    return elements * t.element_size()


def minimum_bytes(op: str, arguments: dict) -> int:
    """The fewest bytes ``op`` must move: each distinct input element read once, each output
    written once. The RoPE ops read and write q and k, and read one cache row per distinct
    position (one per token when positions is None), a row of every head's values where the
    cache has a row per head."""
    if SPECS[op].inputs is HeadSpec:
        q, k, cache, positions = arguments["q"], arguments.get("k"), arguments["cos_sin_cache"], arguments.get("positions")
        tokens = q.shape[:-2].numel()
        row = cache.shape[-1] * (cache.shape[-2] if cache.dim() > 2 else 1)  # values per position
        rows = tokens if positions is None else min(positions.numel(), cache.numel() // row)
        total = 2 * (_distinct_bytes(q) + _distinct_bytes(k)) + rows * row * cache.element_size()
        total += _distinct_bytes(positions)
        weights = (arguments.get("q_weight"), arguments.get("k_weight"))
        return total + sum(_distinct_bytes(w) for w in weights)
    tensors = {id(value): value for value in arguments.values() if isinstance(value, torch.Tensor)}  # one tensor passed twice
    inputs = sum(_distinct_bytes(value) for value in tensors.values())  # (weight2 = weight) is read once
    first = next(value for value in arguments.values() if isinstance(value, torch.Tensor))  # outputs are shaped like it
    if not SPECS[op].quantized:
        return inputs + len(SPECS[op].outputs) * first.numel() * first.element_size()
    # FP8 rows, a byte per value (quantize_fp8's prefix columns too), and a float32 scale per
    # row, in place of the first two outputs; the others are shaped like the first input
    rows = first.shape[:-1].numel()
    prefix = arguments.get("prefix")
    width = first.shape[-1] + (prefix.shape[-1] if prefix is not None else 0)
    return inputs + rows * (width + 4) + (len(SPECS[op].outputs) - 2) * first.numel() * first.element_size()
