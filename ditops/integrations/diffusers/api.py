"""``apply`` and ``remove``: which model class goes to which family's patcher, and the
bookkeeping that lets ``remove`` undo exactly what ``apply`` did."""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from ...fp8 import check_device
from . import (chroma, cogvideox, cosmos, flux, flux2, flux_clones, hidream, hunyuan_video, kandinsky5, lumina2, ltx2,
               minimax_h3, qwen_image, sd3, wan, z_image)
from .report import Report

SUPPORTED_VERSION = "0.42."

_PATCHERS = {"FluxTransformer2DModel": flux.patch, "WanTransformer3DModel": wan.patch,
             "QwenImageTransformer2DModel": qwen_image.patch, "ZImageTransformer2DModel": z_image.patch,
             "ChromaTransformer2DModel": chroma.patch, "LongCatImageTransformer2DModel": flux_clones.patch,
             "OvisImageTransformer2DModel": flux_clones.patch, "BriaTransformer2DModel": flux_clones.patch,
             "BriaFiboTransformer2DModel": flux_clones.patch, "WanVACETransformer3DModel": wan.patch,
             "WanAnimateTransformer3DModel": wan.patch, "ChronoEditTransformer3DModel": wan.patch,
             "SkyReelsV2Transformer3DModel": wan.patch, "HeliosTransformer3DModel": wan.patch,
             "SD3Transformer2DModel": sd3.patch,
             "Flux2Transformer2DModel": flux2.patch, "HunyuanVideoTransformer3DModel": hunyuan_video.patch,
             "HunyuanVideoFramepackTransformer3DModel": hunyuan_video.patch,
             "HunyuanVideo15Transformer3DModel": hunyuan_video.patch,
             "HunyuanImageTransformer2DModel": hunyuan_video.patch, "Lumina2Transformer2DModel": lumina2.patch,
             "CosmosTransformer3DModel": cosmos.patch, "Kandinsky5Transformer3DModel": kandinsky5.patch,
             "HiDreamImageTransformer2DModel": hidream.patch, "LTX2VideoTransformer3DModel": ltx2.patch,
             "LTXVideoTransformer3DModel": ltx2.patch, "MiniMaxH3Transformer3DModel": minimax_h3.patch,
             "CogVideoXTransformer3DModel": cogvideox.patch, "ConsisIDTransformer3DModel": cogvideox.patch}


QUANTIZE = (None, "fp8")


def apply(model: torch.nn.Module, quantize: Optional[str] = None) -> Report:
    """Replaces what ditops covers in ``model``; returns what was replaced and what was skipped.
    ``apply`` on a model that is already patched changes nothing and returns the first report
    (a ValueError if it asks for another ``quantize``: ``remove`` first).

    ``quantize="fp8"``: every Linear runs as an FP8 GEMM (quantize.py: the FP8 weights stay on
    the model's device, the bf16 Linears wait in host memory for ``remove``), fed FP8 rows by
    the norms where the family's module wires them (docs/diffusers.md says which, per family),
    else quantising its own input; the report lists every Linear and how it runs. A ValueError
    where the model's device has no FP8 GEMM (registry.yaml's fp8_formats)."""
    if quantize not in QUANTIZE:
        raise ValueError(f"apply: quantize is {quantize!r}; wanted one of {', '.join(map(repr, QUANTIZE))}")
    if getattr(model, "_ditops_patches", None) is not None:
        if getattr(model, "_ditops_quantize", None) != quantize:
            raise ValueError(f"apply: quantize is {quantize!r}, but the model is patched with quantize="
                             f"{model._ditops_quantize!r}; wanted remove(model) first")
        return model._ditops_report
    import diffusers

    name = type(model).__name__
    if not diffusers.__version__.startswith(SUPPORTED_VERSION):
        return _untouched(model, f"{name}: diffusers {diffusers.__version__} (block code checked for {SUPPORTED_VERSION}x)")
    patcher = _PATCHERS.get(name)
    if patcher is None:
        return _untouched(model, f"{name}: not a supported model ({', '.join(_PATCHERS)})")
    fp8_dtype = check_device(next(model.parameters()).device) if quantize == "fp8" else None
    patches, report = [], Report()
    patcher(model, patches, report, fp8_dtype=fp8_dtype)  # with fp8_dtype a family replaces every Linear (quantize.py)
    model._ditops_patches, model._ditops_report, model._ditops_quantize = patches, report, quantize
    return report


def remove(model: torch.nn.Module) -> None:
    """Puts back every forward and processor ``apply`` replaced; hooks registered meanwhile stay."""
    for patch in reversed(getattr(model, "_ditops_patches", None) or []):
        patch.restore()
    for attribute in ("_ditops_patches", "_ditops_report", "_ditops_quantize"):
        if hasattr(model, attribute):
            delattr(model, attribute)


def _untouched(model, reason: str) -> Report:
    warnings.warn(f"ditops.integrations.diffusers.apply left the model untouched: {reason}", stacklevel=3)
    return Report(skipped=[reason])
