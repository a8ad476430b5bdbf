#!/usr/bin/env python3
"""Trains a toy model with a moec MoE-FFN layer on a synthetic task and prints
the loss as it falls.

The task: inputs come from C clusters; each cluster has its own random
two-layer map to the target. The model is an input projection, a learned
top-k router (softmax over experts, top-k weights renormalised), the moec
MoeFFN layer on an EP group of R ranks, and an output projection. The router
learns through the top-k weights' gradient, the experts through dw1 and dw2,
both from moec's backward pass.

Each rank's tokens go through the dense layers on their own, as they would
in a process of their own, and the dense layers' gradients are the sum of
the ranks' gradients. So the same script runs:

  - in one process: the R ranks are threads of the moec runtime;
  - under torchrun --nproc_per_node R: each process is one rank of the
    world group torch.distributed makes (gloo), which moec's layer runs
    over (its default once torch.distributed is initialized), holds its L
    experts and its share of every batch; the dense gradients are summed
    over the same group;
  - under mpirun -np R: likewise on moec's MPI fabric, the dense gradients
    summed through torch.distributed (gloo, over loopback: the launcher
    sets MASTER_ADDR and MASTER_PORT).
  With R = 2 and one torch thread (--torch-threads 1) the parameters are
  bitwise those of the one-process run with the same seed (--save writes
  them to compare), under either launcher.
  - with --ddp (a rank per process): the model in torch's
    DistributedDataParallel after moec_torch.prepare_ddp, which averages
    the dense gradients over the processes, each process taking the mean
    loss of its own tokens; the same parameters again (bitwise with 2
    ranks under torchrun).
  - --checkpoint DIR writes each process's model and optimizer state after
    the steps (DIR/rankN.pt); --resume DIR continues a run from one, merged
    (moec_torch.merge_state_dicts, merge_optimizer_state_dicts) and loaded
    as this run holds it: a run of 2 processes resumed in one process, or
    the other way round, goes on as if uninterrupted (bitwise with 2 ranks
    and --torch-threads 1). --steps counts from the start of the run.

    examples/torch/train_toy.py [--steps N] [--ranks R] [--dtype fp32|bf16]
                                [--threads N] [--torch-threads N] [--seed S]
                                [--ddp] [--save FILE] [--checkpoint DIR]
                                [--resume DIR]

Run from a checkout after `bazel build //tools:moec //ops/torch:moec_torch.so`
(examples/torch/train_toy.sh does both; examples/torch/train_toy_torchrun.sh
runs it under torchrun, examples/torch/train_toy_mpi.sh under mpirun). Exits 1 if the loss did not fall to under half its first
value.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ops" / "torch"))
import moec_torch  # noqa: E402


def toy_config(ranks, dtype):
    return {
        "name": "toy", "hidden_size": 64, "intermediate_size": 64, "num_experts": 4 * ranks,
        "top_k": 2, "ep": ranks, "tp": 1, "seq_size": 128, "dtype": dtype,
        # A router in training may send every token to one rank: size the
        # buffers for the worst case so any routing fits.
        "capacity_factor": 1024,
    }


class ToyModel(torch.nn.Module):
    def __init__(self, ranks, dtype, features, threads, fabric=None):
        super().__init__()
        self.moe = moec_torch.MoeFFN(toy_config(ranks, dtype), ranks, threads=threads,
                                     fabric=fabric)
        hidden, experts = self.moe.hidden, self.moe.experts
        self.dtype = self.moe.w1.dtype
        self.inp = torch.nn.Linear(features, hidden)
        self.router = torch.nn.Linear(hidden, experts)
        self.out = torch.nn.Linear(hidden, features)

    def forward(self, x):
        """x [P, S, F] -> [P, S, F], for the P ranks of this process; each
        rank's tokens pass the dense layers on their own."""
        hs, ids, weights = [], [], []
        for xr in x.unbind(0):
            h = self.inp(xr)
            probs = torch.softmax(self.router(h), dim=-1)
            w, i = probs.topk(self.moe.top_k, dim=-1)
            hs.append(h)
            ids.append(i)
            weights.append(w / w.sum(dim=-1, keepdim=True))
        h = torch.stack(hs)
        y = self.moe(h.to(self.dtype), torch.stack(ids), torch.stack(weights)).float()
        return torch.stack([self.out(hr + yr) for hr, yr in zip(hs, y.unbind(0))])


def make_task(features, clusters, seed):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(clusters, features, generator=g) * 2
    maps = torch.randn(clusters, features, features, generator=g) / features ** 0.5

    def batch(shape):
        c = torch.randint(clusters, shape, generator=g)
        x = centers[c] + 0.5 * torch.randn(*shape, features, generator=g)
        target = torch.tanh(torch.einsum("...f,...fg->...g", x, maps[c]))
        return x, target

    return batch


def train(steps=150, ranks=2, dtype="fp32", threads=0, seed=0, log_every=10, out=print,
          fabric=None, save=None, ddp=False, checkpoint=None, resume=None):
    """Trains and returns the losses, one per step trained (one rank per
    process: of all ranks).
    With `save`, writes the parameters (this process's) to that file. With
    `ddp` (a rank per process), the model is wrapped in
    DistributedDataParallel after moec_torch.prepare_ddp, and each process
    takes the mean loss of its own tokens. With `resume` (a folder
    `checkpoint` wrote, by a run of any launcher), the run goes on from the
    step it stopped at; with `checkpoint`, this process's model and
    optimizer state go to that folder after the last step."""
    torch.manual_seed(seed)
    features = 16
    model = ToyModel(ranks, dtype, features, threads, fabric)
    moe = model.moe
    # One rank per process: the dense gradients are summed over the
    # processes through torch.distributed (under torchrun, initialized
    # before the layer, which runs over its world group).
    spread = moe.fabric in ("mpi", "group")
    if spread:
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=moe.first_rank, world_size=moe.ranks)
    mine = slice(moe.first_rank, moe.first_rank + moe.local_ranks)
    dense = [p for n, p in model.named_parameters() if not n.startswith("moe.")]
    run = model
    if ddp and spread:
        # DDP averages the dense gradients; prepare_ddp keeps it off the
        # experts and scales theirs to the same mean.
        moec_torch.prepare_ddp(model)
        run = torch.nn.parallel.DistributedDataParallel(model)
    batch = make_task(features, clusters=8, seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = resumed(model, opt, resume) if resume else 0
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        # Every process draws the whole batch and keeps its ranks' share.
        x, target = batch((ranks, moe.tokens))
        if step < first:
            continue  # trained before the checkpoint: the data goes on from there
        x, target = x[mine], target[mine]
        pred = run(x)
        if run is not model:
            # This process's mean; DDP's gradients are the processes' mean.
            loss = torch.nn.functional.mse_loss(pred, target)
            total = loss.detach() / ranks
        else:
            # The mean over all ranks' elements, as a sum of per-rank sums.
            scale = 1.0 / (ranks * target[0].numel())
            loss = sum(torch.nn.functional.mse_loss(pr, tr, reduction="sum") * scale
                       for pr, tr in zip(pred.unbind(0), target.unbind(0)))
            total = loss.detach().clone()
        opt.zero_grad()
        loss.backward()
        if spread:
            if run is model:
                for p in dense:
                    dist.all_reduce(p.grad)
            dist.all_reduce(total)
        opt.step()
        losses.append(total.item())
        if step % log_every == 0 or step == steps - 1:
            out(f"step {step:4d}  loss {losses[-1]:.4f}")
    out(f"{steps - first} steps in {time.perf_counter() - start:.2f} s "
        f"({moe.ranks} ranks{', one per process' if spread else ''}"
        f"{', in DistributedDataParallel' if run is not model else ''}, {moe.experts} experts, "
        f"top-{moe.top_k}, {moe.w1.dtype})")
    if save:
        moec_torch.save_state({n: p.detach().clone() for n, p in model.named_parameters()}, save)
    if checkpoint:
        moec_torch.save_state({"step": steps, "model": model.state_dict(),
                               "optimizer": moec_torch.optimizer_state_dict(model, opt)},
                              Path(checkpoint) / f"rank{moe.first_rank if spread else 0}.pt")
        out(f"checkpoint of step {steps}: {checkpoint}")
    if spread:
        if moe.fabric == "group":
            moec_torch.close_groups()  # before the group it runs over goes
        dist.destroy_process_group()
    return losses


def resumed(model, opt, folder):
    """Loads the checkpoint the processes of a run wrote to `folder`
    (rankN.pt, one a process; one file from a run in one process) into
    `model` and `opt`, each process its part; returns its step."""
    files = sorted(Path(folder).glob("rank*.pt"))
    if not files:
        raise SystemExit(f"train_toy: --resume {folder}: no rankN.pt checkpoint files there")
    shards = [torch.load(f, weights_only=True) for f in files]
    steps = {s["step"] for s in shards}
    if len(steps) != 1:
        raise SystemExit(f"train_toy: --resume {folder}: the files are of different steps "
                         f"{sorted(steps)}")
    model.load_state_dict(moec_torch.merge_state_dicts(s["model"] for s in shards))
    moec_torch.load_optimizer_state_dict(
        model, opt, moec_torch.merge_optimizer_state_dicts(s["optimizer"] for s in shards))
    return steps.pop()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--threads", type=int, default=0, help="runtime workers (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch's intra-op threads (0: torch's default)")
    p.add_argument("--fabric", choices=["inproc", "mpi", "group"], default=None,
                   help="default: mpi under mpirun, group (torch.distributed's world group) "
                        "under torchrun, else inproc")
    p.add_argument("--ddp", action="store_true",
                   help="one rank per process: wrap the model in DistributedDataParallel "
                        "(after moec_torch.prepare_ddp) instead of summing the dense "
                        "gradients by hand")
    p.add_argument("--save", help="write the parameters after training to this file "
                                  "(one rank per process: FILE.rankN)")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="write the model's and the optimizer's state after the last step "
                        "to DIR/rankN.pt (one file a process)")
    p.add_argument("--resume", metavar="DIR",
                   help="go on from the checkpoint in DIR (written by --checkpoint, by a run "
                        "in one process or one of a rank per process) to --steps")
    args = p.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    fabric = args.fabric or ("mpi" if moec_torch.launched_by_mpi() else
                             "group" if moec_torch.launched_by_torchrun() else "inproc")
    rank = 0
    if fabric == "group":
        import torch.distributed as dist
        dist.init_process_group("gloo")  # torchrun's rendezvous (env://)
        rank = dist.get_rank()
    elif fabric == "mpi":
        rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    spread = fabric != "inproc"
    save = f"{args.save}.rank{rank}" if args.save and spread else args.save
    # One rank per process: every process trains; only rank 0 prints.
    out = print if rank == 0 else (lambda line: None)
    if args.checkpoint:
        Path(args.checkpoint).mkdir(parents=True, exist_ok=True)
    losses = train(args.steps, args.ranks, args.dtype, args.threads, args.seed, out=out,
                   fabric=fabric, save=save, ddp=args.ddp, checkpoint=args.checkpoint,
                   resume=args.resume)
    if not losses:
        out("no steps left to train")
        return 0
    first, last = losses[0], sum(losses[-5:]) / len(losses[-5:])
    out(f"loss {first:.4f} -> {last:.4f} (mean of the last 5 steps)")
    if len(losses) >= 50 and not last < 0.5 * first:
        print("train_toy: the loss did not fall to under half its first value", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
