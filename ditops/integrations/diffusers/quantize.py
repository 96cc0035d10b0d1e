"""``apply(model, quantize="fp8")``: which Linear layers of a model run as FP8 GEMMs.

Every Linear of the model becomes a ``Float8Linear`` (ditops/fp8.py), its weight quantised
once per output channel, where torch._scaled_mm can take its sizes and no hook is on it (a
context-parallel gather, an offload hook: a new module would not carry it). A model module (flux.py,
...) replaces first the Linears whose input a ditops op produces as FP8 rows (a norm with FP8
output, the GELU + quantisation of an MLP) and wires them to it; ``replace_rest`` replaces the
others, which quantise their own input (``quantize_fp8``, one pass). The bf16 Linears are kept,
moved to host memory: the GPU holds the FP8 weights alone (about half the bytes), and
``remove`` moves each back and puts it where it was, so the model has its exact bits again.
The report lists every Linear and how it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...fp8 import Float8Linear, Float8PartsLinear
from .patching import hook_on
from .report import Report

KEPT_ON = "cpu"  # where the replaced bf16 Linears wait for ``remove``


@dataclass
class _LinearPatch:
    parent: torch.nn.Module
    name: str
    original: torch.nn.Module
    replacement: torch.nn.Module

    def restore(self) -> None:
        if getattr(self.parent, self.name) is not self.replacement:  # replaced again after apply: theirs stays
            return
        device = next(self.replacement.buffers()).device
        setattr(self.parent, self.name, self.original.to(device))


def replace_linear(patches: list, report: Report, parent: torch.nn.Module, name: str, path: str, fp8_dtype,
                   widths: tuple = ()) -> bool:
    """``parent.<name>`` (an nn.Linear) -> its Float8Linear (Float8PartsLinear over ``widths``
    where its input is a concatenation quantised part by part). False, with the reason in the
    report, where it is not a plain Linear or its sizes do not fit an FP8 GEMM."""
    linear = getattr(parent, name)
    if type(linear) is not torch.nn.Linear:
        report.linears.append((path, f"bf16: a {type(linear).__name__}, not a torch.nn.Linear"))
        return False
    hook = hook_on(linear)
    if hook is not None:  # a new module would not carry it (a context-parallel gather, an offload hook)
        report.linears.append((path, f"bf16: it has {hook}, which a replacement would drop"))
        return False
    try:
        replacement = Float8PartsLinear(linear, widths, fp8_dtype) if widths else Float8Linear(linear, fp8_dtype)
    except ValueError as error:
        report.linears.append((path, f"bf16: {error}"))
        return False
    patches.append(_LinearPatch(parent, name, linear.to(KEPT_ON), replacement))
    setattr(parent, name, replacement)
    report.linears.append((path, f"fp8 ({str(fp8_dtype).removeprefix('torch.')})"))
    return True


EMBEDDERS = "embed"  # a path holding this names a timestep, text or patch embedder


def replace_rest(model: torch.nn.Module, patches: list, report: Report, fp8_dtype) -> None:
    """Every Linear of ``model`` not replaced yet -> its Float8Linear, which quantises its own
    input per row (one ``quantize_fp8`` pass), but the embedders' (they run once per forward
    on a few rows, and diffusers casts their input to their parameters' dtype: Wan's time
    embedder) and those the model's context-parallel plan names (its final projection:
    ``enable_parallelism`` hooks it by name, before or after ``apply``); the report says why
    where one stays bf16."""
    done = {path for path, _ in report.linears}
    planned = set(getattr(model, "_cp_plan", None) or {})  # enable_parallelism hooks these modules by name
    parents = dict(model.named_modules())
    for path, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear or path in done:
            continue
        if EMBEDDERS in path:
            report.linears.append((path, "bf16: an embedder (once per forward, few rows; diffusers reads its dtype)"))
        elif path in planned:  # the same model whether apply or enable_parallelism comes first
            report.linears.append((path, "bf16: named in the model's context-parallel plan (_cp_plan)"))
        else:
            parent_path, _, name = path.rpartition(".")
            if replace_linear(patches, report, parents[parent_path], name, path, fp8_dtype):
                report.linears[-1] = (path, report.linears[-1][1] + ", quantises its own input")
