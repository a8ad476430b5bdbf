"""Checkpoints: save_state, which replaces a file whole or not at all, and
MoeFFN's state dict. A layer's state_dict() holds w1, w2 and the adapters
(this process's experts) and, as the module's extra state, the layout they
belong to and the main-grad buffers; load_state_dict() checks the layout
before it copies anything, and takes this process's experts out of a
checkpoint of more (a one-process checkpoint loaded under mpirun)."""

import io
from pathlib import Path

import torch

from . import checks, quant, safetensors

# What a MoeFFN's extra state says it is.
CHECKPOINT_FORMAT = "moec.MoeFFN/1"


def save_state(obj, path):
    """torch.save(obj, path) with the file replaced whole or not at all: a
    checkpoint (layer.state_dict(), an optimizer's, a dict of them) for
    torch.load. torch.save writes into memory, and the bytes go through
    safetensors.write_atomically (a scratch file in the folder, synced,
    renamed into place): a save that fails (a full disk) raises OSError
    naming the file and leaves the old file as it was. torch.save straight
    to a path cannot: in PyTorch 1.13 a failed write ends the process
    (its zip writer throws again as it is destroyed). The serialized bytes
    are held in memory once. Returns the path."""
    path = checks.output_path(path, "save_state", "the checkpoint")
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    safetensors.write_atomically(path, buffer.getbuffer())
    return Path(path)


def layout_of(module):
    """The layout of the MoeFFN `module`'s tensors that its checkpoints
    record: the experts and intermediate columns this process holds, the
    sizes, the dtype and what the layer was built with. Every value is an
    int, a str, a bool, None or a list of them, which torch.load(...,
    weights_only=True) reads (PyTorch 1.13's reader has no floats): the
    LoRA scaling is its repr, which gives the float back exactly."""
    first = module.first_rank * module.local_experts
    return {"experts": module.experts, "first_expert": first,
            "local_experts": module.local_ranks * module.local_experts,
            "hidden": module.hidden, "inter": module.inter, "dtype": str(module.dtype),
            "columns": _columns(module),
            "lora_rank": module.lora_rank, "lora_targets": list(module.lora_targets),
            "lora_scaling": _scaling(module.lora_scaling), "main_grad": module.main_grad,
            "weights_transposed": module.weights_transposed,
            "weight_format": module.weight_format}


def _scaling(value):
    """The LoRA scaling as a checkpoint records it: repr(float), also for the
    float an earlier checkpoint recorded."""
    return repr(float(value)) if isinstance(value, (int, float)) and \
        not isinstance(value, bool) else value


def _columns(module):
    """[first, end) of the intermediate columns (of I) this process holds."""
    if module.tp_rank is None:
        return [0, module.inter]
    i = module.inter // module.tp
    return [module.tp_rank * i, (module.tp_rank + 1) * i]


def extra_state(module):
    """MoeFFN.get_extra_state: the format, the layout and the main-grad
    buffers."""
    state = {"format": CHECKPOINT_FORMAT, "layout": layout_of(module)}
    if module.main_grad:
        state["main_grad"] = {"w1": module.w1.main_grad, "w2": module.w2.main_grad}
    return state


def load_extra_state(module, state):
    """MoeFFN.set_extra_state: copies the main-grad buffers."""
    # check_state_dict has checked the layout and sliced the buffers.
    if module.main_grad and "main_grad" in state:
        with torch.no_grad():
            module.w1.main_grad.copy_(state["main_grad"]["w1"])
            module.w2.main_grad.copy_(state["main_grad"]["w2"])


def _own_state(module):
    """{name: tensor} of what load_state_dict copies into this layer
    (its parameters and persistent buffers), as nn.Module finds them."""
    state = {n: p for n, p in module._parameters.items() if p is not None}
    state.update({n: b for n, b in module._buffers.items()
                  if b is not None and n not in module._non_persistent_buffers_set})
    return state


def load_is_strict():
    """The `strict` of the nn.Module.load_state_dict call now running (the
    module's own, or a model's above it), True outside one. PyTorch hands
    its modules' load hooks strict=True whatever the caller asked (it
    applies strict=False itself, after every module has copied what
    fits), so the call's own argument is read from its frame."""
    return next((bool(call.get("strict", True))
                 for call in checks.callers(torch.nn.Module.load_state_dict)), True)


def check_state_dict(module, state_dict, prefix):
    """Before load_state_dict copies anything: every refusal is raised
    here, so that a refused checkpoint leaves the layer untouched
    (nn.Module's own checks raise only after copying what fits). The
    checkpoint's layout must be this layer's, with this process's
    experts among its experts; with strict (load_state_dict's, the
    default), no key may be missing (the layout, _extra_state, included)
    or unknown; every tensor given must be a tensor of this layer's shape
    and dtype, its main-grad buffers too."""
    strict = load_is_strict()
    name = prefix + "_extra_state"
    own = _own_state(module)
    for n in own:
        t = state_dict.get(prefix + n)
        if prefix + n in state_dict and not isinstance(t, torch.Tensor):
            raise ValueError(f"moec: '{prefix}{n}' is a {type(t).__name__}, not a tensor")
    extra = None
    if name in state_dict:
        check_layout(module, state_dict[name], prefix, state_dict)
        extra = state_dict[name]
    if strict:
        missing = [prefix + n for n in list(own) + ["_extra_state"]
                   if prefix + n not in state_dict]
        unexpected = [k for k in state_dict if k.startswith(prefix) and
                      k[len(prefix):].split(".", 1)[0] not in
                      {*own, *module._modules, "_extra_state"}]
        if missing or unexpected:
            raise ValueError(
                "moec: the state dict does not fit the layer: "
                + "; ".join(f"{what} {keys[:3]}{' ...' if len(keys) > 3 else ''}"
                            for what, keys in (("missing", missing),
                                               ("unexpected", unexpected)) if keys)
                + (f" ('{name}' is the layout a MoeFFN checkpoint records: load the "
                   "layer's state_dict(), or strict=False for its tensors alone)"
                   if name in missing else ""))
    given = [(prefix + n, state_dict[prefix + n], t) for n, t in own.items()
             if prefix + n in state_dict]
    if extra is not None and extra.get("main_grad") is not None:
        given += [(f"{name}['main_grad']['{w}']", extra["main_grad"][w],
                   getattr(module, w).main_grad) for w in ("w1", "w2")]
    for key, t, mine in given:
        if tuple(t.shape) != tuple(mine.shape):
            raise ValueError(f"moec: '{key}' has shape {list(t.shape)}; this layer's is "
                             f"{list(mine.shape)}")
        if t.dtype != mine.dtype:
            raise ValueError(f"moec: '{key}' is {t.dtype}; this layer's is {mine.dtype}")


def check_layout(module, extra, prefix, state_dict, what=None):
    """The checks of a checkpoint's extra state (its layout) against this
    layer; a checkpoint of more experts (or of the whole intermediate
    columns, loaded by one TP rank) is sliced in `state_dict` to this
    process's part. `what` names the layout in errors (default: its key,
    prefix + "_extra_state")."""
    name = what or f"'{prefix}_extra_state'"
    if not isinstance(extra, dict) or extra.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"moec: {name} is not a moec MoeFFN checkpoint's")
    layout = extra.get("layout")
    keys = ("experts", "hidden", "inter", "dtype", "lora_rank", "lora_targets",
            "lora_scaling", "first_expert", "local_experts")
    if not isinstance(layout, dict) or any(k not in layout for k in keys):
        raise ValueError(f"moec: {name} is not a moec MoeFFN checkpoint's: its layout "
                         f"lacks {[k for k in keys if k not in (layout or {})]}")
    theirs, mine = dict(layout), layout_of(module)
    theirs.setdefault("weights_transposed", False)
    theirs.setdefault("weight_format", None)
    theirs["lora_scaling"] = _scaling(theirs["lora_scaling"])
    for key in ("experts", "hidden", "inter", "dtype", "lora_rank", "lora_targets",
                "lora_scaling", "weight_format", "weights_transposed"):
        if theirs[key] != mine[key]:
            raise ValueError(f"moec: the checkpoint is of another layer: its {key} is "
                             f"{theirs[key]!r}, this layer's {mine[key]!r}")
    grads = extra.get("main_grad")
    if grads is not None and not module.main_grad:
        raise ValueError("moec: the checkpoint holds main-grad buffers; this layer has "
                         "none (main_grad=False)")
    if grads is not None and not (isinstance(grads, dict) and all(
            isinstance(grads.get(w), torch.Tensor) for w in ("w1", "w2"))):
        raise ValueError(f"moec: {name}: its main_grad is not a dict of tensors w1 and w2")
    lo, n = theirs["first_expert"], theirs["local_experts"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, n)):
        raise ValueError(f"moec: {name}: its first_expert and local_experts are not "
                         f"integers: {lo!r}, {n!r}")
    first, count = mine["first_expert"], mine["local_experts"]
    if not (lo <= first and first + count <= lo + n):
        raise ValueError(
            f"moec: the checkpoint holds experts {lo}..{lo + n - 1} of {theirs['experts']}; "
            f"this layer (rank {module.first_rank}) holds experts {first}..{first + count - 1}")
    held = theirs.get("columns", [0, theirs["inter"]])
    if held != mine["columns"] and held != [0, module.inter]:
        raise ValueError(
            f"moec: the checkpoint holds intermediate columns {held[0]}..{held[1] - 1} of "
            f"{module.inter} (a TP rank's); this layer (TP rank {module.tp_rank}) holds "
            f"{mine['columns'][0]}..{mine['columns'][1] - 1}")
    slicing = held != mine["columns"]
    if (lo, n) == (first, count) and not slicing:
        return
    # A checkpoint of more experts: keep this process's.
    names = ["w1", "w2"] + (["w1_scale", "w2_scale"] if module.weight_format else []) + \
        module.adapter_names()

    # A checkpoint of the whole experts loaded by one TP rank: its slice.
    def keep(name, t):
        if t.shape[:1] != (n,):
            raise ValueError(f"moec: '{prefix}{name}' has shape {list(t.shape)}; the "
                             f"checkpoint's layout holds {n} experts")
        t = t[first - lo:first - lo + count]
        if slicing and name.endswith("_scale"):
            t = module._tp_part(name, None, t)[1]
        elif slicing:  # w1, w2, the adapters (tp_split: those split by TP)
            t = module._tp_part(name, t)[0]
        return t

    for param in names:
        if prefix + param in state_dict:
            state_dict[prefix + param] = keep(param, state_dict[prefix + param])
    if grads is not None:
        state_dict[prefix + "_extra_state"] = dict(extra, main_grad={k: keep(k, v) for k, v in grads.items()})


def merge_state_dicts(shards):
    """One state dict of a whole model from the state dicts its processes
    saved (`model.state_dict()` on each process of a job whose layers run a
    rank per process, in any order), for one file to keep or to load at
    another EP size (a layer loads its slice of the whole experts, in one
    process or in a job of any size).

    Each MoeFFN's part (found by its `_extra_state`) becomes the whole
    layer: every expert (and, with expert tensor parallelism, every
    intermediate column) from the shards that hold it, its layout that of
    all experts and columns; the same expert held by several shards (EP
    groups inside data parallelism) must be the same there. Every other
    tensor is a replica and must be the same in every shard (DDP keeps it
    so; a layer's tensor that another module registers too reads as one
    and differs: leave it out). Raises ValueError naming the key and the
    shards where they disagree, a part no shard holds, or shards of
    different layers."""
    shards = list(shards)
    if not shards or not all(isinstance(s, dict) for s in shards):
        raise ValueError("moec: merge_state_dicts: give the state dicts (dicts) of every "
                         "process, at least one")
    keys = list(shards[0])
    for i, s in enumerate(shards[1:], 1):
        if set(s) != set(keys):
            odd = sorted(set(s) ^ set(keys))
            raise ValueError(f"moec: merge_state_dicts: shard {i}'s keys are not shard 0's: "
                             f"{odd[:3]}{' ...' if len(odd) > 3 else ''} in one of them only")
    layers = [k[:-len("_extra_state")] for k in keys if k.endswith("_extra_state") and
              isinstance(shards[0][k], dict) and shards[0][k].get("format") == CHECKPOINT_FORMAT]
    out = {}
    for prefix in layers:
        out.update(merge_layer(prefix, [{k[len(prefix):]: v for k, v in s.items()
                                          if k.startswith(prefix)} for s in shards]))
    for key in keys:
        if key in out or any(key.startswith(p) and "." not in key[len(p):] for p in layers):
            continue
        value = shards[0][key]
        for i, s in enumerate(shards[1:], 1):
            if not same_value(value, s[key]):
                raise ValueError(f"moec: merge_state_dicts: '{key}' differs between shard 0 and "
                                 f"shard {i}: a tensor outside the layers is a replica, the same "
                                 "in every process (DDP keeps it so)")
        out[key] = value
    return {k: out[k] for k in keys}


def same_value(a, b):
    """Whether two checkpoint values are the same: tensors of one shape and
    dtype, equal; anything else equal, and neither a tensor."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b


def tp_split(name, layout=None):
    """quant.tp_split of a layer's tensor `name` in the layout a checkpoint
    records (the [E, H, 2I] one without `layout`)."""
    layout = layout or {}
    return quant.tp_split(name, layout.get("weights_transposed"), layout.get("weight_format"))


def whole_shape(name, shape, experts, inter, columns, layout=None):
    """The shape over all `experts` and intermediate columns of a layer's
    tensor `name` of which a process holds `shape`, its columns `columns`
    of `inter` (tp_split says how); every other tensor along the experts
    only."""
    shape = list(shape)
    shape[0] = experts
    split = tp_split(name, layout)
    if split and list(columns) != [0, inter]:
        dim, unit, halves = split
        shape[dim] = (2 * inter if halves else inter) // unit
    return shape


def merge_layer(prefix, parts, label="merge_state_dicts", what=None):
    """The whole layer's entries (names without `prefix`) from its shards'
    entries `parts` ({name: tensor of the shard's experts, "_extra_state":
    the shard's extra state}); `label` begins the errors, and `what` names
    the layout in them (default: its key, prefix + "_extra_state")."""
    entry = prefix + "_extra_state"
    name = what or f"'{entry}'"
    layouts = [p["_extra_state"].get("layout") if isinstance(p["_extra_state"], dict) and
               p["_extra_state"].get("format") == CHECKPOINT_FORMAT else None for p in parts]
    if not all(isinstance(l, dict) for l in layouts):
        raise ValueError(f"moec: {label}: {name} is not a moec MoeFFN checkpoint's "
                         "in every shard")
    for i, layout in enumerate(layouts):
        columns = layout.get("columns", [0, layout.get("inter")])
        lacks = [k for k in ("experts", "inter", "first_expert", "local_experts")
                 if not isinstance(layout.get(k), int) or isinstance(layout.get(k), bool)]
        if not (isinstance(columns, list) and len(columns) == 2 and
                all(isinstance(c, int) for c in columns)):
            lacks.append("columns")
        if lacks:
            raise ValueError(f"moec: {label}: {name}: shard {i}'s layout has no integer "
                             f"{lacks} (a damaged checkpoint)")
    fixed = ("experts", "hidden", "inter", "dtype", "lora_rank", "lora_targets", "lora_scaling",
             "main_grad", "weights_transposed", "weight_format")
    first = layouts[0]
    for i, layout in enumerate(layouts[1:], 1):
        for key in fixed:
            if layout.get(key) != first.get(key):
                raise ValueError(f"moec: {label}: {name}: shard {i}'s {key} is "
                                 f"{layout.get(key)!r}, shard 0's {first.get(key)!r} (shards "
                                 "of different layers)")
    experts, inter = first["experts"], first["inter"]
    whole = {}   # name -> the whole tensor
    filled = {}  # name -> bool tensor [experts, inter]: what the shards held

    def place(param, t, lo, n, c0, c1, shard):
        """Shard `shard`'s tensor `t` of experts lo..lo+n-1, intermediate
        columns c0..c1-1, into the whole tensor of `param`."""
        kind = param.split(".")[-1]  # main_grad.w1 is w1's
        spec = tp_split(kind, None if param.startswith("main_grad.") else first)
        split = spec is not None and [c0, c1] != [0, inter]
        replica = spec is None and [c0, c1] != [0, inter]  # held whole by each TP rank
        if t.shape[:1] != (n,):
            raise ValueError(f"moec: {label}: shard {shard}'s '{prefix}{param}' has "
                             f"shape {list(t.shape)}; its layout holds {n} experts")
        if param not in whole:
            whole[param] = torch.zeros(whole_shape(kind, t.shape, experts, inter, [c0, c1],
                                                   None if param.startswith("main_grad.")
                                                   else first),
                                       dtype=t.dtype)
            filled[param] = torch.zeros(experts, inter, dtype=torch.bool)
        target, seen = whole[param], filled[param]
        if split:
            dim, unit, halves = spec
            i = (c1 - c0) // unit
            if t.dim() < -dim or t.shape[dim] != (2 if halves else 1) * i:
                raise ValueError(f"moec: {label}: shard {shard}'s '{prefix}{param}' "
                                 f"has shape {list(t.shape)}, not that of its layout's part")
            mine = target[lo:lo + n]
            views = [(mine.narrow(dim, c0 // unit, i), t.narrow(dim, 0, i))]
            if halves:
                views.append((mine.narrow(dim, (inter + c0) // unit, i), t.narrow(dim, i, i)))
        else:
            views = [(target[lo:lo + n], t)]
        for to, piece in views:
            if to.shape != piece.shape:
                raise ValueError(f"moec: {label}: shard {shard}'s '{prefix}{param}' "
                                 f"has shape {list(t.shape)}, not that of its layout's part")
        again = seen[lo:lo + n] if replica else seen[lo:lo + n, c0:c1]
        if replica and again.any():  # another TP rank's copy: the same
            if not all(torch.equal(to, piece) for to, piece in views):
                raise ValueError(f"moec: {label}: '{prefix}{param}' differs between the TP "
                                 f"ranks of experts {lo}..{lo + n - 1}, which hold it whole")
            seen[lo:lo + n, c0:c1] = True
            return
        if again.all():  # held by another shard too: a replica
            if not all(torch.equal(to, piece) for to, piece in views):
                raise ValueError(f"moec: {label}: '{prefix}{param}' differs between "
                                 f"shards that hold the same experts ({lo}..{lo + n - 1})")
            return
        if again.any():
            raise ValueError(f"moec: {label}: shard {shard}'s '{prefix}{param}' "
                             "holds part of what another shard holds (shards of different "
                             "jobs?)")
        for to, piece in views:
            to.copy_(piece)
        seen[lo:lo + n, c0:c1] = True

    grads = {}
    for shard, (part, layout) in enumerate(zip(parts, layouts)):
        lo, n = layout["first_expert"], layout["local_experts"]
        c0, c1 = layout.get("columns", [0, inter])
        for param, t in part.items():
            if param != "_extra_state":
                place(param, t, lo, n, c0, c1, shard)
        main = part["_extra_state"].get("main_grad")
        if main is not None:
            for w in ("w1", "w2"):
                place("main_grad." + w, main[w], lo, n, c0, c1, shard)
                grads[w] = whole["main_grad." + w]
    for param, seen in filled.items():
        if not seen.all():
            e = int((~seen).any(1).nonzero()[0])
            raise ValueError(f"moec: {label}: no shard holds expert {e} of "
                             f"'{prefix}{param.split('.')[-1]}'")
    layout = dict(first, first_expert=0, local_experts=experts, columns=[0, inter])
    extra = {"format": CHECKPOINT_FORMAT, "layout": layout}
    if grads:
        extra["main_grad"] = grads
    out = {prefix + p: t for p, t in whole.items() if not p.startswith("main_grad.")}
    out[entry] = extra
    return out
