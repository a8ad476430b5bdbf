"""Run under torchrun by test_torchrun.py: activation checkpointing
(torch.utils.checkpoint, reentrant and not) around a router and a moec
layer whose ranks are one per process, bare and inside
DistributedDataParallel after prepare_ddp: every process recomputes the
layer's forward inside backward, in the same order, and every gradient is
bitwise the plain run's, two steps in a row.

    checkpointing_check.py [ddp]

Prints "rank r: checkpointing ok"."""

import sys

import torch
import torch.distributed as dist
import torch.utils.checkpoint as cp

import moec_torch

H, E, K, S = 32, 8, 2, 16


class Net(torch.nn.Module):
    def __init__(self, world):
        super().__init__()
        cfg = {"name": "ckpt", "hidden_size": H, "intermediate_size": 16, "num_experts": E,
               "top_k": K, "ep": world, "tp": 1, "seq_size": S, "dtype": "fp32"}
        self.router = torch.nn.Linear(H, E)
        self.moe = moec_torch.MoeFFN(cfg, threads=1)
        self.out = torch.nn.Linear(H, H)

    def block(self, x):
        weights, ids = self.router(x).softmax(-1).topk(K)
        return self.moe(x, ids, weights)

    def forward(self, x, mode):
        h = self.block(x) if mode == "plain" else \
            cp.checkpoint(self.block, x, use_reentrant=mode == "reentrant")
        return self.out(h)


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    me, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = Net(world)
    model = net
    if sys.argv[1:] == ["ddp"]:
        moec_torch.prepare_ddp(net)
        model = torch.nn.parallel.DistributedDataParallel(net)
    x = torch.randn(S, H, generator=torch.Generator().manual_seed(me), requires_grad=True)
    grads = {}
    for mode in ("plain", "reentrant", "nonreentrant"):
        for _ in range(2):
            model(x, mode).square().sum().backward()
        grads[mode] = [p.grad.clone() for p in net.parameters()] + [x.grad.clone()]
        net.zero_grad(set_to_none=True)
        x.grad = None
    bad = [mode for mode in grads if not all(torch.equal(a, b) for a, b in
                                             zip(grads["plain"], grads[mode]))]
    moec_torch.close_groups()
    dist.destroy_process_group()
    if bad:
        print(f"rank {me}: FAILED: the gradients of {bad} differ from the plain run's",
              flush=True)
        return 1
    print(f"rank {me}: checkpointing ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
