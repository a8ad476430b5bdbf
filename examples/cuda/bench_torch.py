#!/usr/bin/env python3
"""PyTorch's side of the cuda backend's benchmark (examples/cuda/bench.sh):

  bench_torch.py gmm [[G*]MxNxK[:ab] ...]
      cuBLAS (torch.matmul, torch.bmm for G products; bf16 in and out) on
      the same products as `cuda_bench gmm`: TFLOP/s.
  bench_torch.py layer --ranks R --tokens S [--config CFG] [--repeat N]
      the layer's step (forward + backward) in PyTorch eager on the GPU, on
      R * S tokens: moec_torch.reference.moe_ffn (rows sorted by expert
      once, one matmul pair per expert on unbind slices), bf16, uniform
      routing: median seconds.

Needs a CUDA PyTorch; it reads ops/torch/moec_torch/reference.py directly,
so the moec torch op need not be built.
"""

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def reference():
    path = REPO / "ops" / "torch" / "moec_torch" / "reference.py"
    spec = importlib.util.spec_from_file_location("moec_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(fn, repeat):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


DEFAULT_PRODUCTS = [
    "4096x4096x4096", "8192x8192x8192", "128*512x1536x2048", "128*512x2048x768",
    "128*512x2048x1536:nt", "128*2048x1536x512:tn", "128*2048x1536x2048", "128*2048x2048x768",
    "128*2048x2048x1536:nt", "128*2048x1536x2048:tn",
]


def parse_product(text):
    """[G*]MxNxK[:ab] as cuda_bench gmm reads it: (G, M, N, K, a, b)."""
    shape, _, layout = text.partition(":")
    layout = layout or "nn"
    groups, _, mnk = shape.rpartition("*")
    try:
        g = int(groups or 1)
        m, n, k = (int(v) for v in mnk.split("x"))
    except ValueError:
        g = m = n = k = 0
    if min(g, m, n, k) < 1 or len(layout) != 2 or set(layout) - {"n", "t"}:
        raise SystemExit(f"bench_torch.py: '{text}' is no product: give [G*]MxNxK[:ab], "
                         "a and b n or t")
    return g, m, n, k, layout[0] == "t", layout[1] == "t"


def timed_events(fn, repeat):
    """Median of `repeat` calls, each timed by CUDA events, after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times)


def gmm(products):
    """cuBLAS on the products: torch.bmm for G of them (strided batched), torch.matmul for one;
    a transposed operand is a transposed view of its storage, as cuBLAS reads it."""
    print(f"{'G*MxNxK:ab (bf16)':26s} {'ms':>10s} {'TFLOP/s':>10s}")
    for text in products or DEFAULT_PRODUCTS:
        g, m, n, k, ta, tb = parse_product(text)
        def operand(rows, cols, transposed):
            stored = (rows, cols) if not transposed else (cols, rows)
            x = (torch.rand(g, *stored, device="cuda") * 2 - 1).to(torch.bfloat16)
            return x.transpose(1, 2) if transposed else x

        a, b = operand(m, k, ta), operand(k, n, tb)
        fn = (lambda: torch.matmul(a[0], b[0])) if g == 1 else (lambda: torch.bmm(a, b))
        seconds = timed_events(fn, 20)
        print(f"{text:26s} {seconds * 1e3:10.3f} {2 * g * m * n * k / seconds / 1e12:10.1f}")
        del a, b


def layer(args):
    cfg = json.loads(Path(args.config).read_text())
    H, I, E, K = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_experts"], cfg["top_k"]
    T = args.ranks * args.tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    x = (torch.rand(T, H, device="cuda", generator=g) * 2 - 1).to(dt)
    dy = (torch.rand(T, H, device="cuda", generator=g) * 2 - 1).to(dt)
    ids = torch.rand(T, E, device="cuda", generator=g).argsort(dim=1)[:, :K]
    weights = torch.rand(T, K, device="cuda", generator=g) * 0.8 + 0.2
    w1 = (torch.randn(E, H, 2 * I, device="cuda", generator=g) / H ** 0.5).to(dt).requires_grad_()
    w2 = (torch.randn(E, I, H, device="cuda", generator=g) / I ** 0.5).to(dt).requires_grad_()
    ref = reference()

    def step():
        xs = x.detach().requires_grad_()
        ws = weights.detach().requires_grad_()
        w1.grad = None
        w2.grad = None
        y = ref.moe_ffn(xs, ids, ws, w1, w2)
        y.backward(dy.to(y.dtype))

    seconds = timed(step, args.repeat)
    flops = 3 * 2 * T * K * (H * 2 * I + I * H)
    print(f"PyTorch {torch.__version__} eager step (fwd+bwd) on {torch.cuda.get_device_name()}: "
          f"median {seconds * 1e3:.3f} ms over {args.repeat} ({flops / seconds / 1e12:.1f} TFLOP/s); "
          f"{T} tokens, H {H}, I {I}, E {E}, K {K}, bf16")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["gmm", "layer"])
    parser.add_argument("shapes", nargs="*", help="gmm: products, [G*]MxNxK[:ab]")
    parser.add_argument("--config", default=str(REPO / "examples/configs/qwen3-30b-a3b.json"))
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    if args.mode == "gmm":
        gmm(args.shapes)
    else:
        layer(args)


if __name__ == "__main__":
    main()
