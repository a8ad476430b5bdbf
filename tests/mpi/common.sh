# Shared by the MPI tests: the moec binary, mpirun as root, layer configs.
#   MOEC      the moec binary (from the test's environment)
#   GRAPHS    the graphs folder
set -euo pipefail
MOEC="$(realpath "${MOEC:?set MOEC to the moec binary}")"
GRAPHS="$(realpath "${GRAPHS:-graphs}")"
WORK="${TEST_TMPDIR:-$(mktemp -d)}"
# mpirun refuses root unless told; CI runs as root. More ranks than cores
# need --oversubscribe.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
# No network interfaces are needed on one machine.
export OMPI_MCA_btl=self,vader
MPIRUN=(mpirun --bind-to none)

# layer NAME H I L K EP DTYPE [extra config JSON]: compiles both graphs
# into $WORK/NAME/{fwd,bwd}.moebin (granularity from $GRANULARITY).
layer() {
  local name=$1 H=$2 I=$3 L=$4 K=$5 EP=$6 DT=$7 extra=${8:-}
  local dir="$WORK/$name"
  mkdir -p "$dir"
  echo "{\"name\": \"$name\", \"hidden_size\": $H, \"intermediate_size\": $I, \"num_experts\": $((L * EP)), \"top_k\": $K, \"ep\": $EP, \"tp\": 1, \"seq_size\": 128, \"dtype\": \"$DT\", \"num_cube_cores\": 2, \"num_vector_cores\": 2$extra}" > "$dir/config.json"
  "$MOEC" compile "$GRAPHS/moe_ffn_fwd.json" --config "$dir/config.json" \
    --granularity "${GRANULARITY:-per-tile-range}" -o "$dir/fwd.moebin" > /dev/null
  "$MOEC" compile "$GRAPHS/moe_ffn_bwd.json" --config "$dir/config.json" \
    --granularity "${GRANULARITY:-per-tile-range}" -o "$dir/bwd.moebin" > /dev/null
}

fail() {
  echo "FAILED: $*" >&2
  exit 1
}
