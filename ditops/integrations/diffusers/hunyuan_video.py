"""The HunyuanVideo family under ditops: HunyuanVideo 1.0 (``HunyuanVideoTransformer3DModel``),
Framepack (``HunyuanVideoFramepackTransformer3DModel``, 1.0's blocks), HunyuanVideo 1.5
(``HunyuanVideo15TransformerBlock``, whose forward is 1.0's double block's code) and
HunyuanImage 2.1 (``HunyuanImageTransformer2DModel``: 1.0's blocks and processor, copied).

Double blocks are matched by the code of their forward (read in diffusers 0.42: 1.0's, 1.5's and
HunyuanImage's compute the same, HunyuanImage's under another argument name); a double block with
another forward (1.0's image-to-video ``token_replace`` blocks: the first frame's tokens get their
own modulation) keeps it and is named in the report; its plain ``AdaLayerNormZero`` and its
attention are still patched.

- ``AdaLayerNormZero`` (``norm1``, ``norm1_context``) and ``AdaLayerNormZeroSingle`` (single
  blocks' ``norm``) -> ``norm_scale_shift`` (FLUX's forwards, flux.py; [B, D] chunk views).
- In double blocks, "residual + gate * attention, then ``norm2`` and its modulation" on each
  stream -> ``residual_norm_scale_shift``.
- In attention, the per-head q/k RMSNorm (diffusers' RMSNorm) and the interleaved RoPE of the
  video/image tokens -> ``qk_norm_rope_`` on the cos/sin the model hands the block (one row per
  video token: ``patching.cos_sin_cache``); the text tokens, which diffusers does not rotate,
  get the RMSNorm alone as ``norm_scale_shift`` (norm="rms", no modulation). Double blocks
  normalise text with ``norm_added_q/k``; single blocks (text rows after the video rows of one
  joint projection) with ``norm_q/k``. 1.5's processor builds its [B, 1, S, S] mask from the text
  mask as diffusers does. Calls without rotary embeddings or text, with hooked q/k norms, or
  with norm weights of another dtype than the activations (diffusers' RMSNorm then returns the
  weights' dtype) go to diffusers' processor.

With ``quantize="fp8"`` (quantize.py) a double block's norms give FP8 rows
(``norm_scale_shift_fp8``, ``residual_norm_scale_shift_fp8``) to q/k/v of both streams and to
the GELU MLPs, whose GELU and quantisation are one ``quantize_fp8``, where every norm of the
block is patched and its processor is ditops'. A single block's norm gives FP8 rows of its
video and text tokens to ``proj_mlp`` and, sliced as diffusers slices them, to q/k/v; its
``proj_out`` input [attention output, GELU(MLP)] is one ``quantize_fp8``, as in FLUX's single
blocks.

Left as diffusers wrote them: the text token refiner (``context_embedder``: affine LayerNorms
over the text tokens, once per step), the output ``norm_out``, the single blocks' gated
``proj_out`` (no norm follows it), and the ``token_replace`` norms (a per-token choice of two
modulations over the first frame's tokens). diffusers 0.42 has no context-parallel plan for
these models.
"""

from __future__ import annotations

import torch

from ... import ops
from ...fp8 import Float8Rows
from . import flux, patching, quantize, wan

_NORM2S = ("norm2", "norm2_context")


def _modulated_block(self, hidden_states, encoder_hidden_states, temb, attention_mask, rotary_emb, residual_norm):
    """diffusers' HunyuanVideoTransformerBlock after the hook check: each "residual + gate *
    attention, then norm2 and its modulation" as one ``residual_norm`` (flux.py's: a tensor, or
    FP8 rows for the MLP)."""
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
    norm_context, context_gate_msa, context_shift_mlp, context_scale_mlp, context_gate_mlp = self.norm1_context(
        encoder_hidden_states, emb=temb)
    attention, context_attention = self.attn(hidden_states=norm_hidden_states, encoder_hidden_states=norm_context,
                                             attention_mask=attention_mask, image_rotary_emb=rotary_emb)
    norm_hidden_states, hidden_states = residual_norm(attention, hidden_states, gate_msa, scale_mlp, shift_mlp,
                                                      self.norm2.eps)
    norm_context, encoder_hidden_states = residual_norm(context_attention, encoder_hidden_states, context_gate_msa,
                                                        context_scale_mlp, context_shift_mlp, self.norm2_context.eps)
    ff_output, context_ff_output = self.ff(norm_hidden_states), self.ff_context(norm_context)
    hidden_states = hidden_states + gate_mlp.unsqueeze(1) * ff_output
    encoder_hidden_states = encoder_hidden_states + context_gate_mlp.unsqueeze(1) * context_ff_output
    return hidden_states, encoder_hidden_states


def _block_forward_of(residual_norm):
    def forward(self, hidden_states, encoder_hidden_states, temb, attention_mask=None, freqs_cis=None, *args, **kwargs):
        """diffusers' HunyuanVideoTransformerBlock / HunyuanVideo15TransformerBlock (``_modulated_block``)."""
        if patching.hooked(self, _NORM2S):
            return type(self).forward(self, hidden_states, encoder_hidden_states, temb, attention_mask, freqs_cis,
                                      *args, **kwargs)
        return _modulated_block(self, hidden_states, encoder_hidden_states, temb, attention_mask, freqs_cis,
                                residual_norm)

    return forward


def _image_block_forward_of(residual_norm):
    def forward(self, hidden_states, encoder_hidden_states, temb, attention_mask=None, image_rotary_emb=None,
                *args, **kwargs):
        """diffusers' HunyuanImageTransformerBlock: 1.0's block, the rotary tables under another name."""
        if patching.hooked(self, _NORM2S):
            return type(self).forward(self, hidden_states, encoder_hidden_states, temb, attention_mask,
                                      image_rotary_emb, *args, **kwargs)
        return _modulated_block(self, hidden_states, encoder_hidden_states, temb, attention_mask, image_rotary_emb,
                                residual_norm)

    return forward


# the double blocks' forwards by (diffusers' block class whose forward's code they take, FP8 norms)
_BLOCK_FORWARDS = {False: (_block_forward_of(flux._residual_norm), _image_block_forward_of(flux._residual_norm)),
                   True: (_block_forward_of(flux._residual_norm_fp8), _image_block_forward_of(flux._residual_norm_fp8))}


def _rms(x, norm):
    """diffusers' RMSNorm over head_dim of [B, S, H, Dh] as norm_scale_shift on its [B, S*H, Dh] view."""
    no_modulation = x.new_zeros(())
    return ops.norm_scale_shift(x.flatten(1, 2), no_modulation, no_modulation, weight=norm.weight, norm="rms",
                                eps=norm.eps).view(x.shape)


def _joined(video, text):
    """The video rows, then the text rows: tensors, or FP8 rows (a single block's FP8 norm) with
    their scales."""
    if isinstance(video, Float8Rows):
        return Float8Rows(*(torch.cat(parts, dim=1) for parts in zip(video, text)))
    return torch.cat([video, text], dim=1)


def _tokens(rows: Float8Rows, start, stop) -> Float8Rows:
    """Tokens [start, stop) of FP8 rows [B, S, D] and their scales [B, S, 1] (views)."""
    return Float8Rows(rows.data[:, start:stop], rows.scale[:, start:stop])


def _single_block_forward_fp8(self, hidden_states, encoder_hidden_states, temb, attention_mask=None,
                              image_rotary_emb=None, *args, **kwargs):
    """diffusers' HunyuanVideoSingleTransformerBlock with FP8 GEMMs: the norm's FP8 rows of the
    video and text tokens feed proj_mlp and, as diffusers slices them, the attention's q/k/v;
    proj_out's input [attention output, GELU(MLP)] is quantised by one quantize_fp8 (as FLUX's
    single block's, flux.single_block_output_fp8), never concatenated in bf16."""
    if self.training or patching.hooked(self, ("act_mlp",)):
        return type(self).forward(self, hidden_states, encoder_hidden_states, temb, attention_mask, image_rotary_emb,
                                  *args, **kwargs)
    text = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)
    residual = hidden_states
    rows, gate = self.norm(hidden_states, emb=temb)
    mlp_hidden_states = self.proj_mlp(rows)
    attention, context_attention = self.attn(hidden_states=_tokens(rows, None, -text),
                                             encoder_hidden_states=_tokens(rows, -text, None),
                                             attention_mask=attention_mask, image_rotary_emb=image_rotary_emb)
    rows = Float8Rows(*ops.quantize_fp8(mlp_hidden_states, activation="gelu_tanh",
                                        prefix=torch.cat([attention, context_attention], dim=1)))
    hidden_states = gate.unsqueeze(1) * self.proj_out(rows) + residual
    return hidden_states[:, :-text], hidden_states[:, -text:]


def _heads(attn, projections, states):
    return (getattr(attn, name)(states).unflatten(2, (attn.heads, -1)) for name in projections)


class HunyuanVideoQKNormRopeProcessor(patching.DitopsProcessor):
    """diffusers' HunyuanVideoAttnProcessor2_0 (and HunyuanImageAttnProcessor, the same code)
    with the q/k RMSNorm + RoPE of the video tokens as qk_norm_rope_ and the text tokens' RMSNorm
    as norm_scale_shift (norm="rms"). The module docstring says which calls go to the original."""

    bypassed = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        single = attn.add_q_proj is None  # a single block: one projection of the video rows, then the text rows
        bypassed = self.bypassed[:2] if single else self.bypassed
        if (image_rotary_emb is None or encoder_hidden_states is None or self._unsupported_mask(attention_mask)
                or not patching.norms_taken(attn, bypassed, patching.activation_dtype(hidden_states, attn.to_q))):
            return self.defer(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        cache = patching.cos_sin_cache(*image_rotary_emb)
        if single:
            text = patching.batch_and_tokens(encoder_hidden_states)[1]
            query, key, value = _heads(attn, ("to_q", "to_k", "to_v"), _joined(hidden_states, encoder_hidden_states))
            # with grad, copies: autograd saves the text rows for their norm's backward, and the
            # write below into views of the same projection would invalidate them
            video_query, video_key = patching.writable(query[:, :-text], key[:, :-text])
            text_query, text_key = _rms(query[:, -text:], attn.norm_q), _rms(key[:, -text:], attn.norm_k)
        else:
            video_query, video_key, video_value = _heads(attn, ("to_q", "to_k", "to_v"), hidden_states)
            text_query, text_key, text_value = _heads(attn, ("add_q_proj", "add_k_proj", "add_v_proj"),
                                                      encoder_hidden_states)
            text = text_query.shape[1]
            text_query, text_key = _rms(text_query, attn.norm_added_q), _rms(text_key, attn.norm_added_k)
            value = torch.cat([video_value, text_value], dim=1)
        # in place on the video rows (in a single block, views of the joint projection without grad)
        ops.qk_norm_rope_(video_query, video_key, attn.norm_q.weight, attn.norm_k.weight, cache, eps=attn.norm_q.eps)
        query = torch.cat([video_query, text_query], dim=1)
        key = torch.cat([video_key, text_key], dim=1)
        out = self.attention(query, key, value, self._mask(attention_mask, query)).flatten(2, 3).to(query.dtype)
        out, context_out = out[:, :-text], out[:, -text:]
        if getattr(attn, "to_out", None) is not None:
            out = attn.to_out[1](attn.to_out[0](out))
        if getattr(attn, "to_add_out", None) is not None:
            context_out = attn.to_add_out(context_out)
        return out, context_out

    def _unsupported_mask(self, attention_mask) -> bool:
        return False

    def _mask(self, attention_mask, query):
        return attention_mask


class HunyuanVideo15QKNormRopeProcessor(HunyuanVideoQKNormRopeProcessor):
    """diffusers' HunyuanVideo15AttnProcessor2_0: 1.0's double-block attention, with the
    [B, 1, S, S] mask diffusers builds from the [B, text] mask (video rows kept, text rows and
    columns as the mask says). A call without a mask goes to the original (where it fails)."""

    def _unsupported_mask(self, attention_mask) -> bool:
        return attention_mask is None

    def _mask(self, attention_mask, query):
        batch_size, seq_len = query.shape[:2]
        attention_mask = torch.nn.functional.pad(attention_mask, (seq_len - attention_mask.shape[1], 0), value=True)
        rows = attention_mask.bool().view(batch_size, 1, 1, seq_len).repeat(1, 1, seq_len, 1)
        return rows & rows.transpose(2, 3)


def _processors() -> dict:
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
    from diffusers.models.transformers.transformer_hunyuanimage import HunyuanImageAttnProcessor

    return {HunyuanVideoAttnProcessor2_0: HunyuanVideoQKNormRopeProcessor,
            HunyuanImageAttnProcessor: HunyuanVideoQKNormRopeProcessor,
            HunyuanVideo15AttnProcessor2_0: HunyuanVideo15QKNormRopeProcessor}


def _norms_supported(attn) -> bool:
    from diffusers.models.normalization import RMSNorm

    names = ("norm_q", "norm_k") + (() if attn.add_q_proj is None else ("norm_added_q", "norm_added_k"))
    return all(type(getattr(attn, name)) is RMSNorm and getattr(attn, name).weight is not None
               and getattr(attn, name).bias is None for name in names) and attn.norm_q.eps == attn.norm_k.eps


def _ditops_forward(block, fp8: bool):
    """The ditops forward (its FP8 form: its residual norms give FP8 rows) for a double block
    whose forward is the code of 1.0's (1.5's is the same code) or of HunyuanImage's, else None."""
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoTransformerBlock
    from diffusers.models.transformers.transformer_hunyuanimage import HunyuanImageTransformerBlock

    forward = wan._code(type(block).forward.__code__)
    for reference, ditops_forward in zip((HunyuanVideoTransformerBlock, HunyuanImageTransformerBlock),
                                         _BLOCK_FORWARDS[fp8]):
        if forward == wan._code(reference.forward.__code__):
            return ditops_forward
    return None


def _norm_supported(norm, norm_class) -> bool:
    return type(norm) is norm_class and patching.plain_layer_norm(norm.norm)


def _patch_norm(patches, report, block, path, name, norm_class, forward, op="norm_scale_shift") -> None:
    norm = getattr(block, name)
    if not _norm_supported(norm, norm_class):
        report.skipped.append(f"{path}.{name}: {type(norm).__name__}, not {norm_class.__name__} over a LayerNorm "
                              "without affine parameters; left as it is")
    elif patching.replace_forward(patches, report, norm, f"{path}.{name}", forward):
        report.replaced.append((f"{path}.{name}", op))


def _patch_attention(patches, report, block, path) -> None:
    processor = _processors().get(type(block.attn.processor))
    patching.replace_processor(patches, report, block.attn, f"{path}.attn",
                               processor is not None and _norms_supported(block.attn), processor,
                               "qk_norm_rope_, norm_scale_shift (rms)")


def patch(model, patches: list, report, fp8_dtype=None) -> None:
    """Patches the double and single blocks; with ``fp8_dtype`` their Linears run FP8, a double
    block's fed FP8 rows by its norms where every one of them is patched, its processor is
    ditops' and all the Linears they feed became FP8."""
    from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle

    for index, block in enumerate(model.transformer_blocks):
        path = f"transformer_blocks.{index}"
        _patch_attention(patches, report, block, path)
        plain_norm2s = all(patching.plain_layer_norm(getattr(block, name)) for name in _NORM2S)
        every_norm_patched = (_ditops_forward(block, False) is not None and plain_norm2s and all(
            _norm_supported(getattr(block, name), AdaLayerNormZero) for name in ("norm1", "norm1_context")))
        fp8 = (fp8_dtype is not None and every_norm_patched
               and _quantize_double_block(block, path, patches, report, fp8_dtype))
        suffix = "_fp8" if fp8 else ""
        for name in ("norm1", "norm1_context"):
            _patch_norm(patches, report, block, path, name, AdaLayerNormZero,
                        flux._NORM_FORWARDS[fp8], "norm_scale_shift" + suffix)
        forward = _ditops_forward(block, fp8)
        if forward is None:
            report.skipped.append(f"{path}: {type(block).__name__} has another forward than HunyuanVideo's double "
                                  "block; its norm2s stay as diffusers wrote them")
        elif not plain_norm2s:
            report.skipped.append(f"{path}: norm2/norm2_context with affine parameters or of another type")
        elif patching.replace_forward(patches, report, block, path, forward):
            report.replaced.append((f"{path}.norm2, {path}.norm2_context", "residual_norm_scale_shift" + suffix))
    for index, block in enumerate(getattr(model, "single_transformer_blocks", None) or []):
        path = f"single_transformer_blocks.{index}"
        _patch_attention(patches, report, block, path)
        fp8 = (fp8_dtype is not None and _norm_supported(block.norm, AdaLayerNormZeroSingle)
               and _quantize_single_block(block, path, patches, report, fp8_dtype))
        _patch_norm(patches, report, block, path, "norm", AdaLayerNormZeroSingle,
                    flux._SINGLE_NORM_FORWARDS[fp8], "norm_scale_shift" + ("_fp8" if fp8 else ""))
    if fp8_dtype is not None:
        quantize.replace_rest(model, patches, report, fp8_dtype)


def _quantize_double_block(block, path, patches, report, fp8_dtype) -> bool:
    """The Linears the block's norms feed -> FP8 (q/k/v of both streams, both MLPs, with the
    MLPs' GELU + quantisation fused); True where the norms may give them FP8 rows."""
    if not quantize.takes_rows(report, block.attn, HunyuanVideoQKNormRopeProcessor, path):
        return False
    projections = quantize.fed(block.attn, flux._QKV + flux._ADDED_QKV, f"{path}.attn")
    feed_forwards = {f"{path}.{name}": getattr(block, name) for name in ("ff", "ff_context")}
    return quantize.replace_fed_with_feed_forwards(patches, report, projections, feed_forwards, fp8_dtype, path)


def _quantize_single_block(block, path, patches, report, fp8_dtype) -> bool:
    """flux._quantize_single_block for a block computing diffusers' HunyuanVideo single block,
    fed by _single_block_forward_fp8 through ditops' processor (whose projections stay apart)."""
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoSingleTransformerBlock

    if wan._code(type(block).forward.__code__) != wan._code(HunyuanVideoSingleTransformerBlock.forward.__code__):
        report.skipped.append(f"{path}: its norm gives bf16 ({type(block).__name__} has another forward than "
                              "HunyuanVideo's single block)")
        return False
    return flux._quantize_single_block(block, path, patches, report, fp8_dtype, _single_block_forward_fp8,
                                       HunyuanVideoQKNormRopeProcessor, join=False)
