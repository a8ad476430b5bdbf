#!/usr/bin/env bash
# Writes the task binary reader's seed corpus (tests/fuzz/corpus/) with the
# moec CLI: small binaries of today's format, one of each kind of record the
# reader checks (a plain fp32 layer; a bf16 LoRA layer's forward and
# backward, whose adapters' first GMMs are lead products; an FP8 frozen
# layer's backward, whose weights are quantized). Run it after a change of
# the task binary format: //tests/unit/format:task_binary_test fails until
# the seeds are of the format the reader reads (a seed the reader refuses at
# its version check leaves the fuzzer nothing past the header to explore).
# The corpus's regression-*.bin files, inputs a fuzzer once broke, stay.
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bazel build //tools:moec
moec=bazel-bin/tools/moec
out=tests/fuzz/corpus
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# tiny.json's shapes in bf16 with rank-4 adapters; FP8 blocks need H and I
# multiples of 128.
sed 's/"dtype": "fp32"/"dtype": "bf16", "lora_rank": 4/' examples/configs/tiny.json > "$work/lora.json"
sed 's/"hidden_size": 64/"hidden_size": 256/; s/"intermediate_size": 32/"intermediate_size": 128/; s/"dtype": "fp32"/"dtype": "bf16"/' \
  examples/configs/tiny.json > "$work/fp8.json"
compile() { # GRAPH CONFIG NAME
  "$moec" compile "graphs/$1.json" --config "$2" -o "$work/$3.bin" > /dev/null
}
compile moe_ffn_fwd examples/configs/tiny.json plain-fwd
compile moe_ffn_fwd_lora "$work/lora.json" lora-fwd
compile moe_ffn_bwd_lora "$work/lora.json" lora-bwd
compile moe_ffn_bwd_frozen_transposed_fp8 "$work/fp8.json" fp8-bwd
mkdir -p "$out"
cp "$work"/*.bin "$out"/
ls -l "$out"
