"""CogVideoX (``CogVideoXTransformer3DModel``: CogVideoX 1.0 and 1.5) and ConsisID
(``ConsisIDTransformer3DModel``, whose ``ConsisIDBlock`` computes CogVideoX's block) under ditops.

- ``norm1`` (``CogVideoXLayerNormZero``: one LayerNorm, with its weight and bias, of the video
  and of the text tokens, each ``* (1 + scale) + shift`` with its own chunks of one linear
  layer) -> one ``norm_scale_shift`` per stream (the [B, D] chunks as strided views).
- Per stream, the gated residual add of the attention output followed by ``norm2`` (another
  ``CogVideoXLayerNormZero``) and its modulation -> ``residual_norm_scale_shift``; the FFN on
  [text, video] and its gated adds as diffusers wrote them.
- The attention (``CogVideoXAttnProcessor2_0``, on [text, video] tokens): the per-head q/k
  LayerNorms (``nn.LayerNorm(dim_head)``, weight and bias) and the interleaved RoPE of the video
  tokens (``apply_rotary_emb`` with ``use_real_unbind_dim=-1``) -> ``qk_norm_rope_(norm="layer")``
  on the video tokens' slice of q and k; the text tokens (few) keep diffusers' q/k LayerNorm and
  no RoPE. As diffusers' processor it calls torch's scaled_dot_product_attention (no diffusers
  attention backend).

Blocks are matched by the code of their forward: CogVideoXBlock's, or ConsisIDBlock's (the
same computation without ``attention_kwargs``). Left as diffusers wrote them, and reported:
attentions without q/k norms (``qk_norm=False``), with another processor (the fused
projections' ``FusedCogVideoXAttnProcessor2_0``, one set by the user) or in a model without
rotary embeddings (``use_rotary_positional_embeddings=False``: CogVideoX-2b, whose position is
in its patch embedding), blocks with another forward, the output norms (``norm_final``,
``norm_out``) and ConsisID's face modules (``local_facial_extractor``,
``perceiver_cross_attention``). Look-alikes in diffusers 0.42 that compute otherwise and are
not patched: CogView3-Plus (``CogView3PlusTransformerBlock``: CogVideoX's processor without
RoPE, q/k LayerNorms without affine parameters, another AdaLN) and CogView4. diffusers 0.42
has no context-parallel plan for these models.

With ``quantize="fp8"`` (quantize.py) ``norm1`` gives FP8 rows (``norm_scale_shift_fp8``) to
q/k/v of ditops' processor (both streams' rows joined, text first, as diffusers joins them),
and ``norm2`` (``residual_norm_scale_shift_fp8``) to the GELU-tanh FFN, whose GELU and the
quantisation of its hidden state are one ``quantize_fp8``; each where all the Linears it feeds
became FP8. The other Linears (the attention output, the modulations) quantise their own input.
"""

from __future__ import annotations

import torch

from ... import ops, validation
from ...fp8 import Float8Rows
from . import patching, quantize, wan

_QKV = ("to_q", "to_k", "to_v")
QK_NORM_ROPE = "qk_norm_rope_ (norm=layer)"  # the report's op for an attention


# The norms as the Linears after them take their output: a tensor, or FP8 rows (quantize="fp8").
# ``norm``: the block's LayerNorm (its weight and bias may be None: norm_elementwise_affine=False).


def _norm(x, scale, shift, norm):
    return ops.norm_scale_shift(x, scale, shift, weight=norm.weight, bias=norm.bias, eps=norm.eps)


def _norm_fp8(x, scale, shift, norm):
    return Float8Rows(*ops.norm_scale_shift_fp8(x, scale, shift, weight=norm.weight, bias=norm.bias, eps=norm.eps))


def _residual_norm(x, residual, gate, scale, shift, norm):
    return ops.residual_norm_scale_shift(x, residual, gate, scale, shift, weight=norm.weight, bias=norm.bias,
                                         eps=norm.eps)


def _residual_norm_fp8(x, residual, gate, scale, shift, norm):
    y, y_scale, residual_out = ops.residual_norm_scale_shift_fp8(x, residual, gate, scale, shift, weight=norm.weight,
                                                                 bias=norm.bias, eps=norm.eps)
    return Float8Rows(y, y_scale), residual_out


def _joined(text, video):
    """The text rows, then the video rows (as diffusers' processor and FFN join them): tensors,
    or FP8 rows with their scales."""
    if isinstance(text, Float8Rows):
        return Float8Rows(*(torch.cat(parts, dim=1) for parts in zip(text, video)))
    return torch.cat([text, video], dim=1)


def _layer_norm_zero_forward_of(norm):
    def forward(self, hidden_states, encoder_hidden_states, temb):
        """diffusers' CogVideoXLayerNormZero: six chunks of one linear layer, the first two
        modulating LayerNorm(video), the fourth and fifth LayerNorm(text); the gates as diffusers
        returns them, [B, 1, D]."""
        if patching.hooked(self, ("norm",)):
            return type(self).forward(self, hidden_states, encoder_hidden_states, temb)
        shift, scale, gate, enc_shift, enc_scale, enc_gate = self.linear(self.silu(temb)).chunk(6, dim=1)
        return (norm(hidden_states, scale, shift, self.norm),
                norm(encoder_hidden_states, enc_scale, enc_shift, self.norm), gate[:, None, :], enc_gate[:, None, :])

    return forward


_NORM1_FORWARDS = {False: _layer_norm_zero_forward_of(_norm), True: _layer_norm_zero_forward_of(_norm_fp8)}


def _block(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb, attention_kwargs, fp8):
    """diffusers' CogVideoXBlock with each stream's "residual + gate * attention, then norm2 and
    its modulation" as one residual_norm_scale_shift (its FP8 form where ``fp8`` and no hook on
    the FFN takes its input: a hook takes tensors)."""
    text = encoder_hidden_states.size(1)
    norm_hidden_states, norm_encoder_hidden_states, gate_msa, enc_gate_msa = self.norm1(
        hidden_states, encoder_hidden_states, temb)
    if isinstance(norm_hidden_states, Float8Rows) and (type(self.attn1.processor) is not CogVideoXQKNormRopeProcessor
                                                       or patching.sees_arguments(self.attn1)):
        # a processor set after apply, or a hook taking the attention's arguments, takes tensors
        norm_hidden_states, norm_encoder_hidden_states = (rows.dequantize(hidden_states.dtype) for rows in
                                                          (norm_hidden_states, norm_encoder_hidden_states))
    attention, context_attention = self.attn1(hidden_states=norm_hidden_states,
                                              encoder_hidden_states=norm_encoder_hidden_states,
                                              image_rotary_emb=image_rotary_emb, **attention_kwargs)
    shift, scale, gate_ff, enc_shift, enc_scale, enc_gate_ff = self.norm2.linear(self.norm2.silu(temb)).chunk(6, dim=1)
    residual_norm = _residual_norm_fp8 if fp8 and not patching.sees_arguments(self.ff) else _residual_norm
    norm_hidden_states, hidden_states = residual_norm(attention, hidden_states, gate_msa[:, 0], scale, shift,
                                                      self.norm2.norm)
    norm_encoder_hidden_states, encoder_hidden_states = residual_norm(
        context_attention, encoder_hidden_states, enc_gate_msa[:, 0], enc_scale, enc_shift, self.norm2.norm)
    ff_output = self.ff(_joined(norm_encoder_hidden_states, norm_hidden_states))
    hidden_states = hidden_states + gate_ff[:, None, :] * ff_output[:, text:]
    encoder_hidden_states = encoder_hidden_states + enc_gate_ff[:, None, :] * ff_output[:, :text]
    return hidden_states, encoder_hidden_states


def _bypassed_norm2(block) -> bool:
    """Whether norm2 or its LayerNorm (whose calls the block forward replaces) has a hook
    (``patching.hooked`` warns): then diffusers' forward runs."""
    return patching.hooked(block, ("norm2",)) or patching.hooked(block.norm2, ("norm",))


def _block_forward_of(fp8):
    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, attention_kwargs=None):
        """diffusers' CogVideoXBlock (``_block``)."""
        if _bypassed_norm2(self):
            return type(self).forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                      attention_kwargs)
        return _block(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb, attention_kwargs or {}, fp8)

    return forward


def _consisid_block_forward_of(fp8):
    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None):
        """diffusers' ConsisIDBlock: CogVideoXBlock's computation without attention_kwargs."""
        if _bypassed_norm2(self):
            return type(self).forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb)
        return _block(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb, {}, fp8)

    return forward


# the block forwards by diffusers' block class whose forward's code they take, {fp8: forward}
_BLOCK_FORWARDS = {fp8: _block_forward_of(fp8) for fp8 in (False, True)}
_CONSISID_BLOCK_FORWARDS = {fp8: _consisid_block_forward_of(fp8) for fp8 in (False, True)}


class CogVideoXQKNormRopeProcessor(patching.DitopsProcessor):
    """diffusers' CogVideoXAttnProcessor2_0 with the video tokens' q/k LayerNorm and interleaved
    RoPE as one qk_norm_rope_(norm="layer") (cache row s for video token s of every item); the
    text tokens' q/k through diffusers' LayerNorms. Calls without rotary tables, with a mask,
    with hooked q/k norms or with norm weights of another dtype than the activations go to
    diffusers' processor. The projections take a tensor or FP8 rows (quantize="fp8": norm1
    feeds them), the text rows joined before the video rows as diffusers joins them."""

    bypassed = ("norm_q", "norm_k")

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        dtype = patching.activation_dtype(hidden_states, attn.to_q)
        if (image_rotary_emb is None or attention_mask is not None or patching.hooked(attn, self.bypassed)
                or any(norm.weight is not None and norm.weight.dtype != dtype for norm in (attn.norm_q, attn.norm_k))):
            return self.defer(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        text = patching.batch_and_tokens(encoder_hidden_states)[1]
        states = _joined(encoder_hidden_states, hidden_states)
        query, key, value = (getattr(attn, name)(states).unflatten(2, (attn.heads, -1)) for name in _QKV)
        # in place on the video rows of q and k (views of the projections); under torch.compile on a
        # GPU the op's return values are the graph's new tensors, which spare it a copy of the projection.
        # Before the text rows' norms: those save their input for autograd, which a later write into
        # the same projection would invalidate
        video_query, video_key = ops.qk_norm_rope_(
            query[:, text:], key[:, text:], attn.norm_q.weight, attn.norm_k.weight,
            patching.cos_sin_cache(*image_rotary_emb), norm="layer", q_bias=attn.norm_q.bias,
            k_bias=attn.norm_k.bias, eps=attn.norm_q.eps, interleaved=True)
        text_query, text_key = attn.norm_q(query[:, :text]), attn.norm_k(key[:, :text])
        query, key = torch.cat([text_query, video_query], dim=1), torch.cat([text_key, video_key], dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2),
                                                               value.transpose(1, 2), dropout_p=0.0, is_causal=False)
        out = attn.to_out[1](attn.to_out[0](out.transpose(1, 2).flatten(2, 3)))
        context_out, out = out.split([text, out.shape[1] - text], dim=1)
        return out, context_out


def _attention_refusal(model, attn) -> str | None:
    """Why the attention ``attn`` keeps diffusers' processor, or None where
    CogVideoXQKNormRopeProcessor computes what it does."""
    from diffusers.models.attention_processor import Attention, CogVideoXAttnProcessor2_0

    if not getattr(model.config, "use_rotary_positional_embeddings", False):
        return ("the model has no rotary embeddings (use_rotary_positional_embeddings=False: its positions are in "
                "the patch embedding), so no q/k norm + RoPE to fuse")
    if type(attn) is not Attention or type(attn.processor) is not CogVideoXAttnProcessor2_0:
        return f"processor {type(attn.processor).__name__}, not diffusers' CogVideoXAttnProcessor2_0"
    if attn.norm_q is None or attn.norm_k is None:
        return "no q/k norms (qk_norm=False)"
    norms = (attn.norm_q, attn.norm_k)
    head_size = attn.inner_dim // attn.heads
    if not all(type(norm) is torch.nn.LayerNorm and tuple(norm.normalized_shape) == (head_size,) for norm in norms):
        return (f"q/k norms {type(attn.norm_q).__name__}/{type(attn.norm_k).__name__}, not torch.nn.LayerNorm over "
                f"the {head_size} values of a head")
    if attn.norm_q.eps != attn.norm_k.eps:
        return f"q/k norms of eps {attn.norm_q.eps} and {attn.norm_k.eps}, not one eps (qk_norm_rope_ takes one)"
    if attn.is_cross_attention:
        return "a cross-attention (diffusers rotates its queries only)"
    if attn.inner_kv_dim != attn.inner_dim or attn.inner_dim % attn.heads:
        return f"q/k widths {attn.inner_dim}/{attn.inner_kv_dim} over {attn.heads} heads, not one head size"
    if head_size % 2 or not 2 <= head_size <= validation.MAX_HEAD_SIZE:
        return f"head size {head_size}, not an even one up to {validation.MAX_HEAD_SIZE} (qk_norm_rope_'s)"
    return None


def _norm_supported(norm) -> bool:
    """diffusers' CogVideoXLayerNormZero over a torch LayerNorm of one dimension (its weight and
    bias either way)."""
    from diffusers.models.normalization import CogVideoXLayerNormZero

    return (type(norm) is CogVideoXLayerNormZero and type(norm.norm) is torch.nn.LayerNorm
            and len(norm.norm.normalized_shape) == 1)


def _block_forwards(block):
    """The ditops forwards ({fp8: forward}) for a block whose forward is the code of
    CogVideoXBlock's or of ConsisIDBlock's (a copy in another module counts), else None."""
    from diffusers.models.transformers.cogvideox_transformer_3d import CogVideoXBlock
    from diffusers.models.transformers.consisid_transformer_3d import ConsisIDBlock

    forward = wan._code(type(block).forward.__code__)
    for reference, forwards in ((CogVideoXBlock, _BLOCK_FORWARDS), (ConsisIDBlock, _CONSISID_BLOCK_FORWARDS)):
        if forward == wan._code(reference.forward.__code__):
            return forwards
    return None


_LAYOUT = ("norm1", "attn1", "norm2", "ff")


def patch(model, patches: list, report, fp8_dtype=None) -> None:
    """Patches the blocks; with ``fp8_dtype`` their Linears run FP8, fed FP8 rows by norm1 where
    the block's processor is ditops' and q/k/v became FP8, and by norm2 where the FFN is
    diffusers' GELU-tanh FeedForward and its two Linears became FP8."""
    for index, block in enumerate(model.transformer_blocks):
        path = f"transformer_blocks.{index}"
        if not all(hasattr(block, name) for name in _LAYOUT):
            report.skipped.append(f"{path}: {type(block).__name__}, not CogVideoX's block layout; left as it is")
            continue
        patching.replace_processor_unless(patches, report, block.attn1, f"{path}.attn1",
                                          _attention_refusal(model, block.attn1), CogVideoXQKNormRopeProcessor,
                                          QK_NORM_ROPE)
        forwards = _block_forwards(block)
        if forwards is None:
            report.skipped.append(f"{path}: {type(block).__name__} has another forward than CogVideoX's block; its "
                                  "norms stay as diffusers wrote them")
            continue
        if not (_norm_supported(block.norm1) and _norm_supported(block.norm2)):
            report.skipped.append(f"{path}: norm1/norm2 not CogVideoXLayerNormZero over a LayerNorm; left as they are")
            continue
        rows1, rows2 = (_quantize_block(block, path, patches, report, fp8_dtype) if fp8_dtype is not None
                        else (False, False))
        if patching.replace_forward(patches, report, block.norm1, f"{path}.norm1", _NORM1_FORWARDS[rows1]):
            report.replaced.append((f"{path}.norm1", "norm_scale_shift" + ("_fp8" if rows1 else "")))
        if patching.replace_forward(patches, report, block, path, forwards[rows2]):
            report.replaced.append((f"{path}.norm2", "residual_norm_scale_shift" + ("_fp8" if rows2 else "")))
    outputs = [name for name in ("norm_final", "norm_out") if hasattr(model, name)]
    if outputs:
        report.skipped.append(f"{', '.join(outputs)}: the output LayerNorm and its modulated norm (once per forward); "
                              "left as it is")
    faces = [name for name in ("local_facial_extractor", "perceiver_cross_attention") if hasattr(model, name)]
    if faces:
        report.skipped.append(f"{', '.join(faces)}: ConsisID's face modules; left as diffusers wrote them")
    if fp8_dtype is not None:
        quantize.replace_rest(model, patches, report, fp8_dtype)


def _gelu_tanh_feed_forward(ff) -> bool:
    """Whether ``ff`` is diffusers' FeedForward with a GELU(tanh) up projection, dropout, a Linear
    down and, as CogVideoX's (final_dropout=True), maybe a final dropout."""
    from diffusers.models.activations import GELU
    from diffusers.models.attention import FeedForward

    net = getattr(ff, "net", None)
    return (type(ff) is FeedForward and len(net) in (3, 4) and type(net[0]) is GELU and net[0].approximate == "tanh"
            and type(net[0].proj) is torch.nn.Linear and type(net[2]) is torch.nn.Linear
            and all(type(net[i]) is torch.nn.Dropout for i in range(1, len(net)) if i != 2))


def _feed_forward_fp8(self, hidden_states, *args, **kwargs):
    """The FeedForward with its GELU and the quantisation of its hidden state as one
    quantize_fp8 between the two FP8 GEMMs, then its final dropout (the identity at
    inference; in training diffusers' code runs)."""
    if self.training:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    hidden = self.net[0].proj(hidden_states)
    out = self.net[2](Float8Rows(*ops.quantize_fp8(hidden, activation="gelu_tanh")))
    for module in self.net[3:]:
        out = module(out)
    return out


def _quantize_block(block, path, patches, report, fp8_dtype) -> tuple:
    """The Linears norm1 and norm2 feed -> FP8 (norm1: q/k/v of ditops' processor; norm2: the
    FFN's two Linears, its GELU + quantisation fused); (norm1 gives rows, norm2 gives rows)."""
    rows1 = quantize.takes_rows(report, block.attn1, CogVideoXQKNormRopeProcessor, f"{path}.norm1") and \
        quantize.replace_fed(patches, report, quantize.fed(block.attn1, _QKV, f"{path}.attn1"), fp8_dtype,
                             f"{path}.norm1")
    if not _gelu_tanh_feed_forward(block.ff):
        report.skipped.append(f"{path}.norm2: its norms give bf16 (ff is not diffusers' GELU-tanh FeedForward)")
        return rows1, False
    linears = [(block.ff.net[0], "proj", f"{path}.ff.net.0.proj"), (block.ff.net, "2", f"{path}.ff.net.2")]
    rows2 = quantize.replace_fed(patches, report, linears, fp8_dtype, f"{path}.norm2")
    if rows2 and patching.replace_forward(patches, report, block.ff, f"{path}.ff", _feed_forward_fp8):
        report.replaced.append((f"{path}.ff", "quantize_fp8 (GELU)"))
    return rows1, rows2
