"""``apply(model, quantize="fp8")``: which Linear layers of a model run as FP8 GEMMs.

A model module (flux.py, ...) names each Linear whose input a ditops op produces (a norm with
FP8 output, the GELU + quantisation of an MLP, the row quantisation of an attention output);
``replace_linear`` puts a ``Float8Linear`` (ditops/fp8.py) there, its weight quantised once
per output channel. The bf16 Linear is kept, moved to host memory: the GPU holds the FP8
weights alone (about half the bytes), and ``remove`` moves the bf16 one back and puts it
where it was, so the model has its exact bits again. ``list_linears`` writes, for the report,
every Linear of the model and whether it runs FP8, and why not where it stays bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...fp8 import Float8Linear, Float8PartsLinear
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
    try:
        replacement = Float8PartsLinear(linear, widths, fp8_dtype) if widths else Float8Linear(linear, fp8_dtype)
    except ValueError as error:
        report.linears.append((path, f"bf16: {error}"))
        return False
    patches.append(_LinearPatch(parent, name, linear.to(KEPT_ON), replacement))
    setattr(parent, name, replacement)
    report.linears.append((path, f"fp8 ({str(fp8_dtype).removeprefix('torch.')})"))
    return True


def list_linears(model: torch.nn.Module, report: Report, reasons: dict) -> None:
    """Adds every Linear of ``model`` that stayed bf16 to the report, with the first reason
    of ``reasons`` (a name fragment -> why) that its path contains, or the default."""
    listed = {path for path, _ in report.linears}
    for path, module in model.named_modules():
        if type(module) is torch.nn.Linear and path not in listed:
            why = next((text for fragment, text in reasons.items() if fragment in path),
                       "its input comes from no ditops op with FP8 output")
            report.linears.append((path, f"bf16: {why}"))
