"""The Wan family under ditops: Wan 2.1 / 2.2 (``WanTransformer3DModel``), Wan-VACE
(``WanVACETransformer3DModel``), Wan-Animate (``WanAnimateTransformer3DModel``), ChronoEdit
(``ChronoEditTransformer3DModel``) and SkyReels-V2 (``SkyReelsV2Transformer3DModel``).

Blocks are matched by what they compute, not by class name: every module of the model with
Wan's block layout (norm1, attn1, attn2, norm2, norm3, ffn, scale_shift_table) whose forward
is the code of diffusers' ``WanTransformerBlock.forward`` (ChronoEdit and Wan-Animate copy the
class into their own modules) or of ``SkyReelsV2TransformerBlock.forward`` (an attention mask
and per-token [B, 6, S, D] modulation for diffusion forcing). A block with that layout and
another forward (Wan-VACE's control blocks, which add input and output projections) keeps its
norms and is named in the report; its self-attention is patched where its processor is one
checked (below).

- The float32-modulated ``norm1`` -> ``norm_scale_shift``; the gated self-attention residual
  with the affine ``norm2``, and the cross-attention residual (gate 1) with ``norm3`` and its
  modulation -> ``residual_norm_scale_shift``.
- In self-attention, the q/k RMSNorm across all heads -> ``norm_scale_shift`` (norm="rms", no
  modulation) and the RoPE -> ``rope_``, on the cos/sin that the model's ``rope`` module hands
  the block: one row per token of the sequence the block sees. Under context parallelism the
  plan splits those outputs along the sequence together with ``blocks.0``'s hidden states, so
  both are this shard's and the shard's rows start at row 0 of its table (no offset).
"""

from __future__ import annotations

import types

import torch

from ... import ops
from ...fp8 import Float8Rows
from . import patching, quantize


def _block_forward_of(fp8: bool):
    def forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
        """diffusers' WanTransformerBlock with the norms fused (``_modulated_block``)."""
        if patching.hooked(self, ("norm1", "norm2", "norm3")):
            return type(self).forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb)
        if temb.ndim == 4:  # Wan2.2 TI2V: per-token modulation [B, S, 6, D]
            chunks = (self.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
            chunks = [chunk.squeeze(2) for chunk in chunks]
        else:  # [B, 6, D]: one [B, 1, D] vector per batch item
            chunks = (self.scale_shift_table + temb.float()).chunk(6, dim=1)
        return _modulated_block(self, hidden_states, encoder_hidden_states, chunks, rotary_emb, None, fp8)

    return forward


def _skyreels_block_forward_of(fp8: bool):
    def forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb, attention_mask):
        """diffusers' SkyReelsV2TransformerBlock with the norms fused (``_modulated_block``); its
        self-attention takes the diffusion-forcing attention mask."""
        if patching.hooked(self, ("norm1", "norm2", "norm3")):
            return type(self).forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb, attention_mask)
        if temb.ndim == 4:  # diffusion forcing: per-token modulation [B, 6, S, D]
            chunks = [chunk.squeeze(1) for chunk in (self.scale_shift_table.unsqueeze(2) + temb.float()).chunk(6, dim=1)]
        else:  # [B, 6, D]
            chunks = (self.scale_shift_table + temb.float()).chunk(6, dim=1)
        return _modulated_block(self, hidden_states, encoder_hidden_states, chunks, rotary_emb, attention_mask, fp8)

    return forward


_block_forward, _skyreels_block_forward = _block_forward_of(False), _skyreels_block_forward_of(False)
_FP8_FORWARDS = {_block_forward: _block_forward_of(True), _skyreels_block_forward: _skyreels_block_forward_of(True)}


def _modulated_block(self, hidden_states, encoder_hidden_states, chunks, rotary_emb, attention_mask, fp8: bool):
    """A Wan block after its modulation chunks: the float32-modulated norm1 as
    norm_scale_shift, "residual + gate * self-attention, then the affine norm2" and "residual
    + cross-attention (gate 1), then norm3 and its modulation" each as one
    residual_norm_scale_shift. The modulation stays float32 next to bf16 activations. With
    ``fp8``, norm1 gives the ditops self-attention processor FP8 rows (another processor gets
    bf16) and norm3 gives them to the FFN; norm2 feeds the cross-attention's query in bf16."""
    shift_msa, scale_msa, gate_msa, context_shift, context_scale, context_gate = chunks
    if fp8 and type(self.attn1.processor) is WanNormRopeProcessor:
        norm_hidden_states = Float8Rows(*ops.norm_scale_shift_fp8(hidden_states, scale_msa, shift_msa,
                                                                  eps=self.norm1.eps))
    else:
        norm_hidden_states = ops.norm_scale_shift(hidden_states, scale_msa, shift_msa, eps=self.norm1.eps)
    attention = self.attn1(norm_hidden_states, None, attention_mask, rotary_emb)
    if isinstance(self.norm2, torch.nn.Identity):
        hidden_states = (hidden_states.float() + attention * gate_msa).type_as(hidden_states)
        norm_hidden_states = hidden_states
    else:  # the affine norm2 as a residual_norm_scale_shift without modulation
        no_modulation = gate_msa.new_zeros(())
        norm_hidden_states, hidden_states = ops.residual_norm_scale_shift(
            attention, hidden_states, gate_msa, no_modulation, no_modulation, weight=self.norm2.weight,
            bias=self.norm2.bias, eps=self.norm2.eps)
    cross_attention = self.attn2(norm_hidden_states, encoder_hidden_states, None, None)
    if fp8:
        y, y_scale, hidden_states = ops.residual_norm_scale_shift_fp8(
            cross_attention, hidden_states, None, context_scale, context_shift, eps=self.norm3.eps)
        norm_hidden_states = Float8Rows(y, y_scale)
    else:
        norm_hidden_states, hidden_states = ops.residual_norm_scale_shift(
            cross_attention, hidden_states, None, context_scale, context_shift, eps=self.norm3.eps)
    feed_forward = self.ffn(norm_hidden_states)
    return (hidden_states.float() + feed_forward.float() * context_gate).type_as(hidden_states)


class WanNormRopeProcessor(patching.DitopsProcessor):
    """diffusers' WanAttnProcessor for self-attention with Wan's q/k RMSNorm across all heads
    as norm_scale_shift (norm="rms", no modulation) and its interleaved RoPE as rope_ on q and
    k. Calls without rotary embeddings, with tables other than one [1, S, 1, Dh] for all batch
    items and heads, or with context (cross-attention) go to the original."""

    bypassed = ("norm_q", "norm_k")

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections

        if (rotary_emb is None or rotary_emb[0].shape[0] != 1 or rotary_emb[0].shape[2] != 1
                or attn.add_k_proj is not None or encoder_hidden_states is not None
                or patching.hooked(attn, self.bypassed)):
            return self.defer(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        no_modulation = query.new_zeros(())
        query, key = (ops.norm_scale_shift(t, no_modulation, no_modulation, weight=norm.weight, norm="rms", eps=norm.eps)
                      for t, norm in ((query, attn.norm_q), (key, attn.norm_k)))
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        cos, sin = rotary_emb  # [1, S, 1, Dh] each, every pair's value repeated (diffusers reads sin at odd columns)
        cache = torch.cat([cos[0, :, 0, 0::2], sin[0, :, 0, 1::2]], dim=1)
        ops.rope_(query, key, cache if cache.dtype != torch.float64 else cache.float())
        out = self.attention(query, key, value, attention_mask).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _fp32_layer_norm(norm) -> bool:
    from diffusers.models.normalization import FP32LayerNorm

    return type(norm) is FP32LayerNorm and norm.weight is None and norm.bias is None


def _norm2_supported(norm) -> bool:
    """Identity (cross_attn_norm=False) or an affine FP32LayerNorm."""
    from diffusers.models.normalization import FP32LayerNorm

    return type(norm) is torch.nn.Identity or (type(norm) is FP32LayerNorm and norm.weight is not None
                                                 and norm.bias is not None)


def _processors() -> tuple:
    """The processors whose self-attention (no context, rotary tables) computes what
    WanAttnProcessor's does, read in diffusers 0.42: Wan's, its copies in ChronoEdit and
    Wan-Animate, and SkyReels-V2's (which differs only in the parallel config of cross-attention)."""
    from diffusers.models.transformers import transformer_chronoedit, transformer_wan, transformer_wan_animate
    from diffusers.models.transformers.transformer_skyreels_v2 import SkyReelsV2AttnProcessor

    return (transformer_wan.WanAttnProcessor, transformer_chronoedit.WanAttnProcessor,
            transformer_wan_animate.WanAttnProcessor, SkyReelsV2AttnProcessor)


def _attention_supported(attn) -> bool:
    return type(attn.processor) in _processors() and all(
        type(norm) is torch.nn.RMSNorm and norm.weight is not None and norm.eps is not None
        for norm in (attn.norm_q, attn.norm_k))


_LAYOUT = ("norm1", "attn1", "attn2", "norm2", "norm3", "ffn", "scale_shift_table")


def _code(code) -> tuple:
    """What a code object computes, without where it was written (file, line numbers): two
    copies of one function in two modules compare equal. A block forward reads no globals
    (WanTransformerBlock's reads none), so equal code means equal computation over the same
    submodules, whose types ``patch`` checks on their own."""
    consts = tuple(_code(const) if isinstance(const, types.CodeType) else const for const in code.co_consts)
    return (code.co_code, consts, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
            code.co_argcount, code.co_kwonlyargcount, code.co_flags)


def _ditops_forward(block):
    """The ditops forward for a block with Wan's layout: by the code of its forward (a copy of
    WanTransformerBlock's in another module counts as WanTransformerBlock), else None."""
    from diffusers.models.transformers.transformer_skyreels_v2 import SkyReelsV2TransformerBlock
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    forward = _code(type(block).forward.__code__)
    for reference, ditops_forward in ((WanTransformerBlock, _block_forward),
                                      (SkyReelsV2TransformerBlock, _skyreels_block_forward)):
        if forward == _code(reference.forward.__code__):
            return ditops_forward
    return None


def patch(model, patches: list, report, fp8_dtype=None) -> None:
    """Patches the blocks with Wan's layout; with ``fp8_dtype`` their Linears run FP8
    (``_modulated_block`` says which norms feed them FP8 rows)."""
    for path, block in list(model.named_modules()):
        if not all(hasattr(block, name) for name in _LAYOUT):
            continue
        patching.replace_processor(patches, report, block.attn1, f"{path}.attn1", _attention_supported(block.attn1),
                                   WanNormRopeProcessor, "norm_scale_shift (rms), rope_")
        forward = _ditops_forward(block)
        if forward is None:
            report.skipped.append(f"{path}: {type(block).__name__} has Wan's block layout but another forward; "
                                  "its norms stay as diffusers wrote them")
        elif not (_fp32_layer_norm(block.norm1) and _fp32_layer_norm(block.norm3) and _norm2_supported(block.norm2)):
            report.skipped.append(f"{path}: norm1/norm2/norm3 with other parameters or of another type")
        else:
            fp8 = fp8_dtype is not None and _quantize_block(block, path, patches, report, fp8_dtype)
            if patching.replace_forward(patches, report, block, path, _FP8_FORWARDS[forward] if fp8 else forward):
                suffix = "_fp8" if fp8 else ""
                report.replaced.append((f"{path}.norm1", "norm_scale_shift" + suffix))
                if not isinstance(block.norm2, torch.nn.Identity):
                    report.replaced.append((f"{path}.norm2", "residual_norm_scale_shift"))
                report.replaced.append((f"{path}.norm3", "residual_norm_scale_shift" + suffix))
    if fp8_dtype is not None:
        quantize.replace_rest(model, patches, report, fp8_dtype)


def _quantize_block(block, path, patches, report, fp8_dtype) -> bool:
    """The Linears norm1 and norm3 feed -> FP8 (self-attention's q/k/v where its processor is
    ditops', the FFN with its GELU + quantisation fused); True where those norms may give FP8
    rows (norm1 only to the ditops processor: ``_modulated_block`` checks it at every call)."""
    linears = []
    if type(block.attn1.processor) is WanNormRopeProcessor:
        linears = quantize.fed(block.attn1, ("to_q", "to_k", "to_v"), f"{path}.attn1")
    feed_forwards = {f"{path}.ffn": block.ffn}
    return quantize.replace_fed_with_feed_forwards(patches, report, linears, feed_forwards, fp8_dtype, path)
