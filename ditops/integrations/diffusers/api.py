"""``apply`` and ``remove``: which model class goes to which family's patcher, and the
bookkeeping that lets ``remove`` undo exactly what ``apply`` did."""

from __future__ import annotations

import warnings

import torch

from . import flux, qwen_image, wan, z_image
from .report import Report

SUPPORTED_VERSION = "0.42."

_PATCHERS = {"FluxTransformer2DModel": flux.patch, "WanTransformer3DModel": wan.patch,
             "QwenImageTransformer2DModel": qwen_image.patch, "ZImageTransformer2DModel": z_image.patch}


def apply(model: torch.nn.Module) -> Report:
    """Replaces what ditops covers in ``model``; returns what was replaced and what was skipped.
    ``apply`` on a model that is already patched changes nothing and returns the first report."""
    if getattr(model, "_ditops_patches", None) is not None:
        return model._ditops_report
    import diffusers

    name = type(model).__name__
    if not diffusers.__version__.startswith(SUPPORTED_VERSION):
        return _untouched(model, f"{name}: diffusers {diffusers.__version__} (block code checked for {SUPPORTED_VERSION}x)")
    patcher = _PATCHERS.get(name)
    if patcher is None:
        return _untouched(model, f"{name}: not a supported model ({', '.join(_PATCHERS)})")
    patches, report = [], Report()
    patcher(model, patches, report)
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
