"""Run under torchrun (by test_torchrun.py) or mpirun (test_mpi.py): a
model with a moec layer whose ranks are one per process, wrapped in
torch.nn.parallel.DistributedDataParallel after moec_torch.prepare_ddp,
trained for a few SGD steps with momentum (the second one's gradients clipped by
moec_torch.clip_grad_norm_), against the same model in one process (the
layer's ranks as threads) trained by autograd on the mean of the
processes' losses, which is what DDP's averaged gradients stand for, and
clipped by torch's clip_grad_norm_.

    ddp_check.py VARIANT [DIR]

VARIANT: full | lora | groups (4 processes: two EP groups of 2 inside data
parallelism over the world; torchrun only) | groups_bf16 (the same in
bf16) | tp (4 processes: EP 2 x TP 2, a TP rank's tokens its EP rank's) |
zero (the replicated parameters under ZeroRedundancyOptimizer,
split_parameters) | refusals (what prepare_ddp refuses, and what it leaves
to DDP) | world_mismatch (mpirun only: torch.distributed's world not the
layer's).

Under mpirun the layer runs on moec's MPI fabric and torch.distributed
(gloo) is started from the launcher's ranks, MASTER_ADDR and MASTER_PORT.

Every process checks its dense parameters and its experts' (or adapters')
slice against the one-process model's, and that DDP's construction left
its experts as they were. With DIR, each process saves its state dict
and its optimizer's state there, and merge_state_dicts and
merge_optimizer_state_dicts of them are checked (merged_ok). Prints "rank
r: ddp ok"."""

import math
import os
import sys

import torch
import torch.distributed as dist

import moec_torch

H, E, K, S, STEPS, LR, MOMENTUM = 32, 8, 2, 16, 3, 0.5, 0.9
# The largest difference between a parameter's change and the one-process
# model's, as a share of that change's largest value.
TOLERANCE = {"fp32": 1e-4, "bf16": 0.1}
CLIP = 1e-3  # the second step's gradients clipped to this norm


class Net(torch.nn.Module):
    """A projection, a learned router (softmax, top-k), moec's layer (fp32
    or bf16), a projection (fp32)."""

    def __init__(self, layer):
        super().__init__()
        self.inp = torch.nn.Linear(H, H)
        self.router = torch.nn.Linear(H, E)
        self.moe = layer
        self.out = torch.nn.Linear(H, H)

    def forward(self, x):
        h = self.inp(x)
        weights, ids = self.router(h).softmax(-1).topk(K)
        y = self.moe(h.to(self.moe.dtype), ids, weights)  # the layer's dtype
        return self.out(y.to(h.dtype))


def trained(model):
    """(name, parameter) of what the optimizer steps."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def merged_ok(folder, model, opt, ref, ref_opt, me, world, dtype, one_process, job, optimizer):
    """Each process saves its state dict and its optimizer's state by name
    (one file a process), and merge_state_dicts and
    merge_optimizer_state_dicts make the whole model's of them: the
    one-process model's parameters and momentum (the steps' differences
    aside) and layout, which load into a one-process model and, each
    process its slice, into a new model of this job's size (`optimizer`
    makes a model's optimizer as `opt` was made)."""
    # (Without the full case's alias of w1, which would read as a replica.)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("alias.")}
    moec_torch.save_state({"model": state,
                           "optimizer": moec_torch.optimizer_state_dict(model, opt)},
                          f"{folder}/rank{me}.pt")
    dist.barrier()
    saved = [torch.load(f"{folder}/rank{r}.pt", weights_only=True) for r in range(world)]
    merged = moec_torch.merge_state_dicts(s["model"] for s in saved)
    bad = optimizer_merged_ok(model, opt, ref, ref_opt, dtype, one_process, job, optimizer,
                              moec_torch.merge_optimizer_state_dicts(s["optimizer"] for s in saved))
    want = ref.state_dict()
    if list(merged) != list(want):
        print(f"rank {me}: FAILED: the merged state dict's keys {list(merged)}, the one-process "
              f"model's {list(want)}", flush=True)
        return False
    bad += [k for k, v in want.items() if (
        not torch.allclose(merged[k], v, rtol=0, atol=TOLERANCE[dtype] * 0.1 * v.abs().max().item())
        if isinstance(v, torch.Tensor) else merged[k] != v)]
    whole = one_process()
    whole.load_state_dict(merged)
    bad += [f"{k} (one process)" for k, v in whole.state_dict().items()
            if isinstance(v, torch.Tensor) and not torch.equal(v, merged[k])]
    again = job()  # collective: every process makes it
    again.load_state_dict(merged)
    bad += [f"{n} (this job again)" for (n, p), q in zip(again.named_parameters(),
                                                           model.parameters())
            if not torch.equal(p, q)]
    if bad:
        print(f"rank {me}: FAILED: the merged state dict: {bad}", flush=True)
    return not bad


def optimizer_merged_ok(model, opt, ref, ref_opt, dtype, one_process, job, optimizer, merged):
    """The merged optimizer state: the one-process optimizer's momentum (of
    the parameters `opt` steps), which loads into a one-process model's
    optimizer as it is and into a new job's as each process's slice."""
    bad = []
    want = moec_torch.optimizer_state_dict(ref, ref_opt)["state"]
    for name, values in merged["state"].items():
        got, ref_value = values["momentum_buffer"], want[name]["momentum_buffer"]
        scale = ref_value.abs().max().item()
        if got.shape != ref_value.shape or scale == 0 or not torch.allclose(
                got.float(), ref_value.float(), rtol=0, atol=TOLERANCE[dtype] * 0.1 * scale):
            bad.append(f"momentum of {name}")
    whole = one_process()
    whole_opt = optimizer(whole)
    moec_torch.load_optimizer_state_dict(whole, whole_opt, merged)
    loaded = moec_torch.optimizer_state_dict(whole, whole_opt)
    bad += [f"momentum of {n} (one process)" for n, v in merged["state"].items()
            if not torch.equal(loaded["state"][n]["momentum_buffer"], v["momentum_buffer"])]
    if loaded["layers"] != merged["layers"] or loaded["param_groups"] != merged["param_groups"]:
        bad.append("the one-process optimizer's layout or groups")
    again = job()  # collective
    again_opt = optimizer(again)
    moec_torch.load_optimizer_state_dict(again, again_opt, merged)
    mine = moec_torch.optimizer_state_dict(model, opt)["state"]
    loaded = moec_torch.optimizer_state_dict(again, again_opt)["state"]
    bad += [f"momentum of {n} (this job again)" for n, v in mine.items()
            if not torch.equal(loaded[n]["momentum_buffer"], v["momentum_buffer"])]
    return bad


def refusals(me, world):
    """prepare_ddp's refusals, each a ValueError naming the layer; a
    forward inside DDP without it (RuntimeError), or with the layer left out
    by hand (runs), or of a layer that DDP does not hold (runs); and a layer whose experts are all in this process
    (in-process fabric), which is a replica like any module: left to DDP."""
    cfg = {"name": "ddp", "hidden_size": H, "intermediate_size": 16, "num_experts": E,
           "top_k": K, "ep": world, "tp": 1, "seq_size": S, "dtype": "fp32"}
    cases = []
    grads = Net(moec_torch.MoeFFN(cfg, threads=1, main_grad=True))
    cases.append((lambda: moec_torch.prepare_ddp(grads),
                  "layer 'moe' keeps its weight gradients in main_grad buffers"))
    one = dist.new_group([0])  # collective
    model = Net(moec_torch.MoeFFN(cfg, threads=1))
    cases.append((lambda: moec_torch.prepare_ddp(model, process_group=one if me == 0 else None),
                  r"layer 'moe' runs over processes \[0, 1\], not all of them in DDP's group "
                  r"\[0\]" if me == 0 else None))
    cases.append((lambda: moec_torch.prepare_ddp(model.moe, process_group=one if me == 0
                                                 else None),
                  "the layer runs over processes" if me == 0 else None))
    again = Net(moec_torch.MoeFFN(cfg, threads=1))
    moec_torch.prepare_ddp(again)
    cases.append((lambda: moec_torch.prepare_ddp(again, process_group=one if me == 0 else None),
                  "layer 'moe' was prepared for another DDP group already" if me == 0 else None))
    # DDP around the layer without prepare_ddp: every process's forward
    # raises, before any exchange (DDP has copied rank 0's experts already).
    bare = torch.nn.parallel.DistributedDataParallel(Net(moec_torch.MoeFFN(cfg, threads=1)))
    cases.append((lambda: bare(torch.zeros(S, H)), "runs inside DistributedDataParallel without "
                  r"moec_torch.prepare_ddp\(model\)"))
    # Told by hand to leave the layer alone: it runs.
    byhand = Net(moec_torch.MoeFFN(cfg, threads=1))
    byhand._ddp_params_and_buffers_to_ignore = ["moe." + n for n, _ in
                                                byhand.moe.named_parameters()]
    wrapped = torch.nn.parallel.DistributedDataParallel(byhand)
    cases.append((lambda: wrapped(torch.zeros(S, H)), None))

    # A layer DDP does not hold, called from a DDP-wrapped model's forward
    # (a teacher inside a student's step): not DDP's, so it runs.
    class Student(torch.nn.Module):
        def __init__(self, teacher):
            super().__init__()
            self.proj = torch.nn.Linear(H, H)
            self.teacher = [teacher]  # a plain list: not a submodule

        def forward(self, x):
            return self.proj(self.teacher[0](x))

    student = torch.nn.parallel.DistributedDataParallel(
        Student(Net(moec_torch.MoeFFN(cfg, threads=1))))
    cases.append((lambda: student(torch.zeros(S, H)), None))
    import re
    failed = []
    for i, (call, want) in enumerate(cases):
        try:
            call()
            got = None
        except (ValueError, RuntimeError) as e:
            got = str(e)
        if (want is None) != (got is None) or (want and not re.search(want, got)):
            failed.append(f"case {i}: expected {want!r}, got {got!r}")
    local = Net(moec_torch.MoeFFN(dict(cfg, ep=2), 2, fabric="inproc", threads=1))
    if moec_torch.prepare_ddp(local) != []:
        failed.append("an in-process layer was left out of DDP")
    if failed:
        print(f"rank {me}: FAILED: {failed}", flush=True)
        return 1
    print(f"rank {me}: ddp ok (refusals)", flush=True)
    moec_torch.close_groups()
    dist.destroy_process_group()
    return 0


def world_mismatch():
    """Under mpirun: torch.distributed started as a world of one process in
    each (a script that passed the wrong rank and size), around a layer on
    moec's MPI fabric over 2: prepare_ddp refuses, naming both sizes."""
    me = int(os.environ["OMPI_COMM_WORLD_RANK"])
    port = int(os.environ["MASTER_PORT"]) + 1 + me
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{port}")
    cfg = {"name": "ddp", "hidden_size": H, "intermediate_size": 16, "num_experts": E,
           "top_k": K, "ep": 2, "tp": 1, "seq_size": S, "dtype": "fp32"}
    model = Net(moec_torch.MoeFFN(cfg, threads=1))
    try:
        moec_torch.prepare_ddp(model)
        got = None
    except ValueError as e:
        got = str(e)
    want = ("the layer runs on the MPI fabric over 2 processes, and torch.distributed's "
            "world has 1")
    dist.destroy_process_group()
    if got is None or want not in got:
        print(f"rank {me}: FAILED: expected {want!r}, got {got!r}", flush=True)
        return 1
    print(f"rank {me}: ddp ok (world mismatch)", flush=True)
    return 0


def main():
    variant = sys.argv[1]
    if variant == "world_mismatch":
        return world_mismatch()
    if moec_torch.launched_by_mpi():
        dist.init_process_group("gloo", rank=int(os.environ["OMPI_COMM_WORLD_RANK"]),
                                world_size=int(os.environ["OMPI_COMM_WORLD_SIZE"]))
    else:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    me, world = dist.get_rank(), dist.get_world_size()
    if variant == "refusals":
        return refusals(me, world)
    tp = 2 if variant == "tp" else 1
    ep = 2 if variant in ("groups", "groups_bf16", "tp") else world
    dtype = "bf16" if variant.endswith("bf16") else "fp32"
    shards = world // tp  # the token sets: a TP rank's tokens are its EP rank's
    cfg = {"name": "ddp", "hidden_size": H, "intermediate_size": 16, "num_experts": E,
           "top_k": K, "ep": ep, "tp": tp, "seq_size": S, "dtype": dtype,
           "capacity_factor": 64}
    kw = {"lora_rank": 4, "lora_alpha": 8} if variant == "lora" else {}
    torch.manual_seed(0)
    ref = Net(moec_torch.MoeFFN(cfg, ep, tp=tp, fabric="inproc", threads=1, **kw))
    if variant == "lora":
        with torch.no_grad():
            for p in ref.moe.adapters():
                p.uniform_(-0.3, 0.3)
    group = None
    if variant.startswith("groups"):
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # collective
        group = groups[me // 2]
    model = Net(moec_torch.MoeFFN(cfg, group=group, tp=tp, threads=1, **kw))
    layer, L = model.moe, model.moe.local_experts
    mine = slice(layer.first_rank * L, (layer.first_rank + 1) * L)

    def share(name, whole):
        """This process's part of the one-process model's `name`: of the
        layer's, its experts (and of w1, w2 its TP slice)."""
        if not name.startswith("moe."):
            return whole
        name = name[4:]
        return layer._tp_part(name, whole[mine])[0] if name in ("w1", "w2") else whole[mine]
    with torch.no_grad():  # the same start as the one-process model
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            p.copy_(share(n, q))

    start = {n: p.detach().clone() for n, p in trained(model)}
    want = {"moe." + n for n, _ in layer.named_parameters()}
    if variant == "full":
        # A module that registers the layer's w1 too: DDP meets it by that
        # name as well, which must be left out as well.
        model.alias = torch.nn.Module()
        model.alias.register_parameter("w", layer.w1)
        want.add("alias.w")
    ignored = moec_torch.prepare_ddp(model)
    assert moec_torch.prepare_ddp(model) == ignored  # again: nothing more
    assert set(ignored) == want, (ignored, want)
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    moved = [n for n, p in layer.named_parameters() if not torch.equal(p, before[n])]
    if moved:
        print(f"rank {me}: FAILED: DDP's construction changed {moved}", flush=True)
        return 1

    if variant == "zero":
        # ZeRO shares the replicated parameters' optimizer out over the
        # processes; each process's experts get an optimizer of their own.
        from torch.distributed.optim import ZeroRedundancyOptimizer
        replicated, own = moec_torch.split_parameters(model)
        assert {id(p) for p in own} == {id(p) for p in layer.parameters()}
        assert len(replicated) + len(own) == len(list(model.parameters()))
        opts = [ZeroRedundancyOptimizer(replicated, optimizer_class=torch.optim.SGD, lr=LR,
                                        momentum=MOMENTUM),
                torch.optim.SGD(own, lr=LR, momentum=MOMENTUM)]
    else:
        opts = [torch.optim.SGD([p for _, p in trained(model)], lr=LR, momentum=MOMENTUM)]
    ref_opt = torch.optim.SGD([p for _, p in trained(ref)], lr=LR, momentum=MOMENTUM)

    def optimizer(net):
        """An optimizer of `net` as opts[-1] is of the model (under ZeRO:
        of the layer's parameters, split_parameters' own)."""
        own = list(net.moe.parameters()) if variant == "zero" else \
            [p for _, p in trained(net)]
        return torch.optim.SGD(own, lr=LR, momentum=MOMENTUM)
    gen = torch.Generator().manual_seed(7)
    for step in range(STEPS):
        x = torch.randn(shards, S, H, generator=gen)
        target = torch.randn(shards, S, H, generator=gen)
        # DDP: this process's loss; its gradients are averaged over the world.
        loss = torch.nn.functional.mse_loss(ddp(x[me // tp]), target[me // tp])
        loss.backward()
        if step == 1:  # the whole model's norm, clipped (far below it)
            # Norms alone (an infinite max_norm scales nothing): the layer's
            # (its processes' experts together), and the largest value.
            norms = [moec_torch.clip_grad_norm_(layer, math.inf).item(),
                     moec_torch.clip_grad_norm_(model, math.inf, norm_type=math.inf).item()]
            norm = moec_torch.clip_grad_norm_(model, CLIP)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        # One process: the mean of every process's loss, each EP group's
        # tokens through the one-process layer in turn.
        total = 0
        for g in range(shards // ep):
            out = ref(x[g * ep:(g + 1) * ep])
            total = total + sum(torch.nn.functional.mse_loss(o, t) for o, t in
                                zip(out.unbind(0), target[g * ep:(g + 1) * ep].unbind(0)))
        (total / shards).backward()
        if step == 1:
            clip = torch.nn.utils.clip_grad_norm_
            wants = [clip(ref.moe.parameters(), math.inf).item(),
                     clip(ref.parameters(), math.inf, norm_type=math.inf).item()]
            want_norm = clip(ref.parameters(), CLIP).item()
            for what, got, want in zip(("the whole gradient's norm", "the layer's norm",
                                        "the largest gradient"),
                                       [norm.item(), *norms], [want_norm, *wants]):
                if not abs(got - want) <= TOLERANCE[dtype] * want:
                    print(f"rank {me}: FAILED: {what} {got}, one process's {want}", flush=True)
                    return 1
            if not want_norm > 10 * CLIP:
                print(f"rank {me}: FAILED: the norm {want_norm} was not clipped", flush=True)
                return 1
        ref_opt.step()
        ref_opt.zero_grad()

    # What the steps changed, against the one-process model's change (both
    # started from the same values): DDP's all-reduce adds in gloo's order.
    bad, worst = [], 0.0
    for (n, p), (_, q) in zip(trained(model), trained(ref)):
        got, want = (p - start[n]).float(), (share(n, q) - start[n]).float()
        scale = want.abs().max().item()
        err = (got - want).abs().max().item() / max(scale, 1e-30)
        worst = max(worst, err)
        if scale == 0 or err > TOLERANCE[dtype]:
            bad.append(f"{n} (its change off by {err:.3g} of {scale:.3g})")
    if bad:
        print(f"rank {me}: FAILED: {bad}", flush=True)
        return 1
    if len(sys.argv) > 2 and not merged_ok(sys.argv[2], model, opts[-1], ref, ref_opt, me,
                                           world, dtype,
                                           lambda: Net(moec_torch.MoeFFN(
                                               cfg, ep, tp=tp, fabric="inproc", threads=1, **kw)),
                                           lambda: Net(moec_torch.MoeFFN(
                                               cfg, group=group, tp=tp, threads=1, **kw)),
                                           optimizer):
        return 1
    print(f"rank {me}: ddp ok ({len(trained(model))} trained tensors, {len(ignored)} left to "
          f"moec; changes within {worst:.2g})", flush=True)
    if layer.fabric == "group":
        moec_torch.close_groups()  # before the group it runs over goes
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
