#!/usr/bin/env bash
# How a layer's schedule holds as the expert-parallel degree grows: the
# forward and backward graphs compiled for CONFIG with only `ep` changed, on
# TARGET, and for each degree the tasks, the compile time (in process), the
# scheduler's estimated makespan and the timed simulation's (with the shared
# link, as `moec dump` reports it), its ratio to the best degree's and the
# critical path's share of it.
#
#   scripts/bench-ep.sh [CONFIG] [TARGET] [GRAPH_DIR] [EP ...]
#
# Defaults: examples/configs/deepseek-v3.json, ascend-910b, graphs (the
# shipped graphs, automatic splits; graphs/seed for the seed's hand-set
# ones), EP 8 16 32 64 128 256.
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
config="${1:-examples/configs/deepseek-v3.json}"
target="${2:-ascend-910b}"
graphs="${3:-graphs}"
shift $(( $# < 3 ? $# : 3 ))
eps=("$@")
[ ${#eps[@]} -gt 0 ] || eps=(8 16 32 64 128 256)
bazel build //tools:moec >/dev/null 2>&1 || bazel build //tools:moec
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 - "$PWD/bazel-bin/tools/moec" "$config" "$target" "$graphs" "$work" "${eps[@]}" <<'PY'
import json, subprocess, sys
moec, config, target, graphs, work = sys.argv[1:6]
eps = [int(e) for e in sys.argv[6:]]
print(f"{config} on {target}, graphs from {graphs}/")
print(f"{'pass':4} {'ep':>4} {'tasks':>6} {'compile ms':>10} {'estimate ms':>11} "
      f"{'simulated ms':>12} {'x best':>6} {'critical path':>13}")
for g in ("fwd", "bwd"):
    rows = []
    for ep in eps:
        c = json.load(open(config))
        c["ep"] = ep
        path = f"{work}/config-{ep}.json"
        json.dump(c, open(path, "w"))
        out = f"{work}/{g}-{ep}.moebin"
        r = subprocess.run([moec, "compile", f"{graphs}/moe_ffn_{g}.json", "--config", path,
                            "--target", target, "-o", out, "--no-progress"],
                           capture_output=True, text=True)
        if r.returncode:
            sys.exit(r.stderr)
        line = r.stderr
        compiled = float(line.split("compiled in ")[1].split(" ms")[0])
        estimate = float(line.split("estimated ")[1].split(" ms")[0])
        d = json.loads(subprocess.run([moec, "dump", out, "--json"], capture_output=True,
                                      text=True, check=True).stdout)["statistics"]
        rows.append((ep, d["tasks"]["total"], compiled, estimate, d["makespan"] * 1e3,
                     d["critical_path"]["length"] * 1e3))
    best = min(r[4] for r in rows)
    for ep, tasks, compiled, estimate, sim, cp in rows:
        print(f"{g:4} {ep:>4} {tasks:>6} {compiled:>10.1f} {estimate:>11.3f} {sim:>12.3f} "
              f"{sim / best:>6.2f} {100 * cp / sim:>12.0f}%")
PY
