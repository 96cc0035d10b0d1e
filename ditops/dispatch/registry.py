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
    preferences:                   # measured exceptions to the order of ``ops``
      residual_norm_scale_shift:
        - backend: cuda            # taken first where it accepts a call that ``when`` matches
          when: {device_names: [H200], min_hidden_size: 4097, max_hidden_size: 5120}
          evidence:                # rows of `ditops bench` JSON files where backend is the fastest of backends
            - {file: benchmarks/results/NVIDIA-H200_2026-11-26.json, model: Wan2.1-14B 720p,
               shape: B1 S75600 D5120, dtype: bfloat16, backends: [cuda, triton]}

Implementations not named keep their registry order behind the named ones. ``prefer`` and
``ops.<op>`` set an order themselves, so they drop the measured preferences of the ops they
reorder (every op for ``prefer``); ``preferences.<op>`` replaces that op's rules.

**A config file runs code**: each backend's ``module`` is imported (and its ``available``
function called) with the rights of the process, like ``import`` in a script. Load only
config files you would run as code. The file is checked before anything of it is used:

- every field's type, every op and backend name (in ``ops``, ``prefer``, ``disable``),
  every constraint's name and value type: a typo raises ``ValueError`` naming the file and
  the field, never drops the user's intent silently;
- a backend defined by a user file is imported when the file loads: a module that cannot be
  imported, or that lacks the functions its implementations name (``module: os`` is not a
  ditops backend), is refused by name; the built-in backends are imported on first use, and
  one that cannot be imported there is only unavailable (e.g. no cuda-python on this machine);
- a file is read only up to ``MAX_CONFIG_BYTES`` and its YAML aliases may expand to at most
  ``MAX_CONFIG_NODES`` nodes (an alias bomb is refused at once; the built-in registry's
  aliases expand to a few hundred); messages show short excerpts of a field, never all of it.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
import yaml

from . import constraints as constraint_checks
from .constraints import shown
from .contract import Kernel, as_kernel
from .device import DeviceInfo
from .features import Features

BUILTIN_REGISTRY = Path(__file__).resolve().parent.parent / "configs" / "registry.yaml"

MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_NODES = 100_000

OPS: dict = {}  # op name -> its reference function, in declaration order: ditops/opspec.py declares every op


def declare_op(name: str, reference: Callable) -> None:
    """Makes ``name`` an op the registry knows, run by ``reference`` on the reference backend
    (the op's definition). An op that the registry files name no implementation for runs there alone."""
    OPS[name] = reference

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
_BACKEND_KEYS = ("module", "description", "available", "constraints")
_TOP_LEVEL_KEYS = ("backends", "ops", "prefer", "disable", "preferences", "fp8_formats")
_EVIDENCE_KEYS = ("file", "model", "shape", "dtype", "backends")
_RESULTS_FILE = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*\.json\Z")


def op_name(name: str) -> str:
    """Accepts an op's name with or without the trailing underscore of the in-place ops."""
    if isinstance(name, str):
        if name in OPS:
            return name
        if name + "_" in OPS:
            return name + "_"
    raise ValueError(f"unknown op {shown(name)}; the ops are {', '.join(OPS)}")


@dataclass
class Backend:
    name: str
    module: str
    description: str = ""
    available: Optional[str] = None
    constraints: dict = field(default_factory=dict)
    strict: bool = False  # defined by a user file: its module was imported and checked at load
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
            return f"cannot import {self.module}: {type(error).__name__}: {str(error)[:300]}"
        if self.available is None:
            return None
        check = f"{self.module}.{self.available}"
        try:
            reason = getattr(module, self.available)(device)
        except Exception as error:  # a broken check makes the backend unavailable, with the reason shown
            return f"its availability check {check} raised {type(error).__name__}: {str(error)[:300]}"
        if reason is not None and not isinstance(reason, str):
            return f"its availability check {check} returned {shown(reason)}; wanted None or a reason string"
        return reason


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
    def kernel(self) -> Kernel:
        """What ditops/ops.py runs, binds or traces (dispatch/contract.py). The reference
        backend runs the op's declared reference."""
        if self.backend.name == "reference":
            return as_kernel(OPS[self.op])
        return as_kernel(getattr(importlib.import_module(self.backend.module), self.function_name))

    def refusal(self, features: Features) -> Optional[str]:
        """Why this implementation cannot take a call with these features (every failed
        constraint, joined by ", and "), or None if it can."""
        reason = self.backend.refusal(features.device)
        if reason:
            return reason
        reasons = [reason for check, wanted in self.checks if (reason := check(wanted, features))]
        return ", and ".join(reasons) or None


class Evidence(NamedTuple):
    """A row of a ``ditops bench`` results file (its ``rows`` entries are keyed by op, model,
    shape, dtype and candidate) that times ``backends`` on the preference's op."""

    file: str  # relative to the repository root: benchmarks/results/<GPU>_<date>.json
    model: str
    shape: str
    dtype: str
    backends: tuple

    def __str__(self) -> str:
        return f"{self.file}: {self.model} {self.shape} {self.dtype} ({' vs '.join(self.backends)})"


class Preference(NamedTuple):
    """A measured exception to an op's order: ``backend`` goes first where ``checks`` pass,
    because it is the fastest of the backends timed in each row of ``evidence``."""

    backend: str
    checks: list  # (check, wanted) pairs from constraints.compile_constraints
    evidence: tuple  # Evidence rows

    @property
    def cited(self) -> str:
        return "ditops bench " + "; ".join(str(row) for row in self.evidence)

    def __str__(self) -> str:
        return f"{self.backend} goes first here, measured: {self.cited}"


class Registry:
    """Backends and, per op, implementations in order of preference."""

    def __init__(self) -> None:
        self.backends: dict = {}
        self.entries: dict = {op: [] for op in OPS}  # op -> list of (backend name, entry mapping); none: the reference alone
        self.disabled: set = set()  # (op or "*", backend name)
        self.preferences: dict = {op: [] for op in OPS}  # op -> list of Preference, first match wins
        self.fp8_formats: dict = {}  # "sm_89" (that sm and newer) or an AMD arch -> its FP8 torch dtypes
        self.sources: list = []

    def load(self, path) -> None:
        """Merges one YAML file (format in the module docstring); a bad one raises ValueError."""
        path = Path(path)
        self.merge(read_config(path), str(path), trusted=path.resolve() == BUILTIN_REGISTRY)

    def merge(self, document, where: str, *, trusted: bool = False) -> None:
        """Merges one parsed config; ``where`` names it in messages. Backends defined by an
        untrusted (user) document are imported and checked now."""
        document = {} if document is None else document
        known = ", ".join(_TOP_LEVEL_KEYS)
        _expect(document, dict, where, "the document", f"a mapping with keys {known}")
        unknown = [key for key in document if key not in _TOP_LEVEL_KEYS]
        if unknown:
            raise ValueError(f"{where}: unknown top-level keys [{', '.join(shown(key) for key in unknown[:4])}]; known: {known}")
        for name, spec in _field(document, "backends", dict, where).items():
            self.backends[name] = _backend(name, spec, where, strict=not trusted)
        for position, name in enumerate(_field(document, "prefer", list, where)):
            self._known_backend(name, where, f"prefer[{position}]")
            for op in OPS:
                self._prefer(op, [name], where, create=False)
        for op, entries in _per_op(document, "ops", where, "a list of backend names or mappings with 'backend'"):
            self._prefer(op, entries, where, create=True)
        for op, rules in _per_op(document, "preferences", where, "a list of mappings with backend, when, evidence"):
            self.preferences[op] = [self._preference(rule, where, f"preferences.{op}[{i}]") for i, rule in enumerate(rules)]
        for position, item in enumerate(_field(document, "disable", list, where)):
            self._disable(item, where, f"disable[{position}]")
        for device, names in _field(document, "fp8_formats", dict, where).items():
            self.fp8_formats[device] = self._fp8_dtypes(device, names, where)
        self._check_modules(where)
        self.sources.append(where)

    @staticmethod
    def _fp8_dtypes(device, names, where: str) -> tuple:
        at = f"fp8_formats.{device}"
        if not re.fullmatch(r"sm_\d+|gfx[0-9a-f]+", device):
            raise ValueError(f"{where}: {at}: the key {shown(device)}; wanted sm_<number> or an AMD gfx arch")
        _expect(names, list, where, at, "a list of FP8 dtype names")
        dtypes = tuple(getattr(torch, name, None) if isinstance(name, str) else None for name in names)
        if not all(isinstance(dtype, torch.dtype) and dtype.itemsize == 1 and dtype.is_floating_point for dtype in dtypes):
            raise ValueError(f"{where}: {at}: got {shown(names)}; wanted FP8 torch dtype names (float8_e4m3fn, ...)")
        return dtypes

    def fp8_dtypes_of(self, device: DeviceInfo) -> tuple:
        """The FP8 formats ``device`` converts to and multiplies in: an NVIDIA GPU those of the
        newest ``sm_N`` entry at or below its sm, an AMD GPU its arch's; the CPU every one
        (the reference backend computes them)."""
        if not device.is_gpu:
            return tuple(dict.fromkeys(dtype for dtypes in self.fp8_formats.values() for dtype in dtypes))
        if device.vendor == "rocm":
            return self.fp8_formats.get(device.arch, ())
        eligible = [(int(key[3:]), dtypes) for key, dtypes in self.fp8_formats.items()
                    if key.startswith("sm_") and int(key[3:]) <= device.sm]
        return max(eligible)[1] if eligible else ()

    def _known_backend(self, name, where: str, at: str) -> None:
        if not isinstance(name, str) or name not in self.backends:
            raise ValueError(f"{where}: {at}: backend {shown(name)} is not defined under 'backends'; known: {', '.join(self.backends)}")

    def _disable(self, item, where: str, at: str) -> None:
        _expect(item, str, where, at, "'backend' or 'op=backend'")
        op, _, backend = item.rpartition("=")
        try:
            op = op_name(op) if op else "*"
        except ValueError as error:
            raise ValueError(f"{where}: {at}: {error}") from None
        self._known_backend(backend, where, at)
        self.disabled.add((op, backend))

    def _preference(self, rule, where: str, at: str) -> "Preference":
        keys = ("backend", "when", "evidence")
        if not isinstance(rule, dict) or set(rule) != set(keys):
            raise ValueError(f"{where}: {at}: got {shown(rule)}, wanted a mapping with exactly the keys {', '.join(keys)}")
        self._known_backend(rule["backend"], where, f"{at}.backend")
        _expect(rule["when"], dict, where, f"{at}.when", "a mapping of constraint names to values")
        checks = constraint_checks.compile_constraints(rule["when"], f"{where}: {at}.when")
        evidence = rule["evidence"]
        if not isinstance(evidence, list) or not evidence:
            raise ValueError(f"{where}: {at}.evidence: got {shown(evidence)}, wanted a list of one or more rows of "
                             f"ditops bench files ({', '.join(_EVIDENCE_KEYS)})")
        rows = tuple(self._evidence(row, rule["backend"], where, f"{at}.evidence[{i}]") for i, row in enumerate(evidence))
        return Preference(rule["backend"], checks, rows)

    def _evidence(self, row, backend: str, where: str, at: str) -> Evidence:
        if not isinstance(row, dict) or set(row) != set(_EVIDENCE_KEYS):
            raise ValueError(f"{where}: {at}: got {shown(row)}, wanted a mapping with exactly the keys {', '.join(_EVIDENCE_KEYS)}")
        file = row["file"]
        if not isinstance(file, str) or not _RESULTS_FILE.match(file) or ".." in file.split("/"):
            raise ValueError(f"{where}: {at}.file: got {shown(file)}, wanted the path of a ditops bench JSON file "
                             "relative to the repository root (benchmarks/results/<GPU>_<date>.json)")
        for key in ("model", "shape"):
            _expect(row[key], str, where, f"{at}.{key}", "a string: the row's value in the file")
        constraint_checks.compile_constraints({"dtypes": [row["dtype"]]}, f"{where}: {at}.dtype")
        backends = row["backends"]
        _expect(backends, list, where, f"{at}.backends", f"a list of the timed backends, {backend} and at least one other")
        for position, name in enumerate(backends):
            self._known_backend(name, where, f"{at}.backends[{position}]")
        if backend not in backends or len(set(backends)) < 2:
            raise ValueError(f"{where}: {at}.backends: got {shown(backends)}, wanted {backend} and at least one other backend")
        return Evidence(file, row["model"], row["shape"], row["dtype"], tuple(backends))

    def preference(self, op: str, features: Features) -> Optional["Preference"]:
        """The first measured preference of ``op`` whose conditions the call meets, or None."""
        for rule in self.preferences[op]:
            if all(check(wanted, features) is None for check, wanted in rule.checks):
                return rule
        return None

    def _prefer(self, op: str, entries: list, where: str, create: bool) -> None:
        """Moves the named implementations of ``op`` to the front; ``create`` adds missing ones.
        The op's measured preferences were measured against the order this replaces: dropped."""
        self.preferences[op] = []
        current = self.entries[op]
        front = []
        for position, entry in enumerate(entries):
            at = f"ops.{op}[{position}]"
            if isinstance(entry, str):
                self._known_backend(entry, where, at)
                found = [item for item in current if item[0] == entry]
                if not found and create:
                    found = [(entry, {"backend": entry})]
                front += found
            elif isinstance(entry, dict) and "backend" in entry:
                self._known_backend(entry["backend"], where, at)
                if "function" in entry:
                    _expect_identifier(entry["function"], where, f"{at}.function")
                constraints = {key: value for key, value in entry.items() if key not in ("backend", "function")}
                constraint_checks.compile_constraints(constraints, f"{where}: {at}")
                front.append((entry["backend"], entry))
            else:
                raise ValueError(f"{where}: {at}: got {shown(entry)}, wanted a backend name or a mapping with 'backend'")
        named = {name for name, _ in front}
        self.entries[op] = front + [item for item in current if item[0] not in named]

    def _check_modules(self, where: str) -> None:
        """Each user-defined backend's module defines what the registry will call: its
        ``available`` function (taking the DeviceInfo) and the function of every
        implementation that names it; one that no implementation names yet must define at
        least one op, or it is not a ditops backend."""
        for backend in self.backends.values():
            if not backend.strict:
                continue
            at = f"{where}: backend {backend.name!r} (module {backend.module})"
            module = _import(backend.module, at)
            if backend.available is not None:
                function = getattr(module, backend.available, None)
                if not callable(function) or not _takes_one_argument(function):
                    raise ValueError(
                        f"{at}: available: {backend.module}.{backend.available} must be a function of the DeviceInfo "
                        "returning None or a reason string; the module lacks it or it takes other arguments"
                    )
            named = [(op, entry.get("function", op)) for op in OPS for name, entry in self.entries[op] if name == backend.name]
            for op, function_name in named:
                if not callable(getattr(module, function_name, None)):
                    raise ValueError(f"{at}: ops.{op}: the module has no function {function_name!r}; a ditops backend defines one per op it serves")
            if not named and not any(callable(getattr(module, op, None)) for op in OPS):
                raise ValueError(f"{at}: the module is not a ditops backend: it defines none of the ops ({', '.join(OPS)})")

    def implementations(self, op: str) -> list:
        """The enabled implementations of ``op``, best first."""
        result = []
        for backend_name, entry in self.entries[op] or [("reference", {"backend": "reference"})]:
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


def read_config(path: Path):
    """The parsed YAML of a config file, refusing files too big, or whose aliases expand too far,
    before anything walks the document."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ValueError(f"cannot read ditops config {path}: {error}") from error
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"cannot read ditops config {path}: it is larger than {MAX_CONFIG_BYTES} bytes")
    loader = yaml.SafeLoader(data)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node, MAX_CONFIG_NODES)
        if size > MAX_CONFIG_NODES:
            raise ValueError(
                f"cannot read ditops config {path}: its aliases expand to more than {MAX_CONFIG_NODES} YAML nodes "
                "(an alias bomb?); a ditops config needs a few hundred"
            )
        return loader.construct_document(node)
    except yaml.YAMLError as error:
        raise ValueError(f"cannot read ditops config {path}: {str(error)[:400]}") from None
    except RecursionError:
        raise ValueError(f"cannot read ditops config {path}: it is nested too deeply") from None
    finally:
        loader.dispose()


def _expanded_size(root, limit: int) -> int:
    """How many nodes the YAML graph under ``root`` has once every alias is expanded; stops
    early past ``limit``. Each distinct node is visited once (its size is remembered), so a
    bomb of 9^10 expanded nodes costs a hundred steps."""
    sizes: dict = {}
    active: set = set()  # nodes whose children are being sized: meeting one again is a cycle
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        children = _children(node)
        if children_done:
            active.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in children)
            if sizes[key] > limit:
                return sizes[key]
            continue
        if key in sizes:
            continue
        if key in active:  # a node that contains itself expands without end
            return limit + 1
        active.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in sizes)
    return sizes[id(root)]


def _children(node) -> list:
    if isinstance(node, yaml.MappingNode):
        return [item for pair in node.value for item in pair]
    if isinstance(node, yaml.SequenceNode):
        return node.value
    return []


_TYPE_NAMES = {dict: "a mapping", list: "a list", str: "a string"}


def _expect(value, wanted: type, where: str, at: str, description: str) -> None:
    if not isinstance(value, wanted):
        got = "null" if value is None else f"{type(value).__name__} {shown(value)}"
        raise ValueError(f"{where}: {at}: got {got}, wanted {description}")


def _field(document: dict, key: str, wanted: type, where: str):
    """A top-level field, of its type (absent or null: empty); mapping keys must be names."""
    value = document.get(key)
    if value is None:
        return wanted()
    _expect(value, wanted, where, key, _TYPE_NAMES[wanted])
    if wanted is dict:
        for name in value:
            if key == "backends":
                _expect_identifier(name, where, f"backends: the name {shown(name)}")
            else:
                _expect(name, str, where, f"{key}: the key {shown(name)}", "a string")
    return value


def _per_op(document: dict, key: str, where: str, description: str) -> list:
    """(op, list) pairs of a top-level mapping of op names to lists (``ops``, ``preferences``)."""
    pairs = []
    for op, items in _field(document, key, dict, where).items():
        try:
            op = op_name(op)
        except ValueError as error:
            raise ValueError(f"{where}: {key}: {error}") from None
        _expect(items, list, where, f"{key}.{op}", description)
        pairs.append((op, items))
    return pairs


def _expect_identifier(name, where: str, at: str) -> None:
    if not isinstance(name, str) or not _IDENTIFIER.match(name):
        raise ValueError(f"{where}: {at}: got {shown(name)}, wanted a name of letters, digits and _ (at most 64)")


def _backend(name: str, spec, where: str, strict: bool) -> Backend:
    at = f"backends.{name}"
    if not isinstance(spec, dict) or "module" not in spec or any(key not in _BACKEND_KEYS for key in spec):
        keys = sorted(shown(key) for key in spec) if isinstance(spec, dict) else shown(spec)
        raise ValueError(f"{where}: backend {name!r} needs 'module' and may have description, available, constraints (got {keys})")
    module = spec["module"]
    if not isinstance(module, str) or not _MODULE.match(module):
        raise ValueError(f"{where}: {at}.module: got {shown(module)}, wanted a dotted Python module name (my_package.kernels)")
    description = spec.get("description", "")
    _expect(description, str, where, f"{at}.description", "a string")
    available = spec.get("available")
    if available is not None:
        _expect_identifier(available, where, f"{at}.available")
    constraints = spec.get("constraints") or {}
    _expect(constraints, dict, where, f"{at}.constraints", "a mapping of constraint names to values")
    constraint_checks.compile_constraints(constraints, f"{where}: {at}.constraints")
    return Backend(name, module, description, available, constraints, strict=strict)


def _import(module: str, at: str):
    try:
        return importlib.import_module(module)
    except Exception as error:  # whatever the module raises while importing, named with it
        raise ValueError(f"{at}: cannot import {module}: {type(error).__name__}: {str(error)[:300]}") from None


def _takes_one_argument(function: Callable) -> bool:
    try:
        inspect.signature(function).bind(None)
    except TypeError:
        return False
    except ValueError:  # no signature to read (some builtins): let the call decide
        pass
    return True
