"""FLUX.1 (``FluxTransformer2DModel``) under ditops.

- The AdaLN-Zero modulations of every block -> ``norm_scale_shift`` (the per-batch chunks of
  the modulation stay strided views).
- In double blocks, the gated residual add of the attention output followed by ``norm2`` and
  its modulation -> ``residual_norm_scale_shift``.
- In every attention processor, the per-head RMSNorm of q and k (separate weights for text and
  image tokens) and the interleaved RoPE -> ``qk_norm_rope_``, on the cos/sin the model hands
  the block. Under context parallelism the plan splits ``txt_ids`` and ``img_ids``, so those
  tables hold this shard's text rows, then its image rows: the image tokens start at
  position_offset = the local text length.
"""

from __future__ import annotations

import torch

from ... import ops
from . import patching


def _ada_layer_norm_zero_forward(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
    """diffusers' AdaLayerNormZero: the six modulation chunks of one linear layer, the first
    two applied to LayerNorm(x). The chunks are [B, D] views: per-batch modulation."""
    if patching.hooked(self, ("norm",)):
        return type(self).forward(self, x, timestep, class_labels, hidden_dtype, emb)
    if self.emb is not None:
        emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.linear(self.silu(emb)).chunk(6, dim=1)
    return ops.norm_scale_shift(x, scale_msa, shift_msa, eps=self.norm.eps), gate_msa, shift_mlp, scale_mlp, gate_mlp


def _ada_layer_norm_zero_single_forward(self, x, emb=None):
    if patching.hooked(self, ("norm",)):
        return type(self).forward(self, x, emb)
    shift_msa, scale_msa, gate_msa = self.linear(self.silu(emb)).chunk(3, dim=1)
    return ops.norm_scale_shift(x, scale_msa, shift_msa, eps=self.norm.eps), gate_msa


def _double_block_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                          joint_attention_kwargs=None):
    """diffusers' FluxTransformerBlock with each "residual + gate * attention, then norm2 and
    its modulation" as one residual_norm_scale_shift."""
    if patching.hooked(self, ("norm2", "norm2_context")):
        return type(self).forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                  joint_attention_kwargs)
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


class FluxQKNormRopeProcessor(patching.DitopsProcessor):
    """diffusers' FluxAttnProcessor with the q/k RMSNorms and the RoPE as qk_norm_rope_: text
    tokens first with the added-projection norms, then image tokens at position_offset = text
    length with the image norms. Without rotary embeddings it defers to the original."""

    bypassed = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.transformers.transformer_flux import _get_qkv_projections

        bypassed = self.bypassed if attn.added_kv_proj_dim is not None else self.bypassed[:2]
        if image_rotary_emb is None or patching.hooked(attn, bypassed):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        query, key, value, context_query, context_key, context_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states)
        query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in (query, key, value))
        cache = patching.cos_sin_cache(*image_rotary_emb)
        eps = attn.norm_q.eps
        if attn.added_kv_proj_dim is None:
            ops.qk_norm_rope_(query, key, attn.norm_q.weight, attn.norm_k.weight, cache, eps=eps)
        else:
            # Each stream in place on its own projection, then the concatenation: the same work in
            # eager, and under torch.compile the in-place op writes the projections' buffers
            # directly (on slices of the concatenation Inductor copies each slice out and back).
            context_query, context_key, context_value = (t.unflatten(-1, (-1, attn.head_dim))
                                                          for t in (context_query, context_key, context_value))
            text = context_query.shape[1]
            ops.qk_norm_rope_(context_query, context_key, attn.norm_added_q.weight, attn.norm_added_k.weight,
                              cache, eps=eps)
            ops.qk_norm_rope_(query, key, attn.norm_q.weight, attn.norm_k.weight, cache, eps=eps, position_offset=text)
            query, key, value = (torch.cat(pair, dim=1) for pair in ((context_query, query), (context_key, key),
                                                                     (context_value, value)))
        out = self.attention(query, key, value, attention_mask).flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out
        text = encoder_hidden_states.shape[1]
        context_out, out = out.split_with_sizes([text, out.shape[1] - text], dim=1)
        return attn.to_out[1](attn.to_out[0](out.contiguous())), attn.to_add_out(context_out.contiguous())


def _attention_supported(attn) -> bool:
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    norms = [attn.norm_q, attn.norm_k] + ([attn.norm_added_q, attn.norm_added_k] if attn.added_kv_proj_dim else [])
    return type(attn.processor) is FluxAttnProcessor and all(
        isinstance(norm, torch.nn.RMSNorm) and norm.weight is not None and norm.eps == attn.norm_q.eps for norm in norms)


def patch(model, patches: list, report) -> None:
    for index, block in enumerate(model.transformer_blocks):
        path = f"transformer_blocks.{index}"
        if all(patching.plain_layer_norm(norm)
               for norm in (block.norm1.norm, block.norm1_context.norm, block.norm2, block.norm2_context)):
            for name in ("norm1", "norm1_context"):
                if patching.replace_forward(patches, report, getattr(block, name), f"{path}.{name}",
                                            _ada_layer_norm_zero_forward):
                    report.replaced.append((f"{path}.{name}", "norm_scale_shift"))
            if patching.replace_forward(patches, report, block, path, _double_block_forward):
                report.replaced.append((f"{path}.norm2, {path}.norm2_context", "residual_norm_scale_shift"))
        else:
            report.skipped.append(f"{path}: norms with affine parameters or another type")
        patching.replace_processor(patches, report, block.attn, f"{path}.attn", _attention_supported(block.attn),
                                   FluxQKNormRopeProcessor, "qk_norm_rope_")
    for index, block in enumerate(model.single_transformer_blocks):
        path = f"single_transformer_blocks.{index}"
        if not patching.plain_layer_norm(block.norm.norm):
            report.skipped.append(f"{path}.norm: a norm with affine parameters or another type")
        elif patching.replace_forward(patches, report, block.norm, f"{path}.norm", _ada_layer_norm_zero_single_forward):
            report.replaced.append((f"{path}.norm", "norm_scale_shift"))
        patching.replace_processor(patches, report, block.attn, f"{path}.attn", _attention_supported(block.attn),
                                   FluxQKNormRopeProcessor, "qk_norm_rope_")
