#!/usr/bin/env bash
# moec_torch as an installed package, the way docs/torch.md installs it: a
# venv made with `python3 -m venv --system-site-packages --without-pip`, then
# its python's `pip install --no-index --no-build-isolation` of ops/torch
# (with the op and compiler libraries and the graphs it packages), then,
# from a folder outside
# the repository and with no MOEC_* variable set, a few training steps of a
# MoeFFN layer (the loss falls), compiling through the library, dump() as a
# dict, a simulated trace and its loader, and a compile error as an
# exception. The install builds out of tree: the source folder must hold
# the same files after it (no build/, no *.egg-info).
#   package_test.sh OP_LIBRARY COMPILER_LIBRARY
set -euo pipefail
op_lib="$(realpath "$1")"
moec_lib="$(realpath "$2")"
scratch="${TEST_TMPDIR:-$(mktemp -d)}/package"
rm -rf "$scratch" && mkdir -p "$scratch/src" "$scratch/elsewhere"
cp ops/torch/setup.py "$scratch/src/"
cp -r ops/torch/moec_torch "$scratch/src/"
(cd "$scratch/src" && find . | sort) > "$scratch/src-before.txt"
venv="$scratch/venv"
/usr/bin/python3 -m venv --system-site-packages --without-pip "$venv"
MOEC_TORCH_LIB="$op_lib" MOEC_LIB="$moec_lib" MOEC_GRAPHS="$PWD/graphs" PIP_NO_CACHE_DIR=1 \
  "$venv/bin/python" -m pip install --quiet --no-index --no-build-isolation \
  --root-user-action=ignore "$scratch/src"
(cd "$scratch/src" && find . | sort) > "$scratch/src-after.txt"
if ! diff -u "$scratch/src-before.txt" "$scratch/src-after.txt"; then
  echo "package_test: pip install wrote into the source folder (above); setup.py must build" \
    "out of tree (no build/, no *.egg-info)" >&2
  exit 1
fi
site="$(dirname "$(find "$venv" -path '*-packages/moec_torch/__init__.py' | head -1)")"
site="$(dirname "$site")"
[ -f "$site/moec_torch/lib/libmoec.so" ] && [ -f "$site/moec_torch/lib/moec_torch.so" ]
[ -f "$site/moec_torch/graphs/moe_ffn_fwd.json" ]
cd "$scratch/elsewhere"
env -u MOEC_TORCH_LIB -u MOEC_LIB -u MOEC_GRAPHS -u MOEC_BIN -u PYTHONPATH \
  MOEC_CACHE_DIR="$scratch/cache" PYTHONDONTWRITEBYTECODE=1 \
  "$venv/bin/python" - "$site" <<'PY'
import json, sys
from pathlib import Path
import torch
import moec_torch

site = Path(sys.argv[1])
assert Path(moec_torch.__file__).resolve().is_relative_to(site.resolve()), moec_torch.__file__
assert moec_torch.native.library_path().resolve().is_relative_to(site.resolve())
assert moec_torch.native.op_library_path().resolve().is_relative_to(site.resolve())

cfg = {"name": "pkg", "hidden_size": 32, "intermediate_size": 16, "num_experts": 4, "top_k": 2,
       "ep": 2, "tp": 1, "seq_size": 64, "dtype": "fp32", "capacity_factor": 8}
torch.manual_seed(0)
R, S, H, E, K = 2, 64, 32, 4, 2
layer = moec_torch.MoeFFN(cfg, 2, threads=2)
x = torch.randn(R, S, H)
ids = torch.stack([torch.randperm(E)[:K] for _ in range(R * S)]).reshape(R, S, K)
weights = torch.rand(R, S, K) * 0.5 + 0.25
target = torch.randn(R, S, H) * 0.1
opt = torch.optim.SGD(layer.parameters(), lr=0.5)
losses = []
for step in range(4):
    loss = (layer(x, ids, weights) - target).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
assert losses[-1] < losses[0], losses
print("training steps:", " ".join(f"{l:.5f}" for l in losses))

Path("cfg.json").write_text(json.dumps(cfg))
summary = moec_torch.compile("moe_ffn_fwd.json", "cfg.json", "fwd.moebin")
assert "moe_ffn_fwd" in summary, summary
info = moec_torch.dump("fwd.moebin")
assert info["statistics"]["deadlock_free"] and info["statistics"]["makespan"] > 0
tasks = sum(q["tasks"] for q in info["queues"])
assert moec_torch.dump("fwd.moebin", rank=1)["rank"] == 1
moec_torch.simulate_trace("fwd.moebin", "sim.json")
trace = moec_torch.load_trace("sim.json")
assert trace["metadata"]["source"] == "simulated"
assert len(trace["tasks"]) == 2 * tasks, (len(trace["tasks"]), tasks)
assert len(trace["arrows"]) == len(trace["waits"]) > 0
try:
    moec_torch.compile("moe_ffn_fwd.json", "missing.json", "bad.moebin")
    raise SystemExit("a missing config compiled")
except RuntimeError as e:
    assert "missing.json" in str(e), e
assert not Path("bad.moebin").exists()

# Hugging Face models from the installed package: patch, adapters, merged checkpoint.
import moec_torch.hf as mhf
from moec_torch import hf_models, safetensors
model = hf_models.model_from_config(dict(model_type="qwen3_moe", vocab_size=32, hidden_size=32,
                                         moe_intermediate_size=16, num_experts=4,
                                         num_experts_per_tok=2, num_attention_heads=4,
                                         num_key_value_heads=2, num_hidden_layers=1))
ids = torch.randint(0, 32, (2, 5))
want = model(ids).logits
assert mhf.patch_model(model, ranks=2, threads=1, lora_rank=2) == ["model.layers.0.mlp"]
assert torch.allclose(model(ids).logits, want, atol=1e-5)
mhf.save_adapters(model, "adapter")
assert len(safetensors.load_file("adapter/adapter_model.safetensors")) == 4 * 3 * 2
mhf.save_pretrained(model, "merged")
assert "model.layers.0.mlp.experts.3.down_proj.weight" in safetensors.Checkpoint("merged").keys()
print(f"package ok: {tasks} tasks, simulated makespan {info['statistics']['makespan'] * 1e6:.1f} us;"
      " a Hugging Face-structured model patched")
PY
