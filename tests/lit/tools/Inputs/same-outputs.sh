#!/bin/bash
# Fails unless two `moec run` output folders hold the same bits for every
# output of the layer: same-outputs.sh DIR_A DIR_B
set -e
for out in y dx dtopk_weights dw1 dw2; do
  cmp "$1/$out.npy" "$2/$out.npy"
done
