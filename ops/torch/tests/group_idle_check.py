"""Run under torchrun with 2 processes (by test_torchrun.py): a group whose
timeout is 2 s, a layer over it, a pass, 7 s of nothing, and another pass
that must give the same bits. gloo closes every connection of a group once
a receive waits longer than its timeout; the fabric's keep-alive messages
(a quarter of it apart) are what let the layer idle longer. Prints "rank r:
idle ok"."""

import datetime
import sys
import time

import torch
import torch.distributed as dist

import moec_torch


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=2))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    cfg = {"name": "idle", "hidden_size": 64, "intermediate_size": 32, "num_experts": 4,
           "top_k": 2, "ep": 2, "tp": 1, "seq_size": 64, "dtype": "fp32"}
    torch.manual_seed(0)
    layer = moec_torch.MoeFFN(cfg, threads=1, timeout_seconds=5.0)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 64, generator=g)
    ids = torch.rand(64, 4, generator=g).argsort(dim=1)[:, :2]
    w = torch.rand(64, 2, generator=g)
    with torch.no_grad():
        first = layer(x, ids, w)
        time.sleep(7)
        second = layer(x, ids, w)
    if not torch.equal(first, second):
        print(f"rank {rank}: FAILED: the pass after the idle time differs", flush=True)
        return 1
    print(f"rank {rank}: idle ok", flush=True)
    moec_torch.close_groups()
    return 0


if __name__ == "__main__":
    sys.exit(main())
