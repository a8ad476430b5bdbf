#!/usr/bin/env python3
"""The torch op's two fabrics of one rank per process side by side, in one
job started by mpirun (so that both are there): moec's MPI fabric, and the
fabric over a torch.distributed group (gloo), which torchrun's jobs use.

  - the layer's forward + backward on each fabric, and each again with
    MOEC_LOCAL_PUTS=1 (puts into the process's own memory, the signals
    still crossing): the difference is the communication the schedule
    leaves exposed;
  - dispatch + combine (moec_torch.Exchange) over the group (and over MPI)
    against torch.distributed.all_to_all_single of the same rows over the
    same group, what a plain PyTorch user writes: the rows sorted by destination
    rank, the counts exchanged, the rows there and back, the weighted sum.

Layer: H 1024, I 512, 4 experts a rank, top-2, S 512 tokens a rank, fp32
(examples/mpi/bench.sh's layer), one worker thread a process. Each time is
the slowest rank's (a pass ends when its last rank does), the best of
--repeat passes in each of --rounds rounds, the runs alternating within a
round; printed per round and the best over them.

    mpirun -np R python3 examples/torch/fabric_bench.py [--repeat N] [--rounds N]

(examples/torch/fabric_bench.sh runs it on this machine and across 2
simulated hosts.) The launcher must export MASTER_ADDR and MASTER_PORT
(torch.distributed's env:// rendezvous)."""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ops" / "torch"))
import moec_torch  # noqa: E402


def config(ranks):
    return {"name": "fabric-bench", "hidden_size": 1024, "intermediate_size": 512,
            "num_experts": 4 * ranks, "top_k": 2, "ep": ranks, "tp": 1, "seq_size": 512,
            "dtype": "fp32"}


def slowest(seconds):
    """The largest of every rank's `seconds`."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(fn):
    dist.barrier()
    start = time.perf_counter()
    fn()
    return slowest(time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=5, help="passes per run and round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    cfg = config(size)

    def layer(fabric, local_puts):
        # MOEC_LOCAL_PUTS is read when a fabric is made: the MPI fabric per
        # layer, the group's once per group (so a group of its own).
        os.environ["MOEC_LOCAL_PUTS"] = "1" if local_puts else "0"
        try:
            torch.manual_seed(0)
            if fabric == "mpi":
                return moec_torch.MoeFFN(cfg, fabric="mpi", threads=1)
            group = dist.new_group(list(range(size))) if local_puts else dist.group.WORLD
            return moec_torch.MoeFFN(cfg, group=group, threads=1)
        finally:
            del os.environ["MOEC_LOCAL_PUTS"]

    runs = {"mpi": layer("mpi", False), "mpi, local puts": layer("mpi", True),
            "group": layer("group", False), "group, local puts": layer("group", True)}
    some = runs["mpi"]
    S, H, E, K = some.tokens, some.hidden, some.experts, some.top_k
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(S, H, generator=g)
    ids = torch.rand(S, E, generator=g).argsort(dim=1)[:, :K]
    weights = torch.rand(S, K, generator=g) * 0.8 + 0.2
    dy = torch.randn(S, H, generator=g)

    def step(m):
        xs = x.clone().requires_grad_()
        m(xs, ids, weights).backward(dy)

    over = {"group": moec_torch.Exchange(cfg, group=dist.group.WORLD, threads=1),
            "mpi": moec_torch.Exchange(cfg, fabric="mpi", threads=1)}
    L = E // size

    def moec_exchange(exchange):
        expert_x, _, handle = exchange.dispatch(x, ids, weights)
        exchange.combine(expert_x, handle)

    def all_to_all():
        # Rows sorted by destination rank once, the counts exchanged, the
        # rows there and back, the weighted sum by token.
        dest = ids.flatten() // L
        order = torch.argsort(dest, stable=True)
        token = order // K
        send = x.index_select(0, token)
        counts = torch.bincount(dest, minlength=size)
        theirs = torch.empty_like(counts)
        dist.all_to_all_single(theirs, counts)
        out = torch.empty(int(theirs.sum()), H)
        dist.all_to_all_single(out, send, theirs.tolist(), counts.tolist())
        back = torch.empty_like(send)
        dist.all_to_all_single(back, out, counts.tolist(), theirs.tolist())
        torch.zeros(S, H).index_add_(0, token, back * weights.flatten()[order, None])

    exchanges = {"moec Exchange over the group": lambda: moec_exchange(over["group"]),
                 "moec Exchange over MPI": lambda: moec_exchange(over["mpi"]),
                 "all_to_all_single": all_to_all}
    for fn in [lambda m=m: step(m) for m in runs.values()] + list(exchanges.values()):
        fn(), fn()  # warm-up: first-touch pages, compiled routes
    names = list(runs) + list(exchanges)
    best = {n: float("inf") for n in names}
    if rank == 0:
        print(f"{size} ranks, layer H {H}, I 512, L {L}, top-{K}, S {S}, fp32; the slowest "
              f"rank's time, best of {args.repeat} passes a round", flush=True)
    for r in range(args.rounds):
        line = {}
        for name in names:
            fn = (lambda m=runs[name]: step(m)) if name in runs else exchanges[name]
            line[name] = min(timed(fn) for _ in range(args.repeat))
            best[name] = min(best[name], line[name])
        if rank == 0:
            print(f"round {r}: " + ", ".join(f"{n} {1e3 * t:.1f} ms" for n, t in line.items()),
                  flush=True)
    if rank == 0:
        print("best: " + ", ".join(f"{n} {1e3 * t:.1f} ms" for n, t in best.items()))
        for fabric in ("mpi", "group"):
            exposed = best[fabric] - best[f"{fabric}, local puts"]
            print(f"{fabric}: forward + backward {1e3 * best[fabric]:.1f} ms, exposed "
                  f"communication {1e3 * exposed:.1f} ms ({100 * exposed / best[fabric]:.1f}% "
                  "of the step)")
        print(f"dispatch + combine: moec over the group "
              f"{1e3 * best['moec Exchange over the group']:.1f} ms (over MPI "
              f"{1e3 * best['moec Exchange over MPI']:.1f} ms), all_to_all_single over the "
              f"group {1e3 * best['all_to_all_single']:.1f} ms "
              f"({best['all_to_all_single'] / best['moec Exchange over the group']:.2f}x)",
              flush=True)
    moec_torch.close_groups()
    moec_torch.finalize_mpi()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
