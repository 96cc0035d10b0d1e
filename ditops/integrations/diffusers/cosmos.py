"""Cosmos (``CosmosTransformer3DModel``: Cosmos 1.0 and its 2.5 image-context blocks) under ditops.

- ``norm1`` (``CosmosAdaLayerNormZero``: LayerNorm without affine parameters, shift and scale
  from the AdaLN-LoRA of the embedded timestep plus ``temb``) -> ``norm_scale_shift``; each
  "residual + gate * attention, then ``norm2``/``norm3`` and its modulation" ->
  ``residual_norm_scale_shift``. The modulation is [B, D] (one timestep per item) or [B, S, D]
  (per-frame timesteps), both forms the ops take. The FFN's gated add (no norm follows it in the
  block) stays as diffusers wrote it.
- The self-attention's (``attn1``) q/k RMSNorm + RoPE -> ``qk_norm_rope_``: diffusers rotates
  the two halves of each head (``use_real_unbind_dim=-2``: NeoX, ``interleaved=False``) with
  cos/sin tables of one row per video token, shared by the batch.

With ``quantize="fp8"`` (quantize.py) a block with ditops' processor whose fed Linears all
became FP8 gets FP8 rows from ``norm1`` (``norm_scale_shift_fp8``) for the self-attention's
q/k/v and from ``norm3`` (``residual_norm_scale_shift_fp8``) for the FFN's up projection
(diffusers' exact GELU follows it, so the down projection quantises its own input). ``norm2``
gives bf16: it feeds the cross-attention, diffusers' processor. The other Linears quantise
their own input.

Left as diffusers wrote them: the cross-attention (``attn2``: q/k RMSNorm without RoPE, and
2.5's image-context branch), the output ``norm_out``, blocks of another class or whose norms are
not the ones checked. diffusers 0.42 has no context-parallel plan for Cosmos.
"""

from __future__ import annotations

import torch

from ... import ops
from . import flux, patching, quantize

_NORMS = ("norm1", "norm2", "norm3")


def _modulation(norm, embedded_timestep, temb):
    """CosmosAdaLayerNormZero's (shift, scale, gate), as [B, D] or [B, S, D] views."""
    emb = norm.linear_2(norm.linear_1(norm.activation(embedded_timestep)))
    return (emb if temb is None else emb + temb).chunk(3, dim=-1)


def _block_forward_of(first_norm, last_norm):
    def forward(self, hidden_states, encoder_hidden_states, embedded_timestep, temb=None, image_rotary_emb=None,
                extra_pos_emb=None, attention_mask=None, controlnet_residual=None, latents=None, block_idx=None):
        """diffusers' CosmosTransformerBlock: norm1 as ``first_norm`` (flux.py's norm_scale_shift,
        or its FP8 form), each "residual + gate * attention, then norm2/norm3 and its modulation"
        as residual_norm_scale_shift, norm3's as ``last_norm`` (or its FP8 form). With a hooked
        norm, diffusers' forward runs."""
        if patching.hooked(self, _NORMS) or any(patching.hooked(getattr(self, name), ("norm",)) for name in _NORMS):
            return type(self).forward(self, hidden_states, encoder_hidden_states, embedded_timestep, temb,
                                      image_rotary_emb, extra_pos_emb, attention_mask, controlnet_residual, latents,
                                      block_idx)
        if self.before_proj is not None:
            hidden_states = self.before_proj(hidden_states) + latents
        if extra_pos_emb is not None:
            hidden_states = hidden_states + extra_pos_emb
        shift, scale, gate = _modulation(self.norm1, embedded_timestep, temb)
        norm_hidden_states = first_norm(hidden_states, scale, shift, self.norm1.norm.eps)
        attn_output = self.attn1(norm_hidden_states, image_rotary_emb=image_rotary_emb)
        shift, scale, next_gate = _modulation(self.norm2, embedded_timestep, temb)
        norm_hidden_states, hidden_states = ops.residual_norm_scale_shift(attn_output, hidden_states, gate, scale,
                                                                          shift, eps=self.norm2.norm.eps)
        attn_output = self.attn2(norm_hidden_states, encoder_hidden_states=encoder_hidden_states,
                                 attention_mask=attention_mask)
        shift, scale, gate = _modulation(self.norm3, embedded_timestep, temb)
        norm_hidden_states, hidden_states = last_norm(attn_output, hidden_states, next_gate, scale, shift,
                                                      self.norm3.norm.eps)
        gate = gate.unsqueeze(1) if gate.ndim == 2 else gate
        hidden_states = hidden_states + gate * self.ff(norm_hidden_states)
        if controlnet_residual is not None:
            assert self.after_proj is None
            hidden_states += controlnet_residual
        if self.after_proj is not None:
            assert controlnet_residual is None
            return hidden_states, self.after_proj(hidden_states)
        return hidden_states

    return forward


_BLOCK_FORWARDS = {False: _block_forward_of(flux._norm, flux._residual_norm),
                   True: _block_forward_of(flux._norm_fp8, flux._residual_norm_fp8)}


class CosmosQKNormRopeProcessor(patching.DitopsProcessor):
    """diffusers' CosmosAttnProcessor2_0 on a self-attention with rotary tables: the per-head
    q/k RMSNorm and the NeoX RoPE as qk_norm_rope_ (cache row s for token s of every item).
    Calls without rotary tables, with context or a mask, with hooked q/k norms, or with norm
    weights of another dtype than the activations go to diffusers' processor. Attention runs
    through dispatch_attention_fn with diffusers' defaults, as diffusers' processor calls it.
    The projections take a tensor or FP8 rows (quantize="fp8": norm1 feeds them)."""

    bypassed = ("norm_q", "norm_k")

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if (image_rotary_emb is None or encoder_hidden_states is not None or attention_mask is not None
                or not patching.norms_taken(attn, self.bypassed, patching.activation_dtype(hidden_states, attn.to_q))):
            return self.defer(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        query, key, value = (projection(hidden_states).unflatten(2, (attn.heads, -1))
                             for projection in (attn.to_q, attn.to_k, attn.to_v))
        cos, sin = image_rotary_emb
        half = cos.shape[-1] // 2  # diffusers' tables repeat each half: [t, h, w, t, h, w]
        cache = torch.cat([cos[:, :half], sin[:, :half]], dim=1)
        ops.qk_norm_rope_(query, key, attn.norm_q.weight, attn.norm_k.weight, cache, interleaved=False,
                          eps=attn.norm_q.eps)
        out = dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False)
        out = attn.to_out[0](out.flatten(2, 3).type_as(query))
        return attn.to_out[1](out)


def _block_supported(block) -> bool:
    from diffusers.models.transformers.transformer_cosmos import CosmosAdaLayerNormZero

    return all(type(norm) is CosmosAdaLayerNormZero and patching.plain_layer_norm(norm.norm)
               for norm in (getattr(block, name) for name in _NORMS))


def _attention_supported(attn) -> bool:
    from diffusers.models.attention_processor import Attention
    from diffusers.models.normalization import RMSNorm
    from diffusers.models.transformers.transformer_cosmos import CosmosAttnProcessor2_0

    return (type(attn) is Attention and type(attn.processor) is CosmosAttnProcessor2_0
            and attn.inner_kv_dim == attn.inner_dim and attn.norm_q.eps == attn.norm_k.eps
            and all(type(norm) is RMSNorm and norm.weight is not None for norm in (attn.norm_q, attn.norm_k)))


def patch(model, patches: list, report, fp8_dtype=None) -> None:
    """Patches the blocks; with ``fp8_dtype`` their Linears run FP8, fed FP8 rows by norm1 and
    norm3 where a block's processor is ditops' and all the Linears they feed became FP8."""
    from diffusers.models.transformers.transformer_cosmos import CosmosTransformerBlock

    for index, block in enumerate(model.transformer_blocks):
        path = f"transformer_blocks.{index}"
        if not patching.is_block(report, block, CosmosTransformerBlock, path):
            continue
        patching.replace_processor(patches, report, block.attn1, f"{path}.attn1", _attention_supported(block.attn1),
                                   CosmosQKNormRopeProcessor, "qk_norm_rope_")
        if not _block_supported(block):
            report.skipped.append(f"{path}: norms not CosmosAdaLayerNormZero over a LayerNorm without affine "
                                  "parameters; left as they are")
        else:
            fp8 = fp8_dtype is not None and _quantize_block(block, path, patches, report, fp8_dtype)
            suffix = "_fp8" if fp8 else ""
            if patching.replace_forward(patches, report, block, path, _BLOCK_FORWARDS[fp8]):
                report.replaced += [(f"{path}.norm1", "norm_scale_shift" + suffix),
                                    (f"{path}.norm2", "residual_norm_scale_shift"),
                                    (f"{path}.norm3", "residual_norm_scale_shift" + suffix)]
            if fp8:
                report.skipped.append(f"{path}.norm2: gives bf16 (it feeds the cross-attention, diffusers' "
                                      "processor, which takes tensors)")
        report.skipped.append(f"{path}.attn2: cross-attention, q/k RMSNorm without RoPE; left as it is")
    if fp8_dtype is not None:
        quantize.replace_rest(model, patches, report, fp8_dtype)


def _quantize_block(block, path, patches, report, fp8_dtype) -> bool:
    """The Linears norm1 and norm3 feed -> FP8 (attn1's q/k/v, the FFN's up projection); True
    where those norms may give them FP8 rows."""
    from diffusers.models.activations import GELU

    if not quantize.takes_rows(report, block.attn1, CosmosQKNormRopeProcessor, path):
        return False
    if type(getattr(block.ff, "net", [None])[0]) is not GELU:
        report.skipped.append(f"{path}: its norms give bf16 (ff is not diffusers' GELU FeedForward)")
        return False
    linears = (quantize.fed(block.attn1, ("to_q", "to_k", "to_v"), f"{path}.attn1")
               + quantize.fed(block.ff.net[0], ("proj",), f"{path}.ff.net.0"))
    return quantize.replace_fed(patches, report, linears, fp8_dtype, path)
