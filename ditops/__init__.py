"""ditops: fused ops for diffusion transformers, one API on NVIDIA and AMD GPUs.

The ops (docs/ops.md) dispatch to the best backend for their inputs; ``use_backend``,
``DITOPS_BACKEND`` and ``DITOPS_CONFIG`` / ``load_config`` override the choice and
``explain`` says what would run and why.
"""

from .dispatch import BackendUnavailable, fp8_dtypes, load_config, simulated_device, use_backend
from .ops import (
    Explanation,
    add_gate_norm,
    add_gate_norm_scale,
    add_gate_norm_scale_fp8,
    explain,
    norm_scale_shift,
    norm_scale_shift_fp8,
    norm_scale_shift_select,
    norm_scale_shift_select_fp8,
    qk_norm_rope_,
    quantize_fp8,
    residual_norm_scale_shift,
    residual_norm_scale_shift_fp8,
    residual_norm_scale_shift_select,
    residual_norm_scale_shift_select_fp8,
    rope_,
)
from .rope_cache import rope_cos_sin_cache

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "Explanation",
    "add_gate_norm",
    "add_gate_norm_scale",
    "add_gate_norm_scale_fp8",
    "explain",
    "fp8_dtypes",
    "load_config",
    "norm_scale_shift",
    "norm_scale_shift_fp8",
    "norm_scale_shift_select",
    "norm_scale_shift_select_fp8",
    "qk_norm_rope_",
    "quantize_fp8",
    "residual_norm_scale_shift",
    "residual_norm_scale_shift_fp8",
    "residual_norm_scale_shift_select",
    "residual_norm_scale_shift_select_fp8",
    "rope_",
    "rope_cos_sin_cache",
    "simulated_device",
    "use_backend",
]
