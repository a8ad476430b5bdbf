#!/usr/bin/python3
"""How the cost of a training step (forward + backward) grows: moec's step
time and GFLOP/s against tokens per rank S, against experts E at a fixed
number of routed rows, and against ranks (in-process and MPI), each point a
`moec compile` of the forward and backward graphs and a `moec run --random`
(best of --repeat). Writes a CSV and, with matplotlib, a PNG of two rows
of panels (step time; GFLOP/s).

    examples/scaling/scaling.py [--moec BIN] [--threads N] [--repeat N]
                                [--csv FILE] [--png FILE] [--sweeps tokens,experts,ranks]

The layer: H 1024, I 512, top-4, E 32 unless swept, fp32, 2 ranks unless
swept. FLOPs of a step: 18 * rows * H * I for the rows routed (R S K), the
six GEMMs of forward and backward. Ranks are weak scaling: S per rank is
fixed, so the work grows with R; with more ranks than cores, the ranks
share the cores (--threads in all).
"""

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BASE = {"name": "scaling", "hidden_size": 1024, "intermediate_size": 512, "num_experts": 32,
        "top_k": 4, "ep": 2, "tp": 1, "seq_size": 2048, "dtype": "fp32"}
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def checked(command, env=None):
    """Runs `command`; returns its stdout, or raises with its output."""
    done = subprocess.run(command, text=True, capture_output=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n"
                           f"{done.stdout}{done.stderr}")
    return done.stdout


def run_point(moec, tmp, cfg, threads, repeat, mpi=False):
    """Compiles and runs one layer; returns the best forward + backward
    seconds."""
    path = Path(tmp) / "cfg.json"
    path.write_text(json.dumps(cfg))
    binaries = []
    for graph in ("moe_ffn_fwd", "moe_ffn_bwd"):
        out = Path(tmp) / f"{graph}.moebin"
        checked([moec, "compile", str(REPO / "graphs" / f"{graph}.json"), "--config", str(path),
                 "-o", str(out)])
        binaries.append(str(out))
    ranks = cfg["ep"]
    command = [moec, "run", *binaries, "--random", "1", "--outputs", str(Path(tmp) / "out"),
               "--repeat", str(repeat), "--no-progress"]
    if mpi:
        per = max(1, threads // ranks)
        command = ["mpirun", "-np", str(ranks), "--oversubscribe", "--bind-to", "none",
                   *command, "--threads", str(per)]
    else:
        command += ["--ranks", str(ranks), "--threads", str(threads)]
    env = dict(os.environ, **(MPI_ENV if mpi else {}))
    out = checked(command, env)
    times = dict(re.findall(r"^\s+(forward|backward)\s+([0-9.]+) ms", out, re.M))
    if set(times) != {"forward", "backward"}:
        raise RuntimeError(f"no pass times in the output of {' '.join(command)}:\n{out}")
    return (float(times["forward"]) + float(times["backward"])) / 1e3


def points(sweeps):
    if "tokens" in sweeps:
        for s in (128, 256, 512, 1024, 2048, 4096, 8192):
            yield "tokens", s, dict(BASE, seq_size=s), False
    if "experts" in sweeps:
        for e in (8, 16, 32, 64, 128, 256):
            yield "experts", e, dict(BASE, num_experts=e), False
    if "ranks" in sweeps:
        for mpi in (False, True):
            for r in (1, 2, 4):
                yield "ranks-mpi" if mpi else "ranks-inproc", r, dict(BASE, ep=r), mpi


def fma_peak(moec):
    """One core's fp32 FMA peak in GFLOP/s, from `moec bench --skip-layers`,
    and the CPU's name."""
    out = checked([moec, "bench", "--skip-layers", "--no-progress"])
    peak = re.search(r"fp32 FMA peak, one core: ([0-9.]+) GFLOP/s", out)
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return (float(peak.group(1)) if peak else None), cpu


def plot(rows, png, peak, cores, cpu):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sweeps = [("tokens", "tokens per rank S (2 ranks, E 32)", True),
              ("experts", "experts E (2 ranks, S 2048: 16384 routed rows)", True),
              ("ranks", "ranks (S 2048 per rank, E 32)", False)]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for col, (name, label, log) in enumerate(sweeps):
        for kind in ([name] if name != "ranks" else ["ranks-inproc", "ranks-mpi"]):
            pts = [r for r in rows if r["sweep"] == kind]
            if not pts:
                continue
            xs = [int(r["x"]) for r in pts]
            tag = {"ranks-inproc": "in-process", "ranks-mpi": "MPI"}.get(kind, "moec")
            axes[0][col].plot(xs, [float(r["step_s"]) for r in pts], "o-", label=tag)
            axes[1][col].plot(xs, [float(r["gflops"]) for r in pts], "o-", label=tag)
            if name == "tokens":
                # Linear in the routed rows: the time of the largest point,
                # scaled down.
                last = pts[-1]
                axes[0][col].plot(xs, [float(last["step_s"]) * x / int(last["x"]) for x in xs],
                                  "--", color="gray", label="linear in rows")
        for row in (0, 1):
            ax = axes[row][col]
            ax.set_xlabel(label)
            if log:
                ax.set_xscale("log", base=2)
            else:
                ax.set_xticks([1, 2, 4])
            ax.grid(True, alpha=0.3)
        axes[0][col].set_ylabel("step time, s (forward + backward)")
        axes[1][col].set_ylabel("GFLOP/s")
        if peak:
            axes[1][col].axhline(peak * cores, color="red", linestyle=":",
                                 label=f"fp32 FMA peak, {cores} cores ({peak * cores:.0f})")
        axes[1][col].set_ylim(bottom=0)
        for row in (0, 1):
            axes[row][col].legend()
        if name == "tokens":
            axes[0][col].set_yscale("log", base=2)
    fig.suptitle(f"moec training step, H 1024, I 512, top-4, fp32; {cpu}, {cores} cores")
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--moec", default=str(REPO / "bazel-bin/tools/moec"))
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--csv", default="scaling.csv")
    p.add_argument("--png", default="scaling.png")
    p.add_argument("--sweeps", default="tokens,experts,ranks")
    args = p.parse_args()
    rows = []
    peak, cpu = fma_peak(args.moec)
    cores = os.cpu_count()
    print(f"{cpu}, {cores} cores; fp32 FMA peak {peak} GFLOP/s per core; "
          f"{args.threads} threads", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for sweep, x, cfg, mpi in points(args.sweeps.split(",")):
            seconds = run_point(args.moec, tmp, cfg, args.threads, args.repeat, mpi)
            routed = cfg["ep"] * cfg["seq_size"] * cfg["top_k"]
            flops = 18 * routed * cfg["hidden_size"] * cfg["intermediate_size"]
            row = {"sweep": sweep, "x": x, "ranks": cfg["ep"], "tokens": cfg["seq_size"],
                   "experts": cfg["num_experts"], "routed_rows": routed,
                   "step_s": f"{seconds:.4f}", "gflops": f"{flops / seconds / 1e9:.1f}"}
            rows.append(row)
            print(f"{sweep:13} {x:5}  routed rows {routed:6}  step {seconds * 1e3:9.1f} ms  "
                  f"{flops / seconds / 1e9:7.1f} GFLOP/s", flush=True)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    try:
        plot(rows, args.png, peak, cores, cpu)
        print(f"wrote {args.csv} and {args.png}")
    except ImportError:
        print(f"wrote {args.csv}; no plot: matplotlib is missing (python3-matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
