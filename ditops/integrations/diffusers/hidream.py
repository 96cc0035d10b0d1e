"""HiDream-I1 (``HiDreamImageTransformer2DModel``) under ditops.

- In the double-stream blocks (``HiDreamImageTransformerBlock``, image and text streams) and
  the single-stream blocks (``HiDreamImageSingleTransformerBlock``), each wrapped in a
  ``HiDreamBlock``: ``norm1_i`` / ``norm1_t`` (LayerNorm without affine parameters, ``* (1 +
  scale) + shift``) -> ``norm_scale_shift``; each "x + gate * attention, then ``norm3_i`` /
  ``norm3_t`` and its modulation" -> ``residual_norm_scale_shift``. The modulation is one [B, D]
  vector per item. The FFN's gated add (no norm follows it in the block) stays as diffusers
  wrote it.

Left as diffusers wrote them: every attention (``HiDreamAttnProcessor``: its q/k RMSNorm runs
over all heads together, [B, S, H * Dh], not per head as ``qk_norm_rope_`` computes), the
``final_layer``'s modulated norm, blocks of another class or whose norms are not the ones
checked. diffusers 0.42 has no context-parallel plan for HiDream-I1.
"""

from __future__ import annotations

from ... import ops
from . import patching

_DOUBLE_NORMS = ("norm1_i", "norm1_t", "norm3_i", "norm3_t")
_SINGLE_NORMS = ("norm1_i", "norm3_i")


def _stream(self, x, modulation, attention, suffix):
    """One stream's "x + gate * attention, then norm3 and its modulation" as
    residual_norm_scale_shift, then the FFN's gated add."""
    _, _, gate, shift, scale, ff_gate = modulation
    norm = getattr(self, f"norm3_{suffix}")
    y, x = ops.residual_norm_scale_shift(attention, x, gate, scale, shift, eps=norm.eps)
    return ff_gate.unsqueeze(1) * getattr(self, f"ff_{suffix}")(y) + x


def _double_block_forward(self, hidden_states, hidden_states_masks=None, encoder_hidden_states=None, temb=None,
                          image_rotary_emb=None):
    """diffusers' HiDreamImageTransformerBlock: norm1_i, norm1_t as norm_scale_shift, each
    stream's "x + gate * attention, then norm3" as residual_norm_scale_shift. With a hooked norm,
    diffusers' forward runs."""
    if patching.hooked(self, _DOUBLE_NORMS):
        return type(self).forward(self, hidden_states, hidden_states_masks, encoder_hidden_states, temb,
                                  image_rotary_emb)
    modulation = self.adaLN_modulation(temb).chunk(12, dim=-1)
    image, text = modulation[:6], modulation[6:]
    norm_image = ops.norm_scale_shift(hidden_states, image[1], image[0], eps=self.norm1_i.eps)
    norm_text = ops.norm_scale_shift(encoder_hidden_states, text[1], text[0], eps=self.norm1_t.eps)
    attention_image, attention_text = self.attn1(norm_image, hidden_states_masks, norm_text,
                                                 image_rotary_emb=image_rotary_emb)
    return (_stream(self, hidden_states, image, attention_image, "i"),
            _stream(self, encoder_hidden_states, text, attention_text, "t"))


def _single_block_forward(self, hidden_states, hidden_states_masks=None, encoder_hidden_states=None, temb=None,
                          image_rotary_emb=None):
    """diffusers' HiDreamImageSingleTransformerBlock: norm1_i as norm_scale_shift, "x + gate *
    attention, then norm3_i" as residual_norm_scale_shift. With a hooked norm, diffusers'
    forward runs."""
    if patching.hooked(self, _SINGLE_NORMS):
        return type(self).forward(self, hidden_states, hidden_states_masks, encoder_hidden_states, temb,
                                  image_rotary_emb)
    modulation = self.adaLN_modulation(temb).chunk(6, dim=-1)
    norm = ops.norm_scale_shift(hidden_states, modulation[1], modulation[0], eps=self.norm1_i.eps)
    attention = self.attn1(norm, hidden_states_masks, image_rotary_emb=image_rotary_emb)
    return _stream(self, hidden_states, modulation, attention, "i")


def patch(model, patches: list, report) -> None:
    from diffusers.models.transformers.transformer_hidream_image import (HiDreamBlock,
                                                                         HiDreamImageSingleTransformerBlock,
                                                                         HiDreamImageTransformerBlock)

    families = (("double_stream_blocks", HiDreamImageTransformerBlock, _DOUBLE_NORMS, _double_block_forward),
                ("single_stream_blocks", HiDreamImageSingleTransformerBlock, _SINGLE_NORMS, _single_block_forward))
    for blocks, block_class, norms, forward in families:
        for index, wrapper in enumerate(getattr(model, blocks)):
            path = f"{blocks}.{index}.block"
            block = wrapper.block if type(wrapper) is HiDreamBlock else wrapper
            if type(block) is not block_class:
                report.skipped.append(f"{path}: {type(block).__name__}, not {block_class.__name__}; left as it is")
                continue
            if not all(patching.plain_layer_norm(getattr(block, name)) for name in norms):
                report.skipped.append(f"{path}: norms not LayerNorms without affine parameters; left as they are")
            elif patching.replace_forward(patches, report, block, path, forward):
                report.replaced += [(f"{path}.{name}", "norm_scale_shift" if name.startswith("norm1") else
                                     "residual_norm_scale_shift") for name in norms]
            report.skipped.append(f"{path}.attn1: q/k RMSNorm over all heads together, not per head; left as it is")
    report.skipped.append("final_layer: its modulated norm; left as it is")
