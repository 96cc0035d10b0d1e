"""Backends that exist only for the tests, plugged in through YAML alone (tests/*_registry.yaml).

``fast`` and ``amd`` are correct (they run the reference and record some calls), ``broken``
leaves the last row unwritten and ``sloppy`` is off by 1e-2: the conformance checker must
catch both. The ops not defined here are the reference's, imported for the simulated
per-vendor backends of tests/simulated_registry.yaml.
"""

from ditops.backends import reference
from ditops.backends.reference import (  # noqa: F401 (served to the registry by name)
    add_gate_norm,
    add_gate_norm_scale,
    norm_scale_shift_select,
    qk_norm_rope_,
    residual_norm_scale_shift,
    residual_norm_scale_shift_select,
)

CALLS = []


def available(device):
    return None if device.is_gpu else "needs a GPU"


def norm_scale_shift(x, scale, shift, weight, bias, norm, eps, modulation_index, y):
    CALLS.append("norm_scale_shift")
    return reference.norm_scale_shift(x, scale, shift, weight, bias, norm, eps, modulation_index, y)


def rope_(q, k, cos_sin_cache, positions, interleaved, rotary_dim, position_offset):
    CALLS.append("rope_")
    return reference.rope_(q, k, cos_sin_cache, positions, interleaved, rotary_dim, position_offset)


def broken_norm_scale_shift(x, scale, shift, weight, bias, norm, eps, modulation_index, y):
    rows = x.shape[-2] - 1
    reference.norm_scale_shift(x[..., :rows, :], scale, shift, weight, bias, norm, eps, modulation_index, y[..., :rows, :])


def sloppy_norm_scale_shift(x, scale, shift, weight, bias, norm, eps, modulation_index, y):
    reference.norm_scale_shift(x, scale, shift, weight, bias, norm, eps, modulation_index, y)
    y.add_(1e-2)
