"""moec in Hugging Face-structured MoE models: patch the experts of a model,
fill them from a checkpoint, save PEFT adapters and merged checkpoints.

    import moec_torch.hf as mhf
    names = mhf.patch_model(model, ranks=2, threads=2, lora_rank=16, lora_alpha=32)
    mhf.load_experts(model, "Qwen3-30B-A3B/")      # or load_checkpoint: every tensor
    ...train...
    mhf.save_adapters(model, "adapter/")           # adapter_config.json + adapter_model.safetensors
    mhf.load_adapters(model, "adapter/")
    mhf.save_pretrained(model, "merged/", max_shard_size="5GB")

A model is "Hugging Face-structured" when its MoE blocks are transformers'
classes (or classes with their names, attributes and forward math, as
moec_torch.hf_models' stand-ins): Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V2,
DeepSeek-V3 and OLMoE, with experts either as per-expert modules
(``experts.<e>.gate_proj/up_proj/down_proj``, Mixtral ``w1/w3/w2``;
transformers v4) or fused parameters (``experts.gate_up_proj [E, 2I, H]``,
``experts.down_proj [E, H, I]``; transformers v5).

patch_model replaces each block's experts with a MoecExperts module that runs
a moec MoeFFN layer: the block's router and shared experts stay the model's
own; in the v5 layout the block's forward is untouched (its experts module
is called as the model calls it), in the v4 layout the block's forward (or
DeepSeek's ``moe`` method) is replaced by one with the same routing math that
calls the moec experts. Fused (v5) experts of a frozen or LoRA layer stay
where they are: the layer stores its weights transposed (MoeFFN
weights_transposed=True) and takes the model's gate_up_proj and down_proj
as its w1 and w2, the same tensors, when it holds every expert in their
dtype on the CPU (else it copies them once, in that layout). Otherwise the
model's expert weights are converted once into the layer's w1 [E, H, 2I] /
w2 [E, I, H] and the model's copies are freed.

LoRA: PEFT puts one adapter on each targeted nn.Linear, so gate_proj and
up_proj have an A and a B each. The moec layer holds them as one adapter of
rank r * (gate/up targets) on its fused w1, with A = [A_gate | A_up] and a
block-diagonal B, and one of the same rank on w2 whose columns past r are
zero; a gradient hook keeps the zero blocks zero, so the layer computes
exactly PEFT's per-module adapters. save_adapters writes them under PEFT's
names for the unpatched model.
"""

import json
import math
import os
import re
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from . import adapters, checks, quant, safetensors

__all__ = ["FAMILIES", "MoecExperts", "all_sum", "barrier", "find_blocks", "load_adapters",
           "load_checkpoint", "load_experts", "patch_model",
           "save_adapters", "save_pretrained"]


# --- families ---------------------------------------------------------------

class Family:
    """What moec needs to know of a model family: its config's model_type,
    its MoE block classes, its experts' projection names in checkpoints
    (gate, up, down), and how its v4 block routes: "softmax" (the block's
    forward is replaced by one with the same routing) or "moe_method"
    (DeepSeek: the block's ``moe`` method is)."""

    def __init__(self, name, blocks, projections, routing, checkpoint_block=None):
        self.name = name
        self.blocks = blocks
        self.projections = projections
        self.routing = routing
        # The block's name in checkpoints when the module tree names it
        # otherwise (transformers v5's Mixtral calls block_sparse_moe mlp).
        self.checkpoint_block = checkpoint_block

    def __repr__(self):
        return f"Family({self.name})"


PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
FAMILIES = [
    Family("qwen2_moe", ("Qwen2MoeSparseMoeBlock",), PROJECTIONS, "softmax"),
    Family("qwen3_moe", ("Qwen3MoeSparseMoeBlock",), PROJECTIONS, "softmax"),
    Family("mixtral", ("MixtralSparseMoeBlock",), ("w1", "w3", "w2"), "softmax",
           checkpoint_block="block_sparse_moe"),
    Family("deepseek_v2", ("DeepseekV2MoE", "DeepseekV2Moe"), PROJECTIONS, "moe_method"),
    Family("deepseek_v3", ("DeepseekV3MoE",), PROJECTIONS, "moe_method"),
    Family("olmoe", ("OlmoeSparseMoeBlock",), PROJECTIONS, "softmax"),
]
_BY_BLOCK = {cls: f for f in FAMILIES for cls in f.blocks}


def _known():
    return ", ".join(f"{f.name} ({'/'.join(f.blocks)})" for f in FAMILIES)


def _looks_like_moe(module):
    """A module that holds experts and a router, whatever its class."""
    return hasattr(module, "experts") and (hasattr(module, "gate") or hasattr(module, "router"))


def find_blocks(model):
    """[(name, block, family)] of every MoE block of `model`, in module
    order. A module that looks like an MoE block (experts and a gate) of
    an unknown class is refused, naming it and the known families."""
    found = []
    for name, module in model.named_modules():
        if any(name.startswith(f + ".") for f, _, _ in found):
            continue
        family = _BY_BLOCK.get(type(module).__name__)
        if isinstance(getattr(module, "experts", None), MoecExperts):
            raise ValueError(f"moec: the model is patched already ('{name}.experts' is moec's)")
        if family is not None:
            found.append((name, module, family))
        elif _looks_like_moe(module) and not isinstance(module, torch.nn.ModuleList):
            raise ValueError(
                f"moec: '{name}' ({type(module).__name__}) looks like an MoE block (it has "
                f"experts and a router) but is not one moec knows; known: {_known()}")
    return found


# --- the experts' weights ---------------------------------------------------

def _fused(experts):
    return not isinstance(experts, torch.nn.ModuleList) and hasattr(experts, "gate_up_proj")


def _expert_sizes(block, family, where):
    """(E, H, I) of a block's experts, from their weights."""
    ex = block.experts
    if _fused(ex):
        e, two_i, h = ex.gate_up_proj.shape
        if two_i % 2 or tuple(ex.down_proj.shape) != (e, h, two_i // 2):
            raise ValueError(f"moec: '{where}.experts': gate_up_proj {list(ex.gate_up_proj.shape)}"
                             f" and down_proj {list(ex.down_proj.shape)} are not [E, 2I, H] "
                             "and [E, H, I]")
        return e, h, two_i // 2
    if not isinstance(ex, torch.nn.ModuleList) or len(ex) == 0:
        raise ValueError(f"moec: '{where}.experts' is neither a ModuleList of experts nor "
                         "fused gate_up_proj/down_proj parameters")
    g, u, d = family.projections
    first = ex[0]
    for p in (g, u, d):
        if not isinstance(getattr(first, p, None), torch.nn.Linear):
            raise ValueError(f"moec: '{where}.experts.0' has no nn.Linear '{p}' "
                             f"({family.name} experts have {', '.join(family.projections)})")
    i, h = getattr(first, g).weight.shape
    return len(ex), h, i


def _expert_weights(block, family, e):
    """(gate [I, H], up [I, H], down [H, I]) of expert e, as nn.Linear
    weights [out, in]: views of the model's tensors."""
    ex = block.experts
    if _fused(ex):
        i = ex.gate_up_proj.shape[1] // 2
        return ex.gate_up_proj[e, :i], ex.gate_up_proj[e, i:], ex.down_proj[e]
    return tuple(getattr(ex[e], p).weight for p in family.projections)


def _dtype_name(dtype, where):
    names = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    if dtype not in names:
        raise ValueError(f"moec: {where}: the layer computes in float32 or bfloat16, not {dtype}; "
                         "pass dtype=torch.float32 or torch.bfloat16")
    return names[dtype]


# --- LoRA in PEFT's layout --------------------------------------------------

class _Lora:
    """PEFT's per-module adapters of one family on the layer's fused ones.

    targets: the family's module names targeted, among (gate, up, down).
    The layer's rank is r * max(1, gate/up targets); w1's A columns
    [j r, (j+1) r) and B rows of the same range over the j-th gate/up
    target's columns are its adapter; w2's first r columns of A and rows of
    B are down's. Masks keep the rest zero."""

    def __init__(self, family, targets, r, alpha):
        g, u, d = family.projections
        self.family = family
        self.r = r
        self.alpha = alpha
        self.w1_targets = [t for t in (g, u) if t in targets]
        self.down = d if d in targets else None
        self.rank = r * max(1, len(self.w1_targets))
        self.moec_targets = (("w1",) if self.w1_targets else ()) + (("w2",) if self.down else ())

    def pieces(self, inter):
        """[(module, moec target, A column slice, B row slice, B column slice)]:
        where each PEFT module's adapter lives in the layer's A [K, rank]
        and B [rank, N]."""
        out = []
        g = self.family.projections[0]
        for j, t in enumerate(self.w1_targets):
            rows = slice(j * self.r, (j + 1) * self.r)
            cols = slice(0, inter) if t == g else slice(inter, 2 * inter)
            out.append((t, "w1", rows, rows, cols))
        if self.down:
            rows = slice(0, self.r)
            out.append((self.down, "w2", rows, rows, slice(None)))
        return out

    def masks(self, layer):
        """{parameter name: 0/1 mask} of the entries that belong to an adapter."""
        masks = {}
        for target in self.moec_targets:
            a = getattr(layer, f"{target}_lora_A")
            b = getattr(layer, f"{target}_lora_B")
            masks[f"{target}_lora_A"] = torch.zeros(1, 1, a.shape[2], dtype=a.dtype)
            masks[f"{target}_lora_B"] = torch.zeros(1, *b.shape[1:], dtype=b.dtype)
        for _, target, acols, brows, bcols in self.pieces(layer.inter):
            masks[f"{target}_lora_A"][..., acols] = 1
            masks[f"{target}_lora_B"][:, brows, bcols] = 1
        return masks


# --- the moec experts module ------------------------------------------------

class MoecExperts(torch.nn.Module):
    """A block's routed experts on a moec MoeFFN layer, called as transformers
    v5 calls its experts module: forward(hidden_states [N, H], top_k_index
    [N, K], top_k_weights [N, K]) -> [N, H], in hidden_states' dtype.

    In one process with R in-process ranks the N tokens are shared out over
    the ranks, ceil(N / R) each, the last padded with tokens of zero weight
    that add exact zeros; under mpirun each process passes its own tokens.
    `layer` is the MoeFFN; `family` the model family; `lora` the PEFT layout
    of its adapters, or None."""

    def __init__(self, layer, family, lora=None):
        super().__init__()
        self.layer = layer
        self.family = family
        self.num_experts = layer.experts
        self.lora = lora
        self._masks = lora.masks(layer) if lora else {}
        for name, mask in self._masks.items():
            getattr(layer, name).register_hook(lambda g, m=mask: g * m.to(g.dtype))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        layer = self.layer
        n, h = hidden_states.shape
        k = top_k_index.shape[-1]
        x = hidden_states.to(layer.dtype)
        weights = top_k_weights.float()
        ids = top_k_index.long()
        # The ranks this process runs: all of them in one process, its own
        # under mpirun. Each gets ceil(n / r) tokens (at least one).
        r = layer.local_ranks
        s = max(1, -(-n // r))
        pad = r * s - n
        if pad:
            x = torch.cat((x, x.new_zeros(pad, h)))
            weights = torch.cat((weights, weights.new_zeros(pad, k)))
            spread = (torch.arange(pad).unsqueeze(1) * k + torch.arange(k)) % layer.experts
            ids = torch.cat((ids, spread))
        if r == 1:
            return layer(x, ids, weights)[:n].to(hidden_states.dtype)
        y = layer(x.view(r, s, h), ids.view(r, s, k), weights.view(r, s, k))
        return y.reshape(r * s, h)[:n].to(hidden_states.dtype)

    def extra_repr(self):
        if not self.lora:
            return f"family={self.family.name}"
        modules = self.lora.w1_targets + ([self.lora.down] if self.lora.down else [])
        return f"family={self.family.name}, lora r={self.lora.r} on {'/'.join(modules)}"


def _route_softmax(block, hidden_states):
    """transformers v4's Qwen2/3-MoE, Mixtral and OLMoE routing: softmax in
    fp32 over all experts, top-k, renormalized (Mixtral always, the others
    when norm_topk_prob), cast back to the hidden dtype."""
    logits = block.gate(hidden_states)
    weights = F.softmax(logits, dim=1, dtype=torch.float)
    weights, selected = torch.topk(weights, block.top_k, dim=-1)
    if getattr(block, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, selected, weights.to(hidden_states.dtype)


def _softmax_block_forward(self, hidden_states):
    """The v4 block's forward with moec's experts: the same routing, shared
    expert and return value ((hidden states, router logits)), for hidden
    states of any shape [..., H]."""
    shape = hidden_states.shape
    if self.training and getattr(self, "jitter_noise", 0) > 0:  # Mixtral
        hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
            1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
    flat = hidden_states.reshape(-1, shape[-1])
    logits, selected, weights = _route_softmax(self, flat)
    out = self.experts(flat, selected, weights)
    if hasattr(self, "shared_expert"):  # Qwen2-MoE
        shared = self.shared_expert(flat)
        out = out + torch.sigmoid(self.shared_expert_gate(flat)) * shared
    return out.reshape(shape), logits


def _moe_method(self, hidden_states, topk_indices, topk_weights):
    """DeepSeek's v4 ``moe`` method (the routed experts' sum) on moec's
    experts; the block's forward (router, shared experts) stays its own."""
    return self.experts(hidden_states, topk_indices, topk_weights).to(hidden_states.dtype)


# --- patching ---------------------------------------------------------------

def _config_of(model):
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError("moec: the model has no .config (a Hugging Face model carries its "
                         "PretrainedConfig as model.config)")
    return config


def _family_of_config(config):
    model_type = getattr(config, "model_type", None)
    return next((f for f in FAMILIES if f.name == model_type), None)


def _top_k(block, config):
    for source in (block, getattr(block, "gate", None), config):
        for key in ("top_k", "num_experts_per_tok"):
            value = getattr(source, key, None) if source is not None else None
            if isinstance(value, int) and value > 0:
                return value
    raise ValueError("moec: cannot tell the block's top-k (no top_k or num_experts_per_tok)")


def patch_model(model, ranks=None, *, threads=0, dtype=None, tokens_per_rank=256,
                lora_rank=0, lora_alpha=None, lora_targets=None, **options):
    """Replaces the routed experts of every MoE block of `model` with a moec
    layer, in place, and returns the names of the blocks it replaced.

    ranks: the EP group's size (default 1 in one process; under mpirun or
    over a torch.distributed group, the processes); threads: the runtime's workers per block (0: the hardware
    threads); dtype: the layer's (default the experts' weights', float32 or
    bfloat16); tokens_per_rank: the capacity compiled first (it grows with
    the batches). lora_rank, lora_alpha, lora_targets: LoRA adapters as PEFT
    puts them on the experts' projections (lora_targets: the family's module
    names, default all three: gate_proj, up_proj, down_proj, Mixtral w1, w3,
    w2; lora_alpha defaults to lora_rank); the experts' base weights are then
    frozen. Other options go to MoeFFN (frozen, main_grad, dispatch_dtype,
    capacity_policy, timeout_seconds, fabric, group, target, check_finite, trace,
    weight_format, pack_weights). With a weight_format (frozen or LoRA; quant.WEIGHT_FORMATS)
    the experts are held quantized: "fp8_block128" as FP8 e4m3 codes with a
    scale per 128 x 128 block, for which load_experts copies an FP8
    checkpoint's weight and weight_scale_inv as they are; "int8" and
    "int4_g*" (and an FP8 layer from a bf16 or fp32 checkpoint) quantize the
    experts as they are loaded.

    The model's expert weights (on any device but meta) are converted once
    into the layer's and freed, except fused (v5) experts of a frozen or
    LoRA layer, which the layer reads in place (the module docstring); a
    model built with its experts on the meta device is patched with empty
    experts, for load_experts to fill."""
    config = _config_of(model)
    blocks = find_blocks(model)
    if not blocks:
        family = _family_of_config(config)
        what = f"a {family.name} model" if family else \
            f"model_type {getattr(config, 'model_type', None)!r}"
        raise ValueError(f"moec: found no MoE block in {type(model).__name__} ({what}); "
                         f"known blocks: {_known()}")
    lora_rank = checks.integer(lora_rank, "patch_model: argument 'lora_rank'", minimum=0)
    tokens_per_rank = checks.integer(tokens_per_rank, "patch_model: argument 'tokens_per_rank'",
                                     minimum=1)
    if lora_alpha is not None and not lora_rank:
        raise ValueError("moec: lora_alpha= needs lora_rank= (the adapters' rank)")
    alpha = checks.number(lora_alpha, "patch_model: argument 'lora_alpha'") \
        if lora_alpha is not None else float(lora_rank)
    from . import MoeFFN, _default_fabric, _fabric  # the package imports this lazily
    fabric = options.get("fabric")
    if ranks is None:
        # The processes under mpirun or over a torch.distributed group,
        # else 1.
        spread = options.get("group") is not None or \
            (fabric or _default_fabric()) in ("mpi", "group")
        ranks = _fabric(fabric, options.get("group"), None, options.get("tp", 1),
                        "patch_model")[1] if spread else 1
    group = checks.integer(ranks, "patch_model: argument 'ranks'", minimum=1)
    # Check every block before changing any.
    plans = []
    for name, block, family in blocks:
        e, h, i = _expert_sizes(block, family, name)
        k = _top_k(block, config)
        if e % group:
            raise ValueError(f"moec: the {e} experts of '{name}' do not divide over {group} "
                             "ranks (each rank holds the same number of experts)")
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"moec: the experts of '{name}' use hidden_act {act!r}; the layer "
                             "computes SwiGLU (silu(gate) * up) only")
        if not _fused(block.experts) and family.routing == "moe_method" and \
                not callable(getattr(block, "moe", None)):
            raise ValueError(f"moec: '{name}' ({type(block).__name__}) has no moe method to "
                             "replace; this version of the block is not one moec knows")
        weight = block.experts.gate_up_proj if _fused(block.experts) else \
            getattr(block.experts[0], family.projections[0]).weight
        layer_dtype = dtype or weight.dtype
        targets = None
        if lora_rank:
            targets = tuple(lora_targets) if lora_targets is not None else family.projections
            if isinstance(lora_targets, str):
                targets = (lora_targets,)
            unknown = [t for t in targets if t not in family.projections]
            if unknown or not targets:
                raise ValueError(f"moec: lora_targets {list(targets)} of '{name}': {family.name} "
                                 f"experts have {', '.join(family.projections)}")
        cfg = {"name": f"hf-{family.name}", "hidden_size": h, "intermediate_size": i,
               "num_experts": e, "top_k": k, "seq_size": tokens_per_rank,
               "dtype": _dtype_name(layer_dtype, f"'{name}'")}
        plans.append((name, block, family, cfg, weight.is_meta, targets))
    names = []
    for name, block, family, cfg, empty, targets in plans:
        lora = _Lora(family, targets, lora_rank, alpha) if lora_rank else None
        lora_args = dict(lora_rank=lora.rank, lora_alpha=alpha * lora.rank / lora_rank,
                         lora_targets=lora.moec_targets) if lora else {}
        # Fused experts of a frozen or LoRA layer stay in the model's layout
        # (gate_up_proj [E, 2I, H], down_proj [E, H, I]), which the layer
        # reads in place.
        fused = _fused(block.experts)
        transposed = (fused and (bool(lora) or bool(options.get("frozen")))) or \
            bool(options.get("weight_format"))
        layer = MoeFFN(cfg, ranks, threads=threads, init_weights=False,
                       weights_transposed=transposed, **lora_args, **options)
        if not (fused and transposed and _adopt(layer, block.experts)):
            _copy_in(layer, block, family, empty)
        if lora:
            _init_lora(layer, lora)
        block.experts = MoecExperts(layer, family, lora)
        if not fused:
            if family.routing == "moe_method":
                block.moe = types.MethodType(_moe_method, block)
            else:
                block.forward = types.MethodType(_softmax_block_forward, block)
        names.append(name)
    return names


def _local_experts(layer):
    first = layer.first_rank * layer.local_experts
    return range(first, first + layer.w1.shape[0])


def _adopt(layer, experts):
    """Makes the model's fused gate_up_proj and down_proj the layer's w1 and
    w2 (the same tensors: nothing is copied) where the layer holds every
    expert in that layout and dtype; returns whether it did."""
    w1, w2 = experts.gate_up_proj, experts.down_proj
    if not all(isinstance(w, torch.nn.Parameter) and not w.is_meta and w.device.type == "cpu"
               and w.dtype == layer.w1.dtype and w.is_contiguous()
               for w in (w1, w2)):
        return False
    if tuple(w1.shape) != tuple(layer.w1.shape) or tuple(w2.shape) != tuple(layer.w2.shape):
        return False  # under mpirun the layer holds its rank's experts only
    w1.requires_grad_(False)
    w2.requires_grad_(False)
    layer.w1, layer.w2 = w1, w2
    return True


def _set_expert(layer, j, gate, up, down):
    """Expert j of the layer from its nn.Linear weights [out, in]: copied,
    or for quantized weights quantized (the stored matrices, gate and up
    rows stacked, in the layer's format)."""
    if not layer.weight_format:
        for to, w in zip(layer.projections(), (gate, up, down)):
            to[j].copy_(w)
        return
    for name, w in (("w1", torch.cat((gate, up))), ("w2", down)):
        codes, scales = quant.quantize(layer.weight_format, w.unsqueeze(0))
        getattr(layer, name)[j].copy_(codes[0])
        getattr(layer, name + "_scale")[j].copy_(scales[0])


def _copy_in(layer, block, family, empty):
    """Copies this process's experts of `block` into the layer (unless the
    model's are on meta), one expert at a time."""
    with torch.no_grad():
        if empty:
            for p in (layer.w1, layer.w2, *([layer.w1_scale, layer.w2_scale]
                                            if layer.weight_format else [])):
                p.zero_()
            return
        for j, e in enumerate(_local_experts(layer)):
            _set_expert(layer, j, *_expert_weights(block, family, e))


def _init_lora(layer, lora):
    """PEFT's start: each module's A uniform in ±1/sqrt(in) (its
    kaiming_uniform(a=sqrt(5))), drawn for every expert of the model so that
    every process draws the same; B zero; the entries of no adapter zero."""
    masks = lora.masks(layer)
    with torch.no_grad():
        for target in lora.moec_targets:
            getattr(layer, f"{target}_lora_A").zero_()
            getattr(layer, f"{target}_lora_B").zero_()
        local = _local_experts(layer)
        for e in range(layer.experts):
            for module, target, acols, _, _ in lora.pieces(layer.inter):
                a = getattr(layer, f"{target}_lora_A")
                draw = torch.empty(a.shape[1], lora.r).uniform_(-1, 1) / math.sqrt(a.shape[1])
                if e in local:
                    a[e - local.start][:, acols] = draw.to(a.dtype)
        for name, mask in masks.items():
            getattr(layer, name).mul_(mask)


def _patched(model):
    """[(name, block, experts)] of the patched blocks; raises if none."""
    out = [(name, m, m.experts) for name, m in model.named_modules()
           if isinstance(getattr(m, "experts", None), MoecExperts)]
    if not out:
        raise ValueError("moec: the model has no moec experts; call patch_model(model) first")
    return out


def _checkpoint_prefix(name, family):
    """The block's name in checkpoints ("model.layers.3.mlp")."""
    if family.checkpoint_block:
        parent, _, last = name.rpartition(".")
        if last != family.checkpoint_block:
            return f"{parent}.{family.checkpoint_block}" if parent else family.checkpoint_block
    return name


# --- checkpoints in -----------------------------------------------------------

def _open(checkpoint):
    """A checkpoint folder (or an open one) as safetensors.Checkpoint."""
    return checkpoint if isinstance(checkpoint, safetensors.Checkpoint) \
        else safetensors.Checkpoint(checkpoint)


def _dequantize_fp8(weight, scale_inv, name):
    """DeepSeek-V3's FP8 weight: e4m3 codes [out, in] times the fp32
    weight_scale_inv of each 128 x 128 tile."""
    try:
        return quant.dequantize_fp8_blocks(weight, scale_inv)
    except ValueError as e:
        raise ValueError(f"moec: '{name}_scale_inv': {str(e).removeprefix('moec: ')}") from None


def _read_weight(ckpt, name):
    """A checkpoint weight as a float or bf16 tensor: FP8 ones dequantized
    with their weight_scale_inv."""
    if ckpt.dtype(name) == "F8_E4M3":
        scale = name + "_scale_inv"
        if scale not in ckpt:
            raise ValueError(f"moec: '{name}' is F8_E4M3 and the checkpoint has no "
                             f"'{scale}' to dequantize it")
        return _dequantize_fp8(ckpt.get_tensor(name), ckpt.get_tensor(scale), name)
    return ckpt.get_tensor(name)


FLOATS = ("F64", "F32", "F16", "BF16")


def _check_weight(ckpt, key, shape, dtype):
    """Refuses, before anything is copied, a checkpoint tensor that cannot
    fill a model tensor of `shape` and `dtype`: another shape; for a
    floating-point tensor, an integer or bool one (its values would be
    cast), or an F8_E4M3 one without a floating-point weight_scale_inv of
    its 128 x 128 blocks; for an integer one, another dtype. ValueError
    naming the tensor and its file."""
    where = ckpt.where(key)
    if tuple(ckpt.shape(key)) != tuple(shape):
        raise ValueError(f"moec: '{key}' in {where} has shape {list(ckpt.shape(key))}; the "
                         f"model's is {list(shape)}")
    kind = ckpt.dtype(key)
    if not dtype.is_floating_point:
        if safetensors.DTYPES[kind] != dtype or kind == "F8_E4M3":
            raise ValueError(f"moec: '{key}' in {where} is {kind}; the model's is {dtype}")
    elif kind == "F8_E4M3":
        scale = key + "_scale_inv"
        if scale not in ckpt:
            raise ValueError(f"moec: '{key}' is F8_E4M3 (in {where}) and the checkpoint has "
                             f"no '{scale}' to dequantize it")
        want = [quant._blocks(n) for n in shape[-2:]] if len(shape) == 2 else None
        if want is None or ckpt.shape(scale) != want or ckpt.dtype(scale) not in FLOATS:
            raise ValueError(f"moec: '{scale}' in {ckpt.where(scale)} is {ckpt.dtype(scale)} "
                             f"{ckpt.shape(scale)}; an F8_E4M3 weight of shape {list(shape)} "
                             f"needs floating-point scales of its 128x128 blocks, {want}")
    elif kind not in FLOATS:
        raise ValueError(f"moec: '{key}' in {where} is {kind}; the model's is {dtype} (a "
                         "floating-point tensor)")


def _expert_keys(model, ckpt):
    """[(layer, [(expert index in the layer, gate, up, down checkpoint names)])]
    for every patched block, each name checked in `ckpt` with its shape and
    dtype (_check_weight)."""
    plan = []
    for name, _, experts in _patched(model):
        layer, family = experts.layer, experts.family
        prefix = _checkpoint_prefix(name, family)
        shapes = ((layer.inter, layer.hidden), (layer.inter, layer.hidden),
                  (layer.hidden, layer.inter))
        keys = []
        for j, e in enumerate(_local_experts(layer)):
            names = [f"{prefix}.experts.{e}.{p}.weight" for p in family.projections]
            for key, shape in zip(names, shapes):
                if key not in ckpt:
                    raise ValueError(f"moec: the checkpoint {ckpt.where(key)} has no '{key}' "
                                     f"(expert {e} of '{name}')")
                _check_weight(ckpt, key, shape, layer.dtype)
            keys.append((j, *names))
        plan.append((layer, keys))
    return plan


def load_experts(model, checkpoint):
    """Fills a patched model's experts from a Hugging Face checkpoint folder
    (config.json, model.safetensors or shards with model.safetensors.index.json),
    under mpirun each process only its own experts. Every name and shape is
    checked first; then the experts are read one at a time from the mapped
    files into the layers, so no block's experts are held twice. FP8 weights
    (F8_E4M3 with weight_scale_inv per 128x128 block, as DeepSeek-V3 ships)
    are dequantized to the layer's dtype. Returns the names read."""
    ckpt = _open(checkpoint)
    plan = _expert_keys(model, ckpt)
    read = []
    with torch.no_grad():
        for layer, keys in plan:
            for j, g, u, d in keys:
                if not _copy_fp8_expert(layer, j, ckpt, g, u, d):
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
            any(ckpt.dtype(n) != "F8_E4M3" for n in names):
        return False
    i, b = layer.inter, layer.inter // quant.BLOCK
    for n in names:
        if n + "_scale_inv" not in ckpt:
            raise ValueError(f"moec: '{n}' is F8_E4M3 and the checkpoint has no "
                             f"'{n}_scale_inv' to go with it")
    for (name, rows, blocks), n in zip((("w1", slice(0, i), slice(0, b)),
                                        ("w1", slice(i, 2 * i), slice(b, 2 * b)),
                                        ("w2", slice(None), slice(None))), names):
        codes, scales = ckpt.get_tensor(n), ckpt.get_tensor(n + "_scale_inv")
        want = tuple(getattr(layer, name + "_scale")[j, blocks].shape)
        if tuple(scales.shape) != want:
            raise ValueError(f"moec: '{n}_scale_inv' in {ckpt.where(n + '_scale_inv')} has "
                             f"shape {list(scales.shape)}; a {list(codes.shape)} weight in "
                             f"128x128 blocks needs {list(want)}")
        getattr(layer, name)[j, rows].copy_(codes)
        getattr(layer, name + "_scale")[j, blocks].copy_(scales)
    return True


def load_checkpoint(model, checkpoint):
    """Loads every tensor of a checkpoint folder into a patched model: the
    experts through load_experts, every other parameter and buffer by its
    name (FP8 ones dequantized). A name the model has and the checkpoint
    lacks (but a tied lm_head.weight), or one the checkpoint has and the
    model lacks, is an error, raised before anything is copied. The model
    may be wholly on the meta device (made without memory, then patched):
    its parameters and buffers get memory here, tied ones staying tied, so
    no weight is ever in memory twice."""
    ckpt = _open(checkpoint)
    blocks = _patched(model)
    own = _non_expert_state(model)
    if getattr(_config_of(model), "tie_word_embeddings", False):
        own.pop("lm_head.weight", None)
    ranks = blocks[0][2].layer.ranks
    known = set(own) | {n for r in range(ranks) for n, _, _ in _expert_entries(blocks, r)}
    missing = [k for k in own if k not in ckpt]
    extra = [k for k in ckpt.keys() if k not in known
             and not (k.endswith("_scale_inv") and k[:-len("_scale_inv")] in known)]
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


# --- merged checkpoints out ----------------------------------------------------

def _parse_size(size):
    """Bytes of a shard size: a positive int, or text such as "5GB", "500MiB"."""
    if isinstance(size, int) and not isinstance(size, bool):
        return checks.integer(size, "save_pretrained: argument 'max_shard_size'", minimum=1)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)?\s*", str(size), re.I)
    units = {None: 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    n = int(float(m.group(1)) * units[m.group(2).upper() if m.group(2) else None]) if m else 0
    if n < 1:
        raise ValueError(f"moec: max_shard_size {size!r} is not a size such as 5GB or 500MB")
    return n


def _merged_experts(name, experts):
    """{checkpoint name: tensor} of one block's merged experts this process
    holds (adapters folded in), in the model's layout [out, in]."""
    layer = experts.layer
    gate, up, down = layer.projections(*(layer.merged_weights() if layer.lora_rank
                                         else layer.dequantized_weights()))
    prefix = _checkpoint_prefix(name, experts.family)
    g, u, d = experts.family.projections
    out = {}
    for j, e in enumerate(_local_experts(layer)):
        for p, w in zip((g, u, d), (gate, up, down)):
            out[f"{prefix}.experts.{e}.{p}.weight"] = w[j]
    return out


def _expert_entries(blocks, rank):
    """[(checkpoint name, dtype, shape)] of rank `rank`'s experts of every
    patched block: what that rank writes."""
    out = []
    for name, _, experts in blocks:
        layer = experts.layer
        prefix = _checkpoint_prefix(name, experts.family)
        g, u, d = experts.family.projections
        first = rank * layer.local_experts
        for e in range(first, first + layer.local_experts):
            for p, shape in ((g, (layer.inter, layer.hidden)), (u, (layer.inter, layer.hidden)),
                             (d, (layer.hidden, layer.inter))):
                out.append((f"{prefix}.experts.{e}.{p}.weight", layer.dtype, shape))
    return out


def _nbytes(dtype, shape):
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def save_pretrained(model, directory, max_shard_size="5GB"):
    """Writes a patched model as a Hugging Face checkpoint: config.json, the
    weights with their original names (the experts per expert, the adapters
    merged in) in safetensors shards of at most max_shard_size, and
    model.safetensors.index.json (one model.safetensors, no index, when it
    fits one shard), as transformers' save_pretrained does. Under mpirun
    every process writes its experts' shards and rank 0 the rest, the config
    and the index, so that the folder is one checkpoint. A source
    checkpoint's quantization_config is dropped: the weights are written in
    the model's dtype. Each process's files are replaced whole or not at
    all (safetensors.write_together; the index and config last). Returns
    the files this process wrote."""
    blocks = _patched(model)
    config = _config_of(model)
    directory = Path(directory)
    limit = _parse_size(max_shard_size)
    layer = blocks[0][2].layer
    rest = {k: v.detach() for k, v in _non_expert_state(model).items()}
    if getattr(config, "tie_word_embeddings", False):
        rest.pop("lm_head.weight", None)
    entries = [(k, v.dtype, tuple(v.shape), 0) for k, v in rest.items()]
    for r in range(layer.ranks):
        entries += [(n, dt, shape, r) for n, dt, shape in _expert_entries(blocks, r)]
    # Every process plans every rank's shards alike (the shapes are known to
    # all), so rank 0's index names the files the other processes write.
    plan = safetensors.plan_shards([(n, _nbytes(dt, s), r) for n, dt, s, r in entries], limit)
    files = safetensors.shard_files(len(plan))
    mine = range(layer.first_rank, layer.first_rank + layer.local_ranks)
    directory.mkdir(parents=True, exist_ok=True)
    for path in ([directory / f for f, (owner, _) in zip(files, plan) if owner in mine]
                 + ([directory / "config.json", directory / INDEX] if 0 in mine else [])):
        checks.output_path(path, "save_pretrained", "the checkpoint file")
    tensors = dict(rest) if 0 in mine else {}
    for name, _, experts in blocks:
        tensors.update(_merged_experts(name, experts))
    def shard(path, names):
        # The contiguous copies of one shard's tensors, made as it is written.
        return lambda f: safetensors.file_writer({n: tensors[n].contiguous() for n in names},
                                                 path, {"format": "pt"})(f)

    writes = [(directory / file, shard(directory / file, names))
              for file, (owner, names) in zip(files, plan) if owner in mine]
    if 0 in mine:
        if len(plan) > 1:
            total = sum(_nbytes(dt, s) for _, dt, s, _ in entries)
            writes.append((directory / INDEX, safetensors.index_data(
                {n: f for f, (_, names) in zip(files, plan) for n in names}, total)))
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
        cfg.pop("quantization_config", None)
        writes.append((directory / "config.json",
                       json.dumps(cfg, indent=2, sort_keys=True).encode()))
    # This process's files, replaced together: written under scratch names,
    # then renamed, the index and the config last.
    safetensors.write_together(writes)
    barrier(model)
    written = [path for path, _ in writes]
    return written[-1:] + written[:-1] if 0 in mine else written


INDEX = "model.safetensors.index.json"


def _first_layer(model):
    return _patched(model)[0][2].layer


def barrier(model):
    """Under mpirun, returns once every process of the patched model's EP
    group has called it (bounded by the layers' timeout_seconds); in one
    process, at once."""
    layer = _first_layer(model)
    if layer._collective:
        layer._agree({"at": "barrier"}, "moec barrier: the ranks could not meet")


def all_sum(model, value):
    """The sum of a number over the processes of the patched model's EP group
    (under mpirun; in one process, the number), e.g. a loss."""
    layer = _first_layer(model)
    if not layer._collective:
        return float(value)
    views = layer._agree({"value": float(value)}, "moec all_sum: the ranks could not meet")
    return math.fsum(v["value"] for v in views)
