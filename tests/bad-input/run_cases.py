#!/usr/bin/env python3
"""Runs the bad-input matrix (cases.txt beside this file).

    run_cases.py --moec MOEC --moec-opt MOEC_OPT --torch-lib MOEC_TORCH_SO
                 [--only SUBSTRING] [--list]

Makes the fixtures in a fresh folder, then runs each case there and checks
its exit status (1 or 2 as the table says; never a signal, never past the
60 s limit), that its output matches the table's message, and that nothing
in the folder was created, changed or removed. Prints one line per case and
a summary; exits 1 when any case fails.

Fixtures (from the shipped graphs and the tiny config: 2 ranks, E 4, H 64,
I 32, S 128, top-2):
  fwd.bin bwd.bin        the tiny layer; bwd-h32.bin the backward of H 32
  in/                    good inputs and outputs of one run, with manifest
  g.json                 the forward graph; graph-json/mlir/config variants
                         of it under the names the cases use
  truncated.bin flipped.bin version.bin empty.bin   broken binaries
  a-folder.json/         a directory where a file is expected
  npy-*/ route-*/        input folders, each with one bad file
Needs only the Python standard library; the torch cases run Debian's
/usr/bin/python3 with torch and moec_torch.
"""

import argparse
import ast
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(os.path.abspath(__file__)).parent  # in the runfiles tree under bazel test
ROOT = HERE.parent.parent
TIMEOUT = 60

TINY = json.loads((ROOT / "examples/configs/tiny.json").read_text())

TORCH_PRELUDE = """
import torch, moec_torch as mt
cfg = {cfg!r}
torch.manual_seed(0)
layer = mt.MoeFFN(cfg, 2, threads=2)
x = torch.randn(2, 128, 64)
ids = torch.stack([torch.randperm(4)[:2] for _ in range(256)]).view(2, 128, 2)
w = torch.rand(2, 128, 2)
"""


# --- .npy files, without numpy ---------------------------------------------------

def read_npy(path):
    data = path.read_bytes()
    assert data[:6] == b"\x93NUMPY"
    length = struct.unpack("<H", data[8:10])[0]
    header = ast.literal_eval(data[10:10 + length].decode("latin1"))
    return header, data[10 + length:]


def write_npy(path, descr, shape, payload, fortran=False):
    header = repr({"descr": descr, "fortran_order": fortran, "shape": tuple(shape)})
    header = header.encode("latin1")
    pad = 64 - (10 + len(header) + 1) % 64
    header += b" " * pad + b"\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + payload)


def floats(payload, fmt="<f"):
    return list(struct.unpack(f"{fmt[0]}{len(payload) // 4}{fmt[1]}", payload))


def pack(values, fmt):
    return struct.pack(f"{fmt[0]}{len(values)}{fmt[1]}", *values)


# --- fixtures --------------------------------------------------------------------

def run(cmd, cwd):
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def input_variant(w, name, change):
    """A copy of the good inputs (no manifest) as folder `name`, then
    change(folder)."""
    folder = w / name
    folder.mkdir()
    for f in ("x", "topk_ids", "topk_weights", "w1", "w2", "dy"):
        shutil.copy(w / "in" / f"{f}.npy", folder / f"{f}.npy")
    change(folder)


def make_fixtures(w, moec):
    configs, graphs = ROOT / "examples/configs", ROOT / "graphs"
    tiny = str(configs / "tiny.json")
    run([moec, "compile", str(graphs / "moe_ffn_fwd.json"), "--config", tiny, "-o", "fwd.bin"], w)
    run([moec, "compile", str(graphs / "moe_ffn_bwd.json"), "--config", tiny, "-o", "bwd.bin"], w)
    (w / "cfg-h32.json").write_text(json.dumps(dict(TINY, hidden_size=32)))
    run([moec, "compile", str(graphs / "moe_ffn_bwd.json"), "--config", "cfg-h32.json",
         "-o", "bwd-h32.bin"], w)
    run([moec, "run", "fwd.bin", "bwd.bin", "--ranks", "2", "--random", "1", "--outputs", "in"], w)

    # Graphs, JSON.
    text = (graphs / "moe_ffn_fwd.json").read_text()
    graph = json.loads(text)
    (w / "g.json").write_text(text)
    (w / "malformed.json").write_text(text[:len(text) // 2])
    (w / "graph.txt").write_text(text[:len(text) // 3])
    (w / "duplicate-key.json").write_text(text.replace('"name":', '"name": "x", "name":', 1))
    (w / "deep.json").write_text('{"name": "g", "tensors": ' + "[" * 200 + "]" * 200 + "}")
    (w / "a-folder.json").mkdir()

    def variant(name, change):
        g = json.loads(text)
        change(g)
        (w / name).write_text(json.dumps(g, indent=1))

    variant("unknown-kind.json", lambda g: g["ops"][0].update(op="frobnicate"))
    variant("slot-max.json", lambda g: g["tensors"][0].update(param_position=2**63 - 1))
    variant("slot-2p32.json", lambda g: g["tensors"][0].update(param_position=2**32 + 15))
    variant("tiling-huge.json", lambda g: g["ops"][1].update(tiling_position=2**63 - 1))
    variant("dim-deep.json", lambda g: g["tensors"][0]["shape"].__setitem__(
        1, "(" * 10000 + "hidden_size" + ")" * 10000))
    variant("dim-long.json", lambda g: g["tensors"][0]["shape"].__setitem__(
        1, "hidden_size" + " + 0" * 20000))
    variant("fill-symbol.json", lambda g: g["ops"][0]["fill"].update(event_group="no_such_symbol"))
    variant("edge-unknown.json", lambda g: g["edges"].append(["dispatch", "nowhere"]))

    # Graphs, MLIR.
    mlir = (graphs / "moe_ffn_fwd.mlir").read_text()
    (w / "syntax.mlir").write_text(mlir[:len(mlir) // 2])
    (w / "deep.mlir").write_text("module attributes {x = " + "[" * 100 + "]" * 100 + "} {}\n")
    (w / "no-split.mlir").write_text(
        'moe.graph "g" {\n  %y = moe.input "y" : !moe.tensor<[16, 8], f32>\n'
        '  %a = moe.swiglu "s"(%y) -> "a" {split_value = 4 : i64} : '
        "(!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>\n}\n")
    body = mlir[mlir.index("moe.graph"):mlir.rindex("}")]
    (w / "two-graphs.mlir").write_text(
        "module {\n" + body + body.replace('"moe_ffn_fwd"', '"second"', 1) + "}\n")
    (w / "slot.mlir").write_text(re.sub(r"slot = 1 : i64", "slot = 70000 : i64", mlir, count=1))
    (w / "bad-profile.json").write_text('{"name": "bad", "cube_cores": "many"}')

    # Configs.
    (w / "cfg-malformed.json").write_text('{"hidden_size": 64,,}')
    for name, change in [("cfg-huge-seq.json", {"seq_size": 2**40}),
                         ("cfg-ep.json", {"num_experts": 5}),
                         ("cfg-topk.json", {"top_k": 5}),
                         ("cfg-negative.json", {"hidden_size": -64}),
                         ("cfg-string.json", {"seq_size": "128"})]:
        (w / name).write_text(json.dumps(dict(TINY, **change)))
    misspelled = dict(TINY)
    misspelled["hiden_size"] = misspelled.pop("hidden_size")
    (w / "cfg-misspelled.json").write_text(json.dumps(misspelled))
    (w / "cfg-duplicate.json").write_text(
        json.dumps(TINY).replace('"seq_size":', '"seq_size": 64, "seq_size":'))

    # Task binaries.
    binary = (w / "fwd.bin").read_bytes()
    (w / "truncated.bin").write_bytes(binary[:len(binary) // 2])
    flipped = bytearray(binary)
    flipped[len(binary) // 2] ^= 0x10
    (w / "flipped.bin").write_bytes(bytes(flipped))
    (w / "version.bin").write_bytes(binary[:8] + struct.pack("<I", 7) + binary[12:])
    (w / "empty.bin").write_bytes(b"")

    # .npy inputs.
    header, x = read_npy(w / "in/x.npy")
    values = floats(x)
    shape = list(header["shape"])
    input_variant(w, "npy-missing", lambda f: (f / "x.npy").unlink())
    input_variant(w, "npy-directory", lambda f: ((f / "x.npy").unlink(), (f / "x.npy").mkdir()))
    input_variant(w, "npy-dtype", lambda f: write_npy(
        f / "x.npy", "<i4", shape, pack([int(v * 100) for v in values], "<i")))
    input_variant(w, "npy-shape", lambda f: write_npy(
        f / "x.npy", "<f4", shape[:2] + [65], pack(values[:shape[0] * shape[1] * 65] + [0.0] * 
                                                  max(0, shape[0] * shape[1] * 65 - len(values)), "<f")))
    input_variant(w, "npy-big-endian", lambda f: write_npy(f / "x.npy", ">f4", shape, pack(values, ">f")))
    input_variant(w, "npy-fortran", lambda f: write_npy(f / "x.npy", "<f4", shape, x, fortran=True))
    input_variant(w, "npy-truncated", lambda f: write_npy(f / "x.npy", "<f4", shape, x[:len(x) // 2]))
    input_variant(w, "npy-magic", lambda f: (f / "x.npy").write_bytes(b"PK\x03\x04" + x[:100]))
    w1_header, w1 = read_npy(w / "in/w1.npy")
    e, h, i2 = w1_header["shape"]
    input_variant(w, "npy-w1", lambda f: write_npy(
        f / "w1.npy", "<f4", [e - 1, h, i2], w1[:len(w1) * (e - 1) // e]))
    shutil.copytree(w / "in", w / "npy-mixed")
    shutil.copy(w / "in/y.npy", w / "npy-mixed/x.npy")
    shutil.copytree(w / "in", w / "npy-manifest-bad")
    (w / "npy-manifest-bad/manifest.json").write_text("[1, 2]\n")
    shutil.copytree(w / "in", w / "npy-manifest-missing")
    (w / "npy-manifest-missing/dy.npy").unlink()

    # Routing.
    ids_header, ids = read_npy(w / "in/topk_ids.npy")
    ids_values = list(struct.unpack(f"<{len(ids) // 8}q", ids))
    r, s, k = ids_header["shape"]

    def ids_with(change):
        v = list(ids_values)
        change(v)
        return lambda f: write_npy(f / "topk_ids.npy", "<i8", [r, s, k], struct.pack(f"<{len(v)}q", *v))

    at_rank1 = s * k + 5 * k  # rank 1, token 5, slot 0
    input_variant(w, "route-range", ids_with(lambda v: v.__setitem__(at_rank1, 4)))
    input_variant(w, "route-negative", ids_with(lambda v: v.__setitem__(at_rank1, -1)))
    input_variant(w, "route-duplicate", ids_with(lambda v: v.__setitem__(at_rank1 + 1, v[at_rank1])))
    input_variant(w, "route-float", lambda f: write_npy(
        f / "topk_ids.npy", "<f4", [r, s, k], pack([float(v) for v in ids_values], "<f")))
    input_variant(w, "route-k", lambda f: write_npy(
        f / "topk_ids.npy", "<i8", [r, s, k + 1],
        struct.pack(f"<{r * s * (k + 1)}q", *[j % 4 for j in range(r * s * (k + 1))])))
    _, weights = read_npy(w / "in/topk_weights.npy")
    nan_weights = floats(weights)
    nan_weights[7] = float("nan")
    input_variant(w, "route-nan", lambda f: write_npy(
        f / "topk_weights.npy", "<f4", [r, s, k], pack(nan_weights, "<f")))


# --- cases -----------------------------------------------------------------------

def load_cases(path):
    cases = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(" | ", 3)]
        if len(parts) != 4 or parts[1] not in ("1", "2"):
            sys.exit(f"{path}:{number}: expected 'NAME | 1 or 2 | MESSAGE | COMMAND'")
        name, code, message, command = parts
        if any(c["name"] == name for c in cases):
            sys.exit(f"{path}:{number}: case '{name}' is listed twice")
        cases.append({"name": name, "exit": int(code), "message": message,
                      "command": command, "line": number})
    return cases


def snapshot(folder):
    state = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            state[str(p.relative_to(folder))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return state


def run_case(case, w, env):
    scratch = Path(tempfile.mkdtemp(prefix="moec-scratch-"))
    env = dict(env, SCRATCH=str(scratch))
    try:
        return check_case(case, w, env)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def check_case(case, w, env):
    before = snapshot(w)
    started = time.monotonic()
    try:
        done = subprocess.run(["bash", "-c", case["command"]], cwd=w, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"still running after {TIMEOUT} s (a hang)", ""
    seconds = time.monotonic() - started
    output = done.stdout.decode("utf-8", "replace")
    after = snapshot(w)
    problems = []
    if done.returncode < 0 or done.returncode > 128:
        problems.append(f"ended by signal {-done.returncode if done.returncode < 0 else done.returncode - 128}")
    elif done.returncode != case["exit"]:
        problems.append(f"exit {done.returncode}, expected {case['exit']}")
    if not re.search(case["message"], output):
        problems.append(f"output does not match /{case['message']}/")
    changed = sorted(set(before) ^ set(after) |
                     {p for p in set(before) & set(after) if before[p] != after[p]})
    if changed:
        problems.append("left changes in the folder: " + ", ".join(changed[:5]))
    return "; ".join(problems), output if problems else f"{seconds:.1f} s"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--moec", required=True)
    parser.add_argument("--moec-opt", required=True)
    parser.add_argument("--torch-lib", required=True)
    parser.add_argument("--moec-lib", required=True)
    parser.add_argument("--only", default="", help="run the cases whose name holds this")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args()
    cases = [c for c in load_cases(HERE / "cases.txt") if args.only in c["name"]]
    if args.list:
        for c in cases:
            print(c["name"])
        return 0
    tools = Path(tempfile.mkdtemp(prefix="moec-bad-input-"))
    for tool, name in ((args.moec, "moec"), (args.moec_opt, "moec-opt")):
        (tools / name).symlink_to(Path(tool).resolve())
    w = Path(os.environ.get("TEST_TMPDIR", tempfile.mkdtemp())) / "fixtures"
    shutil.rmtree(w, ignore_errors=True)
    w.mkdir(parents=True)
    make_fixtures(w, str(tools / "moec"))
    prelude = TORCH_PRELUDE.format(cfg=TINY)
    env = dict(os.environ,
               PATH=f"{tools}:{os.environ.get('PATH', '/usr/bin:/bin')}",
               GRAPHS=str(ROOT / "graphs"), CONFIGS=str(ROOT / "examples/configs"),
               MOEC_LIB=str(Path(args.moec_lib).resolve()), MOEC_GRAPHS=str(ROOT / "graphs"),
               MOEC_TORCH_LIB=str(Path(args.torch_lib).resolve()),
               MOEC_CACHE_DIR=str(tools / "cache"), PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=str(ROOT / "ops/torch"), TORCH_PRELUDE=prelude)
    env["BASH_ENV"] = str(tools / "functions.sh")
    (tools / "functions.sh").write_text(
        'torch_case() { /usr/bin/python3 -c "$TORCH_PRELUDE"$\'\\n\'"$1"; }\n')
    failed = 0
    for case in cases:
        problem, detail = run_case(case, w, env)
        if problem:
            failed += 1
            print(f"FAIL {case['name']} (cases.txt:{case['line']}): {problem}")
            print("     " + "\n     ".join(detail.strip().splitlines()[-8:]))
        else:
            print(f"ok   {case['name']} ({detail})")
    kinds = sorted({c["name"].split("/")[0] for c in cases})
    print(f"bad-input matrix: {len(cases) - failed} of {len(cases)} cases passed "
          f"({', '.join(kinds)})")
    shutil.rmtree(tools, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
