#!/usr/bin/env bash
# LoRA fine-tuning of a small Qwen3-MoE-format checkpoint with moec's layer,
# end to end (finetune.py): make the checkpoint, patch the model and train
# beside the plain-PyTorch LoRA model, save the adapters and the merged
# checkpoint, then reload both in a fresh process and check the logits.
#   bash examples/hf/run.sh [--dtype bf16] [--steps N] [--ranks R] [--layout fused]
#                           [--lora-form parameters] [--weight-format fp8_block128] ...
# --weight-format holds the experts quantized under the adapters (fp8_block128:
# an FP8 checkpoint as DeepSeek-V3 ships one; int8, int4_g32, ...: quantized as
# they load).
# The work folder is $WORKDIR (default: a new temporary folder).
# RANKS=2 bash examples/hf/run.sh runs train and check under torchrun
# --nproc_per_node 2 (LAUNCHER=mpirun: under mpirun -np 2). Debian's torchrun
# needs "--tee 2 --redirects 2" (on Python 3.11 its default "0" maps to no
# stream and it stops at once; examples/torch/train_toy_torchrun.sh says more).
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bazel build //compiler/api:libmoec.so //ops/torch:moec_torch.so 2>&1 | tail -1
work=${WORKDIR:-$(mktemp -d)}
py=(/usr/bin/python3 examples/hf/finetune.py)
"${py[@]}" make-checkpoint "$work" "$@"
if [ -n "${RANKS:-}" ]; then
  if [ "${LAUNCHER:-torchrun}" = mpirun ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    launch=(mpirun --oversubscribe --bind-to none -np "$RANKS")
  else
    launch=(torchrun --standalone --nproc_per_node "$RANKS" --tee 2 --redirects 2
      --log_dir "$work/torchrun-logs")
    py=(examples/hf/finetune.py)
  fi
  "${launch[@]}" "${py[@]}" train "$work" "$@"
  "${launch[@]}" "${py[@]}" check "$work" "$@"
else
  "${py[@]}" train "$work" "$@"
  "${py[@]}" check "$work" "$@"
fi
echo "finetune: passed ($work)"
