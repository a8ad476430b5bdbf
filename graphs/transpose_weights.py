#!/usr/bin/env python3
"""Writes the graphs of a layer whose base weights are stored transposed.

Hugging Face's fused experts (transformers v5) keep each expert's weights as
`gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`: the matrices of moec's
w1 [E, H, 2I] and w2 [E, I, H], each transposed. A layer that reads them in
place runs these graphs: the base GMMs' weight tensors get their last two
dims swapped and their `transpose` flag flipped (the forward reads them
transposed, the backward as they are). Only graphs without base weight
gradients have such a form (frozen and LoRA layers):

  moe_ffn_fwd.json        -> moe_ffn_fwd_transposed.json
  moe_ffn_bwd_frozen.json -> moe_ffn_bwd_frozen_transposed.json
  moe_ffn_{fwd,bwd}_lora{,_w1,_w2}.json -> ..._transposed.json

    python3 graphs/transpose_weights.py          # writes them beside this file
    python3 graphs/transpose_weights.py --check  # exits 1 where one differs
"""

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = ["moe_ffn_fwd", "moe_ffn_bwd_frozen"] + [
    f"moe_ffn_{p}_lora{t}" for p in ("fwd", "bwd") for t in ("", "_w1", "_w2")]
# The GMMs on the base weights: the forward's projections and the backward's
# activation gradients.
BASE_GMMS = {"up_proj", "down_proj", "act_grad", "gate_grad"}


def transposed(graph):
    """The graph with its base weights stored transposed."""
    tensors = {t["name"]: t for t in graph["tensors"]}
    seen = 0
    for op in graph["ops"]:
        if op["op"] != "gmm" or op["name"] not in BASE_GMMS:
            continue
        weight = tensors[op["inputs"][1]]
        weight["shape"] = [weight["shape"][0], weight["shape"][2], weight["shape"][1]]
        if weight.pop("transpose", False) is False:
            weight["transpose"] = True
        seen += 1
    if seen != 2:
        raise ValueError(f"graph '{graph['name']}' has {seen} base GMMs; expected 2")
    graph["name"] += "_transposed"
    return graph


def text(graph):
    return json.dumps(graph, indent=2) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with the files in graphs/ instead of writing them")
    parser.add_argument("--dir", type=Path, default=HERE, help="the graphs folder")
    args = parser.parse_args()
    stale = []
    for name in SOURCES:
        source = json.loads((args.dir / f"{name}.json").read_text())
        want = text(transposed(source))
        path = args.dir / f"{name}_transposed.json"
        if args.check:
            if not path.exists() or path.read_text() != want:
                stale.append(path.name)
        else:
            path.write_text(want)
    if stale:
        print(f"stale: {', '.join(stale)}; run python3 graphs/transpose_weights.py",
              file=sys.stderr)
        return 1
    print(f"{len(SOURCES)} transposed graphs {'up to date' if args.check else 'written'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
