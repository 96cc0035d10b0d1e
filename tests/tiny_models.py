"""Tiny random-weight diffusers models, built on CPU without a download, that the integration
tests share.

Two kinds of builder: tiny_flux, tiny_wan, tiny_qwen and tiny_z_image take the dtype and give
(model, inputs, blocks the signal goes through); the others give a float32 model with random norm
weights (``built``) and its inputs, (model, inputs), which ``in_dtype`` turns into the first kind.
"""

import warnings

import pytest
import torch

diffusers = pytest.importorskip("diffusers")


def cast(model, dtype):
    """The model in eval mode and in ``dtype``, without diffusers' note about casting."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' note about casting with .to()
        return model.eval().to(dtype)


# ----- FLUX, Wan, Qwen-Image and Z-Image, in a given dtype ----------------------------------------

# real_width: the attention of the real model (heads x 128, RoPE axes as the model's), all
# else tiny; for the GPU runs under torchrun (tests/test_diffusers_context_parallel.py).
REAL_ROPE_AXES = (16, 56, 56)


def tiny_flux(dtype, real_width=False):
    """FLUX.1: two double-stream and two single-stream blocks."""
    torch.manual_seed(0)
    heads, head_dim, axes = (24, 128, REAL_ROPE_AXES) if real_width else (2, 16, (4, 4, 8))
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=head_dim,
        num_attention_heads=heads, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=axes)
    generator = torch.Generator().manual_seed(1)
    batch, image_tokens, text_tokens = 2, 12, 5
    inputs = dict(
        hidden_states=torch.randn(batch, image_tokens, 8, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, 32, generator=generator),
        pooled_projections=torch.randn(batch, 32, generator=generator),
        timestep=torch.rand(batch, generator=generator),
    )
    inputs = {name: value.to(dtype) for name, value in inputs.items()}
    inputs.update(img_ids=torch.randn(image_tokens, 3, generator=generator) * 8, txt_ids=torch.zeros(text_tokens, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' note about casting with .to()
        model = model.eval().to(dtype)
    return model, inputs, 4  # blocks the signal goes through


def tiny_wan(dtype, real_width=False):
    """Wan: two blocks, q/k norms over all heads."""
    torch.manual_seed(0)
    heads, head_dim = (12, 128) if real_width else (2, 16)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32)
    generator = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(2, 4, 3, 8, 8, generator=generator).to(dtype),
                  timestep=torch.tensor([10.0, 500.0]),
                  encoder_hidden_states=torch.randn(2, 7, 32, generator=generator).to(dtype))
    return cast(model, dtype), inputs, 2


def tiny_qwen(dtype, edit=False, real_width=False):
    """Qwen-Image; with edit, the zero_cond_t variant whose image tokens after the first
    image take the second modulation set (modulate_index, Qwen-Image-Edit)."""
    torch.manual_seed(0)
    heads, head_dim, axes = (24, 128, REAL_ROPE_AXES) if real_width else (2, 16, (4, 6, 6))
    model = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=head_dim, num_attention_heads=heads,
        joint_attention_dim=32, axes_dims_rope=axes, zero_cond_t=edit)
    generator = torch.Generator().manual_seed(1)
    shapes = [(1, 4, 4), (1, 2, 4)] if edit else [(1, 4, 4)]
    tokens = sum(frames * height * width for frames, height, width in shapes)
    inputs = dict(hidden_states=torch.randn(2, tokens, 16, generator=generator).to(dtype),
                  encoder_hidden_states=torch.randn(2, 7, 32, generator=generator).to(dtype),
                  encoder_hidden_states_mask=torch.ones(2, 7), timestep=torch.tensor([0.1, 0.7]).to(dtype),
                  img_shapes=[shapes] * 2)
    return cast(model, dtype), inputs, 2


def tiny_z_image(dtype, heads: int = 2):
    """Z-Image: a noise refiner, a context refiner and two layers, heads of 32; 3 heads give FFN
    widths an FP8 GEMM takes (multiples of 16: 96 -> 256)."""
    torch.manual_seed(0)
    model = diffusers.ZImageTransformer2DModel(dim=32 * heads, n_layers=2, n_refiner_layers=1, n_heads=heads, n_kv_heads=heads,
                                               in_channels=4, cap_feat_dim=32, axes_dims=[8, 12, 12],
                                               axes_lens=[64, 32, 32])
    generator = torch.Generator().manual_seed(1)
    inputs = dict(x=[torch.randn(4, 1, 8, 8, generator=generator).to(dtype) for _ in range(2)],
                  t=torch.tensor([0.3, 0.8]).to(dtype),
                  cap_feats=[torch.randn(7, 32, generator=generator).to(dtype), torch.randn(9, 32, generator=generator).to(dtype)])
    return cast(model, dtype), inputs, 4  # a noise refiner, a context refiner and two layers


def z_image_noise_mask_call(model, dtype):
    """A call of the model's first layer as Z-Image Omni makes it: random noisy and clean
    modulation inputs and a noise_mask holding both kinds of token."""
    block, generator = model.layers[0], torch.Generator().manual_seed(5)
    batch, tokens, embedding = 2, 11, block.adaLN_modulation[0].in_features
    x = torch.randn(batch, tokens, model.dim, generator=generator).to(dtype)
    positions = torch.randint(0, 8, (batch * tokens, 3), generator=generator)
    freqs_cis = model.rope_embedder(positions).view(batch, tokens, -1)
    noise_mask = torch.randint(0, 2, (batch, tokens), generator=generator)
    assert 0 < noise_mask.sum() < noise_mask.numel()
    noisy, clean = (torch.randn(batch, embedding, generator=generator).to(dtype) for _ in range(2))
    return lambda: block(x, None, freqs_cis, noise_mask=noise_mask, adaln_noisy=noisy, adaln_clean=clean)


# ----- float32, with random norm weights: the families past the first four --------------------------


def built(model_class, **config):
    """The model with random norm weights (diffusers initialises them to 1), so that a norm
    applied with another's weights shows."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' notes about configs and casting
        model = model_class(**config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and name.endswith("weight") and parameter.ndim == 1:
                parameter.uniform_(0.5, 1.5)
    return model


def in_dtype(build):
    """``build``'s float32 (model, inputs) as a builder taking the dtype; position ids stay float32, as tiny_flux's."""
    def converted(value, dtype):
        if isinstance(value, list):
            return [converted(item, dtype) for item in value]
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    def tiny(dtype):
        model, inputs = build()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # diffusers' note about casting with .to()
            model = model.to(dtype)
        kept = getattr(model, "_keep_in_fp32_modules", None) or ()  # as from_pretrained(torch_dtype=...) keeps them
        for name, parameter in model.named_parameters():
            if any(module in name.split(".") for module in kept):
                parameter.data = parameter.data.float()
        return model, {name: value if name.endswith("_ids") else converted(value, dtype)
                       for name, value in inputs.items()}, None

    return tiny


# ----- FLUX.1-shaped: Chroma and the copies -------------------------------------------------------

# the FLUX.1 config the FLUX.1-shaped families share
FLUX_SHAPE = dict(patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 4, 8))


def flux_inputs(text_tokens=5, image_tokens=12, **extra):
    """Inputs of a FLUX_SHAPE model, ``extra`` added to them."""
    generator = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(2, image_tokens, 8, generator=generator),
                  encoder_hidden_states=torch.randn(2, text_tokens, 32, generator=generator),
                  timestep=torch.rand(2, generator=generator),
                  img_ids=torch.randn(image_tokens, 3, generator=generator) * 8, txt_ids=torch.zeros(text_tokens, 3))
    inputs.update(extra)
    return inputs


def tiny_chroma():
    """Chroma: FLUX.1's shape, with the pipeline's attention mask."""
    model = built(diffusers.ChromaTransformer2DModel, **FLUX_SHAPE, approximator_num_channels=16,
                  approximator_hidden_dim=32, approximator_layers=1)
    # the pipeline's mask: the text keep-mask (the second prompt is 3 tokens long), then the image tokens
    text_mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2])
    return model, flux_inputs(attention_mask=torch.cat([text_mask, torch.ones(2, 12)], dim=1))


def tiny_longcat_image():
    """LongCat-Image: FLUX.1's shape."""
    return built(diffusers.LongCatImageTransformer2DModel, **FLUX_SHAPE, pooled_projection_dim=32), flux_inputs()


def tiny_ovis_image():
    """Ovis-Image: FLUX.1's shape."""
    return built(diffusers.OvisImageTransformer2DModel, **FLUX_SHAPE, out_channels=8), flux_inputs()


def tiny_bria():
    """Bria: FLUX.1's shape, with pooled projections."""
    generator = torch.Generator().manual_seed(2)
    return (built(diffusers.BriaTransformer2DModel, **FLUX_SHAPE, pooled_projection_dim=32),
            flux_inputs(pooled_projections=torch.randn(2, 32, generator=generator)))


def tiny_bria_fibo():
    """Bria FIBO: FLUX.1's shape, with a text encoder layer per block."""
    model = built(diffusers.BriaFiboTransformer2DModel, **FLUX_SHAPE, text_encoder_dim=16)
    generator = torch.Generator().manual_seed(2)
    layers = [torch.randn(2, 5, 16, generator=generator) for _ in range(4)]  # one per block
    return model, flux_inputs(text_encoder_layers=layers)


# ----- the Wan family -----------------------------------------------------------------------------

# the Wan config the Wan family shares
WAN_SHAPE = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                 text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32)


def wan_inputs(frames=3, **extra):
    """Inputs of a WAN_SHAPE model, ``extra`` added to them."""
    generator = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(2, 4, frames, 8, 8, generator=generator),
                  timestep=torch.tensor([10.0, 500.0]), encoder_hidden_states=torch.randn(2, 7, 32, generator=generator))
    inputs.update(extra)
    return inputs


def tiny_wan_vace():
    """Two Wan blocks and one VACE control block (layers [0]): the control block has Wan's layout
    and computes something else (input and output projections, a control stream)."""
    model = built(diffusers.WanVACETransformer3DModel, **WAN_SHAPE, vace_layers=[0], vace_in_channels=8)
    generator = torch.Generator().manual_seed(2)
    return model, wan_inputs(control_hidden_states=torch.randn(2, 8, 3, 8, 8, generator=generator))


def tiny_wan_animate():
    """Wan-Animate's blocks are a copy of WanTransformerBlock in its own module; between them run
    face adapters (no Wan layout), fed by a tiny motion encoder on 8x8 face frames."""
    model = built(diffusers.WanAnimateTransformer3DModel, **dict(WAN_SHAPE, in_channels=None), latent_channels=4,
                  image_dim=None, motion_encoder_channel_sizes={"8": 4, "4": 4}, motion_encoder_size=8,
                  motion_style_dim=8, motion_dim=4, motion_encoder_dim=16, face_encoder_hidden_dim=32,
                  face_encoder_num_heads=2, inject_face_latents_blocks=1)
    generator = torch.Generator().manual_seed(2)
    return model, wan_inputs(hidden_states=torch.randn(2, 12, 3, 8, 8, generator=generator),
                             pose_hidden_states=torch.randn(2, 4, 2, 8, 8, generator=generator),
                             face_pixel_values=torch.randn(2, 3, 2, 8, 8, generator=generator))


def tiny_wan_i2v():
    """Wan I2V: the cross-attentions also attend to image-context k/v (add_k_proj, norm_added_k);
    diffusers' processor takes the last 512 context tokens as the text."""
    model = built(diffusers.WanTransformer3DModel, **WAN_SHAPE, image_dim=16, added_kv_proj_dim=32)
    generator = torch.Generator().manual_seed(2)
    return model, wan_inputs(encoder_hidden_states=torch.randn(2, 512, 32, generator=generator),
                             encoder_hidden_states_image=torch.randn(2, 5, 16, generator=generator))


def tiny_chronoedit():
    """ChronoEdit: Wan's shape."""
    return built(diffusers.ChronoEditTransformer3DModel, **WAN_SHAPE), wan_inputs()


def tiny_skyreels_v2():
    """Diffusion forcing: one timestep per frame (per-token modulation) and a causal mask over
    blocks of two frames."""
    model = built(diffusers.SkyReelsV2Transformer3DModel, **WAN_SHAPE, num_frame_per_block=2)
    return model, wan_inputs(frames=4, timestep=torch.tensor([[10.0, 10.0, 500.0, 500.0], [900.0, 900.0, 20.0, 20.0]]),
                             enable_diffusion_forcing=True)


def tiny_helios(amplify_history=True, layers=2, history=True):
    """Helios: Wan's layout with short-history latents before the video (2 + 3 frames, 80 tokens);
    its cross-attention runs on the video tokens only (guidance_cross_attn), its history keys
    take a learned per-head scale (is_amplify_history; in bfloat16 diffusers 0.42.1 fails there,
    its float32 scale making the keys float32), and each batch item has its own frame indices,
    so its own RoPE table."""
    shape = {key: value for key, value in WAN_SHAPE.items() if key != "rope_max_seq_len"} | {"num_layers": layers}
    model = built(diffusers.HeliosTransformer3DModel, **shape, rope_dim=(4, 6, 6), is_amplify_history=amplify_history)
    with torch.no_grad():
        for block in model.blocks if amplify_history else ():
            block.attn1.history_key_scale.uniform_(-1.0, 1.0)  # not one value for every head
    generator = torch.Generator().manual_seed(2)
    short = dict(latents_history_short=torch.randn(2, 4, 2, 8, 8, generator=generator),
                 indices_latents_history_short=torch.tensor([[0, 1], [0, 2]]))
    return model, wan_inputs(**(short if history else {}), indices_hidden_states=torch.tensor([[2, 3, 4], [3, 4, 5]]))


# ----- SD3 / SD3.5 --------------------------------------------------------------------------------


def tiny_sd3(sd35=False):
    """SD3, or SD3.5 (per-head q/k RMSNorm; the first block with SD3.5 Medium's dual attention).
    The last block's text stream ends at its attention (context_pre_only)."""
    model = built(diffusers.SD3Transformer2DModel, sample_size=8, patch_size=2, in_channels=4, num_layers=2,
                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=32,
                  pooled_projection_dim=16, out_channels=4, pos_embed_max_size=8,
                  qk_norm="rms_norm" if sd35 else None, dual_attention_layers=(0,) if sd35 else ())
    generator = torch.Generator().manual_seed(1)
    return model, dict(hidden_states=torch.randn(2, 4, 8, 8, generator=generator),
                       encoder_hidden_states=torch.randn(2, 5, 16, generator=generator),
                       pooled_projections=torch.randn(2, 16, generator=generator), timestep=torch.tensor([10.0, 600.0]))


# ----- FLUX.2 -------------------------------------------------------------------------------------


def tiny_flux2():
    """FLUX.2: two double-stream and two single-stream blocks, 4-axis position ids."""
    model = built(diffusers.Flux2Transformer2DModel, patch_size=1, in_channels=8, num_layers=2, num_single_layers=2,
                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=16,
                  axes_dims_rope=(4, 4, 4, 4))
    generator = torch.Generator().manual_seed(1)
    return model, dict(hidden_states=torch.randn(2, 12, 8, generator=generator),
                       encoder_hidden_states=torch.randn(2, 5, 32, generator=generator),
                       timestep=torch.rand(2, generator=generator), guidance=torch.tensor([3.5, 3.5]),
                       img_ids=torch.randn(12, 4, generator=generator) * 8,
                       txt_ids=torch.randn(5, 4, generator=generator) * 2)


# ----- the HunyuanVideo family: 1.0, Framepack, 1.5, HunyuanImage 2.1 -----------------------------

# the config the HunyuanVideo family shares
HUNYUAN_SHAPE = dict(num_attention_heads=2, attention_head_dim=16, num_layers=2, num_refiner_layers=1)


def hunyuan_text(generator, tokens=7):
    """Text states and the pipeline's keep-mask: the second prompt is 4 tokens long."""
    return (torch.randn(2, tokens, 32, generator=generator),
            torch.tensor([[1] * tokens, [1] * 4 + [0] * (tokens - 4)], dtype=torch.long))


def tiny_hunyuan_video(image_condition_type=None):
    """HunyuanVideo 1.0; image_condition_type="token_replace" gives its image-to-video blocks."""
    model = built(diffusers.HunyuanVideoTransformer3DModel, **HUNYUAN_SHAPE, in_channels=4, out_channels=4,
                  num_single_layers=2, patch_size=2, text_embed_dim=32, pooled_projection_dim=16,
                  rope_axes_dim=(4, 6, 6), image_condition_type=image_condition_type)
    generator = torch.Generator().manual_seed(1)
    text, mask = hunyuan_text(generator)
    return model, dict(hidden_states=torch.randn(2, 4, 3, 8, 8, generator=generator),
                       timestep=torch.tensor([10.0, 500.0]), encoder_hidden_states=text, encoder_attention_mask=mask,
                       pooled_projections=torch.randn(2, 16, generator=generator),
                       guidance=torch.tensor([3500.0, 3500.0]))


def tiny_hunyuan_video_framepack():
    """Framepack packs the clean and history latents (1x, 2x, 4x, with their own RoPE rows)
    before the video tokens and puts the image tokens before the text."""
    model = built(diffusers.HunyuanVideoFramepackTransformer3DModel, **HUNYUAN_SHAPE, in_channels=4, out_channels=4,
                  num_single_layers=2, patch_size=2, text_embed_dim=32, pooled_projection_dim=16,
                  rope_axes_dim=(4, 6, 6), has_image_proj=True, image_proj_dim=16, has_clean_x_embedder=True)
    generator = torch.Generator().manual_seed(1)
    text, mask = hunyuan_text(generator)
    return model, dict(hidden_states=torch.randn(2, 4, 2, 8, 8, generator=generator),
                       timestep=torch.tensor([10.0, 500.0]), encoder_hidden_states=text, encoder_attention_mask=mask,
                       pooled_projections=torch.randn(2, 16, generator=generator),
                       image_embeds=torch.randn(2, 3, 16, generator=generator), indices_latents=torch.arange(1, 3),
                       guidance=torch.tensor([3500.0, 3500.0]),
                       latents_clean=torch.randn(2, 4, 1, 8, 8, generator=generator),
                       indices_latents_clean=torch.tensor([0]),
                       latents_history_2x=torch.randn(2, 4, 2, 8, 8, generator=generator),
                       indices_latents_history_2x=torch.arange(-2, 0),
                       latents_history_4x=torch.randn(2, 4, 4, 8, 8, generator=generator),
                       indices_latents_history_4x=torch.arange(-6, -2))


def tiny_hunyuan_video15():
    """Image-to-video: the image tokens, the ByT5 tokens and the text tokens, each with a mask."""
    model = built(diffusers.HunyuanVideo15Transformer3DModel, **HUNYUAN_SHAPE, in_channels=4, out_channels=4,
                  text_embed_dim=32, text_embed_2_dim=16, image_embed_dim=16, rope_axes_dim=(4, 6, 6))
    generator = torch.Generator().manual_seed(1)
    text, mask = hunyuan_text(generator)
    return model, dict(hidden_states=torch.randn(2, 4, 3, 4, 4, generator=generator),
                       timestep=torch.tensor([10.0, 500.0]), encoder_hidden_states=text, encoder_attention_mask=mask,
                       encoder_hidden_states_2=torch.randn(2, 3, 16, generator=generator),
                       encoder_attention_mask_2=torch.tensor([[1, 1, 1], [1, 1, 0]]),
                       image_embeds=torch.randn(2, 2, 16, generator=generator))


def tiny_hunyuan_image():
    """HunyuanImage 2.1: the text and the ByT5 tokens, each with a mask."""
    model = built(diffusers.HunyuanImageTransformer2DModel, **HUNYUAN_SHAPE, in_channels=4, out_channels=4,
                  num_single_layers=2, patch_size=(1, 1), text_embed_dim=32, text_embed_2_dim=16,
                  rope_axes_dim=(8, 8))
    generator = torch.Generator().manual_seed(1)
    text, mask = hunyuan_text(generator)
    return model, dict(hidden_states=torch.randn(2, 4, 4, 4, generator=generator), timestep=torch.tensor([10.0, 500.0]),
                       encoder_hidden_states=text, encoder_attention_mask=mask,
                       encoder_hidden_states_2=torch.randn(2, 3, 16, generator=generator),
                       encoder_attention_mask_2=torch.tensor([[1, 1, 1], [1, 1, 0]]))


# ----- Lumina2 ------------------------------------------------------------------------------------


def tiny_lumina2():
    """Grouped-query attention (4 query heads, 2 k/v heads); the second prompt is 4 tokens long,
    so the joint blocks get the key mask."""
    model = built(diffusers.Lumina2Transformer2DModel, sample_size=8, patch_size=2, in_channels=4, hidden_size=64,
                  num_layers=2, num_refiner_layers=1, num_attention_heads=4, num_kv_heads=2, multiple_of=16,
                  axes_dim_rope=(4, 6, 6), axes_lens=(32, 16, 16), cap_feat_dim=32)
    generator = torch.Generator().manual_seed(1)
    text, mask = hunyuan_text(generator)
    return model, dict(hidden_states=torch.randn(2, 4, 8, 8, generator=generator), timestep=torch.tensor([0.1, 0.7]),
                       encoder_hidden_states=text, encoder_attention_mask=mask)


# ----- Cosmos -------------------------------------------------------------------------------------


def tiny_cosmos(image_context=False):
    """Cosmos 1.0: one timestep per item, a text mask. With image_context (2.5's blocks): the
    image-context cross-attention and per-frame timesteps ([B, S, D] modulation)."""
    model = built(diffusers.CosmosTransformer3DModel, in_channels=4, out_channels=4, num_attention_heads=2,
                  attention_head_dim=16, num_layers=2, text_embed_dim=32, adaln_lora_dim=16, max_size=(8, 16, 16),
                  concat_padding_mask=False, img_context_dim_in=16 if image_context else None,
                  img_context_num_tokens=3, img_context_dim_out=32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "pos_emb" in name:  # diffusers initialises the learnable positions to 0
                parameter.uniform_(0.5, 1.5)
    generator = torch.Generator().manual_seed(1)
    text, mask = hunyuan_text(generator)
    inputs = dict(hidden_states=torch.randn(2, 4, 3, 8, 8, generator=generator))
    if image_context:
        return model, dict(inputs, timestep=torch.rand(2, 1, 3, 1, 1, generator=generator),
                           encoder_hidden_states=(text, torch.randn(2, 3, 16, generator=generator)))
    return model, dict(inputs, timestep=torch.tensor([0.1, 0.7]), encoder_hidden_states=text,
                       attention_mask=mask.bool())


# ----- Kandinsky 5 --------------------------------------------------------------------------------


def tiny_kandinsky5():
    """Two text blocks, two visual blocks; the modulations (zero in diffusers' init) random."""
    model = built(diffusers.Kandinsky5Transformer3DModel, in_visual_dim=4, in_text_dim=32, in_text_dim2=16,
                  time_dim=32, out_visual_dim=4, patch_size=(1, 2, 2), model_dim=48, ff_dim=64, num_text_blocks=2,
                  num_visual_blocks=2, axes_dims=(8, 8, 8))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "modulation" in name:
                parameter.normal_(0, 0.2)
    generator = torch.Generator().manual_seed(1)
    return model, dict(hidden_states=torch.randn(2, 3, 8, 8, 4, generator=generator),
                       encoder_hidden_states=torch.randn(2, 7, 32, generator=generator),
                       timestep=torch.tensor([0.1, 0.7]), pooled_projections=torch.randn(2, 16, generator=generator),
                       visual_rope_pos=(torch.arange(3), torch.arange(4), torch.arange(4)),
                       text_rope_pos=torch.arange(7))


# ----- HiDream-I1 ---------------------------------------------------------------------------------


def tiny_hidream(experts=2):
    """Two double-stream and two single-stream blocks (mixture-of-experts FFNs unless experts=0),
    a square image."""
    model = built(diffusers.HiDreamImageTransformer2DModel, patch_size=2, in_channels=4, num_layers=2,
                  num_single_layers=2, attention_head_dim=16, num_attention_heads=2, caption_channels=[16, 24],
                  text_emb_dim=20, num_routed_experts=experts, num_activated_experts=1, axes_dims_rope=(4, 6, 6),
                  max_resolution=(16, 16), llama_layers=[0, 1, 2, 3])
    generator = torch.Generator().manual_seed(1)
    return model, dict(hidden_states=torch.randn(2, 4, 8, 8, generator=generator), timesteps=torch.tensor([100, 700]),
                       encoder_hidden_states_t5=torch.randn(2, 5, 16, generator=generator),
                       encoder_hidden_states_llama3=torch.randn(4, 2, 3, 24, generator=generator),
                       pooled_embeds=torch.randn(2, 20, generator=generator))


# ----- LTX-Video and LTX-2 ------------------------------------------------------------------------


def tiny_ltx():
    """LTX-Video: a 2 x 4 x 4 video, an all-ones text mask (the text cross-attention takes it)."""
    model = built(diffusers.LTXVideoTransformer3DModel, in_channels=8, out_channels=8, num_attention_heads=2,
                  attention_head_dim=16, cross_attention_dim=32, num_layers=2, caption_channels=24)
    generator = torch.Generator().manual_seed(1)
    return model, dict(hidden_states=torch.randn(2, 32, 8, generator=generator),
                       encoder_hidden_states=torch.randn(2, 6, 24, generator=generator),
                       timestep=torch.tensor([100, 700]), encoder_attention_mask=torch.ones(2, 6), num_frames=2,
                       height=4, width=4)


def tiny_ltx2(rope_type="interleaved", ltx23=False):
    """LTX-2: a 2 x 4 x 4 video and 5 audio frames, head widths 16 (video) and 8 (audio). With
    ltx23, LTX-2.3's options: the text query and key/value modulation, per-head output gates,
    the STG processor, and per-token video timesteps ([B, S, D] modulation)."""
    model = built(diffusers.LTX2VideoTransformer3DModel, in_channels=8, out_channels=8, num_attention_heads=2,
                  attention_head_dim=16, cross_attention_dim=32, audio_in_channels=4, audio_out_channels=4,
                  audio_num_attention_heads=2, audio_attention_head_dim=8, audio_cross_attention_dim=16, num_layers=2,
                  caption_channels=24, rope_type=rope_type, cross_attn_mod=ltx23, audio_cross_attn_mod=ltx23,
                  gated_attn=ltx23, audio_gated_attn=ltx23, perturbed_attn=ltx23)
    generator = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(2, 32, 8, generator=generator),
                  audio_hidden_states=torch.randn(2, 5, 4, generator=generator),
                  encoder_hidden_states=torch.randn(2, 6, 24, generator=generator),
                  audio_encoder_hidden_states=torch.randn(2, 6, 24, generator=generator),
                  timestep=torch.tensor([100.0, 700.0]), num_frames=2, height=4, width=4, audio_num_frames=5)
    if ltx23:
        inputs.update(timestep=torch.rand(2, 32, generator=generator) * 1000, audio_timestep=torch.tensor([300.0, 500.0]),
                      sigma=torch.tensor([0.1, 0.7]))
    return model, inputs


# ----- CogVideoX (1.0, 1.5) and ConsisID ---------------------------------------------------------

# CogVideoX-shaped: two blocks, heads of 32
COGVIDEOX_HEADS, COGVIDEOX_HEAD_DIM, COGVIDEOX_TEXT = 2, 32, 7
COGVIDEOX_SIZE = dict(in_channels=4, out_channels=4, time_embed_dim=32, text_embed_dim=32, num_layers=2,
                      sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
                      max_text_seq_length=COGVIDEOX_TEXT)


def _resize_crop_region_for_grid(source, target_width, target_height):
    """diffusers' pipeline_cogvideox.get_resize_crop_region_for_grid (that module imports transformers)."""
    height, width = source
    if height / width > target_height / target_width:
        resize_height, resize_width = target_height, int(round(target_height / height * width))
    else:
        resize_width, resize_height = target_width, int(round(target_width / width * height))
    top, left = int(round((target_height - resize_height) / 2.0)), int(round((target_width - resize_width) / 2.0))
    return (top, left), (top + resize_height, left + resize_width)


def rotary_tables(model, frames, height, width):
    """(cos, sin) as CogVideoXPipeline._prepare_rotary_positional_embeddings builds them from
    the latents' frames, height and width (1.0: a grid cropped to the sample size; 1.5, with
    patch_size_t: slices of the sample-size grid)."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    config = model.config
    p, p_t = config.patch_size, config.get("patch_size_t")
    grid = (height // p, width // p)
    base_width, base_height = config.sample_width // p, config.sample_height // p
    if p_t is None:
        return get_3d_rotary_pos_embed(embed_dim=config.attention_head_dim,
                                       crops_coords=_resize_crop_region_for_grid(grid, base_width, base_height),
                                       grid_size=grid, temporal_size=frames)
    return get_3d_rotary_pos_embed(embed_dim=config.attention_head_dim, crops_coords=None, grid_size=grid,
                                   temporal_size=(frames + p_t - 1) // p_t, grid_type="slice",
                                   max_size=(base_height, base_width))


def _random_layer_norms(model):
    """Random LayerNorm weights and biases (diffusers initialises them to 1 and 0), so that a norm
    applied with another's parameters, or without its bias, shows."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and parameter.ndim == 1:
                parameter.uniform_(0.5, 1.5) if name.endswith("weight") else parameter.normal_(0.0, 0.3)
    return model


def cogvideox_inputs(model, frames=3, height=8, width=8, rope=True, **extra):
    generator = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(2, frames, 4, height, width, generator=generator),
                  encoder_hidden_states=torch.randn(2, COGVIDEOX_TEXT, 32, generator=generator),
                  timestep=torch.tensor([10, 500]),
                  image_rotary_emb=rotary_tables(model, frames, height, width) if rope else None)
    inputs.update(extra)
    return inputs


def tiny_cogvideox(rope=True, **config):
    """CogVideoX 1.0 (5B's layout: rotary embeddings, q/k LayerNorms): two blocks, heads of 32."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = diffusers.CogVideoXTransformer3DModel(num_attention_heads=COGVIDEOX_HEADS, attention_head_dim=COGVIDEOX_HEAD_DIM,
                                                      use_rotary_positional_embeddings=rope, **COGVIDEOX_SIZE, **config).eval()
    return _random_layer_norms(model), cogvideox_inputs(model, rope=rope)


def tiny_cogvideox15():
    """CogVideoX 1.5 (I2V's layout): patch_size_t=2, the ofs embedding; 4 latent frames -> 2."""
    model, _ = tiny_cogvideox(patch_size_t=2, ofs_embed_dim=32)
    return model, cogvideox_inputs(model, frames=4, ofs=torch.tensor([2.0, 2.0]))


def tiny_consisid(face=False):
    """ConsisID: CogVideoX's blocks; with face, its face modules (a local facial extractor and
    a perceiver cross-attention after every other block), 3 heads (kv width 2/3 of 96)."""
    torch.manual_seed(0)
    heads = 3 if face else COGVIDEOX_HEADS
    faces = dict(is_train_face=True, cross_attn_interval=2, cross_attn_dim_head=16, cross_attn_num_heads=2,
                 LFE_id_dim=32, LFE_vit_dim=32, LFE_depth=2, LFE_dim_head=16, LFE_num_heads=2, LFE_num_id_token=2,
                 LFE_num_querie=4, LFE_output_dim=2 * heads * COGVIDEOX_HEAD_DIM // 3, LFE_ff_mult=2, LFE_num_scale=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = diffusers.ConsisIDTransformer3DModel(num_attention_heads=heads, attention_head_dim=COGVIDEOX_HEAD_DIM,
                                                     use_rotary_positional_embeddings=True, **COGVIDEOX_SIZE,
                                                     **(faces if face else {})).eval()
    generator = torch.Generator().manual_seed(2)
    extra = dict(id_cond=torch.randn(2, 32, generator=generator),
                 id_vit_hidden=[torch.randn(2, 5, 32, generator=generator) for _ in range(2)]) if face else {}
    return _random_layer_norms(model), cogvideox_inputs(model, **extra)


# ----- MiniMax-H3 ---------------------------------------------------------------------------------

def tiny_minimax_h3(refiner_layers=1):
    """MiniMax-H3: one packed sequence of 5 text, 8 video and 3 audio rows in a shuffled order,
    two timesteps, so the rows select six of the blocks' modulation rows; the RoPE rotates 12
    of each head's 16 channels."""
    model = built(diffusers.MiniMaxH3Transformer3DModel, num_attention_heads=2, attention_head_dim=16, hidden_size=32,
                  num_layers=2, num_refiner_layers=refiner_layers, ffn_dim=64, in_channels=4, audio_in_channels=4,
                  patch_size=(1, 2, 2), text_dim=24, freq_dim=16, time_embed_hidden_dim=32, time_embed_dim=16,
                  rope_freq_dim=2)
    generator = torch.Generator().manual_seed(1)
    text, video, audio = 5, 8, 3
    order = torch.randperm(text + video + audio, generator=generator)
    text_indices, video_indices, audio_indices = (part.sort().values for part in order.split([text, video, audio]))
    tags = torch.zeros(len(order), dtype=torch.long)
    tags[text_indices], tags[audio_indices] = 1, 2  # diffusers' modality tags: 0 video, 1 text, 2 audio
    return model, dict(hidden_states=torch.randn(2, video, 16, generator=generator),
                       audio_hidden_states=torch.randn(2, audio, 4, generator=generator),
                       encoder_hidden_states=torch.randn(2, text, 24, generator=generator),
                       timestep=torch.tensor([0.2, 0.9]),
                       timestep_indices=torch.randint(0, 2, (len(order),), generator=generator), token_tags=tags,
                       position_ids=torch.randint(0, 6, (len(order), 3), generator=generator),
                       video_indices=video_indices, audio_indices=audio_indices, text_indices=text_indices)
