"""``apply`` and ``remove``: which model class goes to which family's patcher, and the
bookkeeping that lets ``remove`` undo exactly what ``apply`` did."""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from ...fp8 import check_device

from . import chroma, flux, flux_clones, qwen_image, wan, z_image
from .report import Report

SUPPORTED_VERSION = "0.42."

_PATCHERS = {"FluxTransformer2DModel": flux.patch, "WanTransformer3DModel": wan.patch,
             "QwenImageTransformer2DModel": qwen_image.patch, "ZImageTransformer2DModel": z_image.patch,
             "ChromaTransformer2DModel": chroma.patch, "LongCatImageTransformer2DModel": flux_clones.patch,
             "OvisImageTransformer2DModel": flux_clones.patch, "BriaTransformer2DModel": flux_clones.patch,
             "BriaFiboTransformer2DModel": flux_clones.patch, "WanVACETransformer3DModel": wan.patch,
             "WanAnimateTransformer3DModel": wan.patch, "ChronoEditTransformer3DModel": wan.patch,
             "SkyReelsV2Transformer3DModel": wan.patch}


_FP8_PATCHERS = {flux.patch}  # the families whose norm -> projection chains run FP8 with quantize="fp8"
QUANTIZE = (None, "fp8")


def apply(model: torch.nn.Module, quantize: Optional[str] = None) -> Report:
    """Replaces what ditops covers in ``model``; returns what was replaced and what was skipped.
    ``apply`` on a model that is already patched changes nothing and returns the first report.

    ``quantize="fp8"``: the Linears that the ops feed run as FP8 GEMMs (quantize.py: the FP8
    weights stay on the model's device, the bf16 Linears wait in host memory for ``remove``);
    the report lists every Linear and how it runs. A ValueError where the model's device has
    no FP8 GEMM or its family has no FP8 path."""
    if quantize not in QUANTIZE:
        raise ValueError(f"apply: quantize is {quantize!r}; wanted one of {', '.join(map(repr, QUANTIZE))}")
    if getattr(model, "_ditops_patches", None) is not None:
        return model._ditops_report
    import diffusers

    name = type(model).__name__
    if not diffusers.__version__.startswith(SUPPORTED_VERSION):
        return _untouched(model, f"{name}: diffusers {diffusers.__version__} (block code checked for {SUPPORTED_VERSION}x)")
    patcher = _PATCHERS.get(name)
    if patcher is None:
        return _untouched(model, f"{name}: not a supported model ({', '.join(_PATCHERS)})")
    options = {}
    if quantize == "fp8":
        if patcher not in _FP8_PATCHERS:
            raise ValueError(f"apply: quantize='fp8' is not supported for {name} yet; it runs FP8 on "
                             f"{', '.join(n for n, p in _PATCHERS.items() if p in _FP8_PATCHERS)}")
        options["fp8_dtype"] = check_device(next(model.parameters()).device)
    patches, report = [], Report()
    patcher(model, patches, report, **options)
    model._ditops_patches, model._ditops_report = patches, report
    return report


def remove(model: torch.nn.Module) -> None:
    """Puts back every forward and processor ``apply`` replaced; hooks registered meanwhile stay."""
    for patch in reversed(getattr(model, "_ditops_patches", None) or []):
        patch.restore()
    for attribute in ("_ditops_patches", "_ditops_report"):
        if hasattr(model, attribute):
            delattr(model, attribute)


def _untouched(model, reason: str) -> Report:
    warnings.warn(f"ditops.integrations.diffusers.apply left the model untouched: {reason}", stacklevel=3)
    return Report(skipped=[reason])
