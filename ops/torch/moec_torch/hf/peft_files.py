"""Adapters out and in, in PEFT's files and names for the unpatched model. See the package's
docstring."""

import json
import math
import re
from pathlib import Path

import torch

from .. import adapters, checks, safetensors

from .patch import (_block_lora, _checkpoint_prefix, _config_of, _local_experts, _patched,
                    barrier)


# --- adapters out and in -----------------------------------------------------

ADAPTER_FILE = adapters.WEIGHTS
ADAPTER_CONFIG = adapters.CONFIG


def _lora_of(model):
    """The patched blocks, which must all carry LoRA adapters."""
    blocks = _patched(model)
    if any(b.lora is None for _, _, b in blocks):
        raise ValueError("moec: the model's moec experts have no LoRA adapters; patch it with "
                         "lora_rank=")
    return blocks


def _stem(name, experts):
    """The adapters' names of a block up to its experts: under the
    checkpoint's block name for per-expert modules (as PEFT names adapters
    of the unpatched v4 model), under the model's for fused parameters."""
    block = _checkpoint_prefix(name, experts.family) if experts.lora.form == "modules" else name
    return f"base_model.model.{block}.experts."


def _adapter_pieces(name, experts):
    """(PEFT's name, the layer parameter's name, expert index in the layer,
    the [rows, cols] of this module in the whole expert's A or B) of every
    adapter tensor of one block this process holds, an expert at a time:
    <stem><e>.<module>.lora_A.weight [r, in] and lora_B.weight [out, r],
    PEFT's own names in the modules form; in the parameters form _stacked
    puts them together."""
    layer, lora = experts.layer, experts.lora
    stem = _stem(name, experts)
    for j, e in enumerate(_local_experts(layer)):
        for module, target, acols, brows, bcols in lora.pieces(layer.inter):
            base = f"{stem}{e}.{module}"
            yield f"{base}.lora_A.weight", f"{target}_lora_A", j, (slice(None), acols)
            yield f"{base}.lora_B.weight", f"{target}_lora_B", j, (brows, bcols)


def _adapter_tensors(name, experts):
    """_adapter_pieces with the layer's parameter itself in place of its
    name (the whole expert's rows and columns: one process's, tp 1)."""
    for key, param, j, piece in _adapter_pieces(name, experts):
        yield key, getattr(experts.layer, param), j, piece


def _parameter_key(name, experts, piece, m):
    """PEFT's name of the adapter of a fused parameter: its ParamWrappers
    nest in the experts module's parameter order (the first innermost), so
    each wrapper outside this one adds a base_layer."""
    nesting = experts.lora.nesting
    depth = len(nesting) - 1 - nesting.index(piece)
    return f"{_stem(name, experts)}{'base_layer.' * depth}lora_{m}.weight"


def _parameter_pieces(blocks):
    """(name, experts, piece, A key, B key, rank) of every fused-parameter
    adapter of the blocks."""
    for name, _, experts in blocks:
        if experts.lora.form != "parameters":
            continue
        for piece, rank in experts.lora.ranks.items():
            yield (name, experts, piece, _parameter_key(name, experts, piece, "A"),
                   _parameter_key(name, experts, piece, "B"), rank)


def _stacked(tensors, blocks):
    """PEFT's target_parameters tensors from the per-expert ones of every
    expert: lora_A [E r, in], expert e's rows e r .. e r + r - 1 (expert
    major); lora_B [out, r E], expert e's column k at k E + e (rank major),
    as PEFT's ParamWrapper reshapes them."""
    out = dict(tensors)
    for name, experts, piece, a_key, b_key, rank in _parameter_pieces(blocks):
        stem, count = _stem(name, experts), experts.layer.experts
        a = [out.pop(f"{stem}{e}.{piece}.lora_A.weight") for e in range(count)]
        b = [out.pop(f"{stem}{e}.{piece}.lora_B.weight") for e in range(count)]
        out[a_key] = torch.cat(a).contiguous()
        out[b_key] = torch.stack(b, dim=2).reshape(b[0].shape[0], rank * count).contiguous()
    return out


def _unstacked(tensors, blocks, directory):
    """read_tensors' dict with PEFT's target_parameters tensors split into
    the per-expert ones _adapter_tensors names, each checked (floating
    point, of the layer's shape) before; a tensor under a block's experts
    that is not one of its adapters is refused."""
    out = dict(tensors)
    for name, experts, piece, a_key, b_key, rank in _parameter_pieces(blocks):
        layer, count = experts.layer, experts.layer.experts
        _, target, _, _, bcols = next(p for p in experts.lora.pieces(layer.inter)
                                      if p[0] == piece)
        inner = layer._whole_shape(f"{target}_lora_A")[0]  # whole experts' adapters
        outer = len(range(layer._whole_shape(f"{target}_lora_B")[1])[bcols])
        stem = _stem(name, experts)
        for key, shape in ((a_key, (count * rank, inner)), (b_key, (outer, rank * count))):
            if adapters.tensor(out, key, shape) is None:
                raise ValueError(f"moec: the adapters in {directory} have no '{key}'")
        (a, path), (b, _) = out.pop(a_key), out.pop(b_key)
        a, b = a.reshape(count, rank, inner), b.reshape(outer, rank, count)
        for e in range(count):
            out[f"{stem}{e}.{piece}.lora_A.weight"] = (a[e], path)
            out[f"{stem}{e}.{piece}.lora_B.weight"] = (b[:, :, e], path)
    for name, _, experts in blocks:
        if experts.lora.form == "parameters":
            stray = [k for k in out if k.startswith(_stem(name, experts)) and
                     not k[len(_stem(name, experts)):].split(".", 1)[0].isdigit()]
            if stray:
                raise ValueError(f"moec: {out[stray[0]][1]}: '{stray[0]}' is not an adapter "
                                 f"of the model's experts of '{name}' (their adapters are "
                                 f"{', '.join(experts.lora.ranks)})")
    return out


def _target_regex(blocks):
    """PEFT's target_modules as a regex (PEFT fullmatches a string against
    each module name): the routed experts' projections only, not the
    shared experts' or a dense MLP's of the same names."""
    parents = sorted({re.sub(r"\.\d+\.", r".\\d+.", _checkpoint_prefix(n, b.family))
                      .replace(".", r"\.").replace(r"\\d+\.", r"\d+\.")
                      for n, _, b in blocks})
    modules = sorted({m for _, _, b in blocks for m, *_ in b.lora.pieces(b.layer.inter)})
    return rf"^(?:{'|'.join(parents)})\.experts\.\d+\.(?:{'|'.join(modules)})$"


def save_adapters(model, directory):
    """Writes the LoRA adapters of a patched model as PEFT saves a LoRA of the
    unpatched one: adapter_config.json (peft_type LORA, r, lora_alpha,
    target_modules: a regex of the experts' projections) and
    adapter_model.safetensors with ``base_model.model.<block>.experts.<e>.
    <module>.lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r] for each
    module (gate_proj, up_proj, down_proj; Mixtral w1, w3, w2). Under mpirun
    each process writes its experts to adapter_model-<rank>-of-<ranks>.safetensors;
    once every process has, rank 0 joins them into adapter_model.safetensors
    (the one file PEFT reads; the folder must be one that every process
    sees) and writes the config; with a TP rank per process (tp > 1) each
    holds parts of the adapters, and this is refused (merge the state
    dicts). adapter_model.safetensors and the config
    are replaced whole or not at all (safetensors.write_together: written
    under scratch names, then renamed, the config last). A model patched
    with lora_target_parameters (or a target_parameters lora_config) is
    written in PEFT's target_parameters form instead: per block
    ``base_model.model.<block>.experts[.base_layer].lora_A.weight`` [E r,
    in] and ``lora_B.weight`` [out, r E] (_stacked), target_modules [] and
    target_parameters the parameters' names. The config carries the
    patch's use_rslora, rank_pattern and alpha_pattern. Returns the files
    written."""
    blocks = _lora_of(model)
    directory = Path(directory)
    layer = blocks[0][2].layer
    if layer.tp_rank is not None:
        raise ValueError(
            f"moec: save_adapters with expert tensor parallelism (tp={layer.tp}, a TP rank per "
            "process): each process holds its TP rank's part of the adapters; save the state "
            "dicts (model.state_dict() on every process) and put them together with "
            "moec_torch.merge_state_dicts, then save from a model patched in one process")
    sharded = layer.local_ranks != layer.ranks
    whole = directory / ADAPTER_FILE
    mine = directory / (f"adapter_model-{layer.first_rank:05d}-of-{layer.ranks:05d}"
                        ".safetensors" if sharded else ADAPTER_FILE)
    directory.mkdir(parents=True, exist_ok=True)
    for path in [mine] + ([whole, directory / ADAPTER_CONFIG] if layer.first_rank == 0 else []):
        checks.output_path(path, "save_adapters", "the adapter file")
    tensors = {}
    for name, _, experts in blocks:
        for key, p, j, (rows, cols) in _adapter_tensors(name, experts):
            tensors[key] = p[j][rows, cols].detach().t().contiguous().clone()
    writes, parts = [], []
    if sharded:
        safetensors.save_file(tensors, mine, metadata={"format": "pt"})
        barrier(model)
        if layer.first_rank == 0:
            parts = [directory / f"adapter_model-{r:05d}-of-{layer.ranks:05d}.safetensors"
                     for r in range(layer.ranks)]
            tensors = {}
            for part in parts:
                tensors.update(safetensors.load_file(part))
    if layer.first_rank == 0:
        tensors = _stacked(tensors, blocks)
        writes.append((whole, safetensors.file_writer(tensors, whole, {"format": "pt"})))
        peft = blocks[0][2].lora.peft
        fused = blocks[0][2].lora.form == "parameters"
        base = getattr(_config_of(model), "_name_or_path", None) or None
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM",
                  "base_model_name_or_path": base, "r": peft["r"],
                  "lora_alpha": peft["lora_alpha"], "lora_dropout": 0.0, "bias": "none",
                  "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
                  "modules_to_save": None, "use_rslora": peft["use_rslora"], "use_dora": False,
                  "rank_pattern": peft["rank_pattern"], "alpha_pattern": peft["alpha_pattern"],
                  "layers_to_transform": None, "layers_pattern": None,
                  "target_modules": [] if fused else _target_regex(blocks)}
        if fused:  # a key PEFT before 0.17 does not know: only where it is needed
            config["target_parameters"] = sorted(f"{n}.experts.{p}" for n, _, b in blocks
                                                 for p in b.lora.ranks)
        writes.append((directory / ADAPTER_CONFIG, json.dumps(config, indent=2).encode()))
        safetensors.write_together(writes)
        for part in parts:
            part.unlink()
    if sharded:
        barrier(model)
    return [path for path, _ in writes[::-1]]


def _all_adapter_names(blocks):
    """The per-expert names (_adapter_tensors') of every adapter of every
    expert of the blocks (all processes' experts)."""
    names = set()
    for name, _, experts in blocks:
        stem = _stem(name, experts)
        for e in range(experts.layer.experts):
            for module, *_ in experts.lora.pieces(experts.layer.inter):
                names |= {f"{stem}{e}.{module}.lora_{m}.weight" for m in "AB"}
    return names


def load_adapters(model, directory):
    """Loads adapters that save_adapters (or PEFT, for the unpatched model)
    wrote into a patched model's experts. adapter_config.json is checked
    (adapters.read_config: every field of its type; LoRA features moec
    does not compute, such as DoRA or bias terms, refused); its targets,
    ranks (rank_pattern) and scalings (lora_alpha, alpha_pattern,
    use_rslora), found by PEFT's rules, must be the model's, and it must be
    in the model's form (PEFT's target_modules on per-expert modules, or
    target_parameters on v5's fused parameters; patch_model(lora_config=
    the folder) patches a model for it). Only adapter_model.safetensors is
    read (or, where the folder has none, adapter_model.bin with
    weights_only), never another file of the folder. Every tensor of this
    process's experts must be there, floating point and of its shape, and
    no tensor may name an expert or a module the blocks' adapters lack,
    before any is copied; with a TP rank per process each keeps its part. Tensors of other modules in the file (say,
    attention adapters) are not moec's and are returned, not loaded."""
    blocks = _lora_of(model)
    directory = Path(directory)
    config = adapters.read_config(directory)
    shown = f"moec: {checks.where(directory / ADAPTER_CONFIG, 'adapter config')}"
    adapters.refuse_unsupported(config, shown)
    lora = blocks[0][2].lora
    form = "parameters" if config.get("target_parameters") else "modules"
    if form != lora.form:
        names = {"parameters": "target_parameters, on v5's fused expert parameters",
                 "modules": "target_modules, on per-expert modules"}
        raise ValueError(f"moec: the adapters in {directory} are PEFT's {names[form]}; the "
                         f"model's are {names[lora.form]}: patch the model with "
                         f"lora_config='{directory}' to load them")
    for name, _, experts in blocks:
        ours = experts.lora
        theirs = _block_lora(name, experts.family, experts.layer.experts, form == "parameters",
                             ours.nesting, config, shown)
        if theirs.ranks != ours.ranks or not math.isclose(theirs.scaling, ours.scaling,
                                                          rel_tol=1e-12):
            raise ValueError(f"moec: the adapters in {directory} give the experts of "
                             f"'{name}' ranks {theirs.ranks} (scaling {theirs.scaling:g}); the "
                             f"model's are {ours.ranks} (scaling {ours.scaling:g}): patch the "
                             f"model with lora_config='{directory}' to load them")
    tensors = _unstacked(adapters.read_tensors(adapters.weight_files(directory, config)),
                         blocks, directory)
    known = _all_adapter_names(blocks)
    for name, _, experts in blocks:
        adapters.unknown_experts(tensors, _stem(name, experts), known, experts.layer.experts)
    # Each expert's adapters put together whole from their pieces (the
    # entries of no piece zero, as the masks keep them), then the layer's
    # part of them copied in (all, or a TP rank's part).
    wholes, used = {}, set()
    for name, _, experts in blocks:
        layer = experts.layer
        for key, param, j, (rows, cols) in _adapter_pieces(name, experts):
            p = getattr(layer, param)
            whole = wholes.setdefault((name, param, j), (layer, torch.zeros(
                layer._whole_shape(param), dtype=p.dtype)))[1]
            t = adapters.tensor(tensors, key, tuple(whole[rows, cols].shape)[::-1])
            if t is None:
                raise ValueError(f"moec: the adapters in {directory} have no '{key}'")
            whole[rows, cols] = t.t().to(p.dtype)
            used.add(key)
    with torch.no_grad():
        for (_, param, j), (layer, whole) in wholes.items():
            getattr(layer, param)[j].copy_(layer._tp_part(param, whole)[0])
    return sorted(k for k in tensors if k not in used and k not in known)
