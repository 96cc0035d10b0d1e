"""Z-Image (``ZImageTransformer2DModel``) under ditops.

- In blocks with one modulation for all tokens, the first RMSNorm and its scale ->
  ``norm_scale_shift``; "x + tanh(gate) * RMSNorm(attention), then the FFN's RMSNorm and its
  scale" -> ``add_gate_norm_scale``; the FFN's gated add -> ``add_gate_norm``. Per-token
  modulation (``noise_mask``) runs as diffusers wrote it.
- Every attention's q/k RMSNorm + RoPE -> ``qk_norm_rope_`` on the per-image frequencies the
  model hands the block. diffusers 0.42 has no context-parallel plan for Z-Image.
"""

from __future__ import annotations

import torch

from ... import ops
from . import patching


def _block_forward(self, x, attn_mask, freqs_cis, adaln_input=None, noise_mask=None, adaln_noisy=None,
                   adaln_clean=None):
    """diffusers' ZImageTransformerBlock with one modulation for all tokens: the first RMSNorm
    and its scale as norm_scale_shift, "x + tanh(gate) * norm(attention), then the FFN's
    RMSNorm and its scale" as add_gate_norm_scale, and the FFN's gated add as add_gate_norm.
    Per-token modulation (noise_mask) and blocks without modulation run as diffusers wrote them."""
    if (not self.modulation or noise_mask is not None
            or patching.hooked(self, ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2"))):
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


class ZImageQKNormRopeProcessor(patching.DitopsProcessor):
    """diffusers' ZSingleStreamAttnProcessor with the per-head q/k RMSNorm and the RoPE as
    qk_norm_rope_. Its frequencies are per batch item ([B, S, Dh / 2], complex), so the cache
    holds B * S rows and token (b, s) reads row b * S + s through positions."""

    bypassed = ("norm_q", "norm_k")

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
        if freqs_cis is None or encoder_hidden_states is not None or patching.hooked(attn, self.bypassed):
            return self.defer(attn, hidden_states, encoder_hidden_states, attention_mask, freqs_cis)
        query, key, value = (projection(hidden_states).unflatten(-1, (attn.heads, -1))
                             for projection in (attn.to_q, attn.to_k, attn.to_v))
        batch, tokens = query.shape[:2]
        cache = patching.complex_cache(freqs_cis).reshape(batch * tokens, -1)
        positions = torch.arange(batch * tokens, device=query.device).view(batch, tokens)
        ops.qk_norm_rope_(query, key, attn.norm_q.weight, attn.norm_k.weight, cache, positions, eps=attn.norm_q.eps)
        if attention_mask is not None and attention_mask.ndim == 2:
            attention_mask = attention_mask[:, None, None, :]
        out = attn.to_out[0](self.attention(query, key, value, attention_mask).flatten(2, 3).to(query.dtype))
        return attn.to_out[1](out) if len(attn.to_out) > 1 else out


def _block_supported(block) -> bool:
    from diffusers.models.normalization import RMSNorm

    norms = (block.attention_norm1, block.attention_norm2, block.ffn_norm1, block.ffn_norm2)
    return all(type(norm) is RMSNorm and norm.weight is not None and norm.bias is None and norm.eps == norms[0].eps
               for norm in norms)


def _attention_supported(attn) -> bool:
    from diffusers.models.normalization import RMSNorm
    from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

    return type(attn.processor) is ZSingleStreamAttnProcessor and all(
        type(norm) is RMSNorm and norm.weight is not None for norm in (attn.norm_q, attn.norm_k))


def patch(model, patches: list, report) -> None:
    for group in ("noise_refiner", "context_refiner", "layers"):
        for index, block in enumerate(getattr(model, group)):
            path = f"{group}.{index}"
            if block.modulation and not _block_supported(block):
                report.skipped.append(f"{path}: norms of another type, with bias or other eps")
            elif block.modulation and patching.replace_forward(patches, report, block, path, _block_forward):
                report.replaced += [(f"{path}.attention_norm1", "norm_scale_shift"),
                                    (f"{path}.attention_norm2, {path}.ffn_norm1", "add_gate_norm_scale"),
                                    (f"{path}.ffn_norm2", "add_gate_norm")]
            patching.replace_processor(patches, report, block.attention, f"{path}.attention",
                                       _attention_supported(block.attention), ZImageQKNormRopeProcessor, "qk_norm_rope_")
