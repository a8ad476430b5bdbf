"""Frozen expert weights in the formats checkpoints ship.

Each format stores an expert's matrix [rows, cols] as stored (the layer's
transposed layout: nn.Linear's [out, in]) as codes and fp32 scales, as the
runtime reads them (runtime/cpu/Quant.h):

  fp8_block128   FP8 e4m3 codes (uint8: torch 1.13 has no float8 type), a
                 scale per 128 x 128 block [.., ceil(R/128), ceil(C/128)];
                 value = code x scale: DeepSeek-V3's ``weight`` and
                 ``weight_scale_inv``. A block's scale is amax / 448.
  int8           int8 codes, a scale per row [.., R] (an output channel);
                 value = code x scale, scale = amax / 127.
  int4_g<G>      4-bit codes 0..15, two a byte (uint8 [.., R, C/2]; value j
                 of a row in the low half of byte j/2 when j is even, the
                 high half when odd: GPTQ's order within its int32 words), a
                 scale per group of G = 32, 64 or 128 values along a row
                 [.., R, C/G]; value = (code - 8) x scale, scale = amax / 7.
  int4_g<G>_zp   the same with a zero point per group: (scale, zero) pairs
                 [.., R, C/G, 2]; value = (code - zero) x scale, from the
                 group's range with 0 in it (AWQ's min-max): scale = range /
                 15, zero = round(-min / scale).

A run of zeros has scale 1; one holding a NaN or an infinity gets a NaN
scale (the layer refuses it). Values are computed in float32 and rounded
once to the layer's dtype.

    codes, scales = quantize("int4_g128", w)       # w [E, R, C]
    w = dequantize("int4_g128", codes, scales)     # float32 [E, R, C]
"""

import collections
import re

import torch

from . import safetensors

__all__ = ["BLOCK", "WEIGHT_FORMATS", "Format", "check_format", "dequantize",
           "dequantize_fp8_blocks", "parse", "quantize", "quantize_fp8_blocks"]

BLOCK = 128
GROUPS = (32, 64, 128)
WEIGHT_FORMATS = ("fp8_block128", "int8") + tuple(
    f"int4_g{g}{zp}" for zp in ("", "_zp") for g in GROUPS)
# The runtime's codes of the formats (LayerShape::weightFormat; info()).
FORMAT_CODES = {None: 0, "fp8": 1, "int8": 2, "int4": 3}


class Format(collections.namedtuple("Format", "name kind group zero_points")):
    """A weight format: kind "fp8", "int8" or "int4"; group and zero_points
    for int4."""

    @property
    def codes_dtype(self):
        return torch.int8 if self.kind == "int8" else torch.uint8

    @property
    def graph_suffix(self):
        """The suffix of its graphs (graphs/transpose_weights.py)."""
        return "_int4zp" if self.zero_points else "_" + self.kind

    def stored_shape(self, rows, cols):
        """The codes' shape of a [rows, cols] matrix."""
        return (rows, -(-cols // 2)) if self.kind == "int4" else (rows, cols)

    def scale_shape(self, rows, cols):
        """The scales' shape of a [rows, cols] matrix."""
        if self.kind == "fp8":
            return (_blocks(rows), _blocks(cols))
        if self.kind == "int8":
            return (rows,)
        return (rows, cols // self.group) + ((2,) if self.zero_points else ())

    def config(self):
        """What the layer's config gets: the int4 group (weight_group)."""
        return {"weight_group": self.group} if self.kind == "int4" else {}

    def check_sizes(self, hidden, inter):
        """ValueError unless the stored matrices ([2I, H], [H, I]) hold
        whole blocks (fp8) or groups (int4)."""
        unit = BLOCK if self.kind == "fp8" else self.group if self.kind == "int4" else 1
        sizes = {"hidden_size": hidden, "intermediate_size": inter}
        if any(not isinstance(v, int) or v % unit for v in sizes.values()):
            what = "whole 128 x 128 blocks" if self.kind == "fp8" else \
                f"whole groups of {unit} values along a row"
            raise ValueError(f"moec: weight_format={self.name!r} holds {what}: hidden_size and "
                             f"intermediate_size must be multiples of {unit}; the config has "
                             f"{sizes}")


def parse(weight_format):
    """The Format of a name (None: dense), or ValueError naming the formats."""
    if weight_format is None:
        return None
    if not isinstance(weight_format, str) or weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"moec: weight_format must be one of {WEIGHT_FORMATS} or None, got "
                         f"{weight_format!r}")
    m = re.fullmatch(r"int4_g(\d+)(_zp)?", weight_format)
    if m:
        return Format(weight_format, "int4", int(m.group(1)), bool(m.group(2)))
    return Format(weight_format, "fp8" if weight_format.startswith("fp8") else "int8", 0, False)


def check_format(weight_format):
    """`weight_format` (None: dense), or ValueError naming the formats."""
    parse(weight_format)
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


def _finite_scale(scale, values, dim):
    """`scale`, at least the smallest positive float (a run of tiny values
    would get 0, which no scale may be), with NaN where the run of `values`
    along `dim` holds a NaN or an infinity (the runtime's quantizers do the
    same)."""
    scale = scale.clamp(min=torch.finfo(torch.float32).tiny * 2 ** -23)
    return torch.where(torch.isfinite(values).all(dim), scale, torch.full_like(scale, float("nan")))


def tp_unit(weight_format):
    """The values a TP rank's slice of I must hold whole: 128 (FP8 blocks),
    the group (int4), 1 (int8, dense)."""
    fmt = parse(weight_format)
    return 1 if fmt is None or fmt.kind == "int8" else BLOCK if fmt.kind == "fp8" else fmt.group


def tp_split(name, transposed, weight_format=None):
    """How a TP rank holds its slice of I of a layer's tensor `name` ("w1",
    "w2", "w1_scale", "w2_scale", and of the LoRA adapters "w1_lora_B" [..,
    r, 2I] and "w2_lora_A" [.., I, r], in every layout; anything else, w1's
    A and w2's B among them: None): (dim, unit, halves),
    dim counted from the end, its part of dim the entries of its I/tp
    values, `unit` values an entry, in each half (gate's, then up's) where
    `halves`; or None for a tensor every TP rank holds whole. w1 [.., H,
    2I] and w2 [.., I, H]; `transposed` (the formats' layout, [out, in]):
    w1 [.., 2I, H] (gate rows, then up) and w2 [.., H, I] (int4 codes two a
    byte), with their scales (FP8 blocks of 128, int8 rows, int4 groups
    along a row, + a last dim of 2 with zero points): int8's w2 row scales
    span the row, so each TP rank holds them whole."""
    if name in ("w1_lora_B", "w2_lora_A"):  # adapters: [.., r, 2I], [.., I, r]
        return (-1, 1, True) if name == "w1_lora_B" else (-2, 1, False)
    if name not in ("w1", "w2", "w1_scale", "w2_scale"):
        return None
    w1 = name.startswith("w1")
    if not transposed:
        return (-1, 1, True) if w1 else (-2, 1, False)
    fmt = parse(weight_format)
    if not name.endswith("_scale"):
        return (-2, 1, True) if w1 else (-1, 2 if fmt and fmt.kind == "int4" else 1, False)
    if fmt is None:  # dense: no scales
        return None
    zero = 1 if fmt.zero_points else 0
    if fmt.kind == "int8":
        return (-1, 1, True) if w1 else None
    if w1:
        return (-2 - zero, BLOCK if fmt.kind == "fp8" else 1, True)
    return (-1 - zero, tp_unit(weight_format), False)


def tp_part(weight_format, which, t, tp, stored, scales=None, transposed=True):
    """TP rank t's part (of tp) of experts' weights `which` ("w1", "w2", or
    an adapter: "w1_lora_B" ...) and of their scales, as tp_split says:
    w1's gate and up columns (rows where `transposed`, the formats' layout)
    t*I/tp .. (t+1)*I/tp - 1, w2's rows (columns), with the scales that
    cover them. The experts are
    quantized whole, as a checkpoint stores them; I/tp holds whole blocks or
    groups (tp_unit). `weight_format` None: dense weights, no scales.
    Returns (stored part, scales part), each None where not given."""

    def take(x, split):
        if x is None or split is None:
            return x
        dim, _, halves = split
        n = x.shape[dim] // (2 if halves else 1) // tp
        part = x.narrow(dim, t * n, n)
        return torch.cat((part, x.narrow(dim, tp * n + t * n, n)), dim) if halves else part

    return (take(stored, tp_split(which, transposed, weight_format)),
            take(scales, tp_split(which + "_scale", transposed, weight_format)))


def quantize(weight_format, w):
    """(codes, scales) of w [..., R, C] in `weight_format`, matrix by
    matrix of its last two dims (the module docstring)."""
    fmt = parse(weight_format)
    if fmt.kind == "fp8":
        return quantize_fp8_blocks(w)
    w = w.detach().float()
    if fmt.kind == "int8":
        amax = w.abs().amax(-1)
        scale = _finite_scale(torch.where(amax > 0, amax / 127, torch.ones_like(amax)), w, -1)
        codes = torch.round(w / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return codes, scale
    *lead, rows, cols = w.shape
    g = w.reshape(*lead, rows, cols // fmt.group, fmt.group)
    lo = g.amin(-1).clamp(max=0)
    hi = g.amax(-1).clamp(min=0)
    if fmt.zero_points:
        scale = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi))
        scale = _finite_scale(scale, g, -1)
        zero = torch.round(-lo / scale).clamp(0, 15)
        zero = torch.where(torch.isfinite(scale), zero, torch.zeros_like(zero))
        scales = torch.stack((scale, zero), -1)
    else:
        amax = torch.maximum(-lo, hi)
        scale = _finite_scale(torch.where(amax > 0, amax / 7, torch.ones_like(amax)), g, -1)
        zero = torch.full_like(scale, 8.0)
        scales = scale
    codes = (torch.round(g / scale.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(0, 15)
    codes = codes.to(torch.uint8).reshape(*lead, rows, cols)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scales


def dequantize(weight_format, codes, scales, dtype=torch.float32):
    """The values of `codes` and `scales` in `weight_format`, in `dtype`
    (rounded once from float32)."""
    fmt = parse(weight_format)
    if fmt.kind == "fp8":
        return dequantize_fp8_blocks(codes, scales, dtype)
    *lead, rows, stored = codes.shape
    cols = 2 * stored if fmt.kind == "int4" else stored
    want = tuple(lead) + fmt.scale_shape(rows, cols)
    if tuple(scales.shape) != want:
        raise ValueError(f"moec: the scales have shape {list(scales.shape)}; {weight_format} "
                         f"codes of shape {list(codes.shape)} need {list(want)}")
    if fmt.kind == "int8":
        return (codes.float() * scales.float().unsqueeze(-1)).to(dtype)
    values = torch.stack((codes & 0xF, codes >> 4), -1).reshape(*lead, rows, cols).float()
    scales = scales.float()
    scale, zero = (scales[..., 0], scales[..., 1]) if fmt.zero_points else \
        (scales, torch.full_like(scales, 8.0))
    spread = lambda t: t.repeat_interleave(fmt.group, -1)  # noqa: E731
    return ((values - spread(zero)) * spread(scale)).to(dtype)
