#!/usr/bin/env bash
# The layer under the MPI fabric (one process per rank, mpirun -np 2, 3, 4 on
# this machine) against the reference, and bit for bit against the
# in-process fabric on the same inputs: forward and backward, fp32 and bf16,
# skewed routing, experts and ranks that receive no rows, both event
# granularities, several passes of one context (--repeat), FP8 dispatch, tiles
# cut by peer groups, LoRA adapters on a quantized base (also with expert
# tensor parallelism).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

passed=0
failed=0
for ep in 2 3 4; do
  layer "f32-$ep" 64 32 2 2 "$ep" fp32
  check "f32-$ep" "$ep"
  layer "bf16-$ep" 64 32 2 2 "$ep" bf16
  check "bf16-$ep" "$ep" --hot-share 0.5
done
# Skewed routing: most first choices go to expert 0.
layer skew 48 32 3 2 2 fp32
check skew 2 --hot-share 0.9
# Top-1, every token to expert 0: the other experts, and the other ranks'
# experts, receive no rows (dw of them must be zero, as the reference's).
layer zero 32 16 2 1 3 fp32 ', "capacity_factor": 4'
check zero 3 --hot-share 1
# The seed's event granularity: one event per producer op and expert.
GRANULARITY=per-expert layer per-expert 64 32 2 2 2 fp32
check per-expert 2
# Many local experts, top-8.
layer wide 32 16 8 8 2 bf16
check wide 2
# FP8 dispatch: quantized rows (codes and block scales) put between
# processes, the same bits as in process.
layer fp8 300 32 2 2 3 bf16 ', "dispatch_dtype": "fp8_e4m3"'
check fp8 3 --hot-share 0.5
# Each expert's rows cut into peer groups (tiles of the rows from some source
# ranks only; on 3 ranks a group's sources wrap past the last rank).
PEER_GROUPS=2 layer groups 64 32 2 2 3 bf16
check groups 3 --hot-share 0.5
# LoRA adapters on an int4 base: the adapters' inputs and gradients
# between processes, the same bits as in process.
GRAPH=_lora_transposed_int4 layer lora 256 128 2 2 3 bf16 ', "lora_rank": 8, "weight_group": 32'
OUTPUTS="y dx dtopk_weights dlora_a1 dlora_b1 dlora_a2 dlora_b2" check lora 3 --hot-share 0.5
# LoRA adapters with expert tensor parallelism on an FP8 base (2 EP x 2 TP
# processes): each TP rank's slices of the adapters, and the TP ranks'
# partial gradients of the whole ones summed, the same bits as in process.
TP=2 GRAPH=_lora_transposed_fp8 layer lora-tp 256 256 2 2 2 bf16 ', "lora_rank": 16'
OUTPUTS="y dx dtopk_weights dlora_a1 dlora_b1 dlora_a2 dlora_b2" check lora-tp 4
# One trace of the whole job.
check_trace f32-2 2
# The path between nodes (two-sided messages) on this one machine: no rank
# shares memory with another.
MPIRUN+=(-x MOEC_MPI_NO_SHARED_MEMORY=1)
check f32-3 3 --hot-share 0.5
check bf16-4 4
check groups 3
check_trace f32-3 3

echo
echo "mpi conformance: ${passed} passed, ${failed} failed"
[ "$failed" -eq 0 ]
