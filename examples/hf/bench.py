"""A LoRA training step of a Qwen3-MoE-structured model at qwen3-30b-a3b's MoE
shapes (H 2048, expert I 768, 128 experts, top-8), patched with moec against
the same model unpatched with PEFT's LoRA in plain PyTorch, same threads.

    bench.py [--layers 2] [--tokens 2048] [--threads 2] [--steps 3]   # step times, side by side
    bench.py --memory                                                  # peak RSS of each, alone
    bench.py --memory --layout fused      # moec's model with transformers v5's fused experts
    bench.py --layouts                    # moec's model, per-expert modules against fused

The model is moec_torch.hf_models' stand-in of Qwen3MoeForCausalLM (its MoE
blocks are transformers v4's: the per-expert loop; attention simplified),
in bf16, with a small vocabulary so that the MoE blocks dominate. LoRA (r 16,
alpha 32) on every expert's gate_proj, up_proj and down_proj; the rest
frozen, as PEFT freezes it. A step is forward, cross-entropy, backward and
AdamW on the adapters; each variant's step is timed after two warm-up
steps, the two variants alternating in one process. --memory runs each
variant alone in a process of its own and reports its peak RSS once the
model is made (and patched), and after two steps, beside the bytes of the
model's parameters.

--layout fused builds moec's model with transformers v5's fused experts
(gate_up_proj [E, 2I, H], down_proj [E, H, I]), which the LoRA layer reads
in place; the PyTorch variant keeps the per-expert modules PEFT's LoRA
targets (the same weights and math).
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ops/torch"))
import moec_torch  # noqa: E402
import moec_torch.hf as mhf  # noqa: E402
from moec_torch import hf_lora, hf_models  # noqa: E402

TARGETS = r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(?:gate_proj|up_proj|down_proj)$"


def make(args, variant, layout=None):
    torch.manual_seed(0)
    config = hf_models.config_from_dict(dict(
        model_type="qwen3_moe", vocab_size=args.vocab, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=args.layers,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        experts_layout=(layout or args.layout) if variant == "moec" else "modules"))
    torch.set_default_dtype(torch.bfloat16)  # made in bf16, as from_pretrained(torch_dtype=)
    try:
        model = hf_models.model_from_config(config)
    finally:
        torch.set_default_dtype(torch.float32)
    if variant == "moec":
        mhf.patch_model(model, ranks=args.ranks, threads=args.threads, lora_rank=16,
                        lora_alpha=32, tokens_per_rank=args.tokens // args.ranks)
        for p in model.parameters():
            p.requires_grad_(False)
        params = [p for _, _, ex in mhf._patched(model) for p in ex.layer.adapters()]
        for p in params:
            p.requires_grad_(True)
    else:
        hf_lora.add_lora(model, TARGETS, 16, 32)
        params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-4)


def step(model, opt, ids, labels):
    t0 = time.perf_counter()
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             labels.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def data(args):
    g = torch.Generator().manual_seed(1)
    seq = args.tokens // args.batch
    ids = torch.randint(0, args.vocab, (args.batch, seq), generator=g)
    return ids, torch.randint(0, args.vocab, (args.batch, seq), generator=g)


def side_by_side(args):
    ids, labels = data(args)
    if args.layouts:
        variants = {f"moec {layout}": make(args, "moec", layout)
                    for layout in ("modules", "fused")}
    else:
        variants = {v: make(args, v) for v in ("moec", "pytorch")}
    times = {v: [] for v in variants}
    for i in range(args.steps + 2):
        for v, (model, opt) in variants.items():
            t = step(model, opt, ids, labels)
            if i >= 2:
                times[v].append(t)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")
    print(f"{cpu}, {os.cpu_count()} cores; threads {args.threads}; {args.layers} layers, "
          f"{args.tokens} tokens, bf16, LoRA r 16 on 128 experts x 3 projections a layer; "
          f"moec's experts {'modules, fused' if args.layouts else args.layout}")
    med = {v: statistics.median(t) for v, t in times.items()}
    for v, t in times.items():
        print(f"{v:12s} step {med[v]:.3f} s  (median of {len(t)}: "
              f"{', '.join(f'{x:.3f}' for x in t)})")
    if args.layouts:
        print(f"fused / modules: {med['moec fused'] / med['moec modules']:.3f}")
    else:
        print(f"speed-up: {med['pytorch'] / med['moec']:.2f}x")


def peak_rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def alone(args):
    model, opt = make(args, args.variant)
    made = peak_rss()
    ids, labels = data(args)
    for _ in range(2):
        step(model, opt, ids, labels)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"{args.variant} {made} {peak_rss()} {held}")


def memory(args):
    print(f"moec's experts: {args.layout}")
    print(f"{'variant':8s} {'peak RSS made, GB':>18s} {'after 2 steps, GB':>18s} "
          f"{'parameters, GB':>15s}")
    for v in ("moec", "pytorch"):
        out = subprocess.run([sys.executable, __file__, "--variant", v, *sys.argv[1:]],
                             capture_output=True, text=True, check=True).stdout.split()
        made, peak, held = (int(x) / 1e9 for x in out[1:4])
        print(f"{v:8s} {made:18.2f} {peak:18.2f} {held:15.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2, help="sequences (tokens / batch each)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--ranks", type=int, default=2, help="moec's in-process EP ranks")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--memory", action="store_true")
    p.add_argument("--layout", choices=["modules", "fused"], default="modules",
                   help="moec's model's experts: per-expert modules (v4) or fused (v5)")
    p.add_argument("--layouts", action="store_true",
                   help="time moec's model with both layouts instead of against PyTorch")
    p.add_argument("--variant", choices=["moec", "pytorch"], help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.variant:
        alone(args)
    elif args.memory:
        memory(args)
    else:
        side_by_side(args)


if __name__ == "__main__":
    main()
