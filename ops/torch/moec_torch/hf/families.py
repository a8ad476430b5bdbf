"""The MoE families moec patches, their blocks found in a model, their experts' weights. See the
package's docstring."""

import torch


# --- families ---------------------------------------------------------------

class Family:
    """What moec needs to know of a model family: its config's model_type,
    its MoE block classes, its experts' projection names in checkpoints
    (gate, up, down), and how its v4 block routes: "softmax" (the block's
    forward is replaced by one with the same routing) or "moe_method"
    (DeepSeek: the block's ``moe`` method is), and how its checkpoints name
    the experts: "modules", per expert (<block>.experts.<e>.<projection>.weight,
    transformers v4's names, which v5 converts on load), or "fused", as v5's
    parameters (<block>.experts.gate_up_proj [E, 2I, H], .down_proj [E, H,
    I]: Qwen3.5-MoE's checkpoints)."""

    def __init__(self, name, blocks, projections, routing, checkpoint_block=None,
                 checkpoint_experts="modules"):
        self.name = name
        self.blocks = blocks
        self.projections = projections
        self.routing = routing
        # The block's name in checkpoints when the module tree names it
        # otherwise (transformers v5's Mixtral calls block_sparse_moe mlp).
        self.checkpoint_block = checkpoint_block
        self.checkpoint_experts = checkpoint_experts

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
    Family("glm4_moe", ("Glm4MoeMoE",), PROJECTIONS, "moe_method"),
    Family("qwen3_next", ("Qwen3NextSparseMoeBlock",), PROJECTIONS, "softmax"),
    Family("qwen3_5_moe", ("Qwen3_5MoeSparseMoeBlock",), PROJECTIONS, "softmax",
           checkpoint_experts="fused"),
]
_BY_BLOCK = {cls: f for f in FAMILIES for cls in f.blocks}


def _known():
    return ", ".join(f"{f.name} ({'/'.join(f.blocks)})" for f in FAMILIES)


def _looks_like_moe(module):
    """A module that holds experts and a router, whatever its class."""
    return hasattr(module, "experts") and (hasattr(module, "gate") or hasattr(module, "router"))


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
