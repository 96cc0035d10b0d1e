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

With ``quantize="fp8"`` (quantize.py) the norms give FP8 rows (``norm_scale_shift_fp8``,
``residual_norm_scale_shift_fp8``) to the Linears they feed, now FP8 (q/k/v, the MLPs' up
projections, the single blocks' ``proj_mlp``); each MLP's GELU and the quantisation of its
hidden state are one ``quantize_fp8`` (quantize.py's FeedForward forward); a single block's
``proj_out`` is one FP8 GEMM over its input [attention output, GELU(MLP)], the two quantised
together by one ``quantize_fp8`` (the attention output its ``prefix``). A block whose
processor is not ditops', or one of whose fed Linears
cannot be FP8, keeps bf16 norms. The other Linears (the attention outputs, the modulation)
quantise their own input; quantize.replace_rest says which stay bf16.
"""

from __future__ import annotations

import torch

from ... import ops
from ...fp8 import Float8Rows
from . import patching, quantize


# The norms as the Linears after them take their output: a tensor, or FP8 rows (quantize="fp8").


def _norm(x, scale, shift, eps):
    return ops.norm_scale_shift(x, scale, shift, eps=eps)


def _norm_fp8(x, scale, shift, eps):
    return Float8Rows(*ops.norm_scale_shift_fp8(x, scale, shift, eps=eps))


def _residual_norm(x, residual, gate, scale, shift, eps):
    return ops.residual_norm_scale_shift(x, residual, gate, scale, shift, eps=eps)


def _residual_norm_fp8(x, residual, gate, scale, shift, eps):
    y, y_scale, residual_out = ops.residual_norm_scale_shift_fp8(x, residual, gate, scale, shift, eps=eps)
    return Float8Rows(y, y_scale), residual_out


def _ada_layer_norm_zero_forward_of(norm):
    def forward(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
        """diffusers' AdaLayerNormZero: the six modulation chunks of one linear layer, the first
        two applied to LayerNorm(x). The chunks are [B, D] views: per-batch modulation."""
        if patching.hooked(self, ("norm",)):
            return type(self).forward(self, x, timestep, class_labels, hidden_dtype, emb)
        if self.emb is not None:
            emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.linear(self.silu(emb)).chunk(6, dim=1)
        return norm(x, scale_msa, shift_msa, self.norm.eps), gate_msa, shift_mlp, scale_mlp, gate_mlp

    return forward


def _ada_layer_norm_zero_single_forward_of(norm):
    def forward(self, x, emb=None):
        if patching.hooked(self, ("norm",)):
            return type(self).forward(self, x, emb)
        shift_msa, scale_msa, gate_msa = self.linear(self.silu(emb)).chunk(3, dim=1)
        return norm(x, scale_msa, shift_msa, self.norm.eps), gate_msa

    return forward


def _double_block_forward_of(residual_norm):
    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, joint_attention_kwargs=None):
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
        return after_attention(self, outputs, hidden_states, encoder_hidden_states,
                               (gate_msa, shift_mlp, scale_mlp, gate_mlp),
                               (context_gate_msa, context_shift_mlp, context_scale_mlp, context_gate_mlp), residual_norm)

    return forward


def after_attention(block, outputs, hidden_states, encoder_hidden_states, modulation, context_modulation,
                    residual_norm):
    """A FLUX-shaped double block (FLUX's, Chroma's) after its attention: per stream the gated
    residual add with norm2 and its modulation as ``residual_norm`` (a tensor or FP8 rows for
    the MLP), then the MLP's gated add. ``modulation``: (gate_msa, shift_mlp, scale_mlp, gate_mlp)."""
    attention, context_attention = outputs[0], outputs[1]
    gate_msa, shift_mlp, scale_mlp, gate_mlp = modulation
    norm_hidden_states, hidden_states = residual_norm(
        attention, hidden_states, gate_msa, scale_mlp, shift_mlp, block.norm2.eps)
    hidden_states = hidden_states + gate_mlp.unsqueeze(1) * block.ff(norm_hidden_states)
    if len(outputs) == 3:  # IP-Adapter output
        hidden_states = hidden_states + outputs[2]

    gate_msa, shift_mlp, scale_mlp, gate_mlp = context_modulation
    norm_context, encoder_hidden_states = residual_norm(
        context_attention, encoder_hidden_states, gate_msa, scale_mlp, shift_mlp, block.norm2_context.eps)
    encoder_hidden_states = encoder_hidden_states + gate_mlp.unsqueeze(1) * block.ff_context(norm_context)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


# The forwards by whether their norms give FP8 rows, {fp8: forward}, as in every model module.
_NORM_FORWARDS = {fp8: _ada_layer_norm_zero_forward_of(_norm_fp8 if fp8 else _norm) for fp8 in (False, True)}
_SINGLE_NORM_FORWARDS = {fp8: _ada_layer_norm_zero_single_forward_of(_norm_fp8 if fp8 else _norm)
                         for fp8 in (False, True)}
_DOUBLE_BLOCK_FORWARDS = {fp8: _double_block_forward_of(_residual_norm_fp8 if fp8 else _residual_norm)
                          for fp8 in (False, True)}


def _single_block_forward_fp8(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                              joint_attention_kwargs=None):
    """diffusers' FluxSingleTransformerBlock with FP8 GEMMs (single_block_fp8) on the text and
    image tokens together."""
    if self.training or patching.hooked(self, ("act_mlp",)):
        return type(self).forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                  joint_attention_kwargs)
    text_seq_len = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    hidden_states = single_block_fp8(self, hidden_states, temb, image_rotary_emb, joint_attention_kwargs)
    return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]


def single_block_fp8(block, hidden_states, temb, image_rotary_emb, joint_attention_kwargs):
    """A FLUX-shaped single block on one token sequence with FP8 GEMMs: the norm's FP8 rows feed
    the MLP's up projection and q/k/v; proj_out's input as single_block_output_fp8 takes it."""
    residual = hidden_states
    norm_hidden_states, gate = block.norm(hidden_states, emb=temb)
    mlp_hidden_states = block.proj_mlp(norm_hidden_states)
    attention = block.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                           **(joint_attention_kwargs or {}))
    return single_block_output_fp8(block, residual, gate, mlp_hidden_states, attention)


def single_block_output_fp8(block, residual, gate, mlp_hidden_states, attention):
    """A FLUX-shaped single block (FLUX's, Chroma's) after its attention, with an FP8 proj_out:
    its input [attention output, GELU(MLP)] quantised by one quantize_fp8, one scale per row over
    both (as a Linear quantising its input would), never concatenated in bf16; then the gated
    residual add."""
    rows = Float8Rows(*ops.quantize_fp8(mlp_hidden_states, activation="gelu_tanh", prefix=attention))
    hidden_states = residual + gate.unsqueeze(1) * block.proj_out(rows)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states


class FluxQKNormRopeProcessor(patching.DitopsProcessor):
    """diffusers' FluxAttnProcessor with the q/k RMSNorms and the RoPE as qk_norm_rope_: text
    tokens first with the added-projection norms, then image tokens at position_offset = text
    length with the image norms. Without rotary embeddings it defers to the original."""

    bypassed = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.transformers.transformer_flux import _get_qkv_projections

        bypassed = self.bypassed if attn.added_kv_proj_dim is not None else self.bypassed[:2]
        if image_rotary_emb is None or patching.hooked(attn, bypassed):
            return self.defer(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        query, key, value, context_query, context_key, context_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states)
        query, key = patching.writable(query, key)  # with fused projections, chunks of one
        query, key, value = (t.unflatten(-1, (attn.heads, -1)) for t in (query, key, value))
        cache = patching.cos_sin_cache(*image_rotary_emb)
        eps = attn.norm_q.eps
        if attn.added_kv_proj_dim is None:
            query, key = ops.qk_norm_rope_(query, key, attn.norm_q.weight, attn.norm_k.weight, cache, eps=eps)
        else:
            # Each stream in place on its own projection, then the concatenation: the same work in
            # eager, and under torch.compile the in-place op writes the projections' buffers
            # directly (on slices of the concatenation Inductor copies each slice out and back).
            context_query, context_key = patching.writable(context_query, context_key)
            context_query, context_key, context_value = (t.unflatten(-1, (attn.heads, -1))
                                                          for t in (context_query, context_key, context_value))
            text = context_query.shape[1]
            context_query, context_key = ops.qk_norm_rope_(context_query, context_key, attn.norm_added_q.weight,
                                                           attn.norm_added_k.weight, cache, eps=eps)
            query, key = ops.qk_norm_rope_(query, key, attn.norm_q.weight, attn.norm_k.weight, cache, eps=eps,
                                           position_offset=text)
            query, key, value = (torch.cat(pair, dim=1) for pair in ((context_query, query), (context_key, key),
                                                                     (context_value, value)))
        out = self.attention(query, key, value, attention_mask).flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out
        # the text length from the projections: encoder_hidden_states may be FP8 rows (quantize="fp8")
        text = context_query.shape[1]
        context_out, out = out.split_with_sizes([text, out.shape[1] - text], dim=1)
        return attn.to_out[1](attn.to_out[0](out.contiguous())), attn.to_add_out(context_out.contiguous())


def _attention_supported(attn) -> bool:
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    norms = [attn.norm_q, attn.norm_k] + ([attn.norm_added_q, attn.norm_added_k] if attn.added_kv_proj_dim else [])
    return type(attn.processor) is FluxAttnProcessor and all(
        isinstance(norm, torch.nn.RMSNorm) and norm.weight is not None and norm.eps == attn.norm_q.eps for norm in norms)


_QKV = ("to_q", "to_k", "to_v")
_ADDED_QKV = ("add_q_proj", "add_k_proj", "add_v_proj")
_FEED_FORWARDS = ("ff", "ff_context")


def patch(model, patches: list, report, fp8_dtype=None) -> None:
    """Patches FLUX's blocks; with ``fp8_dtype`` their Linears run FP8, fed FP8 rows by the norms
    where a block's processor is ditops' and all the Linears its norms feed became FP8."""
    for index, block in enumerate(model.transformer_blocks):
        path = f"transformer_blocks.{index}"
        patching.replace_processor(patches, report, block.attn, f"{path}.attn", _attention_supported(block.attn),
                                   FluxQKNormRopeProcessor, "qk_norm_rope_")
        fp8 = fp8_dtype is not None and _quantize_double_block(block, path, patches, report, fp8_dtype)
        suffix = "_fp8" if fp8 else ""
        if all(patching.plain_layer_norm(norm)
               for norm in (block.norm1.norm, block.norm1_context.norm, block.norm2, block.norm2_context)):
            for name in ("norm1", "norm1_context"):
                if patching.replace_forward(patches, report, getattr(block, name), f"{path}.{name}",
                                            _NORM_FORWARDS[fp8]):
                    report.replaced.append((f"{path}.{name}", "norm_scale_shift" + suffix))
            if patching.replace_forward(patches, report, block, path, _DOUBLE_BLOCK_FORWARDS[fp8]):
                report.replaced.append((f"{path}.norm2, {path}.norm2_context", "residual_norm_scale_shift" + suffix))
        else:
            report.skipped.append(f"{path}: norms with affine parameters or another type")
    for index, block in enumerate(model.single_transformer_blocks):
        path = f"single_transformer_blocks.{index}"
        patching.replace_processor(patches, report, block.attn, f"{path}.attn", _attention_supported(block.attn),
                                   FluxQKNormRopeProcessor, "qk_norm_rope_")
        fp8 = fp8_dtype is not None and _quantize_single_block(block, path, patches, report, fp8_dtype)
        if not patching.plain_layer_norm(block.norm.norm):
            report.skipped.append(f"{path}.norm: a norm with affine parameters or another type")
        elif patching.replace_forward(patches, report, block.norm, f"{path}.norm",
                                      _SINGLE_NORM_FORWARDS[fp8]):
            report.replaced.append((f"{path}.norm", "norm_scale_shift" + ("_fp8" if fp8 else "")))
    if fp8_dtype is not None:
        quantize.replace_rest(model, patches, report, fp8_dtype)


def _quantize_double_block(block, path, patches, report, fp8_dtype) -> bool:
    """The Linears the block's norms feed -> FP8 (q/k/v of both streams, both MLPs, with the
    MLPs' GELU + quantisation fused); True where the norms may give them FP8 rows."""
    if not quantize.takes_rows(report, block.attn, FluxQKNormRopeProcessor, path):
        return False
    projections = quantize.fed(block.attn, _QKV + _ADDED_QKV, f"{path}.attn")
    feed_forwards = {f"{path}.{name}": getattr(block, name) for name in _FEED_FORWARDS}
    if not quantize.replace_fed_with_feed_forwards(patches, report, projections, feed_forwards, fp8_dtype, path):
        return False
    quantize.join_projections(patches, report, block.attn, f"{path}.attn", {"to_qkv": _QKV, "to_added_qkv": _ADDED_QKV})
    return True


def _quantize_single_block(block, path, patches, report, fp8_dtype, forward=None, processor_class=None,
                           join: bool = True) -> bool:
    """The Linears the block's norm feeds -> FP8 (q/k/v, one GEMM where ``join``; proj_mlp), and
    proj_out, fed FP8 rows by the block's ``forward`` (FLUX's single block's:
    _single_block_forward_fp8) through ``processor_class`` (FLUX's processor where None); True
    where the norm may give them FP8 rows."""
    if not quantize.takes_rows(report, block.attn, processor_class or FluxQKNormRopeProcessor, path):
        return False
    if not (type(block.act_mlp) is torch.nn.GELU and block.act_mlp.approximate == "tanh"):
        report.skipped.append(f"{path}: its norm gives bf16 (act_mlp is not GELU(tanh))")
        return False
    linears = quantize.fed(block.attn, _QKV, f"{path}.attn") + quantize.fed(block, ("proj_mlp", "proj_out"), path)
    if not quantize.replace_fed(patches, report, linears, fp8_dtype, path):
        return False
    if join:
        quantize.join_projections(patches, report, block.attn, f"{path}.attn", {"to_qkv": _QKV})
    if not patching.replace_forward(patches, report, block, path, forward or _single_block_forward_fp8):
        return False
    report.replaced.append((f"{path}.act_mlp, {path}.proj_out", "quantize_fp8 (attention; GELU)"))
    return True
