"""FP8 linear layers fed by the ops' FP8 rows (``norm_scale_shift_fp8``, ``quantize_fp8``, ...).

A ``Float8Rows`` is what those ops return: FP8 values [..., K] and one float32 scale per row
[..., 1]. A ``Float8Linear`` holds a Linear's weight quantised once per output channel (FP8
[N, K] and float32 scales [1, N]) and multiplies through ``torch._scaled_mm`` with both sets of
scales and the bias in the GEMM (cuBLASLt on NVIDIA, hipBLASLt on AMD): the activation
quantisation a standalone FP8 linear adds happens in the op that produced the rows. Given a
plain tensor instead, it quantises it first (``quantize_fp8``: one pass).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import ops
from .dispatch import fp8_dtypes


_NO_BACKWARD = ("ditops FP8 layers (apply(model, quantize=\"fp8\"), Float8Linear, Float8Rows) are for inference and have "
                "no backward: run the model under torch.no_grad() or torch.inference_mode(), or patch it without "
                "quantize= to train it")


@torch.library.custom_op("ditops::fp8_no_backward", mutates_args=())
def _no_backward(grad: Tensor) -> Tensor:
    """Raises when a backward reaches FP8 layers. An op, not a raise in the backward itself, so
    that torch.compile can trace the backward (its fake returns a gradient) and the error comes
    when one runs."""
    raise NotImplementedError(_NO_BACKWARD)


@_no_backward.register_fake
def _(grad: Tensor) -> Tensor:
    return torch.empty_like(grad)


class _InferenceOnly(torch.autograd.Function):
    """The identity, whose backward raises: gradients must not reach FP8 tensors, where autograd
    fails deep inside (an FP8 sum has no kernel) with an error that names no cause."""

    @staticmethod
    def forward(ctx, out: Tensor) -> Tensor:
        return out.clone()  # not a view: the projections' outputs are rotated in place (qk_norm_rope_)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _no_backward(grad)


def inference_only(out: Tensor) -> Tensor:
    """out computed from FP8 rows, marked so that a backward through it raises a clear error: in
    grad mode only (a copy there), eager or compiled. Inference is left as it is."""
    if out.requires_grad and torch.is_grad_enabled():
        return _InferenceOnly.apply(out)
    return out


class Float8Rows(NamedTuple):
    """FP8 activations and their per-row float32 scales: ``data * scale`` stands for the values."""

    data: Tensor
    scale: Tensor

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        """The values the rows stand for, in ``dtype`` (for code that takes a tensor)."""
        return inference_only((self.data.float() * self.scale).to(dtype))


def quantize_weight(weight: Tensor, fp8_dtype: torch.dtype) -> tuple:
    """A [N, K] weight as FP8 rows and their float32 scales [1, N] (one per output channel):
    scale = max(amax, 1e-12) / the format's max, as the activations' rows are."""
    fmax = torch.finfo(fp8_dtype).max
    values = weight.detach().float()
    scale = values.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / fmax
    return (values / scale).clamp(-fmax, fmax).to(fp8_dtype), scale.t().contiguous()


def check_device(device: torch.device, fp8_dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """The FP8 format to use on ``device`` (``fp8_dtype``, or the device's own); a ValueError
    naming the device where it multiplies in no FP8 format or not in that one."""
    formats = fp8_dtypes(device)
    if not formats or (fp8_dtype is not None and fp8_dtype not in formats):
        have = ", ".join(map(str, formats)) or "none"
        raise ValueError(f"fp8: device {device} multiplies in FP8 formats: {have}; wanted "
                         f"{fp8_dtype or 'one'} (FP8 GEMMs need NVIDIA sm_89 or newer, or AMD gfx942 or gfx950)")
    return fp8_dtype or formats[0]


class Float8Linear(torch.nn.Module):
    """``linear`` with its weight in FP8 (per output channel), its bias and output dtype kept.
    ``forward`` takes Float8Rows, or a tensor that it quantises per row first."""

    def __init__(self, linear: torch.nn.Linear, fp8_dtype: torch.dtype):
        super().__init__()
        out_features, in_features = linear.weight.shape
        if in_features % 16 or out_features % 16:
            raise ValueError(f"Float8Linear: linear is {in_features} -> {out_features}; wanted both multiples of 16 "
                             "(torch._scaled_mm)")
        weight, scale = quantize_weight(linear.weight, fp8_dtype)
        self._hold(weight, scale, None if linear.bias is None else linear.bias.detach().clone(), linear.weight.dtype)

    def _hold(self, weight: Tensor, weight_scale: Tensor, bias: Optional[Tensor], out_dtype: torch.dtype) -> None:
        # the float32 scales first: diffusers casts some modules' input to the dtype of their first
        # floating-point tensor (get_parameter_dtype; MiniMax-H3's AdaLN projections), which the
        # FP8 weight is not (a float32 input is quantised as any other)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        self.out_features, self.in_features = weight.shape
        self.fp8_dtype, self.out_dtype = weight.dtype, out_dtype

    @classmethod
    def side_by_side(cls, parts: list) -> "Float8Linear":
        """One Float8Linear whose output is the parts' outputs concatenated: Linears fed the
        same rows (q, k and v) as one GEMM, fewer launches and a wider GEMM. Each part's
        buffers become views of the joint ones, so the weights are held once."""
        kinds = {(part.in_features, part.fp8_dtype, part.out_dtype, part.bias is None) for part in parts}
        if len(kinds) != 1:
            raise ValueError(f"Float8Linear.side_by_side: parts of in_features, fp8_dtype, out_dtype, bias-less "
                             f"{sorted(map(str, kinds))}; wanted one of each")
        joint = cls.__new__(cls)
        torch.nn.Module.__init__(joint)
        biases = None if parts[0].bias is None else torch.cat([part.bias for part in parts])
        joint._hold(torch.cat([part.weight for part in parts]), torch.cat([part.weight_scale for part in parts], dim=1),
                    biases, parts[0].out_dtype)
        sizes = [part.out_features for part in parts]
        views = zip(joint.weight.split(sizes), joint.weight_scale.split(sizes, dim=1),
                    biases.split(sizes) if biases is not None else [None] * len(parts))
        for part, (weight, weight_scale, bias) in zip(parts, views):
            part.weight, part.weight_scale, part.bias = weight, weight_scale, bias
        return joint

    def forward(self, x) -> Tensor:
        if not isinstance(x, Float8Rows):
            if x.dim() > 3:  # quantize_fp8 takes [B, S, D] or [N, D]: Kandinsky 5 runs Linears on [B, F, H, W, D]
                return self.forward(x.reshape(-1, x.shape[-1])).unflatten(0, x.shape[:-1])
            x = Float8Rows(*ops.quantize_fp8(x, fp8_dtype=self.fp8_dtype))
        return linear(x, self.weight, self.weight_scale, self.bias, self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fp8_dtype}, bias={self.bias is not None}"


def linear(rows: Float8Rows, weight: Tensor, weight_scale: Tensor, bias: Optional[Tensor], out_dtype: torch.dtype) -> Tensor:
    """rows @ weight.T + bias, in out_dtype: FP8 rows [..., K] with scales [..., 1], an FP8
    weight [N, K] with scales [1, N]. Fast accumulation, as torchao's rowwise FP8 inference.
    Inference only (inference_only)."""
    return inference_only(_product(rows, weight, weight_scale, bias, out_dtype))


def _product(rows: Float8Rows, weight: Tensor, weight_scale: Tensor, bias: Optional[Tensor], out_dtype: torch.dtype) -> Tensor:
    data, scale = rows
    leading = data.shape[:-1]
    if not data.is_cuda:
        # torch's CPU _scaled_mm takes rowwise scales only from 2.13 on: the same product,
        # the FP8 values exact in float32
        out = torch.nn.functional.linear(data.float() * scale, weight.float() * weight_scale.reshape(-1, 1),
                                         None if bias is None else bias.float())
        return out.to(out_dtype)
    fused_bias = bias if out_dtype != torch.float32 else None  # the GEMM takes a bias with a 16-bit output only
    out = torch._scaled_mm(data.reshape(-1, data.shape[-1]), weight.t(), scale_a=scale.reshape(-1, 1),
                           scale_b=weight_scale, bias=fused_bias, out_dtype=out_dtype, use_fast_accum=True)
    if bias is not None and fused_bias is None:
        out = out + bias
    return out.reshape(*leading, weight.shape[0])

