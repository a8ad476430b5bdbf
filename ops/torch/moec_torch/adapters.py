"""LoRA adapter folders as PEFT saves them, read and written for
MoeFFN.save_adapters / load_adapters and moec_torch.hf.save_adapters /
load_adapters:

    config = read_config(folder)            # adapter_config.json, its fields checked
    files = weight_files(folder, config)    # exactly the files it names, never a glob
    tensors = read_tensors(files)           # {name: (tensor, file)}
    t = tensor(tensors, name, shape)        # floating point, of that shape

    save_layer(layer, folder, "experts")    # a MoeFFN's own adapters (its save_adapters)
    load_layer(layer, folder, "experts")    # and back (its load_adapters)

A folder holds adapter_config.json and adapter_model.safetensors (or, as
older PEFT wrote it, adapter_model.bin, read with weights_only); a MoeFFN
layer whose processes each saved their own experts leaves
adapter_model-rank{r}-of-{R}.safetensors instead, which the config's "moec"
section records ({"experts", "ranks", "module_prefix", "shards"}). Any other
file of the folder (a backup adapter_model.old.bin, a stray copy) is never
read. Every error is a ValueError naming the file and what is wrong.
"""

import json
import math
import os
from pathlib import Path

import torch

from . import checks, safetensors

__all__ = ["CONFIG", "LEGACY", "WEIGHTS", "check_config", "load_layer", "rank_file",
           "read_config", "read_tensors", "refuse_unsupported", "save_layer", "tensor",
           "unknown_experts", "weight_files"]

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
LEGACY = "adapter_model.bin"


def rank_file(rank, ranks):
    """The file of one process's experts: adapter_model-rank{r}-of-{R}.safetensors."""
    return f"adapter_model-rank{rank}-of-{ranks}.safetensors"


def _positive_int(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def read_config(directory):
    """The JSON object of `directory`/adapter_config.json (a regular file
    of at most 1 MiB; strict JSON), checked by check_config. ValueError
    "moec: adapter config 'PATH': ..." otherwise."""
    path = Path(directory) / CONFIG
    shown = f"moec: {checks.where(path, 'adapter config')}"
    doc = checks.strict_json(checks.read_small_file(path, "adapter config"), shown)
    return check_config(doc, shown)


def _names(value):
    return isinstance(value, list) and all(isinstance(t, str) for t in value)


def _pattern(value, rule):
    return isinstance(value, dict) and all(isinstance(k, str) and rule(v)
                                           for k, v in value.items())


def _positive_number(value):
    return not isinstance(value, bool) and isinstance(value, (int, float)) and \
        math.isfinite(value) and value > 0


def check_config(doc, shown):
    """`doc` (an adapter config's JSON object) with its fields checked by
    type: peft_type a string; r a positive integer; lora_alpha a positive
    finite number; target_modules a list of module names or a regex (a
    string), or absent (PEFT's default for the model's type);
    target_parameters a list of parameter names, or absent; rank_pattern
    and alpha_pattern objects of positive integers / numbers; use_rslora,
    use_dora, fan_in_fan_out and lora_bias true or false; bias a string;
    "moec", where present, an object of experts and ranks (positive
    integers, the ranks dividing the experts), module_prefix (a string) and
    shards (a bool). ValueError "`shown`: ..." otherwise."""
    if not isinstance(doc, dict):
        raise ValueError(f"{shown} must hold a JSON object, got {type(doc).__name__}")

    def refuse(key, rule):
        raise ValueError(f"{shown}: '{key}' must be {rule}, got {doc.get(key)!r}")

    if not isinstance(doc.get("peft_type"), str):
        refuse("peft_type", "a string (\"LORA\")")
    if not _positive_int(doc.get("r")):
        refuse("r", "a positive integer")
    if not _positive_number(doc.get("lora_alpha")):
        refuse("lora_alpha", "a positive number")
    targets = doc.get("target_modules")
    if targets is not None and not isinstance(targets, str) and not _names(targets):
        refuse("target_modules", "a list of module names or a regex")
    if doc.get("target_parameters") is not None and not _names(doc["target_parameters"]):
        refuse("target_parameters", "a list of parameter names")
    for key, rule, what in (("rank_pattern", _positive_int, "positive integers"),
                            ("alpha_pattern", _positive_number, "positive numbers")):
        if doc.get(key) is not None and not _pattern(doc[key], rule):
            refuse(key, f"an object of {what}")
    for key in ("use_rslora", "use_dora", "fan_in_fan_out", "lora_bias"):
        if doc.get(key) is not None and not isinstance(doc[key], bool):
            refuse(key, "true or false")
    if doc.get("bias") is not None and not isinstance(doc["bias"], str):
        refuse("bias", "a string (\"none\")")
    moec = doc.get("moec")
    if moec is not None:
        if not isinstance(moec, dict):
            refuse("moec", "an object (experts, ranks, module_prefix, shards)")
        for key, ok, rule in (("experts", _positive_int, "a positive integer"),
                              ("ranks", _positive_int, "a positive integer"),
                              ("module_prefix", lambda v: isinstance(v, str), "a string"),
                              ("shards", lambda v: isinstance(v, bool), "true or false")):
            if not ok(moec.get(key)):
                raise ValueError(f"{shown}: 'moec.{key}' must be {rule}, got "
                                 f"{moec.get(key)!r}")
        if moec["experts"] % moec["ranks"]:
            raise ValueError(f"{shown}: 'moec.experts' ({moec['experts']}) is not a multiple of "
                             f"'moec.ranks' ({moec['ranks']})")
    return doc


def refuse_unsupported(config, shown, extra=()):
    """Refuses the PEFT LoRA features whose adapters moec's layer does not
    compute (their tensors or their math differ from A and B scaled):
    DoRA, LoRA biases, fan_in_fan_out's transposed weights, adapters on
    some layers only; and `extra`, fields that the caller does not take
    (a MoeFFN's own adapters: rsLoRA's scaling, rank and alpha patterns,
    target_parameters). Each named with its value."""
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{shown}: peft_type is {config.get('peft_type')!r}; moec reads LoRA "
                         "adapters (\"LORA\") only")
    refused = [("use_dora", bool(config.get("use_dora")), "DoRA's magnitude vectors"),
               ("bias", config.get("bias", "none") not in ("none", None),
                "bias terms next to the adapters"),
               ("lora_bias", bool(config.get("lora_bias")), "a bias on lora_B"),
               ("fan_in_fan_out", bool(config.get("fan_in_fan_out")),
                "adapters of Conv1D (transposed) weights"),
               ("layers_to_transform", config.get("layers_to_transform") not in (None, []),
                "adapters on some layers only")]
    what = {"use_rslora": "rsLoRA's scaling (lora_alpha / sqrt(r))",
            "rank_pattern": "ranks by module", "alpha_pattern": "alphas by module",
            "target_parameters": "PEFT's target_parameters form"}
    refused += [(key, bool(config.get(key)), what[key]) for key in extra]
    for key, bad, meaning in refused:
        if bad:
            raise ValueError(f"{shown}: '{key}' is {config.get(key)!r} ({meaning}), which "
                             "moec's adapters do not compute")


def weight_files(directory, config, ranks=None):
    """The weight files the config names, and only those: where its "moec"
    section says shards, the rank files of `ranks` (default: all of them);
    else adapter_model.safetensors, or, where the folder has none,
    adapter_model.bin. A file that the config names and the folder lacks
    is reported when it is opened."""
    directory = Path(directory)
    moec = config.get("moec")
    if moec and moec["shards"]:
        ranks = range(moec["ranks"]) if ranks is None else ranks
        return [directory / rank_file(r, moec["ranks"]) for r in ranks]
    single = directory / WEIGHTS
    if os.path.lexists(single) or not os.path.lexists(directory / LEGACY):
        return [single]
    return [directory / LEGACY]


def read_tensors(files):
    """{name: (tensor, file)} of the weight files (safetensors, or a .bin
    read with weights_only; each opened by checks.open_regular), a name
    held by two of them refused."""
    out = {}
    for path in files:
        for name, t in safetensors.load_tensors(path).items():
            if name in out:
                raise ValueError(f"moec: {path}: holds '{name}', which {out[name][1]} "
                                 "holds too")
            out[name] = (t, path)
    return out


def tensor(tensors, name, shape):
    """The tensor `name` of read_tensors' dict, checked to be floating
    point (an integer or bool adapter would be cast, its values lost) and
    of `shape`; None where no file holds it."""
    found = tensors.get(name)
    if found is None:
        return None
    t, path = found
    if not t.is_floating_point():
        raise ValueError(f"moec: {path}: '{name}' is {t.dtype}; an adapter "
                         "is a floating-point tensor")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"moec: {path}: '{name}' has shape {list(t.shape)}; "
                         f"expected {list(shape)}")
    return t


def unknown_experts(tensors, stem, known, experts):
    """Refuses a tensor whose name starts with `stem` (the experts' names
    up to the expert number: "base_model.model.mlp.experts.") that is not
    one of `known`, the names of every adapter of the layer's `experts`
    experts: an adapter of another layer (more experts, other modules)."""
    for name, (_, path) in tensors.items():
        if name.startswith(stem) and name not in known:
            number = name[len(stem):].split(".", 1)[0]
            what = (f"expert {number}; the layer has {experts} experts"
                    if number.isdigit() and int(number) >= experts else
                    "a module the layer has no adapter for")
            raise ValueError(f"moec: {path}: '{name}' is not an adapter of "
                             f"this layer ({what})")


# A MoeFFN layer's own adapters (MoeFFN.save_adapters and load_adapters say
# what they do; these are their bodies).

def save_layer(layer, directory, module_prefix):
    """MoeFFN.save_adapters."""
    if not layer.lora_rank:
        raise RuntimeError("moec: this layer has no LoRA adapters (lora_rank=0)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if layer.tp_rank is not None:
        raise ValueError(
            f"moec: save_adapters with a TP rank per process (tp={layer.tp}): this process "
            "holds its TP rank's columns of w1's B and rows of w2's A, not the experts' "
            "adapters; save the state dicts (model.state_dict() on every process) and put "
            "them together with moec_torch.merge_state_dicts, or save from one process")
    sharded = layer.local_ranks != layer.ranks
    weights = directory / (rank_file(layer.first_rank, layer.ranks) if sharded else WEIGHTS)
    # Neither file may be one the layer reads (its config file, ...).
    for path in [weights] + ([directory / CONFIG] if layer.first_rank == 0 else []):
        layer._output(path, "save_adapters", "the adapter file")
    tensors = {name: getattr(layer, param)[e].detach().t().contiguous().clone()
               for param, e, name in layer._peft_names(module_prefix)}
    writes = [(weights, safetensors.file_writer(tensors, weights, {"format": "pt"}))]
    if layer.first_rank == 0:
        config = {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": None,
                  "r": layer.lora_rank, "lora_alpha": layer.lora_scaling * layer.lora_rank,
                  "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
                  "inference_mode": True, "modules_to_save": None,
                  "target_modules": [layer.PEFT_MODULES[t] for t in layer.lora_targets],
                  "moec": {"experts": layer.experts, "ranks": layer.ranks,
                           "module_prefix": module_prefix, "shards": sharded}}
        writes.append((directory / CONFIG, json.dumps(config, indent=2).encode()))
    safetensors.write_together(writes)
    return [path for path, _ in writes[::-1]]


def load_layer(layer, directory, module_prefix):
    """MoeFFN.load_adapters."""
    if not layer.lora_rank:
        raise RuntimeError("moec: this layer has no LoRA adapters (lora_rank=0)")
    directory = Path(directory)
    config = read_config(directory)
    shown = f"moec: {checks.where(directory / CONFIG, 'adapter config')}"
    refuse_unsupported(config, shown, ("use_rslora", "rank_pattern", "alpha_pattern",
                                       "target_parameters"))
    want = {"r": layer.lora_rank, "lora_alpha": layer.lora_scaling * layer.lora_rank,
            "target_modules": sorted(layer.PEFT_MODULES[t] for t in layer.lora_targets)}
    targets = config["target_modules"]
    got = {"r": config["r"], "lora_alpha": config["lora_alpha"],
           "target_modules": sorted(targets) if isinstance(targets, list) else targets}
    if got != want:  # a peft_type other than LORA was refused above
        raise ValueError(f"moec: the adapters in {directory} are {got}; this layer's are "
                         f"{want}")
    moec = config.get("moec")
    first = layer.first_rank * layer.local_experts
    count = layer.local_ranks * layer.local_experts
    ranks = None
    if moec is not None:
        if moec["experts"] != layer.experts:
            raise ValueError(f"{shown}: the adapters are of a layer of {moec['experts']} "
                             f"experts; this layer has {layer.experts}")
        if moec["module_prefix"] != module_prefix:
            raise ValueError(f"{shown}: the adapters were saved with module_prefix "
                             f"{moec['module_prefix']!r}; loading with {module_prefix!r}")
        # The rank files that hold this process's experts.
        per = moec["experts"] // moec["ranks"]
        ranks = range(first // per, (first + count - 1) // per + 1)
    tensors = read_tensors(weight_files(directory, config, ranks))
    known = {name for _, _, name in layer._peft_names(module_prefix, range(layer.experts))}
    unknown_experts(tensors, f"base_model.model.{module_prefix}.", known, layer.experts)
    # The files hold whole experts' adapters; a TP rank keeps its part.
    updates = []
    for param, e, name in layer._peft_names(module_prefix):
        t = tensor(tensors, name, layer._whole_shape(param)[::-1])
        if t is None:
            raise ValueError(f"moec: {directory} has no '{name}'")
        updates.append((param, e, layer._tp_part(param, t.t())[0]))
    with torch.no_grad():
        for param, e, t in updates:
            getattr(layer, param)[e].copy_(t)
