#!/bin/bash
# Compiles both layer graphs for a generated config and runs them on the CPU
# runtime with random inputs, checked against the reference:
#   run-verify.sh GRAPHS OUTDIR H I L K EP DTYPE [moec run options]
# SEQ (default 128) sets the tokens per rank, CF the capacity_factor, TP the
# tensor-parallel ranks of each EP rank (default 1; EP x TP ranks run); EXTRA is
# added to the config's keys as written (', "key": value'); COMPILE to both
# compiles' options (e.g. --peer-groups 4).
set -e
graphs=$1 out=$2 H=$3 I=$4 L=$5 K=$6 EP=$7 DT=$8
shift 8
mkdir -p "$out"
cfg="$out/config.json"
echo "{\"name\": \"run\", \"hidden_size\": $H, \"intermediate_size\": $I, \"num_experts\": $((L * EP)), \"top_k\": $K, \"ep\": $EP, \"tp\": ${TP:-1}, \"seq_size\": ${SEQ:-128}, \"dtype\": \"$DT\", \"num_cube_cores\": 2, \"num_vector_cores\": 4${CF:+, \"capacity_factor\": $CF}${EXTRA:-}}" > "$cfg"
moec compile "$graphs/moe_ffn_fwd.json" --config "$cfg" ${COMPILE:-} -o "$out/fwd.moebin" 2>/dev/null
moec compile "$graphs/moe_ffn_bwd.json" --config "$cfg" ${COMPILE:-} -o "$out/bwd.moebin" 2>/dev/null
moec run "$out/fwd.moebin" "$out/bwd.moebin" --ranks "$((EP * ${TP:-1}))" --random 1 --outputs "$out/o" --verify --threads 2 "$@"
