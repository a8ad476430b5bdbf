"""Run under torchrun with 4 processes (by test_torchrun.py): two EP groups
of 2 ranks each, as an EP group inside data parallelism makes them
(torch.distributed.new_group([0, 1]) and new_group([2, 3])), each process's
layer over its own group. Each group draws its own inputs; every process
checks its forward and gradients bit for bit against the one-process layer
(MoeFFN(ranks=2), in-process fabric) on its group's inputs. Prints "rank r
(group g, rank i): ok"."""

import sys

import torch
import torch.distributed as dist

import moec_torch
from mpi_capacity_check import step  # the same step, over a group


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # collective: every process
    g = world // 2
    cfg = {"name": "subgroups", "hidden_size": 64, "intermediate_size": 32, "num_experts": 4,
           "top_k": 2, "ep": 2, "tp": 1, "seq_size": 64, "dtype": "fp32"}
    torch.manual_seed(g)  # each group its own weights
    layer = moec_torch.MoeFFN(cfg, group=groups[g], threads=1)
    torch.manual_seed(g)
    single = moec_torch.MoeFFN(cfg, 2, fabric="inproc", threads=1)
    r, L = layer.first_rank, layer.local_experts
    gen = torch.Generator().manual_seed(100 + g)
    x = torch.randn(2, 64, 64, generator=gen)
    ids = torch.rand(2 * 64, 4, generator=gen).argsort(dim=1)[:, :2].reshape(2, 64, 2)
    w = torch.rand(2, 64, 2, generator=gen)
    dy = torch.randn(2, 64, 64, generator=gen)

    got = step(layer, x[r], ids[r], w[r], dy[r])
    want = step(single, x, ids, w, dy)
    want = (want[0][r], want[1][r], want[2][r], want[3][r * L:(r + 1) * L],
            want[4][r * L:(r + 1) * L])
    names = ("y", "dx", "dtopk_weights", "dw1", "dw2")
    bad = [n for n, a, b in zip(names, got, want) if not torch.equal(a, b)]
    if layer.ranks != 2 or bad:
        print(f"rank {world} (group {g}, rank {r}): FAILED: ranks {layer.ranks}, differ: {bad}",
              flush=True)
        return 1
    print(f"rank {world} (group {g}, rank {r}): ok", flush=True)
    moec_torch.close_groups()
    return 0


if __name__ == "__main__":
    sys.exit(main())
