"""Adapters out and in, in PEFT's files and names for the unpatched model. See the package's
docstring."""

import json
import re
from pathlib import Path

import torch

from .. import adapters, checks, safetensors

from .patch import _checkpoint_prefix, _config_of, _local_experts, _patched, barrier


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


def _adapter_tensors(name, experts):
    """(PEFT name, layer parameter, expert index in the layer, A or B, the
    parameter's [rows, cols] of this module) of every adapter tensor of one
    block this process holds."""
    layer, lora = experts.layer, experts.lora
    prefix = _checkpoint_prefix(name, experts.family)
    for j, e in enumerate(_local_experts(layer)):
        for module, target, acols, brows, bcols in lora.pieces(layer.inter):
            base = f"base_model.model.{prefix}.experts.{e}.{module}"
            yield f"{base}.lora_A.weight", getattr(layer, f"{target}_lora_A"), j, \
                (slice(None), acols)
            yield f"{base}.lora_B.weight", getattr(layer, f"{target}_lora_B"), j, (brows, bcols)


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
    sees) and writes the config. adapter_model.safetensors and the config
    are replaced whole or not at all (safetensors.write_together: written
    under scratch names, then renamed, the config last). Returns the files
    written."""
    blocks = _lora_of(model)
    directory = Path(directory)
    layer = blocks[0][2].layer
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
        writes.append((whole, safetensors.file_writer(tensors, whole, {"format": "pt"})))
        lora = blocks[0][2].lora
        base = getattr(_config_of(model), "_name_or_path", None) or None
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM",
                  "base_model_name_or_path": base, "r": lora.r, "lora_alpha": lora.alpha,
                  "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
                  "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
                  "use_rslora": False, "use_dora": False, "rank_pattern": {},
                  "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None,
                  "target_modules": _target_regex(blocks)}
        writes.append((directory / ADAPTER_CONFIG, json.dumps(config, indent=2).encode()))
        safetensors.write_together(writes)
        for part in parts:
            part.unlink()
    if sharded:
        barrier(model)
    return [path for path, _ in writes[::-1]]


def _all_adapter_names(blocks):
    """The PEFT names of every adapter of every expert of the blocks (all
    processes' experts)."""
    names = set()
    for name, _, experts in blocks:
        prefix = _checkpoint_prefix(name, experts.family)
        for e in range(experts.layer.experts):
            for module, *_ in experts.lora.pieces(experts.layer.inter):
                names |= {f"base_model.model.{prefix}.experts.{e}.{module}.lora_{m}.weight"
                          for m in "AB"}
    return names


def load_adapters(model, directory):
    """Loads adapters that save_adapters (or PEFT, for the unpatched model)
    wrote into a patched model's experts. adapter_config.json is checked
    (adapters.read_config: every field of its type; peft_type, r and
    lora_alpha must be the model's); only adapter_model.safetensors is read
    (or, where the folder has none, adapter_model.bin with weights_only),
    never another file of the folder. Every tensor of this process's
    experts must be there, floating point and of its shape, and no tensor
    may name an expert or a module the blocks' adapters lack, before any
    is copied. Tensors of other modules in the file (say, attention
    adapters) are not moec's and are returned, not loaded."""
    blocks = _lora_of(model)
    directory = Path(directory)
    config = adapters.read_config(directory)
    lora = blocks[0][2].lora
    want = {"peft_type": "LORA", "r": lora.r, "lora_alpha": lora.alpha}
    got = {k: config.get(k) for k in want}
    if got != want:
        raise ValueError(f"moec: the adapters in {directory} are {got}; the model's are {want}")
    tensors = adapters.read_tensors(adapters.weight_files(directory, config))
    known = _all_adapter_names(blocks)
    for name, _, experts in blocks:
        adapters.unknown_experts(
            tensors, f"base_model.model.{_checkpoint_prefix(name, experts.family)}.experts.",
            known, experts.layer.experts)
    updates, used = [], set()
    for name, _, experts in blocks:
        for key, p, j, (rows, cols) in _adapter_tensors(name, experts):
            t = adapters.tensor(tensors, key, tuple(p[j][rows, cols].shape)[::-1])
            if t is None:
                raise ValueError(f"moec: the adapters in {directory} have no '{key}'")
            updates.append((p, j, rows, cols, t))
            used.add(key)
    with torch.no_grad():
        for p, j, rows, cols, t in updates:
            p[j][rows, cols] = t.t().to(p.dtype)
    return sorted(k for k in tensors if k not in used and k not in known)
