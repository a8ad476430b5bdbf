"""GPTQ, AWQ and compressed-tensors checkpoints: a linear layer's weight as
integer codes with a scale and zero per group, as AutoGPTQ, GPTQModel,
AutoAWQ, llm-compressor and transformers save them, read into moec's
formats.

Such a checkpoint holds, for each quantized nn.Linear ``X`` with weight
[out, in], in place of ``X.weight``, the tensors below. Codes are `bits`
wide, p = 32 / bits of them to an int32 word, from the low bits up.

GPTQ (``"quant_method": "gptq"``; 4 or 8 bits):

  X.qweight   int32 [in / p, out]: input row i's code of output column j
              in word [i // p, j], slot i % p;
  X.qzeros    int32 [groups, out / p]: the zero of group g, output column
              j, in word [g, j // p], slot j % p; a "gptq" (v1) checkpoint
              stores zero - 1 (AutoGPTQ's historical offset), a "gptq_v2"
              one the zero;
  X.scales    float16 [groups, out];
  X.g_idx     int32 [in]: the group of each input row (i // group_size,
              or a permutation's groups with desc_act); without it, in
              order.

AWQ (``"quant_method": "awq"``, ``"version": "gemm"``; 4 bits):

  X.qweight   int32 [in, out / 8]: input row i's code of output column
              8c + t in word [i, c], slot ORDER[t] (AWQ's interleave:
              slots 0..7 hold columns 0, 2, 4, 6, 1, 3, 5, 7);
  X.qzeros    int32 [groups, out / 8]: the zeros, interleaved the same way;
  X.scales    float16 [groups, out]; groups in order.

compressed-tensors (``"quant_method": "compressed-tensors"``, ``"format":
"pack-quantized"``: llm-compressor's W4A16 and W8A16; its weights' args in
``config_groups``):

  X.weight_packed       int32 [out, ceil(in / p)]: row j's code of input
                        column i in word [j, i // p], slot i % p, stored
                        unsigned (the signed code + 2^(bits-1));
  X.weight_scale        [out, groups] (strategy "group"; "channel": [out, 1]);
  X.weight_zero_point   int32 [ceil(out / p), groups], where not
                        symmetric: the zeros, stored as the codes are
                        (+ 2^(bits-1)), packed along the rows; symmetric:
                        the zero is 2^(bits-1) in the stored codes;
  X.weight_g_idx        optional, int32 [in] (actorder);
  X.weight_shape        [2]: [out, in].

compressed-tensors' "int-quantized" and "float-quantized" formats (its
W8A8 int8 and FP8 checkpoints) keep ``X.weight``, as int8 or FP8 e4m3
codes [out, in], with ``X.weight_scale``: [out, 1] (by channel), [out,
groups], [1] (tensor), or for FP8 by block [ceil(out/128), ceil(in/128)];
value = code x scale, symmetric (moec_torch.hf reads them beside
DeepSeek-V3's FP8 blocks).

groups = ceil(in / group_size) (group_size -1: one group, the whole row).
The value of input row i, output column j is
(code - zero[g(i), j]) x scale[g(i), j]. The model's config.json names the
format in ``quantization_config`` (or, for GPTQ, AutoGPTQ's
quantize_config.json beside it).

moec's int4 formats hold 4-bit codes with a scale (and zero) per group
along a row of the [out, in] matrix: a 4-bit checkpoint with group_size G
of 32, 64 or 128 and groups in order is held as it is by
``int4_g<G>_zp`` (its zeros as zero points, 0..15), and by ``int4_g<G>``
where every zero is 8 (GPTQ's ``sym``, compressed-tensors'
``symmetric``): the same values, nothing rounded
again (``as_format``). Otherwise the weight is dequantized
(``dequantize``).
"""

import json
from pathlib import Path

import torch

from . import quant

__all__ = ["TENSORS", "as_format", "check", "config_of", "dequantize", "unpack"]

# The tensors that stand for a quantized weight X.weight (X.<suffix>), the
# first of each the one whose presence says so.
TENSORS_OF = {"gptq": ("qweight", "qzeros", "scales", "g_idx"),
              "awq": ("qweight", "qzeros", "scales"),
              "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point",
                                     "weight_g_idx", "weight_shape")}
TENSORS = tuple(sorted({t for ts in TENSORS_OF.values() for t in ts}))
MARKERS = tuple(sorted({ts[0] for ts in TENSORS_OF.values()}))
BITS = {"gptq": (4, 8), "awq": (4,), "compressed-tensors": (4, 8)}
NAMES = {"gptq": "GPTQ", "awq": "AWQ", "compressed-tensors": "compressed-tensors"}
# AWQ's slot of column t within each 8 (AutoAWQ's pack order 0 2 4 6 1 3 5 7).
AWQ_SLOT = (0, 4, 1, 5, 2, 6, 3, 7)


# compressed-tensors' formats moec reads: each weight's type, bits and strategies.
CT_FORMATS = {"pack-quantized": ("int", (4, 8), ("group", "channel")),
              "int-quantized": ("int", (8,), ("group", "channel")),
              "float-quantized": ("float", (8,), ("tensor", "channel", "block"))}


def _compressed_tensors(q, path):
    """(format, bits, group_size, symmetric) of a compressed-tensors
    quantization_config: one weight scheme in every config group, of a
    format and strategy moec reads (CT_FORMATS: integer codes packed in
    int32 words; int8 codes; FP8 e4m3 codes, 128 x 128 blocks where by
    block); ValueError otherwise."""
    fmt = q.get("format")
    if fmt not in CT_FORMATS:
        raise ValueError(f"moec: {path}: a compressed-tensors checkpoint of format {fmt!r}: moec "
                         f"reads {', '.join(repr(f) for f in CT_FORMATS)}")
    groups = q.get("config_groups")
    schemes = [g.get("weights") for g in groups.values() if isinstance(g, dict)] \
        if isinstance(groups, dict) else []
    if not schemes or any(w != schemes[0] for w in schemes) or not isinstance(schemes[0], dict):
        raise ValueError(f"moec: {path}: compressed-tensors config_groups give no weights or "
                         "several weight schemes; moec reads one for every layer")
    w = schemes[0]
    strategy, group = w.get("strategy"), w.get("group_size")
    kind, bits, strategies = CT_FORMATS[fmt]
    if w.get("type", "int") != kind or w.get("num_bits") not in bits or \
            strategy not in strategies or w.get("dynamic") or \
            (strategy == "group" and not isinstance(group, int)) or \
            (strategy == "block" and list(w.get("block_structure") or []) != [128, 128]) or \
            (fmt != "pack-quantized" and not w.get("symmetric", True)):
        raise ValueError(f"moec: {path}: compressed-tensors {fmt} weights {w}: moec reads "
                         f"{kind} codes of {' or '.join(map(str, bits))} bits by "
                         f"{' or '.join(strategies)}"
                         + (" (blocks 128 x 128)" if "block" in strategies else "")
                         + ("" if fmt == "pack-quantized" else ", symmetric"))
    return fmt, w["num_bits"], group if strategy == "group" else -1, \
        bool(w.get("symmetric", True))


def config_of(folder):
    """The GPTQ, AWQ or compressed-tensors settings of a checkpoint folder,
    {"method", "format" (compressed-tensors'), "bits", "group_size",
    "desc_act", "sym", "v1", "file"}, from
    config.json's quantization_config or quantize_config.json; None where
    neither names one of them. ValueError for settings moec cannot read
    (naming the file)."""
    folder = Path(folder)
    for name, pick in (("config.json", lambda d: d.get("quantization_config")),
                       ("quantize_config.json", lambda d: d)):
        path = folder / name
        if not path.is_file():
            continue
        try:
            q = pick(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            raise ValueError(f"moec: {path}: cannot read it: {e}") from None
        if not isinstance(q, dict):
            continue
        method = q.get("quant_method", "gptq" if name == "quantize_config.json" else None)
        if method not in BITS:
            continue
        what = NAMES[method]
        bits, group = q.get("bits", q.get("w_bit")), q.get("group_size", q.get("q_group_size", -1))
        sym, ct_format = bool(q.get("sym", False)), None
        if method == "compressed-tensors":
            if q.get("format") == "dense":
                return None  # (its weights stored as they are, in floating point)
            ct_format, bits, group, sym = _compressed_tensors(q, path)
        if bits not in BITS[method]:
            raise ValueError(f"moec: {path}: a {what} checkpoint of {bits}-bit codes; moec reads "
                             f"{' and '.join(map(str, BITS[method]))}-bit ones")
        if not isinstance(group, int) or isinstance(group, bool) or group == 0 or group < -1:
            raise ValueError(f"moec: {path}: {what} group_size {group!r} is not a positive "
                             "integer or -1")
        if method == "gptq":
            fmt = q.get("checkpoint_format", "gptq")
            if fmt not in ("gptq", "gptq_v2"):
                raise ValueError(f"moec: {path}: GPTQ checkpoint_format {fmt!r}: moec reads "
                                 "'gptq' and 'gptq_v2'")
        elif method == "awq":
            version = str(q.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"moec: {path}: AWQ version {q.get('version')!r}: moec reads "
                                 "'gemm'")
            if q.get("zero_point", True) is not True:
                raise ValueError(f"moec: {path}: AWQ without zero points: moec reads AutoAWQ's "
                                 "GEMM layout, which has them")
            fmt = None
        else:
            fmt = None
        return {"method": method, "format": ct_format, "bits": bits, "group_size": group,
                "desc_act": bool(q.get("desc_act", False)), "sym": sym,
                "v1": fmt == "gptq", "file": str(path)}
    return None


def _groups(cfg, rows_in):
    g = cfg["group_size"]
    return 1 if g == -1 else -(-rows_in // g)


def check(cfg, shape, shapes, dtypes, name, read):
    """Refuses tensors (their `shapes` and safetensors `dtypes`, dicts by
    suffix; `read(suffix)` the tensor, for the small ones whose values
    matter: weight_shape, g_idx) that cannot stand for a weight [out, in] =
    `shape` in the checkpoint's format: ValueError naming the tensor
    `name`.<suffix> and what it should be."""
    out, rows_in = shape
    method, bits = cfg["method"], cfg["bits"]
    per, what = 32 // bits, NAMES[method]
    groups = _groups(cfg, rows_in)
    floats, ints = ("F16", "BF16", "F32"), ("I32", "I64")
    marker = TENSORS_OF[method][0]
    optional = {"g_idx", "weight_g_idx"}
    if method == "compressed-tensors":
        want = {"weight_packed": ([out, -(-rows_in // per)], ("I32",)),
                "weight_scale": ([out, groups], floats),
                "weight_g_idx": ([rows_in], ints), "weight_shape": ([2], ints)}
        if not cfg["sym"]:
            want["weight_zero_point"] = ([-(-out // per), groups], ("I32",))
    else:
        if (rows_in % per if method == "gptq" else 0) or out % per:
            raise ValueError(f"moec: '{name}.qweight': a {bits}-bit {what} weight packs {per} "
                             f"values a word; the model's [{out}, {rows_in}] does not divide")
        want = {"qweight": ([rows_in // per, out] if method == "gptq" else [rows_in, out // per],
                            ("I32",)),
                "qzeros": ([groups, out // per], ("I32",)),
                "scales": ([groups, out], floats)}
        if method == "gptq":
            want["g_idx"] = ([rows_in], ints)
    for suffix, (dims, kinds) in want.items():
        if suffix not in shapes:
            if suffix in optional:
                continue  # without it the groups are in order
            raise ValueError(f"moec: '{name}.{marker}' has no '{name}.{suffix}' beside it")
        if list(shapes[suffix]) != dims or dtypes[suffix] not in kinds:
            raise ValueError(f"moec: '{name}.{suffix}' is {dtypes[suffix]} "
                             f"{list(shapes[suffix])}; a {cfg['bits']}-bit {what} weight "
                             f"[{out}, {rows_in}] with group_size {cfg['group_size']} needs "
                             f"{' or '.join(kinds)} {dims}")
    if "weight_shape" in want and read("weight_shape").tolist() != [out, rows_in]:
        raise ValueError(f"moec: '{name}.weight_shape' holds "
                         f"{read('weight_shape').tolist()}; the model's weight is "
                         f"[{out}, {rows_in}]")
    for suffix in optional & set(shapes):
        g_idx = read(suffix)
        if g_idx.numel() and (g_idx.min() < 0 or g_idx.max() >= groups):
            raise ValueError(f"moec: '{name}.{suffix}' names group "
                             f"{int(g_idx.min() if g_idx.min() < 0 else g_idx.max())}; the "
                             f"weight has groups 0 .. {groups - 1}")


def _unpack_words(words, bits, dim):
    """int32 words -> their codes, `32 / bits` of each word along `dim`,
    from the low bits up (int32: an arithmetic shift's sign bits are masked
    off)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    w = words.to(torch.int32).unsqueeze(dim + 1)
    view = [1] * w.dim()
    view[dim + 1] = per
    codes = (w >> shifts.view(view)) & ((1 << bits) - 1)
    shape = list(words.shape)
    shape[dim] *= per
    return codes.reshape(shape)


def _awq_columns(t):
    """AWQ's interleaved columns of t [.., 8 c] in their order."""
    index = (torch.arange(t.shape[-1]).view(-1, 8)[:, list(AWQ_SLOT)]).reshape(-1)
    return t[..., index]


def _in_features(cfg, tensors):
    """The weight's input size, from its tensors' shapes (and
    compressed-tensors' weight_shape, checked against them)."""
    bits, per = cfg["bits"], 32 // cfg["bits"]
    if cfg["method"] == "compressed-tensors":
        packed, shape = tensors["weight_packed"], tensors["weight_shape"].tolist()
        if shape != [packed.shape[0], shape[1]] or not 0 < shape[1] <= packed.shape[1] * 32 // bits:
            raise ValueError(f"moec: a compressed-tensors weight_shape {shape} for "
                             f"weight_packed {list(packed.shape)}")
        return shape[1]
    q = tensors["qweight"]
    return q.shape[0] * per if cfg["method"] == "gptq" else q.shape[0]


def _zeros_scales_groups(cfg, tensors):
    """(zeros float32 [out, groups], scales float32 [out, groups], g_idx
    int64 [in]) of a weight's tensors, zeros with GPTQ v1's offset undone."""
    bits = cfg["bits"]
    rows_in = _in_features(cfg, tensors)
    if cfg["method"] == "compressed-tensors":
        scales = tensors["weight_scale"].float().contiguous()
        zeros = torch.full_like(scales, 1 << (bits - 1)) if cfg["sym"] else \
            _unpack_words(tensors["weight_zero_point"], bits, 0)[:scales.shape[0]].float()
        g_idx = tensors.get("weight_g_idx")
    else:
        if cfg["method"] == "gptq":
            zeros = _unpack_words(tensors["qzeros"], bits, 1) + (1 if cfg["v1"] else 0)
        else:
            zeros = _awq_columns(_unpack_words(tensors["qzeros"], bits, 1))
        zeros, scales = zeros.t().float(), tensors["scales"].float().t().contiguous()
        g_idx = tensors.get("g_idx")
    g_idx = g_idx.to(torch.int64) if g_idx is not None else \
        torch.arange(rows_in) // (rows_in if cfg["group_size"] == -1 else cfg["group_size"])
    if g_idx.numel() and (g_idx.min() < 0 or g_idx.max() >= scales.shape[1]):
        raise ValueError(f"moec: a g_idx names group {int(g_idx.max())} of "
                         f"{scales.shape[1]}")
    return zeros.contiguous(), scales, g_idx


def unpack(cfg, tensors):
    """(codes uint8 [out, in], zeros float32 [out, groups], scales float32
    [out, groups], g_idx int64 [in]) of a weight's tensors (a dict by
    suffix), zeros with GPTQ v1's offset undone."""
    zeros, scales, g_idx = _zeros_scales_groups(cfg, tensors)
    return _codes(cfg, tensors, scales.shape[0], g_idx.numel()), zeros, scales, g_idx


def _codes(cfg, tensors, out, rows_in):
    """The codes uint8 [out, in] of a weight's tensors."""
    bits = cfg["bits"]
    packed = _int4_bytes(cfg, tensors, out, rows_in) if bits == 4 else None
    if packed is not None:
        return torch.stack((packed & 15, packed >> 4), -1).reshape(out, -1)
    if cfg["method"] == "compressed-tensors":
        codes = _unpack_words(tensors["weight_packed"], bits, 1)[:, :rows_in]
    elif cfg["method"] == "gptq":
        codes = _unpack_words(tensors["qweight"], bits, 0).t()
    else:
        codes = _awq_columns(_unpack_words(tensors["qweight"], bits, 1)).t()
    return codes.to(torch.uint8).contiguous()


def dequantize(cfg, tensors):
    """The weight [out, in] (float32) that a weight's tensors stand for."""
    codes, zeros, scales, g_idx = unpack(cfg, tensors)
    out, rows_in = codes.shape
    groups = scales.shape[1]
    if rows_in % groups == 0 and torch.equal(g_idx, torch.arange(rows_in) // (rows_in // groups)):
        g = codes.reshape(out, groups, -1).float()   # groups in order: no gathers
        return ((g - zeros.unsqueeze(-1)) * scales.unsqueeze(-1)).reshape(out, rows_in)
    return (codes.float() - zeros[:, g_idx]) * scales[:, g_idx]


def _int4_bytes(cfg, tensors, out, rows_in):
    """The 4-bit codes [out, in] as moec stores them (two a byte, the even
    input column in the low half), straight from the words where their
    bytes already are so on a little-endian CPU (GPTQ: 8 input rows a word,
    the word's bytes rows 2b, 2b + 1; compressed-tensors: 8 input columns a
    word, the same); None for AWQ, whose words run along the outputs."""
    if cfg["method"] == "gptq":
        words = tensors["qweight"].contiguous().view(torch.uint8)   # [in / 8, 4 out]
        return words.reshape(rows_in // 8, out, 4).permute(1, 0, 2).reshape(out, rows_in // 2)
    if cfg["method"] == "compressed-tensors" and rows_in % 8 == 0:
        return tensors["weight_packed"].contiguous().view(torch.uint8).reshape(out, -1)
    return None


def as_format(cfg, tensors, weight_format):
    """(codes, scales) of the weight in moec's `weight_format`, the same
    values as the checkpoint's, or None where that format cannot hold them
    as they are (then dequantize and quantize again)."""
    fmt = quant.parse(weight_format)
    if fmt.kind != "int4" or cfg["bits"] != 4 or cfg["group_size"] != fmt.group:
        return None
    zeros, scales, g_idx = _zeros_scales_groups(cfg, tensors)
    out, rows_in = scales.shape[0], g_idx.numel()
    if rows_in % fmt.group or not torch.equal(g_idx, torch.arange(rows_in) // fmt.group):
        return None  # groups out of order (desc_act)
    if fmt.zero_points:
        if zeros.min() < 0 or zeros.max() > 15:
            return None  # a v1 zero of 16 (stored 15)
        held = torch.stack((scales, zeros), -1)
    elif torch.all(zeros == 8):
        held = scales
    else:
        return None
    packed = _int4_bytes(cfg, tensors, out, rows_in)
    if packed is None:  # (AWQ's words run along the outputs)
        codes = _codes(cfg, tensors, out, rows_in)
        packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), held
