"""MXFP4 (OCP microscaling FP4) experts as gpt-oss publishes them, dequantised on the device where they are
computed.

Each group of 32 weights is 16 bytes of packed E2M1 codes (low nibble first) and one E8M0 scale byte
(exponent + 127). Dequantisation follows transformers' ``convert_moe_packed_tensors`` operation for operation
(lookup table in the target dtype, ``ldexp`` by the scale), so the weights are bit-identical to what
transformers computes (tested); it runs once per expert landing in a device cache slot, right after its transfer
(on CUDA on the copy stream), so the slot then holds compute-dtype weights.
"""

from __future__ import annotations

import torch

#: E2M1 code → value (sign bit 3), as in the OCP MX specification.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_LUTS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _lut(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Byte → its two values ``[256, 2]`` (low nibble, high nibble): one lookup decodes a byte, the same values
    as transformers' nibble-by-nibble lookup."""
    key = (dtype, device)
    if key not in _LUTS:
        values = torch.tensor(FP4_VALUES, dtype=dtype)
        codes = torch.arange(256)
        _LUTS[key] = torch.stack([values[codes & 0x0F], values[codes >> 4]], dim=1).to(device)
    return _LUTS[key]


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, contiguous: bool = True
) -> torch.Tensor:
    """``blocks [..., R, G, 16]`` (uint8) and ``scales [..., R, G]`` → weights ``[..., G·32, R]`` in ``dtype``
    (the transposed layout gpt-oss's experts multiply with: ``x @ w``); with ``contiguous=False`` the transposed
    view (for a caller that copies it into place anyway: one op less)."""
    *prefix, rows, groups, nbytes = blocks.shape
    if tuple(scales.shape) != (*prefix, rows, groups):
        raise ValueError(f"MXFP4 scales {tuple(scales.shape)} do not match blocks {tuple(blocks.shape)}")
    flat = blocks.reshape(-1, nbytes)
    out = _lut(dtype, blocks.device)[flat.to(torch.int)]  # [group, byte, (lo, hi)]
    torch.ldexp(out, scales.reshape(-1, 1, 1).to(torch.int32) - 127, out=out)
    w = out.view(*prefix, rows, groups * nbytes * 2).transpose(-1, -2)
    return w.contiguous() if contiguous else w


def expert_weights(
    slot: list[torch.Tensor], dtype: torch.dtype, contiguous: bool = True
) -> list[torch.Tensor]:
    """One gpt-oss expert's compute tensors ``[gate_up [H, 2I], gate_up_bias, down [I, H], down_bias]`` from its
    stored parts ``[gate_up blocks, scales, bias, down blocks, scales, bias]`` (a bias given as None stays None:
    the caller views it in place)."""
    gu_blocks, gu_scales, gu_bias, d_blocks, d_scales, d_bias = slot
    return [
        dequantize(gu_blocks, gu_scales, dtype, contiguous),
        gu_bias if gu_bias is None or gu_bias.dtype == dtype else gu_bias.to(dtype),
        dequantize(d_blocks, d_scales, dtype, contiguous),
        d_bias if d_bias is None or d_bias.dtype == dtype else d_bias.to(dtype),
    ]
