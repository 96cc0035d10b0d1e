"""Chroma (``ChromaTransformer2DModel``) under ditops.

Chroma is FLUX.1 with the modulation Linears pruned: one approximator computes every block's
modulation up front, and each block receives its rows ([B, 6, D] per stream in double blocks,
[B, 3, D] in single blocks). The attention is diffusers' FLUX attention itself
(``FluxAttention`` with ``FluxAttnProcessor``), with a text-and-image attention mask.

- ``ChromaAdaLayerNormZeroPruned`` and ``ChromaAdaLayerNormZeroSinglePruned`` -> ``norm_scale_shift``
  (the modulation rows stay [B, D] views).
- In double blocks, the gated residual add of the attention output followed by ``norm2`` and
  its modulation -> ``residual_norm_scale_shift``, on both streams.
- In every attention processor, the q/k RMSNorms and the RoPE -> ``qk_norm_rope_`` through
  FLUX's processor (``flux.FluxQKNormRopeProcessor``); the attention mask goes to attention
  unchanged.

With ``quantize="fp8"`` (quantize.py) a block whose processor became ditops' runs as FLUX's
does (flux.py): its norms give FP8 rows to the Linears they feed, the double blocks' GELU MLPs
quantise their hidden state in one pass, and a single block quantises its attention output and
GELU(MLP) together for proj_out.
"""

from __future__ import annotations

import torch

from . import flux, patching, quantize


def _pruned_norm_forward_of(norm):
    def forward(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
        """diffusers' ChromaAdaLayerNormZeroPruned: the six modulation rows of ``emb`` [B, 6, D],
        the first two applied to LayerNorm(x)."""
        if patching.hooked(self, ("norm",)):
            return type(self).forward(self, x, timestep, class_labels, hidden_dtype, emb)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.flatten(1, 2).chunk(6, dim=1)
        return norm(x, scale_msa, shift_msa, self.norm.eps), gate_msa, shift_mlp, scale_mlp, gate_mlp

    return forward


def _pruned_single_norm_forward_of(norm):
    def forward(self, x, emb=None):
        if patching.hooked(self, ("norm",)):
            return type(self).forward(self, x, emb)
        shift_msa, scale_msa, gate_msa = emb.flatten(1, 2).chunk(3, dim=1)
        return norm(x, scale_msa, shift_msa, self.norm.eps), gate_msa

    return forward


def _double_block_forward_of(residual_norm):
    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, attention_mask=None,
                joint_attention_kwargs=None):
        """diffusers' ChromaTransformerBlock with each "residual + gate * attention, then norm2 and
        its modulation" as one residual_norm_scale_shift. temb holds the image stream's six rows,
        then the text stream's."""
        if patching.hooked(self, ("norm2", "norm2_context")):
            return type(self).forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                      attention_mask, joint_attention_kwargs)
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb[:, :6])
        norm_context, context_gate_msa, context_shift_mlp, context_scale_mlp, context_gate_mlp = self.norm1_context(
            encoder_hidden_states, emb=temb[:, 6:])
        if attention_mask is not None:  # [B, S] keep-mask -> [B, 1, S, S]: a pair attends where both tokens are kept
            attention_mask = attention_mask[:, None, None, :] * attention_mask[:, None, :, None]
        outputs = self.attn(hidden_states=norm_hidden_states, encoder_hidden_states=norm_context,
                            image_rotary_emb=image_rotary_emb, attention_mask=attention_mask,
                            **(joint_attention_kwargs or {}))
        return flux.after_attention(self, outputs, hidden_states, encoder_hidden_states,
                                    (gate_msa, shift_mlp, scale_mlp, gate_mlp),
                                    (context_gate_msa, context_shift_mlp, context_scale_mlp, context_gate_mlp),
                                    residual_norm)

    return forward


def _single_block_forward_fp8(self, hidden_states, temb, image_rotary_emb=None, attention_mask=None,
                              joint_attention_kwargs=None):
    """diffusers' ChromaSingleTransformerBlock with FP8 GEMMs, as flux._single_block_forward_fp8."""
    if self.training or patching.hooked(self, ("act_mlp",)):
        return type(self).forward(self, hidden_states, temb, image_rotary_emb, attention_mask, joint_attention_kwargs)
    residual = hidden_states
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
    mlp_hidden_states = self.proj_mlp(norm_hidden_states)
    if attention_mask is not None:
        attention_mask = attention_mask[:, None, None, :] * attention_mask[:, None, :, None]
    attention = self.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                          attention_mask=attention_mask, **(joint_attention_kwargs or {}))
    return flux.single_block_output_fp8(self, residual, gate, mlp_hidden_states, attention)


# The ditops forwards: {FP8 rows from the norms?: forward}
_PRUNED_NORM_FORWARDS = {False: _pruned_norm_forward_of(flux._norm), True: _pruned_norm_forward_of(flux._norm_fp8)}
_PRUNED_SINGLE_NORM_FORWARDS = {False: _pruned_single_norm_forward_of(flux._norm),
                                True: _pruned_single_norm_forward_of(flux._norm_fp8)}
_DOUBLE_BLOCK_FORWARDS = {False: _double_block_forward_of(flux._residual_norm),
                          True: _double_block_forward_of(flux._residual_norm_fp8)}


def _layer_norm(norm) -> bool:
    """nn.LayerNorm without affine parameters; not FP32LayerNorm (``norm_type="fp32_layer_norm"``),
    whose bf16 rounding differs."""
    return type(norm) is torch.nn.LayerNorm and norm.weight is None and norm.bias is None


def _double_block_supported(block) -> bool:
    from diffusers.models.transformers.transformer_chroma import ChromaAdaLayerNormZeroPruned, ChromaTransformerBlock

    # norm.emb: the pruned norm can embed timesteps itself (num_embeddings); Chroma's blocks do not
    norm1s_supported = all(type(norm) is ChromaAdaLayerNormZeroPruned and norm.emb is None and _layer_norm(norm.norm)
                           for norm in (block.norm1, block.norm1_context))
    return (type(block) is ChromaTransformerBlock and norm1s_supported and _layer_norm(block.norm2)
            and _layer_norm(block.norm2_context))


def patch(model, patches: list, report, fp8_dtype=None) -> None:
    """Patches Chroma's blocks; with ``fp8_dtype`` in FP8 as flux.patch does FLUX's."""
    from diffusers.models.transformers.transformer_chroma import ChromaAdaLayerNormZeroSinglePruned

    for index, block in enumerate(model.transformer_blocks):
        path = f"transformer_blocks.{index}"
        patching.replace_processor(patches, report, block.attn, f"{path}.attn", flux._attention_supported(block.attn),
                                   flux.FluxQKNormRopeProcessor, "qk_norm_rope_")
        if _double_block_supported(block):
            fp8 = fp8_dtype is not None and flux._quantize_double_block(block, path, patches, report, fp8_dtype)
            suffix = "_fp8" if fp8 else ""
            for name in ("norm1", "norm1_context"):
                if patching.replace_forward(patches, report, getattr(block, name), f"{path}.{name}",
                                            _PRUNED_NORM_FORWARDS[fp8]):
                    report.replaced.append((f"{path}.{name}", "norm_scale_shift" + suffix))
            if patching.replace_forward(patches, report, block, path, _DOUBLE_BLOCK_FORWARDS[fp8]):
                report.replaced.append((f"{path}.norm2, {path}.norm2_context", "residual_norm_scale_shift" + suffix))
        else:
            report.skipped.append(f"{path}: another block type, or norms with affine parameters, an embedding "
                                  "or of another type")
    for index, block in enumerate(model.single_transformer_blocks):
        path = f"single_transformer_blocks.{index}"
        patching.replace_processor(patches, report, block.attn, f"{path}.attn", flux._attention_supported(block.attn),
                                   flux.FluxQKNormRopeProcessor, "qk_norm_rope_")
        if not (type(block.norm) is ChromaAdaLayerNormZeroSinglePruned and _layer_norm(block.norm.norm)):
            report.skipped.append(f"{path}.norm: a norm with affine parameters or another type")
            continue
        fp8 = fp8_dtype is not None and flux._quantize_single_block(block, path, patches, report, fp8_dtype,
                                                                    _single_block_forward_fp8)
        if patching.replace_forward(patches, report, block.norm, f"{path}.norm", _PRUNED_SINGLE_NORM_FORWARDS[fp8]):
            report.replaced.append((f"{path}.norm", "norm_scale_shift" + ("_fp8" if fp8 else "")))
    if fp8_dtype is not None:
        quantize.replace_rest(model, patches, report, fp8_dtype)
