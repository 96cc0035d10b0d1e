"""Choosing an implementation for a call, and the user's overrides.

Overrides, strongest first: the ``backend=`` argument of a call; ``use_backend(...)``
(scoped, thread-local, innermost first); the ``DITOPS_BACKEND`` environment variable
(``triton`` or ``rope=cuda,norm_scale_shift=reference``). Each of them forces a backend:
if it cannot take the input, ``BackendUnavailable`` lists every candidate and why it
refused; nothing falls back silently. Without an override, the first implementation of
the registry (after user YAML) that accepts is taken.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Optional

import torch

from . import device as device_module
from .constraints import DEVICE_CHECKS
from .features import Features
from .registry import BUILTIN_REGISTRY, MAX_CONFIG_BYTES, OPS, Implementation, Registry, op_name
from .signature import PlanTable

logger = logging.getLogger("ditops")
_is_grad_enabled = torch.is_grad_enabled

ALL_OPS = "*"


class BackendUnavailable(RuntimeError):
    """No implementation may run this call (a forced backend refused it, or every one refused)."""


class Candidate(NamedTuple):
    backend: str
    refusal: Optional[str]  # None when it accepts


class _Dispatcher:
    """The registry after user config, the environment's overrides and the selection cache."""

    def __init__(self) -> None:
        self.user_configs: list = []
        self.reload()

    def reload(self) -> None:
        """Re-reads the registry, DITOPS_CONFIG, the user configs and DITOPS_BACKEND; clears the cache."""
        registry = Registry()
        registry.load(BUILTIN_REGISTRY)
        for path in config_paths(self.user_configs):
            registry.load(path)
        self.registry = registry
        self.implementations = {op: registry.implementations(op) for op in OPS}
        self.env_forced = parse_backend_setting(os.environ.get("DITOPS_BACKEND", ""), "DITOPS_BACKEND")
        self.plans = PlanTable()  # ditops.ops.Plan by call signature
        self.warned: set = set()
        global _settings_state
        _settings_state = settings_state(self.user_configs)


PACKAGE = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def package_digest(root: Path = PACKAGE) -> str:
    """A hash of ditops' own files under ``root`` (code, kernels, configs): what a choice made
    while a graph is traced, and the Triton kernel it hands to Inductor, come from."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".yaml", ".cu", ".cuh"):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def config_paths(user_configs: list) -> list:
    """The user config files loaded over the registry, in order: DITOPS_CONFIG, then ``user_configs``."""
    env_config = os.environ.get("DITOPS_CONFIG")
    return ([env_config] if env_config else []) + list(user_configs)


def settings_state(user_configs: list) -> str:
    """ditops' files, the config files (config_paths) as they read now, and DITOPS_BACKEND,
    in one short hash."""
    digest = hashlib.sha256(package_digest().encode())
    for path in config_paths(user_configs):
        try:
            text = Path(path).read_bytes()[:MAX_CONFIG_BYTES]
        except OSError:  # Registry.load names the file when it loads it
            text = b""
        digest.update(str(path).encode() + b"\0" + text + b"\0")
    digest.update(os.environ.get("DITOPS_BACKEND", "").encode())
    return digest.hexdigest()[:16]


# The settings of the last reload, ready before the registry is first read: reading it while
# Dynamo traces a call must not read files (a graph break).
_settings_state = settings_state([])


def parse_backend_setting(text: str, where: str) -> dict:
    """``"triton"`` -> {"*": "triton"}; ``"rope=cuda,norm_scale_shift=reference"`` -> per op."""
    forced = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        op, _, backend = item.rpartition("=")
        if not backend:
            raise ValueError(f"{where}: {item!r} is not 'backend' or 'op=backend'")
        forced[op_name(op) if op else ALL_OPS] = backend
    return forced


_dispatcher: Optional[_Dispatcher] = None


def dispatcher() -> _Dispatcher:
    global _dispatcher
    if _dispatcher is None:
        _dispatcher = _Dispatcher()
    return _dispatcher


def load_config(path) -> None:
    """Merges a user YAML (format: ditops.dispatch.registry) over the registry, after DITOPS_CONFIG."""
    state = dispatcher()
    state.user_configs.append(str(path))
    try:
        state.reload()
    except Exception:
        state.user_configs.pop()
        state.reload()
        raise


def reset() -> None:
    """Forgets configs given to ``load_config`` and re-reads the environment."""
    state = dispatcher()
    state.user_configs.clear()
    state.reload()


class _Scopes(threading.local):
    def __init__(self) -> None:
        self.stack: list = []


_scopes = _Scopes()


@contextlib.contextmanager
def use_backend(backend: Optional[str] = None, **per_op: str) -> Iterator[None]:
    """Force a backend inside a ``with`` block (this thread only).

    ``use_backend("triton")`` forces it for every op; ``use_backend(rope="cuda")`` for one op;
    both forms combine. An inner block overrides an outer one.
    """
    scope = {op_name(op): name for op, name in per_op.items()}
    if backend is not None:
        scope[ALL_OPS] = backend
    _scopes.stack.append(scope)
    try:
        yield
    finally:
        _scopes.stack.pop()


def traced_state(op: str, backend: Optional[str]) -> str:
    """What the choice for ``op``'s call traced into a compiled graph depends on besides the
    call's own arguments: ditops' files, the configs and DITOPS_BACKEND of the last reset,
    the ``use_backend`` scopes in force. The graph node takes it as an argument: Dynamo guards
    on what this reads, so a changed override recompiles, and torch's compile caches (in
    memory and on disk) key on the graph, so none serves a graph traced under other settings
    or other ditops code."""
    scoped = _scoped_backend(op) if backend is None else None
    return f"{_settings_state} use_backend={scoped}" if scoped else _settings_state


def _scoped_backend(op: str) -> Optional[str]:
    """The backend the innermost ``use_backend`` scope naming ``op`` (or every op) forces, if any."""
    for scope in reversed(_scopes.stack):
        name = scope.get(op) or scope.get(ALL_OPS)
        if name:
            return name
    return None


def forced_backend(op: str, backend: Optional[str]) -> tuple:
    """(backend name or None, what forced it)."""
    if backend is not None:
        return backend, "the backend= argument"
    scoped = _scoped_backend(op)
    if scoped:
        return scoped, "use_backend()"
    env = dispatcher().env_forced
    name = env.get(op) or env.get(ALL_OPS)
    return (name, "DITOPS_BACKEND") if name else (None, "")


def candidates(op: str, features: Features) -> list:
    """Every enabled implementation of ``op``, best first, with why it refuses (None: accepts)."""
    return [Candidate(impl.name, impl.refusal(features)) for impl in ordered(op, features)]


def ordered(op: str, features: Features) -> list:
    """The enabled implementations of ``op`` in the order a call with these features tries
    them: the registry's, with the backend of a matching measured preference moved first."""
    state = dispatcher()
    implementations = state.implementations[op]
    rule = state.registry.preference(op, features)
    if rule is None:
        return implementations
    return [i for i in implementations if i.name == rule.backend] + [i for i in implementations if i.name != rule.backend]


def device_refusal(backend: str, device: device_module.DeviceInfo) -> Optional[str]:
    """Why ``backend`` can run no call on ``device``, in explain's words: its availability
    check's reason, else what the device constraints (e.g. min_sm) of each of its enabled
    implementations say; None when one of them may accept a call there."""
    state = dispatcher()
    reason = state.registry.backends[backend].refusal(device)
    if reason:
        return reason
    # the device checks read nothing of a call's features but the device
    features = Features._make((device,) + (None,) * (len(Features._fields) - 1))
    reasons = []
    for implementation in (i for implementations in state.implementations.values() for i in implementations):
        if implementation.name != backend:
            continue
        refused = [why for check, wanted in implementation.checks if check in DEVICE_CHECKS and (why := check(wanted, features))]
        if not refused:
            return None
        reasons.append(", and ".join(refused))
    return "; ".join(dict.fromkeys(reasons)) or "no op has an enabled implementation of it"


def fp8_dtypes(device) -> tuple:
    """The FP8 formats of ``device`` (a DeviceInfo, torch.device or string), first the one its
    hardware prefers (registry.yaml's ``fp8_formats``); empty where it has none."""
    info = device if isinstance(device, device_module.DeviceInfo) else device_module.device_info(device)
    return dispatcher().registry.fp8_dtypes_of(info)


def signature_key(op: str, scalars: Callable, arguments: tuple, backend: Optional[str]) -> tuple:
    """The half of a call's signature read in Python (signature.py holds the other half, the
    tensors' metadata, checked per plan): the op, the override in force, grad mode, the
    simulated device, every argument's type (None or a tensor; True is not 1), the non-tensor
    arguments (``scalars`` picks them from ``arguments``) and the first argument's shape."""
    state = _dispatcher or dispatcher()
    forced = forced_backend(op, backend)[0] if backend is not None or _scopes.stack or state.env_forced else None
    return (op, forced, _is_grad_enabled(), device_module._simulation.device, tuple(map(type, arguments)),
            scalars(arguments), arguments[0].shape)


def select(op: str, features: Features, backend: Optional[str] = None) -> Implementation:
    """The implementation that runs a call with these features; logs a fallback once."""
    implementation = choose(op, features, backend)
    if forced_backend(op, backend)[0] is None:
        _log_fallback(dispatcher(), op, implementation, features)
    return implementation


def choose(op: str, features: Features, backend: Optional[str] = None) -> Implementation:
    """The selection itself: uncached and silent (``explain`` uses it too)."""
    state = dispatcher()
    forced, forced_by = forced_backend(op, backend)
    if forced and features.traced:  # compiled_graph is a preference: a forced backend serves compiled graphs too
        features = features._replace(traced=False)
    refusals = []
    for implementation in ordered(op, features):
        reason = implementation.refusal(features)
        if forced and implementation.name != forced:
            refusals.append(Candidate(implementation.name, reason or f"not forced ({forced} is); it would accept"))
            continue
        if reason is None:
            return implementation
        refusals.append(Candidate(implementation.name, reason))
    if forced and forced not in state.registry.backends:
        headline = f"backend {forced!r} (forced by {forced_by}) does not exist; known: {', '.join(state.registry.backends)}"
    elif forced:
        headline = f"backend {forced!r} (forced by {forced_by}) cannot run this call"
        if all(c.backend != forced for c in refusals):
            headline = f"backend {forced!r} (forced by {forced_by}) has no enabled implementation of {op}"
    else:
        headline = "no enabled implementation accepts this call"
    raise BackendUnavailable(f"ditops.{op}: {headline}\n{format_table(features, refusals)}")


def format_table(features: Features, rows: list) -> str:
    lines = [f"  input: {describe_features(features)}"]
    width = max((len(row.backend) for row in rows), default=0)
    for row in rows:
        verdict = "accepts" if row.refusal is None else f"refused: {row.refusal}"
        line = f"  {row.backend:<{width}}  {verdict}"
        if line not in lines:  # a backend with several registry entries refused alike: said once
            lines.append(line)
    return "\n".join(lines)


def describe_features(f: Features) -> str:
    parts = [f"{str(f.dtype).removeprefix('torch.')} on {f.device}"]
    if f.hidden_size:
        parts.append(f"D={f.hidden_size - f.prefix_size}, P={f.prefix_size}" if f.prefix_size else f"D={f.hidden_size}")
        parts.append(f"norm={f.norm}")
        if f.affine:
            parts.append("with a norm weight or bias")
    if f.head_size:
        parts.append(f"Dh={f.head_size}, R={f.rotary_dim}, {'interleaved' if f.interleaved else 'neox'}")
        if f.rope_cache == "per_head":
            parts.append("a cos/sin cache per head")
        if f.norm:  # qk_norm_rope_'s
            parts.append(f"norm={f.norm}")
    if f.modulation:
        parts.append("modulation " + "/".join(f.modulation))
    if f.param_dtypes:
        parts.append("params " + "/".join(sorted({str(d).removeprefix("torch.") for d in f.param_dtypes})))
    parts.append(f"{f.alignment}-byte aligned")
    if f.traced:
        parts.append("traced into a compiled graph")
    if not f.unit_stride:
        parts.append("last-dim stride != 1")
    if f.requires_grad:
        parts.append("requires grad")
    return ", ".join(parts)


def _log_fallback(state: _Dispatcher, op: str, implementation: Implementation, features: Features) -> None:
    """One WARNING per (op, backend, reasons) when a GPU call lands on the reference."""
    if implementation.name != "reference" or not features.device.is_gpu:
        return
    refusals = [c for c in candidates(op, features) if c.refusal]
    # dict.fromkeys: a backend's several registry entries that refuse alike are named once
    reasons = "; ".join(dict.fromkeys(f"{c.backend}: {c.refusal}" for c in refusals))
    reasons = reasons or "no kernel backend is registered for it"
    key = (op, implementation.name, reasons)
    if key in state.warned:
        return
    state.warned.add(key)
    level = logging.INFO if features.requires_grad else logging.WARNING
    logger.log(level, "ditops.%s runs on the slow reference backend on %s (%s)", op, features.device, reasons)
