"""Lumina2 (``Lumina2Transformer2DModel``) under ditops. Z-Image descends from it: the same
sandwich norms, with the first RMSNorm inside a ``LuminaRMSNormZero``.

- In the modulated blocks (``noise_refiner``, ``layers``), ``norm1``'s RMSNorm and its scale ->
  ``norm_scale_shift``; "x + tanh(gate) * RMSNorm(attention), then the FFN's RMSNorm and its
  scale" -> ``add_gate_norm_scale``; the FFN's gated add -> ``add_gate_norm``. The
  ``context_refiner`` blocks have no modulation (plain RMSNorms, no scale or gate to fuse) and
  run their norms as diffusers wrote them.
- Every attention's q/k RMSNorm + RoPE -> ``qk_norm_rope_`` on the per-item complex frequencies
  the model hands the block (interleaved pairs); grouped-query attention (fewer k/v heads), the
  key mask and the proportional softmax scale as diffusers' processor computes them, through
  ``F.scaled_dot_product_attention`` as it does (the processor has no attention backend).

With ``quantize="fp8"`` (quantize.py), as on Z-Image: a modulated block with ditops' processor
whose fed Linears all became FP8 gets its norms' output as FP8 rows, ``norm_scale_shift_fp8``
to q/k/v and ``add_gate_norm_scale_fp8`` to the SwiGLU FFN's ``linear_1`` and ``linear_3``. The
other Linears (the attention output, ``linear_2``, whose input is the SiLU gating, the
modulation, the context refiner's blocks) quantise their own input.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ... import ops
from . import patching, quantize, z_image

_NORMS = ("norm1", "norm2", "ffn_norm1", "ffn_norm2")


def _block_forward_of(first_norm, gated_norm):
    def forward(self, hidden_states, attention_mask, image_rotary_emb, temb=None):
        """diffusers' modulated Lumina2TransformerBlock: norm1's RMSNorm and its scale as
        ``first_norm`` (z_image.py's: norm_scale_shift, or its FP8 form), "x + tanh(gate) *
        norm2(attention), then ffn_norm1 and its scale" as ``gated_norm`` (add_gate_norm_scale),
        and the FFN's gated add as add_gate_norm. With norm weights of another dtype than the
        activations (diffusers' RMSNorm then returns float32), a hooked norm or no modulation,
        diffusers' forward runs."""
        if (not self.modulation or temb is None or patching.hooked(self, _NORMS)
                or patching.hooked(self.norm1, ("norm",)) or any(
                    norm.weight.dtype != hidden_states.dtype
                    for norm in (self.norm1.norm, self.norm2, self.ffn_norm1, self.ffn_norm2))):
            return type(self).forward(self, hidden_states, attention_mask, image_rotary_emb, temb)
        norm1 = self.norm1
        scale_msa, gate_msa, scale_mlp, gate_mlp = norm1.linear(norm1.silu(temb)).chunk(4, dim=1)
        eps = norm1.norm.eps
        attention_input = first_norm(hidden_states, scale_msa, norm1.norm.weight, eps)
        attention = self.attn(hidden_states=attention_input, encoder_hidden_states=attention_input,
                              attention_mask=attention_mask, image_rotary_emb=image_rotary_emb)
        hidden_states, feed_forward_input = gated_norm(hidden_states, attention, gate_msa, scale_mlp, self.norm2.weight,
                                                       self.ffn_norm1.weight, eps)
        return ops.add_gate_norm(hidden_states, self.feed_forward(feed_forward_input), gate_mlp,
                                 weight=self.ffn_norm2.weight, norm="rms", eps=eps, gate_act="tanh")

    return forward


_BLOCK_FORWARDS = {False: _block_forward_of(z_image._first_norm, z_image._gated_norm),
                   True: _block_forward_of(z_image._first_norm_fp8, z_image._gated_norm_fp8)}


class Lumina2QKNormRopeProcessor(patching.DitopsProcessor):
    """diffusers' Lumina2AttnProcessor2_0 with the per-head q/k RMSNorm and the RoPE as
    qk_norm_rope_. The frequencies are per batch item ([B, S, Dh / 2], complex), so the cache
    holds B * S rows and token (b, s) reads row b * S + s through positions. The projections
    take a tensor or FP8 rows (quantize="fp8": the block's first norm feeds them)."""

    bypassed = ("norm_q", "norm_k")

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None,
                 base_sequence_length=None):
        if (image_rotary_emb is None or encoder_hidden_states is not hidden_states
                or patching.hooked(attn, self.bypassed)):
            return self.defer(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                              base_sequence_length)
        query = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))
        batch, tokens, _, head_dim = query.shape
        key, value = (projection(hidden_states).unflatten(-1, (-1, head_dim)) for projection in (attn.to_k, attn.to_v))
        cache = patching.complex_cache(image_rotary_emb).reshape(batch * tokens, -1)
        positions = torch.arange(batch * tokens, device=query.device).view(batch, tokens)
        ops.qk_norm_rope_(query, key, attn.norm_q.weight, attn.norm_k.weight, cache, positions, eps=attn.norm_q.eps)
        scale = attn.scale if base_sequence_length is None else (
            math.sqrt(math.log(tokens, base_sequence_length)) * attn.scale)
        repeats = attn.heads // key.shape[2]
        key, value = (t.unsqueeze(3).repeat(1, 1, 1, repeats, 1).flatten(2, 3) for t in (key, value))
        if attention_mask is not None:
            attention_mask = attention_mask.bool().view(batch, 1, 1, -1)
        out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                             attn_mask=attention_mask, scale=scale)
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _block_supported(block) -> bool:
    from diffusers.models.normalization import LuminaRMSNormZero, RMSNorm

    if type(block.norm1) is not LuminaRMSNormZero:
        return False
    norms = (block.norm1.norm, block.norm2, block.ffn_norm1, block.ffn_norm2)
    return all(type(norm) is RMSNorm and norm.weight is not None and norm.bias is None and norm.eps == norms[0].eps
               for norm in norms)


def _attention_supported(attn) -> bool:
    from diffusers.models.normalization import RMSNorm
    from diffusers.models.transformers.transformer_lumina2 import Lumina2AttnProcessor2_0

    return type(attn.processor) is Lumina2AttnProcessor2_0 and attn.norm_q.eps == attn.norm_k.eps and all(
        type(norm) is RMSNorm and norm.weight is not None for norm in (attn.norm_q, attn.norm_k))


def patch(model, patches: list, report, fp8_dtype=None) -> None:
    """Patches the blocks; with ``fp8_dtype`` their Linears run FP8, fed FP8 rows by the norms
    where a block's processor is ditops' and all the Linears its norms feed became FP8."""
    from diffusers.models.transformers.transformer_lumina2 import Lumina2TransformerBlock

    for group in ("context_refiner", "noise_refiner", "layers"):
        for index, block in enumerate(getattr(model, group)):
            path = f"{group}.{index}"
            if not patching.is_block(report, block, Lumina2TransformerBlock, path):
                continue
            patching.replace_processor(patches, report, block.attn, f"{path}.attn",
                                       _attention_supported(block.attn), Lumina2QKNormRopeProcessor, "qk_norm_rope_")
            if not block.modulation:
                report.skipped.append(f"{path}: no modulation (plain RMSNorms, no scale or gate to fuse); its norms "
                                      "stay as diffusers wrote them")
                continue
            if not _block_supported(block):
                report.skipped.append(f"{path}: norms of another type, with bias or other eps")
                continue
            fp8 = fp8_dtype is not None and _quantize_block(block, path, patches, report, fp8_dtype)
            suffix = "_fp8" if fp8 else ""
            if patching.replace_forward(patches, report, block, path, _BLOCK_FORWARDS[fp8]):
                report.replaced += [(f"{path}.norm1", "norm_scale_shift" + suffix),
                                    (f"{path}.norm2, {path}.ffn_norm1", "add_gate_norm_scale" + suffix),
                                    (f"{path}.ffn_norm2", "add_gate_norm")]
    if fp8_dtype is not None:
        quantize.replace_rest(model, patches, report, fp8_dtype)


def _quantize_block(block, path, patches, report, fp8_dtype) -> bool:
    """The Linears the block's norms feed -> FP8 (q/k/v, the FFN's linear_1 and linear_3); True
    where the norms may give them FP8 rows."""
    if not quantize.takes_rows(report, block.attn, Lumina2QKNormRopeProcessor, path):
        return False
    linears = (quantize.fed(block.attn, ("to_q", "to_k", "to_v"), f"{path}.attn")
               + quantize.fed(block.feed_forward, ("linear_1", "linear_3"), f"{path}.feed_forward"))
    return quantize.replace_fed(patches, report, linears, fp8_dtype, path)
