"""MiniMax-H3 (``MiniMaxH3Transformer3DModel``) under ditops.

One packed sequence of text, video and audio rows; each row takes the AdaLN modulation of its
(timestep, modality) pair, a row of the block's modulation table (``adaln_indices``).

- In ``transformer_blocks``: the RMSNorm ``norm1`` and its modulation -> ``norm_scale_shift``;
  "residual + gate * attention, then ``norm2`` and its modulation" ->
  ``residual_norm_scale_shift``. The ops read the block's [K, D] modulation tables through
  ``adaln_indices`` (their ``modulation_index``), with no copy of the selected rows (diffusers'
  ``index_select``); the FFN's gate, applied outside the ops, is selected as diffusers selects it.
- Their attention's per-head q/k RMSNorm and the NeoX RoPE on the leading channels of each
  head -> ``qk_norm_rope_(interleaved=False, rotary_dim=R)``, on the (cos, sin) the model's
  ``rope`` hands the block, cast to the activations' dtype as diffusers casts them. Under
  context parallelism the plan splits those rows with the hidden states: the shard's rows.
- The text token refiner's blocks (unmodulated pre-norm RMSNorms) keep diffusers' code.

With ``quantize="fp8"`` (quantize.py) a block whose attention runs ditops' processor gets its
norms' output as FP8 rows: ``norm_scale_shift_fp8`` to q/k/v, ``residual_norm_scale_shift_fp8``
to the SwiGLU FFN's up projection; its down projection, the attention output and the other
Linears quantise their own input.
"""

from __future__ import annotations

import torch

from ... import ops
from ...fp8 import Float8Rows
from . import patching, quantize


def _block_forward_of(fp8: bool):
    def forward(self, hidden_states, temb, adaln_indices, rotary_emb, attention_mask=None):
        """diffusers' MiniMaxH3TransformerBlock with its two norms and their modulation as ops."""
        if patching.hooked(self, ("norm1", "norm2")):
            return type(self).forward(self, hidden_states, temb, adaln_indices, rotary_emb, attention_mask)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaln_proj(temb)  # [K, D] tables
        if fp8:
            norm_hidden_states = Float8Rows(*ops.norm_scale_shift_fp8(
                hidden_states, scale_msa, shift_msa, weight=self.norm1.weight, norm="rms", eps=self.norm1.eps,
                modulation_index=adaln_indices))
        else:
            norm_hidden_states = ops.norm_scale_shift(hidden_states, scale_msa, shift_msa, weight=self.norm1.weight,
                                                      norm="rms", eps=self.norm1.eps, modulation_index=adaln_indices)
        attention = self.attn(norm_hidden_states, rotary_emb, attention_mask)
        if fp8:
            y, y_scale, hidden_states = ops.residual_norm_scale_shift_fp8(
                attention, hidden_states, gate_msa, scale_mlp, shift_mlp, weight=self.norm2.weight, norm="rms",
                eps=self.norm2.eps, modulation_index=adaln_indices)
            norm_hidden_states = Float8Rows(y, y_scale)
        else:
            norm_hidden_states, hidden_states = ops.residual_norm_scale_shift(
                attention, hidden_states, gate_msa, scale_mlp, shift_mlp, weight=self.norm2.weight, norm="rms",
                eps=self.norm2.eps, modulation_index=adaln_indices)
        return hidden_states + gate_mlp.index_select(0, adaln_indices) * self.ff(norm_hidden_states)

    return forward


_BLOCK_FORWARDS = {fp8: _block_forward_of(fp8) for fp8 in (False, True)}


class MiniMaxH3QKNormRopeProcessor(patching.DitopsProcessor):
    """diffusers' MiniMaxH3AttnProcessor with the per-head q/k RMSNorms and the RoPE (NeoX
    pairs over the first R channels of a head; diffusers' cos and sin repeat their R/2 values
    in both halves) as one qk_norm_rope_. Calls without tables, or with a hook on
    norm_q/norm_k, go to the original."""

    bypassed = ("norm_q", "norm_k")

    def __call__(self, attn, hidden_states, rotary_emb=None, attention_mask=None):
        if rotary_emb is None or patching.hooked(attn, self.bypassed):
            return self.defer(attn, hidden_states, rotary_emb, attention_mask)
        if attn.fused_projections:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key = patching.writable(query, key)
        query, key, value = (t.unflatten(-1, (attn.heads, -1)) for t in (query, key, value))
        cos, sin = rotary_emb
        half = cos.shape[-1] // 2
        cache = torch.cat([cos[:, :half], sin[:, :half]], dim=1).to(query.dtype)
        query, key = ops.qk_norm_rope_(query, key, attn.norm_q.weight, attn.norm_k.weight, cache, interleaved=False,
                                       rotary_dim=2 * half, eps=attn.norm_q.eps)
        out = self.attention(query, key, value, attention_mask).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _attention_supported(attn) -> bool:
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

    norms = (attn.norm_q, attn.norm_k)
    return (type(attn.processor) is MiniMaxH3AttnProcessor and attn.head_dim % 2 == 0
            and all(type(norm) is torch.nn.RMSNorm and norm.weight is not None
                    and tuple(norm.normalized_shape) == (attn.head_dim,) for norm in norms)
            and attn.norm_q.eps is not None and attn.norm_q.eps == attn.norm_k.eps)


def _rms_norm(norm) -> bool:
    return type(norm) is torch.nn.RMSNorm and norm.weight is not None and norm.eps is not None


def patch(model, patches: list, report, fp8_dtype=None) -> None:
    """Patches the transformer blocks; with ``fp8_dtype`` their Linears run FP8, fed FP8 rows by
    the norms where the block's attention runs ditops' processor."""
    for index, block in enumerate(model.transformer_blocks):
        path = f"transformer_blocks.{index}"
        patching.replace_processor(patches, report, block.attn, f"{path}.attn", _attention_supported(block.attn),
                                   MiniMaxH3QKNormRopeProcessor, "qk_norm_rope_")
        if not (_rms_norm(block.norm1) and _rms_norm(block.norm2)):
            report.skipped.append(f"{path}: norm1/norm2 not torch.nn.RMSNorm with a weight and a number as eps")
            continue
        fp8 = fp8_dtype is not None and _quantize_block(block, path, patches, report, fp8_dtype)
        if patching.replace_forward(patches, report, block, path, _BLOCK_FORWARDS[fp8]):
            suffix = "_fp8" if fp8 else ""
            report.replaced.append((f"{path}.norm1", "norm_scale_shift" + suffix))
            report.replaced.append((f"{path}.norm2", "residual_norm_scale_shift" + suffix))
    if len(model.token_refiner.refiner_blocks):
        report.skipped.append("token_refiner: unmodulated pre-norm blocks, left as diffusers wrote them")
    if fp8_dtype is not None:
        quantize.replace_rest(model, patches, report, fp8_dtype)


def _quantize_block(block, path, patches, report, fp8_dtype) -> bool:
    """q/k/v and the SwiGLU FFN's up projection -> FP8, fed rows by norm1 and norm2; True where
    the norms may give them (the attention runs ditops' processor)."""
    if not quantize.takes_rows(report, block.attn, MiniMaxH3QKNormRopeProcessor, path):
        return False
    linears = quantize.fed(block.attn, ("to_q", "to_k", "to_v"), f"{path}.attn")
    if not quantize.replace_fed_with_feed_forwards(patches, report, linears, {f"{path}.ff": block.ff}, fp8_dtype, path):
        return False
    quantize.join_projections(patches, report, block.attn, f"{path}.attn", {"to_qkv": ("to_q", "to_k", "to_v")})
    return True
