"""FLUX.2 (``Flux2Transformer2DModel``: dev, klein) under ditops.

FLUX.2 keeps FLUX.1's two kinds of block but moves the modulation out of them: the model
computes it once per stream ([B, 1, D] chunks, or [B, S, D] where reference tokens get their
own modulation) and the blocks hold plain LayerNorms.

- In double blocks, ``norm1`` / ``norm1_context`` and their modulation -> ``norm_scale_shift``;
  the gated residual add of the attention output followed by ``norm2`` / ``norm2_context`` and
  their modulation -> ``residual_norm_scale_shift``.
- In single blocks, ``norm`` and its modulation -> ``norm_scale_shift``.
- The q/k RMSNorms and the RoPE (4 axes, text rows then image rows) -> ``qk_norm_rope_``: in
  double blocks through FLUX's processor (``flux.FluxQKNormRopeProcessor``; ``Flux2AttnProcessor``
  computes what ``FluxAttnProcessor`` does), in single blocks on the q and k slices of the fused
  qkv + MLP projection (``Flux2ParallelQKNormRopeProcessor``).

With ``quantize="fp8"`` (quantize.py) the norms give FP8 rows (``norm_scale_shift_fp8``,
``residual_norm_scale_shift_fp8``) to the Linears they feed, now FP8: q/k/v of both streams
(one GEMM per stream), the SwiGLU MLPs' ``linear_in``, and the single blocks' fused qkv + MLP
projection. The SwiGLU output and the single blocks' [attention, SwiGLU(MLP)] quantise their
own rows in their Linears (``quantize_fp8`` has no SwiGLU). A block whose processor is not
ditops', or one of whose fed Linears cannot be FP8, keeps bf16 norms.

The KV-cache processors of FLUX.2 klein (``Flux2KVAttnProcessor``,
``Flux2KVParallelSelfAttnProcessor``) are left as they are and reported; the block forwards
serve them too, since they call whatever processor the attention holds.
"""

from __future__ import annotations

import torch

from ... import ops
from . import flux, patching, quantize


def _double_block_forward_of(norm, residual_norm):
    def forward(self, hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt, image_rotary_emb=None,
                joint_attention_kwargs=None):
        """diffusers' Flux2TransformerBlock with each modulated norm as ``norm`` and each
        "residual + gate * attention, then norm2 and its modulation" as ``residual_norm``
        (flux.py's: tensors, or FP8 rows for the Linears they feed)."""
        from diffusers.models.transformers.transformer_flux2 import Flux2Modulation

        if patching.hooked(self, ("norm1", "norm1_context", "norm2", "norm2_context")):
            return type(self).forward(self, hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt,
                                      image_rotary_emb, joint_attention_kwargs)
        (shift_msa, scale_msa, gate_msa), (shift_mlp, scale_mlp, gate_mlp) = Flux2Modulation.split(temb_mod_img, 2)
        context_msa, context_mlp = Flux2Modulation.split(temb_mod_txt, 2)
        (context_shift_msa, context_scale_msa, context_gate_msa) = context_msa
        (context_shift_mlp, context_scale_mlp, context_gate_mlp) = context_mlp
        norm_hidden_states = norm(hidden_states, scale_msa, shift_msa, self.norm1.eps)
        norm_context = norm(encoder_hidden_states, context_scale_msa, context_shift_msa, self.norm1_context.eps)
        attention, context_attention = self.attn(hidden_states=norm_hidden_states, encoder_hidden_states=norm_context,
                                                 image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))

        norm_hidden_states, hidden_states = residual_norm(attention, hidden_states, gate_msa, scale_mlp, shift_mlp,
                                                          self.norm2.eps)
        hidden_states = hidden_states + gate_mlp * self.ff(norm_hidden_states)

        norm_context, encoder_hidden_states = residual_norm(context_attention, encoder_hidden_states, context_gate_msa,
                                                            context_scale_mlp, context_shift_mlp, self.norm2_context.eps)
        encoder_hidden_states = encoder_hidden_states + context_gate_mlp * self.ff_context(norm_context)
        if encoder_hidden_states.dtype == torch.float16:
            encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
        return encoder_hidden_states, hidden_states

    return forward


def _single_block_forward_of(norm):
    def forward(self, hidden_states, encoder_hidden_states, temb_mod, image_rotary_emb=None,
                joint_attention_kwargs=None, split_hidden_states=False, text_seq_len=None):
        """diffusers' Flux2SingleTransformerBlock with its modulated norm as ``norm``."""
        from diffusers.models.transformers.transformer_flux2 import Flux2Modulation

        if patching.hooked(self, ("norm",)):
            return type(self).forward(self, hidden_states, encoder_hidden_states, temb_mod, image_rotary_emb,
                                      joint_attention_kwargs, split_hidden_states, text_seq_len)
        if encoder_hidden_states is not None:  # else the text rows are already in front of hidden_states
            text_seq_len = encoder_hidden_states.shape[1]
            hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        shift, scale, gate = Flux2Modulation.split(temb_mod, 1)[0]
        norm_hidden_states = norm(hidden_states, scale, shift, self.norm.eps)
        attention = self.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                              **(joint_attention_kwargs or {}))
        hidden_states = hidden_states + gate * attention
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        if split_hidden_states:
            return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
        return hidden_states

    return forward


_DOUBLE_BLOCK_FORWARDS = {False: _double_block_forward_of(flux._norm, flux._residual_norm),
                          True: _double_block_forward_of(flux._norm_fp8, flux._residual_norm_fp8)}
_SINGLE_BLOCK_FORWARDS = {False: _single_block_forward_of(flux._norm), True: _single_block_forward_of(flux._norm_fp8)}


class Flux2ParallelQKNormRopeProcessor(patching.DitopsProcessor):
    """diffusers' Flux2ParallelSelfAttnProcessor with the q/k RMSNorms and the RoPE as
    qk_norm_rope_, in place on the q and k slices of the fused projection's output. Without
    rotary embeddings it defers to the original."""

    bypassed = ("norm_q", "norm_k")

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        if image_rotary_emb is None or patching.hooked(attn, self.bypassed):
            return self.defer(attn, hidden_states, attention_mask, image_rotary_emb)
        projected = attn.to_qkv_mlp_proj(hidden_states)
        # split by the global qkv : MLP ratio, as diffusers does, so a column-sharded projection splits alike
        qkv_width = 3 * attn.inner_dim
        local_qkv = projected.shape[-1] * qkv_width // (qkv_width + attn.mlp_hidden_dim * attn.mlp_mult_factor)
        qkv, mlp_hidden_states = projected.split([local_qkv, projected.shape[-1] - local_qkv], dim=-1)
        query, key, value = qkv.chunk(3, dim=-1)
        query, key = patching.writable(query, key)
        query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in (query, key, value))
        # the returned q and k: under torch.compile the graph then need not rebuild the projection around them
        query, key = ops.qk_norm_rope_(query, key, attn.norm_q.weight, attn.norm_k.weight,
                                       patching.cos_sin_cache(*image_rotary_emb), eps=attn.norm_q.eps)
        out = self.attention(query, key, value, attention_mask).flatten(2, 3).to(query.dtype)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp_hidden_states)], dim=-1))


def _norms_supported(attn) -> bool:
    norms = [attn.norm_q, attn.norm_k] + ([attn.norm_added_q, attn.norm_added_k]
                                          if getattr(attn, "added_kv_proj_dim", None) else [])
    return all(type(norm) is torch.nn.RMSNorm and norm.weight is not None and norm.eps == attn.norm_q.eps
               for norm in norms)


def patch(model, patches: list, report, fp8_dtype=None) -> None:
    """Patches FLUX.2's blocks; with ``fp8_dtype`` their Linears run FP8, fed FP8 rows by the
    norms where a block's processor is ditops' and all the Linears its norms feed became FP8."""
    from diffusers.models.transformers.transformer_flux2 import (Flux2AttnProcessor, Flux2ParallelSelfAttnProcessor,
                                                                 Flux2SingleTransformerBlock, Flux2TransformerBlock)

    for index, block in enumerate(model.transformer_blocks):
        path = f"transformer_blocks.{index}"
        supported = type(block.attn.processor) is Flux2AttnProcessor and _norms_supported(block.attn)
        patching.replace_processor(patches, report, block.attn, f"{path}.attn", supported,
                                   flux.FluxQKNormRopeProcessor, "qk_norm_rope_")
        norms = (block.norm1, block.norm1_context, block.norm2, block.norm2_context)
        if type(block) is Flux2TransformerBlock and all(map(patching.plain_layer_norm, norms)):
            fp8 = fp8_dtype is not None and _quantize_double_block(block, path, patches, report, fp8_dtype)
            suffix = "_fp8" if fp8 else ""
            if patching.replace_forward(patches, report, block, path, _DOUBLE_BLOCK_FORWARDS[fp8]):
                report.replaced.append((f"{path}.norm1, {path}.norm1_context", "norm_scale_shift" + suffix))
                report.replaced.append((f"{path}.norm2, {path}.norm2_context", "residual_norm_scale_shift" + suffix))
        else:
            report.skipped.append(f"{path}: another block type, or norms with affine parameters or of another type")
    for index, block in enumerate(model.single_transformer_blocks):
        path = f"single_transformer_blocks.{index}"
        supported = type(block.attn.processor) is Flux2ParallelSelfAttnProcessor and _norms_supported(block.attn)
        patching.replace_processor(patches, report, block.attn, f"{path}.attn", supported,
                                   Flux2ParallelQKNormRopeProcessor, "qk_norm_rope_")
        if type(block) is Flux2SingleTransformerBlock and patching.plain_layer_norm(block.norm):
            fp8 = fp8_dtype is not None and _quantize_single_block(block, path, patches, report, fp8_dtype)
            if patching.replace_forward(patches, report, block, path, _SINGLE_BLOCK_FORWARDS[fp8]):
                report.replaced.append((f"{path}.norm", "norm_scale_shift" + ("_fp8" if fp8 else "")))
        else:
            report.skipped.append(f"{path}: another block type, or a norm with affine parameters or of another type")
    if fp8_dtype is not None:
        quantize.replace_rest(model, patches, report, fp8_dtype)


def _quantize_double_block(block, path, patches, report, fp8_dtype) -> bool:
    """The Linears the block's norms feed -> FP8 (q/k/v of both streams, each joined into one
    GEMM, and both MLPs' linear_in); True where the norms may give them FP8 rows."""
    if not quantize.takes_rows(report, block.attn, flux.FluxQKNormRopeProcessor, path):
        return False
    linears = (quantize.fed(block.attn, flux._QKV + flux._ADDED_QKV, f"{path}.attn")
               + quantize.fed(block.ff, ("linear_in",), f"{path}.ff")
               + quantize.fed(block.ff_context, ("linear_in",), f"{path}.ff_context"))
    if not quantize.replace_fed(patches, report, linears, fp8_dtype, path):
        return False
    quantize.join_projections(patches, report, block.attn, f"{path}.attn",
                              {"to_qkv": flux._QKV, "to_added_qkv": flux._ADDED_QKV})
    return True


def _quantize_single_block(block, path, patches, report, fp8_dtype) -> bool:
    """The Linear the block's norm feeds -> FP8 (the fused qkv + MLP projection); True where
    the norm may give it FP8 rows."""
    if not quantize.takes_rows(report, block.attn, Flux2ParallelQKNormRopeProcessor, path):
        return False
    return quantize.replace_fed(patches, report, quantize.fed(block.attn, ("to_qkv_mlp_proj",), f"{path}.attn"),
                                fp8_dtype, path)
