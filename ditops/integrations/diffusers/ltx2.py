"""LTX-2 (``LTX2VideoTransformer3DModel``: a video and an audio stream) and LTX-Video
(``LTXVideoTransformer3DModel``) under ditops.

Every block norm is diffusers' ``RMSNorm`` without weight (``norm_elementwise_affine=False``,
the models' default); the modulation is one [B, 1, D] vector per item or one [B, S, D] per
token (per-token timesteps), both forms the ops take.

- LTX-2 (``LTX2VideoTransformerBlock``), on each stream: ``norm1`` / ``audio_norm1`` with its
  modulation -> ``norm_scale_shift`` (norm="rms"); "x + gate * self-attention, then ``norm2``"
  (modulated for the text query where ``cross_attn_mod``, else plain) -> ``residual_norm_scale_shift``;
  "x + (gate *) text cross-attention, then ``audio_to_video_norm`` / ``video_to_audio_norm``",
  whose output diffusers modulates twice (for the audio-to-video and the video-to-audio
  attention) -> ``residual_norm_scale_shift`` with the first modulation, ``norm_scale_shift`` on
  the stored sum with the second; "x + gate * audio-video attention, then ``norm3`` and the FFN's
  modulation" -> ``residual_norm_scale_shift``. With both audio-video attentions off
  (``isolate_modalities``), the text attention's residual goes into ``norm3`` instead.
- LTX-Video (``LTXVideoTransformerBlock``): ``norm1`` -> ``norm_scale_shift``; "x + text
  cross-attention, then ``norm2``" -> ``residual_norm_scale_shift``. The self-attention's gated
  residual feeds the cross-attention unnormalised and stays as diffusers wrote it.
- The attentions called with rotary tables (self-attentions; LTX-2's audio-video attentions,
  whose query and key have tables of their own). The tables span all heads (each head has its
  own frequencies) and each batch item: they become a cos/sin cache with a row per head,
  [B, S, H, Dh] (docs/ops.md). Interleaved tables pair neighbouring dims; LTX-2's
  ``rope_type="split"`` tables ([B, H, S, Dh / 2] views of token-major memory) rotate the two
  halves of each head (NeoX). A self-attention's q/k RMSNorm over all heads of a token (diffusers'
  ``norm_q`` / ``norm_k``, ``torch.nn.RMSNorm``) and its RoPE -> one
  ``qk_norm_rope_(norm_over="token")``: q and k share the tokens and the table. An audio-video
  attention's q and k are of two streams (other tokens, a table each): ``norm_q`` / ``norm_k``
  stay diffusers', the RoPE -> ``rope_`` on q and on k. So does a self-attention's where its
  norms are not RMSNorms of one eps over all of a token's heads, or have a hook. Under context
  parallelism the plan splits the ``rope`` outputs with the hidden states, so the rows are this
  shard's (LTX-Video; diffusers 0.42.1's own context parallelism fails on LTX-2, with or without
  ditops). Calls with a mask, with STG perturbation, or with tables of another shape go to
  diffusers' processor, and so do calls under torch.compile (``LTXRopeProcessor.fits`` says why).

With ``quantize="fp8"`` (quantize.py) a block's norms give FP8 rows (``norm_scale_shift_fp8``,
``residual_norm_scale_shift_fp8``) to the Linears that take their output, now FP8: q/k/v of the
rotary attentions (LTX-2's audio-video attentions too: their query rows are one stream's norm
output, their key/value rows the other's), the text cross-attentions' q on LTX-2 (its
``norm2`` / ``audio_norm2`` output; ``LTX2TextQueryProcessor`` runs diffusers' code with the
rows), LTX-2.3's gate logits beside each of those q, and the GELU-tanh FFNs, whose GELU and
quantisation are one ``quantize_fp8``. A block gives FP8 rows where all of those Linears can be
FP8 (LTX-2.3's gate logits, D -> heads, need heads a multiple of 16) and every attention they
feed gets a ditops processor, else bf16 (the report says why). Self-quantising (one
``quantize_fp8`` each): the text keys and values (the prompt, no norm's output), the attention
outputs, LTX-Video's text query (its cross-attention reads the residual stream unnormalised)
and the model-level Linears (quantize.replace_rest). Under torch.compile the rotary attentions
given FP8 rows stay ditops' with diffusers' q/k norm and RoPE code, so that their projections
still take the rows; calls that go to diffusers' processor (a mask on a rotary attention, STG
perturbation) get the rows dequantised.

Left as diffusers wrote them: the text cross-attentions (q/k RMSNorm without RoPE; on LTX-2 with
FP8 rows, diffusers' code in ditops' processor), the FFNs' gated adds (no norm follows them in
the block), the prompt modulation of the text, the output ``norm_out`` / ``audio_norm_out`` and
their modulation, blocks of another class or whose norms are not the ones checked.
"""

from __future__ import annotations

import torch

from ... import ops
from ...fp8 import Float8Rows
from . import patching, quantize

_LTX2_NORMS = ("norm1", "audio_norm1", "norm2", "audio_norm2", "audio_to_video_norm", "video_to_audio_norm", "norm3",
               "audio_norm3")
_LTX_NORMS = ("norm1", "norm2")


def _norm(norm, x, pending, scale, shift):
    """(norm(x') * (1 + scale) + shift, x'), with x' = x + gate * branch for the ``pending``
    (branch, gate) residual (gate None: 1), or x where none is pending."""
    if pending is None:
        return ops.norm_scale_shift(x, scale, shift, norm="rms", eps=norm.eps), x
    branch, gate = pending
    return ops.residual_norm_scale_shift(branch, x, gate, scale, shift, norm="rms", eps=norm.eps)


def _norm_fp8(norm, x, pending, scale, shift):
    """``_norm`` with its output as FP8 rows (quantize="fp8": for the Linears it feeds)."""
    if pending is None:
        return Float8Rows(*ops.norm_scale_shift_fp8(x, scale, shift, norm="rms", eps=norm.eps)), x
    branch, gate = pending
    y, y_scale, x = ops.residual_norm_scale_shift_fp8(branch, x, gate, scale, shift, norm="rms", eps=norm.eps)
    return Float8Rows(y, y_scale), x


def _prompt_modulation(table, temb_prompt, batch_size, like):
    """LTX-2.3's (shift, scale) of the text keys and values: from the prompt timestep, or the
    layer's table alone where the model has none (diffusers' code)."""
    from diffusers.models.transformers.transformer_ltx2 import LTX2VideoTransformerBlock

    if temb_prompt is not None:
        return LTX2VideoTransformerBlock.get_mod_params(table, temb_prompt, batch_size)
    return table[None, None].to(device=like.device, dtype=like.dtype).unbind(dim=2)


def _ltx2_block_forward_of(norm):
    def forward(self, hidden_states, audio_hidden_states, encoder_hidden_states, audio_encoder_hidden_states, temb,
                temb_audio, temb_ca_scale_shift, temb_ca_audio_scale_shift, temb_ca_gate, temb_ca_audio_gate,
                temb_prompt=None, temb_prompt_audio=None, video_rotary_emb=None, audio_rotary_emb=None,
                ca_video_rotary_emb=None, ca_audio_rotary_emb=None, encoder_attention_mask=None,
                audio_encoder_attention_mask=None, self_attention_mask=None, audio_self_attention_mask=None,
                a2v_cross_attention_mask=None, v2a_cross_attention_mask=None, use_a2v_cross_attention=True,
                use_v2a_cross_attention=True, perturbation_mask=None, all_perturbed=None):
        """diffusers' LTX2VideoTransformerBlock with every norm and its modulation fused (``norm``:
        ``_norm``, or ``_norm_fp8`` for FP8 rows): a stream's gated residual stays pending until
        the next norm takes it. With a hooked norm, diffusers' forward runs."""
        if patching.hooked(self, _LTX2_NORMS):
            return type(self).forward(self, hidden_states, audio_hidden_states, encoder_hidden_states,
                                      audio_encoder_hidden_states, temb, temb_audio, temb_ca_scale_shift,
                                      temb_ca_audio_scale_shift, temb_ca_gate, temb_ca_audio_gate, temb_prompt,
                                      temb_prompt_audio, video_rotary_emb, audio_rotary_emb, ca_video_rotary_emb,
                                      ca_audio_rotary_emb, encoder_attention_mask, audio_encoder_attention_mask,
                                      self_attention_mask, audio_self_attention_mask, a2v_cross_attention_mask,
                                      v2a_cross_attention_mask, use_a2v_cross_attention, use_v2a_cross_attention,
                                      perturbation_mask, all_perturbed)
        batch_size = hidden_states.size(0)
        video = self.get_mod_params(self.scale_shift_table, temb, batch_size)
        audio = self.get_mod_params(self.audio_scale_shift_table, temb_audio, batch_size)
        perturbation = (dict(perturbation_mask=perturbation_mask, all_perturbed=all_perturbed) if self.perturbed_attn
                        else {})

        # 1. Self-attentions
        x, _ = norm(self.norm1, hidden_states, None, video[1], video[0])
        video_pending = (self.attn1(hidden_states=x, encoder_hidden_states=None, query_rotary_emb=video_rotary_emb,
                                    attention_mask=self_attention_mask, **perturbation), video[2])
        x, _ = norm(self.audio_norm1, audio_hidden_states, None, audio[1], audio[0])
        audio_pending = (self.audio_attn1(hidden_states=x, encoder_hidden_states=None,
                                          query_rotary_emb=audio_rotary_emb, attention_mask=audio_self_attention_mask,
                                          **perturbation), audio[2])

        # 2. Text cross-attentions; norm2 is modulated (shift, scale, gate: parameters 6-8) only with cross_attn_adaln
        no_modulation = video[0].new_zeros(())
        if self.cross_attn_adaln:
            shift_text_kv, scale_text_kv = _prompt_modulation(self.prompt_scale_shift_table, temb_prompt, batch_size,
                                                              hidden_states)
            encoder_hidden_states = encoder_hidden_states * (1 + scale_text_kv) + shift_text_kv
            audio_shift_text_kv, audio_scale_text_kv = _prompt_modulation(
                self.audio_prompt_scale_shift_table, temb_prompt_audio, batch_size, audio_hidden_states)
            audio_encoder_hidden_states = audio_encoder_hidden_states * (1 + audio_scale_text_kv) + audio_shift_text_kv
        shift, scale, gate = video[6:9] if self.video_cross_attn_adaln else (no_modulation, no_modulation, None)
        x, hidden_states = norm(self.norm2, hidden_states, video_pending, scale, shift)
        video_pending = (self.attn2(x, encoder_hidden_states=encoder_hidden_states, query_rotary_emb=None,
                                    attention_mask=encoder_attention_mask), gate)
        shift, scale, gate = audio[6:9] if self.audio_cross_attn_adaln else (no_modulation, no_modulation, None)
        x, audio_hidden_states = norm(self.audio_norm2, audio_hidden_states, audio_pending, scale, shift)
        audio_pending = (self.audio_attn2(x, encoder_hidden_states=audio_encoder_hidden_states, query_rotary_emb=None,
                                          attention_mask=audio_encoder_attention_mask), gate)

        # 3. Audio-to-video and video-to-audio attentions: each stream's norm output modulated twice
        if use_a2v_cross_attention or use_v2a_cross_attention:
            video_a2v_scale, video_a2v_shift, video_v2a_scale, video_v2a_shift = self.get_mod_params(
                self.video_a2v_cross_attn_scale_shift_table[:4, :], temb_ca_scale_shift, batch_size)
            a2v_gate = self.get_mod_params(self.video_a2v_cross_attn_scale_shift_table[4:, :], temb_ca_gate,
                                           batch_size)[0]
            audio_a2v_scale, audio_a2v_shift, audio_v2a_scale, audio_v2a_shift = self.get_mod_params(
                self.audio_a2v_cross_attn_scale_shift_table[:4, :], temb_ca_audio_scale_shift, batch_size)
            v2a_gate = self.get_mod_params(self.audio_a2v_cross_attn_scale_shift_table[4:, :], temb_ca_audio_gate,
                                           batch_size)[0]
            video_a2v, hidden_states = norm(self.audio_to_video_norm, hidden_states, video_pending, video_a2v_scale,
                                             video_a2v_shift)
            video_v2a, _ = norm(self.audio_to_video_norm, hidden_states, None, video_v2a_scale, video_v2a_shift)
            audio_a2v, audio_hidden_states = norm(self.video_to_audio_norm, audio_hidden_states, audio_pending,
                                                   audio_a2v_scale, audio_a2v_shift)
            audio_v2a, _ = norm(self.video_to_audio_norm, audio_hidden_states, None, audio_v2a_scale, audio_v2a_shift)
            video_pending = audio_pending = None
            if use_a2v_cross_attention:
                video_pending = (self.audio_to_video_attn(video_a2v, encoder_hidden_states=audio_a2v,
                                                          query_rotary_emb=ca_video_rotary_emb,
                                                          key_rotary_emb=ca_audio_rotary_emb,
                                                          attention_mask=a2v_cross_attention_mask), a2v_gate)
            if use_v2a_cross_attention:
                audio_pending = (self.video_to_audio_attn(audio_v2a, encoder_hidden_states=video_v2a,
                                                          query_rotary_emb=ca_audio_rotary_emb,
                                                          key_rotary_emb=ca_video_rotary_emb,
                                                          attention_mask=v2a_cross_attention_mask), v2a_gate)

        # 4. Feed-forwards
        x, hidden_states = norm(self.norm3, hidden_states, video_pending, video[4], video[3])
        hidden_states = hidden_states + self.ff(x) * video[5]
        x, audio_hidden_states = norm(self.audio_norm3, audio_hidden_states, audio_pending, audio[4], audio[3])
        audio_hidden_states = audio_hidden_states + self.audio_ff(x) * audio[5]
        return hidden_states, audio_hidden_states

    return forward


def _ltx_block_forward_of(norm):
    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, encoder_attention_mask=None):
        """diffusers' LTXVideoTransformerBlock: norm1 as ``norm``, "x + cross-attention, then
        norm2" as ``norm`` with the pending residual (``_norm`` or ``_norm_fp8``). With a hooked
        norm, diffusers' forward runs."""
        from diffusers.models.transformers.transformer_ltx2 import LTX2VideoTransformerBlock

        if patching.hooked(self, _LTX_NORMS):
            return type(self).forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                      encoder_attention_mask)
        # LTX-2's get_mod_params is the code LTX-Video's block writes inline
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = LTX2VideoTransformerBlock.get_mod_params(
            self.scale_shift_table, temb, hidden_states.size(0))
        x, _ = norm(self.norm1, hidden_states, None, scale_msa, shift_msa)
        attention = self.attn1(hidden_states=x, encoder_hidden_states=None, image_rotary_emb=image_rotary_emb)
        hidden_states = hidden_states + attention * gate_msa
        attention = self.attn2(hidden_states, encoder_hidden_states=encoder_hidden_states, image_rotary_emb=None,
                               attention_mask=encoder_attention_mask)
        x, hidden_states = norm(self.norm2, hidden_states, (attention, None), scale_mlp, shift_mlp)
        return hidden_states + self.ff(x) * gate_mlp

    return forward


# ----- attention: the RoPE --------------------------------------------------------------------


def _table_fits(table, rope_type, batch, tokens, width, head_dim) -> bool:
    """Whether (cos, sin) are the tables diffusers builds for rows [batch, tokens, width]."""
    wanted = ((batch, tokens, width) if rope_type == "interleaved"
              else (batch, width // head_dim, tokens, head_dim // 2))
    return all(tuple(t.shape) == wanted for t in table)


def _cache(table, rope_type, heads) -> torch.Tensor:
    """(cos, sin) as a cos/sin cache with a row per head, [B, S, H, Dh]: each head's Dh / 2 cos,
    then its Dh / 2 sin."""
    cos, sin = table
    if rope_type == "interleaved":  # [B, S, H * Dh], every pair's value repeated
        return patching.cos_sin_cache(cos.unflatten(-1, (heads, -1)), sin.unflatten(-1, (heads, -1)))
    # [B, H, S, Dh / 2] each: diffusers' views of [B, S, H, Dh / 2] tables, read in that order
    return torch.cat([cos.transpose(1, 2), sin.transpose(1, 2)], dim=-1)


def _heads(x, attn):
    return x.unflatten(2, (attn.heads, -1))  # [B, S, H * Dh] -> [B, S, H, Dh]


def _token_rms_norms(attn) -> bool:
    """Whether attn's q/k norms are what qk_norm_rope_(norm_over="token") computes, as
    LTX2Attention and LTXAttention build them: torch.nn.RMSNorms over all of a token's heads, of
    one eps (a number; None would be the activations' machine epsilon)."""
    norm_q, norm_k = attn.norm_q, attn.norm_k
    return (type(norm_q) is torch.nn.RMSNorm and type(norm_k) is torch.nn.RMSNorm
            and tuple(norm_q.normalized_shape) == (attn.inner_dim,)
            and tuple(norm_k.normalized_shape) == (attn.inner_kv_dim,)
            and norm_q.eps is not None and norm_q.eps == norm_k.eps)


def _diffusers_rope(x, table, rope_type):
    from diffusers.models.transformers import transformer_ltx2 as ltx2

    # LTX-Video's apply_rotary_emb is LTX-2's interleaved code
    rotate = ltx2.apply_interleaved_rotary_emb if rope_type == "interleaved" else ltx2.apply_split_rotary_emb
    return rotate(x, table)


def _gated_output(attn, hidden_states, out):
    """LTX-2's per-head output gates where the attention has them (from its input rows), then
    the output projection."""
    if attn.to_gate_logits is not None:
        # diffusers' factor 2: zero-initialised logits give gates of 1
        gates = 2.0 * torch.sigmoid(attn.to_gate_logits(hidden_states))
        out = (out.unflatten(2, (attn.heads, -1)) * gates.unsqueeze(-1)).flatten(2, 3)
    return attn.to_out[1](attn.to_out[0](out))


class LTXRopeProcessor(patching.DitopsProcessor):
    """The ditops part of the LTX processors (subclasses below take diffusers' arguments): q
    and k through diffusers' projections, a self-attention's q/k norms and RoPE as one
    qk_norm_rope_, else diffusers' norms and rope_ (the module docstring says when), attention
    through dispatch_attention_fn with this processor's backend and parallel config. The
    projections take tensors or FP8 rows (quantize="fp8": the block's norms feed them)."""

    bypassed = ("norm_q", "norm_k")

    def fits(self, attn, hidden_states, context, query_table, key_table, rope_type) -> bool:
        # Under torch.compile diffusers' norms and RoPE stay. The cache is a copy of the tables per
        # call ([B, S, H, Dh] float32: as many values as q), which the RoPE Inductor fuses from
        # diffusers' code does without, reading the tables where they lie. With rope_ on rows of
        # folded heads, whose cache also transposed the split tables, compiled LTX-2 ran 0.93x
        # diffusers, 1.01x without (H100, benchmarks/models.py, 512x768; CUDA graphs 0.95x and
        # 0.985x). The per-head cache drops that transpose but not the copy; whether one
        # qk_norm_rope_ for the norms and RoPE wins it back there is unmeasured, so compiled calls
        # keep diffusers' code. Tensors then go to diffusers' processor; FP8 rows stay here, where
        # the projections take them (diffusers' processor takes tensors: dequantised, then
        # quantised again by each projection), and rotary_attention applies diffusers' code.
        return ((isinstance(hidden_states, Float8Rows) or not torch.compiler.is_compiling())
                and _table_fits(query_table, rope_type, *patching.batch_and_tokens(hidden_states), attn.inner_dim,
                                attn.head_dim)
                and _table_fits(key_table, rope_type, *patching.batch_and_tokens(context), attn.inner_kv_dim,
                                attn.head_dim))

    def rotary_attention(self, attn, hidden_states, context, query_table, key_table, rope_type) -> torch.Tensor:
        """Attention of [B, S, H * Dh] rows, before the output projection; key_table None: the
        query's (a self-attention: one cache for q and k)."""
        if torch.compiler.is_compiling():  # FP8 rows (``fits``): diffusers' norms and RoPE
            query = _heads(_diffusers_rope(attn.norm_q(attn.to_q(hidden_states)), query_table, rope_type), attn)
            key = _heads(_diffusers_rope(attn.norm_k(attn.to_k(context)),
                                         query_table if key_table is None else key_table, rope_type), attn)
        else:
            interleaved = rope_type == "interleaved"
            cache = _cache(query_table, rope_type, attn.heads)
            if key_table is None and _token_rms_norms(attn) and not patching.hooked(attn, self.bypassed):
                # the projections' outputs are new tensors: written in place
                query, key = ops.qk_norm_rope_(_heads(attn.to_q(hidden_states), attn), _heads(attn.to_k(context), attn),
                                               attn.norm_q.weight, attn.norm_k.weight, cache, interleaved=interleaved,
                                               eps=attn.norm_q.eps, norm_over="token")
            else:
                query = _heads(attn.norm_q(attn.to_q(hidden_states)), attn)
                key = _heads(attn.norm_k(attn.to_k(context)), attn)
                if key_table is None:
                    ops.rope_(query, key, cache, interleaved=interleaved)
                else:
                    ops.rope_(query, None, cache, interleaved=interleaved)
                    ops.rope_(key, None, _cache(key_table, rope_type, attn.heads), interleaved=interleaved)
        value = _heads(attn.to_v(context), attn)
        return self.attention(query, key, value).flatten(2, 3).type_as(query)


class LTXVideoRopeProcessor(LTXRopeProcessor):
    """diffusers' LTXVideoAttnProcessor with the RoPE as rope_ (``LTXRopeProcessor``). Calls
    without rotary tables, with a mask or context, or with tables of another shape go to
    diffusers' processor."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if (image_rotary_emb is None or encoder_hidden_states is not None or attention_mask is not None
                or not self.fits(attn, hidden_states, hidden_states, image_rotary_emb, image_rotary_emb,
                                 "interleaved")):
            return self.defer(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        out = self.rotary_attention(attn, hidden_states, hidden_states, image_rotary_emb, None, "interleaved")
        return attn.to_out[1](attn.to_out[0](out))


class LTX2RopeProcessor(LTXRopeProcessor):
    """diffusers' LTX2AudioVideoAttnProcessor with the RoPE as rope_ (``LTXRopeProcessor``), then
    its per-head output gates where the attention has them. Calls without rotary tables, with a
    mask, or with tables of another shape go to diffusers' processor."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None):
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        if (query_rotary_emb is None or attention_mask is not None
                or not self.fits(attn, hidden_states, context, query_rotary_emb,
                                 query_rotary_emb if key_rotary_emb is None else key_rotary_emb, attn.rope_type)):
            return self.defer(attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                              key_rotary_emb)
        out = self.rotary_attention(attn, hidden_states, context, query_rotary_emb, key_rotary_emb, attn.rope_type)
        return _gated_output(attn, hidden_states, out)


class LTX2TextQueryProcessor(patching.DitopsProcessor):
    """diffusers' LTX2AudioVideoAttnProcessor (LTX2PerturbedAttnProcessor computes the same for
    the text cross-attentions, which the block calls without perturbation) on a text
    cross-attention whose query side takes FP8 rows (quantize="fp8": ``norm2`` / ``audio_norm2``
    feed ``to_q`` and the gate logits); the text keys and values quantise their own input.
    Calls with tensors or rotary tables go to diffusers' processor."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None):
        if (not isinstance(hidden_states, Float8Rows) or encoder_hidden_states is None or query_rotary_emb is not None
                or key_rotary_emb is not None):
            return self.defer(attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                              key_rotary_emb)
        if attention_mask is not None:  # diffusers' code: the [B, 1, text] bias, per head
            batch_size, text = encoder_hidden_states.shape[:2]
            attention_mask = attn.prepare_attention_mask(attention_mask, text, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(attn.to_k(encoder_hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        out = self.attention(query, key, value, attention_mask).flatten(2, 3).to(query.dtype)
        return _gated_output(attn, hidden_states, out)


class LTX2PerturbedRopeProcessor(LTX2RopeProcessor):
    """diffusers' LTX2PerturbedAttnProcessor: without perturbation (the blocks outside
    ``spatio_temporal_guidance_blocks``) it computes LTX2AudioVideoAttnProcessor's attention, so
    ``LTX2RopeProcessor``; calls with STG perturbation go to diffusers' processor."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None, perturbation_mask=None, all_perturbed=None):
        if perturbation_mask is not None or (all_perturbed is not None and all_perturbed is not False):
            return self.defer(attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                              key_rotary_emb, perturbation_mask, all_perturbed)
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                                key_rotary_emb)


# ----- which blocks and attentions --------------------------------------------------------------


def _plain_rms_norms(block, names) -> bool:
    from diffusers.models.normalization import RMSNorm

    return all(type(getattr(block, name)) is RMSNorm and getattr(block, name).weight is None for name in names)


def _ltx2_processor_class(attn):
    """The ditops processor for an LTX-2 attention, or None."""
    from diffusers.models.transformers import transformer_ltx2 as ltx2

    processors = {ltx2.LTX2AudioVideoAttnProcessor: LTX2RopeProcessor,
                  ltx2.LTX2PerturbedAttnProcessor: LTX2PerturbedRopeProcessor}
    if type(attn) is not ltx2.LTX2Attention or attn.rope_type not in ("interleaved", "split"):
        return None
    return processors.get(type(attn.processor))


def _ltx_processor_class(attn):
    from diffusers.models.transformers import transformer_ltx as ltx

    supported = type(attn) is ltx.LTXAttention and type(attn.processor) is ltx.LTXVideoAttnProcessor
    return LTXVideoRopeProcessor if supported else None


def _forwards(forward_of) -> dict:
    """A block forward by whether its norms give FP8 rows."""
    return {False: forward_of(_norm), True: forward_of(_norm_fp8)}


# rotary: the attentions called with rotary tables, self_attentions those of them whose q and k
# share one (the others' have tables of their own); text_query_fed: whether a norm's output is the
# text cross-attentions' query (LTX-2's norm2s; LTX-Video's cross-attention reads the residual stream)
_LTX2 = dict(norms=_LTX2_NORMS, forwards=_forwards(_ltx2_block_forward_of), processor_class=_ltx2_processor_class,
             rotary=("attn1", "audio_attn1", "audio_to_video_attn", "video_to_audio_attn"),
             self_attentions=("attn1", "audio_attn1"),
             text=("attn2", "audio_attn2"), text_query_fed=True, feed_forwards=("ff", "audio_ff"),
             output="norm_out, audio_norm_out")
_LTX = dict(norms=_LTX_NORMS, forwards=_forwards(_ltx_block_forward_of), processor_class=_ltx_processor_class,
            rotary=("attn1",), self_attentions=("attn1",), text=("attn2",), text_query_fed=False, feed_forwards=("ff",),
            output="norm_out")
QK_NORM_ROPE = "qk_norm_rope_ (norm_over=token)"  # the report's op for a self-attention


def _sites(norms, fp8: bool) -> list:
    """(norm, op) per norm a block forward fuses."""
    ops_of = {"norm1": ("norm_scale_shift",), "audio_norm1": ("norm_scale_shift",),
              "audio_to_video_norm": ("residual_norm_scale_shift", "norm_scale_shift"),
              "video_to_audio_norm": ("residual_norm_scale_shift", "norm_scale_shift")}
    suffix = "_fp8" if fp8 else ""
    return [(name, ", ".join(op + suffix for op in ops_of.get(name, ("residual_norm_scale_shift",)))) for name in norms]


def patch(model, patches: list, report, fp8_dtype=None) -> None:
    """Patches the blocks' norms and the rotary attentions; with ``fp8_dtype`` the Linears run
    FP8, a block's fed FP8 rows by its norms where every attention they feed gets a ditops
    processor and all the Linears they feed became FP8 (the module docstring says which)."""
    from diffusers.models.transformers.transformer_ltx import LTXVideoTransformerBlock
    from diffusers.models.transformers.transformer_ltx2 import LTX2VideoTransformerBlock

    block_class, family = ((LTX2VideoTransformerBlock, _LTX2) if type(model).__name__ == "LTX2VideoTransformer3DModel"
                           else (LTXVideoTransformerBlock, _LTX))
    for index, block in enumerate(model.transformer_blocks):
        path = f"transformer_blocks.{index}"
        if not patching.is_block(report, block, block_class, path):
            continue
        plain = _plain_rms_norms(block, family["norms"])
        fp8 = plain and fp8_dtype is not None and _quantize_block(block, path, family, patches, report, fp8_dtype)
        if not plain:
            report.skipped.append(f"{path}: norms not RMSNorms without weight; left as they are")
        elif patching.replace_forward(patches, report, block, path, family["forwards"][fp8]):
            report.replaced += [(f"{path}.{name}", op) for name, op in _sites(family["norms"], fp8)]
        for name in family["rotary"]:
            attn = getattr(block, name)
            processor_class = family["processor_class"](attn)
            self_attention = name in family["self_attentions"]
            fused = self_attention and _token_rms_norms(attn)
            patching.replace_processor(patches, report, attn, f"{path}.{name}", processor_class is not None,
                                       processor_class, QK_NORM_ROPE if fused else "rope_")
            if processor_class is not None and self_attention and not fused:
                report.skipped.append(f"{path}.{name}: q/k norms not torch.nn.RMSNorms of one eps over all heads of a "
                                      "token: diffusers' norm_q / norm_k, then rope_")
        for name in family["text"]:
            if fp8 and family["text_query_fed"]:
                patching.replace_processor(patches, report, getattr(block, name), f"{path}.{name}", True,
                                           LTX2TextQueryProcessor, "FP8 query rows")
                continue
            report.skipped.append(f"{path}.{name}: text cross-attention, q/k RMSNorm without RoPE; left as it is")
            if fp8:
                report.skipped.append(f"{path}.{name}.to_q: quantises its own input (its query is the residual "
                                      "stream, which no norm precedes)")
    if len(family["rotary"]) > len(family["self_attentions"]):
        report.skipped.append("the audio-video attentions' q/k RMSNorm: diffusers' norm_q / norm_k, then rope_ on q "
                              "and on k (their tokens and tables differ; qk_norm_rope_ takes q and k of one table)")
    report.skipped.append(f"{family['output']}: the output LayerNorm and its modulation; left as it is")
    if fp8_dtype is not None:
        quantize.replace_rest(model, patches, report, fp8_dtype)


def _quantize_block(block, path, family, patches, report, fp8_dtype) -> bool:
    """The Linears the block's norms feed -> FP8: q, k, v of the rotary attentions (their query
    and context rows are norm outputs), q of the text cross-attentions where ``text_query_fed``
    (their keys and values are the text), LTX-2.3's gate logits beside each q, and the GELU-tanh MLPs
    (GELU + quantisation fused); True where the norms may give them FP8 rows: every one of those
    attentions gets a ditops processor (diffusers' take tensors) and replace_fed took them all."""
    attentions = family["rotary"] + (family["text"] if family["text_query_fed"] else ())
    others = [name for name in attentions if family["processor_class"](getattr(block, name)) is None]
    if others:
        report.skipped.append(f"{path}: its norms give bf16 (the attention processor of {', '.join(others)} "
                              "is not ditops')")
        return False
    linears = []
    for name in attentions:
        attn = getattr(block, name)
        names = ("to_q",) + (("to_k", "to_v") if name in family["rotary"] else ())
        gates = ("to_gate_logits",) if getattr(attn, "to_gate_logits", None) is not None else ()
        linears += quantize.fed(attn, names + gates, f"{path}.{name}")
    feed_forwards = {f"{path}.{name}": getattr(block, name) for name in family["feed_forwards"]}
    return quantize.replace_fed_with_feed_forwards(patches, report, linears, feed_forwards, fp8_dtype, path)
