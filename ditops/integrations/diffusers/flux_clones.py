"""The FLUX.1 copies of diffusers under ditops: LongCat-Image (``LongCatImageTransformer2DModel``),
Ovis-Image (``OvisImageTransformer2DModel``), Bria 3.2 (``BriaTransformer2DModel``) and FIBO
(``BriaFiboTransformer2DModel``).

Their double blocks are FLUX.1's ``FluxTransformerBlock`` under another name (Ovis-Image's MLPs
are SwiGLU), their single blocks keep FLUX.1's
``AdaLayerNormZeroSingle``, and their attention processors compute what ``FluxAttnProcessor``
computes (heads split as ``attn.heads`` x rest instead of rest x ``attn.head_dim``: the same
split where heads x head_dim is the inner width, which ``patch`` checks). So FLUX's ditops
forwards and processor serve them (flux.py says what they replace):

- ``norm1``, ``norm1_context`` and the single blocks' ``norm`` -> ``norm_scale_shift``;
- the double blocks' residual add with ``norm2`` / ``norm2_context`` -> ``residual_norm_scale_shift``;
- the q/k RMSNorms and the RoPE -> ``qk_norm_rope_`` (``flux.FluxQKNormRopeProcessor``).

FIBO's single blocks run diffusers' generic ``Attention`` with Bria's processor and
diffusers' own RMSNorm for q and k (the same math as ``torch.nn.RMSNorm``, in float32): FLUX's
processor serves it too.

With ``quantize="fp8"`` a block whose processor became ditops' runs FLUX's FP8 forms
(flux.py): the norms give FP8 rows to the Linears they feed, the double blocks' GELU MLPs
quantise their hidden state in one pass (Ovis-Image's SwiGLU MLPs take the rows in their up
projection; the down projection quantises its own input), and LongCat-Image's and Bria's single
blocks, which compute FLUX's single block, quantise the attention output and GELU(MLP)
together; so do FIBO's single blocks, which compute FLUX's single block on one token sequence
(no text stream beside it). Ovis-Image's single block, whose diffusers forward hands its norm's
output to ``proj_mlp`` and the attention alone, keeps that forward: those Linears take the rows,
and ``proj_out`` quantises its own input.
"""

from __future__ import annotations

import torch

from . import flux, patching, quantize


def _bria(forward):
    """FLUX's block forward for Bria's blocks, which name ``joint_attention_kwargs`` ``attention_kwargs``."""
    def bria_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, attention_kwargs=None):
        return forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb, attention_kwargs)

    return bria_forward


_BRIA_DOUBLE_BLOCK_FORWARDS = {fp8: _bria(forward) for fp8, forward in flux._DOUBLE_BLOCK_FORWARDS.items()}
_bria_single_block_forward_fp8 = _bria(flux._single_block_forward_fp8)


def _fibo_single_block_forward_fp8(self, hidden_states, temb, image_rotary_emb=None, joint_attention_kwargs=None):
    """diffusers' BriaFiboSingleTransformerBlock with FP8 GEMMs (flux.single_block_fp8)."""
    if self.training or patching.hooked(self, ("act_mlp",)):
        return type(self).forward(self, hidden_states, temb, image_rotary_emb, joint_attention_kwargs)
    return flux.single_block_fp8(self, hidden_states, temb, image_rotary_emb, joint_attention_kwargs)


def _processors() -> tuple:
    """The clones' processors, each checked against FluxAttnProcessor in diffusers 0.42."""
    from diffusers.models.transformers.transformer_bria import BriaAttnProcessor
    from diffusers.models.transformers.transformer_bria_fibo import BriaFiboAttnProcessor
    from diffusers.models.transformers.transformer_longcat_image import LongCatImageAttnProcessor
    from diffusers.models.transformers.transformer_ovis_image import OvisImageAttnProcessor

    return BriaAttnProcessor, BriaFiboAttnProcessor, LongCatImageAttnProcessor, OvisImageAttnProcessor


def _rms_norm(norm, eps) -> bool:
    """torch's RMSNorm, or diffusers' (FIBO's generic Attention), with a weight, no bias, at ``eps``."""
    from diffusers.models.normalization import RMSNorm

    return (type(norm) in (torch.nn.RMSNorm, RMSNorm) and norm.weight is not None
            and getattr(norm, "bias", None) is None and norm.eps == eps)


def _attention_supported(attn) -> bool:
    if type(attn.processor) not in _processors() or attn.inner_dim % attn.heads:
        return False
    norms = [attn.norm_q, attn.norm_k] + ([attn.norm_added_q, attn.norm_added_k] if attn.added_kv_proj_dim else [])
    return all(_rms_norm(norm, attn.norm_q.eps) for norm in norms)


def _double_blocks() -> tuple:
    """The clones' double blocks, each checked against FluxTransformerBlock in diffusers 0.42."""
    from diffusers.models.transformers.transformer_bria import BriaTransformerBlock
    from diffusers.models.transformers.transformer_bria_fibo import BriaFiboTransformerBlock
    from diffusers.models.transformers.transformer_longcat_image import LongCatImageTransformerBlock
    from diffusers.models.transformers.transformer_ovis_image import OvisImageTransformerBlock

    return BriaTransformerBlock, BriaFiboTransformerBlock, LongCatImageTransformerBlock, OvisImageTransformerBlock


def _single_blocks() -> tuple:
    """The clones' single blocks whose forward is FluxSingleTransformerBlock's in diffusers 0.42
    (Bria's naming attention_kwargs), which flux._single_block_forward_fp8 replaces."""
    from diffusers.models.transformers.transformer_bria import BriaSingleTransformerBlock
    from diffusers.models.transformers.transformer_longcat_image import LongCatImageSingleTransformerBlock

    return BriaSingleTransformerBlock, LongCatImageSingleTransformerBlock


def _single_block_fp8_forward(block):
    """The FP8 forward of a single block of _single_blocks() or FIBO's, by its class; None for
    flux._quantize_single_block's default (FLUX's)."""
    from diffusers.models.transformers.transformer_bria import BriaSingleTransformerBlock
    from diffusers.models.transformers.transformer_bria_fibo import BriaFiboSingleTransformerBlock

    return {BriaSingleTransformerBlock: _bria_single_block_forward_fp8,
            BriaFiboSingleTransformerBlock: _fibo_single_block_forward_fp8}.get(type(block))


def _quantize_ovis_single_block(block, path, patches, report, fp8_dtype) -> bool:
    """Ovis-Image's single block (diffusers 0.42: its forward hands the norm's output to
    ``proj_mlp``, whose output its SwiGLU splits, and to the attention, nothing else): q/k/v
    (one GEMM) and ``proj_mlp`` -> FP8, fed FP8 rows by diffusers' forward; True where the norm
    may give them."""
    if not quantize.takes_rows(report, block.attn, flux.FluxQKNormRopeProcessor, path):
        return False
    linears = quantize.fed(block.attn, flux._QKV, f"{path}.attn") + quantize.fed(block, ("proj_mlp",), path)
    if not quantize.replace_fed(patches, report, linears, fp8_dtype, path):
        return False
    quantize.join_projections(patches, report, block.attn, f"{path}.attn", {"to_qkv": flux._QKV})
    return True


def _ada_layer_norm_zero(norm, single: bool) -> bool:
    from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle

    wanted = AdaLayerNormZeroSingle if single else AdaLayerNormZero
    return type(norm) is wanted and patching.plain_layer_norm(norm.norm)


def patch(model, patches: list, report, fp8_dtype=None) -> None:
    """Patches the clones' blocks as flux.patch does FLUX's, with ``fp8_dtype`` in FP8 where
    flux.py's FP8 forms compute what the block computes."""
    from diffusers.models.transformers.transformer_bria import BriaTransformerBlock
    from diffusers.models.transformers.transformer_bria_fibo import BriaFiboSingleTransformerBlock
    from diffusers.models.transformers.transformer_ovis_image import OvisImageSingleTransformerBlock

    for index, block in enumerate(model.transformer_blocks):
        path = f"transformer_blocks.{index}"
        patching.replace_processor(patches, report, block.attn, f"{path}.attn", _attention_supported(block.attn),
                                   flux.FluxQKNormRopeProcessor, "qk_norm_rope_")
        norm1s = (block.norm1, block.norm1_context)
        norm2s = (block.norm2, block.norm2_context)
        if (type(block) in _double_blocks() and all(_ada_layer_norm_zero(norm, False) for norm in norm1s)
                and all(map(patching.plain_layer_norm, norm2s))):
            fp8 = fp8_dtype is not None and flux._quantize_double_block(block, path, patches, report, fp8_dtype)
            suffix = "_fp8" if fp8 else ""
            for name in ("norm1", "norm1_context"):
                if patching.replace_forward(patches, report, getattr(block, name), f"{path}.{name}",
                                            flux._NORM_FORWARDS[fp8]):
                    report.replaced.append((f"{path}.{name}", "norm_scale_shift" + suffix))
            forward = (_BRIA_DOUBLE_BLOCK_FORWARDS[fp8] if type(block) is BriaTransformerBlock
                       else flux._DOUBLE_BLOCK_FORWARDS[fp8])
            if patching.replace_forward(patches, report, block, path, forward):
                report.replaced.append((f"{path}.norm2, {path}.norm2_context", "residual_norm_scale_shift" + suffix))
        else:
            report.skipped.append(f"{path}: another block type, or norms with affine parameters or of another type")
    for index, block in enumerate(model.single_transformer_blocks):
        path = f"single_transformer_blocks.{index}"
        patching.replace_processor(patches, report, block.attn, f"{path}.attn", _attention_supported(block.attn),
                                   flux.FluxQKNormRopeProcessor, "qk_norm_rope_")
        fp8 = False
        if fp8_dtype is not None and type(block) is OvisImageSingleTransformerBlock:
            fp8 = _quantize_ovis_single_block(block, path, patches, report, fp8_dtype)
        elif fp8_dtype is not None and type(block) not in _single_blocks() + (BriaFiboSingleTransformerBlock,):
            report.skipped.append(f"{path}: its norm gives bf16 (a single block of another kind than FLUX's)")
        elif fp8_dtype is not None:
            fp8 = flux._quantize_single_block(block, path, patches, report, fp8_dtype, _single_block_fp8_forward(block))
        if not _ada_layer_norm_zero(block.norm, True):
            report.skipped.append(f"{path}.norm: a norm with affine parameters or another type")
        elif patching.replace_forward(patches, report, block.norm, f"{path}.norm",
                                      flux._SINGLE_NORM_FORWARDS[fp8]):
            report.replaced.append((f"{path}.norm", "norm_scale_shift" + ("_fp8" if fp8 else "")))
    if fp8_dtype is not None:
        quantize.replace_rest(model, patches, report, fp8_dtype)
