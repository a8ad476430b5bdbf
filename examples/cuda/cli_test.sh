#!/usr/bin/env bash
# cuda_bench's arguments, checked where there is no GPU too: a product that
# is no [G*]MxNxK[:ab] is refused by name before any GPU is looked for,
# --tile-n takes a positive count, --weight-format a format's name, and an
# int4 B's stored rows whole groups; layer takes its binaries in pairs
# (a missing one named) and --pack-weights off, on or both; decode takes
# no arguments; an unknown option is named; --help anywhere prints the
# usage. Then, on the cpu backend (--backend cpu, no GPU needed), layer
# runs small LoRA binaries (dense bf16 and int8 bases) and the full fp32
# layer, with and without packed weights, and checks each against the
# reference: the harness's bindings (adapters included) that the GPU runs
# use.
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -uo pipefail
bench="$1"
moec="${2:-}"
fails=0
expect() { # expect WANT-IN-STDERR ARGS...
  local want="$1"
  shift
  local err rc
  err="$("$bench" "$@" 2>&1 >/dev/null)"
  rc=$?
  if [ $rc -ne 1 ] || [[ "$err" != *"$want"* ]]; then
    echo "FAIL: cuda_bench $* -> exit $rc, '$err' (wanted exit 1 and '$want')"
    fails=$((fails + 1))
  fi
}
for bad in 12x3 8x8x8:tq 0*8x8x8 8x0x8 2*8x8 x8x8x8 8x8x8:n; do
  expect "'$bad' is no product: give [G*]MxNxK[:ab], a and b n or t" gmm 4x4x4 "$bad"
done
expect "--tile-n takes a positive column count" gmm --tile-n 0 8x8x8
expect "'2*64x96x256:nn' with B int4_g64: int4 groups of 64 values do not divide B's stored rows of 96 (n)" \
  gmm --weight-format int4_g64 64x128x64:nt "2*64x96x256:nn"
for bad in fp9 int4 int4_g16 int8_zp; do
  expect "--weight-format $bad: give dense, fp8_block128, int8 or int4_g32, int4_g64, int4_g128" \
    gmm --weight-format "$bad" 8x8x8
done
expect "layer takes binaries in pairs, FWD BWD [FWD BWD ...]; 1 given" layer a.moebin
expect "layer takes binaries in pairs, FWD BWD [FWD BWD ...]; 3 given" layer a b c --repeat 2
expect "--repeat takes a value" layer a.moebin b.moebin --repeat
expect "unknown option --repat" layer a.moebin b.moebin --repat 2
expect "--pack-weights takes off, on or both, not 'yes'" layer a.moebin b.moebin --pack-weights yes
expect "no-such.fwd.moebin" layer no-such.fwd.moebin no-such.bwd.moebin
# decode takes no arguments: anything after it gets the usage and exit 2.
err="$("$bench" decode 8x8x8 2>&1 >/dev/null)"
rc=$?
if [ $rc -ne 2 ] || [[ "$err" != *"cuda_bench decode"* ]]; then
  echo "FAIL: cuda_bench decode 8x8x8 -> exit $rc, '$err' (wanted exit 2 and the usage)"
  fails=$((fails + 1))
fi
expect "unknown option --tiles" gmm --tiles 2 8x8x8
expect "unknown option --tile-n (it takes a value)" gmm 8x8x8 --tile-n
# --help anywhere: the usage on stdout, exit 0, no GPU looked for.
for args in "--help" "-h" "gmm --help" "gmm 8x8x8 -h" "decode --help" "layer --help" \
  "layer a.moebin --help"; do
  # shellcheck disable=SC2086
  out="$("$bench" $args 2>/dev/null)"
  rc=$?
  if [ $rc -ne 0 ] || [[ "$out" != *"usage: cuda_bench gmm"* ]]; then
    echo "FAIL: cuda_bench $args -> exit $rc, '$out' (wanted exit 0 and the usage on stdout)"
    fails=$((fails + 1))
  fi
done
expect "--backend takes cuda or cpu, not 'gpu'" layer a.moebin b.moebin --backend gpu
# The layer on the cpu backend.
if [ -n "$moec" ]; then
  dir="$(mktemp -d)"
  trap 'rm -rf "$dir"' EXIT
  cat >"$dir/lora.json" <<'EOF'
{"hidden_size": 64, "intermediate_size": 32, "num_experts": 4, "top_k": 2, "ep": 2,
 "tp": 1, "seq_size": 128, "dtype": "bf16", "num_cube_cores": 2, "num_vector_cores": 4,
 "lora_rank": 4, "lora_alpha": 8}
EOF
  compile() { # compile GRAPH CONFIG OUT
    local log
    if ! log="$("$moec" compile "$1" --config "$2" -o "$3" --no-progress 2>&1)"; then
      echo "FAIL: moec compile $1 --config $2: $log"
      fails=$((fails + 1))
    fi
  }
  pairs=()
  for g in lora lora_transposed_int8; do
    for pass in fwd bwd; do
      compile "graphs/moe_ffn_${pass}_$g.json" "$dir/lora.json" "$dir/$g.$pass.moebin"
      pairs+=("$dir/$g.$pass.moebin")
    done
  done
  for pass in fwd bwd; do
    compile "graphs/moe_ffn_$pass.json" examples/configs/tiny.json "$dir/full.$pass.moebin"
    pairs+=("$dir/full.$pass.moebin")
  done
  out="$("$bench" layer "${pairs[@]}" --backend cpu --repeat 2 --sample 8 --pack-weights both 2>&1)"
  rc=$?
  passed="$(grep -c '^verify (8 sampled tokens): passed$' <<<"$out")"
  lora="$(grep -c 'frozen, LoRA r 4 on w1, w2' <<<"$out")"
  adapters="$(grep -c '^  dlora_b1 ' <<<"$out")"
  if [ $rc -ne 0 ] || [ "$passed" != 6 ] || [ "$lora" != 4 ] || [ "$adapters" != 4 ]; then
    echo "FAIL: cuda_bench layer --backend cpu -> exit $rc, $passed of 6 checks passed," \
      "$lora of 4 LoRA layers, $adapters of 4 adapter gradients checked:"
    echo "$out"
    fails=$((fails + 1))
  fi
fi
[ $fails -eq 0 ] && echo "cuda_bench arguments: all checks passed"
exit $((fails > 0))
