"""``apply(model, quantize="fp8")``: which Linear layers of a model run as FP8 GEMMs.

Every Linear of the model becomes a ``Float8Linear`` (ditops/fp8.py), its weight quantised
once per output channel, where torch._scaled_mm can take its sizes and no hook is on it (a
context-parallel gather, an offload hook: a new module would not carry it). A model module
(flux.py, ...) first replaces the Linears that a ditops op would feed FP8 rows (a norm with FP8
output, the GELU + quantisation of an MLP) with ``replace_fed``: all of a block's or none, and
its norms give FP8 rows only where all were replaced, so that FP8 rows never reach a bf16
Linear. ``replace_rest`` replaces the others, which quantise their own input
(``quantize_fp8``, one pass). The bf16 Linears are kept, moved to host memory: the GPU holds
the FP8 weights alone (about half the bytes), and ``remove`` moves each back and puts it where
it was, so the model has its exact bits again. The report lists every Linear and how it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import ops
from ...fp8 import Float8Linear, Float8Rows
from . import patching
from .report import Report

KEPT_ON = "cpu"  # where the replaced bf16 Linears wait for ``remove``
EMBEDDERS = "embed"  # a path holding this names a timestep, text or patch embedder


@dataclass
class _LinearPatch:
    parent: torch.nn.Module
    name: str
    original: torch.nn.Module
    replacement: torch.nn.Module

    def restore(self) -> None:
        if getattr(self.parent, self.name) is not self.replacement:  # replaced again after apply: theirs stays
            return
        device = next(self.replacement.buffers()).device
        setattr(self.parent, self.name, self.original.to(device))


def _replacement(linear, fp8_dtype) -> tuple:
    """(the Float8Linear for ``linear``, None), or (None, why it stays bf16)."""
    if type(linear) is not torch.nn.Linear:
        return None, f"a {type(linear).__name__}, not a torch.nn.Linear"
    hook = patching.hook_on(linear)
    if hook is not None:
        return None, f"it has {hook}, which a replacement would drop"
    try:
        return Float8Linear(linear, fp8_dtype), None
    except ValueError as error:
        return None, str(error)


def _install(patches: list, report: Report, parent, name: str, path: str, replacement, fp8_dtype, how: str = "") -> None:
    patches.append(_LinearPatch(parent, name, getattr(parent, name).to(KEPT_ON), replacement))
    setattr(parent, name, replacement)
    report.linears.append((path, f"fp8 ({str(fp8_dtype).removeprefix('torch.')}){how}"))


def fed(parent, names: tuple, path: str) -> list:
    """The Linears ``parent.<name>`` as replace_fed takes them."""
    return [(parent, name, f"{path}.{name}") for name in names]


def takes_rows(report: Report, attention, processor_class, owner: str) -> bool:
    """Whether ``attention``'s processor is ditops' ``processor_class``, whose projections take
    FP8 rows (diffusers' processors take tensors); where not, the report says that ``owner``'s
    norms give bf16."""
    if isinstance(attention.processor, processor_class):
        return True
    report.skipped.append(f"{owner}: its norms give bf16 (the attention processor is not ditops')")
    return False


def replace_fed(patches: list, report: Report, linears: list, fp8_dtype, owner: str) -> bool:
    """The Linears an op would feed FP8 rows, as (parent, name, path): all of them ->
    their FP8 modules, True; or, where one cannot be replaced, none, False, and the report
    says which and why (``owner``'s norms then give bf16, which replace_rest's Linears take)."""
    built = [(parent, name, path, *_replacement(getattr(parent, name), fp8_dtype)) for parent, name, path in linears]
    refused = [f"{path} ({why})" for _, _, path, _, why in built if why]
    if refused:
        report.skipped.append(f"{owner}: its norms give bf16, not FP8 rows: {'; '.join(refused)} stays bf16")
        return False
    for parent, name, path, replacement, _ in built:
        _install(patches, report, parent, name, path, replacement, fp8_dtype)
    return True


@dataclass
class _JointPatch:
    module: torch.nn.Module
    name: str
    joint: torch.nn.Module
    fused_projections: bool = True  # set with the joint on an attention (join_projections): unset with it

    def restore(self) -> None:
        if getattr(self.module, self.name, None) is self.joint:
            delattr(self.module, self.name)
            if self.fused_projections:
                self.module.fused_projections = False


def join(patches: list, report: Report, module, path: str, joint_name: str, names: tuple) -> bool:
    """The FP8 Linears ``names`` of ``module``, which take the same rows, -> one FP8 GEMM
    ``module.<joint_name>`` whose output is theirs side by side (the caller's forward splits
    it); False (and a skip in the report) where one GEMM cannot serve them."""
    try:
        joint = Float8Linear.side_by_side([getattr(module, name) for name in names])
    except ValueError as error:
        report.skipped.append(f"{path}: {', '.join(names)} stay separate GEMMs ({error})")
        return False
    setattr(module, joint_name, joint)
    patches.append(_JointPatch(module, joint_name, joint, fused_projections=False))
    report.replaced.append((f"{path}.{joint_name}", f"one FP8 GEMM for {', '.join(names)}"))
    return True


def join_projections(patches: list, report: Report, attention, path: str, joints: dict) -> None:
    """Each group of projections of ``attention`` (``joints``: {joint name: names}), which
    replace_fed made FP8 and which take the same rows, -> one FP8 GEMM ``attention.<joint
    name>``, in diffusers' fused-projection form (``fused_projections``, which its processors,
    ditops' and diffusers', read for every group at once: all groups are joined or none). Left
    alone where the model's own projections are fused already."""
    if not hasattr(attention, "fused_projections") or any(hasattr(attention, name) for name in joints):
        return
    try:
        built = {joint_name: Float8Linear.side_by_side([getattr(attention, name) for name in names])
                 for joint_name, names in joints.items()}
    except ValueError as error:  # parts that one GEMM cannot serve (a bias on some only): each runs alone
        report.skipped.append(f"{path}: its projections stay separate GEMMs ({error})")
        return
    for joint_name, joint in built.items():
        setattr(attention, joint_name, joint)
        patches.append(_JointPatch(attention, joint_name, joint))
        report.replaced.append((f"{path}.{joint_name}", f"one FP8 GEMM for {', '.join(joints[joint_name])}"))
    attention.fused_projections = True


def replace_rest(model: torch.nn.Module, patches: list, report: Report, fp8_dtype) -> None:
    """Every Linear of ``model`` not replaced yet -> its Float8Linear, which quantises its own
    input per row (one ``quantize_fp8`` pass), but the embedders' (they run once per forward
    on a few rows, and diffusers casts their input to their parameters' dtype: Wan's time
    embedder) and those the model's context-parallel plan names (its final projection:
    ``enable_parallelism`` hooks it by name, before or after ``apply``); the report says why
    where one stays bf16."""
    done = {path for path, _ in report.linears}
    planned = set(getattr(model, "_cp_plan", None) or {})  # enable_parallelism hooks these modules by name
    parents = dict(model.named_modules())
    for path, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear or path in done:
            continue
        if EMBEDDERS in path:
            report.linears.append((path, "bf16: an embedder (once per forward, few rows; diffusers reads its dtype)"))
        elif path in planned:  # the same model whether apply or enable_parallelism comes first
            report.linears.append((path, "bf16: named in the model's context-parallel plan (_cp_plan)"))
        else:
            replacement, why = _replacement(module, fp8_dtype)
            parent_path, _, name = path.rpartition(".")
            if why:
                report.linears.append((path, f"bf16: {why}"))
            else:
                _install(patches, report, parents[parent_path], name, path, replacement, fp8_dtype,
                         ", quantises its own input")


# diffusers' GELU-tanh FeedForward (FLUX, Qwen-Image, Wan): FP8 rows in, the GELU and the
# quantisation of its wide hidden state as one quantize_fp8 between its two FP8 GEMMs. Its
# SwiGLU FeedForward (Ovis-Image): FP8 rows in to the up projection, diffusers' forward as it is
# (quantize_fp8 has no SwiGLU: the down projection quantises its own input).


def _gelu_tanh_feed_forward(ff) -> bool:
    """Whether ``ff`` is diffusers' FeedForward with a GELU(tanh) up projection, dropout, a Linear down."""
    from diffusers.models.activations import GELU

    net = getattr(ff, "net", None)
    return (net is not None and len(net) == 3 and type(net[0]) is GELU and net[0].approximate == "tanh"
            and type(net[1]) is torch.nn.Dropout and type(net[2]) is torch.nn.Linear)


def _swiglu_feed_forward(ff) -> bool:
    """Whether ``ff`` is diffusers' FeedForward with a SwiGLU up projection, dropout, a Linear down."""
    from diffusers.models.activations import SwiGLU

    net = getattr(ff, "net", None)
    return (net is not None and len(net) == 3 and type(net[0]) is SwiGLU and type(net[1]) is torch.nn.Dropout
            and type(net[2]) is torch.nn.Linear)


def _feed_forward_linears(ff, path: str, gelu: bool) -> list:
    """The Linears of a FeedForward that FP8 rows reach, as replace_fed takes them: a GELU-tanh
    FeedForward's up and down projections, a SwiGLU one's up projection."""
    up = [(ff.net[0], "proj", f"{path}.net.0.proj")]
    return up + [(ff.net, "2", f"{path}.net.2")] if gelu else up


def _feed_forward_fp8(self, hidden_states, *args, **kwargs):
    """The FeedForward with its GELU and the quantisation of its hidden state as one
    quantize_fp8 between the two FP8 GEMMs. Dropout is the identity at inference; in training
    diffusers' code runs."""
    if self.training:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    hidden = self.net[0].proj(hidden_states)
    return self.net[2](Float8Rows(*ops.quantize_fp8(hidden, activation="gelu_tanh")))


def replace_fed_with_feed_forwards(patches: list, report: Report, linears: list, feed_forwards: dict, fp8_dtype,
                                   owner: str) -> bool:
    """replace_fed for ``linears`` and the projections of the FeedForwards ``feed_forwards``
    ({path: module}) that ``owner``'s norms feed, each of them diffusers' GELU-tanh FeedForward,
    then wired with its GELU and quantisation fused, or its SwiGLU one; False where one is
    another kind (the report says which) or replace_fed refuses."""
    gelu = {path for path, ff in feed_forwards.items() if _gelu_tanh_feed_forward(ff)}  # before replace_fed
    others = [path for path, ff in feed_forwards.items() if path not in gelu and not _swiglu_feed_forward(ff)]
    if others:
        report.skipped.append(
            f"{owner}: its norms give bf16 ({', '.join(others)}: not diffusers' GELU-tanh or SwiGLU FeedForward)")
        return False
    for path, ff in feed_forwards.items():
        linears = linears + _feed_forward_linears(ff, path, path in gelu)
    if not replace_fed(patches, report, linears, fp8_dtype, owner):
        return False
    for path, ff in feed_forwards.items():
        if path in gelu and patching.replace_forward(patches, report, ff, path, _feed_forward_fp8):
            report.replaced.append((path, "quantize_fp8 (GELU)"))
    return True
