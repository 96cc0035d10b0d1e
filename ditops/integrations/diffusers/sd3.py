"""Stable Diffusion 3 / 3.5 (``SD3Transformer2DModel``) under ditops.

- The AdaLN-Zero modulations of every ``JointTransformerBlock`` -> ``norm_scale_shift``:
  ``AdaLayerNormZero`` (FLUX's forward, flux.py), SD3.5's ``SD35AdaLayerNormZeroX`` (two
  modulations of one LayerNorm, for the block's two attentions: two ``norm_scale_shift``), and
  the last block's ``AdaLayerNormContinuous`` on the text stream.
- The gated residual add of the attention output (with SD3.5's dual attention, of the second
  attention's) followed by ``norm2`` and its modulation -> ``residual_norm_scale_shift``, on
  the image stream and, but in the last block, on the text stream.
- SD3.5's per-head q/k RMSNorms (``qk_norm="rms_norm"``, diffusers' RMSNorm over head_dim, text
  and image weights apart) -> ``norm_scale_shift`` (norm="rms", no modulation) on the [B, S*H, Dh]
  view of each projection. SD3 has no q/k norm and no RoPE: its attention stays as it is.

With ``quantize="fp8"`` (quantize.py) the AdaLN norms give FP8 rows (``norm_scale_shift_fp8``)
to the q/k/v projections of the attentions they feed (both streams; SD3.5's second attention),
through ``SD3JointProcessor`` (diffusers' joint attention on rows; SD3's projections, with no
q/k norm between, one GEMM per stream); the residual norms give FP8 rows
(``residual_norm_scale_shift_fp8``) to the GELU MLPs, whose GELU and quantisation are one
``quantize_fp8``. The attention outputs quantise their own input.
"""

from __future__ import annotations

import torch

from ... import ops
from . import flux, patching, quantize


def _ada_layer_norm_zero_x_forward_of(norm):
    def forward(self, hidden_states, emb=None):
        """diffusers' SD35AdaLayerNormZeroX: nine modulation chunks of one linear layer;
        LayerNorm(x) modulated once for the first attention and once for the second."""
        if patching.hooked(self, ("norm",)):
            return type(self).forward(self, hidden_states, emb)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_msa2, scale_msa2, gate_msa2 = self.linear(
            self.silu(emb)).chunk(9, dim=1)
        eps = self.norm.eps
        return (norm(hidden_states, scale_msa, shift_msa, eps), gate_msa, shift_mlp, scale_mlp, gate_mlp,
                norm(hidden_states, scale_msa2, shift_msa2, eps), gate_msa2)

    return forward


def _ada_layer_norm_continuous_forward_of(norm):
    def forward(self, x, conditioning_embedding):
        """diffusers' AdaLayerNormContinuous: scale, then shift (FLUX's chunks come the other way
        round), from one linear layer in x's dtype."""
        if patching.hooked(self, ("norm",)):
            return type(self).forward(self, x, conditioning_embedding)
        scale, shift = self.linear(self.silu(conditioning_embedding).to(x.dtype)).chunk(2, dim=1)
        return norm(x, scale, shift, self.norm.eps)

    return forward


# The block's first norms, as the attention takes their output: {FP8 rows?: {norm: forward}}
_NORM1_FORWARDS = {fp8: {"zero": flux._NORM_FORWARDS[fp8],
                         "zero_x": _ada_layer_norm_zero_x_forward_of(flux._norm_fp8 if fp8 else flux._norm),
                         "continuous": _ada_layer_norm_continuous_forward_of(flux._norm_fp8 if fp8 else flux._norm)}
                   for fp8 in (False, True)}


def _joint_block_forward_of(residual_norm):
    def forward(self, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs=None):
        """diffusers' JointTransformerBlock with each "residual + gate * attention, then norm2
        and its modulation" as one ``residual_norm`` (flux.py's: a tensor, or FP8 rows for the
        MLP). With dual attention the first attention's gated add stays a torch add and the
        second's is fused. Chunked feed-forward (``set_chunk_feed_forward``) runs diffusers' code."""
        if self._chunk_size is not None or patching.hooked(self, ("norm2",) if self.context_pre_only
                                                           else ("norm2", "norm2_context")):
            return type(self).forward(self, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs)
        return _joint_block(self, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs, residual_norm)

    return forward


def _joint_block(self, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs, residual_norm):
    """diffusers' JointTransformerBlock after the checks of _joint_block_forward_of's forward."""
    joint_attention_kwargs = joint_attention_kwargs or {}
    if self.use_dual_attention:
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp, norm_hidden_states2, gate_msa2 = self.norm1(
            hidden_states, emb=temb)
    else:
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
    if self.context_pre_only:
        norm_context = self.norm1_context(encoder_hidden_states, temb)
    else:
        norm_context, context_gate_msa, context_shift_mlp, context_scale_mlp, context_gate_mlp = self.norm1_context(
            encoder_hidden_states, emb=temb)
    attention, context_attention = self.attn(hidden_states=norm_hidden_states, encoder_hidden_states=norm_context,
                                             **joint_attention_kwargs)
    if self.use_dual_attention:
        hidden_states = hidden_states + gate_msa.unsqueeze(1) * attention
        attention, gate_msa = self.attn2(hidden_states=norm_hidden_states2, **joint_attention_kwargs), gate_msa2

    norm_hidden_states, hidden_states = residual_norm(attention, hidden_states, gate_msa, scale_mlp, shift_mlp,
                                                      self.norm2.eps)
    hidden_states = hidden_states + gate_mlp.unsqueeze(1) * self.ff(norm_hidden_states)
    if self.context_pre_only:
        return None, hidden_states

    norm_context, encoder_hidden_states = residual_norm(context_attention, encoder_hidden_states, context_gate_msa,
                                                        context_scale_mlp, context_shift_mlp, self.norm2_context.eps)
    encoder_hidden_states = encoder_hidden_states + context_gate_mlp.unsqueeze(1) * self.ff_context(norm_context)
    return encoder_hidden_states, hidden_states


_JOINT_BLOCK_FORWARDS = {False: _joint_block_forward_of(flux._residual_norm),
                         True: _joint_block_forward_of(flux._residual_norm_fp8)}


def _heads(x, heads):
    """[B, S, H*Dh] -> [B, H, S, Dh], the layout diffusers hands attention."""
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def _rms_per_head(x, norm, heads):
    """diffusers' RMSNorm over head_dim of a [B, S, H*Dh] projection, as norm_scale_shift on
    its [B, S*H, Dh] view."""
    no_modulation = x.new_zeros(())
    rows = ops.norm_scale_shift(x.reshape(x.shape[0], -1, x.shape[-1] // heads), no_modulation, no_modulation,
                                weight=norm.weight, norm="rms", eps=norm.eps)
    return _heads(rows.view(x.shape), heads)


def _per_head(x, norm, heads):
    """[B, S, H*Dh] -> [B, H, S, Dh], through the q/k norm where there is one."""
    return _heads(x, heads) if norm is None else _rms_per_head(x, norm, heads)


def _projections(attn, x, joint: str, names: tuple) -> tuple:
    """q, k, v of ``x``: the one GEMM ``joint`` where quantize.join_projections made one."""
    if attn.fused_projections:
        return getattr(attn, joint)(x).chunk(3, dim=-1)
    return tuple(getattr(attn, name)(x) for name in names)


class SD3JointProcessor(patching.DitopsProcessor):
    """diffusers' JointAttnProcessor2_0 on what ditops' norms give it, tensors or FP8 rows
    (quantize="fp8"), with SD3.5's per-head q/k RMSNorms as norm_scale_shift (norm="rms"); SD3
    has none. Like the processor it replaces it calls torch's scaled_dot_product_attention (no
    diffusers attention backend); calls with a mask or extra arguments (which that processor
    ignores), and norm weights of another dtype than the projections (diffusers' RMSNorm then
    returns the weights' dtype), go to the original."""

    bypassed = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        names = self.bypassed if encoder_hidden_states is not None else self.bypassed[:2]
        norms = tuple(name for name in names if getattr(attn, name) is not None)
        dtype = patching.activation_dtype(hidden_states, attn.to_q)
        if attention_mask is not None or args or kwargs or not patching.norms_taken(attn, norms, dtype):
            return self.defer(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)
        heads = attn.heads
        query, key, value = _projections(attn, hidden_states, "to_qkv", ("to_q", "to_k", "to_v"))
        image_tokens = query.shape[1]  # from the projection: hidden_states may be FP8 rows
        query, key, value = _per_head(query, attn.norm_q, heads), _per_head(key, attn.norm_k, heads), _heads(value, heads)
        if encoder_hidden_states is not None:
            context_query, context_key, context_value = _projections(
                attn, encoder_hidden_states, "to_added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj"))
            query = torch.cat([query, _per_head(context_query, attn.norm_added_q, heads)], dim=2)
            key = torch.cat([key, _per_head(context_key, attn.norm_added_k, heads)], dim=2)
            value = torch.cat([value, _heads(context_value, heads)], dim=2)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](out))
        out, context_out = out[:, :image_tokens], out[:, image_tokens:]
        if not attn.context_pre_only:
            context_out = attn.to_add_out(context_out)
        return attn.to_out[1](attn.to_out[0](out)), context_out


def _attention_supported(attn) -> bool:
    """diffusers' joint processor, with SD3.5's q/k RMSNorms (weights, no bias) or no q/k norm."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0
    from diffusers.models.normalization import RMSNorm

    names = ("norm_q", "norm_k") + (("norm_added_q", "norm_added_k") if attn.added_kv_proj_dim is not None else ())
    norms = [getattr(attn, name) for name in names]
    return type(attn.processor) is JointAttnProcessor2_0 and (
        all(norm is None for norm in norms)
        or all(type(norm) is RMSNorm and norm.weight is not None and norm.bias is None for norm in norms))


def _block_supported(block) -> bool:
    from diffusers.models.attention import JointTransformerBlock
    from diffusers.models.normalization import AdaLayerNormContinuous, AdaLayerNormZero, SD35AdaLayerNormZeroX

    norm1 = SD35AdaLayerNormZeroX if block.use_dual_attention else AdaLayerNormZero
    context_norm1 = AdaLayerNormContinuous if block.context_pre_only else AdaLayerNormZero
    norm2s = (block.norm2,) if block.context_pre_only else (block.norm2, block.norm2_context)
    return (type(block) is JointTransformerBlock and type(block.norm1) is norm1
            and patching.plain_layer_norm(block.norm1.norm) and type(block.norm1_context) is context_norm1
            and patching.plain_layer_norm(block.norm1_context.norm) and all(map(patching.plain_layer_norm, norm2s)))


def patch(model, patches: list, report, fp8_dtype=None) -> None:
    """Patches the joint blocks; with ``fp8_dtype`` their Linears run FP8, the attentions fed FP8
    rows by the AdaLN norms and the MLPs by the residual norms, each where all the Linears those
    norms feed became FP8."""
    for index, block in enumerate(model.transformer_blocks):
        path = f"transformer_blocks.{index}"
        attentions = {f"{path}.{name}": getattr(block, name) for name in ("attn", "attn2")
                      if getattr(block, name) is not None}
        for attention_path, attention in attentions.items():
            if attention.norm_q is not None:
                patching.replace_processor(patches, report, attention, attention_path, _attention_supported(attention),
                                           SD3JointProcessor, "norm_scale_shift (rms)")
            elif fp8_dtype is None:
                report.skipped.append(f"{attention_path}: no q/k norm (SD3); attention stays as diffusers wrote it")
        if not _block_supported(block):
            report.skipped.append(f"{path}: another block type, or norms with affine parameters or of another type")
            continue
        rows = fp8_dtype is not None and _quantize_attentions(attentions, path, patches, report, fp8_dtype)
        norm1 = "zero_x" if block.use_dual_attention else "zero"
        context_norm1 = "continuous" if block.context_pre_only else "zero"
        for name, form in (("norm1", norm1), ("norm1_context", context_norm1)):
            if patching.replace_forward(patches, report, getattr(block, name), f"{path}.{name}",
                                        _NORM1_FORWARDS[rows][form]):
                report.replaced.append((f"{path}.{name}", "norm_scale_shift" + ("_fp8" if rows else "")))
        feed_forwards = {f"{path}.{name}": getattr(block, name)
                         for name in (("ff",) if block.context_pre_only else ("ff", "ff_context"))}
        fp8 = fp8_dtype is not None and quantize.replace_fed_with_feed_forwards(patches, report, [], feed_forwards,
                                                                                fp8_dtype, path)
        if patching.replace_forward(patches, report, block, path, _JOINT_BLOCK_FORWARDS[fp8]):
            norm2s = f"{path}.norm2" + ("" if block.context_pre_only else f", {path}.norm2_context")
            report.replaced.append((norm2s, "residual_norm_scale_shift" + ("_fp8" if fp8 else "")))
    if fp8_dtype is not None:
        quantize.replace_rest(model, patches, report, fp8_dtype)


def _quantize_attentions(attentions: dict, path, patches, report, fp8_dtype) -> bool:
    """The Linears the block's AdaLN norms feed -> FP8 (q/k/v of each attention, the text
    stream's too); True where those norms may give them FP8 rows. Projections with no q/k norm
    between them and the attention (SD3) become one GEMM per stream: SD3.5's stay apart, since
    a per-head norm on a slice of a joint output would copy it first."""
    for attention_path, attention in attentions.items():
        if attention.norm_q is None:  # SD3: ditops' processor is there to take the rows
            patching.replace_processor(patches, report, attention, attention_path, _attention_supported(attention),
                                       SD3JointProcessor, "FP8 rows to q/k/v")
    if not all(quantize.takes_rows(report, attention, SD3JointProcessor, path) for attention in attentions.values()):
        return False
    linears = [linear for attention_path, attention in attentions.items()
               for linear in quantize.fed(attention, flux._QKV + (flux._ADDED_QKV if attention.added_kv_proj_dim
                                                                  else ()), attention_path)]
    if not quantize.replace_fed(patches, report, linears, fp8_dtype, path):
        return False
    for attention_path, attention in attentions.items():
        if attention.norm_q is None:
            added = {"to_added_qkv": flux._ADDED_QKV} if attention.added_kv_proj_dim else {}
            joints = {"to_qkv": flux._QKV, **added}
            quantize.join_projections(patches, report, attention, attention_path, joints)
    return True
