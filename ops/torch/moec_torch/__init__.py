"""moec's MoE-FFN layer as a PyTorch module with autograd.

    import moec_torch
    layer = moec_torch.MoeFFN("examples/configs/tiny.json", ranks=2)
    y = layer(x, topk_ids, topk_weights)      # x [R, S, H] -> y [R, S, H]
    y.square().sum().backward()               # x.grad, topk_weights.grad,
                                              # layer.w1.grad, layer.w2.grad

The layer runs an EP group of R ranks inside this process on the moec CPU
runtime: rank r holds experts r*L .. r*L+L-1 of E, and tensors carry the rank
as their first dim, as in ``moec run``. Forward and backward run the task
binaries that ``moec compile`` makes of graphs/moe_ffn_{fwd,bwd}.json for the
config; they are compiled once per config and cached on disk.

Where things are found (the defaults suit a checkout built with Bazel):

    MOEC_TORCH_LIB   the op library        bazel-bin/ops/torch/moec_torch.so
    MOEC_BIN         the moec CLI          bazel-bin/tools/moec
    MOEC_GRAPHS      the graph folder      graphs/
    MOEC_CACHE_DIR   compiled binaries     ~/.cache/moec
"""

import hashlib
import json
import math
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from . import reference

__all__ = ["MoeFFN", "MoeFFNFunction", "compile_layer", "load_library", "reference"]

_REPO = Path(__file__).resolve().parents[3]


def _path(env, default):
    value = os.environ.get(env)
    return Path(value) if value else default


_loaded = False


def load_library():
    """Loads the op library once (torch.ops.moec, torch.classes.moec)."""
    global _loaded
    if not _loaded:
        lib = _path("MOEC_TORCH_LIB", _REPO / "bazel-bin/ops/torch/moec_torch.so")
        if not lib.is_file():
            raise RuntimeError(
                f"moec: the op library {lib} does not exist; build it with "
                "'bazel build //ops/torch:moec_torch.so' or set MOEC_TORCH_LIB")
        torch.ops.load_library(str(lib))
        _loaded = True


def _read_config(config):
    if isinstance(config, dict):
        return dict(config)
    path = Path(config)
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"moec: cannot read config '{path}': {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"moec: config '{path}' is not JSON: {e}") from None


_compiled = {}


def compile_layer(config, ranks, target="cpu", granularity="per-tile-range"):
    """Returns (forward, backward) task-binary paths for `config` (a dict or a
    JSON path) on `ranks` EP ranks, compiling them with the moec CLI unless
    the cache has them. The key covers the config, the graphs, the target,
    the granularity and the moec binary itself."""
    cfg = _read_config(config)
    cfg["ep"] = int(ranks)
    moec = _path("MOEC_BIN", _REPO / "bazel-bin/tools/moec")
    graphs = _path("MOEC_GRAPHS", _REPO / "graphs")
    if not moec.is_file():
        raise RuntimeError(
            f"moec: the compiler {moec} does not exist; build it with "
            "'bazel build //tools:moec' or set MOEC_BIN")
    sources = [graphs / "moe_ffn_fwd.json", graphs / "moe_ffn_bwd.json"]
    key = hashlib.sha256()
    key.update(json.dumps(cfg, sort_keys=True).encode())
    # The cpu target takes its core counts from this machine.
    key.update(f"{target}|{granularity}|{os.cpu_count()}".encode())
    stat = moec.stat()
    key.update(f"{moec.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    for source in sources:
        key.update(source.read_bytes())
    digest = key.hexdigest()[:24]
    if digest in _compiled:
        return _compiled[digest]
    cache = _path("MOEC_CACHE_DIR", Path.home() / ".cache/moec") / digest
    outputs = (cache / "forward.moebin", cache / "backward.moebin")
    if not all(p.is_file() for p in outputs):
        cache.mkdir(parents=True, exist_ok=True)
        # Compile into a scratch folder and move the files in, so a failed or
        # concurrent compile never leaves a half-written binary in the cache.
        with tempfile.TemporaryDirectory(dir=cache) as scratch:
            cfg_path = Path(scratch) / "config.json"
            cfg_path.write_text(json.dumps(cfg, indent=2))
            for source, out in zip(sources, outputs):
                tmp = Path(scratch) / out.name
                run = subprocess.run(
                    [str(moec), "compile", str(source), "--config", str(cfg_path),
                     "--target", target, "--granularity", granularity, "-o", str(tmp)],
                    capture_output=True, text=True)
                if run.returncode != 0:
                    raise RuntimeError(
                        f"moec compile {source.name} failed:\n{run.stderr.strip()}")
                os.replace(tmp, out)
            os.replace(cfg_path, cache / "config.json")
    _compiled[digest] = tuple(str(p) for p in outputs)
    return _compiled[digest]


class MoeFFNFunction(torch.autograd.Function):
    """y = MoE-FFN(x) on the moec runtime; backward gives dx, d topk_weights,
    dw1 and dw2 (topk_ids get no gradient)."""

    @staticmethod
    def forward(ctx, layer, x, topk_ids, topk_weights, w1, w2):
        y, step = torch.ops.moec.forward(layer, x, topk_ids, topk_weights, w1, w2)
        ctx.layer = layer
        ctx.step = step
        ctx.save_for_backward(x, topk_ids, topk_weights, w1, w2)
        ctx.mark_non_differentiable()
        return y

    @staticmethod
    def backward(ctx, dy):
        x, topk_ids, topk_weights, w1, w2 = ctx.saved_tensors
        dx, dtopk, dw1, dw2 = torch.ops.moec.backward(
            ctx.layer, ctx.step, x, topk_ids, topk_weights, w1, w2, dy)
        return None, dx, None, dtopk, dw1, dw2


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class MoeFFN(torch.nn.Module):
    """The MoE-FFN layer of `config` (a dict or a JSON path, see
    docs/graph-format.md) on an EP group of `ranks` ranks in this process.

    Parameters: w1 [E, H, 2I] (gate columns first, then up) and w2 [E, I, H],
    in the config's dtype. forward(x, topk_ids, topk_weights) takes
    x [R, S, H] (S up to the config's seq_size), topk_ids [R, S, K] (int32 or
    int64, distinct experts per token) and topk_weights [R, S, K] (float32),
    and returns y [R, S, H].

    threads: the runtime's worker threads (0: the hardware threads)."""

    def __init__(self, config, ranks, *, threads=0, target="cpu",
                 granularity="per-tile-range", timeout_seconds=60.0):
        super().__init__()
        load_library()
        cfg = _read_config(config)
        forward, backward = compile_layer(cfg, ranks, target, granularity)
        self.layer = torch.classes.moec.Layer(forward, backward, int(threads),
                                              float(timeout_seconds))
        info = self.layer.info()
        self.ranks = info["ranks"]
        self.experts = info["experts"]
        self.hidden = info["hidden"]
        self.inter = info["inter"]
        self.top_k = info["top_k"]
        self.tokens = info["tokens"]
        dtype = torch.bfloat16 if info["bf16"] else torch.float32
        self.w1 = torch.nn.Parameter(
            torch.empty(self.experts, self.hidden, 2 * self.inter, dtype=dtype))
        self.w2 = torch.nn.Parameter(
            torch.empty(self.experts, self.inter, self.hidden, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            bound1 = 1 / math.sqrt(self.hidden)
            bound2 = 1 / math.sqrt(self.inter)
            self.w1.copy_(torch.empty_like(self.w1, dtype=torch.float32)
                          .uniform_(-bound1, bound1))
            self.w2.copy_(torch.empty_like(self.w2, dtype=torch.float32)
                          .uniform_(-bound2, bound2))

    def forward(self, x, topk_ids, topk_weights):
        return MoeFFNFunction.apply(self.layer, x, topk_ids, topk_weights, self.w1, self.w2)

    def times(self):
        """Seconds of the last passes: forward and backward, each as
        (prepare, tasks, finish)."""
        t = self.layer.times()
        return {"forward": tuple(t[0:3]), "backward": tuple(t[3:6])}

    def extra_repr(self):
        return (f"ranks={self.ranks}, experts={self.experts}, hidden={self.hidden}, "
                f"inter={self.inter}, top_k={self.top_k}, tokens={self.tokens}, "
                f"dtype={self.w1.dtype}")
