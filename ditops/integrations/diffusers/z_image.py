"""Z-Image (``ZImageTransformer2DModel``) under ditops.

- In modulated blocks, the first RMSNorm and its scale -> ``norm_scale_shift``; "x +
  tanh(gate) * RMSNorm(attention), then the FFN's RMSNorm and its scale" ->
  ``add_gate_norm_scale``; the FFN's gated add -> ``add_gate_norm``. With per-token modulation
  (``noise_mask``: Z-Image Omni's noisy and clean tokens) ``norm_scale_shift`` reads its scale
  from a [B, 2, D] table (the clean and the noisy set) through ``noise_mask`` as its
  ``modulation_index``; the other ops, which take no index, take each token's modulation
  selected into [B, S, D] tensors as diffusers selects it.
- Every attention's q/k RMSNorm + RoPE -> ``qk_norm_rope_`` on the per-image frequencies the
  model hands the block. diffusers 0.42 has no context-parallel plan for Z-Image.

With ``quantize="fp8"`` (quantize.py) a block with ditops' processor whose fed Linears all
became FP8 gets its norms' output as FP8 rows: ``norm_scale_shift_fp8`` to q/k/v,
``add_gate_norm_scale_fp8`` to the FFN's w1 and w3. The other Linears (the attention output,
w2, the modulation) quantise their own input.
"""

from __future__ import annotations

import torch

from ... import ops
from ...fp8 import Float8Rows
from . import patching, quantize


def _first_norm(x, scale, weight, eps, modulation_index=None):
    return ops.norm_scale_shift(x, scale, x.new_zeros(()), weight=weight, norm="rms", eps=eps,
                                modulation_index=modulation_index)


def _first_norm_fp8(x, scale, weight, eps, modulation_index=None):
    return Float8Rows(*ops.norm_scale_shift_fp8(x, scale, x.new_zeros(()), weight=weight, norm="rms", eps=eps,
                                                modulation_index=modulation_index))


def _gated_norm(x, attention, gate, scale, weight, weight2, eps):
    """(x + tanh(gate) * RMSNorm(attention), the FFN's input: its RMSNorm and scale)."""
    return ops.add_gate_norm_scale(x, attention, gate, scale, weight=weight, weight2=weight2, norm="rms", eps=eps,
                                   gate_act="tanh")


def _gated_norm_fp8(x, attention, gate, scale, weight, weight2, eps):
    y, y_scale, out = ops.add_gate_norm_scale_fp8(x, attention, gate, scale, weight=weight, weight2=weight2, norm="rms",
                                                  eps=eps, gate_act="tanh")
    return out, Float8Rows(y, y_scale)


def _block_forward_of(first_norm, gated_norm):
    def forward(self, x, attn_mask, freqs_cis, adaln_input=None, noise_mask=None, adaln_noisy=None, adaln_clean=None):
        """diffusers' ZImageTransformerBlock: the first RMSNorm and its scale as norm_scale_shift,
        "x + tanh(gate) * norm(attention), then the FFN's RMSNorm and its scale" as
        add_gate_norm_scale, and the FFN's gated add as add_gate_norm. With ``noise_mask`` each
        token's modulation is the noisy or the clean one: norm_scale_shift reads its scale from
        the two through noise_mask, the other ops take it selected as diffusers selects it, into
        [B, S, D] tensors. Blocks without modulation run as diffusers wrote them."""
        if not self.modulation or patching.hooked(self, ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2")):
            return type(self).forward(self, x, attn_mask, freqs_cis, adaln_input, noise_mask, adaln_noisy, adaln_clean)
        if noise_mask is None:
            scale_msa, gate_msa, scale_mlp, gate_mlp = self.adaLN_modulation(adaln_input).unsqueeze(1).chunk(4, dim=2)
        else:
            from diffusers.models.transformers.transformer_z_image import select_per_token

            # the raw values, selected before the ops take 1 + scale and tanh(gate) per value
            noisy, clean = (self.adaLN_modulation(embedding).chunk(4, dim=1) for embedding in (adaln_noisy, adaln_clean))
            # a [B, 2, D] table read through noise_mask: row 0 the clean set, row 1 the noisy one,
            # which select_per_token picks where noise_mask == 1 (diffusers' masks hold 0 and 1);
            # the stack writes 2 rows per batch item where select_per_token would write S
            scale_msa = torch.stack((clean[0], noisy[0]), dim=1)
            gate_msa, scale_mlp, gate_mlp = (select_per_token(value_noisy, value_clean, noise_mask, x.shape[1])
                                             for value_noisy, value_clean in zip(noisy[1:], clean[1:]))
        eps = self.attention_norm1.eps
        attention_input = first_norm(x, scale_msa, self.attention_norm1.weight, eps, noise_mask)
        attention = self.attention(attention_input, attention_mask=attn_mask, freqs_cis=freqs_cis)
        x, feed_forward_input = gated_norm(x, attention, gate_msa, scale_mlp, self.attention_norm2.weight,
                                           self.ffn_norm1.weight, eps)
        return ops.add_gate_norm(x, self.feed_forward(feed_forward_input), gate_mlp, weight=self.ffn_norm2.weight,
                                 norm="rms", eps=eps, gate_act="tanh")

    return forward


_BLOCK_FORWARDS = {False: _block_forward_of(_first_norm, _gated_norm),
                   True: _block_forward_of(_first_norm_fp8, _gated_norm_fp8)}


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


def patch(model, patches: list, report, fp8_dtype=None) -> None:
    """Patches Z-Image's blocks; with ``fp8_dtype`` their Linears run FP8, fed FP8 rows by the
    norms where a block's processor is ditops' and all the Linears its norms feed became FP8."""
    for group in ("noise_refiner", "context_refiner", "layers"):
        for index, block in enumerate(getattr(model, group)):
            path = f"{group}.{index}"
            patching.replace_processor(patches, report, block.attention, f"{path}.attention",
                                       _attention_supported(block.attention), ZImageQKNormRopeProcessor, "qk_norm_rope_")
            if block.modulation and not _block_supported(block):
                report.skipped.append(f"{path}: norms of another type, with bias or other eps")
                continue
            fp8 = block.modulation and fp8_dtype is not None and _quantize_block(block, path, patches, report, fp8_dtype)
            suffix = "_fp8" if fp8 else ""
            if block.modulation and patching.replace_forward(patches, report, block, path,
                                                             _BLOCK_FORWARDS[fp8]):
                report.replaced += [(f"{path}.attention_norm1", "norm_scale_shift" + suffix),
                                    (f"{path}.attention_norm2, {path}.ffn_norm1", "add_gate_norm_scale" + suffix),
                                    (f"{path}.ffn_norm2", "add_gate_norm")]
    if fp8_dtype is not None:
        quantize.replace_rest(model, patches, report, fp8_dtype)


def _quantize_block(block, path, patches, report, fp8_dtype) -> bool:
    """The Linears the block's norms feed -> FP8 (q/k/v, the FFN's w1 and w3); True where the
    norms may give them FP8 rows."""
    if not quantize.takes_rows(report, block.attention, ZImageQKNormRopeProcessor, path):
        return False
    linears = (quantize.fed(block.attention, ("to_q", "to_k", "to_v"), f"{path}.attention")
               + quantize.fed(block.feed_forward, ("w1", "w3"), f"{path}.feed_forward"))
    return quantize.replace_fed(patches, report, linears, fp8_dtype, path)
