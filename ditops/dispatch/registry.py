"""The registry: for each op, an ordered list of implementations with their constraints.

It is read from ``ditops/configs/registry.yaml`` and then from user YAML files
(``DITOPS_CONFIG``, ``ditops.load_config``) in the same format, which may add backends
and implementations, reorder them and disable them:

    backends:                      # new or replaced backends
      mine:
        module: my_package.kernels # holds one function per op, named as the op
        available: available       # optional: a function of the module, (DeviceInfo) -> reason or None
        constraints: {devices: [cuda], dtypes: [bfloat16]}   # defaults for its implementations
    ops:
      rope_: [cuda, triton]        # backend names: this op prefers them, in this order (an
                                   # implementation named as the op in the backend's module)
      norm_scale_shift:
        - backend: mine            # a mapping: a new implementation, or one replacing that backend's
          hidden_multiple_of: 8    # constraints of this implementation (merged over the backend's)
    prefer: [triton]               # for every op, move these backends to the front
    disable: [cuda, rope_=triton]  # never pick these (everywhere, or for one op)

Implementations not named keep their registry order behind the named ones.
"""

from __future__ import annotations

import copy
import functools
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import yaml

from . import constraints as constraint_checks
from .device import DeviceInfo
from .features import Features

BUILTIN_REGISTRY = Path(__file__).resolve().parent.parent / "configs" / "registry.yaml"

OPS = (
    "norm_scale_shift",
    "residual_norm_scale_shift",
    "norm_scale_shift_select",
    "residual_norm_scale_shift_select",
    "add_gate_norm",
    "add_gate_norm_scale",
    "qk_norm_rope_",
    "rope_",
)


def op_name(name: str) -> str:
    """Accepts an op's name with or without the trailing underscore of the in-place ops."""
    if name in OPS:
        return name
    if name + "_" in OPS:
        return name + "_"
    raise ValueError(f"unknown op {name!r}; the ops are {', '.join(OPS)}")


@dataclass
class Backend:
    name: str
    module: str
    description: str = ""
    available: Optional[str] = None
    constraints: dict = field(default_factory=dict)
    _refusals: dict = field(default_factory=dict, repr=False)

    def refusal(self, device: DeviceInfo) -> Optional[str]:
        """Why this backend cannot run on ``device`` at all (not importable, no such hardware), or None."""
        if device not in self._refusals:
            self._refusals[device] = self._find_refusal(device)
        return self._refusals[device]

    def _find_refusal(self, device: DeviceInfo) -> Optional[str]:
        try:
            module = importlib.import_module(self.module)
        except Exception as error:  # any import failure means "not available here", with its reason
            return f"cannot import {self.module}: {type(error).__name__}: {error}"
        if self.available is None:
            return None
        return getattr(module, self.available)(device)


@dataclass
class Implementation:
    op: str
    backend: Backend
    function_name: str
    checks: list  # (check, wanted) pairs from constraints.compile_constraints

    @property
    def name(self) -> str:
        return self.backend.name

    @functools.cached_property
    def function(self) -> Callable:
        return getattr(importlib.import_module(self.backend.module), self.function_name)

    def refusal(self, features: Features) -> Optional[str]:
        """Why this implementation cannot take a call with these features (every failed
        constraint, joined by ", and "), or None if it can."""
        reason = self.backend.refusal(features.device)
        if reason:
            return reason
        reasons = [reason for check, wanted in self.checks if (reason := check(wanted, features))]
        return ", and ".join(reasons) or None


class Registry:
    """Backends and, per op, implementations in order of preference."""

    def __init__(self) -> None:
        self.backends: dict = {}
        self.entries: dict = {op: [] for op in OPS}  # op -> list of (backend name, entry mapping)
        self.disabled: set = set()  # (op or "*", backend name)
        self.sources: list = []

    def load(self, path) -> None:
        """Merges one YAML file (format in the module docstring)."""
        path = Path(path)
        try:
            document = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as error:
            raise ValueError(f"cannot read ditops config {path}: {error}") from error
        self.merge(document, str(path))

    def merge(self, document: dict, where: str) -> None:
        unknown = set(document) - {"backends", "ops", "prefer", "disable"}
        if unknown:
            raise ValueError(f"{where}: unknown top-level keys {sorted(unknown)}; known: backends, ops, prefer, disable")
        for name, spec in (document.get("backends") or {}).items():
            spec = dict(spec)
            extra = set(spec) - {"module", "description", "available", "constraints"}
            if "module" not in spec or extra:
                raise ValueError(f"{where}: backend {name!r} needs 'module' and may have description, available, constraints (got {sorted(spec)})")
            self.backends[name] = Backend(name=name, **spec)
        for name in document.get("prefer") or []:
            for op in OPS:
                self._prefer(op, [name], where, create=False)
        for op, entries in (document.get("ops") or {}).items():
            self._prefer(op_name(op), entries, where, create=True)
        for item in document.get("disable") or []:
            op, _, backend = item.rpartition("=")
            self.disabled.add((op_name(op) if op else "*", backend))
        self.sources.append(where)

    def _prefer(self, op: str, entries: list, where: str, create: bool) -> None:
        """Moves the named implementations of ``op`` to the front; ``create`` adds missing ones."""
        current = self.entries[op]
        front = []
        for entry in entries:
            if isinstance(entry, str):
                found = [item for item in current if item[0] == entry]
                if not found and create:
                    found = [(entry, {"backend": entry})]
                front += found
            elif isinstance(entry, dict) and "backend" in entry:
                front.append((entry["backend"], entry))
            else:
                raise ValueError(f"{where}: op {op}: entry {entry!r} is neither a backend name nor a mapping with 'backend'")
        named = {name for name, _ in front}
        self.entries[op] = front + [item for item in current if item[0] not in named]

    def implementations(self, op: str) -> list:
        """The enabled implementations of ``op``, best first."""
        result = []
        for backend_name, entry in self.entries[op]:
            if ("*", backend_name) in self.disabled or (op, backend_name) in self.disabled:
                continue
            where = f"{op} -> {backend_name}"
            backend = self.backends.get(backend_name)
            if backend is None:
                raise ValueError(f"{where}: backend {backend_name!r} is not defined under 'backends'")
            merged = copy.deepcopy(backend.constraints)
            merged.update({k: v for k, v in entry.items() if k not in ("backend", "function")})
            merged.setdefault("autograd", False)
            checks = constraint_checks.compile_constraints(merged, where)
            result.append(Implementation(op, backend, entry.get("function", op), checks))
        return result
