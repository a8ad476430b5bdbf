"""Frozen expert weights in the formats checkpoints ship.

fp8_block128: FP8 e4m3 codes (uint8 tensors: torch 1.13 has no float8 type)
with one fp32 scale per 128 x 128 block of each expert's matrix as stored,
value = code x scale: DeepSeek-V3's ``weight`` and ``weight_scale_inv``. A
block's scale is amax / 448 (1 for a block of zeros, NaN for one holding a
NaN or an infinity), as the runtime's quantizeBlocks (runtime/cpu/Fp8.h).

    codes, scales = quantize_fp8_blocks(w)        # w [E, R, C] -> uint8, f32 [E, R/128, C/128]
    w = dequantize_fp8_blocks(codes, scales)      # float32 [E, R, C]
"""

import torch

from . import safetensors

__all__ = ["BLOCK", "WEIGHT_FORMATS", "check_format", "dequantize_fp8_blocks",
           "quantize_fp8_blocks"]

BLOCK = 128
WEIGHT_FORMATS = ("fp8_block128",)
# The runtime's codes of the formats (LayerShape::weightFormat; info()).
FORMAT_CODES = {None: 0, "fp8_block128": 1}


def check_format(weight_format):
    """`weight_format` (None: dense), or ValueError naming the formats."""
    if weight_format is not None and weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"moec: weight_format must be one of {WEIGHT_FORMATS} or None, got "
                         f"{weight_format!r}")
    return weight_format


def _blocks(n):
    return -(-n // BLOCK)


def quantize_fp8_blocks(w):
    """(codes uint8 [..., R, C], scales float32 [..., ceil(R/128), ceil(C/128)])
    of w [..., R, C], block by block of its last two dims: the runtime's
    quantizer (torch.ops.moec.quantize_fp8_blocks), one matrix at a time."""
    from . import load_library  # the package imports this module first
    load_library()
    *lead, rows, cols = w.shape
    codes, scales = torch.ops.moec.quantize_fp8_blocks(
        w.detach().float().reshape(-1, rows, cols).contiguous())
    return codes.reshape(w.shape), scales.reshape(*lead, *scales.shape[1:])


def dequantize_fp8_blocks(codes, scales, dtype=torch.float32):
    """The values code x scale of FP8 block weights, in `dtype` (rounded
    once from float32)."""
    *_, rows, cols = codes.shape
    want = (_blocks(rows), _blocks(cols))
    if tuple(scales.shape[-2:]) != want or tuple(scales.shape[:-2]) != tuple(codes.shape[:-2]):
        raise ValueError(f"moec: the scales have shape {list(scales.shape)}; codes of shape "
                         f"{list(codes.shape)} in 128x128 blocks need "
                         f"{list(codes.shape[:-2]) + list(want)}")
    spread = scales.float().repeat_interleave(BLOCK, -2)[..., :rows, :]
    spread = spread.repeat_interleave(BLOCK, -1)[..., :cols]
    return (safetensors.fp8_e4m3_to_float(codes) * spread).to(dtype)
