#!/usr/bin/env python3
"""Step time (forward + backward) of moec's MoeFFN against the plain PyTorch
layer (moec_torch.reference: rows sorted by expert once, one matmul pair per
expert on unbind slices), on the same inputs and parameters, with the same
threads, alternating the two in one process. Prints the median of each and
the speed-up as a ratio, and under each the range of the steps (fastest to
slowest): on a shared machine the median moves with the neighbours, and the
range says by how much it did in that run.

    examples/torch/bench.py [--config CFG] [--tokens S] [--ranks R]
                            [--dtypes fp32,bf16] [--threads N] [--repeat N]
                            [--training | --memory | --profile VARIANT |
                             --decode N,N,...]

Default: the qwen3-30b-a3b shapes (H 2048, I 768, E 128, top-8) with S = 1024
tokens per rank on 2 ranks, fp32 and bf16. examples/torch/bench.sh builds
what it needs first.

The baseline must be fair: before the comparison it prints PyTorch's own
GEMM rate on a 1024^3 product (one thread, and the library that serves it)
next to moec's GMM tile rate on the same product (`moec bench
--skip-layers`). Where PyTorch's rate is below half of moec's, it prints no
speed-up for that dtype, and says why (e.g. a reference BLAS as
libblas.so.3: install libopenblas0-pthread). The shares of the peak are of
moec's probe (`moec bench --skip-layers`: register-only FMA and bf16
dot-product chains): one core alone times the threads ("of peak"), and the
threads' cores all measuring at once ("of at once"), which is less where
the cores share a clock or power budget (under 90% of the threads x one
core alone, a warning says the cores are shared with other work now: a
VM's vCPUs on one physical core, a busy host; a healthy machine gives
95-105%, and a run's shares then say more about the machine than the
layer); beside them goes that command's independent check, the core's
clock times the flops a cycle its vendor documents. "ceiling" is the
largest share of the peak the machine's memory leaves the step: its
FLOPs at the peak over the time its base weights' bytes take at the rate
the threads' cores read memory together (`moec
bench`'s "memory read" line; weight_stream_bytes says which bytes), 100%
where the FLOPs take longer.

--memory measures moec's memory instead: for each dtype, in a process of
its own, the peak RSS of the process (ru_maxrss, the layer's making
included) over --repeat training steps, against the bytes the layer must
hold (weights, their gradients, x/y/dy, the saved rows X, Y and A), with
what else the process holds: its size before the layer was made, the
workspace and the kernels' scratch.

--training compares moec's training variants instead, in one run on the
same inputs and weights: the full layer, main_grad=True (weight gradients
accumulated into fp32 main_grad buffers), frozen=True (no weight
gradients), lora (LoRA adapters of rank 16 on w1 and w2, base frozen: the
adapters' gradients only), and split: moec_torch.Exchange's dispatch, the
experts in plain PyTorch (one matmul pair per expert on unbind slices), and
its combine. It prints each one's step time and backward pass time (moec's
passes), and their ratios to the full layer's: split's step ratio is what
fusing the layer saves; the range of its steps; and each step's share of
the peak ("of peak", as below), by the FLOPs of the base GMMs it runs:
three products of each weight where the step trains it (forward, dX, dW),
two where the base is frozen (a LoRA adapter's small products not
counted). frozen_<format>
and lora_<format> (not run by default) are the frozen and lora layers
with their base weights quantized (quantize_weights) to a weight format:
fp8 (FP8 e4m3 blocks, "fp8_block128"), int8, int4_g128, int4_g64_zp, ...
(moec_torch.quant).
Each dense variant has a "_packed" twin (frozen_packed, lora_packed, ...):
the same layer with pack_weights=True, which keeps its weights packed in
the GEMM tile's layout instead of packing the part each tile reads every
time ("_unpacked" says pack_weights=False, the default, explicitly), and
a "_packed_forward" one (pack_weights="forward": the forward pass's
weights packed, the backward's read as stored).

--decode N,N,... times forward calls of N tokens each instead, as a
generation step makes them (no gradients), on one rank that holds every
expert: moec's frozen layer, the same with pack_weights=True, and the
plain PyTorch layer on the same weights, alternating. With few tokens a
call reads the weights of the experts its tokens reach ("experts", "MB
read"), and the time goes to that: "moec GB/s" is those bytes over the
faster moec call, against the memory read rate `moec bench` measures.

--profile VARIANT prints where one variant's step goes instead: the layer
made with trace=True, two warm-up steps, then the third step's
MoeFFN.profile tables (per op its busy time, FLOPs or bytes and rate, per
worker busy and idle time, the host phases), forward and backward, for
each dtype of --dtypes.

Both run with glibc's malloc told to keep freed memory
(MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ 16 GiB, above any
tensor of the step, as a user tuning PyTorch's CPU training would set
them; without them PyTorch's backward maps and unmaps its large buffers
every step and pays their page faults, and on a VM the step after one
that unmapped such a buffer loses its cores to the host for a while: an
fp32 w1 gradient at qwen3's shapes is 1.6 GB): the script starts itself again
with them where they are not set, prints them, and warns where the mmap
threshold is set below the step's largest tensor.

Before each timed step every trained parameter gets an in-place write of
its own values (x * 1), as an optimizer step would: a layer that keeps its
weights packed (pack_weights=True) then packs its trained weights
again each step, as in training, and only its frozen ones once.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ops" / "torch"))
import moec_torch  # noqa: E402
from moec_torch import quant, reference  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def step(fn, x, ids, weights, dy):
    """One forward + backward; returns seconds."""
    x = x.detach().requires_grad_()
    weights = weights.detach().requires_grad_()
    start = time.perf_counter()
    y = fn(x, ids, weights)
    y.backward(dy)
    return time.perf_counter() - start


def optimizer_write(layer):
    """What an optimizer step does to the trained parameters, as far as the
    layer can tell: an in-place write (x * 1: the same values). A layer that
    keeps its weights packed (pack_weights) then packs the trained ones
    again at the next step, as it would in training."""
    with torch.no_grad():
        for p in layer.parameters():
            if p.requires_grad:
                p.mul_(1)


def make_inputs(layer, ranks):
    """x, topk_ids (uniform random), topk_weights, dy for `layer`."""
    S, H, E, K = layer.tokens, layer.hidden, layer.experts, layer.top_k
    g = torch.Generator().manual_seed(0)
    tdt = layer.dtype
    x = (torch.rand(ranks, S, H, generator=g) * 2 - 1).to(tdt)
    dy = (torch.rand(ranks, S, H, generator=g) * 2 - 1).to(tdt)
    ids = torch.rand(ranks * S, E, generator=g).argsort(dim=1)[:, :K].reshape(ranks, S, K)
    weights = torch.rand(ranks, S, K, generator=g) * 0.8 + 0.2
    return x, ids, weights, dy


def gmm_flops(layer, ranks, products):
    """FLOPs of `products` products of each of the layer's base weights
    (w1 [H, 2I], w2 [I, H]) over every rank's routed rows: 1 the forward, 2
    with dX (a frozen base), 3 with the weight gradients."""
    rows = ranks * layer.tokens * layer.top_k
    return products * 2 * rows * 3 * layer.hidden * layer.inter


def weight_stream_bytes(layer, trains=None):
    """Bytes of the base weights (w1, w2, and a quantized base's scales;
    every rank's) that a training step moves to and from memory at least:
    each read by the forward and again by the backward's dX, and where the
    step trains them (`trains`, default: w1 requires grad) their gradients
    written, or with main_grad the fp32 main_grad read and written. Not
    counted: a LoRA layer's adapters and the activations. So a lower bound
    on a step's memory traffic where the weights do not stay in the caches
    from one pass to the next, as at a real model's sizes."""
    base = [layer.w1, layer.w2]
    scales = [getattr(layer, n) for n in ("w1_scale", "w2_scale")
              if getattr(layer, n, None) is not None]
    moved = 2 * sum(t.numel() * t.element_size() for t in base + scales)
    if layer.w1.requires_grad if trains is None else trains:
        # (main_grad as the layer's flag: bench_training's layers share
        # their parameters, the main_grad buffers on them included.)
        moved += sum(w.numel() * (8 if getattr(layer, "main_grad", False) else w.element_size())
                     for w in base)
    return moved


def ceiling(flops, peak, moved, rate):
    """The share of the peak (FLOP/s) a step of `flops` can reach at most
    when it moves `moved` bytes at `rate` bytes a second: its FLOPs at the
    peak take flops / peak, its bytes moved / rate; 1 where the bytes take
    less. NaN without a rate."""
    if not rate or rate != rate:
        return float("nan")
    return min(1.0, (flops / peak) / (moved / rate))


def bench(cfg, ranks, dtype, threads, repeat, with_torch=True):
    """Median step seconds of moec and (with_torch) of the plain PyTorch
    layer, alternating; the step's FLOPs; every timed step of each, in
    seconds ({"moec": [...], "torch": [...]}); the bytes its weights move
    (weight_stream_bytes)."""
    cfg = dict(cfg, dtype=dtype)
    layer = moec_torch.MoeFFN(cfg, ranks, threads=threads)
    x, ids, weights, dy = make_inputs(layer, ranks)

    def plain(x, ids, weights):
        return reference.moe_ffn(x, ids, weights, layer.w1, layer.w2)

    runs = (("moec", layer), ("torch", plain)) if with_torch else (("moec", layer),)
    times = {"moec": [], "torch": []}
    # Two warm-up steps each (workspace, page faults), then alternate.
    for name, fn in runs * 2:
        layer.zero_grad(set_to_none=True)
        step(fn, x, ids, weights, dy)
    for _ in range(repeat):
        for name, fn in runs:
            layer.zero_grad(set_to_none=True)
            optimizer_write(layer)
            times[name].append(step(fn, x, ids, weights, dy))
    moec_s = statistics.median(times["moec"])
    torch_s = statistics.median(times["torch"]) if with_torch else float("nan")
    return moec_s, torch_s, gmm_flops(layer, ranks, 3), times, weight_stream_bytes(layer)


def bench_decode(cfg, dtype, threads, repeat, counts):
    """--decode: forward calls of a few tokens each, as a generation step
    makes, on one rank holding every expert: moec's frozen layer, the same
    with pack_weights=True, and the plain PyTorch layer on the same weights,
    alternating, under torch.no_grad(). Returns {N: (experts hit, expert
    bytes read, {name: median seconds}, {name: [seconds]})}."""
    cfg = dict(cfg, dtype=dtype, seq_size=max(counts))
    layer = moec_torch.MoeFFN(cfg, 1, threads=threads, frozen=True)
    packed = moec_torch.MoeFFN(cfg, 1, threads=threads, frozen=True, pack_weights=True)
    with torch.no_grad():
        packed.w1.copy_(layer.w1)
        packed.w2.copy_(layer.w2)
    E, H, K = layer.experts, layer.hidden, layer.top_k
    per_expert = (layer.w1[0].numel() + layer.w2[0].numel()) * layer.w1.element_size()

    def plain(x, ids, weights):
        return reference.moe_ffn(x, ids, weights, layer.w1, layer.w2)

    runs = (("moec", layer), ("moec packed", packed), ("torch", plain))
    out = {}
    g = torch.Generator().manual_seed(0)
    for n in counts:
        x = (torch.rand(1, n, H, generator=g) * 2 - 1).to(layer.dtype)
        ids = torch.rand(n, E, generator=g).argsort(dim=1)[:, :K].reshape(1, n, K)
        weights = torch.rand(1, n, K, generator=g) * 0.8 + 0.2
        times = {name: [] for name, _ in runs}
        with torch.no_grad():
            for _ in range(3):  # warm-up: workspace, page faults, packing
                for _, fn in runs:
                    fn(x, ids, weights)
            for _ in range(repeat):
                for name, fn in runs:
                    start = time.perf_counter()
                    fn(x, ids, weights)
                    times[name].append(time.perf_counter() - start)
        hit = int(ids.unique().numel())
        out[n] = (hit, hit * per_expert, {k: statistics.median(v) for k, v in times.items()},
                  times)
    return out


VARIANTS = {"full": {}, "main_grad": {"main_grad": True}, "frozen": {"frozen": True},
            "lora": {"lora_rank": 16, "lora_alpha": 32}, "peft_frozen": {}}

# Variants built to train whose weights are then frozen the PyTorch way
# (requires_grad_(False), as PEFT freezes a base model): the layer runs the
# frozen graphs from its first pass (docs/torch.md).
FROZEN_BY_REQUIRES_GRAD = ("peft_frozen",)


# The suffixes of a variant's name that set pack_weights.
PACKING = (("_packed", True), ("_packed_forward", "forward"), ("_unpacked", False))


def dense_variant(name):
    """(the dense variant, the pack_weights its suffix sets or None) of a
    name such as "lora_packed", or (None, None) for another name."""
    for suffix, pack in PACKING:
        if name.endswith(suffix) and name[:-len(suffix)] in VARIANTS:
            return name[:-len(suffix)], pack
    return (name, None) if name in VARIANTS else (None, None)


def variant_options(name):
    """MoeFFN's options of a dense variant, "lora", "lora_packed" (the same
    with pack_weights=True), "lora_packed_forward" (pack_weights="forward")
    or "lora_unpacked" (pack_weights=False), or None for another name."""
    base, pack = dense_variant(name)
    if base is None:
        return None
    return dict(VARIANTS[base], pack_weights=pack) if pack is not None else VARIANTS[base]


def quantized_variant(name):
    """(dense variant, weight format) of a quantized variant, "frozen_int8"
    or "lora_fp8" (fp8: "fp8_block128"), or None for another name. With
    _packed or _unpacked ("frozen_fp8_packed") the dense variant is that one
    (pack_weights=True or False, which the quantized layer keeps); without,
    the first frozen or lora variant listed."""
    suffix = next((x for x, _ in PACKING if name.endswith(x)), "")
    base, _, form = name[:len(name) - len(suffix)].partition("_")
    form = "fp8_block128" if form == "fp8" else form
    if base in ("frozen", "lora") and form in quant.WEIGHT_FORMATS:
        return base + suffix, form
    return None


def bench_training(cfg, ranks, dtype, threads, repeat, variants):
    """Median step and backward seconds of each training variant, run
    alternately on the same inputs and weights, the FLOPs of the base
    GMMs its step runs (gmm_flops: 3 products where it trains the base
    weights, else 2), its timed steps' seconds, and the bytes its base
    weights move (weight_stream_bytes; split's: the full layer's)."""
    cfg = dict(cfg, dtype=dtype)
    unknown = [v for v in variants if variant_options(v) is None and v != "split"
               and not quantized_variant(v)]
    if unknown:
        raise SystemExit(f"bench.py: unknown variants {unknown}; known: {list(VARIANTS)} (and "
                         f"each with _packed, _packed_forward or _unpacked: pack_weights=True, "
                         f"\"forward\" or False), split, "
                         f"frozen_<format> and lora_<format> for a format of "
                         f"{('fp8',) + quant.WEIGHT_FORMATS[1:]} (each also with _packed, "
                         f"_packed_forward or _unpacked: made from that variant)")
    # The same base weights in every variant, shared (one copy per
    # requires_grad): four copies of a large layer's weights and gradients
    # would not fit a small machine. LoRA's adapters stay its own.
    layers = {}
    dense = ["full"] + [v for v in variants if variant_options(v) is not None and v != "full"]
    for name, options in ((n, variant_options(n)) for n in dense):
        layer = moec_torch.MoeFFN(cfg, ranks, threads=threads, **options)
        if dense_variant(name)[0] in FROZEN_BY_REQUIRES_GRAD:
            layer.requires_grad_(False)
        donor = next((d for d in layers.values()
                      if d.w1.requires_grad == layer.w1.requires_grad), None)
        if donor is not None:
            for w in ("w1", "w2"):
                if hasattr(getattr(layer, w), "main_grad"):
                    getattr(donor, w).main_grad = getattr(layer, w).main_grad
                setattr(layer, w, getattr(donor, w))
        elif layers:
            with torch.no_grad():
                for w in ("w1", "w2"):
                    getattr(layer, w).copy_(getattr(layers["full"], w))
        layers[name] = layer
    for name in (v for v in variants if quantized_variant(v)):
        base, form = quantized_variant(name)
        donor = layers.get(base) if "_" in base else \
            next((layers[n] for n in layers if n.split("_")[0] == base), None)
        if donor is None:
            wanted = base if "_" in base else f"{base} (or {base}_packed)"
            raise SystemExit(f"bench.py: variant {name} needs {wanted} before it")
        layers[name] = donor.quantize_weights(form)
    x, ids, weights, dy = make_inputs(layers["full"], ranks)
    exchange = moec_torch.Exchange(cfg, ranks, threads=threads)
    full = layers["full"]

    def split(x, ids, weights):
        expert_x, counts, handle = exchange.dispatch(x, ids, weights)
        outs = []
        for rows, w1, w2 in zip(expert_x.split(counts.tolist()), full.w1.unbind(0),
                                full.w2.unbind(0)):
            h = rows @ w1
            outs.append((torch.nn.functional.silu(h[:, :full.inter]) * h[:, full.inter:]) @ w2)
        return exchange.combine(torch.cat(outs), handle)

    runs = dict(layers, split=split) if "split" in variants else dict(layers)
    steps = {name: [] for name in runs}
    backward = {name: [] for name in runs}
    for rep in range(repeat + 2):  # the first two rounds warm up
        for name, fn in runs.items():
            full.zero_grad(set_to_none=True)
            if name != "split":
                fn.zero_grad(set_to_none=True)
                optimizer_write(fn)
            seconds = step(fn, x, ids, weights, dy)
            if rep >= 2:
                steps[name].append(seconds)
                backward[name].append(sum(fn.times()["backward"]) if name != "split"
                                      else float("nan"))
    trains = {name: name == "split" or fn.w1.requires_grad for name, fn in runs.items()}
    return {name: (statistics.median(steps[name]), statistics.median(backward[name]),
                   gmm_flops(full, ranks, 3 if trains[name] else 2), steps[name],
                   weight_stream_bytes(full if name == "split" else runs[name], trains[name]))
            for name in runs}


def step_range(seconds):
    """'fastest-slowest' of step times in seconds, as the tables print
    them."""
    return f"{min(seconds):.3f}-{max(seconds):.3f}"


def variant_layer(cfg, ranks, threads, variant, flag, **extra):
    """The MoeFFN of `variant` (a dense variant, or frozen_<format> /
    lora_<format>: made quantized), with `extra` options; exits naming
    `flag` where `variant` is no variant."""
    base_variant, form = quantized_variant(variant) or (variant, None)
    options = variant_options(base_variant)
    if options is None:
        raise SystemExit(f"bench.py: {flag} {variant!r} is not a variant (see --variants)")
    try:
        return moec_torch.MoeFFN(cfg, ranks, threads=threads, weight_format=form, **options,
                                 **extra)
    except ValueError as e:  # the op's own message: what of the config does not fit
        raise SystemExit(f"bench.py: {flag} {variant}: {e}") from None


def profile_one(cfg, ranks, dtype, threads, variant):
    """Makes the layer of `variant` (as --memory-variant names one) with
    trace=True, runs two warm-up steps and one more, and prints that step's
    profile tables (MoeFFN.profile: per op its busy time and rate, per worker
    busy and idle, the host phases), forward then backward."""
    layer = variant_layer(dict(cfg, dtype=dtype), ranks, threads, variant, "--profile",
                          trace=True)
    x, ids, weights, dy = make_inputs(layer, ranks)
    for _ in range(3):
        layer.zero_grad(set_to_none=True)
        optimizer_write(layer)
        seconds = step(layer, x, ids, weights, dy)
    print(f"{dtype} {variant}: the third step {seconds:.3f} s (forward + backward)")
    for which in ("forward", "backward"):
        print(f"-- {which}")
        print(layer.profile(which), flush=True)


def rss_bytes(field="VmRSS"):
    """This process's resident memory now (VmRSS) or its peak (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def memory_one(cfg, ranks, dtype, threads, steps, variant="full"):
    """In this process: makes the layer of `variant` (full, frozen, lora, or
    frozen_<format> / lora_<format>: made quantized, an expert at a time),
    runs `steps` training steps and prints the peak RSS (ru_maxrss: the
    whole process, the layer's making included) against the bytes the layer
    must hold."""
    import resource
    moec_torch.load_library()
    base = rss_bytes()
    layer = variant_layer(dict(cfg, dtype=dtype), ranks, threads, variant, "--memory-variant")
    quantized = quantized_variant(variant) is not None
    x, ids, weights, dy = make_inputs(layer, ranks)
    for _ in range(steps):
        layer.zero_grad(set_to_none=True)
        step(layer, x, ids, weights, dy)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    size = x.element_size()
    stored = [layer.w1, layer.w2] + ([layer.w1_scale, layer.w2_scale] if quantized else [])
    weights_b = sum(t.numel() * t.element_size() for t in stored)
    grads_b = weights_b if layer.w1.requires_grad else 0
    adapters_b = 2 * sum(t.numel() * t.element_size() for t in layer.adapters())  # and grads
    rows = ranks * layer.tokens * layer.top_k
    saved = rows * (layer.hidden + 3 * layer.inter) * size  # X [T, H], Y [T, 2I], A [T, I]
    xydy = 3 * x.numel() * size
    need = weights_b + grads_b + adapters_b + xydy + saved
    info = layer.info()
    gib = 1 << 30
    print(f"{dtype:6} {variant}: peak RSS {peak / gib:6.2f} GiB; must hold {need / gib:6.2f} GiB "
          f"(weights {weights_b / gib:.2f}, gradients {grads_b / gib:.2f}, adapters and "
          f"theirs {adapters_b / gib:.3f}, x/y/dy {xydy / gib:.3f}, saved rows X/Y/A "
          f"{saved / gib:.3f}); ratio {peak / need:.2f}")
    print(f"       else held: the process before the layer (Python, torch, libraries) "
          f"{base / gib:.2f} GiB; workspace resident {info['workspace_resident'] / gib:.2f} GiB "
          f"(allocated {info['workspace_bytes'] / gib:.2f}; the saved rows are part of it); "
          f"kernel scratch {info['scratch_bytes'] / gib:.3f} GiB")
    print("\n".join("       " + line for line in layer.workspace().splitlines()), flush=True)


def openblas():
    """The OpenBLAS this process mapped, as a ctypes library, or None. Its
    pthread build keeps its own thread count, which torch.set_num_threads
    does not set."""
    import ctypes
    for path in blas_library().split(", "):
        if "openblas" in path:
            try:
                lib = ctypes.CDLL(path)
                lib.openblas_get_num_threads.restype = ctypes.c_int
                return lib
            except (OSError, AttributeError):
                return None
    return None


def torch_gemm_rate(dtype, n=1024, reps=5):
    """PyTorch's C = A B on n x n operands of `dtype`, one thread (OpenBLAS's
    own threads too): best GFLOP/s of `reps`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.rand(2, 2) @ torch.rand(2, 2)  # maps the BLAS
    blas = openblas()
    blas_threads = blas.openblas_get_num_threads() if blas else None
    if blas:
        blas.openblas_set_num_threads(1)
    try:
        a = torch.rand(n, n).to(dtype)
        b = torch.rand(n, n).to(dtype)
        a @ b
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
        if blas:
            blas.openblas_set_num_threads(blas_threads)
    return 2 * n ** 3 / best / 1e9


def blas_library():
    """The BLAS this process mapped for PyTorch's fp32 GEMM (libblas.so.3 is
    an alternative: the reference BLAS or OpenBLAS)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return "unknown"
    paths = sorted({line.split()[-1] for line in maps if "blas" in line.split()[-1]})
    return ", ".join(os.path.realpath(p) for p in paths) or "none mapped"


def moec_tile_rates(moec, threads):
    """moec's one-thread GMM tile rate on 1024^3, per dtype, and its probe's
    one-core peak per dtype (the bf16 dot-product peak where the CPU has
    one, else the fp32 FMA peak) and `threads` cores' at once, from `moec
    bench --skip-layers`."""
    out = subprocess.run([moec, "bench", "--skip-layers", "--no-progress", "--threads",
                          str(threads)], check=True, text=True, stdout=subprocess.PIPE).stdout
    check = re.search(r"^independent check: .*$", out, re.M)
    if check:
        CHECK.append(check.group(0))
    fp32 = re.search(r"fp32 FMA peak, one core: ([0-9.]+) GFLOP/s", out)
    bf16 = re.search(r"bf16 dot-product peak, one core: ([0-9.]+) GFLOP/s", out)
    if fp32:
        PEAKS["fp32"] = float(fp32.group(1))
        PEAKS["bf16"] = float(bf16.group(1)) if bf16 else PEAKS["fp32"]
    for name, dtype in (("fp32 FMA", "fp32"), ("bf16 dot-product", "bf16")):
        m = re.search(name + r" peak, \d+ cores at once: ([0-9.]+) GFLOP/s", out)
        if m:
            TOGETHER[dtype] = float(m.group(1))
    read = re.search(r"^memory read, (?:one core|\d+ cores at once): ([0-9.]+) GB/s", out, re.M)
    if read:
        MEMORY.append(float(read.group(1)) * 1e9)
    if "bf16" not in TOGETHER and "fp32" in TOGETHER and not bf16:
        TOGETHER["bf16"] = TOGETHER["fp32"]
    rates = {}
    for line in out.splitlines():
        m = re.match(r"\s*(f32|bf16)\s+1024 x 1024 x 1024\s+([0-9.]+)", line)
        if m:
            rates["fp32" if m.group(1) == "f32" else "bf16"] = float(m.group(2))
    return rates


PEAKS = {}  # dtype -> one core's peak GFLOP/s, set by moec_tile_rates
TOGETHER = {}  # dtype -> the threads' cores' peak GFLOP/s, all at once (threads > 1)
CHECK = []  # moec bench's independent check of those peaks (one core), if any
MEMORY = []  # bytes a second the threads' cores read from memory at once, if measured


def memory_rate():
    """What the threads' cores read from memory at once (moec bench), bytes
    a second; NaN where it was not measured."""
    return MEMORY[-1] if MEMORY else float("nan")


def fair_baseline(moec, threads):
    """Prints both GEMM rates; returns {dtype: reason} for each dtype whose
    PyTorch GEMM is under half of moec's tile rate (no speed-up then)."""
    torch_rates = {"fp32": torch_gemm_rate(torch.float32),
                   "bf16": torch_gemm_rate(torch.bfloat16)}
    moec_rates = moec_tile_rates(moec, threads)
    blas = blas_library()
    print(f"GEMM 1024^3, one thread, GFLOP/s: PyTorch fp32 {torch_rates['fp32']:.1f} "
          f"(BLAS: {blas}), bf16 {torch_rates['bf16']:.1f} (oneDNN); moec GMM tile fp32 "
          f"{moec_rates.get('fp32', float('nan')):.1f}, bf16 {moec_rates.get('bf16', float('nan')):.1f}")
    unfair = {}
    for dtype, rate in torch_rates.items():
        if dtype in moec_rates and rate < 0.5 * moec_rates[dtype]:
            why = (f"PyTorch's {dtype} GEMM runs at {rate:.1f} GFLOP/s, under half of moec's "
                   f"{moec_rates[dtype]:.1f}: ")
            if dtype == "fp32" and "openblas" not in blas:
                why += "PyTorch is using a reference BLAS; install libopenblas0 (libopenblas0-pthread)"
            else:
                why += "not a fair baseline on this machine"
            unfair[dtype] = why
    return unfair


def print_peaks(threads):
    """The peaks moec's probe measured: `threads` x one core alone, and the
    `threads` cores at once."""
    print(f"peak of {threads} cores (moec's probe): "
          + ", ".join(f"{d} {p * threads:.1f} GFLOP/s" for d, p in PEAKS.items())
          + ("" if PEAKS.get("bf16") != PEAKS.get("fp32") else
             " (no bf16 dot products: bf16 is judged against the fp32 peak)"))
    if TOGETHER:
        print(f"the {threads} cores at once: "
              + ", ".join(f"{d} {p:.1f} GFLOP/s" for d, p in TOGETHER.items()))
    warning = contention_warning(threads)
    if warning:
        print(warning, flush=True)
    if MEMORY:
        print(f"memory read, the {threads} cores at once (moec's probe): "
              f"{memory_rate() / 1e9:.1f} GB/s")
    for line in CHECK:
        print(f"{line} (one core)")


# Below this share of `threads` x one core alone, the cores at once are
# taken as shared with other work (a VM's vCPUs on one physical core, a
# busy host): a healthy machine measures 95-105%.
TOGETHER_HEALTHY = 0.9


def contention_warning(threads):
    """A line saying that the probe's `threads` cores at once ran under
    TOGETHER_HEALTHY of `threads` x one core alone (the lowest dtype's
    share), so that this run's shares of the peak and speed-ups say more
    about the machine than about the layer; None where they did not (or
    were not measured)."""
    shares = {d: TOGETHER[d] / (threads * PEAKS[d]) for d in TOGETHER
              if threads > 1 and PEAKS.get(d)}
    if not shares or min(shares.values()) >= TOGETHER_HEALTHY:
        return None
    dtype = min(shares, key=shares.get)
    return (f"warning: the {threads} cores at once ran {dtype} at {100 * shares[dtype]:.0f}% of "
            f"{threads} x one core alone (a healthy machine: 95-105%): they share a physical "
            "core or the host is busy, and this run's shares of the peak and speed-ups say "
            "more about the machine than the layer; measure again when it is quiet")


MALLOC_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": str(1 << 34), "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}


def malloc_warning(cfg, dtypes, env=os.environ):
    """A line saying that MALLOC_MMAP_THRESHOLD_ in `env` is below the
    step's largest tensor (the w1 gradient PyTorch's backward makes, E x H x
    2I of the widest of `dtypes`), which glibc then maps and unmaps every
    step; None where it is unset or not below. glibc reads the value's
    leading digits (none: 0), and so does this."""
    value = env.get("MALLOC_MMAP_THRESHOLD_")
    width = {d: torch.finfo(moec_torch._DTYPES[d]).bits // 8
             for d in dtypes if d in moec_torch._DTYPES}
    if value is None or not width:
        return None
    digits = re.match(r"\d*", value).group()
    threshold = int(digits or 0)
    widest = max(width, key=width.get)
    w1 = cfg["num_experts"] * cfg["hidden_size"] * 2 * cfg["intermediate_size"] * width[widest]
    if threshold >= w1:
        return None
    read = "" if digits == value else f" (glibc reads {value!r} as {threshold})"
    return (f"warning: MALLOC_MMAP_THRESHOLD_={threshold}{read} is below the step's largest "
            f"tensor (the {widest} w1 gradient, {w1 / 1e9:.2f} GB): PyTorch's backward maps and "
            "unmaps it every step, which slows its step and, on a VM, the step after it")


def with_malloc_settings():
    """Starts this script again with MALLOC_SETTINGS where any is unset
    (glibc reads them once, at the process's start); returns otherwise."""
    if all(k in os.environ for k in MALLOC_SETTINGS):
        return
    env = dict(os.environ)
    for k, v in MALLOC_SETTINGS.items():
        env.setdefault(k, v)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "examples/configs/qwen3-30b-a3b.json"))
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank S")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="threads of both (torch.set_num_threads and moec workers)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--moec", default=os.environ.get("MOEC_BIN", str(REPO / "bazel-bin/tools/moec")),
                   help="the moec CLI, for its GMM tile rate (default: $MOEC_BIN or bazel-bin)")
    p.add_argument("--variants", default="full,main_grad,frozen,lora,split",
                   help="with --training: the variants to compare (full always runs; each "
                        "variant holds its own layer, so fewer fit a smaller machine); also "
                        "frozen_<format> and lora_<format>, the frozen and lora layers with "
                        "their weights quantized: fp8, int8, int4_g128, int4_g64_zp, ...; "
                        "frozen_fp8_packed and the like: made from frozen_packed (kept packed); "
                        "peft_frozen: a layer built to train, its weights then frozen by "
                        "requires_grad_(False) as PEFT freezes a base model")
    p.add_argument("--memory", action="store_true",
                   help="measure moec alone: peak RSS of --repeat training steps (each dtype "
                        "in a process of its own) against the bytes the layer must hold, "
                        "and the workspace table")
    p.add_argument("--memory-one", help=argparse.SUPPRESS)
    p.add_argument("--memory-variant", default="full",
                   help="with --memory: the layer measured: full (the default), frozen, lora, "
                        "or frozen_<format> / lora_<format> (see --variants)")
    p.add_argument("--profile", metavar="VARIANT",
                   help="where one variant's step goes instead (full, frozen_packed, "
                        "lora_packed, frozen_int8, ...; see --variants): its third step's "
                        "profile tables, forward and backward, for each dtype")
    p.add_argument("--training", action="store_true",
                   help="compare moec's training variants (full, main_grad, frozen, lora, "
                        "split) instead")
    p.add_argument("--decode", metavar="N,N,...",
                   help="forward calls of N tokens each instead (generation's steps), on one "
                        "rank holding every expert, frozen: moec, moec with pack_weights, "
                        "PyTorch; --repeat calls each (default 20 here)")
    args = p.parse_args()
    with_malloc_settings()
    cfg = json.loads(Path(args.config).read_text())
    cfg["seq_size"] = args.tokens
    torch.set_num_threads(args.threads)
    if args.memory_one:
        memory_one(cfg, args.ranks, args.memory_one, args.threads, args.repeat,
                   args.memory_variant)
        return 0
    print(f"command: {' '.join([Path(sys.argv[0]).name] + sys.argv[1:])}")
    print("malloc: " + ", ".join(f"{k}={os.environ[k]}" for k in MALLOC_SETTINGS))
    warning = malloc_warning(cfg, args.dtypes.split(","))
    if warning:
        print(warning, file=sys.stderr)
    shapes = (f"config {cfg.get('name', args.config)}: H {cfg['hidden_size']}, "
              f"I {cfg['intermediate_size']}, E {cfg['num_experts']}, top-{cfg['top_k']}, ")
    print(shapes + (f"{args.threads} threads" if args.decode else
                    f"S {args.tokens} per rank, {args.ranks} ranks, {args.threads} threads, "
                    + ("the third step's profile" if args.profile else
                       f"median of {args.repeat} steps (forward + backward)")))
    if args.profile:
        for dtype in args.dtypes.split(","):
            profile_one(cfg, args.ranks, dtype, args.threads, args.profile)
        return 0
    if args.memory:
        for dtype in args.dtypes.split(","):
            rc = subprocess.run([sys.executable, sys.argv[0]] + sys.argv[1:] +
                                ["--memory-one", dtype]).returncode
            if rc:
                return rc  # the child said why
        return 0
    if args.decode:
        try:
            counts = [int(n) for n in args.decode.split(",")]
        except ValueError:
            counts = []
        if not counts or min(counts) < 1:
            p.error(f"--decode takes token counts (1,4,16), got {args.decode!r}")
        repeat = args.repeat if "--repeat" in sys.argv else 20
        fair_baseline(args.moec, args.threads)  # also measures the memory read rate
        print_peaks(args.threads)
        rate = memory_rate()
        print(f"decode: forward only, frozen, one rank holding all {cfg['num_experts']} "
              f"experts, median of {repeat} calls; memory read {rate / 1e9:.1f} GB/s")
        print(f"{'dtype':6} {'N':>5} {'experts':>8} {'MB read':>8} {'moec ms':>8} "
              f"{'packed ms':>10} {'torch ms':>9} {'speed-up':>9} {'moec GB/s':>10}")
        for dtype in args.dtypes.split(","):
            for n, (hit, moved, med, times) in bench_decode(cfg, dtype, args.threads, repeat,
                                                            counts).items():
                best = min(med["moec"], med["moec packed"])
                print(f"{dtype:6} {n:5d} {hit:8d} {moved / 1e6:8.1f} {med['moec'] * 1e3:8.2f} "
                      f"{med['moec packed'] * 1e3:10.2f} {med['torch'] * 1e3:9.2f} "
                      f"{med['torch'] / best:8.2f}x {moved / best / 1e9:10.1f}", flush=True)
        return 0
    if args.training:
        fair_baseline(args.moec, args.threads)  # the GEMM rate of split's PyTorch experts
        print_peaks(args.threads)
        # The variant column as wide as the longest name asked for.
        width = max([18] + [len(v) for v in args.variants.split(",")])
        print(f"{'dtype':6} {'variant':{width}} {'step s':>8} {'step / full':>12} "
              f"{'of peak':>8} {'ceiling':>8} {'backward s':>11} {'backward / full':>16} "
              f"{'steps s':>13}")
        for dtype in args.dtypes.split(","):
            result = bench_training(cfg, args.ranks, dtype, args.threads, args.repeat,
                                    args.variants.split(","))
            full_step, full_backward, _, _, _ = result["full"]
            peak = PEAKS.get(dtype, float("nan")) * args.threads * 1e9
            for name, (step_s, backward_s, flops, steps, moved) in result.items():
                print(f"{dtype:6} {name:{width}} {step_s:8.3f} {step_s / full_step:12.2f} "
                      f"{100 * flops / step_s / peak:7.1f}% "
                      f"{100 * ceiling(flops, peak, moved, memory_rate()):7.1f}% "
                      f"{backward_s:11.3f} {backward_s / full_backward:16.2f} "
                      f"{step_range(steps):>13}", flush=True)
        return 0
    unfair = fair_baseline(args.moec, args.threads)
    print_peaks(args.threads)
    print(f"{'dtype':6} {'moec s':>9} {'torch s':>9} {'moec GFLOP/s':>13} {'of peak':>8} "
          f"{'ceiling':>8} {'of at once':>11} {'torch GFLOP/s':>14} {'speed-up':>9}")
    for dtype in args.dtypes.split(","):
        # An unfair baseline is not timed (PyTorch's bf16 on a CPU without
        # bf16 dot products takes minutes a step).
        moec_s, torch_s, flops, steps, moved = bench(cfg, args.ranks, dtype, args.threads,
                                                     args.repeat, with_torch=dtype not in unfair)
        ratio = "  refused" if dtype in unfair else f"{torch_s / moec_s:8.2f}x"
        peak = PEAKS.get(dtype, float("nan")) * args.threads * 1e9
        together = TOGETHER.get(dtype, PEAKS.get(dtype, float("nan")) * args.threads) * 1e9
        print(f"{dtype:6} {moec_s:9.3f} {torch_s:9.3f} {flops / moec_s / 1e9:13.1f} "
              f"{100 * flops / moec_s / peak:7.1f}% "
              f"{100 * ceiling(flops, peak, moved, memory_rate()):7.1f}% "
              f"{100 * flops / moec_s / together:10.1f}% "
              f"{flops / torch_s / 1e9:14.1f} {ratio}", flush=True)
        print(f"{'':6} steps s: moec {step_range(steps['moec'])}"
              + (f", torch {step_range(steps['torch'])}" if steps["torch"] else ""), flush=True)
    for dtype, why in unfair.items():
        print(f"no {dtype} speed-up: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
