"""Put ditops under a diffusers transformer: ``report = apply(model)``, ``remove(model)``.

``apply`` re-expresses parts of the model's blocks through the ditops ops, in place on the
module instances (the innermost link of a block's forward, an attention's ``processor``), and
returns a report of what it replaced and what it skipped. ``remove`` restores what it replaced;
``apply`` on a model that is already patched changes nothing. Everything a model does that no
op covers stays as diffusers wrote it. Supported (diffusers 0.42): FLUX.1 (``flux``), FLUX.2
(``flux2``), Chroma (``chroma``), the FLUX.1 copies LongCat-Image, Ovis-Image, Bria 3.2 and FIBO
(``flux_clones``), Wan 2.1/2.2, Wan-VACE, Wan-Animate, ChronoEdit and SkyReels-V2 (``wan``,
whose blocks are matched by their code), SD3 and SD3.5 (``sd3``), Qwen-Image and
Qwen-Image-Edit (``qwen_image``), Z-Image (``z_image``); each module says what it replaces. Any
other model class, or another diffusers version, is left untouched with one warning.

Works with diffusers' deployment features in any order with ``apply`` (``patching`` says how):
context parallelism (``enable_parallelism``, Ulysses and ring), every ``ModelHook``, group
offloading, layerwise casting, model and sequential CPU offload, regional compilation
(``compile_repeated_blocks``) and ``torch.compile`` of the whole model.

Modules: ``api`` (apply, remove) over ``flux``, ``flux2``, ``chroma``, ``flux_clones``, ``wan``,
``sd3``, ``qwen_image``, ``z_image`` (one per model family), which stand on ``patching`` (where
and how a forward or processor is replaced) and ``report``.
"""

from ... import ops  # noqa: F401  (the ops the model modules call; tests record calls through it)
from .api import SUPPORTED_VERSION, apply, remove
from .report import Report

__all__ = ["SUPPORTED_VERSION", "Report", "apply", "remove"]
