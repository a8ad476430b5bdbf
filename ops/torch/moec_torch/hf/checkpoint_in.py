"""Checkpoints in: a model's experts read (FP8 blocks, GPTQ, AWQ and compressed-tensors codes
kept or dequantized), the rest loaded. See the package's docstring."""

import json
import re
from pathlib import Path

import torch

from .. import int_checkpoints, quant, safetensors

from .patch import (
    _checkpoint_prefix,
    _config_of,
    _expert_entries,
    _local_experts,
    _patched,
    _set_expert,
    _store_quantized,
)


# --- checkpoints in -----------------------------------------------------------

def _open(checkpoint):
    """A checkpoint folder (or an open one) as safetensors.Checkpoint, its
    quantization checked to be one moec reads (_check_quantization)."""
    ckpt = checkpoint if isinstance(checkpoint, safetensors.Checkpoint) \
        else safetensors.Checkpoint(checkpoint)
    ckpt._moec_int = _check_quantization(ckpt.folder)
    return ckpt


def _check_quantization(folder):
    """Refuses a checkpoint whose config.json names a quantization moec does
    not read (ValueError naming it and the file): FP8 in 128 x 128 blocks,
    GPTQ, AWQ and compressed-tensors' pack-, int- and float-quantized
    formats are read. Returns the last three's settings
    (int_checkpoints.config_of, which checks them), else None."""
    path = Path(folder) / "config.json"
    try:
        q = json.loads(path.read_text()).get("quantization_config") if path.is_file() else None
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"moec: {path}: cannot read it: {e}") from None
    if not isinstance(q, dict) or q.get("quant_method") is None:
        return int_checkpoints.config_of(folder)  # (AutoGPTQ's quantize_config.json)
    method = q["quant_method"]
    if method == "fp8":
        block = q.get("weight_block_size", [128, 128])
        if list(block) != [128, 128]:
            raise ValueError(f"moec: {path}: FP8 weights in blocks of {block}: moec reads "
                             "128 x 128 blocks (a weight_scale_inv per block)")
    elif method in int_checkpoints.TENSORS_OF:
        return int_checkpoints.config_of(folder)
    else:
        raise ValueError(f"moec: {path}: a checkpoint quantized by {method!r}: moec reads FP8 "
                         "in 128 x 128 blocks ('fp8'), 'gptq', 'awq' and 'compressed-tensors' "
                         "checkpoints")


def _dequantize_fp8(weight, scale_inv, name):
    """DeepSeek-V3's FP8 weight: e4m3 codes [out, in] times the fp32
    weight_scale_inv of each 128 x 128 tile."""
    try:
        return quant.dequantize_fp8_blocks(weight, scale_inv)
    except ValueError as e:
        raise ValueError(f"moec: '{name}_scale_inv': {str(e).removeprefix('moec: ')}") from None


# The kinds of a weight stored as codes beside a scale tensor X.weight_scale_inv
# (DeepSeek-V3) or X.weight_scale (compressed-tensors' int- and float-quantized).
SCALED = ("F8_E4M3", "I8")


def _scale_name(ckpt, name):
    """The scale tensor beside the FP8 or int8 weight `name`, or None."""
    return next((name + s for s in ("_scale_inv", "_scale") if name + s in ckpt), None)


def _scale_layout(scale_shape, shape, fp8):
    """How a scale of `scale_shape` covers a weight [out, in] = `shape`:
    "blocks" (FP8's 128 x 128), "tensor" ([1]), "rows" ([out, 1] or [out]),
    "groups" ([out, n], n dividing in), or None."""
    out, cols = shape
    dims = list(scale_shape)
    if fp8 and dims == [quant._blocks(out), quant._blocks(cols)]:
        return "blocks"
    if dims in ([], [1], [1, 1]):
        return "tensor"
    if dims in ([out, 1], [out]):
        return "rows"
    if len(dims) == 2 and dims[0] == out and dims[1] and cols % dims[1] == 0:
        return "groups"
    return None


def _dequantize_scaled(ckpt, name):
    """An FP8 or int8 weight times its scale tensor (_scale_layout), float32."""
    codes, scale_name = ckpt.get_tensor(name), _scale_name(ckpt, name)
    scale = ckpt.get_tensor(scale_name).float()
    fp8 = ckpt.dtype(name) == "F8_E4M3"
    layout = _scale_layout(scale.shape, codes.shape, fp8)
    if layout == "blocks":
        return _dequantize_fp8(codes, scale.reshape(quant._blocks(codes.shape[0]),
                                                    quant._blocks(codes.shape[1])), name)
    values = safetensors.fp8_e4m3_to_float(codes) if fp8 else codes.float()
    if layout == "tensor":
        return values * scale.reshape(())
    scale = scale.reshape(codes.shape[0], -1)
    return values * scale.repeat_interleave(codes.shape[1] // scale.shape[1], 1)


def _int_codes(ckpt, name):
    """The checkpoint's GPTQ, AWQ or compressed-tensors settings
    (int_checkpoints.config_of) where the weight `name` (X.weight) is held
    as integer codes (X.qweight, X.weight_packed, ...), else None;
    ValueError for such tensors without settings of their kind beside
    them."""
    stem = name[:-len("weight")]
    marker = next((m for m in int_checkpoints.MARKERS if stem + m in ckpt), None) \
        if name not in ckpt and name.endswith(".weight") else None
    if marker is None:
        return None
    if "_moec_int" not in vars(ckpt):  # (read as _open opens it)
        ckpt._moec_int = int_checkpoints.config_of(ckpt.folder)
    cfg = ckpt._moec_int
    if cfg is None or int_checkpoints.TENSORS_OF[cfg["method"]][0] != marker:
        kinds = [int_checkpoints.NAMES[k] for k, ts in int_checkpoints.TENSORS_OF.items()
                 if ts[0] == marker]
        raise ValueError(f"moec: '{stem}{marker}' in {ckpt.where(stem + marker)} is a "
                         f"{' or '.join(kinds)} weight, and {ckpt.folder} has no settings of "
                         "that kind to read it by (a config.json quantization_config with its "
                         "quant_method" + (", or a quantize_config.json" if "GPTQ" in kinds
                                           else "") + ")")
    return cfg


def _int_tensors(ckpt, name, cfg):
    """{suffix: tensor} of the integer-coded weight `name` (X.weight)."""
    stem = name[:-len("weight")]
    return {s: ckpt.get_tensor(stem + s) for s in int_checkpoints.TENSORS_OF[cfg["method"]]
            if stem + s in ckpt}


def _present(ckpt, name):
    """Whether the checkpoint holds the tensor `name`, as it is or as
    integer codes (GPTQ, AWQ, compressed-tensors)."""
    return name in ckpt or _int_codes(ckpt, name) is not None


def _read_weight(ckpt, name):
    """A checkpoint weight as a float or bf16 tensor: FP8 ones dequantized
    with their weight_scale_inv, integer-coded ones (GPTQ, AWQ,
    compressed-tensors) from their codes, zeros and scales."""
    cfg = _int_codes(ckpt, name)
    if cfg is not None:
        return int_checkpoints.dequantize(cfg, _int_tensors(ckpt, name, cfg))
    if ckpt.dtype(name) in SCALED and _scale_name(ckpt, name):
        return _dequantize_scaled(ckpt, name)
    if ckpt.dtype(name) == "F8_E4M3":
        raise ValueError(f"moec: '{name}' is F8_E4M3 and the checkpoint has no "
                         f"'{name}_scale_inv' to dequantize it")
    return ckpt.get_tensor(name)


FLOATS = ("F64", "F32", "F16", "BF16")


def _check_weight(ckpt, key, shape, dtype):
    """Refuses, before anything is copied, a checkpoint tensor that cannot
    fill a model tensor of `shape` and `dtype`: another shape; for a
    floating-point tensor, an integer or bool one (its values would be
    cast) unless it is FP8 or int8 codes with a floating-point scale tensor
    of a layout its shape takes (_scale_layout; DeepSeek-V3's
    weight_scale_inv: 128 x 128 blocks), or integer-coded tensors of other
    shapes or dtypes than such a weight's; for an integer one, another
    dtype. ValueError naming the tensor and its file."""
    cfg = _int_codes(ckpt, key)
    if cfg is not None:
        stem = key[:-len(".weight")]
        marker = f"{stem}.{int_checkpoints.TENSORS_OF[cfg['method']][0]}"
        if not dtype.is_floating_point or len(shape) != 2:
            raise ValueError(f"moec: '{marker}' in {ckpt.where(marker)} is a "
                             f"{int_checkpoints.NAMES[cfg['method']]} "
                             f"weight; the model's '{key}' is {dtype} {list(shape)}")
        have = [s for s in int_checkpoints.TENSORS_OF[cfg["method"]] if f"{stem}.{s}" in ckpt]
        int_checkpoints.check(cfg, shape, {s: ckpt.shape(f"{stem}.{s}") for s in have},
                              {s: ckpt.dtype(f"{stem}.{s}") for s in have}, stem,
                              lambda s: ckpt.get_tensor(f"{stem}.{s}"))
        return
    where = ckpt.where(key)
    if tuple(ckpt.shape(key)) != tuple(shape):
        raise ValueError(f"moec: '{key}' in {where} has shape {list(ckpt.shape(key))}; the "
                         f"model's is {list(shape)}")
    kind = ckpt.dtype(key)
    if not dtype.is_floating_point:
        if safetensors.DTYPES[kind] != dtype or kind == "F8_E4M3":
            raise ValueError(f"moec: '{key}' in {where} is {kind}; the model's is {dtype}")
    elif kind in SCALED and (kind == "F8_E4M3" or _scale_name(ckpt, key)):
        if len(shape) != 2:
            raise ValueError(f"moec: '{key}' in {where} is {kind} {list(shape)}: moec reads FP8 "
                             "and int8 codes of [out, in] weights only (fused experts in "
                             "floating point)")
        scale = _scale_name(ckpt, key)
        if scale is None:
            raise ValueError(f"moec: '{key}' is F8_E4M3 (in {where}) and the checkpoint has "
                             f"no '{key}_scale_inv' to dequantize it")
        blocks = [quant._blocks(n) for n in shape]
        if scale.endswith("_scale_inv"):  # DeepSeek-V3's: 128 x 128 blocks
            layout = "blocks" if ckpt.shape(scale) == blocks else None
        else:
            layout = _scale_layout(ckpt.shape(scale), shape, kind == "F8_E4M3")
        if layout is None or ckpt.dtype(scale) not in FLOATS:
            raise ValueError(f"moec: '{scale}' in {ckpt.where(scale)} is {ckpt.dtype(scale)} "
                             f"{ckpt.shape(scale)}; an {kind} weight of shape {list(shape)} "
                             + (f"needs floating-point scales of its 128x128 blocks, {blocks}"
                                if scale.endswith("_scale_inv") else
                                "needs floating-point scales of its rows [out, 1], groups "
                                "[out, n] or the whole tensor [1]"
                                + (f", or of its 128x128 blocks, {blocks}"
                                   if kind == "F8_E4M3" else "")))
    elif kind not in FLOATS:
        raise ValueError(f"moec: '{key}' in {where} is {kind}; the model's is {dtype} (a "
                         "floating-point tensor)")


def _expert_keys(model, ckpt):
    """[(layer, fused, keys)] for every patched block, each name checked in
    `ckpt` with its shape and dtype (_check_weight): keys [(expert index in
    the layer, gate, up, down checkpoint names)], or where the family's
    checkpoints keep the experts fused (fused True) [(expert index in the
    layer, expert, gate_up_proj's name, down_proj's name)]."""
    plan = []
    for name, _, experts in _patched(model):
        layer, family = experts.layer, experts.family
        prefix = _checkpoint_prefix(name, family)
        if family.checkpoint_experts == "fused":
            fused = (f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj")
            for key, shape in zip(fused, ((layer.experts, 2 * layer.inter, layer.hidden),
                                          (layer.experts, layer.hidden, layer.inter))):
                if key not in ckpt:
                    raise ValueError(f"moec: the checkpoint {ckpt.where(key)} has no '{key}' "
                                     f"(the experts of '{name}', fused as {family.name} "
                                     "checkpoints keep them)")
                _check_weight(ckpt, key, shape, layer.dtype)
            plan.append((layer, True,
                         [(j, e, *fused) for j, e in enumerate(_local_experts(layer))]))
            continue
        shapes = ((layer.inter, layer.hidden), (layer.inter, layer.hidden),
                  (layer.hidden, layer.inter))
        keys = []
        for j, e in enumerate(_local_experts(layer)):
            names = [f"{prefix}.experts.{e}.{p}.weight" for p in family.projections]
            for key, shape in zip(names, shapes):
                if not _present(ckpt, key):
                    raise ValueError(f"moec: the checkpoint {ckpt.where(key)} has no '{key}' "
                                     f"(expert {e} of '{name}')")
                _check_weight(ckpt, key, shape, layer.dtype)
            keys.append((j, *names))
        plan.append((layer, False, keys))
    return plan


def load_experts(model, checkpoint):
    """Fills a patched model's experts from a Hugging Face checkpoint folder
    (config.json, model.safetensors or shards with model.safetensors.index.json),
    under mpirun each process only its own experts. Every name and shape is
    checked first; then the experts are read one at a time from the mapped
    files into the layers, so no block's experts are held twice. FP8 weights
    (F8_E4M3 with weight_scale_inv per 128x128 block, as DeepSeek-V3 ships)
    and int8 or integer-coded ones (moec_torch.int_checkpoints) are copied
    as they are into a layer whose format holds them (_copy_fp8_expert,
    _copy_int8_expert, _copy_int_expert), else dequantized to the layer's
    dtype (and quantized again in its format). Returns the names read."""
    ckpt = _open(checkpoint)
    plan = _expert_keys(model, ckpt)
    read = []
    with torch.no_grad():
        for layer, fused, keys in plan:
            if fused:  # (the mapped tensors, each expert read as its slice is copied)
                gate_up, down = (_read_weight(ckpt, n) for n in keys[0][2:])
                for j, e, _, _ in keys:
                    _set_expert(layer, j, gate_up[e, :layer.inter], gate_up[e, layer.inter:],
                                down[e])
                read += list(keys[0][2:])
                continue
            for j, g, u, d in keys:
                if not (_copy_fp8_expert(layer, j, ckpt, g, u, d)
                        or _copy_int8_expert(layer, j, ckpt, g, u, d)
                        or _copy_int_expert(layer, j, ckpt, g, u, d)):
                    _set_expert(layer, j, *(_read_weight(ckpt, n) for n in (g, u, d)))
                read += [g, u, d]
    return read


def _copy_fp8_expert(layer, j, ckpt, g, u, d):
    """An FP8 checkpoint's expert into an fp8_block128 layer as it is: the
    codes and weight_scale_inv copied, nothing dequantized. Where the blocks
    do not line up (I not a multiple of 128: gate's last block and up's first
    would share a block of the layer's w1) returns False, and the expert is
    dequantized and quantized again."""
    names = (g, u, d)
    if layer.weight_format != "fp8_block128" or layer.inter % quant.BLOCK or \
            any(n not in ckpt or ckpt.dtype(n) != "F8_E4M3" for n in names):
        return False
    i, h = layer.inter, layer.hidden
    fmt = quant.parse(layer.weight_format)
    for n in names:
        if _scale_name(ckpt, n) is None:
            raise ValueError(f"moec: '{n}' is F8_E4M3 and the checkpoint has no "
                             f"'{n}_scale_inv' to go with it")
    parts = []
    for n, shape in zip(names, ((i, h), (i, h), (h, i))):
        codes, scales = ckpt.get_tensor(n), ckpt.get_tensor(_scale_name(ckpt, n))
        want = fmt.scale_shape(*shape)
        if tuple(scales.shape) != want:
            if not _scale_name(ckpt, n).endswith("_scale_inv"):
                return False  # compressed-tensors' scales by tensor or row: dequantized
            raise ValueError(f"moec: '{n}_scale_inv' in {ckpt.where(n + '_scale_inv')} has "
                             f"shape {list(scales.shape)}; a {list(codes.shape)} weight in "
                             f"128x128 blocks needs {list(want)}")
        parts.append((codes, scales))
    (gate, gate_s), (up, up_s), (down, down_s) = parts
    _store_quantized(layer, j, torch.cat((gate, up)), torch.cat((gate_s, up_s)), down, down_s)
    return True


def _copy_int8_expert(layer, j, ckpt, g, u, d):
    """An int8 checkpoint's expert (compressed-tensors' int-quantized, a
    scale per output channel) into an int8 layer as it is: codes and scales
    copied. Otherwise (another layer format, scales by group) returns False,
    and the expert is dequantized (and quantized again)."""
    names = (g, u, d)
    if layer.weight_format != "int8" or \
            any(n not in ckpt or ckpt.dtype(n) != "I8" or _scale_name(ckpt, n) is None or
                _scale_layout(ckpt.shape(_scale_name(ckpt, n)), ckpt.shape(n), False) != "rows"
                for n in names):
        return False
    codes = [ckpt.get_tensor(n) for n in names]
    scales = [ckpt.get_tensor(_scale_name(ckpt, n)).float().reshape(-1) for n in names]
    _store_quantized(layer, j, torch.cat(codes[:2]), torch.cat(scales[:2]), codes[2], scales[2])
    return True


def _copy_int_expert(layer, j, ckpt, g, u, d):
    """An integer-coded checkpoint's expert into an int4 layer as it is: its
    codes, scales and zeros copied, nothing rounded again, where the layer's
    format holds them (int_checkpoints.as_format: 4 bits, the format's group
    size, groups in order, and for int4_g<G> without zero points every zero 8);
    otherwise returns False, and the expert is dequantized (and quantized
    again)."""
    cfg = _int_codes(ckpt, g)
    if cfg is None or not layer.weight_format:
        return False
    held = []
    for n in (g, u, d):
        if _int_codes(ckpt, n) is None:
            return False
        held.append(int_checkpoints.as_format(cfg, _int_tensors(ckpt, n, cfg),
                                              layer.weight_format))
        if held[-1] is None:
            return False
    (gate, gate_s), (up, up_s), (down, down_s) = held
    _store_quantized(layer, j, torch.cat((gate, up)), torch.cat((gate_s, up_s)), down, down_s)
    return True


def _ignored(model, ignore):
    """The regexes of checkpoint names load_checkpoint skips: `ignore`, and
    every module's _keys_to_ignore_on_load_unexpected (transformers' list
    of names its checkpoints hold and the model does not, such as
    DeepSeek-V3's multi-token prediction layer, model.layers.61.*)."""
    patterns = [ignore] if isinstance(ignore, str) else list(ignore)
    for m in model.modules():
        patterns += list(getattr(m, "_keys_to_ignore_on_load_unexpected", None) or ())
    out = []
    for p in dict.fromkeys(patterns):
        try:
            out.append(re.compile(p))
        except (re.error, TypeError) as e:
            raise ValueError(f"moec: load_checkpoint: {p!r} is not a regex of names to "
                             f"skip ({e})") from None
    return out


def load_checkpoint(model, checkpoint, ignore=()):
    """Loads every tensor of a checkpoint folder into a patched model: the
    experts through load_experts, every other parameter and buffer by its
    name (FP8 ones dequantized). A name the model has and the checkpoint
    lacks (but a tied lm_head.weight), or one the checkpoint has and the
    model lacks, is an error, raised before anything is copied, but for
    names that a regex of `ignore` or of the model's modules'
    _keys_to_ignore_on_load_unexpected finds (re.search, as transformers
    skips them): those are not read. The model may be wholly on the meta
    device (made without memory, then patched): its parameters and buffers
    get memory here, tied ones staying tied, so no weight is ever in memory
    twice. Returns the names skipped."""
    ckpt = _open(checkpoint)
    skip = _ignored(model, ignore)
    blocks = _patched(model)
    own = _non_expert_state(model)
    if getattr(_config_of(model), "tie_word_embeddings", False):
        own.pop("lm_head.weight", None)
    ranks = blocks[0][2].layer.ranks
    known = set(own) | {n for r in range(ranks) for n, _, _ in _expert_entries(blocks, r)}
    missing = [k for k in own if not _present(ckpt, k)]
    skipped = [k for k in ckpt.keys() if k not in known and any(p.search(k) for p in skip)]
    passed = known | set(skipped)
    extra = [k for k in ckpt.keys() if k not in passed
             and not (k.endswith(("_scale_inv", "_scale"))
                      and k.rsplit("_scale", 1)[0] in known)
             and not (k.rsplit(".", 1)[-1] in int_checkpoints.TENSORS
                      and k.rsplit(".", 1)[0] + ".weight" in known)]
    for names, what in ((missing, "the checkpoint {where} has no '{name}'"),
                        (extra, "the model has no '{name}' of {where}")):
        if names:
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            raise ValueError("moec: " + what.format(name=names[0], where=ckpt.where(names[0]))
                             + more)
    for key, t in own.items():
        _check_weight(ckpt, key, t.shape, t.dtype)
    _expert_keys(model, ckpt)
    load_experts(model, ckpt)
    if any(t.is_meta for t in own.values()):
        _materialize(model, {id(t) for t in own.values()})
        own = {k: v for k, v in _non_expert_state(model).items() if k in own}
    with torch.no_grad():
        for key, t in own.items():
            t.copy_(_read_weight(ckpt, key))
    if getattr(_config_of(model), "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        model.tie_weights()  # transformers' models tie lm_head to the embedding here
    return skipped


def _materialize(model, wanted):
    """Gives the meta parameters and buffers of `model` whose ids are in
    `wanted` CPU memory (uninitialized, for the checkpoint to fill); a
    tensor that several modules share (tied embeddings) stays shared."""
    made = {}
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for n, t in list(getattr(module, kind).items()):
                if t is None or not t.is_meta or id(t) not in wanted:
                    continue
                if id(t) not in made:
                    new = torch.empty(t.shape, dtype=t.dtype)
                    made[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) \
                        if isinstance(t, torch.nn.Parameter) else new
                getattr(module, kind)[n] = made[id(t)]


def _non_expert_state(model):
    """{checkpoint name: tensor} of the model's state_dict without moec's
    layers (the tensors themselves); a block that the module tree names
    otherwise than checkpoints do (v5's Mixtral mlp) under its checkpoint
    name."""
    renames = [(n + ".", _checkpoint_prefix(n, ex.family) + ".") for n, _, ex in _patched(model)
               if _checkpoint_prefix(n, ex.family) != n]
    out = {}
    for k, v in model.state_dict(keep_vars=True).items():
        if ".experts.layer." in f".{k}":
            continue
        for old, new in renames:
            if k.startswith(old):
                k = new + k[len(old):]
        out[k] = v
    return out
