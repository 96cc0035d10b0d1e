"""HiDream-I1 (``HiDreamImageTransformer2DModel``) under ditops.

- In the double-stream blocks (``HiDreamImageTransformerBlock``, image and text streams) and
  the single-stream blocks (``HiDreamImageSingleTransformerBlock``), each wrapped in a
  ``HiDreamBlock``: ``norm1_i`` / ``norm1_t`` (LayerNorm without affine parameters, ``* (1 +
  scale) + shift``) -> ``norm_scale_shift``; each "x + gate * attention, then ``norm3_i`` /
  ``norm3_t`` and its modulation" -> ``residual_norm_scale_shift``. The modulation is one [B, D]
  vector per item. The FFN's gated add (no norm follows it in the block) stays as diffusers
  wrote it.

With ``quantize="fp8"`` (quantize.py), in a block whose fed Linears all became FP8,
``norm1_i`` / ``norm1_t`` give FP8 rows (``norm_scale_shift_fp8``) to q/k/v of their stream,
through ``HiDreamFP8RowsProcessor`` (diffusers' processor reads its input's dtype and batch
size, which FP8 rows lack), and ``norm3_t`` / ``norm3_i`` (``residual_norm_scale_shift_fp8``)
to ``w1`` and ``w3`` of a dense SwiGLU FFN (``HiDreamImageFeedForwardSwiGLU``: both read the
normed rows). ``w2`` quantises its own input (quantize_fp8 has no SwiGLU). ``norm3_i`` gives
bf16 to a mixture-of-experts FFN (``MOEFeedForwardSwiGLU``, the released models' ``ff_i``):
its router (``MoEGate``) picks each token's experts by top-k over the normed rows in bf16, and
the norm ops give FP8 or bf16 rows, not both; routing on FP8 rows would send near-tied tokens
to other experts than the model does. Its shared and routed experts quantise their own input,
as do the attention outputs and the modulation. Every SwiGLU FFN, dense or expert, runs ``w1``
and ``w3`` as one FP8 GEMM (``w13``): one GEMM instead of two, and an expert's input quantised
once instead of once per projection.

Left as diffusers wrote them: the attentions' math (``HiDreamAttnProcessor``: its q/k RMSNorm
runs over all heads together, [B, S, H * Dh], not per head as ``qk_norm_rope_`` computes), the
``final_layer``'s modulated norm, blocks of another class or whose norms are not the ones
checked. diffusers 0.42 has no context-parallel plan for HiDream-I1.
"""

from __future__ import annotations

import torch

from ...fp8 import Float8Linear, Float8Rows
from . import flux, patching, quantize

_DOUBLE_NORMS = ("norm1_i", "norm1_t", "norm3_i", "norm3_t")
_SINGLE_NORMS = ("norm1_i", "norm3_i")


def _stream(self, x, modulation, attention, suffix, residual_norm):
    """One stream's "x + gate * attention, then norm3 and its modulation" as ``residual_norm``
    (flux.py's: a tensor, or FP8 rows for the FFN), then the FFN's gated add."""
    _, _, gate, shift, scale, ff_gate = modulation
    y, x = residual_norm(attention, x, gate, scale, shift, getattr(self, f"norm3_{suffix}").eps)
    return ff_gate.unsqueeze(1) * getattr(self, f"ff_{suffix}")(y) + x


def _double_block_forward_of(norm, image_residual_norm, text_residual_norm):
    def forward(self, hidden_states, hidden_states_masks=None, encoder_hidden_states=None, temb=None,
                image_rotary_emb=None):
        """diffusers' HiDreamImageTransformerBlock: norm1_i, norm1_t as ``norm`` (norm_scale_shift
        or its FP8 form), each stream's "x + gate * attention, then norm3" as its residual norm.
        With a hooked norm, diffusers' forward runs."""
        if patching.hooked(self, _DOUBLE_NORMS):
            return type(self).forward(self, hidden_states, hidden_states_masks, encoder_hidden_states, temb,
                                      image_rotary_emb)
        modulation = self.adaLN_modulation(temb).chunk(12, dim=-1)
        image, text = modulation[:6], modulation[6:]
        norm_image = norm(hidden_states, image[1], image[0], self.norm1_i.eps)
        norm_text = norm(encoder_hidden_states, text[1], text[0], self.norm1_t.eps)
        attention_image, attention_text = self.attn1(norm_image, hidden_states_masks, norm_text,
                                                     image_rotary_emb=image_rotary_emb)
        return (_stream(self, hidden_states, image, attention_image, "i", image_residual_norm),
                _stream(self, encoder_hidden_states, text, attention_text, "t", text_residual_norm))

    return forward


def _single_block_forward_of(norm, residual_norm):
    def forward(self, hidden_states, hidden_states_masks=None, encoder_hidden_states=None, temb=None,
                image_rotary_emb=None):
        """diffusers' HiDreamImageSingleTransformerBlock: norm1_i as ``norm``, "x + gate *
        attention, then norm3_i" as ``residual_norm``. With a hooked norm, diffusers' forward runs."""
        if patching.hooked(self, _SINGLE_NORMS):
            return type(self).forward(self, hidden_states, hidden_states_masks, encoder_hidden_states, temb,
                                      image_rotary_emb)
        modulation = self.adaLN_modulation(temb).chunk(6, dim=-1)
        normed = norm(hidden_states, modulation[1], modulation[0], self.norm1_i.eps)
        attention = self.attn1(normed, hidden_states_masks, image_rotary_emb=image_rotary_emb)
        return _stream(self, hidden_states, modulation, attention, "i", residual_norm)

    return forward


# Keyed by (norm1 and the text stream's norm3 give FP8 rows, the image stream's norm3 does):
# the image FFN may be a mixture of experts, fed bf16.
_BF16, _FP8 = (flux._norm, flux._residual_norm), (flux._norm_fp8, flux._residual_norm_fp8)
_DOUBLE_FORWARDS = {(False, False): _double_block_forward_of(_BF16[0], _BF16[1], _BF16[1]),
                    (True, False): _double_block_forward_of(_FP8[0], _BF16[1], _FP8[1]),
                    (True, True): _double_block_forward_of(_FP8[0], _FP8[1], _FP8[1])}
_SINGLE_FORWARDS = {(False, False): _single_block_forward_of(*_BF16),
                    (True, False): _single_block_forward_of(_FP8[0], _BF16[1]),
                    (True, True): _single_block_forward_of(*_FP8)}


def _projections(attn, rows, suffix, masks):
    """One stream's q and k (each RMSNorm'd, k masked) and v, [B, S, H, Dh], as diffusers'
    HiDreamAttnProcessor computes them, from FP8 rows."""
    query = getattr(attn, f"q_rms_norm{suffix}")(getattr(attn, f"to_q{suffix}")(rows)).to(attn.to_q.out_dtype)
    key = getattr(attn, f"k_rms_norm{suffix}")(getattr(attn, f"to_k{suffix}")(rows)).to(attn.to_q.out_dtype)
    query, key, value = (t.unflatten(-1, (attn.heads, -1)) for t in (query, key, getattr(attn, f"to_v{suffix}")(rows)))
    return query, key if masks is None else key * masks, value


class HiDreamFP8RowsProcessor(patching.DitopsProcessor):
    """diffusers' HiDreamAttnProcessor on FP8 rows (quantize="fp8": norm1_i and norm1_t give
    them to the FP8 q/k/v): the same computation, in the dtype the projections give. A call
    with tensors (a hooked norm sends the block to diffusers' forward) or with extra arguments
    goes to diffusers' processor."""

    def __call__(self, attn, hidden_states, hidden_states_masks=None, encoder_hidden_states=None,
                 image_rotary_emb=None, *args, **kwargs):
        if not isinstance(hidden_states, Float8Rows) or args or kwargs:
            return self.defer(attn, hidden_states, hidden_states_masks, encoder_hidden_states, image_rotary_emb,
                              *args, **kwargs)
        from diffusers.models.transformers.transformer_hidream_image import apply_rope

        masks = None if hidden_states_masks is None else hidden_states_masks.view(hidden_states.data.shape[0], -1, 1, 1)
        query, key, value = _projections(attn, hidden_states, "", masks)
        image_tokens = query.shape[1]
        if not attn.single:
            text = _projections(attn, encoder_hidden_states, "_t", None)
            query, key, value = (torch.cat(pair, dim=1) for pair in zip((query, key, value), text))
        if query.shape[-1] == image_rotary_emb.shape[-3] * 2:
            query, key = apply_rope(query, key, image_rotary_emb)
        else:  # tables for the first half of each head
            (query_1, query_2), (key_1, key_2) = query.chunk(2, dim=-1), key.chunk(2, dim=-1)
            query_1, key_1 = apply_rope(query_1, key_1, image_rotary_emb)
            query, key = torch.cat([query_1, query_2], dim=-1), torch.cat([key_1, key_2], dim=-1)
        out = torch.nn.functional.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2),
                                                               value.transpose(1, 2), dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).flatten(2, 3).to(query.dtype)
        if attn.single:
            return attn.to_out(out)
        return attn.to_out(out[:, :image_tokens]), attn.to_out_t(out[:, image_tokens:])


def _swiglu_ffn(ff) -> bool:
    from diffusers.models.transformers.transformer_hidream_image import HiDreamImageFeedForwardSwiGLU

    return type(ff) is HiDreamImageFeedForwardSwiGLU


def patch(model, patches: list, report, fp8_dtype=None) -> None:
    """Patches the blocks; with ``fp8_dtype`` their Linears run FP8, fed FP8 rows by the norms
    where all the Linears a block's norms feed became FP8 (``_quantize_block``)."""
    from diffusers.models.transformers.transformer_hidream_image import (HiDreamBlock,
                                                                         HiDreamImageSingleTransformerBlock,
                                                                         HiDreamImageTransformerBlock)

    families = (("double_stream_blocks", HiDreamImageTransformerBlock, _DOUBLE_NORMS, _DOUBLE_FORWARDS),
                ("single_stream_blocks", HiDreamImageSingleTransformerBlock, _SINGLE_NORMS, _SINGLE_FORWARDS))
    for blocks, block_class, norms, forwards in families:
        for index, wrapper in enumerate(getattr(model, blocks)):
            path = f"{blocks}.{index}.block"
            block = wrapper.block if type(wrapper) is HiDreamBlock else wrapper
            if not patching.is_block(report, block, block_class, path):
                continue
            if not all(patching.plain_layer_norm(getattr(block, name)) for name in norms):
                report.skipped.append(f"{path}: norms not LayerNorms without affine parameters; left as they are")
            else:
                fp8 = fp8_dtype is not None and _quantize_block(block, path, patches, report, fp8_dtype)
                fed = {"norm1_i": fp8, "norm1_t": fp8, "norm3_t": fp8, "norm3_i": fp8 and _swiglu_ffn(block.ff_i)}
                if patching.replace_forward(patches, report, block, path, forwards[fp8, fed["norm3_i"]]):
                    report.replaced += [(f"{path}.{name}", ("norm_scale_shift" if name.startswith("norm1")
                                                            else "residual_norm_scale_shift") + "_fp8" * fed[name])
                                        for name in norms]
            report.skipped.append(f"{path}.attn1: q/k RMSNorm over all heads together, not per head; left as it is")
    report.skipped.append("final_layer: its modulated norm; left as it is")
    if fp8_dtype is not None:
        quantize.replace_rest(model, patches, report, fp8_dtype)
        _join_swiglu_up_projections(model, patches, report)


def _swiglu_forward(self, x):
    """diffusers' HiDreamImageFeedForwardSwiGLU with w1 and w3 as one FP8 GEMM (``w13``): rows
    that come as a tensor (the experts' and shared experts' input) are quantised once, not once
    per projection. With a hook on w1 or w3, diffusers' forward runs."""
    if patching.hooked(self, ("w1", "w3")):
        return type(self).forward(self, x)
    gate, up = self.w13(x).chunk(2, dim=-1)
    return self.w2(torch.nn.functional.silu(gate) * up)


def _join_swiglu_up_projections(model, patches, report) -> None:
    """Every SwiGLU FFN of the model whose w1 and w3 became FP8 (dense FFNs, routed and shared
    experts) -> one GEMM for both, which read the same rows."""
    for path, ff in model.named_modules():
        if (_swiglu_ffn(ff) and all(type(getattr(ff, name)) is Float8Linear for name in ("w1", "w3"))
                and quantize.join(patches, report, ff, path, "w13", ("w1", "w3"))):
            patching.replace_forward(patches, report, ff, path, _swiglu_forward)


def _quantize_block(block, path, patches, report, fp8_dtype) -> bool:
    """The Linears the block's norms feed -> FP8 (q/k/v of each stream; w1 and w3 of each dense
    FFN), and the attention -> HiDreamFP8RowsProcessor; True where the norms may give FP8 rows
    (norm3_i only to a dense FFN: the module's docstring says why)."""
    from diffusers.models.transformers.transformer_hidream_image import HiDreamAttention, HiDreamAttnProcessor

    attn = block.attn1
    if type(attn) is not HiDreamAttention or type(attn.processor) is not HiDreamAttnProcessor:
        report.skipped.append(f"{path}: its norms give bf16 (attn1's processor is not diffusers' HiDreamAttnProcessor)")
        return False
    streams = ("i",) if attn.single else ("i", "t")
    linears = [linear for stream, suffix in zip(streams, ("", "_t"))
               for linear in quantize.fed(attn, tuple(f"to_{name}{suffix}" for name in "qkv"), f"{path}.attn1")]
    for stream in streams:
        ff = getattr(block, f"ff_{stream}")
        if _swiglu_ffn(ff):
            linears += quantize.fed(ff, ("w1", "w3"), f"{path}.ff_{stream}")
        else:
            report.skipped.append(f"{path}.norm3_{stream}: gives bf16 (ff_{stream} is a {type(ff).__name__}: its "
                                  "router picks experts by top-k over the normed rows in bf16); its experts quantise "
                                  "their own input")
    if not quantize.replace_fed(patches, report, linears, fp8_dtype, path):
        return False
    patching.replace_processor(patches, report, attn, f"{path}.attn1", True, HiDreamFP8RowsProcessor,
                               "q/k/v fed FP8 rows")
    return True
