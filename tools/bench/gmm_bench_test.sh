#!/usr/bin/env bash
# gmm_bench --layer's tile filter: one named tile alone, an unknown name
# refused with the reason and exit status 2.
set -euo pipefail
bench="$1"
out=$("$bench" --layer 1 1 1 dw2)
echo "$out"
rows=$(grep -cE '^  [a-z_0-9]+ +[0-9]+ x' <<<"$out")
[[ "$rows" == 1 ]] || { echo "FAIL: $rows tile rows, want 1"; exit 1; }
grep -qE '^  dw2 +768 x  2048 x   128 +[0-9.]+' <<<"$out" || { echo "FAIL: no dw2 row"; exit 1; }
set +e
err=$("$bench" --layer 1 1 1 nosuch 2>&1 >/dev/null)
rc=$?
set -e
[[ "$rc" == 2 ]] || { echo "FAIL: exit status $rc for an unknown tile, want 2"; exit 1; }
grep -q "no tile named 'nosuch' (the tiles: up_proj, down_proj" <<<"$err" || { echo "FAIL: message: $err"; exit 1; }
echo "gmm_bench_test: passed"
