"""Threads and step time of a model of many MoE layers in one process.

    many_layers.py [--layers 48] [--threads 0] [--steps 3] [--hidden 256] [--inter 128]

Builds --layers MoeFFN layers (2 in-process ranks, 8 experts, top-2, S 256
a rank, fp32; --threads 0: each layer asks for the hardware threads, as a
user who sets nothing gets), runs a training step through all of them
(forward layer after layer, then backward) and prints the threads of the
process (/proc/self/task) after the layers are made and after the steps,
and the step time after two warm-up steps (the median of --steps).
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ops/torch"))
import moec_torch  # noqa: E402


def threads():
    return len(os.listdir("/proc/self/task"))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=128)
    args = p.parse_args()
    cfg = {"name": "many", "hidden_size": args.hidden, "intermediate_size": args.inter,
           "num_experts": 8, "top_k": 2, "ep": 2, "tp": 1, "seq_size": 256, "dtype": "fp32",
           "num_cube_cores": 2, "num_vector_cores": 2}
    before = threads()
    torch.manual_seed(0)
    layers = [moec_torch.MoeFFN(cfg, ranks=2, threads=args.threads) for _ in range(args.layers)]
    made = threads()
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, 256, args.hidden, generator=g) * 0.1
    ids = torch.stack([torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(256)])
                       for _ in range(2)])
    weights = torch.full((2, 256, 2), 0.5)

    def step():
        x = x0.clone().requires_grad_()
        h = x
        for layer in layers:
            h = h + layer(h, ids, weights)
        h.square().mean().backward()
        for layer in layers:
            layer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    print(f"{args.layers} layers, threads={args.threads} each, {os.cpu_count()} cores, "
          f"torch threads {torch.get_num_threads()}")
    print(f"process threads: {before} before the layers, {made} with them, "
          f"{threads()} after {args.steps + 2} steps")
    print(f"step (forward + backward through every layer): "
          f"{statistics.median(times) * 1e3:.1f} ms (median of {args.steps})")


if __name__ == "__main__":
    main()
