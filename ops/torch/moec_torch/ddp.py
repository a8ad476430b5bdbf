"""Data parallelism around expert-parallel layers: prepare_ddp, for
torch.nn.parallel.DistributedDataParallel (DDP); clip_grad_norm_, the
norm of the whole model's gradient across the processes; split_parameters,
the replicated parameters apart from each process's own.

A MoeFFN whose ranks are one per process (under torchrun or mpirun) holds
different experts in each process. DDP, left to itself, treats every
parameter as a replica: at construction it copies rank 0's parameters and
buffers into every other process (each process's experts overwritten
with rank 0's), and after each backward it averages every gradient over
its processes (gradients of different experts summed together), both
without a word (so a layer refuses to run inside a DDP holding it that
does not leave it alone: MoeFFN._check_ddp). prepare_ddp(model) keeps DDP
off those layers and gives their gradients DDP's meaning:

  - every parameter and buffer of such a layer goes into the model's
    `_ddp_params_and_buffers_to_ignore` (DDP's list of what it neither
    broadcasts nor reduces);
  - DDP's gradients are those of the mean of its W processes' losses.
    The layer's backward gives an expert's gradient summed over the
    losses of every EP rank of its group (their tokens' rows come back to
    it), so the layer's weight and adapter gradients are scaled by 1 / W
    (by T / W with expert tensor parallelism over T ranks, whose processes
    pass their EP rank's tokens, so that DDP's mean counts each EP rank's
    loss T times): its backward runs on dy times that factor and takes it
    off dx and d topk_weights again (exact for a power of two);
  - where DDP's group is larger than the layer's (EP groups inside data
    parallelism: torch.distributed.new_group([0, 1]) and new_group([2,
    3]) in a world of 4), the processes that hold the same experts in
    their groups sum those gradients first (a hook's all-reduce over a
    group of theirs, which prepare_ddp makes; DDP's group must then be
    the world group, since every process makes each new group).

Layers whose experts are all in every process (the in-process fabric) are
replicas like any module and are left to DDP. A layer with main_grad
buffers is refused: DDP neither reads nor reduces them.
"""

import math

import torch

from .layer import MoeFFN


def _spread_layers(model):
    """(name, layer) of the MoeFFN layers in `model` whose ranks are one per
    process: each process holds its own experts."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, MoeFFN) and m._collective]


def _ranks(group, world):
    """The global ranks of torch.distributed group `group`, in its order."""
    import torch.distributed as dist
    return list(range(world)) if group is dist.group.WORLD \
        else list(dist.get_process_group_ranks(group))


def _processes(layer, world):
    """The global ranks of the processes `layer` runs over, in their order
    in its group."""
    if layer.fabric == "group":
        return _ranks(layer.group, world)
    # The MPI fabric spans the MPI world, which must be torch.distributed's.
    count = layer.ranks * layer.tp
    if count != world:
        raise ValueError(f"moec: prepare_ddp: the layer runs on the MPI fabric over {count} "
                         f"processes, and torch.distributed's world has {world}")
    return list(range(world))


def _summed(group):
    """A parameter hook: the gradient summed over `group`. gloo sums fp32
    and fp64; a bf16 gradient is summed as fp32 and rounded once."""
    import torch.distributed as dist

    def hook(grad):
        total = grad.to(torch.float32, copy=True)
        dist.all_reduce(total, group=group)
        return total.to(grad.dtype)

    return hook


def split_parameters(model):
    """(replicated, per_process): the parameters of `model` that every
    process holds alike, and those of its layers whose ranks are one per
    process (each process its own experts). An optimizer that shards its
    state over the processes or copies parameters between them
    (torch.distributed.optim.ZeroRedundancyOptimizer, which gives each
    process a share of the parameters and then copies each share's new
    values into every other process) must get the replicated ones only;
    the per-process ones need an optimizer of their own, in every
    process."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"moec: split_parameters: model must be an nn.Module, got "
                        f"{type(model).__name__}")
    own = {id(p) for _, m in _spread_layers(model) for p in m.parameters()}
    params = list(model.parameters())
    return ([p for p in params if id(p) not in own], [p for p in params if id(p) in own])


def prepare_ddp(model, process_group=None):
    """Makes `model` ready for DistributedDataParallel(model,
    process_group=process_group): call it on every process, after the
    model is built (and patched, for moec_torch.hf) and before DDP wraps
    it. Returns the names of the parameters and buffers DDP is to leave
    alone (added to model._ddp_params_and_buffers_to_ignore). Calling it
    again with the same group changes nothing."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("moec: prepare_ddp: torch.distributed is not initialized "
                         "(init_process_group, as torchrun's scripts do, before DDP)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"moec: prepare_ddp: model must be an nn.Module, got "
                        f"{type(model).__name__}")
    group = dist.group.WORLD if process_group is None else process_group
    world = dist.get_world_size()
    members = _ranks(group, world)
    layers = _spread_layers(model)
    mine = set()  # the layers' tensors
    for name, layer in layers:
        where = f"layer '{name}'" if name else "the layer"
        if layer.main_grad:
            raise ValueError(f"moec: prepare_ddp: {where} keeps its weight gradients in "
                             "main_grad buffers, which DDP neither reads nor reduces; build "
                             "it without main_grad=True, or reduce them yourself as "
                             "Megatron's DDP does")
        if layer._ddp_group is not None and layer._ddp_group is not group:
            raise ValueError(f"moec: prepare_ddp: {where} was prepared for another DDP "
                             "group already")
        own = _processes(layer, world)
        if not set(own) <= set(members):
            raise ValueError(f"moec: prepare_ddp: {where} runs over processes {own}, not all "
                             f"of them in DDP's group {members}")
        mine.update(id(t) for t in (*layer.parameters(), *layer.buffers()))
    # Every name DDP may find them by (a tensor another module registers too).
    ignore = [f"{prefix}{'.' if prefix else ''}{n}"
              for prefix, module in model.named_modules(remove_duplicate=False)
              for n, t in (*module._parameters.items(), *module._buffers.items())
              if t is not None and id(t) in mine]
    unprepared = [(name, layer) for name, layer in layers if layer._ddp_group is None]
    replicas = _replica_groups(unprepared, group, world, members)
    for name, layer in unprepared:
        # DDP's mean counts each EP rank's loss once for each of its TP
        # ranks, which pass the same tokens. The factor goes into the
        # layer's dy, not over its weight gradients: one pass over an
        # activation instead of one over the experts (a 400 MB bf16 w1
        # gradient took 130-190 ms to scale on 2 cores).
        layer._grad_scale = layer.tp / len(members)
        if name in replicas:
            for p in layer.parameters():
                if p.requires_grad:
                    p.register_hook(_summed(replicas[name]))
        layer._ddp_group = group
    already = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    model._ddp_params_and_buffers_to_ignore = already + [n for n in ignore if n not in already]
    return ignore


def _replica_groups(layers, group, world, members):
    """{layer name: the group of the processes that hold the same experts
    as this one} for the layers whose EP group is smaller than DDP's
    group, made with torch.distributed.new_group by every process in the
    same order (from what every process says of its layers)."""
    import torch.distributed as dist
    if all(len(_processes(layer, world)) == len(members) for _, layer in layers):
        return {}
    if group is not dist.group.WORLD:
        raise ValueError("moec: prepare_ddp: an EP group smaller than DDP's group needs DDP "
                         "over the world group (process_group=None): the groups that sum an "
                         "expert's gradients are made by every process")
    mine = [(name, tuple(_processes(layer, world))) for name, layer in layers]
    every = [None] * world
    dist.all_gather_object(every, mine)
    if any([n for n, _ in theirs] != [n for n, _ in mine] for theirs in every):
        raise ValueError("moec: prepare_ddp: the processes' models differ in their "
                         "expert-parallel layers (every process must pass the same model)")
    me = dist.get_rank()
    made, out = {}, {}
    for i, (name, own) in enumerate(mine):
        sizes = {len(theirs[i][1]) for theirs in every}
        if len(sizes) != 1 or world % next(iter(sizes)):
            raise ValueError(f"moec: prepare_ddp: the EP groups of layer '{name}' are not "
                             "of one size that divides the world")
        if len(own) == world:
            continue  # one EP group: its experts are nowhere else
        # Position in its EP group -> the processes at that position.
        spots = {}
        for rank, theirs in enumerate(every):
            spots.setdefault(theirs[i][1].index(rank), []).append(rank)
        for spot in sorted(spots):
            ranks = tuple(spots[spot])
            if ranks not in made:
                made[ranks] = dist.new_group(list(ranks))  # every process, the same order
        out[name] = made[tuple(spots[own.index(me)])]
    return out


def clip_grad_norm_(model, max_norm, norm_type=2.0, error_if_nonfinite=False):
    """torch.nn.utils.clip_grad_norm_ for a model with expert-parallel
    layers: the norm of the whole model's gradient, as one process holding
    every expert would compute it, and every gradient scaled alike where it
    is over max_norm. Returns that norm (a tensor). Call it on every
    process, after the backward (DDP's reduction included), before the
    optimizer step.

    torch's own clip_grad_norm_ sees only this process's experts: each
    process gets another norm, scales the replicated parameters' gradients
    by another factor, and the replicas drift apart. Here each layer whose
    ranks are one per process sums its gradients' norms over its processes
    (an exchange over the layer's own fabric; an EP group inside data
    parallelism holds the same expert gradients as the others after
    prepare_ddp, so its own processes make the whole), and the other
    parameters count once (DDP's reduction made them the same everywhere).
    norm_type is 2.0 or inf. Gradients in main_grad buffers are not
    .grad and are not counted or scaled."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"moec: clip_grad_norm_: model must be an nn.Module, got "
                        f"{type(model).__name__}")
    norm_type = float(norm_type)
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"moec: clip_grad_norm_: norm_type must be 2.0 or inf, got {norm_type}")
    max_norm = float(max_norm)
    replicated, _ = split_parameters(model)

    def norm(params):
        # In double, a few MiB at a time: an expert's gradient in double
        # whole would be four times its bf16 bytes.
        grads = [p.grad.detach().reshape(-1) for p in params if p.grad is not None]
        if norm_type == math.inf:
            return max((torch.linalg.vector_norm(g, math.inf).item() for g in grads if g.numel()),
                       default=0.0)
        return math.sqrt(math.fsum(
            torch.linalg.vector_norm(piece, dtype=torch.float64).item() ** 2
            for g in grads for piece in g.split(1 << 20)))

    parts = [norm(replicated)]
    for _, layer in _spread_layers(model):
        if not any(p.requires_grad for p in layer.parameters()):
            continue  # frozen everywhere: nothing to count
        views = layer._agree({"grad_norm": norm(layer.parameters())},
                             "moec clip_grad_norm_: the ranks could not compare their norms")
        local = [v.get("grad_norm") for v in views]
        if any(not isinstance(v, (int, float)) for v in local):
            raise RuntimeError(f"moec clip_grad_norm_: a rank sent {local}, not norms")
        parts.append(max(local) if norm_type == math.inf
                     else math.sqrt(math.fsum(v * v for v in local)))
    total = max(parts) if norm_type == math.inf else math.sqrt(math.fsum(v * v for v in parts))
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"moec clip_grad_norm_: the total norm of order {norm_type} of the "
                           f"gradients is {total}")
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.detach().mul_(coef)
    return torch.tensor(total)
