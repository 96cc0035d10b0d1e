"""The Wan family under ditops: Wan 2.1 / 2.2 (``WanTransformer3DModel``), Wan-VACE
(``WanVACETransformer3DModel``), Wan-Animate (``WanAnimateTransformer3DModel``), ChronoEdit
(``ChronoEditTransformer3DModel``), SkyReels-V2 (``SkyReelsV2Transformer3DModel``) and Helios
(``HeliosTransformer3DModel``).

Blocks are matched by what they compute, not by class name: every module of the model with
Wan's block layout (norm1, attn1, attn2, norm2, norm3, ffn, scale_shift_table) whose forward
is the code of diffusers' ``WanTransformerBlock.forward`` (ChronoEdit and Wan-Animate copy the
class into their own modules), of ``SkyReelsV2TransformerBlock.forward`` (an attention mask
and per-token [B, 6, S, D] modulation for diffusion forcing) or of
``HeliosTransformerBlock.forward`` (history tokens before the video's: with
``guidance_cross_attn`` only the last ``original_context_length`` tokens take the
cross-attention, its residual and so norm2's output). A block with that layout and
another forward (Wan-VACE's control blocks, which add input and output projections) keeps its
norms and is named in the report; its self-attention is patched where its processor is one
checked (below).

- The float32-modulated ``norm1`` -> ``norm_scale_shift``; the gated self-attention residual
  with the affine ``norm2``, and the cross-attention residual (gate 1) with ``norm3`` and its
  modulation -> ``residual_norm_scale_shift``.
- In self-attention (``attn1``, the calls with rotary tables), the q/k RMSNorm over all heads
  of a token and the interleaved RoPE -> one ``qk_norm_rope_(norm_over="token")``, on the
  cos/sin that the model's ``rope`` module hands the block: one row per token of the sequence
  the block sees (Helios: a table per batch item, read through positions; its history keys
  then take their learned scale, as diffusers'). Under context parallelism the plan splits
  those tables along the sequence together with the hidden states, so both are this shard's
  and the shard's rows start at row 0 of its table (no offset). A self-attention keeps
  diffusers' processor, named in the report with the reason, where its processor is not one
  checked, its norm_q/norm_k are not ``torch.nn.RMSNorm``s with weights of a dtype the op
  takes and one number as eps (the op takes one eps), or its heads are not ones the op takes
  (one even head size up to 512 for q and k, the norms over all of a token's heads). Calls the
  processor does not cover go to diffusers' (``WanQKNormRopeProcessor`` says which).
- The cross-attention (``attn2``: no RoPE; in I2V models also the image-context k/v) keeps its
  processor and norms.
"""

from __future__ import annotations

import types

import torch

from ... import ops, validation
from ...fp8 import Float8Rows
from . import patching, quantize


def _block_forward_of(fp8: bool):
    def forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
        """diffusers' WanTransformerBlock with the norms fused (``_modulated_block``)."""
        if patching.hooked(self, ("norm1", "norm2", "norm3")):
            return type(self).forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb)
        return _modulated_block(self, hidden_states, encoder_hidden_states, _chunks(self, temb), rotary_emb, None, fp8)

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


def _helios_block_forward_of(fp8: bool):
    def forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb, original_context_length=None):
        """diffusers' HeliosTransformerBlock with the norms fused (``_modulated_block``)."""
        if patching.hooked(self, ("norm1", "norm2", "norm3")):
            return type(self).forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb,
                                      original_context_length)
        return _modulated_block(self, hidden_states, encoder_hidden_states, _chunks(self, temb), rotary_emb, None, fp8,
                                helios_context=original_context_length)

    return forward


def _chunks(block, temb) -> list:
    """The six modulation vectors of a Wan or Helios block: [B, 1, D] each from [B, 6, D], or
    [B, S, D] from per-token modulation ([B, S, 6, D]: Wan2.2 TI2V)."""
    if temb.ndim == 4:
        return [chunk.squeeze(2) for chunk in (block.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)]
    return (block.scale_shift_table + temb.float()).chunk(6, dim=1)


_BLOCK_FORWARDS = {fp8: _block_forward_of(fp8) for fp8 in (False, True)}
_SKYREELS_BLOCK_FORWARDS = {fp8: _skyreels_block_forward_of(fp8) for fp8 in (False, True)}
_HELIOS_BLOCK_FORWARDS = {fp8: _helios_block_forward_of(fp8) for fp8 in (False, True)}


def _modulated_block(self, hidden_states, encoder_hidden_states, chunks, rotary_emb, attention_mask, fp8: bool,
                     helios_context=None):
    """A Wan block after its modulation chunks: the float32-modulated norm1 as
    norm_scale_shift, "residual + gate * self-attention, then the affine norm2" and "residual
    + cross-attention (gate 1), then norm3 and its modulation" each as one
    residual_norm_scale_shift. The modulation stays float32 next to bf16 activations. With
    ``fp8``, norm1 gives the ditops self-attention processor FP8 rows (another processor, or a
    hooked attention, gets bf16) and norm3 gives them to the FFN (bf16 where it is hooked);
    norm2 feeds the cross-attention's query in bf16.
    A Helios block (``helios_context``: its original_context_length, which its attentions
    take) with guidance_cross_attn runs the cross-attention on the last helios_context tokens
    only: norm2's output is read there, and norm3 is a norm_scale_shift after their residual."""
    shift_msa, scale_msa, gate_msa, context_shift, context_scale, context_gate = chunks
    # a hook on attn1 or the FFN (Helios's context-parallel plan splits their inputs) takes tensors
    if fp8 and type(self.attn1.processor) in _DITOPS_PROCESSORS and not patching.sees_arguments(self.attn1):
        norm_hidden_states = Float8Rows(*ops.norm_scale_shift_fp8(hidden_states, scale_msa, shift_msa,
                                                                  eps=self.norm1.eps))
    else:
        norm_hidden_states = ops.norm_scale_shift(hidden_states, scale_msa, shift_msa, eps=self.norm1.eps)
    helios = () if helios_context is None else (helios_context,)
    attention = self.attn1(norm_hidden_states, None, attention_mask, rotary_emb, *helios)
    if isinstance(self.norm2, torch.nn.Identity):
        hidden_states = (hidden_states.float() + attention * gate_msa).type_as(hidden_states)
        norm_hidden_states = hidden_states
    else:  # the affine norm2 as a residual_norm_scale_shift without modulation
        no_modulation = gate_msa.new_zeros(())
        norm_hidden_states, hidden_states = ops.residual_norm_scale_shift(
            attention, hidden_states, gate_msa, no_modulation, no_modulation, weight=self.norm2.weight,
            bias=self.norm2.bias, eps=self.norm2.eps)
    history = hidden_states.shape[1] - helios_context if helios and self.guidance_cross_attn else 0
    if history:
        norm_hidden_states = norm_hidden_states[:, history:]
    cross_attention = self.attn2(norm_hidden_states, encoder_hidden_states, None, None, *helios)
    rows = fp8 and not patching.sees_arguments(self.ffn)
    if history:
        hidden_states = torch.cat([hidden_states[:, :history], hidden_states[:, history:] + cross_attention], dim=1)
        norm = ops.norm_scale_shift_fp8 if rows else ops.norm_scale_shift
        normed = norm(hidden_states, context_scale, context_shift, eps=self.norm3.eps)  # y, or (y, y_scale)
    else:
        norm = ops.residual_norm_scale_shift_fp8 if rows else ops.residual_norm_scale_shift
        *normed, hidden_states = norm(cross_attention, hidden_states, None, context_scale, context_shift,
                                      eps=self.norm3.eps)
        normed = normed if rows else normed[0]
    norm_hidden_states = Float8Rows(*normed) if rows else normed
    feed_forward = self.ffn(norm_hidden_states)
    return (hidden_states.float() + feed_forward.float() * context_gate).type_as(hidden_states)


QK_NORM_ROPE = "qk_norm_rope_ (norm_over=token)"  # the report's op for a self-attention


class WanQKNormRopeProcessor(patching.DitopsProcessor):
    """diffusers' WanAttnProcessor for self-attention with Wan's q/k RMSNorm over all heads of a
    token and its interleaved RoPE as one qk_norm_rope_(norm_over="token"). Calls without
    rotary embeddings, with tables other than one [1, S, 1, Dh] for all batch items and heads,
    with context (cross-attention, I2V's image context) or with a hook on norm_q/norm_k go to
    the original."""

    bypassed = ("norm_q", "norm_k")

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections

        if (rotary_emb is None or rotary_emb[0].shape[0] != 1 or rotary_emb[0].shape[2] != 1
                or attn.add_k_proj is not None or encoder_hidden_states is not None
                or patching.hooked(attn, self.bypassed)):
            return self.defer(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query, key = patching.writable(query, key)  # with fused projections, chunks of one
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        cos, sin = rotary_emb  # [1, S, 1, Dh] each, every pair's value repeated (diffusers reads sin at odd columns)
        cache = torch.cat([cos[0, :, 0, 0::2], sin[0, :, 0, 1::2]], dim=1)
        if cache.dtype == torch.float64 and query.dtype != torch.float64:
            cache = cache.float()  # diffusers' float64 tables: the GPU backends take float32 caches
        # q and k as returned: under torch.compile on a GPU those are the graph's new tensors, which
        # spare the graph writing them back into the projection first (with fused to_qkv, a copy of it)
        query, key = ops.qk_norm_rope_(query, key, attn.norm_q.weight, attn.norm_k.weight, cache,
                                       eps=attn.norm_q.eps, norm_over="token")
        out = self.attention(query, key, value, attention_mask).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


class HeliosQKNormRopeProcessor(patching.DitopsProcessor):
    """diffusers' HeliosAttnProcessor for self-attention as WanQKNormRopeProcessor: Helios's
    tables are [B, S, 2 * Dh] (cos then sin, every pair's value repeated), one per batch item,
    read through positions where there is more than one; then, with is_amplify_history, the
    history keys (those before the last original_context_length tokens) times their learned
    scale. Calls with context or without tables, or with a hook on norm_q/norm_k, go to the
    original."""

    bypassed = ("norm_q", "norm_k")

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 original_context_length=None):
        from diffusers.models.transformers.transformer_helios import _get_qkv_projections

        if (rotary_emb is None or encoder_hidden_states is not None or attn.is_cross_attention
                or patching.hooked(attn, self.bypassed)):
            return self.defer(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb,
                              original_context_length)
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query, key = patching.writable(query, key)  # with fused projections, chunks of one
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        cos, sin = rotary_emb.chunk(2, dim=-1)
        cache = torch.cat([cos[..., 0::2], sin[..., 1::2]], dim=-1)  # [B, S, Dh]
        if cache.dtype == torch.float64 and query.dtype != torch.float64:
            cache = cache.float()
        batch, tokens = query.shape[:2]
        positions = None
        if cache.shape[0] == 1:
            cache = cache[0]
        else:  # row b * S + s of the flattened tables is token s of item b
            cache = cache.flatten(0, 1)
            positions = torch.arange(batch * tokens, device=query.device).view(batch, tokens)
        query, key = ops.qk_norm_rope_(query, key, attn.norm_q.weight, attn.norm_k.weight, cache, positions,
                                       eps=attn.norm_q.eps, norm_over="token")
        history = tokens - original_context_length if attn.is_amplify_history else 0
        if history > 0:
            scale = 1.0 + torch.sigmoid(attn.history_key_scale) * (attn.max_scale - 1.0)
            if attn.history_scale_mode == "per_head":
                scale = scale.view(1, 1, -1, 1)
            key = torch.cat([key[:, :history] * scale, key[:, history:]], dim=1)
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


_DITOPS_PROCESSORS = (WanQKNormRopeProcessor, HeliosQKNormRopeProcessor)


def _processors() -> dict:
    """{diffusers processor: the ditops processor computing its self-attention (no context,
    rotary tables)}, read in diffusers 0.42: Wan's, its copies in ChronoEdit and Wan-Animate,
    SkyReels-V2's (which differs only in the parallel config of cross-attention) and Helios's."""
    from diffusers.models.transformers import transformer_chronoedit, transformer_wan, transformer_wan_animate
    from diffusers.models.transformers.transformer_helios import HeliosAttnProcessor
    from diffusers.models.transformers.transformer_skyreels_v2 import SkyReelsV2AttnProcessor

    wan_like = (transformer_wan.WanAttnProcessor, transformer_chronoedit.WanAttnProcessor,
                transformer_wan_animate.WanAttnProcessor, SkyReelsV2AttnProcessor)
    return {**dict.fromkeys(wan_like, WanQKNormRopeProcessor), HeliosAttnProcessor: HeliosQKNormRopeProcessor}


def _attention_refusal(attn) -> str | None:
    """Why the self-attention ``attn`` keeps diffusers' processor, or None where the ditops
    processor _processors() names for it computes what it does."""
    if type(attn.processor) not in _processors():
        return f"processor {type(attn.processor).__name__} is not one checked"
    norms = (attn.norm_q, attn.norm_k)
    if not all(type(norm) is torch.nn.RMSNorm and norm.weight is not None for norm in norms):
        return (f"q/k norms {type(attn.norm_q).__name__}/{type(attn.norm_k).__name__}, not torch.nn.RMSNorm "
                "with weights")
    if attn.norm_q.eps is None or attn.norm_k.eps is None:
        return "q/k norms with eps=None (the activations' dtype's machine epsilon), not a number"
    if attn.norm_q.eps != attn.norm_k.eps:
        return f"q/k norms of eps {attn.norm_q.eps} and {attn.norm_k.eps}, not one eps (qk_norm_rope_ takes one)"
    width, heads = attn.inner_dim, attn.heads
    if attn.kv_inner_dim != width or width % heads:  # diffusers splits q and k into `heads` heads each
        return f"q/k widths {width}/{attn.kv_inner_dim} over {heads} heads, not one head size for q and k"
    if width // heads % 2 or not 2 <= width // heads <= validation.MAX_HEAD_SIZE:
        return f"head size {width // heads}, not an even one up to {validation.MAX_HEAD_SIZE} (qk_norm_rope_'s)"
    if any(tuple(norm.normalized_shape) != (width,) for norm in norms):
        return (f"q/k norms over {tuple(attn.norm_q.normalized_shape)}/{tuple(attn.norm_k.normalized_shape)}, "
                f"not over all {width} values of a token")
    if any(norm.weight.dtype not in validation.ACTIVATION_DTYPES for norm in norms):
        return (f"q/k norm weights of dtype {attn.norm_q.weight.dtype}/{attn.norm_k.weight.dtype}, not one "
                "qk_norm_rope_ takes")
    return None


_LAYOUT = ("norm1", "attn1", "attn2", "norm2", "norm3", "ffn", "scale_shift_table")


def _code(code) -> tuple:
    """What a code object computes, without where it was written (file, line numbers): two
    copies of one function in two modules compare equal. A block forward reads no globals
    (WanTransformerBlock's reads none), so equal code means equal computation over the same
    submodules, whose types ``patch`` checks on their own."""
    consts = tuple(_code(const) if isinstance(const, types.CodeType) else const for const in code.co_consts)
    return (code.co_code, consts, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
            code.co_argcount, code.co_kwonlyargcount, code.co_flags)


def _ditops_forwards(block):
    """The ditops forwards ({fp8: forward}) for a block with Wan's layout: by the code of its
    forward (a copy of WanTransformerBlock's in another module counts as WanTransformerBlock),
    else None."""
    from diffusers.models.transformers.transformer_helios import HeliosTransformerBlock
    from diffusers.models.transformers.transformer_skyreels_v2 import SkyReelsV2TransformerBlock
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    forward = _code(type(block).forward.__code__)
    for reference, forwards in ((WanTransformerBlock, _BLOCK_FORWARDS),
                                (SkyReelsV2TransformerBlock, _SKYREELS_BLOCK_FORWARDS),
                                (HeliosTransformerBlock, _HELIOS_BLOCK_FORWARDS)):
        if forward == _code(reference.forward.__code__):
            return forwards
    return None


def patch(model, patches: list, report, fp8_dtype=None) -> None:
    """Patches the blocks with Wan's layout; with ``fp8_dtype`` their Linears run FP8
    (``_modulated_block`` says which norms feed them FP8 rows)."""
    for path, block in list(model.named_modules()):
        if not all(hasattr(block, name) for name in _LAYOUT):
            continue
        patching.replace_processor_unless(patches, report, block.attn1, f"{path}.attn1",
                                          _attention_refusal(block.attn1),
                                          _processors().get(type(block.attn1.processor)), QK_NORM_ROPE)
        forwards = _ditops_forwards(block)
        if forwards is None:
            report.skipped.append(f"{path}: {type(block).__name__} has Wan's block layout but another forward; "
                                  "its norms stay as diffusers wrote them")
        elif not (_fp32_layer_norm(block.norm1) and _fp32_layer_norm(block.norm3) and _norm2_supported(block.norm2)):
            report.skipped.append(f"{path}: norm1/norm2/norm3 with other parameters or of another type")
        else:
            fp8 = fp8_dtype is not None and _quantize_block(block, path, patches, report, fp8_dtype)
            if patching.replace_forward(patches, report, block, path, forwards[fp8]):
                suffix = "_fp8" if fp8 else ""
                report.replaced.append((f"{path}.norm1", "norm_scale_shift" + suffix))
                if not isinstance(block.norm2, torch.nn.Identity):
                    report.replaced.append((f"{path}.norm2", "residual_norm_scale_shift"))
                norm3 = "residual_norm_scale_shift" + suffix
                if forwards is _HELIOS_BLOCK_FORWARDS and block.guidance_cross_attn:
                    norm3 += f" (norm_scale_shift{suffix} where history tokens come first)"
                report.replaced.append((f"{path}.norm3", norm3))
    if fp8_dtype is not None:
        quantize.replace_rest(model, patches, report, fp8_dtype)


def _quantize_block(block, path, patches, report, fp8_dtype) -> bool:
    """The Linears norm1 and norm3 feed -> FP8 (self-attention's q/k/v where its processor is
    ditops', the FFN with its GELU + quantisation fused); True where those norms may give FP8
    rows (norm1 only to the ditops processor: ``_modulated_block`` checks it at every call)."""
    linears = []
    if type(block.attn1.processor) in _DITOPS_PROCESSORS:
        linears = quantize.fed(block.attn1, ("to_q", "to_k", "to_v"), f"{path}.attn1")
    feed_forwards = {f"{path}.ffn": block.ffn}
    return quantize.replace_fed_with_feed_forwards(patches, report, linears, feed_forwards, fp8_dtype, path)
