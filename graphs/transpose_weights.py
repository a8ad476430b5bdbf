#!/usr/bin/env python3
"""Writes the graphs of a layer whose base weights are stored transposed,
and their FP8 forms.

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

and, from each, the base weights stored quantized in that layout ([out,
in], as checkpoints ship them), each with its fp32 scales `<weight>_scale`
as the fourth input of its GMMs (runtime/cpu/Quant.h):

  ..._transposed_fp8.json     FP8 e4m3 codes, a scale per 128 x 128 block
                              ([L, d1 / 128, d2 / 128]): DeepSeek-V3's
                              `weight` and `weight_scale_inv`; H, and I of a
                              rank, multiples of 128
  ..._transposed_int8.json    int8 codes, a scale per row ([L, d1])
  ..._transposed_int4.json    4-bit codes, a scale per group of the
                              config's `weight_group` values along a row
                              ([L, d1, d2 / weight_group])
  ..._transposed_int4zp.json  the same with a zero point per group
                              ([L, d1, d2 / weight_group, 2])

    python3 graphs/transpose_weights.py          # writes them beside this file
    python3 graphs/transpose_weights.py --check  # exits 1 where one differs
"""

import argparse
import copy
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


# The quantized forms: the file suffix, the codes' dtype, and the scales'
# dims from the weight's [L, d1, d2].
FORMATS = {
    "fp8": ("fp8_e4m3", lambda d0, d1, d2: [d0, f"({d1}) / 128", f"({d2}) / 128"]),
    "int8": ("int8", lambda d0, d1, d2: [d0, d1]),
    "int4": ("int4", lambda d0, d1, d2: [d0, d1, f"({d2}) / weight_group"]),
    "int4zp": ("int4", lambda d0, d1, d2: [d0, d1, f"({d2}) / weight_group", 2]),
}


def quantized(graph, form):
    """The transposed graph with its base weights as codes of `form` (a key
    of FORMATS) and their scales."""
    graph = copy.deepcopy(graph)
    dtype, scale_dims = FORMATS[form]
    tensors = {t["name"]: t for t in graph["tensors"]}
    position = 1 + max(t.get("param_position", -1) for t in graph["tensors"])
    scales = {}
    for op in graph["ops"]:
        if op["op"] != "gmm" or op["name"] not in BASE_GMMS:
            continue
        name = op["inputs"][1]
        weight = tensors[name]
        if name not in scales:
            weight["dtype"] = dtype
            scale = {"name": f"{name}_scale", "shape": scale_dims(*weight["shape"]),
                     "dtype": "fp32", "param_position": position, "list": True}
            position += 1
            graph["tensors"].append(scale)
            scales[name] = scale["name"]
        if len(op["inputs"]) != 3:
            raise ValueError(f"gmm '{op['name']}' has {len(op['inputs'])} inputs; expected 3")
        op["inputs"].append(scales[name])
    graph["name"] += "_" + form
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
        made = transposed(json.loads((args.dir / f"{name}.json").read_text()))
        outputs = {f"{name}_transposed.json": text(made)}
        for form in FORMATS:
            outputs[f"{name}_transposed_{form}.json"] = text(quantized(made, form))
        for file, want in outputs.items():
            path = args.dir / file
            if args.check:
                if not path.exists() or path.read_text() != want:
                    stale.append(path.name)
            else:
                path.write_text(want)
    if stale:
        print(f"stale: {', '.join(stale)}; run python3 graphs/transpose_weights.py",
              file=sys.stderr)
        return 1
    print(f"{(1 + len(FORMATS)) * len(SOURCES)} graphs "
          f"{'up to date' if args.check else 'written'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
