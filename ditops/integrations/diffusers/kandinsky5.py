"""Kandinsky 5 (``Kandinsky5Transformer3DModel``) under ditops.

- In the text blocks (``Kandinsky5TransformerEncoderBlock``) and the visual blocks
  (``Kandinsky5TransformerDecoderBlock``): ``self_attention_norm`` (LayerNorm without affine
  parameters, ``* (1 + scale) + shift`` in float32, then the activations' dtype) ->
  ``norm_scale_shift``; each "x + gate * attention (float32, stored in x's dtype), then the next
  norm and its modulation" -> ``residual_norm_scale_shift``. The modulation is one [B, D]
  vector per item. The FFN's gated add (no norm follows it in the block) stays as diffusers
  wrote it.
- The self-attentions' q/k RMSNorm + RoPE -> ``qk_norm_rope_``: diffusers rotates pairs of
  neighbouring dims (2x2 rotation matrices: interleaved) with one table row per token, the same
  for every item; it rounds the rotated q and k to bfloat16 whatever the activations' dtype,
  which the processor does too.

With ``quantize="fp8"`` (quantize.py) a block with ditops' self-attention processor whose fed
Linears all became FP8 gets FP8 rows from ``self_attention_norm`` (``norm_scale_shift_fp8``)
for the self-attention's q/k/v and from ``feed_forward_norm`` (``residual_norm_scale_shift_fp8``)
for the FFN's ``in_layer`` (an exact GELU follows it: ``out_layer`` quantises its own input).
The visual blocks' ``cross_attention_norm`` feeds diffusers' cross-attention bf16 (the report
says so), and a call with sparse (NABLA) attention, which goes to diffusers' processor, runs
the bf16 norms. The other Linears (the attentions' out_layer, the cross-attention's q/k/v, the
modulations, the final layer) quantise their own input.

Left as diffusers wrote them: the visual blocks' cross-attention (q/k RMSNorm without RoPE),
calls with sparse (NABLA) attention, the ``out_layer``'s modulated norm, blocks of another class
or whose norms are not the ones checked. diffusers 0.42 has no context-parallel plan for
Kandinsky 5.
"""

from __future__ import annotations

import torch

from ... import ops
from . import flux, patching, quantize

_TEXT_NORMS = ("self_attention_norm", "feed_forward_norm")
_VISUAL_NORMS = ("self_attention_norm", "cross_attention_norm", "feed_forward_norm")


def _gated_add(x, gate, out):
    """diffusers' "x + gate * out" in float32, stored in x's dtype (the FFN's, no norm follows)."""
    return (x.float() + gate.float().unsqueeze(1) * out.float()).type_as(x)


def _text_block_forward_of(norm, residual_norm):
    def forward(self, x, time_embed, rope):
        """diffusers' Kandinsky5TransformerEncoderBlock: self_attention_norm as ``norm`` (flux.py's
        norm_scale_shift, or its FP8 form), "x + gate * attention, then feed_forward_norm" as
        ``residual_norm`` (residual_norm_scale_shift, or its FP8 form). With a hooked norm,
        diffusers' forward runs."""
        if patching.hooked(self, _TEXT_NORMS):
            return type(self).forward(self, x, time_embed, rope)
        shift, scale, gate, ff_shift, ff_scale, ff_gate = self.text_modulation(time_embed).chunk(6, dim=-1)
        out = norm(x, scale, shift, self.self_attention_norm.eps)
        out = self.self_attention(out, rotary_emb=rope)
        out, x = residual_norm(out, x, gate, ff_scale, ff_shift, self.feed_forward_norm.eps)
        return _gated_add(x, ff_gate, self.feed_forward(out))

    return forward


def _visual_block_forward_of(norm, residual_norm):
    def forward(self, visual_embed, text_embed, time_embed, rope, sparse_params):
        """diffusers' Kandinsky5TransformerDecoderBlock: self_attention_norm as ``norm``, "x +
        gate * attention, then cross_attention_norm" as residual_norm_scale_shift (diffusers'
        cross-attention takes it), "x + gate * cross-attention, then feed_forward_norm" as
        ``residual_norm``. Sparse attention (diffusers' processor) takes the bf16 norms. With a
        hooked norm, diffusers' forward runs."""
        if patching.hooked(self, _VISUAL_NORMS):
            return type(self).forward(self, visual_embed, text_embed, time_embed, rope, sparse_params)
        first, last = (norm, residual_norm) if sparse_params is None else (flux._norm, flux._residual_norm)
        (shift, scale, gate, cross_shift, cross_scale, cross_gate,
         ff_shift, ff_scale, ff_gate) = self.visual_modulation(time_embed).chunk(9, dim=-1)
        out = first(visual_embed, scale, shift, self.self_attention_norm.eps)
        out = self.self_attention(out, rotary_emb=rope, sparse_params=sparse_params)
        out, visual_embed = ops.residual_norm_scale_shift(out, visual_embed, gate, cross_scale, cross_shift,
                                                          eps=self.cross_attention_norm.eps)
        out = self.cross_attention(out, encoder_hidden_states=text_embed)
        out, visual_embed = last(out, visual_embed, cross_gate, ff_scale, ff_shift, self.feed_forward_norm.eps)
        return _gated_add(visual_embed, ff_gate, self.feed_forward(out))

    return forward


_NORMS_BY_FP8 = {False: (flux._norm, flux._residual_norm), True: (flux._norm_fp8, flux._residual_norm_fp8)}
_TEXT_FORWARDS = {fp8: _text_block_forward_of(*norms) for fp8, norms in _NORMS_BY_FP8.items()}
_VISUAL_FORWARDS = {fp8: _visual_block_forward_of(*norms) for fp8, norms in _NORMS_BY_FP8.items()}


def _eps(norm) -> float:
    """torch's RMSNorm eps; None: float32's (diffusers normalises q and k in float32)."""
    return torch.finfo(torch.float32).eps if norm.eps is None else norm.eps


class Kandinsky5QKNormRopeProcessor(patching.DitopsProcessor):
    """diffusers' Kandinsky5AttnProcessor on a self-attention with rotary tables: the per-head
    q/k RMSNorm and the interleaved RoPE as qk_norm_rope_ (table row s for token s of every
    item), q and k then rounded to bfloat16 as diffusers does. Calls without rotary tables, with
    context or sparse attention, with hooked q/k norms, or with norm weights of another dtype
    than the activations go to diffusers' processor. Attention runs through
    dispatch_attention_fn with the processor's backend and parallel config. The projections take
    a tensor or FP8 rows (quantize="fp8": self_attention_norm feeds them)."""

    bypassed = ("query_norm", "key_norm")

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None, sparse_params=None):
        if (rotary_emb is None or encoder_hidden_states is not None or sparse_params is not None
                or not patching.norms_taken(attn, self.bypassed,
                                            patching.activation_dtype(hidden_states, attn.to_query))):
            return self.defer(attn, hidden_states, encoder_hidden_states, rotary_emb, sparse_params)
        query, key, value = (projection(hidden_states).unflatten(-1, (attn.num_heads, -1))
                             for projection in (attn.to_query, attn.to_key, attn.to_value))
        rotation = rotary_emb.reshape(-1, *rotary_emb.shape[-5:])[0, :, 0]  # [S, Dh/2, 2, 2], every item's
        cache = torch.cat([rotation[..., 0, 0], rotation[..., 1, 0]], dim=-1).float()  # cos, then sin
        ops.qk_norm_rope_(query, key, attn.query_norm.weight, attn.key_norm.weight, cache, interleaved=True,
                          eps=_eps(attn.query_norm))
        if query.dtype != torch.bfloat16:
            query, key = (x.to(torch.bfloat16).type_as(x) for x in (query, key))
        return attn.out_layer(self.attention(query, key, value).flatten(-2, -1))


def _blocks_supported(block, names) -> bool:
    return all(patching.plain_layer_norm(getattr(block, name)) for name in names)


def _attention_supported(attn) -> bool:
    from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Attention, Kandinsky5AttnProcessor

    norms = (attn.query_norm, attn.key_norm)
    return (type(attn) is Kandinsky5Attention and type(attn.processor) is Kandinsky5AttnProcessor
            and _eps(attn.query_norm) == _eps(attn.key_norm)
            and all(type(norm) is torch.nn.RMSNorm and norm.weight is not None for norm in norms))


def patch(model, patches: list, report, fp8_dtype=None) -> None:
    """Patches the blocks; with ``fp8_dtype`` their Linears run FP8, fed FP8 rows by the norms
    where a block's self-attention processor is ditops' and all the Linears they feed became FP8."""
    from diffusers.models.transformers.transformer_kandinsky import (Kandinsky5TransformerDecoderBlock,
                                                                     Kandinsky5TransformerEncoderBlock)

    families = (("text_transformer_blocks", Kandinsky5TransformerEncoderBlock, _TEXT_NORMS, _TEXT_FORWARDS),
                ("visual_transformer_blocks", Kandinsky5TransformerDecoderBlock, _VISUAL_NORMS, _VISUAL_FORWARDS))
    for blocks, block_class, norms, forwards in families:
        for index, block in enumerate(getattr(model, blocks)):
            path = f"{blocks}.{index}"
            if not patching.is_block(report, block, block_class, path):
                continue
            patching.replace_processor(patches, report, block.self_attention, f"{path}.self_attention",
                                       _attention_supported(block.self_attention), Kandinsky5QKNormRopeProcessor,
                                       "qk_norm_rope_")
            if not _blocks_supported(block, norms):
                report.skipped.append(f"{path}: norms not LayerNorms without affine parameters; left as they are")
            else:
                fp8 = fp8_dtype is not None and _quantize_block(block, path, patches, report, fp8_dtype)
                if patching.replace_forward(patches, report, block, path, forwards[fp8]):
                    suffix = "_fp8" if fp8 else ""
                    report.replaced += [(f"{path}.{norms[0]}", "norm_scale_shift" + suffix)] + [
                        (f"{path}.{name}", "residual_norm_scale_shift" + (suffix if name == norms[-1] else ""))
                        for name in norms[1:]]
                    if fp8 and "cross_attention_norm" in norms:
                        report.skipped.append(f"{path}.cross_attention_norm: gives bf16 (it feeds the cross-attention, "
                                              "diffusers' processor, which takes tensors)")
            if hasattr(block, "cross_attention"):
                report.skipped.append(f"{path}.cross_attention: q/k RMSNorm without RoPE; left as it is")
    report.skipped.append("out_layer: its modulated norm over the unflattened video; left as it is")
    if fp8_dtype is not None:
        quantize.replace_rest(model, patches, report, fp8_dtype)


def _quantize_block(block, path, patches, report, fp8_dtype) -> bool:
    """The Linears the block's first and last norms feed -> FP8 (the self-attention's q/k/v, the
    FFN's in_layer); True where those norms may give them FP8 rows."""
    if not quantize.takes_rows(report, block.self_attention, Kandinsky5QKNormRopeProcessor, path):
        return False
    linears = (quantize.fed(block.self_attention, ("to_query", "to_key", "to_value"), f"{path}.self_attention")
               + quantize.fed(block.feed_forward, ("in_layer",), f"{path}.feed_forward"))
    return quantize.replace_fed(patches, report, linears, fp8_dtype, path)
