#!/usr/bin/env python3
"""Step time (forward + backward) of moec's MoeFFN against the plain PyTorch
layer (moec_torch.reference: rows sorted by expert once, one matmul pair per
expert on unbind slices), on the same inputs and parameters, with the same
threads, alternating the two in one process. Prints the median of each and
the speed-up as a ratio.

    examples/torch/bench.py [--config CFG] [--tokens S] [--ranks R]
                            [--dtypes fp32,bf16] [--threads N] [--repeat N]

Default: the qwen3-30b-a3b shapes (H 2048, I 768, E 128, top-8) with S = 1024
tokens per rank on 2 ranks, fp32 and bf16. examples/torch/bench.sh builds
what it needs first.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ops" / "torch"))
import moec_torch  # noqa: E402
from moec_torch import reference  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def step(fn, x, ids, weights, dy):
    """One forward + backward; returns seconds."""
    x = x.detach().requires_grad_()
    weights = weights.detach().requires_grad_()
    start = time.perf_counter()
    y = fn(x, ids, weights)
    y.backward(dy)
    return time.perf_counter() - start


def bench(cfg, ranks, dtype, threads, repeat):
    cfg = dict(cfg, dtype=dtype)
    layer = moec_torch.MoeFFN(cfg, ranks, threads=threads)
    S, H, E, K = layer.tokens, layer.hidden, layer.experts, layer.top_k
    g = torch.Generator().manual_seed(0)
    tdt = layer.w1.dtype
    x = (torch.rand(ranks, S, H, generator=g) * 2 - 1).to(tdt)
    dy = (torch.rand(ranks, S, H, generator=g) * 2 - 1).to(tdt)
    ids = torch.rand(ranks * S, E, generator=g).argsort(dim=1)[:, :K].reshape(ranks, S, K)
    weights = torch.rand(ranks, S, K, generator=g) * 0.8 + 0.2

    def plain(x, ids, weights):
        return reference.moe_ffn(x, ids, weights, layer.w1, layer.w2)

    times = {"moec": [], "torch": []}
    # One warm-up step each (workspace, page faults), then alternate.
    for name, fn in (("moec", layer), ("torch", plain)):
        layer.zero_grad(set_to_none=True)
        step(fn, x, ids, weights, dy)
    for _ in range(repeat):
        for name, fn in (("moec", layer), ("torch", plain)):
            layer.zero_grad(set_to_none=True)
            times[name].append(step(fn, x, ids, weights, dy))
    moec_s = statistics.median(times["moec"])
    torch_s = statistics.median(times["torch"])
    flops = 3 * 2 * ranks * S * K * (H * 2 * layer.inter + layer.inter * H)
    return moec_s, torch_s, flops


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "examples/configs/qwen3-30b-a3b.json"))
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank S")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="threads of both (torch.set_num_threads and moec workers)")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    cfg = json.loads(Path(args.config).read_text())
    cfg["seq_size"] = args.tokens
    torch.set_num_threads(args.threads)
    print(f"command: {' '.join([Path(sys.argv[0]).name] + sys.argv[1:])}")
    print(f"config {cfg.get('name', args.config)}: H {cfg['hidden_size']}, "
          f"I {cfg['intermediate_size']}, E {cfg['num_experts']}, top-{cfg['top_k']}, "
          f"S {args.tokens} per rank, {args.ranks} ranks, {args.threads} threads, "
          f"median of {args.repeat} steps (forward + backward)")
    print(f"{'dtype':6} {'moec s':>9} {'torch s':>9} {'moec GFLOP/s':>13} "
          f"{'torch GFLOP/s':>14} {'speed-up':>9}")
    for dtype in args.dtypes.split(","):
        moec_s, torch_s, flops = bench(cfg, args.ranks, dtype, args.threads, args.repeat)
        print(f"{dtype:6} {moec_s:9.3f} {torch_s:9.3f} {flops / moec_s / 1e9:13.1f} "
              f"{flops / torch_s / 1e9:14.1f} {torch_s / moec_s:8.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
