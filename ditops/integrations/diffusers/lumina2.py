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
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ... import ops
from . import patching

_NORMS = ("norm1", "norm2", "ffn_norm1", "ffn_norm2")


def _block_forward(self, hidden_states, attention_mask, image_rotary_emb, temb=None):
    """diffusers' modulated Lumina2TransformerBlock: norm1's RMSNorm and its scale as
    norm_scale_shift, "x + tanh(gate) * norm2(attention), then ffn_norm1 and its scale" as
    add_gate_norm_scale, and the FFN's gated add as add_gate_norm. With norm weights of another
    dtype than the activations (diffusers' RMSNorm then returns float32), a hooked norm or no
    modulation, diffusers' forward runs."""
    if (not self.modulation or temb is None or patching.hooked(self, _NORMS) or patching.hooked(self.norm1, ("norm",))
            or any(norm.weight.dtype != hidden_states.dtype
                   for norm in (self.norm1.norm, self.norm2, self.ffn_norm1, self.ffn_norm2))):
        return type(self).forward(self, hidden_states, attention_mask, image_rotary_emb, temb)
    norm1 = self.norm1
    scale_msa, gate_msa, scale_mlp, gate_mlp = norm1.linear(norm1.silu(temb)).chunk(4, dim=1)
    eps = norm1.norm.eps
    no_shift = hidden_states.new_zeros(())
    attention_input = ops.norm_scale_shift(hidden_states, scale_msa, no_shift, weight=norm1.norm.weight, norm="rms",
                                           eps=eps)
    attention = self.attn(hidden_states=attention_input, encoder_hidden_states=attention_input,
                          attention_mask=attention_mask, image_rotary_emb=image_rotary_emb)
    hidden_states, feed_forward_input = ops.add_gate_norm_scale(
        hidden_states, attention, gate_msa, scale_mlp, weight=self.norm2.weight, weight2=self.ffn_norm1.weight,
        norm="rms", eps=eps, gate_act="tanh")
    return ops.add_gate_norm(hidden_states, self.feed_forward(feed_forward_input), gate_mlp,
                             weight=self.ffn_norm2.weight, norm="rms", eps=eps, gate_act="tanh")


class Lumina2QKNormRopeProcessor(patching.DitopsProcessor):
    """diffusers' Lumina2AttnProcessor2_0 with the per-head q/k RMSNorm and the RoPE as
    qk_norm_rope_. The frequencies are per batch item ([B, S, Dh / 2], complex), so the cache
    holds B * S rows and token (b, s) reads row b * S + s through positions."""

    bypassed = ("norm_q", "norm_k")

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None,
                 base_sequence_length=None):
        if (image_rotary_emb is None or encoder_hidden_states is not hidden_states
                or patching.hooked(attn, self.bypassed)):
            return self.defer(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb,
                              base_sequence_length)
        batch, tokens, _ = hidden_states.shape
        query = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))
        head_dim = query.shape[-1]
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


def patch(model, patches: list, report) -> None:
    from diffusers.models.transformers.transformer_lumina2 import Lumina2TransformerBlock

    for group in ("context_refiner", "noise_refiner", "layers"):
        for index, block in enumerate(getattr(model, group)):
            path = f"{group}.{index}"
            if type(block) is not Lumina2TransformerBlock:
                report.skipped.append(f"{path}: {type(block).__name__}, not Lumina2TransformerBlock; left as it is")
                continue
            if not block.modulation:
                report.skipped.append(f"{path}: no modulation (plain RMSNorms, no scale or gate to fuse); its norms "
                                      "stay as diffusers wrote them")
            elif not _block_supported(block):
                report.skipped.append(f"{path}: norms of another type, with bias or other eps")
            elif patching.replace_forward(patches, report, block, path, _block_forward):
                report.replaced += [(f"{path}.norm1", "norm_scale_shift"),
                                    (f"{path}.norm2, {path}.ffn_norm1", "add_gate_norm_scale"),
                                    (f"{path}.ffn_norm2", "add_gate_norm")]
            patching.replace_processor(patches, report, block.attn, f"{path}.attn",
                                       _attention_supported(block.attn), Lumina2QKNormRopeProcessor, "qk_norm_rope_")
