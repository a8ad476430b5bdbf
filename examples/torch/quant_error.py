#!/usr/bin/env python3
"""The error each frozen-weight format adds, against the unquantized weights.

A frozen layer at a real model's hidden and intermediate sizes (qwen3-30b-a3b
by default: H 2048, I 768), with fewer experts and tokens so that it runs in
seconds, gets weights with the statistics of trained LLM weights rather than
a uniform draw: heavy-tailed values (Student's t, 5 degrees of freedom),
rows and columns of different scales (log-normal, sigma 0.3) and a few
outlier input channels (0.5% of the columns, 8x larger), the features that
make per-tensor quantization fail and per-block, per-channel and per-group
scales work. For each format it prints:

  weight   relative RMS error of the dequantized w1 and w2 against the
           originals;
  y, dx    relative RMS error of the layer's output and input gradient
           (moec, the format's layer) against PyTorch autograd in float64
           on the original weights, with the dense layer of the same dtype
           as the first row: the error of the dtype alone.

    python3 examples/torch/quant_error.py [--config PATH] [--dtype bf16|fp32]
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "ops/torch"))

import moec_torch  # noqa: E402
from moec_torch import quant, reference  # noqa: E402

FORMATS = ["fp8_block128", "int8", "int4_g128", "int4_g128_zp", "int4_g64", "int4_g32"]


def realistic(shape, g):
    """[E, out, in] weights with heavy tails, row and column scales and
    outlier input channels, RMS 1 / sqrt(in)."""
    e, rows, cols = shape
    t = torch.distributions.StudentT(5.0)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
    w = t.sample(shape)
    w *= torch.exp(0.3 * torch.randn(e, rows, 1, generator=g))
    w *= torch.exp(0.3 * torch.randn(e, 1, cols, generator=g))
    outliers = torch.randperm(cols, generator=g)[:max(1, cols // 200)]
    w[:, :, outliers] *= 8
    return w / w.pow(2).mean().sqrt() / cols ** 0.5


def rms_rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(REPO / "examples/configs/qwen3-30b-a3b.json"))
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--experts", type=int, default=8, help="experts E (2 ranks)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank S")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
    cfg = json.loads(Path(args.config).read_text())
    cfg.update(num_experts=args.experts, seq_size=args.tokens, dtype=args.dtype, ep=2)
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    g = torch.Generator().manual_seed(0)
    # The original weights, [out, in] as stored: w1 [E, 2I, H], w2 [E, H, I].
    w1, w2 = realistic((args.experts, 2 * I, H), g), realistic((args.experts, H, I), g)
    dense = moec_torch.MoeFFN(cfg, 2, threads=args.threads, frozen=True,
                              weights_transposed=True, init_weights=False)
    dt = dense.dtype
    with torch.no_grad():
        dense.w1.copy_(w1)
        dense.w2.copy_(w2)
    x = (torch.randn(2, args.tokens, H, generator=g) * 0.5).to(dt)
    dy = torch.randn(2, args.tokens, H, generator=g).to(dt)
    ids = torch.rand(2 * args.tokens, args.experts, generator=g).argsort(1)[:, :cfg["top_k"]]
    ids = ids.reshape(2, args.tokens, -1)
    weights = torch.rand(2, args.tokens, cfg["top_k"], generator=g) * 0.8 + 0.2

    xd = x.double().requires_grad_()
    want = reference.moe_ffn(xd, ids, weights.double(), w1.transpose(1, 2).double(),
                             w2.transpose(1, 2).double())
    want.backward(dy.double())

    print(f"config {cfg.get('name', args.config)}: H {H}, I {I}, E {args.experts}, top-"
          f"{cfg['top_k']}, S {args.tokens} x 2 ranks, {args.dtype}; weights: Student-t(5), "
          "log-normal row and column scales, 0.5% outlier input channels x8")
    print(f"{'format':14} {'bytes/bf16':>10} {'w1 err':>9} {'w2 err':>9} {'y err':>9} "
          f"{'dx err':>9}")
    bf16_bytes = 2 * (w1.numel() + w2.numel())
    for name in [None] + FORMATS:
        layer = dense if name is None else dense.quantize_weights(name)
        stored = sum(t.numel() * t.element_size() for t in
                     [layer.w1, layer.w2] + ([layer.w1_scale, layer.w2_scale] if name else []))
        got1, got2 = layer.dequantized_weights()
        xs = x.clone().requires_grad_()
        y = layer(xs, ids, weights)
        y.backward(dy)
        print(f"{name or 'dense ' + args.dtype:14} {stored / bf16_bytes:10.3f} "
              f"{rms_rel(got1, w1):9.2e} {rms_rel(got2, w2):9.2e} {rms_rel(y, want):9.2e} "
              f"{rms_rel(xs.grad, xd.grad):9.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
