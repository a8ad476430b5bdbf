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

PEFT's LoRA on parameters (``target_parameters``; peft.tuners.lora.ParamWrapper),
as on transformers v5's fused expert parameters [E, out, in]:

    names = add_param_lora(model, ["gate_up_proj", "down_proj"], r=8, lora_alpha=16)

wraps the module holding each targeted parameter (several parameters of one
module: the wrappers nest, the first parameter innermost, under
``base_layer``); lora_A is an nn.Linear(in, r E), lora_B nn.Linear(r E,
out), and the forward runs the module with the parameter replaced by
``W + scaling * delta``, delta[e] = B_e A_e, A_e = lora_A.weight viewed
[E, r, in] at e and B_e = lora_B.weight viewed [out, r, E] at e (PEFT's
get_delta_weight: einsum("o r e, e r i -> e o i")). Saved names
``base_model.model.<module>[.base_layer].lora_A.weight``. Both forms take
PEFT's rank_pattern, alpha_pattern (a pattern P matches a name N where
N matches (.*[.])?(P)$) and use_rslora (scaling lora_alpha / sqrt(r)).
"""

import json
import math
import re
from pathlib import Path

import torch

from . import safetensors

__all__ = ["LoraLinear", "ParamLora", "add_lora", "add_param_lora", "load_lora",
           "lora_state_dict", "matches"]


def _scaling(lora_alpha, r, use_rslora):
    return lora_alpha / (math.sqrt(r) if use_rslora else r)


def _pattern(patterns, name, default):
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


class LoraLinear(torch.nn.Module):
    """An nn.Linear with a LoRA adapter, with PEFT's attribute names."""

    def __init__(self, base_layer, r, lora_alpha, use_rslora=False):
        super().__init__()
        self.base_layer = base_layer
        self.r = r
        self.scaling = _scaling(lora_alpha, r, use_rslora)
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


def _replace(model, name, module):
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def add_lora(model, target_modules, r, lora_alpha, rank_pattern=None, alpha_pattern=None,
             use_rslora=False):
    """Puts a LoraLinear on every nn.Linear whose name matches, freezes
    every other parameter, and returns the names of the adapted modules.
    "all-linear" is PEFT's shorthand: the last names of every nn.Linear but
    the output layer (get_output_embeddings)."""
    if isinstance(target_modules, str) and target_modules.lower() == "all-linear":
        out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        target_modules = sorted({n.rpartition(".")[2] for n, m in model.named_modules()
                                 if isinstance(m, torch.nn.Linear) and m is not out})
    names = [n for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and matches(n, target_modules)]
    if not names:
        raise ValueError(f"hf_lora: no nn.Linear of the model matches {target_modules!r}")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        _replace(model, name, LoraLinear(model.get_submodule(name), _pattern(rank_pattern, name, r),
                                         _pattern(alpha_pattern, name, lora_alpha), use_rslora))
    return names


class _Delta(torch.nn.Module):
    """The parametrization W -> W + delta."""

    def __init__(self, delta):
        super().__init__()
        self.delta = delta

    def forward(self, w):
        return w + self.delta


class ParamLora(torch.nn.Module):
    """PEFT's ParamWrapper: a LoRA adapter on the parameter `parameter_name`
    [E, out, in] of the module that `base_layer` is (or wraps)."""

    def __init__(self, base_layer, parameter_name, r, lora_alpha, use_rslora=False):
        super().__init__()
        self.base_layer = base_layer
        self.parameter_name = parameter_name
        w = self.get_param()
        self.num_experts, out_features, in_features = w.shape
        self.scaling = _scaling(lora_alpha, r, use_rslora)
        self.lora_A = torch.nn.Linear(in_features, r * self.num_experts, bias=False,
                                      dtype=w.dtype, device=w.device)
        self.lora_B = torch.nn.Linear(r * self.num_experts, out_features, bias=False,
                                      dtype=w.dtype, device=w.device)
        torch.nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        torch.nn.init.zeros_(self.lora_B.weight)

    def get_base_layer(self):
        base = self.base_layer
        while isinstance(base, ParamLora):
            base = base.base_layer
        return base

    def get_param(self):
        return getattr(self.get_base_layer(), self.parameter_name)

    def delta_weight(self):
        e = self.num_experts
        a = self.lora_A.weight.reshape(e, -1, self.lora_A.weight.shape[-1])
        b = self.lora_B.weight.reshape(self.lora_B.weight.shape[0], -1, e)
        return torch.einsum("o r e, e r i -> e o i", b, a) * self.scaling

    def forward(self, *args, **kwargs):
        parametrize = torch.nn.utils.parametrize
        base = self.get_base_layer()
        parametrize.register_parametrization(base, self.parameter_name,
                                             _Delta(self.delta_weight()))
        try:
            with parametrize.cached():
                return self.base_layer(*args, **kwargs)
        finally:
            parametrize.remove_parametrizations(base, self.parameter_name,
                                                leave_parametrized=False)


def add_param_lora(model, target_parameters, r, lora_alpha, rank_pattern=None,
                   alpha_pattern=None, use_rslora=False):
    """Puts a ParamLora on every parameter whose name ("<module>.<param>")
    equals an entry of target_parameters or ends with "." + entry, in
    module order and each module's parameter order; freezes every other
    parameter; returns the names of the adapted parameters."""
    hits = [(n, p) for n, m in model.named_modules() if not isinstance(m, ParamLora)
            for p, _ in m.named_parameters(recurse=False)
            if matches(f"{n}.{p}" if n else p, list(target_parameters))]
    if not hits:
        raise ValueError(f"hf_lora: no parameter of the model matches {target_parameters!r}")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, param in hits:
        key = f"{name}.{param}" if name else param
        _replace(model, name, ParamLora(model.get_submodule(name), param,
                                        _pattern(rank_pattern, key, r),
                                        _pattern(alpha_pattern, key, lora_alpha), use_rslora))
    return [f"{n}.{p}" if n else p for n, p in hits]


def lora_state_dict(model):
    """{PEFT's saved name: tensor} of every adapter of the model."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (LoraLinear, ParamLora)):
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
    args = (config["r"], config["lora_alpha"], config.get("rank_pattern"),
            config.get("alpha_pattern"), bool(config.get("use_rslora")))
    if config.get("target_modules"):
        add_lora(model, config["target_modules"], *args)
    if config.get("target_parameters"):
        add_param_lora(model, config["target_parameters"], *args)
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
