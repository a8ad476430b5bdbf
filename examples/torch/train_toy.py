#!/usr/bin/env python3
"""Trains a toy model with a moec MoE-FFN layer on a synthetic task and prints
the loss as it falls.

The task: inputs come from C clusters; each cluster has its own random
two-layer map to the target. The model is an input projection, a learned
top-k router (softmax over experts, top-k weights renormalised), the moec
MoeFFN layer on an EP group of R ranks in this process, and an output
projection. The router learns through the top-k weights' gradient, the
experts through dw1 and dw2, both from moec's backward pass.

    examples/torch/train_toy.py [--steps N] [--ranks R] [--dtype fp32|bf16]
                                [--threads N] [--seed S]

Run from a checkout after `bazel build //tools:moec //ops/torch:moec_torch.so`
(examples/torch/train_toy.sh does both). Exits 1 if the loss did not fall to
under half its first value.
"""

import argparse
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
    def __init__(self, ranks, dtype, features, threads):
        super().__init__()
        self.moe = moec_torch.MoeFFN(toy_config(ranks, dtype), ranks, threads=threads)
        hidden, experts = self.moe.hidden, self.moe.experts
        self.dtype = self.moe.w1.dtype
        self.inp = torch.nn.Linear(features, hidden)
        self.router = torch.nn.Linear(hidden, experts)
        self.out = torch.nn.Linear(hidden, features)

    def forward(self, x):
        """x [R, S, F] -> [R, S, F]."""
        h = self.inp(x)
        probs = torch.softmax(self.router(h), dim=-1)
        weights, ids = probs.topk(self.moe.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        y = self.moe(h.to(self.dtype), ids, weights).float()
        return self.out(h + y)


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


def train(steps=150, ranks=2, dtype="fp32", threads=0, seed=0, log_every=10, out=print):
    """Trains and returns the losses, one per step."""
    torch.manual_seed(seed)
    features = 16
    model = ToyModel(ranks, dtype, features, threads)
    batch = make_task(features, clusters=8, seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        x, target = batch((ranks, model.moe.tokens))
        loss = torch.nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % log_every == 0 or step == steps - 1:
            out(f"step {step:4d}  loss {losses[-1]:.4f}")
    out(f"{steps} steps in {time.perf_counter() - start:.2f} s "
        f"({model.moe.ranks} ranks, {model.moe.experts} experts, top-{model.moe.top_k}, "
        f"{model.moe.w1.dtype})")
    return losses


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--threads", type=int, default=0, help="runtime workers (0: all)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    losses = train(args.steps, args.ranks, args.dtype, args.threads, args.seed)
    first, last = losses[0], sum(losses[-5:]) / len(losses[-5:])
    print(f"loss {first:.4f} -> {last:.4f} (mean of the last 5 steps)")
    if not last < 0.5 * first:
        print("train_toy: the loss did not fall to under half its first value", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
