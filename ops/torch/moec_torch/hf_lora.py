"""PEFT's LoRA on nn.Linear modules, in plain PyTorch: a stand-in for
``peft.LoraModel`` where peft is not installed, and the outside judge of
moec's adapters (it shares no code with moec_torch.hf).

    names = add_lora(model, r"^.*\\.experts\\.\\d+\\.(?:gate_proj|up_proj)$", r=8, lora_alpha=16)
    load_lora(model, "adapter/")          # adapter_config.json + adapter_model.safetensors
    state = lora_state_dict(model)        # the names PEFT saves

As PEFT does: a targeted nn.Linear W becomes ``W x + (lora_alpha / r) *
lora_B(lora_A(x))`` with lora_A [r, in] (kaiming_uniform(a=sqrt(5)), i.e.
uniform in +-1/sqrt(in)) and lora_B [out, r] (zero); every other parameter of
the model is frozen; ``target_modules`` is a regex (a string, matched whole
against each module name) or a list of names (a module matches one that it
equals or ends with after a dot); the saved names are
``base_model.model.<module>.lora_A.weight`` and ``.lora_B.weight``.
"""

import json
import math
import re
from pathlib import Path

import torch

from . import safetensors

__all__ = ["LoraLinear", "add_lora", "load_lora", "lora_state_dict", "matches"]


class LoraLinear(torch.nn.Module):
    """An nn.Linear with a LoRA adapter, with PEFT's attribute names."""

    def __init__(self, base_layer, r, lora_alpha):
        super().__init__()
        self.base_layer = base_layer
        self.r = r
        self.scaling = lora_alpha / r
        w = base_layer.weight
        self.lora_A = torch.nn.Linear(base_layer.in_features, r, bias=False,
                                      dtype=w.dtype, device=w.device)
        self.lora_B = torch.nn.Linear(r, base_layer.out_features, bias=False,
                                      dtype=w.dtype, device=w.device)
        torch.nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        torch.nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


def matches(name, target_modules):
    """PEFT's rule: a string is a regex matched whole; a list matches a name
    equal to an entry or ending with "." + entry."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == t or name.endswith("." + t) for t in target_modules)


def add_lora(model, target_modules, r, lora_alpha):
    """Puts a LoraLinear on every nn.Linear whose name matches, freezes
    every other parameter, and returns the names of the adapted modules."""
    names = [n for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and matches(n, target_modules)]
    if not names:
        raise ValueError(f"hf_lora: no nn.Linear of the model matches {target_modules!r}")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, LoraLinear(getattr(owner, child), r, lora_alpha))
    return names


def lora_state_dict(model):
    """{PEFT's saved name: tensor} of every adapter of the model."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoraLinear):
            out[f"base_model.model.{name}.lora_A.weight"] = m.lora_A.weight
            out[f"base_model.model.{name}.lora_B.weight"] = m.lora_B.weight
    return out


def load_lora(model, directory):
    """Reads adapter_config.json and adapter_model.safetensors as PEFT's
    PeftModel.from_pretrained does, adds the adapters it names and loads
    them by name; every adapter must be in the file, and every tensor of
    the file must be an adapter's."""
    directory = Path(directory)
    config = json.loads((directory / "adapter_config.json").read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"hf_lora: {directory} holds a {config.get('peft_type')} adapter")
    add_lora(model, config["target_modules"], config["r"], config["lora_alpha"])
    state = lora_state_dict(model)
    tensors = safetensors.load_file(directory / "adapter_model.safetensors")
    if set(tensors) != set(state):
        missing = sorted(set(state) - set(tensors))[:3]
        extra = sorted(set(tensors) - set(state))[:3]
        raise ValueError(f"hf_lora: the adapters of {directory} do not fit the model "
                         f"(missing {missing}, not the model's {extra})")
    with torch.no_grad():
        for name, t in tensors.items():
            if t.shape != state[name].shape:
                raise ValueError(f"hf_lora: '{name}' has shape {list(t.shape)}; the model's "
                                 f"is {list(state[name].shape)}")
            state[name].copy_(t)
    return sorted(state)
