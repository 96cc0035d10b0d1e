"""How ditops sits inside a diffusers model without getting in the way of diffusers' own machinery.

Three rules, each for a feature of diffusers that wraps or configures modules:

1. A ditops forward is the innermost link of the module's forward chain. diffusers'
   ``HookRegistry`` (context-parallel splits and gathers, group offloading, layerwise casting,
   the caching hooks, any ``ModelHook``) and accelerate's hooks (model and sequential CPU
   offload) wrap a module by capturing its bound ``forward`` at registration and setting their
   wrapper on the instance. So ditops does not replace ``module.forward``: it follows the chain
   (instance ``forward`` -> accelerate's ``_old_forward`` -> the first ``HookFunctionReference``
   of the registry) to the link that holds the class's own forward and puts its function there.
   Hooks registered before ``apply`` keep running, because their wrappers are untouched; hooks
   registered after wrap the instance's forward, whose innermost link is ditops'. ``remove``
   finds that link again (wherever later hooks moved it) and puts the class's forward back, so
   the hooks stay. A per-instance subclass swap would not do: a registry that captured the bound
   forward before ``apply`` keeps calling the old class's function.
2. A ditops processor keeps diffusers' processor contract: ``_attention_backend`` and
   ``_parallel_config`` are attributes of it (``enable_parallelism`` and
   ``set_attention_backend`` look for them there), read and written through to the processor
   it replaces, and attention runs through ``dispatch_attention_fn`` with both. So the order of
   ``apply`` and ``enable_parallelism`` does not matter, the processor ``remove`` restores holds
   whatever was set meanwhile, and calls that ditops hands back to diffusers' processor see the
   same configuration.
3. Modules whose call a ditops forward replaces by an op (the norms it fuses; their weights are
   read directly) are checked at every call: when one of them has a hook (a diffusers
   ``ModelHook``, an accelerate hook, a torch forward hook, any forward set on the instance),
   the call runs diffusers' own code instead, so the hook runs exactly as without ditops
   (leaf-level group offloading, sequential CPU offload, layerwise casting with the norms cast),
   and one warning names the hook. Hooks on a block itself, or on the modules that ditops still
   calls (the projections, the MLPs), never need this: they run as they would anyway.
   Global module hooks (``torch.nn.modules.module.register_module_forward_hook``) are not
   checked: they see the fused norms' calls missing.
"""

from __future__ import annotations

import types
import warnings
from dataclasses import dataclass

import torch

from ...fp8 import Float8Linear, Float8Rows
from .report import Report

# ----- forwards: the innermost link ---------------------------------------------------------


def _is_class_forward(value, module) -> bool:
    return getattr(value, "__func__", None) is type(module).forward and getattr(value, "__self__", None) is module


def _innermost_link(module, function=None):
    """(holder, attribute) of the link of ``module``'s forward chain that runs the module's own
    code: the class's forward bound to it (or ``function`` bound to it, a ditops forward), or
    None when the chain ends in something else (a forward someone replaced)."""
    holder, attribute = module, "forward"
    visited = set()
    while True:
        value = getattr(holder, attribute)
        if _is_class_forward(value, module) or (function is not None and getattr(value, "__func__", None) is function
                                                 and getattr(value, "__self__", None) is module):
            return holder, attribute
        if "_old_forward" in vars(module) and "accelerate" not in visited:  # accelerate's add_hook_to_module
            visited.add("accelerate")
            holder, attribute = module, "_old_forward"
            continue
        registry = vars(module).get("_diffusers_hook")
        if registry is not None and registry._fn_refs and "registry" not in visited:
            visited.add("registry")
            first = registry._fn_refs[0]  # the first hook registered captured the forward below them all
            holder, attribute = first, "original_forward" if first.original_forward is not None else "forward"
            continue
        return None


@dataclass
class _ForwardPatch:
    module: torch.nn.Module
    function: types.FunctionType
    original: object  # the link's value before apply, or None: the class's forward showed through

    def restore(self) -> None:
        link = _innermost_link(self.module, self.function)
        if link is None or _is_class_forward(getattr(*link), self.module):
            return  # someone replaced the forward after apply; theirs stays
        holder, attribute = link
        if holder is self.module and attribute == "forward" and self.original is None:
            delattr(self.module, "forward")
        else:
            original = self.original or types.MethodType(type(self.module).forward, self.module)
            setattr(holder, attribute, original)


def replace_forward(patches: list, report: Report, module, path: str, function) -> bool:
    """Puts ``function`` (``function(module, ...)``) at the innermost link of ``module``'s
    forward chain; False (and a skip in the report) when that chain ends in something else."""
    link = _innermost_link(module)
    if link is None:
        report.skipped.append(f"{path}: its forward was replaced by something ditops does not know; left as it is")
        return False
    holder, attribute = link
    class_shows_through = holder is module and attribute == "forward" and "forward" not in vars(module)
    patches.append(_ForwardPatch(module, function, None if class_shows_through else getattr(holder, attribute)))
    setattr(holder, attribute, types.MethodType(function, module))
    return True


# ----- modules whose call ditops replaces: hooks there send the call back to diffusers ------

_warned = set()


def hook_on(module) -> str | None:
    """What hooks ``module`` (a diffusers hook, an accelerate hook, a torch forward hook, a forward
    set on the instance), or None."""
    registry = vars(module).get("_diffusers_hook")
    if registry is not None and registry.hooks:
        return f"diffusers hook(s) {', '.join(registry._hook_order)}"
    if "_hf_hook" in vars(module):
        return f"accelerate hook {type(module._hf_hook).__name__}"
    if module._forward_pre_hooks or module._forward_hooks:
        return "a torch forward hook"
    if "forward" in vars(module):
        return "a forward set on the instance"
    return None


def sees_arguments(module) -> bool:
    """Whether a hook takes ``module``'s arguments before its forward does (a diffusers or
    accelerate hook, a torch forward pre-hook): a context-parallel split, a device move. Those
    take tensors, not FP8 rows."""
    registry = vars(module).get("_diffusers_hook")
    return bool(registry is not None and registry.hooks) or "_hf_hook" in vars(module) or bool(module._forward_pre_hooks)


def hooked(owner, names: tuple) -> bool:
    """Whether a submodule of ``owner`` named in ``names`` (modules whose call a ditops forward
    replaces by an op) has a hook; if so, warns once naming it, and the caller runs diffusers' code."""
    for name in names:
        module = getattr(owner, name)
        hook = hook_on(module)
        if hook is not None:
            key = (type(owner).__name__, name, hook)
            if key not in _warned:
                _warned.add(key)
                warnings.warn(f"ditops: {type(owner).__name__}.{name} has {hook}; {type(owner).__name__} runs "
                              f"diffusers' code so that the hook runs (ditops ops not used there)", stacklevel=3)
            return True
    return False


def norms_taken(owner, names: tuple, dtype: torch.dtype) -> bool:
    """Whether an op may compute the norms ``names`` of ``owner`` on activations of ``dtype``:
    none has a hook (``hooked`` warns) and each weight has that dtype (where it differs,
    diffusers' RMSNorm computes and returns float32, which the op would not)."""
    return not hooked(owner, names) and all(getattr(owner, name).weight.dtype == dtype for name in names)


def activation_dtype(states, projection) -> torch.dtype:
    """The dtype of ``states``: a tensor's own, or for FP8 rows (quantize="fp8") the one they stand
    for, which ``projection``, an FP8 Linear they feed, gives."""
    return projection.out_dtype if isinstance(states, Float8Rows) else states.dtype


def batch_and_tokens(states) -> tuple:
    """[B, S] of a [B, S, D] tensor or of FP8 rows."""
    return tuple((states.data if isinstance(states, Float8Rows) else states).shape[:2])


# ----- attention processors: diffusers' contract --------------------------------------------


class DitopsProcessor:
    """Base of the ditops attention processors: holds the processor it replaces (``original``),
    to which calls it does not cover go, and shares its ``_attention_backend`` and
    ``_parallel_config`` (see rule 2 of this module). Subclasses name the submodules of the
    attention whose call they replace in ``bypassed``."""

    bypassed: tuple = ()

    def __init__(self, original):
        self.original = original

    @property
    def _attention_backend(self):
        return self.original._attention_backend

    @_attention_backend.setter
    def _attention_backend(self, backend) -> None:
        self.original._attention_backend = backend

    @property
    def _parallel_config(self):
        return self.original._parallel_config

    @_parallel_config.setter
    def _parallel_config(self, config) -> None:
        self.original._parallel_config = config

    def defer(self, attn, *arguments, **options):
        """The call, in the processor this one replaced. FP8 rows (quantize="fp8": a norm feeds
        them to the q/k/v projections) are given back as the tensors diffusers' code takes, in
        the dtype those projections give."""
        if any(isinstance(a, Float8Rows) for a in arguments):
            dtype = next(module.out_dtype for module in attn.modules() if isinstance(module, Float8Linear))
            arguments = [a.dequantize(dtype) if isinstance(a, Float8Rows) else a for a in arguments]
        return self.original(attn, *arguments, **options)

    def attention(self, query, key, value, attn_mask=None) -> torch.Tensor:
        """diffusers' attention on [B, S, H, Dh] q, k, v with this processor's backend and
        parallel config (context parallelism happens inside)."""
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        return dispatch_attention_fn(query, key, value, attn_mask=attn_mask, dropout_p=0.0, is_causal=False,
                                     backend=self._attention_backend, parallel_config=self._parallel_config)


@dataclass
class _ProcessorPatch:
    attention: torch.nn.Module
    processor: DitopsProcessor

    def restore(self) -> None:
        if self.attention.processor is self.processor:  # a processor set after apply stays
            self.attention.processor = self.processor.original


def replace_processor(patches: list, report: Report, attention, path: str, supported: bool, processor_class,
                      op: str) -> None:
    """``attention.processor`` -> ``processor_class(original)`` when ``supported``; reported either way."""
    if not supported:
        report.skipped.append(f"{path}: processor {type(attention.processor).__name__} or its q/k norms are not "
                              "the ones checked")
        return
    processor = processor_class(attention.processor)
    patches.append(_ProcessorPatch(attention, processor))
    attention.processor = processor
    report.replaced.append((f"{path}.processor", op))


def replace_processor_unless(patches: list, report: Report, attention, path: str, refusal: str | None,
                             processor_class, op: str) -> None:
    """``replace_processor`` for a model module that says why not: ``refusal``, what of the
    attention the ditops processor does not compute (None: nothing), goes into the report."""
    if refusal is None:
        replace_processor(patches, report, attention, path, True, processor_class, op)
    else:
        report.skipped.append(f"{path}: {refusal}; its q/k norms and RoPE stay as diffusers wrote them")


# ----- helpers the model modules share --------------------------------------------------------


def is_block(report: Report, block, block_class, path: str) -> bool:
    """Whether ``block`` is a ``block_class`` (the class exactly, not a subclass, which may compute
    otherwise); where not, the report says so and the block is left as it is."""
    if type(block) is block_class:
        return True
    report.skipped.append(f"{path}: {type(block).__name__}, not {block_class.__name__}; left as it is")
    return False


def writable(*projections) -> tuple:
    """q and k for an in-place op (qk_norm_rope_, rope_) where they may be chunks of one
    projection (quantize="fp8" joins q/k/v, diffusers' fuse_qkv_projections, FLUX.2's
    to_qkv_mlp_proj) or rows of one whose other rows autograd saved for backward (HunyuanVideo's
    single blocks): as they are without grad, which is what pipelines run; copies with grad.
    With grad the op runs its reference math under autograd, which refuses in-place writes into
    the outputs of split and chunk, and does not say which views those are, and fails backward
    where a write changed a tensor it saved."""
    return tuple(x.clone() for x in projections) if torch.is_grad_enabled() else projections


def plain_layer_norm(norm) -> bool:
    return isinstance(norm, torch.nn.LayerNorm) and norm.weight is None and norm.bias is None


def cos_sin_cache(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' cos and sin, each [S, Dh] with every pair's value repeated (interleaved RoPE),
    as the [S, Dh] cache of docs/ops.md: the Dh/2 cos, then the Dh/2 sin. One row per token of the
    tables the model hands the block, so under context parallelism the shard's own rows. Tables
    with more axes ([B, S, H, Dh]: a row per head) give a cache of that shape."""
    cache = torch.cat([cos[..., 0::2], sin[..., 0::2]], dim=-1)
    return cache if cache.dtype in (torch.float32, torch.bfloat16, torch.float16) else cache.float()


def complex_cache(frequencies: torch.Tensor) -> torch.Tensor:
    """Complex frequencies [..., Dh/2] (cos + i sin) as cache rows: the Dh/2 cos, then the Dh/2 sin."""
    return torch.cat([frequencies.real, frequencies.imag], dim=-1).float()
