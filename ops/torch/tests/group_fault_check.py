"""Faults of a job over a torch.distributed group, under torchrun with 2
processes (by test_torchrun.py), timeout_seconds 3:

    group_fault_check.py kill         rank 1 dies (SIGKILL) while a pass runs
    group_fault_check.py configs      rank 1's layer has another config
    group_fault_check.py extra-layer  rank 0 makes a layer rank 1 does not
    group_fault_check.py passes       every rank runs passes until its link
                                      is cut (across simulated hosts)

Each rank prints "rank r: raised after T s: <the error>" (or "rank r: no
error") and ends the process at once (the group is not usable after)."""

import os
import signal
import sys
import time

import torch

import launcher
import moec_torch


def config(seq=128, hidden=64, inter=32):
    return {"name": "group-fault", "hidden_size": hidden, "intermediate_size": inter,
            "num_experts": 4, "top_k": 2, "ep": 2, "tp": 1, "seq_size": seq,
            "dtype": "fp32", "capacity_factor": 4}


def inputs(rank, seq=128, hidden=64):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(seq, hidden, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(seq)])
    return x, ids, torch.rand(seq, 2, generator=g)


def main():
    mode = sys.argv[1]
    launcher.fabric()
    import torch.distributed as dist
    rank = dist.get_rank()
    torch.set_num_threads(1)

    def run(mark):
        if mode == "configs":
            seq = 128 if rank == 0 else 64
            moec_torch.MoeFFN(config(seq), threads=1, timeout_seconds=3.0)
        elif mode == "kill":
            # A pass of a few hundred ms, so that rank 1 dies inside it.
            layer = moec_torch.MoeFFN(config(2048, 512, 1024), threads=1, timeout_seconds=3.0)
            x = inputs(rank, 2048, 512)
            layer(*x)  # one whole pass first
            mark()
            handle = layer.submit_forward(*x)
            if rank == 1:
                time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGKILL)
            handle.wait()
        elif mode == "extra-layer":
            # Rank 0 makes a second layer that rank 1 never makes.
            moec_torch.MoeFFN(config(), threads=1, timeout_seconds=3.0)
            if rank == 1:
                print("rank 1: ok: made one layer", flush=True)
                time.sleep(8)
                os._exit(0)
            mark()
            moec_torch.MoeFFN(config(), threads=1, timeout_seconds=3.0)
        elif mode == "passes":
            # A first layer with a long timeout compiles (and caches) the
            # binaries, and the barrier lines the ranks up: making the layer
            # under test then takes far less than its 3 s on a loaded machine.
            moec_torch.MoeFFN(config(), threads=1, timeout_seconds=120.0)
            dist.barrier()
            layer = moec_torch.MoeFFN(config(), threads=1, timeout_seconds=3.0)
            x = inputs(rank)
            print(f"rank {rank}: passes run", flush=True)
            while True:
                mark()
                layer(*x)
        else:
            raise SystemExit(f"unknown mode {mode!r}")

    launcher.expect_error(rank, run)


if __name__ == "__main__":
    main()
