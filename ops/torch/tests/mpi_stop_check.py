"""Run under mpirun or torchrun, 2 processes (by test_mpi.py,
test_torchrun.py) with MOEC_TEST_DROP_PUT=1:2: rank
1 drops its second put to rank 0 and the signal after it, so rank 0's
forward pass waits for it until the watchdog (timeout_seconds=3) fires.
Every rank's forward must raise; rank 0's error must carry the report of
both ranks. Prints "rank r: raised after T s: <the error>" and ends the
process at once (the job's fabric is not usable after a stop)."""

import torch

import launcher
import moec_torch


def main():
    torch.set_num_threads(1)
    cfg = {"name": "mpi-stop", "hidden_size": 64, "intermediate_size": 32, "num_experts": 4,
           "top_k": 2, "ep": 2, "tp": 1, "seq_size": 128, "dtype": "fp32",
           "capacity_factor": 4}
    layer = moec_torch.MoeFFN(cfg, 2, fabric=launcher.fabric(), threads=1, timeout_seconds=3.0)
    rank = layer.first_rank
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(128, 64, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(128)])
    weights = torch.rand(128, 2, generator=g)
    launcher.expect_error(rank, lambda mark: layer(x, ids, weights))


if __name__ == "__main__":
    main()
