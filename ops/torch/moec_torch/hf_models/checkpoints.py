"""The Hub's tensor names of a stand-in's state, both ways. See the package's docstring."""

import torch

from .modules import Experts


# --- checkpoint names --------------------------------------------------------------------

def _checkpoint_key(key, renames):
    for old, new in renames:
        if key.startswith(old):
            return new + key[len(old):]
    return key


def checkpoint_state_dict(model):
    """The model's tensors under the Hub's checkpoint names: transformers v4's
    (a family whose checkpoints keep v5's fused experts, Qwen3.5-MoE's,
    under its own), in either layout: each fused experts module's gate_up_proj[e] split into
    experts.<e>.gate_proj.weight and up_proj.weight (Mixtral w1, w3) and
    down_proj[e] as experts.<e>.down_proj.weight (w2), all [out, in]; v5
    Mixtral's mlp named block_sparse_moe; a tied lm_head.weight left out.
    The tensors are the model's own (detached views): writing into them
    writes into the model."""
    fused = {name: m for name, m in model.named_modules() if isinstance(m, Experts)} \
        if model.checkpoint_experts == "modules" else {}  # (else the Hub's are fused too)
    # Blocks that the module tree names otherwise than checkpoints (v5 Mixtral's mlp).
    want = model.checkpoint_block
    renames = [(f"model.layers.{i}.{layer.ffn_name}.", f"model.layers.{i}.{want}.")
               for i, layer in enumerate(model.model.layers) if layer.ffn_name != want]
    out = {}
    for key, t in model.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        experts = fused.get(owner)
        if experts is None:
            out[_checkpoint_key(key, renames)] = t
        elif leaf == "gate_up_proj":
            prefix = _checkpoint_key(owner + ".", renames)
            g, u, d = experts.checkpoint_names
            inter = experts.intermediate_dim
            down = experts.down_proj.detach()
            for e in range(experts.num_experts):
                out[f"{prefix}{e}.{g}.weight"] = t[e, :inter]
                out[f"{prefix}{e}.{u}.weight"] = t[e, inter:]
                out[f"{prefix}{e}.{d}.weight"] = down[e]
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def load_checkpoint_state_dict(model, state):
    """Copies checkpoint-named tensors (the Hub's v4 names, as
    checkpoint_state_dict gives them) into the model, in either layout:
    strictly, every name of the model and no other, each a tensor of its
    shape (and floating point where the model's is, else of its dtype),
    before anything is copied. A tied lm_head.weight in `state` is
    ignored."""
    own = checkpoint_state_dict(model)
    state = dict(state)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"hf_models: the checkpoint does not fit the model: missing "
                         f"{missing[:3]}{' ...' if len(missing) > 3 else ''}, unexpected "
                         f"{unexpected[:3]}{' ...' if len(unexpected) > 3 else ''}")
    for key, t in own.items():
        given = state[key]
        if not isinstance(given, torch.Tensor):
            raise ValueError(f"hf_models: '{key}' is a {type(given).__name__}, not a tensor")
        if tuple(given.shape) != tuple(t.shape):
            raise ValueError(f"hf_models: '{key}' has shape {list(given.shape)}; the "
                             f"model's is {list(t.shape)}")
        # A float tensor takes any float (cast, as transformers' torch_dtype); an
        # integer one its own dtype.
        if given.is_floating_point() != t.is_floating_point() or \
                not t.is_floating_point() and given.dtype != t.dtype:
            raise ValueError(f"hf_models: '{key}' is {given.dtype}; the model's is {t.dtype}")
    with torch.no_grad():
        for key, t in own.items():
            t.copy_(state[key])
