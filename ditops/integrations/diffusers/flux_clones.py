"""The FLUX.1 copies of diffusers under ditops: LongCat-Image (``LongCatImageTransformer2DModel``),
Ovis-Image (``OvisImageTransformer2DModel``), Bria 3.2 (``BriaTransformer2DModel``) and FIBO
(``BriaFiboTransformer2DModel``).

Their double blocks are FLUX.1's ``FluxTransformerBlock`` under another name (Ovis-Image's MLPs
are SwiGLU, which ditops does not touch), their single blocks keep FLUX.1's
``AdaLayerNormZeroSingle``, and their attention processors compute what ``FluxAttnProcessor``
computes (heads split as ``attn.heads`` x rest instead of rest x ``attn.head_dim``: the same
split where heads x head_dim is the inner width, which ``patch`` checks). So FLUX's ditops
forwards and processor serve them (flux.py says what they replace):

- ``norm1``, ``norm1_context`` and the single blocks' ``norm`` -> ``norm_scale_shift``;
- the double blocks' residual add with ``norm2`` / ``norm2_context`` -> ``residual_norm_scale_shift``;
- the q/k RMSNorms and the RoPE -> ``qk_norm_rope_`` (``flux.FluxQKNormRopeProcessor``).

FIBO's single blocks run diffusers' generic ``Attention`` (diffusers' own RMSNorm, no
``head_dim``) with Bria's processor: ditops leaves that attention alone and reports it.
"""

from __future__ import annotations

import torch

from . import flux, patching


def _bria_double_block_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                               attention_kwargs=None):
    """BriaTransformerBlock names FLUX's ``joint_attention_kwargs`` ``attention_kwargs``."""
    return flux._double_block_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                      attention_kwargs)


def _processors() -> tuple:
    """The clones' processors, each checked against FluxAttnProcessor in diffusers 0.42."""
    from diffusers.models.transformers.transformer_bria import BriaAttnProcessor
    from diffusers.models.transformers.transformer_bria_fibo import BriaFiboAttnProcessor
    from diffusers.models.transformers.transformer_longcat_image import LongCatImageAttnProcessor
    from diffusers.models.transformers.transformer_ovis_image import OvisImageAttnProcessor

    return BriaAttnProcessor, BriaFiboAttnProcessor, LongCatImageAttnProcessor, OvisImageAttnProcessor


def _attention_supported(attn) -> bool:
    if type(attn.processor) not in _processors() or getattr(attn, "head_dim", None) is None:
        return False
    norms = [attn.norm_q, attn.norm_k] + ([attn.norm_added_q, attn.norm_added_k] if attn.added_kv_proj_dim else [])
    return attn.heads * attn.head_dim == attn.inner_dim and all(
        type(norm) is torch.nn.RMSNorm and norm.weight is not None and norm.eps == attn.norm_q.eps for norm in norms)


def _double_blocks() -> tuple:
    """The clones' double blocks, each checked against FluxTransformerBlock in diffusers 0.42."""
    from diffusers.models.transformers.transformer_bria import BriaTransformerBlock
    from diffusers.models.transformers.transformer_bria_fibo import BriaFiboTransformerBlock
    from diffusers.models.transformers.transformer_longcat_image import LongCatImageTransformerBlock
    from diffusers.models.transformers.transformer_ovis_image import OvisImageTransformerBlock

    return BriaTransformerBlock, BriaFiboTransformerBlock, LongCatImageTransformerBlock, OvisImageTransformerBlock


def _ada_layer_norm_zero(norm, single: bool) -> bool:
    from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle

    wanted = AdaLayerNormZeroSingle if single else AdaLayerNormZero
    return type(norm) is wanted and patching.plain_layer_norm(norm.norm)


def patch(model, patches: list, report) -> None:
    from diffusers.models.transformers.transformer_bria import BriaTransformerBlock

    for index, block in enumerate(model.transformer_blocks):
        path = f"transformer_blocks.{index}"
        norm1s = (block.norm1, block.norm1_context)
        norm2s = (block.norm2, block.norm2_context)
        if (type(block) in _double_blocks() and all(_ada_layer_norm_zero(norm, False) for norm in norm1s)
                and all(map(patching.plain_layer_norm, norm2s))):
            for name in ("norm1", "norm1_context"):
                if patching.replace_forward(patches, report, getattr(block, name), f"{path}.{name}",
                                            flux._ada_layer_norm_zero_forward):
                    report.replaced.append((f"{path}.{name}", "norm_scale_shift"))
            forward = _bria_double_block_forward if type(block) is BriaTransformerBlock else flux._double_block_forward
            if patching.replace_forward(patches, report, block, path, forward):
                report.replaced.append((f"{path}.norm2, {path}.norm2_context", "residual_norm_scale_shift"))
        else:
            report.skipped.append(f"{path}: another block type, or norms with affine parameters or of another type")
        patching.replace_processor(patches, report, block.attn, f"{path}.attn", _attention_supported(block.attn),
                                   flux.FluxQKNormRopeProcessor, "qk_norm_rope_")
    for index, block in enumerate(model.single_transformer_blocks):
        path = f"single_transformer_blocks.{index}"
        if not _ada_layer_norm_zero(block.norm, True):
            report.skipped.append(f"{path}.norm: a norm with affine parameters or another type")
        elif patching.replace_forward(patches, report, block.norm, f"{path}.norm",
                                      flux._ada_layer_norm_zero_single_forward):
            report.replaced.append((f"{path}.norm", "norm_scale_shift"))
        patching.replace_processor(patches, report, block.attn, f"{path}.attn", _attention_supported(block.attn),
                                   flux.FluxQKNormRopeProcessor, "qk_norm_rope_")
