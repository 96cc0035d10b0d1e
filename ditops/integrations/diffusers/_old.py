"""Put ditops under a diffusers transformer: ``report = apply(model)``, ``remove(model)``.

``apply`` re-expresses parts of the model's blocks through the ditops ops, in place on the
module instances (their ``forward`` or attention ``processor``), and returns a report of what
it replaced and what it skipped. ``remove`` restores every replaced attribute exactly;
``apply`` on a model that is already patched changes nothing. Everything a model does that no
op covers stays as diffusers wrote it.

Supported today (diffusers 0.42):
- ``FluxTransformer2DModel``: the AdaLN-Zero modulations of every block -> ``norm_scale_shift``
  (the per-batch chunks of the modulation stay strided views); in double blocks the gated
  residual add of the attention output followed by ``norm2`` and its modulation ->
  ``residual_norm_scale_shift``; in every attention processor the per-head RMSNorm of q and
  k (separate weights for text and image tokens) and the interleaved RoPE -> ``qk_norm_rope_``
  with a per-token cos/sin cache built from diffusers' rotary embedding.
- ``WanTransformer3DModel``: the float32-modulated ``norm1`` -> ``norm_scale_shift``; the
  gated self-attention residual with the affine ``norm2``, and the cross-attention residual
  (gate 1) with ``norm3`` and its modulation -> ``residual_norm_scale_shift``; in
  self-attention, the q/k RMSNorm across all heads -> ``norm_scale_shift`` (norm="rms", no
  modulation) and the RoPE -> ``rope_``.
- ``QwenImageTransformer2DModel``: both streams' modulated ``norm1`` -> ``norm_scale_shift``
  and "residual + gate * attention, then ``norm2`` and its modulation" ->
  ``residual_norm_scale_shift``; with ``modulate_index`` (Qwen-Image-Edit) the image stream
  uses the select forms; each stream's q/k RMSNorm + RoPE (complex frequencies, interleaved
  pairs) -> ``qk_norm_rope_``.
- ``ZImageTransformer2DModel``: in blocks with one modulation for all tokens, the first
  RMSNorm and its scale -> ``norm_scale_shift``; "x + tanh(gate) * RMSNorm(attention), then
  the FFN's RMSNorm and its scale" -> ``add_gate_norm_scale``; the FFN's gated add ->
  ``add_gate_norm``; every attention's q/k RMSNorm + RoPE -> ``qk_norm_rope_``. Per-token
  modulation (``noise_mask``) runs as diffusers wrote it.
Any other model class, or another diffusers version, is left untouched with one warning.
"""

from __future__ import annotations

import types
import warnings
from dataclasses import dataclass, field

import torch

from .. import ops

SUPPORTED_VERSION = "0.42."


@dataclass
class Report:
    """What ``apply`` replaced, as (module path, op) pairs, and what it left alone and why."""

    replaced: list = field(default_factory=list)
    skipped: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"ditops replaced {len(self.replaced)} places:"] + [f"  {path}: {op}" for path, op in self.replaced]
        return "\n".join(lines + [f"  skipped {what}" for what in self.skipped])


@dataclass
class _Patch:
    module: torch.nn.Module
    attribute: str
    original: object
    had_instance_value: bool  # the attribute lived in the instance's __dict__ (a processor) or on its class (forward)


def apply(model: torch.nn.Module) -> Report:
    """Replaces what ditops covers in ``model``; returns what was replaced and what was skipped."""
    if getattr(model, "_ditops_patches", None) is not None:
        return model._ditops_report
    import diffusers

    name = type(model).__name__
    if not diffusers.__version__.startswith(SUPPORTED_VERSION):
        return _untouched(model, f"{name}: diffusers {diffusers.__version__} (block code checked for {SUPPORTED_VERSION}x)")
    patcher = _PATCHERS.get(name)
    if patcher is None:
        return _untouched(model, f"{name}: not a supported model ({', '.join(_PATCHERS)})")
    patches, report = [], Report()
    patcher(model, patches, report)
    model._ditops_patches, model._ditops_report = patches, report
    return report


def remove(model: torch.nn.Module) -> None:
    """Restores every attribute ``apply`` replaced."""
    for patch in reversed(getattr(model, "_ditops_patches", None) or []):
        if patch.had_instance_value:
            setattr(patch.module, patch.attribute, patch.original)
        else:
            delattr(patch.module, patch.attribute)  # the class's attribute shows through again
    for attribute in ("_ditops_patches", "_ditops_report"):
        if hasattr(model, attribute):
            delattr(model, attribute)


def _untouched(model, reason: str) -> Report:
    warnings.warn(f"ditops.integrations.diffusers.apply left the model untouched: {reason}", stacklevel=3)
    return Report(skipped=[reason])


def _replace(patches: list, module, attribute: str, value) -> None:
    had_instance_value = attribute in vars(module)
    patches.append(_Patch(module, attribute, getattr(module, attribute), had_instance_value))
    if attribute == "forward":  # a function of the module, bound whether or not an instance forward was there
        value = types.MethodType(value, module)
    setattr(module, attribute, value)


# ----- FLUX --------------------------------------------------------------------------------

def _plain_layer_norm(norm) -> bool:
    return isinstance(norm, torch.nn.LayerNorm) and norm.weight is None and norm.bias is None


def _ada_layer_norm_zero_forward(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
    """diffusers' AdaLayerNormZero: the six modulation chunks of one linear layer, the first
    two applied to LayerNorm(x). The chunks are [B, D] views: per-batch modulation."""
    if self.emb is not None:
        emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.linear(self.silu(emb)).chunk(6, dim=1)
    return ops.norm_scale_shift(x, scale_msa, shift_msa, eps=self.norm.eps), gate_msa, shift_mlp, scale_mlp, gate_mlp


def _ada_layer_norm_zero_single_forward(self, x, emb=None):
    shift_msa, scale_msa, gate_msa = self.linear(self.silu(emb)).chunk(3, dim=1)
    return ops.norm_scale_shift(x, scale_msa, shift_msa, eps=self.norm.eps), gate_msa


def _flux_double_block_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                               joint_attention_kwargs=None):
    """diffusers' FluxTransformerBlock with each "residual + gate * attention, then norm2 and
    its modulation" as one residual_norm_scale_shift."""
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
    norm_context, context_gate_msa, context_shift_mlp, context_scale_mlp, context_gate_mlp = self.norm1_context(
        encoder_hidden_states, emb=temb)
    outputs = self.attn(hidden_states=norm_hidden_states, encoder_hidden_states=norm_context,
                        image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    attention, context_attention = outputs[0], outputs[1]

    norm_hidden_states, hidden_states = ops.residual_norm_scale_shift(
        attention, hidden_states, gate_msa, scale_mlp, shift_mlp, eps=self.norm2.eps)
    hidden_states = hidden_states + gate_mlp.unsqueeze(1) * self.ff(norm_hidden_states)
    if len(outputs) == 3:  # IP-Adapter output
        hidden_states = hidden_states + outputs[2]

    norm_context, encoder_hidden_states = ops.residual_norm_scale_shift(
        context_attention, encoder_hidden_states, context_gate_msa, context_scale_mlp, context_shift_mlp,
        eps=self.norm2_context.eps)
    encoder_hidden_states = encoder_hidden_states + context_gate_mlp.unsqueeze(1) * self.ff_context(norm_context)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def _cos_sin_cache(image_rotary_emb) -> torch.Tensor:
    """diffusers' (cos, sin), each [S, Dh] with every pair's value repeated, as the [S, Dh]
    cache of OPS.md: the Dh/2 cos, then the Dh/2 sin."""
    cos, sin = image_rotary_emb
    cache = torch.cat([cos[:, 0::2], sin[:, 0::2]], dim=1)
    return cache if cache.dtype in (torch.float32, torch.bfloat16, torch.float16) else cache.float()


class FluxQKNormRopeProcessor:
    """diffusers' FluxAttnProcessor with the q/k RMSNorms and the RoPE as qk_norm_rope_: text
    tokens first with the added-projection norms, then image tokens at position_offset = text
    length with the image norms. Without rotary embeddings it defers to the original."""

    def __init__(self, original):
        self.original = original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.transformers.transformer_flux import _get_qkv_projections

        if image_rotary_emb is None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        query, key, value, context_query, context_key, context_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states)
        query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in (query, key, value))
        cache = _cos_sin_cache(image_rotary_emb)
        eps = attn.norm_q.eps
        if attn.added_kv_proj_dim is None:
            ops.qk_norm_rope_(query, key, attn.norm_q.weight, attn.norm_k.weight, cache, eps=eps)
        else:
            text = context_query.shape[1]
            query = torch.cat([context_query.unflatten(-1, (-1, attn.head_dim)), query], dim=1)
            key = torch.cat([context_key.unflatten(-1, (-1, attn.head_dim)), key], dim=1)
            value = torch.cat([context_value.unflatten(-1, (-1, attn.head_dim)), value], dim=1)
            ops.qk_norm_rope_(query[:, :text], key[:, :text], attn.norm_added_q.weight, attn.norm_added_k.weight,
                              cache, eps=eps)
            ops.qk_norm_rope_(query[:, text:], key[:, text:], attn.norm_q.weight, attn.norm_k.weight, cache,
                              eps=eps, position_offset=text)
        out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask,
                                    backend=self.original._attention_backend,
                                    parallel_config=self.original._parallel_config)
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out
        context_out, out = out.split_with_sizes([encoder_hidden_states.shape[1], out.shape[1] - encoder_hidden_states.shape[1]], dim=1)
        return attn.to_out[1](attn.to_out[0](out.contiguous())), attn.to_add_out(context_out.contiguous())


def _flux_attention_supported(attn) -> bool:
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    norms = [attn.norm_q, attn.norm_k] + ([attn.norm_added_q, attn.norm_added_k] if attn.added_kv_proj_dim else [])
    return type(attn.processor) is FluxAttnProcessor and all(
        isinstance(norm, torch.nn.RMSNorm) and norm.weight is not None and norm.eps == attn.norm_q.eps for norm in norms)


def _patch_flux(model, patches: list, report: Report) -> None:
    for index, block in enumerate(model.transformer_blocks):
        path = f"transformer_blocks.{index}"
        if all(_plain_layer_norm(norm) for norm in (block.norm1.norm, block.norm1_context.norm, block.norm2, block.norm2_context)):
            for name in ("norm1", "norm1_context"):
                _replace(patches, getattr(block, name), "forward", _ada_layer_norm_zero_forward)
                report.replaced.append((f"{path}.{name}", "norm_scale_shift"))
            _replace(patches, block, "forward", _flux_double_block_forward)
            report.replaced.append((f"{path}.norm2, {path}.norm2_context", "residual_norm_scale_shift"))
        else:
            report.skipped.append(f"{path}: norms with affine parameters or another type")
        _replace_processor(block.attn, f"{path}.attn", _flux_attention_supported(block.attn), FluxQKNormRopeProcessor,
                           "qk_norm_rope_", patches, report)
    for index, block in enumerate(model.single_transformer_blocks):
        path = f"single_transformer_blocks.{index}"
        if _plain_layer_norm(block.norm.norm):
            _replace(patches, block.norm, "forward", _ada_layer_norm_zero_single_forward)
            report.replaced.append((f"{path}.norm", "norm_scale_shift"))
        else:
            report.skipped.append(f"{path}.norm: a norm with affine parameters or another type")
        _replace_processor(block.attn, f"{path}.attn", _flux_attention_supported(block.attn), FluxQKNormRopeProcessor,
                           "qk_norm_rope_", patches, report)


def _replace_processor(attn, path: str, supported: bool, processor_class, op: str, patches: list, report: Report) -> None:
    """``attn.processor`` -> ``processor_class(original)`` when ``supported``; reported either way."""
    if supported:
        _replace(patches, attn, "processor", processor_class(attn.processor))
        report.replaced.append((f"{path}.processor", op))
    else:
        report.skipped.append(f"{path}: processor {type(attn.processor).__name__} or its q/k norms are not the ones checked")


# ----- Wan ---------------------------------------------------------------------------------

def _wan_block_forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
    """diffusers' WanTransformerBlock with the float32-modulated norm1 as norm_scale_shift,
    "residual + gate * self-attention, then the affine norm2" and "residual + cross-attention
    (gate 1), then norm3 and its modulation" each as one residual_norm_scale_shift. The
    modulation stays float32 next to bf16 activations."""
    if temb.ndim == 4:  # Wan2.2 TI2V: per-token modulation [B, S, 6, D]
        chunks = (self.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
        chunks = [chunk.squeeze(2) for chunk in chunks]
    else:  # [B, 6, D]: one [B, 1, D] vector per batch item
        chunks = (self.scale_shift_table + temb.float()).chunk(6, dim=1)
    shift_msa, scale_msa, gate_msa, context_shift, context_scale, context_gate = chunks

    norm_hidden_states = ops.norm_scale_shift(hidden_states, scale_msa, shift_msa, eps=self.norm1.eps)
    attention = self.attn1(norm_hidden_states, None, None, rotary_emb)
    if isinstance(self.norm2, torch.nn.Identity):
        hidden_states = (hidden_states.float() + attention * gate_msa).type_as(hidden_states)
        norm_hidden_states = hidden_states
    else:  # the affine norm2 as a residual_norm_scale_shift without modulation
        no_modulation = gate_msa.new_zeros(())
        norm_hidden_states, hidden_states = ops.residual_norm_scale_shift(
            attention, hidden_states, gate_msa, no_modulation, no_modulation, weight=self.norm2.weight,
            bias=self.norm2.bias, eps=self.norm2.eps)
    cross_attention = self.attn2(norm_hidden_states, encoder_hidden_states, None, None)
    norm_hidden_states, hidden_states = ops.residual_norm_scale_shift(
        cross_attention, hidden_states, None, context_scale, context_shift, eps=self.norm3.eps)
    feed_forward = self.ffn(norm_hidden_states)
    return (hidden_states.float() + feed_forward.float() * context_gate).type_as(hidden_states)


class WanNormRopeProcessor:
    """diffusers' WanAttnProcessor for self-attention with Wan's q/k RMSNorm across all heads
    as norm_scale_shift (norm="rms", no modulation) and its interleaved RoPE as rope_ on q and
    k. Calls without rotary embeddings or with image context (cross-attention) go to the original."""

    def __init__(self, original):
        self.original = original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections

        if rotary_emb is None or attn.add_k_proj is not None or encoder_hidden_states is not None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        no_modulation = query.new_zeros(())
        query, key = (ops.norm_scale_shift(t, no_modulation, no_modulation, weight=norm.weight, norm="rms", eps=norm.eps)
                      for t, norm in ((query, attn.norm_q), (key, attn.norm_k)))
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        cos, sin = rotary_emb  # [1, S, 1, Dh] each, every pair's value repeated
        cache = torch.cat([cos[0, :, 0, 0::2], sin[0, :, 0, 1::2]], dim=1)
        ops.rope_(query, key, cache if cache.dtype != torch.float64 else cache.float())
        out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                    backend=self.original._attention_backend,
                                    parallel_config=self.original._parallel_config)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _fp32_layer_norm(norm) -> bool:
    from diffusers.models.normalization import FP32LayerNorm

    return type(norm) is FP32LayerNorm and norm.weight is None and norm.bias is None


def _wan_norm2_supported(norm) -> bool:
    """Identity (cross_attn_norm=False) or an affine FP32LayerNorm."""
    from diffusers.models.normalization import FP32LayerNorm

    return type(norm) is torch.nn.Identity or (type(norm) is FP32LayerNorm and norm.weight is not None
                                                 and norm.bias is not None)


def _wan_attention_supported(attn) -> bool:
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    return type(attn.processor) is WanAttnProcessor and all(
        type(norm) is torch.nn.RMSNorm and norm.weight is not None and norm.eps is not None
        for norm in (attn.norm_q, attn.norm_k))


def _patch_wan(model, patches: list, report: Report) -> None:
    for index, block in enumerate(model.blocks):
        path = f"blocks.{index}"
        if _fp32_layer_norm(block.norm1) and _fp32_layer_norm(block.norm3) and _wan_norm2_supported(block.norm2):
            _replace(patches, block, "forward", _wan_block_forward)
            report.replaced.append((f"{path}.norm1", "norm_scale_shift"))
            if not isinstance(block.norm2, torch.nn.Identity):
                report.replaced.append((f"{path}.norm2", "residual_norm_scale_shift"))
            report.replaced.append((f"{path}.norm3", "residual_norm_scale_shift"))
        else:
            report.skipped.append(f"{path}: norm1/norm2/norm3 with other parameters or of another type")
        _replace_processor(block.attn1, f"{path}.attn1", _wan_attention_supported(block.attn1), WanNormRopeProcessor,
                           "norm_scale_shift (rms), rope_", patches, report)


# ----- Qwen-Image --------------------------------------------------------------------------

def _halves(t: torch.Tensor) -> tuple:
    """Qwen-Image-Edit stacks the modulation of index 0 and index 1 along the batch: [2B, D]."""
    return t[: t.shape[0] // 2], t[t.shape[0] // 2:]


def _qwen_first_norm(x, modulation, index, eps):
    """LayerNorm(x) with the (shift, scale, gate) rows of ``modulation``: (modulated, gate).
    With a per-token index, the select form: gate is then per token, [B, S, D]."""
    shift, scale, gate = modulation.chunk(3, dim=-1)
    if index is None:
        return ops.norm_scale_shift(x, scale, shift, eps=eps), gate.unsqueeze(1)
    (scale0, scale1), (shift0, shift1), (gate0, gate1) = _halves(scale), _halves(shift), _halves(gate)
    return ops.norm_scale_shift_select(x, index, scale0, shift0, gate0, scale1, shift1, gate1, eps=eps)


def _qwen_second_norm(attention, residual, first_gate, modulation, index, eps):
    """residual + first_gate * attention, stored, then its modulated LayerNorm:
    (modulated, new residual, gate for the MLP)."""
    shift, scale, gate = modulation.chunk(3, dim=-1)
    if index is None:
        modulated, residual = ops.residual_norm_scale_shift(attention, residual, first_gate.squeeze(1), scale, shift, eps=eps)
        return modulated, residual, gate.unsqueeze(1)
    (scale0, scale1), (shift0, shift1), (gate0, gate1) = _halves(scale), _halves(shift), _halves(gate)
    return ops.residual_norm_scale_shift_select(attention, residual, first_gate, index, scale0, shift0, gate0, scale1,
                                                shift1, gate1, eps=eps)


def _qwen_block_forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
                        image_rotary_emb=None, joint_attention_kwargs=None, modulate_index=None):
    """diffusers' QwenImageTransformerBlock with its modulated norms as norm_scale_shift and
    residual_norm_scale_shift (their select forms with modulate_index). Attention and MLPs
    stay as diffusers wrote them."""
    image_modulation = self.img_mod(temb)
    if self.zero_cond_t:
        temb = torch.chunk(temb, 2, dim=0)[0]
    text_modulation = self.txt_mod(temb)
    image_first, image_second = image_modulation.chunk(2, dim=-1)
    text_first, text_second = text_modulation.chunk(2, dim=-1)
    index = None if modulate_index is None else torch.as_tensor(modulate_index, device=hidden_states.device)
    eps = self.img_norm1.eps

    image_modulated, image_gate = _qwen_first_norm(hidden_states, image_first, index, eps)
    text_modulated, text_gate = _qwen_first_norm(encoder_hidden_states, text_first, None, eps)
    image_attention, text_attention = self.attn(
        hidden_states=image_modulated, encoder_hidden_states=text_modulated,
        encoder_hidden_states_mask=encoder_hidden_states_mask, image_rotary_emb=image_rotary_emb,
        **(joint_attention_kwargs or {}))
    image_modulated, hidden_states, image_gate = _qwen_second_norm(
        image_attention, hidden_states, image_gate, image_second, index, eps)
    text_modulated, encoder_hidden_states, text_gate = _qwen_second_norm(
        text_attention, encoder_hidden_states, text_gate, text_second, None, eps)
    hidden_states = hidden_states + image_gate * self.img_mlp(image_modulated)
    encoder_hidden_states = encoder_hidden_states + text_gate * self.txt_mlp(text_modulated)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


class QwenQKNormRopeProcessor:
    """diffusers' QwenDoubleStreamAttnProcessor2_0 with each stream's q/k RMSNorm and RoPE as
    qk_norm_rope_: the text tokens with the added-projection norms and the text frequencies,
    the image tokens with the image norms and frequencies, in place on slices of the joint
    q and k. Calls without rotary embeddings go to the original."""

    def __init__(self, original):
        self.original = original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                 attention_mask=None, image_rotary_emb=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        if image_rotary_emb is None or encoder_hidden_states is None or attention_mask is not None:
            return self.original(attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, attention_mask,
                                 image_rotary_emb)
        if encoder_hidden_states_mask is not None:  # text tokens as the mask says, every image token
            image_mask = torch.ones(hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
            attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)[:, None, None, :]
        text = encoder_hidden_states.shape[1]
        head_size = attn.inner_dim // attn.heads
        joint = [torch.cat([text_projection(encoder_hidden_states), image_projection(hidden_states)], dim=1)
                 .unflatten(-1, (-1, head_size))
                 for text_projection, image_projection in ((attn.add_q_proj, attn.to_q), (attn.add_k_proj, attn.to_k),
                                                           (attn.add_v_proj, attn.to_v))]
        query, key, value = joint
        image_frequencies, text_frequencies = image_rotary_emb  # complex [S, Dh / 2] per stream
        eps = attn.norm_q.eps
        for tokens, q_norm, k_norm, frequencies in ((slice(0, text), attn.norm_added_q, attn.norm_added_k, text_frequencies),
                                                    (slice(text, None), attn.norm_q, attn.norm_k, image_frequencies)):
            cache = torch.cat([frequencies.real, frequencies.imag], dim=-1).float()
            ops.qk_norm_rope_(query[:, tokens], key[:, tokens], q_norm.weight, k_norm.weight, cache, eps=eps)
        out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                    backend=self.original._attention_backend,
                                    parallel_config=self.original._parallel_config)
        out = out.flatten(2, 3).to(query.dtype)
        image_out = attn.to_out[0](out[:, text:].contiguous())
        if len(attn.to_out) > 1:
            image_out = attn.to_out[1](image_out)
        return image_out, attn.to_add_out(out[:, :text].contiguous())


def _qwen_attention_supported(attn) -> bool:
    from diffusers.models.normalization import RMSNorm
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    norms = (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k)
    return type(attn.processor) is QwenDoubleStreamAttnProcessor2_0 and all(
        type(norm) is RMSNorm and norm.weight is not None and norm.eps == attn.norm_q.eps for norm in norms)


def _patch_qwen(model, patches: list, report: Report) -> None:
    for index, block in enumerate(model.transformer_blocks):
        path = f"transformer_blocks.{index}"
        norms = (block.img_norm1, block.img_norm2, block.txt_norm1, block.txt_norm2)
        if all(_plain_layer_norm(norm) and norm.eps == block.img_norm1.eps for norm in norms):
            _replace(patches, block, "forward", _qwen_block_forward)
            report.replaced += [(f"{path}.img_norm1, {path}.txt_norm1", "norm_scale_shift (select with modulate_index)"),
                                (f"{path}.img_norm2, {path}.txt_norm2",
                                 "residual_norm_scale_shift (select with modulate_index)")]
        else:
            report.skipped.append(f"{path}: norms with affine parameters, another type or other eps")
        _replace_processor(block.attn, f"{path}.attn", _qwen_attention_supported(block.attn), QwenQKNormRopeProcessor,
                           "qk_norm_rope_", patches, report)


# ----- Z-Image -----------------------------------------------------------------------------

def _z_image_block_forward(self, x, attn_mask, freqs_cis, adaln_input=None, noise_mask=None, adaln_noisy=None,
                           adaln_clean=None):
    """diffusers' ZImageTransformerBlock with one modulation for all tokens: the first RMSNorm
    and its scale as norm_scale_shift, "x + tanh(gate) * norm(attention), then the FFN's
    RMSNorm and its scale" as add_gate_norm_scale, and the FFN's gated add as add_gate_norm.
    Per-token modulation (noise_mask) and blocks without modulation run as diffusers wrote them."""
    if not self.modulation or noise_mask is not None:
        return type(self).forward(self, x, attn_mask, freqs_cis, adaln_input, noise_mask, adaln_noisy, adaln_clean)
    scale_msa, gate_msa, scale_mlp, gate_mlp = self.adaLN_modulation(adaln_input).unsqueeze(1).chunk(4, dim=2)
    eps = self.attention_norm1.eps
    no_shift = x.new_zeros(())
    attention_input = ops.norm_scale_shift(x, scale_msa, no_shift, weight=self.attention_norm1.weight, norm="rms", eps=eps)
    attention = self.attention(attention_input, attention_mask=attn_mask, freqs_cis=freqs_cis)
    x, feed_forward_input = ops.add_gate_norm_scale(
        x, attention, gate_msa, scale_mlp, weight=self.attention_norm2.weight, weight2=self.ffn_norm1.weight,
        norm="rms", eps=eps, gate_act="tanh")
    return ops.add_gate_norm(x, self.feed_forward(feed_forward_input), gate_mlp, weight=self.ffn_norm2.weight,
                             norm="rms", eps=eps, gate_act="tanh")


class ZImageQKNormRopeProcessor:
    """diffusers' ZSingleStreamAttnProcessor with the per-head q/k RMSNorm and the RoPE as
    qk_norm_rope_. Its frequencies are per batch item ([B, S, Dh / 2], complex), so the cache
    holds B * S rows and token (b, s) reads row b * S + s through positions."""

    def __init__(self, original):
        self.original = original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        if freqs_cis is None or encoder_hidden_states is not None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, freqs_cis)
        query, key, value = (projection(hidden_states).unflatten(-1, (attn.heads, -1))
                             for projection in (attn.to_q, attn.to_k, attn.to_v))
        batch, tokens = query.shape[:2]
        cache = torch.cat([freqs_cis.real, freqs_cis.imag], dim=-1).reshape(batch * tokens, -1).float()
        positions = torch.arange(batch * tokens, device=query.device).view(batch, tokens)
        ops.qk_norm_rope_(query, key, attn.norm_q.weight, attn.norm_k.weight, cache, positions, eps=attn.norm_q.eps)
        if attention_mask is not None and attention_mask.ndim == 2:
            attention_mask = attention_mask[:, None, None, :]
        out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                    backend=self.original._attention_backend,
                                    parallel_config=self.original._parallel_config)
        out = attn.to_out[0](out.flatten(2, 3).to(query.dtype))
        return attn.to_out[1](out) if len(attn.to_out) > 1 else out


def _z_image_supported(block) -> bool:
    from diffusers.models.normalization import RMSNorm

    norms = (block.attention_norm1, block.attention_norm2, block.ffn_norm1, block.ffn_norm2)
    return all(type(norm) is RMSNorm and norm.weight is not None and norm.bias is None and norm.eps == norms[0].eps
               for norm in norms)


def _z_image_attention_supported(attn) -> bool:
    from diffusers.models.normalization import RMSNorm
    from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

    return type(attn.processor) is ZSingleStreamAttnProcessor and all(
        type(norm) is RMSNorm and norm.weight is not None for norm in (attn.norm_q, attn.norm_k))


def _patch_z_image(model, patches: list, report: Report) -> None:
    for group in ("noise_refiner", "context_refiner", "layers"):
        for index, block in enumerate(getattr(model, group)):
            path = f"{group}.{index}"
            if block.modulation and _z_image_supported(block):
                _replace(patches, block, "forward", _z_image_block_forward)
                report.replaced += [(f"{path}.attention_norm1", "norm_scale_shift"),
                                    (f"{path}.attention_norm2, {path}.ffn_norm1", "add_gate_norm_scale"),
                                    (f"{path}.ffn_norm2", "add_gate_norm")]
            elif block.modulation:
                report.skipped.append(f"{path}: norms of another type, with bias or other eps")
            _replace_processor(block.attention, f"{path}.attention", _z_image_attention_supported(block.attention),
                               ZImageQKNormRopeProcessor, "qk_norm_rope_", patches, report)


_PATCHERS = {"FluxTransformer2DModel": _patch_flux, "WanTransformer3DModel": _patch_wan,
             "QwenImageTransformer2DModel": _patch_qwen, "ZImageTransformer2DModel": _patch_z_image}
