"""An optimizer's state by parameter name, for checkpoints that outlive
the job's shape.

A torch optimizer's state_dict() numbers the parameters by their place in
the optimizer, and a MoeFFN whose ranks are one per process (torchrun,
mpirun) holds only this process's experts: its momentum or Adam moments
are this process's slice, and a job resumed at another EP size (or in one
process) could not use them. Here:

  - optimizer_state_dict(model, optimizer): this process's optimizer state
    keyed by the model's parameter names, with each layer's layout (which
    experts and intermediate columns it holds) and every parameter's shape;
  - merge_optimizer_state_dicts(shards): the whole model's of the dicts a
    job's processes saved, the layers' state tensors put together as
    merge_state_dicts puts their parameters;
  - load_optimizer_state_dict(model, optimizer, state): into an optimizer
    over the same parameters, each layer's state sliced to the experts
    this process holds (a merged state loads into a job of any EP size),
    everything checked before anything is loaded.

Everything in these dicts is a tensor, an int, a str, a bool, None or a
list, tuple or dict of them, so torch.load(..., weights_only=True) reads
them: a float (a learning rate, Adam's betas) is kept as {"float":
repr(x)}, which gives it back exactly (PyTorch 1.13's weights-only reader
refuses floats, so its optimizers' own state dicts cannot be read so).
"""

import torch

from . import checkpoint
from .layer import MoeFFN

FORMAT = "moec.optimizer/1"


def _encode(value):
    """`value` with every float as {"float": repr(float)}."""
    if isinstance(value, float):
        return {"float": repr(value)}
    if isinstance(value, (list, tuple)):
        return type(value)(_encode(v) for v in value)
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


def _decode(value):
    """_encode undone."""
    if isinstance(value, dict):
        if set(value) == {"float"} and isinstance(value["float"], str):
            return float(value["float"])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_decode(v) for v in value)
    return value


def _named(model, optimizer, label):
    """(the names of the optimizer's parameters in its order, across its
    groups; {prefix: layer} of the MoeFFN layers among them). A layer's
    parameters are named by the layer (its prefix and w1, w2, ...) also
    where another module registers them too."""
    names, layers = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, MoeFFN):
            prefix = name + "." if name else ""
            for n, p in module._parameters.items():
                if p is not None and id(p) not in names:
                    names[id(p)] = prefix + n
                    layers.setdefault(prefix, module)
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        if id(p) not in names:
            raise ValueError(f"moec: {label}: the optimizer's parameter {i} (shape "
                             f"{list(p.shape)}) is not one of the model's")
    held = {id(p) for p in params}
    layers = {prefix: m for prefix, m in layers.items()
              if any(id(p) in held for p in m._parameters.values() if p is not None)}
    return [names[id(p)] for p in params], layers


def _in_layer(name, prefix):
    """Whether parameter `name` is one of the layer's under `prefix` (its
    own, not a submodule's)."""
    return name.startswith(prefix) and "." not in name[len(prefix):]


def _layer_of(name, layers):
    """(prefix, the parameter's name in the layer) of a layer's parameter
    `name`, or None."""
    return next(((p, name[len(p):]) for p in layers if _in_layer(name, p)), None)


def optimizer_state_dict(model, optimizer):
    """This process's state of `optimizer` (over parameters of `model`, a
    module holding MoeFFN layers, or a layer) keyed by the parameters'
    names in `model`: {"format", "state": {name: {key: value}},
    "param_groups": [{hyperparameters..., "params": [name, ...]}],
    "layers": {prefix: layout} of the MoeFFN layers it trains, "shapes":
    {name: shape}}. Save one a process (save_state); merge them with
    merge_optimizer_state_dicts, load with load_optimizer_state_dict."""
    order, layers = _named(model, optimizer, "optimizer_state_dict")
    saved = optimizer.state_dict()  # numbers the parameters in `order`
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        "format": FORMAT,
        "state": {order[i]: _encode(dict(s)) for i, s in saved["state"].items()},
        "param_groups": [dict(_encode({k: v for k, v in g.items() if k != "params"}),
                              params=[order[i] for i in g["params"]])
                         for g in saved["param_groups"]],
        "layers": {prefix: checkpoint.layout_of(m) for prefix, m in layers.items()},
        "shapes": {name: list(p.shape) for name, p in zip(order, params)}}


def _check_format(state, label, which="the state"):
    """Refuses (ValueError, naming the part) a dict that is not an
    optimizer_state_dict's in its structure: a damaged or foreign file."""
    if not isinstance(state, dict) or state.get("format") != FORMAT or not all(
            isinstance(state.get(k), t) for k, t in (("state", dict), ("param_groups", list),
                                                     ("layers", dict), ("shapes", dict))):
        raise ValueError(f"moec: {label}: {which} is not an optimizer_state_dict's (format "
                         f"{FORMAT!r}: state, param_groups, layers, shapes)")

    def names(values):
        return isinstance(values, list) and all(isinstance(n, str) for n in values)

    bad = next((f"its state of {n!r}" for n, v in state["state"].items()
                if not isinstance(n, str) or not isinstance(v, dict) or
                not all(isinstance(k, str) for k in v)), None) or \
        next((f"its parameter group {i}" for i, g in enumerate(state["param_groups"])
              if not isinstance(g, dict) or not names(g.get("params"))), None) or \
        next((f"its layout of {p!r}" for p, v in state["layers"].items()
              if not isinstance(p, str) or not isinstance(v, dict)), None) or \
        next((f"its shape of {n!r}" for n, v in state["shapes"].items()
              if not isinstance(n, str) or not isinstance(v, list) or
              not all(isinstance(d, int) and not isinstance(d, bool) for d in v)), None)
    if bad:
        raise ValueError(f"moec: {label}: {which} is damaged: {bad} is not what "
                         "optimizer_state_dict writes")


def merge_optimizer_state_dicts(shards):
    """One optimizer state of the whole model from the
    optimizer_state_dict()s a job's processes saved (in any order): each
    layer's state tensors of its parameters' shape (momentum, Adam's
    moments) put together over its experts and intermediate columns as
    merge_state_dicts puts its parameters, its layout that of all experts;
    every other value (a step count, the state of a replicated parameter)
    must be the same in every shard, as DDP keeps it. Raises ValueError
    naming the parameter, the state and the shards where they disagree."""
    label = "merge_optimizer_state_dicts"
    shards = list(shards)
    if not shards:
        raise ValueError(f"moec: {label}: give the optimizer state dicts of every process, "
                         "at least one")
    for i, s in enumerate(shards):
        _check_format(s, label, f"shard {i}")
    first = shards[0]
    for i, s in enumerate(shards[1:], 1):
        for key in ("param_groups", "layers"):
            mine, theirs = first[key], s[key]
            if key == "layers":
                mine, theirs = sorted(mine), sorted(theirs)
            if mine != theirs:
                raise ValueError(f"moec: {label}: shard {i}'s {key} are not shard 0's "
                                 f"({theirs!r} against {mine!r})"[:400])
    layers = first["layers"]
    names = [n for g in first["param_groups"] for n in g["params"]]
    state = {n: {} for n in names if any(n in s["state"] for s in shards)}
    merged_layouts = {}
    for prefix in layers:
        own = [n for n in names if _in_layer(n, prefix)]
        keys = list(dict.fromkeys(k for s in shards for n in own for k in s["state"].get(n, {})))
        extra = [{"format": checkpoint.CHECKPOINT_FORMAT, "layout": s["layers"][prefix]}
                 for s in shards]
        what = f"the layout of layer '{prefix}'"
        whole = checkpoint.merge_layer(prefix, [{"_extra_state": e} for e in extra], label,
                                       what)
        merged_layouts[prefix] = whole[prefix + "_extra_state"]["layout"]
        for key in keys:
            parts = [{"_extra_state": e} for e in extra]
            for n in own:
                shaped = [i for i, s in enumerate(shards) if _param_shaped(s, n, key)]
                if not shaped:
                    continue
                if len(shaped) < len(shards):
                    odd = next(i for i in range(len(shards)) if i not in shaped)
                    raise ValueError(f"moec: {label}: state '{key}' of '{n}' has the "
                                     f"parameter's shape in shard {shaped[0]}, not in shard "
                                     f"{odd}")
                for part, s in zip(parts, shards):
                    part[n[len(prefix):]] = s["state"][n][key]
            merged = checkpoint.merge_layer(prefix, parts, f"{label} (state '{key}')", what)
            for n in own:
                if n in merged:
                    state[n][key] = merged[n]
    for n in state:
        for key in dict.fromkeys(k for s in shards for k in s["state"].get(n, {})):
            if key in state[n]:
                continue
            for i, s in enumerate(shards):
                if key not in s["state"].get(n, {}):
                    raise ValueError(f"moec: {label}: state '{key}' of '{n}' is in some "
                                     f"shards, not in shard {i}")
                if not checkpoint.same_value(s["state"][n][key], first["state"][n][key]):
                    raise ValueError(
                        f"moec: {label}: state '{key}' of '{n}' differs between shard 0 and "
                        f"shard {i}: the state of a replicated parameter is the same in every "
                        "process under DDP (ZeroRedundancyOptimizer shares it out: "
                        "consolidate_state_dict)")
            state[n][key] = first["state"][n][key]
    shapes = dict(first["shapes"])
    for n in names:
        held = _layer_of(n, layers)
        if held is not None:
            layout = layers[held[0]]
            shapes[n] = checkpoint.whole_shape(held[1], shapes[n], layout["experts"],
                                               layout["inter"],
                                               layout.get("columns", [0, layout["inter"]]))
    return {"format": FORMAT, "state": state, "param_groups": first["param_groups"],
            "layers": merged_layouts, "shapes": shapes}


def _param_shaped(shard, name, key):
    """Whether shard's state `key` of parameter `name` is a tensor of the
    parameter's shape."""
    value = shard["state"].get(name, {}).get(key)
    return isinstance(value, torch.Tensor) and list(value.shape) == shard["shapes"].get(name)



def load_optimizer_state_dict(model, optimizer, state):
    """Loads `state` (optimizer_state_dict's, or merge_optimizer_state_dicts')
    into `optimizer`, an optimizer of the same kind over the same
    parameters of `model` (by name, in the same groups): a layer's state
    tensors of more experts than it holds (a merged state, or one
    process's of all experts) are sliced to this process's experts and
    columns. Everything is checked before the optimizer is touched:
    ValueError naming the parameter for a state of another model (other
    parameters or groups, another layer's layout, experts this process
    holds that the state lacks, a shape that differs)."""
    label = "load_optimizer_state_dict"
    _check_format(state, label)
    order, layers = _named(model, optimizer, label)
    groups, at = [], 0  # the names of each group's parameters
    for group in optimizer.param_groups:
        groups.append(order[at:at + len(group["params"])])
        at += len(group["params"])
    saved = state["param_groups"]
    if len(saved) != len(groups):
        raise ValueError(f"moec: {label}: the state has {len(saved)} parameter groups, the "
                         f"optimizer {len(groups)}")
    for k, (theirs, mine) in enumerate(zip(saved, groups)):
        odd = sorted(set(theirs.get("params", [])) ^ set(mine))
        if odd:
            where = "the state's" if odd[0] in theirs.get("params", []) else "the optimizer's"
            raise ValueError(f"moec: {label}: '{odd[0]}' is in {where} parameter group {k} "
                             "only")
    missing = [p for p in layers if p not in state["layers"]]
    if missing:
        raise ValueError(f"moec: {label}: the state has no layout of layer '{missing[0]}' "
                         "(not an optimizer_state_dict of this model)")
    params = dict(zip(order, (p for g in optimizer.param_groups for p in g["params"])))
    loaded = {n: dict(s) for n, s in state["state"].items()}
    for n in loaded:
        if n not in params:
            raise ValueError(f"moec: {label}: the state holds '{n}', which is not among the "
                             "optimizer's parameters")
    for prefix, layer in layers.items():
        extra = {"format": checkpoint.CHECKPOINT_FORMAT, "layout": state["layers"][prefix]}
        own = [n for n in loaded if _in_layer(n, prefix)]
        for key in dict.fromkeys(k for n in own for k in loaded[n]):
            fake = {n: loaded[n][key] for n in own
                    if key in loaded[n] and isinstance(loaded[n][key], torch.Tensor) and
                    list(loaded[n][key].shape) == state["shapes"].get(n)}
            checkpoint.check_layout(layer, extra, prefix, fake,  # slices in `fake`
                                    f"the layout of layer '{prefix}'")
            for n, t in fake.items():
                loaded[n][key] = t
    for n, values in loaded.items():
        want = list(params[n].shape)
        for key, t in values.items():
            if isinstance(t, torch.Tensor) and t.dim() > 0 and list(t.shape) != want and \
                    (list(t.shape) == state["shapes"].get(n) or _layer_of(n, layers)):
                raise ValueError(f"moec: {label}: state '{key}' of '{n}' has shape "
                                 f"{list(t.shape)}; the parameter's is {want}")
    index = {n: i for i, n in enumerate(order)}
    optimizer.load_state_dict({
        "state": {index[n]: _decode(s) for n, s in loaded.items()},
        "param_groups": [dict(_decode({k: v for k, v in g.items() if k != "params"}),
                              params=[index[n] for n in mine])
                         for g, mine in zip(saved, groups)]})
