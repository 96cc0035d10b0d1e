"""Capability checks: each YAML constraint key names one check.

A check takes the value written in the YAML and the call's ``Features`` and returns
None when the call is acceptable, else a short reason a user can act on. Adding a
kind of constraint means adding one function here and using its key in the YAML.
"""

from __future__ import annotations

import re
import reprlib
from typing import Callable, Optional

import torch

from .features import Features

Reason = Optional[str]


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def devices(wanted: list, f: Features) -> Reason:
    if f.device.vendor not in wanted:
        return f"runs on {', '.join(wanted)}, not {f.device.vendor}"


def min_sm(wanted: int, f: Features) -> Reason:
    if f.device.vendor == "cuda" and f.device.sm < wanted:
        return f"needs sm_{wanted} or newer, got {f.device.arch}"


def archs(wanted: list, f: Features) -> Reason:
    if f.device.vendor == "rocm" and f.device.arch not in wanted:
        return f"supports AMD {', '.join(wanted)}, not {f.device.arch}"


def device_names(wanted: list, f: Features) -> Reason:
    """A device class by name ("H100" matches "NVIDIA H100 80GB HBM3"): for measured preferences."""
    if not any(name in f.device.name for name in wanted):
        return f"measured on {', '.join(wanted)}, not on {f.device.name or f.device.arch + ' (unnamed)'}"


def dtypes(wanted: list, f: Features) -> Reason:
    if f.dtype not in wanted:
        return f"activations must be {_dtype_names(wanted)}, got {_dtype_names([f.dtype])}"


def param_dtypes(wanted: list, f: Features) -> Reason:
    refused = sorted({d for d in f.param_dtypes if d not in wanted}, key=str)
    if refused:
        return f"modulation/weight/cache tensors must be {_dtype_names(wanted)}, got {_dtype_names(refused)}"


def alignment(wanted: int, f: Features) -> Reason:
    if f.alignment < wanted:
        return f"needs {wanted}-byte aligned data pointers and strides, got {f.alignment}-byte alignment"


def unit_stride(wanted: bool, f: Features) -> Reason:
    if wanted and not f.unit_stride:
        return "needs every tensor's last dimension to have stride 1"


def uniform_param_dtype(wanted: bool, f: Features) -> Reason:
    if wanted and len(set(f.param_dtypes)) > 1:
        return f"needs modulation/weight tensors of one dtype, got {_dtype_names(sorted(set(f.param_dtypes), key=str))}"


def _width(f: Features) -> str:
    """The row width a call's sizes name: D, or P + D where a prefix comes before x's columns."""
    if f.prefix_size:
        return f"P + D = {f.prefix_size} + {f.hidden_size - f.prefix_size}"
    return f"D={f.hidden_size}"


def hidden_multiple_of(wanted: int, f: Features) -> Reason:
    # P and D each: a kernel's chunk of a row then lies wholly in the prefix or wholly in x
    if f.prefix_size % wanted or (f.hidden_size - f.prefix_size) % wanted:
        if f.prefix_size:
            return f"needs P and D to be multiples of {wanted}, got P={f.prefix_size}, D={f.hidden_size - f.prefix_size}"
        return f"needs D to be a multiple of {wanted}, got D={f.hidden_size}"


def min_hidden_size(wanted: int, f: Features) -> Reason:
    if f.hidden_size < wanted:
        return f"supports {'P + D' if f.prefix_size else 'D'} >= {wanted}, got {_width(f)}"


def max_hidden_size(wanted: int, f: Features) -> Reason:
    if f.hidden_size > wanted:
        return f"supports {'P + D' if f.prefix_size else 'D'} <= {wanted}, got {_width(f)}"


def max_batch_size(wanted: int, f: Features) -> Reason:
    if f.batch_size > wanted:
        return f"supports B <= {wanted} batch items, got B={f.batch_size}"


def head_sizes(wanted: list, f: Features) -> Reason:
    if f.head_size not in wanted:
        return f"supports Dh in {wanted}, got Dh={f.head_size}"


def head_size_multiple_of(wanted: int, f: Features) -> Reason:
    if f.head_size % wanted:
        return f"needs Dh to be a multiple of {wanted}, got Dh={f.head_size}"


def rotary_dim_multiple_of(wanted: int, f: Features) -> Reason:
    if f.rotary_dim % wanted:
        return f"needs R (rotary_dim) to be a multiple of {wanted}, got R={f.rotary_dim}"


def max_head_size(wanted: int, f: Features) -> Reason:
    if f.head_size > wanted:
        return f"supports Dh <= {wanted}, got Dh={f.head_size}"


def full_rotary(wanted: bool, f: Features) -> Reason:
    if wanted and f.rotary_dim != f.head_size:
        return f"needs rotary_dim == Dh, got R={f.rotary_dim}, Dh={f.head_size}"


def norms(wanted: list, f: Features) -> Reason:
    if f.norm and f.norm not in wanted:
        return f"supports norm in {wanted}, got {f.norm!r}"


def rope_caches(wanted: list, f: Features) -> Reason:
    if f.rope_cache and f.rope_cache not in wanted:
        return f"supports cos/sin cache forms {wanted} ([P, R]: one row for every head), got {f.rope_cache!r}"


def modulation(wanted: list, f: Features) -> Reason:
    refused = sorted(set(form for form in f.modulation if form not in wanted))
    if refused:
        return f"supports modulation forms {wanted}, got {refused}"


def layouts(wanted: list, f: Features) -> Reason:
    if f.head_size and ("interleaved" if f.interleaved else "neox") not in wanted:
        return f"supports RoPE layouts {wanted}, got {'interleaved' if f.interleaved else 'neox'}"


def affine(wanted: bool, f: Features) -> Reason:
    if f.affine and not wanted:
        return "takes no norm weight or bias"


def autograd(wanted: bool, f: Features) -> Reason:
    if f.requires_grad and not wanted:
        return "is forward-only and an input requires grad"


def compiled_graph(wanted: bool, f: Features) -> Reason:
    if f.traced and not wanted:
        return "leaves calls in a compiled graph to what Inductor launches itself (measured faster there)"


def fp8_output(wanted: bool, f: Features) -> Reason:
    """An FP8 output in a format the device's hardware converts to (registry.yaml: fp8_formats)."""
    if wanted and f.out_dtype is not None and not f.out_dtype_native:
        return f"needs a GPU with hardware {_dtype_names([f.out_dtype])} (fp8_formats), not {f.device.arch}"


def needs_real_device(wanted: bool, f: Features) -> Reason:
    """A backend that launches through a GPU driver cannot serve a device simulated for calls
    that run here: their tensors are in host memory (simulated_device, ditops/dispatch/device.py)."""
    if wanted and f.device.runs_here:
        return (f"launches through the GPU driver, and {f.device.arch} is simulated here: the calls run on CPU "
                "tensors (Triton's interpreter with TRITON_INTERPRET=1, else the reference)")


# Releases of the GPU software stacks that backends load at run time, by name: a function
# returning "major.minor", set by the backend that loads it (ditops/backends/rocm: "rocm").
# Dispatch cannot import the backends (they import it), so they report here.
RELEASES: dict = {}


def min_rocm(wanted: dict, f: Features) -> Reason:
    """hiprtc compiles only for the archs its LLVM knows: the oldest ROCm release per arch."""
    needed = wanted.get(f.device.arch)
    if needed is None:
        return None
    release = RELEASES.get("rocm")
    if release is None:
        return f"needs ROCm {needed} or newer for {f.device.arch}; no ROCm runtime is loaded in this process"
    found = release()
    if _version_numbers(found) < _version_numbers(needed):
        return f"needs ROCm {needed} or newer for {f.device.arch} (its hiprtc's LLVM), got ROCm {found}"


def _version_numbers(text: str) -> tuple:
    return tuple(int(part) for part in text.split("."))


CHECKS: dict = {
    check.__name__: check
    for check in (
        devices,
        min_sm,
        archs,
        device_names,
        dtypes,
        param_dtypes,
        uniform_param_dtype,
        alignment,
        unit_stride,
        hidden_multiple_of,
        min_hidden_size,
        max_hidden_size,
        max_batch_size,
        head_sizes,
        head_size_multiple_of,
        rotary_dim_multiple_of,
        max_head_size,
        full_rotary,
        norms,
        rope_caches,
        modulation,
        layouts,
        affine,
        autograd,
        compiled_graph,
        needs_real_device,
        fp8_output,
        min_rocm,
    )
}

# The checks that read only the call's device: one that refuses, refuses every call there.
DEVICE_CHECKS = frozenset((devices, min_sm, archs, device_names, needs_real_device, min_rocm))

# What each constraint's YAML value must be: (what a message says is wanted, the test).
# Checked when a config loads, so that a typo fails there, naming the file and the field,
# instead of at a call (or never: `devices: cuda` would test substrings of "cuda").


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # YAML's true is not a size


def _positive(value) -> bool:
    return _integer(value) and value > 0


def _non_negative(value) -> bool:
    return _integer(value) and value >= 0


def _list_of(test: Callable) -> Callable:
    return lambda value: isinstance(value, list) and all(test(item) for item in value)


def _names_from(*names: str) -> Callable:
    return _list_of(lambda item: isinstance(item, str) and item in names)


def _is_gfx(name) -> bool:
    return isinstance(name, str) and name.startswith("gfx") and name[3:].isalnum()


def _is_version(text) -> bool:
    return isinstance(text, str) and re.fullmatch(r"\d+(\.\d+)*", text) is not None


def _is_torch_dtype_name(name) -> bool:
    return isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype)


_BOOLEAN = ("true or false", lambda value: isinstance(value, bool))
_POSITIVE = ("an integer > 0", _positive)
_SIZE = ("an integer >= 0", _non_negative)
_DTYPES = ("a list of torch dtype names (e.g. [float16, bfloat16])", _list_of(_is_torch_dtype_name))

VALUE_TYPES: dict = {
    "devices": ("a list of device vendors among cuda, rocm, cpu", _names_from("cuda", "rocm", "cpu")),
    "min_sm": ("an integer >= 0 (e.g. 80 for sm_80)", _non_negative),
    "archs": ("a list of AMD arch names (e.g. [gfx90a, gfx942])", _list_of(_is_gfx)),
    "device_names": ("a list of GPU names or parts of them (e.g. [H100, H200])",
                     _list_of(lambda item: isinstance(item, str) and item.strip() != "")),
    "dtypes": _DTYPES,
    "param_dtypes": _DTYPES,
    "uniform_param_dtype": _BOOLEAN,
    "alignment": ("an integer > 0 (bytes)", _positive),
    "unit_stride": _BOOLEAN,
    "hidden_multiple_of": _POSITIVE,
    "min_hidden_size": _SIZE,
    "max_hidden_size": _SIZE,
    "max_batch_size": _SIZE,
    "head_sizes": ("a list of integers > 0", _list_of(_positive)),
    "head_size_multiple_of": _POSITIVE,
    "rotary_dim_multiple_of": _POSITIVE,
    "max_head_size": _SIZE,
    "full_rotary": _BOOLEAN,
    "norms": ("a list of norms among layer, rms", _names_from("layer", "rms")),
    "rope_caches": ("a list of cos/sin cache forms among shared, per_head", _names_from("shared", "per_head")),
    "modulation": ("a list of modulation forms among scalar, vector, batch, token, frame, table",
                   _names_from("scalar", "vector", "batch", "token", "frame", "table")),
    "layouts": ("a list of RoPE layouts among interleaved, neox", _names_from("interleaved", "neox")),
    "affine": _BOOLEAN,
    "autograd": _BOOLEAN,
    "compiled_graph": _BOOLEAN,
    "needs_real_device": _BOOLEAN,
    "fp8_output": _BOOLEAN,
    "min_rocm": ('a mapping of AMD arch names to ROCm releases (e.g. {gfx942: "6.0"})',
                   lambda value: isinstance(value, dict) and all(_is_gfx(arch) and _is_version(version)
                                                                 for arch, version in value.items())),
}
assert set(VALUE_TYPES) == set(CHECKS), "every check needs its value type"

DTYPE_CONSTRAINTS = ("dtypes", "param_dtypes")


def shown(value, limit: int = 60) -> str:
    """A short repr of a config value for a message: never the whole of a big field."""
    return _SHORT_REPR.repr(value)[:limit]


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxlist, _SHORT_REPR.maxdict, _SHORT_REPR.maxstring, _SHORT_REPR.maxother = 2, 4, 4, 40, 40


def compile_constraints(constraints: dict, where: str) -> list:
    """Turns YAML constraints into (check, wanted) pairs, rejecting unknown keys and values of
    the wrong type (``where`` names the file and field in the message)."""
    compiled = []
    for key, wanted in constraints.items():
        check: Callable = CHECKS.get(key) if isinstance(key, str) else None
        if check is None:
            raise ValueError(f"{where}: unknown constraint {shown(key)}; known: {', '.join(CHECKS)}")
        description, valid = VALUE_TYPES[key]
        if not valid(wanted):
            if key in DTYPE_CONSTRAINTS and isinstance(wanted, list):
                bad = next(name for name in wanted if not _is_torch_dtype_name(name))
                raise ValueError(f"{where}: constraint {key}: {shown(bad)} is not a torch dtype")
            raise ValueError(f"{where}: constraint {key}: got {shown(wanted)}, wanted {description}")
        if key in DTYPE_CONSTRAINTS:
            wanted = [getattr(torch, name) for name in wanted]
        compiled.append((check, wanted))
    return compiled
