"""Qwen-Image and Qwen-Image-Edit (``QwenImageTransformer2DModel``) under ditops.

- Both streams' modulated ``norm1`` -> ``norm_scale_shift`` and "residual + gate * attention,
  then ``norm2`` and its modulation" -> ``residual_norm_scale_shift``; with ``modulate_index``
  (Qwen-Image-Edit) the image stream uses the select forms.
- Each stream's q/k RMSNorm + RoPE (complex frequencies, interleaved pairs) -> ``qk_norm_rope_``
  on the frequencies ``pos_embed`` hands the block, one row per token of each stream. Under
  context parallelism the plan splits both ``pos_embed`` outputs along the sequence with the
  streams, so the tables are this shard's and its tokens start at row 0 (no offset).

With ``quantize="fp8"`` (quantize.py) the norms without ``modulate_index`` give FP8 rows
(``norm_scale_shift_fp8``, ``residual_norm_scale_shift_fp8``) to the projections they feed
(q/k/v, the MLPs' up projections), each MLP's GELU and quantisation are one ``quantize_fp8``
(quantize.py's FeedForward forward); with ``modulate_index`` (Qwen-Image-Edit's image stream)
their select forms do (``norm_scale_shift_select_fp8``, ``residual_norm_scale_shift_select_fp8``).
"""

from __future__ import annotations

import torch

from ... import ops
from ...fp8 import Float8Rows
from . import patching, quantize


def _halves(t: torch.Tensor) -> tuple:
    """Qwen-Image-Edit stacks the modulation of index 0 and index 1 along the batch: [2B, D]."""
    return t[: t.shape[0] // 2], t[t.shape[0] // 2:]


def _first_norm_of(fp8: bool):
    def first_norm(x, modulation, index, eps):
        """LayerNorm(x) with the (shift, scale, gate) rows of ``modulation``: (modulated, gate).
        With a per-token index, the select form: gate is then per token, [B, S, D]."""
        shift, scale, gate = modulation.chunk(3, dim=-1)
        if index is None and fp8:
            return Float8Rows(*ops.norm_scale_shift_fp8(x, scale, shift, eps=eps)), gate.unsqueeze(1)
        if index is None:
            return ops.norm_scale_shift(x, scale, shift, eps=eps), gate.unsqueeze(1)
        (scale0, scale1), (shift0, shift1), (gate0, gate1) = _halves(scale), _halves(shift), _halves(gate)
        if fp8:
            y, y_scale, gate = ops.norm_scale_shift_select_fp8(x, index, scale0, shift0, gate0, scale1, shift1, gate1,
                                                               eps=eps)
            return Float8Rows(y, y_scale), gate
        return ops.norm_scale_shift_select(x, index, scale0, shift0, gate0, scale1, shift1, gate1, eps=eps)

    return first_norm


def _second_norm_of(fp8: bool):
    def second_norm(attention, residual, first_gate, modulation, index, eps):
        """residual + first_gate * attention, stored, then its modulated LayerNorm:
        (modulated, new residual, gate for the MLP)."""
        shift, scale, gate = modulation.chunk(3, dim=-1)
        if index is None and fp8:
            y, y_scale, residual = ops.residual_norm_scale_shift_fp8(attention, residual, first_gate.squeeze(1), scale,
                                                                     shift, eps=eps)
            return Float8Rows(y, y_scale), residual, gate.unsqueeze(1)
        if index is None:
            modulated, residual = ops.residual_norm_scale_shift(attention, residual, first_gate.squeeze(1), scale, shift,
                                                                eps=eps)
            return modulated, residual, gate.unsqueeze(1)
        (scale0, scale1), (shift0, shift1), (gate0, gate1) = _halves(scale), _halves(shift), _halves(gate)
        if fp8:
            y, y_scale, residual, gate = ops.residual_norm_scale_shift_select_fp8(
                attention, residual, first_gate, index, scale0, shift0, gate0, scale1, shift1, gate1, eps=eps)
            return Float8Rows(y, y_scale), residual, gate
        return ops.residual_norm_scale_shift_select(attention, residual, first_gate, index, scale0, shift0, gate0, scale1,
                                                    shift1, gate1, eps=eps)

    return second_norm


def _block_forward_of(first_norm, second_norm):
    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
                image_rotary_emb=None, joint_attention_kwargs=None, modulate_index=None):
        """diffusers' QwenImageTransformerBlock with its modulated norms as norm_scale_shift and
        residual_norm_scale_shift (their select forms with modulate_index). Attention and MLPs
        stay as diffusers wrote them."""
        if patching.hooked(self, ("img_norm1", "img_norm2", "txt_norm1", "txt_norm2")):
            return type(self).forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
                                      image_rotary_emb, joint_attention_kwargs, modulate_index)
        image_modulation = self.img_mod(temb)
        if self.zero_cond_t:
            temb = torch.chunk(temb, 2, dim=0)[0]
        text_modulation = self.txt_mod(temb)
        image_first, image_second = image_modulation.chunk(2, dim=-1)
        text_first, text_second = text_modulation.chunk(2, dim=-1)
        index = None if modulate_index is None else torch.as_tensor(modulate_index, device=hidden_states.device)
        eps = self.img_norm1.eps

        image_modulated, image_gate = first_norm(hidden_states, image_first, index, eps)
        text_modulated, text_gate = first_norm(encoder_hidden_states, text_first, None, eps)
        image_attention, text_attention = self.attn(
            hidden_states=image_modulated, encoder_hidden_states=text_modulated,
            encoder_hidden_states_mask=encoder_hidden_states_mask, image_rotary_emb=image_rotary_emb,
            **(joint_attention_kwargs or {}))
        image_modulated, hidden_states, image_gate = second_norm(
            image_attention, hidden_states, image_gate, image_second, index, eps)
        text_modulated, encoder_hidden_states, text_gate = second_norm(
            text_attention, encoder_hidden_states, text_gate, text_second, None, eps)
        hidden_states = hidden_states + image_gate * self.img_mlp(image_modulated)
        encoder_hidden_states = encoder_hidden_states + text_gate * self.txt_mlp(text_modulated)
        if encoder_hidden_states.dtype == torch.float16:
            encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        return encoder_hidden_states, hidden_states

    return forward


_BLOCK_FORWARDS = {fp8: _block_forward_of(_first_norm_of(fp8), _second_norm_of(fp8)) for fp8 in (False, True)}


class QwenQKNormRopeProcessor(patching.DitopsProcessor):
    """diffusers' QwenDoubleStreamAttnProcessor2_0 with each stream's q/k RMSNorm and RoPE as
    qk_norm_rope_: the text tokens with the added-projection norms and the text frequencies,
    the image tokens with the image norms and frequencies, in place on each stream's q and k
    before they are joined. Calls without rotary embeddings go to the original, and so do
    calls with a text mask under context parallelism: diffusers shards that mask and attends
    over the whole sequence with each rank's shard of it, and on 2 GPUs such calls gave NaN in
    some patched runs (never proven to come from ditops, never seen unpatched), so there
    ditops computes exactly what diffusers does."""

    bypassed = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                 attention_mask=None, image_rotary_emb=None):
        if (image_rotary_emb is None or encoder_hidden_states is None or attention_mask is not None
                or (encoder_hidden_states_mask is not None and self._parallel_config is not None)
                or patching.hooked(attn, self.bypassed)):
            return self.defer(attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, attention_mask,
                                 image_rotary_emb)
        head_size = attn.inner_dim // attn.heads
        image_frequencies, text_frequencies = image_rotary_emb  # complex [S, Dh / 2] per stream
        eps = attn.norm_q.eps
        streams = []  # (q, k, v) of the text, then of the image
        for states, projections, q_norm, k_norm, frequencies in (
                (encoder_hidden_states, (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj), attn.norm_added_q,
                 attn.norm_added_k, text_frequencies),
                (hidden_states, (attn.to_q, attn.to_k, attn.to_v), attn.norm_q, attn.norm_k, image_frequencies)):
            query, key, value = (projection(states).unflatten(-1, (-1, head_size)) for projection in projections)
            # in place on the stream's own projections, before the concatenation: under
            # torch.compile, on slices of the concatenation Inductor copies each slice out and back
            ops.qk_norm_rope_(query, key, q_norm.weight, k_norm.weight, patching.complex_cache(frequencies), eps=eps)
            streams.append((query, key, value))
        text = streams[0][0].shape[1]  # the streams' lengths from their projections: the states may be FP8 rows
        if encoder_hidden_states_mask is not None:  # text tokens as the mask says, every image token
            image_query = streams[1][0]
            image_mask = torch.ones(image_query.shape[:2], dtype=torch.bool, device=image_query.device)
            attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)[:, None, None, :]
        query, key, value = (torch.cat(pair, dim=1) for pair in zip(*streams))
        out = self.attention(query, key, value, attention_mask).flatten(2, 3).to(query.dtype)
        image_out = attn.to_out[0](out[:, text:].contiguous())
        if len(attn.to_out) > 1:
            image_out = attn.to_out[1](image_out)
        return image_out, attn.to_add_out(out[:, :text].contiguous())


def _attention_supported(attn) -> bool:
    from diffusers.models.normalization import RMSNorm
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    norms = (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k)
    return type(attn.processor) is QwenDoubleStreamAttnProcessor2_0 and all(
        type(norm) is RMSNorm and norm.weight is not None and norm.eps == attn.norm_q.eps for norm in norms)


def patch(model, patches: list, report, fp8_dtype=None) -> None:
    """Patches Qwen-Image's blocks; with ``fp8_dtype`` their Linears run FP8 (the module docstring)."""
    for index, block in enumerate(model.transformer_blocks):
        path = f"transformer_blocks.{index}"
        patching.replace_processor(patches, report, block.attn, f"{path}.attn", _attention_supported(block.attn),
                                   QwenQKNormRopeProcessor, "qk_norm_rope_")
        fp8 = fp8_dtype is not None and _quantize_block(block, path, patches, report, fp8_dtype)
        suffix = "_fp8" if fp8 else ""
        norms = (block.img_norm1, block.img_norm2, block.txt_norm1, block.txt_norm2)
        if not all(patching.plain_layer_norm(norm) and norm.eps == block.img_norm1.eps for norm in norms):
            report.skipped.append(f"{path}: norms with affine parameters, another type or other eps")
        elif patching.replace_forward(patches, report, block, path, _BLOCK_FORWARDS[fp8]):
            report.replaced += [(f"{path}.img_norm1, {path}.txt_norm1",
                                 f"norm_scale_shift{suffix} (select with modulate_index)"),
                                (f"{path}.img_norm2, {path}.txt_norm2",
                                 f"residual_norm_scale_shift{suffix} (select with modulate_index)")]
    if fp8_dtype is not None:
        quantize.replace_rest(model, patches, report, fp8_dtype)


_PROJECTIONS = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")
_MLPS = ("img_mlp", "txt_mlp")


def _quantize_block(block, path, patches, report, fp8_dtype) -> bool:
    """The Linears the block's norms feed -> FP8 (both streams' q/k/v and MLPs, the MLPs' GELU
    + quantisation fused); True where the norms may give them FP8 rows."""
    if not quantize.takes_rows(report, block.attn, QwenQKNormRopeProcessor, path):
        return False
    projections = quantize.fed(block.attn, _PROJECTIONS, f"{path}.attn")
    feed_forwards = {f"{path}.{name}": getattr(block, name) for name in _MLPS}
    return quantize.replace_fed_with_feed_forwards(patches, report, projections, feed_forwards, fp8_dtype, path)
