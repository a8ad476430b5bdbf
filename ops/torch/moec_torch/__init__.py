"""moec's MoE-FFN layer as a PyTorch module with autograd.

    import moec_torch
    layer = moec_torch.MoeFFN("examples/configs/tiny.json", ranks=2)
    y = layer(x, topk_ids, topk_weights)      # x [R, S, H] -> y [R, S, H]
    y.square().sum().backward()               # x.grad, topk_weights.grad,
                                              # layer.w1.grad, layer.w2.grad

The layer runs an EP group of R ranks on the moec CPU runtime: rank r holds
experts r*L .. r*L+L-1 of E. The ranks are threads of this process (the
default), and tensors then carry the rank as their first dim, as in
``moec run``; or, started by mpirun, each process runs one rank (the MPI
fabric), holds only its L experts, and passes its own tokens:

    # mpirun -np 2 python3 train.py
    layer = moec_torch.MoeFFN("examples/configs/tiny.json")   # R = the processes
    y = layer(x, topk_ids, topk_weights)      # x [S, H] -> y [S, H]; w1 [L, H, 2I]
    ...
    moec_torch.finalize_mpi()                 # at the end (also run at exit)

Forward and backward run the task binaries that ``moec compile`` makes of
graphs/moe_ffn_{fwd,bwd}.json for the config; they are compiled once per
config and cached on disk. A layer cannot be copied or pickled: save
``layer.state_dict()`` (save_state writes it whole or not at all) and
rebuild it with MoeFFN(config, ...) + load_state_dict.

Where things are found: an installed package (pip install ops/torch, see
docs/torch.md) carries its libraries and graphs; in a checkout built with
Bazel they are found there. These override:

    MOEC_TORCH_LIB   the op library         moec_torch/lib/moec_torch.so, or
                                            bazel-bin/ops/torch/moec_torch.so
    MOEC_LIB         the compiler library   moec_torch/lib/libmoec.so, or
                                            bazel-bin/compiler/api/libmoec.so
    MOEC_GRAPHS      the graph folder       moec_torch/graphs, or graphs/
    MOEC_CACHE_DIR   compiled binaries      ~/.cache/moec
"""

import atexit
import collections
import errno
import hashlib
import io
import json
import math
import os
import re
import shutil
import stat
import tempfile
import time
import warnings
from pathlib import Path

import torch

from . import adapters, checks, native, quant, reference, safetensors
from .native import compile, dump, load_trace, simulate_trace

__all__ = ["BackwardHandle", "DispatchHandle", "Exchange", "ForwardHandle", "Gradients",
           "MoeFFN", "MoeFFNFunction", "checks", "compile", "compile_graphs",
           "compile_layer", "close_groups", "dump", "finalize_mpi", "launched_by_mpi", "launched_by_torchrun", "load_library",
           "load_trace", "native", "quant", "reference", "safetensors", "save_state",
           "simulate_trace"]


_loaded = False


def load_library():
    """Loads the op library once (torch.ops.moec, torch.classes.moec)."""
    global _loaded
    if not _loaded:
        lib = native.op_library_path()
        if not lib.is_file():
            raise RuntimeError(
                f"moec: the op library {lib} does not exist; install the moec_torch package, "
                "build it with 'bazel build //ops/torch:moec_torch.so', or set MOEC_TORCH_LIB")
        torch.ops.load_library(str(lib))
        _loaded = True


_compiled = {}


def launched_by_mpi():
    """True when this process was started by mpirun (or another PMI launcher)."""
    return any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def launched_by_torchrun():
    """True when torchrun (torch.distributed.run, torch's elastic agent)
    started this process: it sets TORCHELASTIC_RUN_ID, RANK and WORLD_SIZE
    for torch.distributed's env:// rendezvous."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def _world_size():
    for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if v in os.environ:
            return int(os.environ[v])
    raise ValueError("moec: cannot tell the number of MPI processes; pass ranks=")


_finalize_registered = False
_groups_registered = False


def _distributed():
    """True when torch.distributed is initialized in this process."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def _default_fabric():
    """"mpi" when mpirun started the process, else "group" when
    torch.distributed is initialized with more than one process, else
    "inproc"."""
    if launched_by_mpi():
        return "mpi"
    if _distributed():
        import torch.distributed as dist
        if dist.get_world_size() > 1:
            return "group"
    return "inproc"


def _fabric(fabric, group, ranks, tp, who):
    """(fabric, ranks, group): the fabric ("inproc", "mpi" or "group"), the
    EP group's size and the torch.distributed group the ranks are (for
    "group"). Default: "mpi" when mpirun started the process, else "group"
    over the world group when torch.distributed is initialized with more
    than one process, else "inproc". Under "mpi" and "group" the ranks default to the processes
    (the group's size) over tp; one process runs one rank of the [ep, tp]
    mesh, rank r of the group the mesh's rank r (ep rank r // tp, tp rank
    r % tp)."""
    if group is not None:
        if fabric not in (None, "group"):
            raise ValueError(f"moec: {who}: group= runs the ranks over a torch.distributed "
                             f"group, and fabric={fabric!r} says otherwise (leave it out, or "
                             "pass fabric='group')")
        fabric = "group"
    if fabric is None:
        fabric = _default_fabric()
    if fabric not in ("inproc", "mpi", "group"):
        raise ValueError(f"moec: fabric must be 'inproc', 'mpi' or 'group', got {fabric!r}")
    processes = None
    if fabric == "mpi":
        processes = _world_size() if ranks is None else None
    elif fabric == "group":
        import torch.distributed as dist
        if group is None:
            if not _distributed():
                raise ValueError(f"moec: {who}: fabric='group' needs torch.distributed "
                                 "initialized (torch.distributed.init_process_group, as "
                                 "torchrun's scripts do) or group=")
            group = dist.group.WORLD
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"moec: {who}: group must be a torch.distributed process group "
                            f"(torch.distributed.new_group, or group.WORLD), got "
                            f"{type(group).__name__}")
        processes = group.size()
        if ranks is not None and ranks * tp != processes:
            raise ValueError(f"moec: {who}: ranks={ranks} with tp={tp} is a mesh of "
                             f"{ranks * tp} ranks, and the group has {processes} processes "
                             "(one rank each)")
    if ranks is None:
        if processes is None:
            raise ValueError(f"moec: {who} needs ranks= (the EP group's size)")
        if processes % tp:
            raise ValueError(f"moec: {processes} processes do not make an [ep, tp] mesh with "
                             f"tp={tp} (ep * tp processes are needed)")
        ranks = processes // tp
    return fabric, checks.integer(ranks, f"{who}: argument 'ranks'", minimum=1), group


def _fabric_args(fabric, group):
    """The constructor arguments that name the fabric's group: its handle
    and timeout (native.group_handle) for "group", else none."""
    if fabric != "group":
        return 0, 0.0
    return native.group_handle(group)


def _register_finalize(fabric):
    """Runs finalize_mpi at exit once an MPI runtime object exists, and
    close_groups once one over a torch.distributed group does; called
    before creating one, whose construction may start MPI and then fail."""
    global _finalize_registered, _groups_registered
    if fabric == "mpi" and not _finalize_registered:
        atexit.register(finalize_mpi)
        _finalize_registered = True
    if fabric == "group" and not _groups_registered:
        atexit.register(close_groups)
        _groups_registered = True


def finalize_mpi():
    """Frees every MPI layer's runtime (collectively: every rank calls this
    once, at the end) and finalizes MPI if moec started it. The layers refuse
    passes after. Registered to run at exit once an MPI layer exists."""
    if _loaded:
        torch.ops.moec.finalize_mpi()


def close_groups(seconds=10.0):
    """Ends moec's fabrics over torch.distributed groups: tells every peer
    and waits at most `seconds` for theirs (collectively: every rank calls
    this once, at the end, before torch.distributed.destroy_process_group).
    Layers over a group fail their passes after. Registered to run at exit
    once such a layer exists."""
    if _loaded:
        torch.ops.moec.close_groups(float(seconds))


def compile_graphs(config, ranks, graphs, target="cpu", granularity="per-tile-range",
                   fresh=False, tp=None):
    """Returns the task-binary paths of `graphs` (file names in the graph
    folder) for `config` (a dict or a JSON path) on `ranks` EP ranks (of
    `tp` tensor-parallel ranks each; default: the config's tp, else 1),
    compiling them with the compiler library (native.compile) unless the
    cache has them (or `fresh`). The key covers the config, the graphs, the
    target (a profile file's contents, not only its path), the granularity
    and the compiler library itself. The cache is the folder $MOEC_CACHE_DIR
    (default ~/.cache/moec); one that is not a folder raises ValueError.

    A cache entry is a folder of the binaries, the config they were compiled
    for and manifest.json (each binary's size and sha256). A compile writes
    into a scratch folder beside it and renames that into place when every
    binary is there, so a failed compile leaves nothing behind. An entry
    whose binaries do not match its manifest (cut short, changed, missing)
    is removed and compiled anew, with a RuntimeWarning. MoeFFN also checks
    that the binaries it gets load and are the config's layer."""
    fresh = checks.boolean(fresh, "compile_graphs: argument 'fresh'")
    cfg = checks.read_config(config)
    cfg["ep"] = checks.integer(ranks, "compile_graphs: argument 'ranks'", minimum=1)
    cfg["tp"] = checks.integer(tp, "compile_graphs: argument 'tp'", minimum=1) \
        if tp is not None else checks.integer(cfg.get("tp", 1), "moec: config key 'tp'",
                                              minimum=1)
    moec = native.library_path()
    folder = native.graphs_dir()
    if not moec.is_file():
        raise RuntimeError(
            f"moec: the compiler library {moec} does not exist; install the moec_torch package, "
            "build it with 'bazel build //compiler/api:libmoec.so', or set MOEC_LIB")
    sources = [folder / g for g in graphs]
    # A target profile file: its contents are part of the key (an edited
    # profile is another target), and the compile reads this copy of them.
    profile_path = checks.target_file(target)
    profile = None if profile_path is None else \
        checks.read_small_file(profile_path, "target profile")
    key = hashlib.sha256()
    key.update(json.dumps(cfg, sort_keys=True).encode())
    # The cpu target takes its core counts from this machine.
    key.update(f"{target}|{granularity}|{os.cpu_count()}".encode())
    if profile is not None:
        key.update(b"profile|" + hashlib.sha256(profile).hexdigest().encode())
    lib = moec.stat()
    key.update(f"{moec.resolve()}|{lib.st_size}|{lib.st_mtime_ns}".encode())
    for source in sources:
        key.update(source.name.encode())
        key.update(source.read_bytes())
    digest = key.hexdigest()[:24]
    if digest in _compiled and not fresh:
        return _compiled[digest]
    entry = _cache_root() / digest
    outputs = tuple(entry / (Path(g).stem + ".moebin") for g in graphs)
    problem = "fresh" if fresh else _entry_problem(entry, outputs)
    if problem is not None:
        if problem not in ("fresh", "missing"):
            warnings.warn(f"moec: the compile cache entry {entry} is damaged ({problem}); "
                          "removed, compiling it anew", RuntimeWarning, stacklevel=3)
        _compile_entry(entry, sources, outputs, cfg, target, granularity, fresh, profile)
    _compiled[digest] = tuple(str(p) for p in outputs)
    return _compiled[digest]


def _cache_root():
    """The compile cache's folder: $MOEC_CACHE_DIR, else ~/.cache/moec. One
    that is there and is not a folder (a file, /dev/null) raises ValueError
    naming the variable and what it points at."""
    value = checks.env_value("MOEC_CACHE_DIR")
    root = Path(value) if value else Path.home() / ".cache/moec"
    where = checks.env_shown("MOEC_CACHE_DIR", value) if value else \
        f"the compile cache folder '{root}' (MOEC_CACHE_DIR is not set)"
    real = os.path.realpath(root)
    if real != os.path.abspath(root):
        where += f" (a link to '{real}')"
    try:
        mode = os.stat(root).st_mode
    except FileNotFoundError:
        return root  # made at the first compile
    except OSError as e:
        raise ValueError(f"moec: {where} cannot be used as the compile cache: "
                         f"{e.strerror}") from None
    if not stat.S_ISDIR(mode):
        kind = checks._kind(mode) or "a regular file"
        raise ValueError(f"moec: {where} is {kind}, not a folder; the compile cache is a "
                         "folder of compiled binaries: point MOEC_CACHE_DIR at a folder (it "
                         "is made if missing)")
    return root


MANIFEST = "manifest.json"


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _entry_problem(entry, outputs):
    """None when the cache entry `entry` holds `outputs` as its manifest
    lists them; "missing" when there is no entry; else what is wrong."""
    if not os.path.lexists(entry):
        return "missing"
    if not entry.is_dir():
        return "it is not a folder"
    try:
        manifest = json.loads(checks.read_small_file(entry / MANIFEST, "manifest"))
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        return f"no readable {MANIFEST}: an unfinished compile, or an older moec_torch's"
    for out in outputs:
        listed = files.get(out.name) if isinstance(files, dict) else None
        if not isinstance(listed, dict):
            return f"{MANIFEST} does not list {out.name}"
        if out.is_symlink() or not out.is_file():
            return f"{out.name} is missing or not a file"
        size = out.stat().st_size
        if size != listed.get("bytes"):
            return f"{out.name} has {size} bytes; {listed.get('bytes')} were written"
        if _sha256(out) != listed.get("sha256"):
            return f"{out.name} is not the binary that was written (its sha256 differs)"
    return None


def _remove(path):
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink()


def _compile_entry(entry, sources, outputs, cfg, target, granularity, fresh, profile=None):
    """Compiles `sources` for `cfg` into a scratch folder beside `entry`,
    writes the manifest last, and renames the folder into place. An entry
    already there is replaced, unless it is whole and another process
    finished it while this one compiled (ranks of an MPI job share the
    cache). `profile`: the bytes of the target profile file (the key's),
    compiled from a copy in the scratch folder."""
    root = entry.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=root, prefix=f".{entry.name}.compiling."))
    except OSError as e:
        value = checks.env_value("MOEC_CACHE_DIR")
        where = checks.env_shown("MOEC_CACHE_DIR", value) if value else \
            f"the compile cache folder '{root}'"
        raise ValueError(f"moec: {where} cannot be used as the compile cache: cannot write "
                         f"{e.filename or root}: {e.strerror}") from None
    started = time.time_ns()
    try:
        cfg_path = scratch / "config.json"
        cfg_path.write_text(json.dumps(cfg, indent=2))
        profile_path = None
        if profile is not None:
            profile_path = scratch / "target.json"
            profile_path.write_bytes(profile)
        files = {}
        for source, out in zip(sources, outputs):
            tmp = scratch / out.name
            try:
                native.compile(source, cfg_path, tmp,
                               target=target if profile_path is None else profile_path,
                               granularity=granularity)
            except RuntimeError as e:
                message = str(e).replace(str(cfg_path), "the config")
                if profile_path is not None:
                    message = message.replace(str(profile_path), os.fspath(target))
                raise RuntimeError(f"moec compile {source.name} failed:\n{message}") from None
            files[out.name] = {"bytes": tmp.stat().st_size, "sha256": _sha256(tmp)}
        (scratch / MANIFEST).write_text(json.dumps(
            {"written_ns": time.time_ns(), "files": files}, indent=2))
        for _ in range(8):
            try:
                os.rename(scratch, entry)
                return
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                    raise
            if _entry_problem(entry, outputs) is None:
                try:
                    written = json.loads((entry / MANIFEST).read_text())["written_ns"]
                except (OSError, ValueError, KeyError, TypeError):
                    written = 0
                if not fresh or written >= started:
                    return  # a whole entry another process made: keep it
            # Move the old entry aside (a rename: a process reading it keeps
            # its open files), then take its place.
            trash = Path(tempfile.mkdtemp(dir=root, prefix=f".{entry.name}.old."))
            try:
                os.rename(entry, trash / "entry")
            except FileNotFoundError:
                pass
            shutil.rmtree(trash, ignore_errors=True)
        raise RuntimeError(f"moec: cannot put the compiled binaries into {entry}: other "
                           "processes keep replacing it")
    finally:
        _remove(scratch)


# How the op library reports a binary it cannot load (Program::load).
_BINARY_ERROR = re.compile(r"moec (forward|backward|dispatch|combine) binary: ")


def _from_cache(compiled, make, problem_of=lambda runtime: None):
    """make(*compiled(False)): a runtime object over binaries from the
    compile cache. When they do not load (damaged after this process took
    them: the cache in memory does not look at the files again), or
    problem_of(runtime) names something wrong with them, warns and builds it
    again over binaries compiled anew (compiled(True))."""
    try:
        runtime = make(*compiled(False))
        problem = problem_of(runtime)
    except RuntimeError as e:
        if not _BINARY_ERROR.search(str(e)):
            raise
        runtime, problem = None, str(e).strip().splitlines()[0]
    if problem is None:
        return runtime
    warnings.warn(f"moec: the cached binaries cannot be used ({problem}); compiling them anew",
                  RuntimeWarning, stacklevel=3)
    runtime = make(*compiled(True))
    problem = problem_of(runtime)
    if problem is not None:
        raise RuntimeError(f"moec: {problem}")
    return runtime


LORA_TARGETS = ("w1", "w2")


def _lora_targets(lora_targets):
    """`lora_targets` as a tuple of names: one name ("w1") is one target, not
    its letters; a list, tuple or set is taken as it is. What is neither
    raises TypeError; the names are checked by _lora_suffix."""
    if isinstance(lora_targets, str):
        return (lora_targets,)
    if not isinstance(lora_targets, (bytes, bytearray)):
        try:
            return tuple(lora_targets)
        except TypeError:
            pass
    raise TypeError(f"moec: lora_targets must be a name or a tuple of names, some of "
                    f"{LORA_TARGETS}, got {lora_targets!r} ({type(lora_targets).__name__})")


def _lora_suffix(lora_targets):
    """The graphs' name suffix for adapters on `lora_targets`."""
    lora_targets = _lora_targets(lora_targets)
    targets = tuple(t for t in LORA_TARGETS if t in lora_targets)
    if not targets or any(t not in LORA_TARGETS for t in lora_targets):
        raise ValueError(f"moec: lora_targets must name some of {LORA_TARGETS}, "
                         f"got {lora_targets!r}")
    return "_lora" if targets == LORA_TARGETS else "_lora_" + targets[0]


def _layer_graphs(frozen, lora_targets, transposed=False, weight_format=None):
    """The graph files of a layer (compile_layer)."""
    if lora_targets:
        suffix = _lora_suffix(lora_targets)
        graphs = [f"moe_ffn_fwd{suffix}.json", f"moe_ffn_bwd{suffix}.json"]
    else:
        graphs = ["moe_ffn_fwd.json",
                  "moe_ffn_bwd_frozen.json" if frozen else "moe_ffn_bwd.json"]
    if transposed:
        if not (frozen or lora_targets):
            raise ValueError("moec: weights stored transposed (weights_transposed=True) need a "
                             "frozen or LoRA layer: the base weights' gradients are computed "
                             "in the [E, H, 2I] layout only")
        graphs = [g.replace(".json", "_transposed.json") for g in graphs]
    fmt = quant.parse(weight_format)
    if fmt is not None:
        if not transposed:
            raise ValueError(f"moec: {weight_format} weights are stored as checkpoints ship "
                             "them, [out, in]: the transposed layout (weights_transposed=True)")
        graphs = [g.replace(".json", fmt.graph_suffix + ".json") for g in graphs]
    return graphs


def compile_layer(config, ranks, target="cpu", granularity="per-tile-range", fresh=False,
                  frozen=False, lora_targets=None, tp=None, weights_transposed=False,
                  weight_format=None):
    """Returns (forward, backward) task-binary paths of the layer (see
    compile_graphs): moe_ffn_fwd.json, and moe_ffn_bwd_frozen.json (no weight
    gradients) with `frozen`, else moe_ffn_bwd.json. With `lora_targets`
    (some of "w1", "w2"; the config sets lora_rank): the graphs with LoRA
    adapters on those projections, moe_ffn_{fwd,bwd}_lora.json (both) or
    moe_ffn_{fwd,bwd}_lora_w1.json / _w2.json; one name ("w1") is one
    target. `weights_transposed`: their *_transposed.json forms, whose base
    weights are stored w1 [E, 2I, H], w2 [E, H, I] (frozen or LoRA only).
    `weight_format` (quant.WEIGHT_FORMATS): their quantized forms,
    *_transposed_{fp8,int8,int4,int4zp}.json (transposed layout only; an
    int4 format needs the config's weight_group).
    `frozen`, `fresh` and `weights_transposed` are bools."""
    frozen = checks.boolean(frozen, "compile_layer: argument 'frozen'")
    fresh = checks.boolean(fresh, "compile_layer: argument 'fresh'")
    weights_transposed = checks.boolean(weights_transposed,
                                        "compile_layer: argument 'weights_transposed'")
    lora_targets = _lora_targets(lora_targets) if lora_targets else ()
    graphs = _layer_graphs(frozen, lora_targets, weights_transposed, weight_format)
    return compile_graphs(config, ranks, graphs, target, granularity, fresh, tp)


def save_state(obj, path):
    """torch.save(obj, path) with the file replaced whole or not at all: a
    checkpoint (layer.state_dict(), an optimizer's, a dict of them) for
    torch.load. torch.save writes into memory, and the bytes go through
    safetensors.write_atomically (a scratch file in the folder, synced,
    renamed into place): a save that fails (a full disk) raises OSError
    naming the file and leaves the old file as it was. torch.save straight
    to a path cannot: in PyTorch 1.13 a failed write ends the process
    (its zip writer throws again as it is destroyed). The serialized bytes
    are held in memory once. Returns the path."""
    path = checks.output_path(path, "save_state", "the checkpoint")
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    safetensors.write_atomically(path, buffer.getbuffer())
    return Path(path)


def _check_finite(name, tensor, part, first):
    """Raises naming `name` and the first of its dim-0 slices (ranks from
    `first`, or experts) that holds NaN or infinity."""
    bad = ~torch.isfinite(tensor.detach())
    if bad.any():
        rows = bad.reshape(tensor.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
        raise ValueError(f"moec: '{name}' of {part} {first + rows[0]} holds "
                         f"{int(bad.sum())} NaN/inf value(s) in all"
                         + (f" ({part}s {[first + r for r in rows]})" if len(rows) > 1 else ""))


class _TpShare(torch.autograd.Function):
    """The tokens of each EP rank, once per TP rank: [P, ...] -> [P*T, ...]
    (rank e*T + t gets EP rank e's). Every TP rank returns the whole
    gradient of the shared tokens, so backward takes TP rank 0's (it does
    not sum them)."""

    @staticmethod
    def forward(ctx, t, tp):
        ctx.tp = tp
        return t.repeat_interleave(tp, 0)

    @staticmethod
    def backward(ctx, g):
        return g.unflatten(0, (-1, ctx.tp))[:, 0].contiguous(), None


class _TpTake(torch.autograd.Function):
    """The output of each EP rank from its TP ranks, which all hold the same
    bits: [P*T, ...] -> [P, ...] (TP rank 0's). Every TP rank's backward
    needs the whole output gradient, so backward gives it to each."""

    @staticmethod
    def forward(ctx, t, tp):
        ctx.tp = tp
        return t.unflatten(0, (-1, tp))[:, 0].contiguous()

    @staticmethod
    def backward(ctx, g):
        return g.repeat_interleave(ctx.tp, 0), None


def _to_tp(w1, w2, experts_per_rank, tp):
    """The weights of every TP rank, from the whole experts of this process's
    EP ranks: w1 [P*L, H, 2I] (gate columns, then up) -> [P*T*L, H, 2I/T],
    where TP rank t of an expert holds its gate and up columns
    t*I/T .. (t+1)*I/T - 1; w2 [P*L, I, H] -> [P*T*L, I/T, H], rows likewise.
    Rank e*T + t's experts come e*T + t-th. Differentiable (a permuted copy)."""
    L, T = experts_per_rank, tp
    n, h, two_i = w1.shape
    i = two_i // 2
    w1t = w1.view(n // L, L, h, 2, T, i // T).permute(0, 4, 1, 2, 3, 5) \
        .reshape(n * T, h, two_i // T)
    w2t = w2.view(n // L, L, T, i // T, h).permute(0, 2, 1, 3, 4).reshape(n * T, i // T, h)
    return w1t, w2t


def _from_tp(w1t, w2t, experts_per_rank, tp):
    """The inverse of _to_tp: per-TP-rank slices back to whole experts."""
    L, T = experts_per_rank, tp
    nt, h, two_is = w1t.shape
    n, i = nt // T, two_is // 2 * T
    w1 = w1t.view(n // L, T, L, h, 2, i // T).permute(0, 2, 3, 4, 1, 5).reshape(n, h, 2 * i)
    w2 = w2t.view(n // L, T, L, i // T, h).permute(0, 2, 1, 3, 4).reshape(n, i, h)
    return w1, w2


class _TpMainGrads:
    """main_grad under tensor parallelism in one process: when the backward
    pass starts, the main-grad buffers as the runtime's ranks hold them (each
    TP rank's slice, a copy); the runtime adds each rank's weight gradient
    into its slice inside the weight-gradient GMMs, as it adds into a
    rank's own buffer under MPI (the same bits); fold() copies the slices
    back into the whole experts' main_grad."""

    def __init__(self, weights, experts_per_rank, tp):
        self.weights, self.experts_per_rank, self.tp = weights, experts_per_rank, tp
        self.buffers = None

    def __iter__(self):
        self.buffers = tuple(t.contiguous() for t in _to_tp(
            *(w.main_grad for w in self.weights), self.experts_per_rank, self.tp))
        return iter(self.buffers)

    def fold(self):
        for w, g in zip(self.weights, _from_tp(*self.buffers, self.experts_per_rank, self.tp)):
            w.main_grad.copy_(g)
            w.grad_added_to_main_grad = True


class MoeFFNFunction(torch.autograd.Function):
    """y = MoE-FFN(x) on the moec runtime; backward gives dx, d topk_weights,
    dw1 and dw2 (topk_ids get no gradient). `done`, when given, is the
    (y, step) a submitted forward pass already gave (ForwardHandle.wait)."""

    @staticmethod
    def forward(ctx, layer, x, topk_ids, topk_weights, w1, w2, check_finite=False,
                first_rank=0, main_grads=None, done=None, *adapters):
        y, step = done if done is not None else torch.ops.moec.forward(
            layer, x, topk_ids, topk_weights, w1, w2, list(adapters))
        ctx.layer = layer
        ctx.step = step
        ctx.main_grads = main_grads
        ctx.check = (check_finite, first_rank, w1.shape[0] // max(1, x.shape[0]))
        ctx.save_for_backward(x, topk_ids, topk_weights, w1, w2, *adapters)
        ctx.mark_non_differentiable()
        return y

    @staticmethod
    def backward(ctx, dy):
        x, topk_ids, topk_weights, w1, w2, *adapters = ctx.saved_tensors
        main_grads = ctx.main_grads or (None, None)
        dx, dtopk, dw1, dw2, dadapters = torch.ops.moec.backward(
            ctx.layer, ctx.step, x, topk_ids, topk_weights, w1, w2, dy, *main_grads,
            adapters)
        if isinstance(ctx.main_grads, _TpMainGrads):
            ctx.main_grads.fold()
        _after_backward(ctx.check, ctx.main_grads, (w1, w2), dy,
                        Gradients(dx, dtopk, dw1, dw2, tuple(dadapters)))
        scales = [None] * (len(adapters) - len(dadapters))  # quantized weights' scales
        return (None, dx, None, dtopk, dw1, dw2, None, None, None, None, *dadapters, *scales)


Gradients = collections.namedtuple("Gradients",
                                   ["dx", "dtopk_weights", "dw1", "dw2", "adapters"])
Gradients.__doc__ = """What a backward pass gives: dx, dtopk_weights, dw1 and dw2 (None for a
frozen or LoRA layer, and with main_grad=True, whose gradients went into
w1.main_grad and w2.main_grad), and the adapters' gradients (A then B,
w1's then w2's; empty without LoRA)."""


def _after_backward(check, main_grads, weights, dy, grads):
    """What every backward does after the runtime's pass: Megatron's flag
    on main-grad weights, and the finite checks (check_finite)."""
    if main_grads:
        # Megatron's flag: the gradient went into main_grad, not .grad.
        for w in weights:
            w.grad_added_to_main_grad = True
    check_finite, first, local_experts = check
    if check_finite:
        _check_finite("dy", dy, "rank", first)
        for name, t in (("dx", grads.dx), ("dtopk_weights", grads.dtopk_weights)):
            _check_finite(name, t, "rank", first)
        for name, t in zip(("dw1", "dw2"), main_grads or (grads.dw1, grads.dw2)):
            if t is not None:
                _check_finite(name, t, "expert", first * local_experts)
        for i, t in enumerate(grads.adapters):
            _check_finite(f"adapter gradient {i}", t, "expert", first * local_experts)


class _Pending:
    """A pass submitted to the runtime, running on a thread of its own: a
    ticket of the op library's layer, waited once. Dropped unwaited, it
    waits for the pass, drops its result, and the module's next call raises."""

    what = "pass"

    def __init__(self, module, ticket, layer, reads=()):
        self.module = module
        self.layer = layer  # the runtime it runs on (growth replaces module.layer)
        self.ticket = ticket
        self.waited = False
        # What the pass reads while it runs, with each tensor's version
        # counter (bumped by every in-place change, as autograd's saved
        # tensors are checked): a change before wait() is an error there.
        self.reads = [(name, t, t._version) for name, t in reads if t is not None]

    def _check_unchanged(self):
        """Raises when a tensor the pass read was changed in place between
        submit and wait: the result would mix old and new values."""
        changed = [name for name, t, version in self.reads if t._version != version]
        if changed:
            raise RuntimeError(
                f"moec: {', '.join(repr(n) for n in changed)} changed in place after "
                f"submit_{self.what} and before wait(): the pass reads its inputs and weights "
                "while it runs, so its result would mix old and new values and is dropped. "
                "Keep every tensor a submitted pass reads (x, topk_ids, topk_weights, dy, the "
                "weights, adapters and scales) unchanged until wait() returns; to reuse a "
                "buffer, submit a clone")

    def done(self):
        """True once the pass has ended: wait() then returns at once."""
        return self.waited or self.layer.ready(self.ticket)

    def _take(self):
        if self.waited:
            raise RuntimeError(f"moec: this {self.what} handle was already waited "
                               "(a handle gives its result once)")
        self.waited = True

    def __del__(self):
        if getattr(self, "waited", True):
            return
        try:
            self.layer.discard(self.ticket)
        except Exception:  # noqa: BLE001 - the interpreter may be going down
            return
        self.module._dropped = (f"moec: a {self.what} handle (ticket {self.ticket}) was "
                                "dropped without wait(); its pass ran and its result is lost")
        warnings.warn(self.module._dropped, RuntimeWarning, stacklevel=2)


class ForwardHandle(_Pending):
    """What MoeFFN.submit_forward returns: wait() gives y. Under grad mode
    y takes part in autograd as the module's forward does; inside a custom
    autograd.Function's forward it is a plain tensor, and
    MoeFFN.submit_backward(handle, dy) gives the gradients."""

    what = "forward"

    def __init__(self, module, ticket, inputs, squeeze):
        super().__init__(module, ticket, module.layer,
                         list(zip(("x", "topk_ids", "topk_weights"), inputs)) +
                         module._read_parameters())
        self.inputs = inputs      # x, topk_ids, topk_weights (as the op took them)
        self.squeeze = squeeze
        self.step = None          # the runtime's pass, once waited

    def wait(self):
        """Waits for the forward pass and returns y (raises its error)."""
        self._take()
        m = self.module
        x, ids, weights = self.inputs
        try:
            done = self.layer.wait_forward(self.ticket)
        except RuntimeError as error:
            if "moec over capacity:" not in str(error) or self.layer is not m.layer:
                raise
            self._check_unchanged()
            m._grow(error)  # grows, or raises (the ranks decide together)
            self.layer = m.layer
            with torch.no_grad():
                done = torch.ops.moec.forward(self.layer, *m._mesh(x, ids, weights),
                                              m._bound())
        self._check_unchanged()
        self.step = done[1]
        y = m._unmesh(MoeFFNFunction.apply(self.layer, *m._mesh(x, ids, weights),
                                           m.check_finite, m.first_rank, m._main_grads(), done,
                                           *m._bound()))
        if m.check_finite:
            _check_finite("y", y, "rank", m.first_rank)
        return y.squeeze(0) if self.squeeze else y


class BackwardHandle(_Pending):
    """What MoeFFN.submit_backward returns: wait() gives the Gradients."""

    what = "backward"

    def __init__(self, module, ticket, layer, main_grads, dy, squeeze, inputs):
        super().__init__(module, ticket, layer,
                         [("dy", dy)] + list(zip(("x", "topk_ids", "topk_weights"), inputs)) +
                         module._read_parameters())
        self.main_grads = main_grads
        self.dy = dy
        self.squeeze = squeeze

    def wait(self):
        """Waits for the backward pass and returns its Gradients (dx and
        dtopk_weights shaped as the forward's inputs were)."""
        self._take()
        m = self.module
        dx, dtopk, dw1, dw2, dadapters = self.layer.wait_backward(self.ticket)
        self._check_unchanged()
        if m._tp_here():
            # Every TP rank's dx and dtopk_weights are the whole ones: TP rank
            # 0's; the weight gradients are slices of the whole experts'.
            dx, dtopk = (t.unflatten(0, (-1, m.tp))[:, 0].contiguous() for t in (dx, dtopk))
            if dw1 is not None:
                dw1, dw2 = _from_tp(dw1, dw2, m.local_experts, m.tp)
            if isinstance(self.main_grads, _TpMainGrads):
                self.main_grads.fold()
        grads = Gradients(dx, dtopk, dw1, dw2, tuple(dadapters))
        _after_backward((m.check_finite, m.first_rank, m.local_experts), self.main_grads,
                        (m.w1, m.w2), self.dy, grads)
        if self.squeeze:
            grads = grads._replace(dx=dx.squeeze(0), dtopk_weights=dtopk.squeeze(0))
        return grads


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

CAPACITY_POLICIES = ("grow", "error")


def _check_policy(policy):
    if not isinstance(policy, str) or policy not in CAPACITY_POLICIES:
        raise ValueError(f"moec: capacity_policy must be 'grow' or 'error', got {policy!r}")


def _matches(info, cfg, ranks, frozen=False, lora_targets=(), tp=1, transposed=False,
             weight_format=None):
    """True when a built layer's sizes are those of `cfg` on `ranks` EP
    ranks of `tp` TP ranks each."""
    fp8 = int(cfg.get("dispatch_dtype") == "fp8_e4m3")
    fmt = quant.parse(weight_format)
    targets = sum(1 << i for i, t in enumerate(LORA_TARGETS) if t in (lora_targets or ()))
    want = {"ranks": int(ranks) * tp, "tp": tp, "experts": int(cfg["num_experts"]),
            "hidden": int(cfg["hidden_size"]), "inter": int(cfg["intermediate_size"]) // tp,
            "top_k": int(cfg["top_k"]), "bf16": int(cfg.get("dtype", "bf16") == "bf16"),
            "frozen": int(bool(frozen) or targets != 0),
            "main_grad": int(bool(cfg.get("main_grad", False))),
            "lora_targets": targets, "lora_rank": int(cfg.get("lora_rank", 0)) if targets else 0,
            "fp8_dispatch": fp8, "weights_transposed": int(bool(transposed)),
            "weight_format": quant.FORMAT_CODES[fmt.kind if fmt else None],
            "weight_group": fmt.group if fmt else 0,
            "weight_zero_points": int(bool(fmt and fmt.zero_points))}
    return all(int(info[k]) == v for k, v in want.items())


class MoeFFN(torch.nn.Module):
    """The MoE-FFN layer of `config` (a dict or a JSON path, see
    docs/graph-format.md) on an EP group of `ranks` ranks (``ep=`` is the
    same argument).

    tp: expert tensor parallelism (default: the config's "tp", else 1): the
    layer runs on an [ep, tp] mesh of ep * tp ranks, and each expert's
    intermediate size I is split over the tp ranks of its EP rank (w1's gate
    and up columns column-parallel, w2's rows row-parallel); the tp ranks of
    an EP rank share its tokens, and their partial down projections are
    summed in the combine. In one process the module holds the whole
    experts and takes the EP ranks' tokens exactly as with tp=1, so the same
    script runs with either; under MPI process r is EP rank r // tp, TP rank
    r % tp, gives its EP rank's tokens, and holds w1 [L, H, 2I/tp] (gate then
    up columns of its slice) and w2 [L, I/tp, H], drawn so that a run with
    the same seed starts from the same whole weights. LoRA adapters are not
    supported with tp > 1.

    fabric: "inproc" (all ranks in this process) or "mpi" (one rank per
    process, under mpirun); default "mpi" when started by mpirun, else
    "inproc". Under MPI, `ranks` defaults to the number of processes.

    Parameters: w1 [P*L, H, 2I] (gate columns first, then up) and
    w2 [P*L, I, H], in the config's dtype, for the P ranks this process runs
    (in process P = R and P*L = E; under MPI P = 1, the rank's own experts).
    forward(x, topk_ids, topk_weights) takes x [P, S, H] (S up to the
    config's seq_size), topk_ids [P, S, K] (int32 or int64, distinct experts
    per token) and topk_weights [P, S, K] (float32), and returns y [P, S, H];
    with P = 1 the leading dim may be left out (x [S, H] -> y [S, H]).

    The weights are initialized from torch's global generator as the whole
    [E, ...] tensors, of which this process keeps its experts: every process
    draws the same numbers, so a run under MPI starts from the same weights
    as a run in one process with the same seed.

    threads: the runtime's worker threads (0: the hardware threads, at most
    1024). ranks, ep, tp, threads and lora_rank are integers (an int, or a
    numpy or torch integer scalar): a float or a bool raises TypeError
    naming the argument, nothing is rounded. check_finite, frozen,
    main_grad and trace are bools (a Python or numpy bool, or a 0-dim torch
    bool tensor): "no", 1 or None raises TypeError naming the argument, no
    value is taken as truthy. timeout_seconds is the watchdog of a pass (and
    under MPI of each wait for the other ranks): 0.001 to 1000000 seconds,
    as the CLI's --timeout, else ValueError.

    Tensors (x, topk_ids, topk_weights, dy, the weights and adapters) must
    be dense: a sparse, mkldnn or nested tensor raises ValueError naming it
    and its layout, a meta tensor RuntimeError, before any work.

    config: a dict, or the path of a regular file of at most 1 MiB; both go
    through checks.read_config (numpy scalars become numbers; non-finite
    numbers and values JSON cannot hold are refused naming the key).

    capacity_policy: what a step whose routing needs more rows than the
    compiled binary holds does (the config's ``capacity_factor``, and
    ``seq_size`` for more tokens than compiled). "grow" (the default)
    compiles (or takes from the cache) binaries with room for it, rebuilds
    the runtime, runs the step again and warns once per growth; the capacity
    never shrinks. "error" raises the runtime's over-capacity error instead.
    Under MPI growing is collective: every rank gets the error at the same
    pass, the ranks exchange their policy and need (bounded by
    timeout_seconds) before any recompiles, and either all grow or all
    raise, naming the ranks whose policy refused. The ranks must be given
    the same capacity_policy (a layer whose ranks differ raises ValueError
    on every rank, naming each rank's value).

    check_finite: raise a ValueError naming the tensor and rank (or expert)
    when an input, the output or a gradient holds NaN or infinity (they
    pass through the layer silently otherwise); off by default, it costs a
    pass over each tensor.

    trace: record every pass (its tasks, waits and phases) so that
    write_trace(path) writes the last one as a Chrome/Perfetto trace; off
    by default, it costs a few percent of a pass.

    frozen: the expert weights are frozen (requires_grad False): backward
    runs graphs/moe_ffn_bwd_frozen.json, which has no weight-gradient GMMs,
    and gives dx and d topk_weights only.

    main_grad: gradient-accumulation fusion, as Megatron's
    gradient_accumulation_fusion: w1.main_grad and w2.main_grad are fp32
    buffers the module owns, and every backward adds its weight gradients
    into them inside the weight-gradient GMMs (C += AᵀB, no separate add, no
    bf16 rounding of the running sum); w1.grad and w2.grad stay None, and
    backward sets w.grad_added_to_main_grad = True. The buffers start at
    zero; zero them between optimizer steps (zero_main_grad()), as a
    Megatron training loop does.

    lora_rank, lora_alpha, lora_targets: LoRA adapters on the experts, as
    PEFT puts them on a linear layer: for each target projection W ("w1",
    the gate/up projection, and/or "w2", the down projection; one name,
    lora_targets="w1", is that one target) of each
    expert, Y = X W + (lora_alpha / lora_rank) (X A) B with parameters
    w1_lora_A [P*L, H, r], w1_lora_B [P*L, r, 2I], w2_lora_A [P*L, I, r],
    w2_lora_B [P*L, r, H]. A is initialised as PEFT does (uniform in
    ±1/sqrt(fan_in), PEFT's kaiming_uniform(a=√5)), B to zero, so a fresh
    layer computes the base layer. The base weights are frozen (requires_grad
    False): backward gives dx, d topk_weights and the adapters' gradients
    only. lora_alpha defaults to lora_rank (a scaling of 1); it must be a
    positive finite number, and the config must not set lora_rank or
    lora_alpha (the module sets them). The adapters are
    graph nodes (graphs/moe_ffn_{fwd,bwd}_lora*.json), compiled and scheduled
    with the rest. merge_adapters() folds them into w1 and w2.

    dispatch_dtype: "fp8_e4m3" sends the dispatched token rows as FP8 e4m3
    with one fp32 scale per 128 values (about half the bytes of bf16 rows),
    dequantized to the compute dtype on arrival, as DeepEP's and Megatron's
    fp8_dispatch do; the combine, and everything backward sends, stay in the
    compute dtype. The default (None) takes the config's "dispatch_dtype",
    which defaults to the compute dtype. The experts then compute on the
    rounded rows, and backward treats the rounding as the identity (the
    gradients are those of the layer at the rounded x).

    weights_transposed: the base weights are stored with each expert's
    matrix transposed, w1 [P*L, 2I, H] (gate rows, then up) and w2
    [P*L, H, I]: the layout of Hugging Face's fused experts (transformers
    v5's gate_up_proj and down_proj), which the layer then reads in place
    (its forward GMMs read them transposed, its backward ones as they are;
    graphs/*_transposed.json). For a frozen or LoRA layer with tp=1 only
    (ValueError otherwise): the base weights' gradients are computed in the
    [P*L, H, 2I] layout. The adapters keep their layout (A [P*L, K, r],
    B [P*L, r, N] on the projection X W, W [K, N]).

    weight_format: stores the frozen base weights quantized, in the
    transposed layout (which weight_format implies), as codes w1, w2 and
    fp32 scales w1_scale, w2_scale (moec_torch.quant says each format):
      "fp8_block128": FP8 e4m3 codes (uint8 [P*L, 2I, H], [P*L, H, I]) with
        a scale per 128 x 128 block ([P*L, 2I/128, H/128], [P*L, H/128,
        I/128]): DeepSeek-V3's weight and weight_scale_inv as its checkpoint
        ships them; H and I multiples of 128;
      "int8": int8 codes with a scale per row ([P*L, 2I], [P*L, H]);
      "int4_g32", "int4_g64", "int4_g128": 4-bit codes two a byte (uint8
        [P*L, 2I, H/2], [P*L, H, I/2]) with a scale per group of G values
        along a row ([P*L, 2I, H/G], [P*L, H, I/G]); "int4_gG_zp": with a
        zero point per group too ([..., 2] pairs); H and I multiples of G.
    FP8 and int8 hold half the bytes of bf16, int4 a quarter (plus the
    scales). Each tile dequantizes the part it reads to the layer's dtype;
    outputs are those of the dense layer on the dequantized weights
    (dequantized_weights()). A frozen or LoRA layer only, tp=1.
    quantize_weights(weight_format) makes one from a dense layer.

    pack_weights: True keeps the weights the layer's matmuls read (w1, w2
    and the adapters) packed in the layout of moec's GEMM tile, each packed
    once, by the first tile that reads it, and again only when it changed:
    frozen weights are packed at the second pass and never again; trained
    ones once per optimizer step where several tiles read each part of
    them, else not at all. Off by default: it buys a frozen layer's step
    about 7% for two more copies of its frozen weights' bytes
    (docs/performance.md). PyTorch counts
    every in-place write to a tensor (an optimizer's, a copy_ into it or a
    view of it) and the layer reads that count at each pass; a write it
    does not count, through a parameter's .data, needs weights_changed()
    before the next pass. The outputs are the same bits as with False.
    Only where moec's tile runs
    the product (bf16 on a CPU with avx512_bf16; quantized base weights
    are not packed).

    init_weights: False leaves w1, w2 and the adapters uninitialized
    (torch.empty), for a caller that fills them (moec_torch.hf does, from a
    model or a checkpoint); drawing the whole experts costs seconds at a
    real model's size.

    A layer cannot be copied or pickled (copy.deepcopy, pickle, torch.save
    of the module raise TypeError): it owns a runtime. Its state is
    state_dict(); rebuild with MoeFFN(config, ...) and load_state_dict."""

    def __init__(self, config, ranks=None, *, ep=None, tp=None, threads=0, target="cpu",
                 granularity="per-tile-range", timeout_seconds=60.0, fabric=None,
                 capacity_policy="grow", check_finite=False, frozen=False, main_grad=False,
                 lora_rank=0, lora_alpha=None, lora_targets=LORA_TARGETS, trace=False,
                 dispatch_dtype=None, init_weights=True, weights_transposed=False,
                 weight_format=None, pack_weights=False, group=None):
        super().__init__()
        load_library()
        arg = "MoeFFN: argument "
        if ranks is not None:
            ranks = checks.integer(ranks, arg + "'ranks'", minimum=1)
        if ep is not None:
            ep = checks.integer(ep, arg + "'ep'", minimum=1)
            if ranks is not None and ranks != ep:
                raise ValueError(f"moec: ranks={ranks} and ep={ep} name the same thing; "
                                 "give one")
            ranks = ep
        threads = checks.integer(threads, arg + "'threads'", minimum=0, maximum=1024)
        timeout_seconds = checks.seconds(timeout_seconds, arg + "'timeout_seconds'")
        lora_rank = checks.integer(lora_rank, arg + "'lora_rank'", minimum=0)
        check_finite = checks.boolean(check_finite, arg + "'check_finite'")
        frozen = checks.boolean(frozen, arg + "'frozen'")
        main_grad = checks.boolean(main_grad, arg + "'main_grad'")
        trace = checks.boolean(trace, arg + "'trace'")
        init_weights = checks.boolean(init_weights, arg + "'init_weights'")
        weights_transposed = checks.boolean(weights_transposed, arg + "'weights_transposed'")
        pack_weights = checks.boolean(pack_weights, arg + "'pack_weights'")
        cfg = checks.read_config(config)
        # The files the layer reads, which no file it writes may be.
        self._config_file = None if isinstance(config, dict) else os.fspath(config)
        self._target_file = checks.target_file(target)
        tp = checks.integer(tp, arg + "'tp'", minimum=1) if tp is not None else \
            checks.integer(cfg.get("tp", 1), "moec: config key 'tp'", minimum=1)
        fabric, ranks, group = _fabric(fabric, group, ranks, tp, "MoeFFN")
        if tp > 1 and lora_rank:
            raise ValueError("moec: LoRA adapters are not supported with tensor parallelism "
                             f"(tp={tp}): their rank-r products would need a TP reduction of "
                             "their own; use tp=1")
        _check_policy(capacity_policy)
        if frozen and main_grad:
            raise ValueError("moec: a frozen layer has no weight gradients to accumulate "
                             "(frozen=True and main_grad=True)")
        if dispatch_dtype is not None:
            if dispatch_dtype not in ("fp8_e4m3", cfg.get("dtype", "bf16")):
                raise ValueError("moec: dispatch_dtype must be 'fp8_e4m3' or the config's dtype "
                                 f"({cfg.get('dtype', 'bf16')!r}), got {dispatch_dtype!r}")
            cfg["dispatch_dtype"] = dispatch_dtype
        self.dispatch_dtype = cfg.get("dispatch_dtype", cfg.get("dtype", "bf16"))
        lora_keys = [k for k in ("lora_rank", "lora_alpha") if k in cfg]
        if lora_keys:
            raise ValueError("moec: LoRA adapters are set by lora_rank= (and lora_alpha=) of "
                             f"the module, not the config (it sets {', '.join(lora_keys)})")
        if lora_rank:
            lora_targets = _lora_targets(lora_targets)
            _lora_suffix(lora_targets)
            if main_grad:
                raise ValueError("moec: main_grad buffers with LoRA adapters are not supported "
                                 "(the adapters' gradients go to .grad)")
            cfg["lora_rank"] = lora_rank
            cfg["lora_alpha"] = checks.number(lora_alpha, arg + "'lora_alpha'") \
                if lora_alpha is not None else float(lora_rank)
            frozen = True
        elif lora_alpha is not None:
            raise ValueError("moec: lora_alpha= needs lora_rank= (the adapters' rank)")
        fmt = quant.parse(weight_format)
        if fmt is not None:
            if not frozen:
                raise ValueError(f"moec: weight_format={weight_format!r} needs a frozen or LoRA "
                                 "layer (frozen=True or lora_rank=): quantized weights get no "
                                 "gradients")
            weights_transposed = True
            fmt.check_sizes(cfg.get("hidden_size"), cfg.get("intermediate_size"))
            for key, value in fmt.config().items():
                if cfg.get(key, value) != value:
                    raise ValueError(f"moec: the config's {key!r} is {cfg[key]!r}, and "
                                     f"weight_format={weight_format!r} says {value}")
                cfg[key] = value
        self.weight_format = weight_format
        if weights_transposed and not frozen:
            raise ValueError("moec: weights_transposed=True needs a frozen or LoRA layer "
                             "(frozen=True or lora_rank=): the base weights' gradients are "
                             "computed in the [E, H, 2I] layout only")
        if weights_transposed and tp > 1:
            raise ValueError(f"moec: weights_transposed=True is not supported with tensor "
                             f"parallelism (tp={tp}); use tp=1")
        self.weights_transposed = weights_transposed
        self.tp = tp
        self.lora_targets = tuple(t for t in LORA_TARGETS if t in lora_targets) \
            if lora_rank else ()
        self.lora_rank = lora_rank
        self.lora_scaling = cfg["lora_alpha"] / lora_rank if lora_rank else 0.0
        if main_grad:
            cfg["main_grad"] = True
        elif cfg.get("main_grad"):
            raise ValueError("moec: the config sets \"main_grad\"; pass main_grad=True to the "
                             "module, which owns the buffers")
        self.config = cfg
        self.capacity_policy = capacity_policy
        self.check_finite = check_finite
        self.frozen = bool(frozen)
        self.main_grad = bool(main_grad)
        self._build = (threads, timeout_seconds, target, granularity, fabric, trace)
        self.group = group
        self.pack_weights = pack_weights
        _register_finalize(fabric)

        def compiled(fresh):
            return compile_layer(cfg, ranks, target, granularity, fresh=fresh,
                                 frozen=self.frozen, lora_targets=self.lora_targets, tp=tp,
                                 weights_transposed=weights_transposed,
                                 weight_format=weight_format)

        def other_layer(layer):
            info = layer.info()
            if not _matches(info, cfg, ranks, self.frozen, self.lora_targets, tp,
                            weights_transposed, weight_format):
                return f"the compiled layer {dict(info)} is not the config's {cfg}"
            return None

        self.layer = _from_cache(compiled, self._runtime_layer, other_layer)
        self._binaries = self._made
        info = self.layer.info()
        self._writes_trace = info["first_rank"] == 0  # under MPI, rank 0 writes
        self.fabric = fabric
        # Ranks in other processes (MPI): what the binaries do not carry is
        # agreed through the fabric's bounded exchange.
        self._collective = fabric in ("mpi", "group") and info["local_ranks"] < info["ranks"]
        if self._collective:
            self._agree_options({"capacity_policy": capacity_policy})
        # EP ranks; the runtime's ranks are the [ep, tp] mesh's.
        self.ranks = info["ranks"] // tp
        self.first_rank = info["first_rank"] // tp
        self.local_ranks = max(1, info["local_ranks"] // tp)
        # The TP rank this process runs (under MPI), or None (all of them).
        self.tp_rank = info["first_rank"] % tp if info["local_ranks"] < tp else None
        self.experts = info["experts"]
        self.local_experts = self.experts // self.ranks
        self.hidden = info["hidden"]
        self.inter = info["inter"] * tp
        self.top_k = info["top_k"]
        self.tokens = info["tokens"]
        dtype = torch.bfloat16 if info["bf16"] else torch.float32
        self.dtype = dtype  # of the activations and the computation
        mine = self.local_ranks * self.local_experts
        # The intermediate columns this process holds: all, or its TP slice.
        self.local_inter = self.inter if self.tp_rank is None else self.inter // tp
        w1, w2 = (self.hidden, 2 * self.local_inter), (self.local_inter, self.hidden)
        if weights_transposed:
            w1, w2 = w1[::-1], w2[::-1]
        stored = fmt.codes_dtype if fmt else dtype
        self.w1 = torch.nn.Parameter(
            torch.empty(mine, *(fmt.stored_shape(*w1) if fmt else w1), dtype=stored),
            requires_grad=not self.frozen)
        self.w2 = torch.nn.Parameter(
            torch.empty(mine, *(fmt.stored_shape(*w2) if fmt else w2), dtype=stored),
            requires_grad=not self.frozen)
        if fmt:  # the codes' fp32 scales (quant)
            for name, shape in (("w1_scale", w1), ("w2_scale", w2)):
                setattr(self, name, torch.nn.Parameter(
                    torch.empty(mine, *fmt.scale_shape(*shape)), requires_grad=False))
        if self.main_grad:
            for w in (self.w1, self.w2):
                w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
        # Adapters: A [P*L, K, r] and B [P*L, r, N] on a projection [P*L, K, N].
        for name in self.lora_targets:
            k, n = self._projection(name)
            setattr(self, f"{name}_lora_A", torch.nn.Parameter(
                torch.empty(mine, k, lora_rank, dtype=dtype)))
            setattr(self, f"{name}_lora_B", torch.nn.Parameter(
                torch.empty(mine, lora_rank, n, dtype=dtype)))
        if init_weights:
            self.reset_parameters()
        self._register_load_state_dict_pre_hook(self._check_checkpoint)

    def _projection(self, name):
        """(K, N) of projection "w1" [L, H, 2I] or "w2" [L, I, H]."""
        return (self.hidden, 2 * self.inter) if name == "w1" else (self.inter, self.hidden)

    def projections(self, w1=None, w2=None):
        """(gate [N, I, H], up [N, I, H], down [N, H, I]): views of w1 and w2
        (default the layer's) as the experts' nn.Linear weights [out, in],
        whichever layout the layer stores them in."""
        w1 = self.w1 if w1 is None else w1
        w2 = self.w2 if w2 is None else w2
        i = self.local_inter
        if self.weights_transposed:
            return w1[:, :i], w1[:, i:], w2
        return w1[:, :, :i].transpose(1, 2), w1[:, :, i:].transpose(1, 2), w2.transpose(1, 2)

    def adapters(self):
        """The LoRA parameters in the order the op takes them: A then B, on
        w1 then w2 (those in lora_targets)."""
        return [getattr(self, f"{name}_lora_{m}") for name in self.lora_targets for m in "AB"]

    def _read_parameters(self):
        """(name, tensor) of the parameters a pass reads: w1, w2, the
        adapters, the scales."""
        return [("w1", self.w1), ("w2", self.w2)] + \
            [(n, getattr(self, n)) for n in (
                [f"{t}_lora_{m}" for t in self.lora_targets for m in "AB"] +
                (["w1_scale", "w2_scale"] if self.weight_format else []))]

    def _bound(self):
        """What the op takes after w1 and w2: the adapters, then the block
        scales of quantized weights."""
        scales = [self.w1_scale, self.w2_scale] if self.weight_format else []
        return self.adapters() + scales

    def merged_weights(self):
        """(w1, w2) with the adapters folded in: W + (lora_alpha / r) A B per
        expert, computed in float32 and returned in the weights' dtype."""
        merged = []
        with torch.no_grad():
            for name, w in zip(LORA_TARGETS, self.dequantized_weights()):
                if name in self.lora_targets:
                    a = getattr(self, f"{name}_lora_A").float()
                    b = getattr(self, f"{name}_lora_B").float()
                    ab = torch.bmm(a, b)
                    if self.weights_transposed:
                        ab = ab.transpose(1, 2)
                    w = (w.float() + self.lora_scaling * ab).to(w.dtype)
                merged.append(w.detach().clone())
        return tuple(merged)

    def dequantized_weights(self):
        """(w1, w2) as the layer computes with them, in its dtype: the
        weights themselves, or for quantized ones code x scale (views of the
        parameters where they are dense)."""
        if not self.weight_format:
            return self.w1, self.w2
        return tuple(quant.dequantize(self.weight_format, getattr(self, n),
                                      getattr(self, n + "_scale"), self.dtype)
                     for n in LORA_TARGETS)

    def weights_changed(self):
        """Says that the layer's weights were written where PyTorch does not
        count it (through a parameter's .data): the next pass packs them
        again (pack_weights). Writes PyTorch counts need no call."""
        self.layer.weights_changed()

    def quantize_weights(self, weight_format="fp8_block128"):
        """A new layer with this one's configuration and options, its base
        weights quantized to `weight_format` (frozen, in the transposed
        layout) and its adapters copied: the fine-tuning form of a dense
        layer. This layer is left as it is."""
        threads, timeout, target, granularity, fabric, trace = self._build
        config = {k: v for k, v in self.config.items()
                  if k not in ("lora_rank", "lora_alpha", "main_grad")}
        options = dict(lora_rank=self.lora_rank, lora_targets=self.lora_targets,
                       lora_alpha=self.lora_scaling * self.lora_rank) if self.lora_rank \
            else dict(frozen=True)
        layer = MoeFFN(config, self.ranks, tp=self.tp, threads=threads, target=target,
                       granularity=granularity, timeout_seconds=timeout, fabric=fabric,
                       group=self.group, capacity_policy=self.capacity_policy, check_finite=self.check_finite,
                       trace=trace, init_weights=False, weight_format=weight_format,
                       pack_weights=self.pack_weights, **options)
        with torch.no_grad():
            for name, w in zip(LORA_TARGETS, self.dequantized_weights()):
                if not self.weights_transposed:
                    w = w.transpose(1, 2)
                for j in range(w.shape[0]):  # an expert at a time: no float copy of all
                    codes, scales = quant.quantize(weight_format, w[j:j + 1])
                    getattr(layer, name)[j].copy_(codes[0])
                    getattr(layer, name + "_scale")[j].copy_(scales[0])
            for mine, theirs in zip(self.adapters(), layer.adapters()):
                theirs.copy_(mine)
        return layer

    def merge_adapters(self):
        """Folds the adapters into w1 and w2 (merged_weights()) and zeroes
        the B matrices, so the layer computes the same function with the
        adapters contributing nothing; training may go on from there."""
        if self.weight_format:
            raise ValueError(f"moec: the adapters cannot be folded into {self.weight_format} "
                             "weights (the merged weights are dense): merged_weights() gives "
                             "them")
        w1, w2 = self.merged_weights()
        with torch.no_grad():
            self.w1.copy_(w1)
            self.w2.copy_(w2)
            for name in self.lora_targets:
                getattr(self, f"{name}_lora_B").zero_()

    def zero_main_grad(self):
        """Zeroes w1.main_grad and w2.main_grad (main_grad=True)."""
        if not self.main_grad:
            raise RuntimeError("moec: this layer has no main_grad buffers (main_grad=False)")
        for w in (self.w1, self.w2):
            w.main_grad.zero_()
            w.grad_added_to_main_grad = False

    def _draw(self, param, bound, weight=None, store=None):
        """Draws the whole [E, ...] tensor uniform in ±bound, one expert at a
        time (the same numbers as one draw of the whole: the CPU generator
        fills in element order), and keeps this process's experts: the
        process never holds the other ranks' experts. `weight` ("w1", "w2")
        names the weight whose values are drawn where `param` is not that
        parameter itself, and `store(j, values)` then keeps local expert
        j's values (a quantized weight's codes and scales) instead of
        param[j].copy_(values)."""
        first = self.first_rank * self.local_experts
        weight = weight or ("w1" if param is self.w1 else "w2" if param is self.w2 else None)
        whole = (self.hidden, 2 * self.inter) if weight == "w1" else \
            (self.inter, self.hidden) if weight == "w2" else param.shape[1:]
        store = store or (lambda j, values: param[j].copy_(values))
        one = torch.empty(1, *whole)
        for e in range(self.experts):
            one.uniform_(-bound, bound)
            if first <= e < first + param.shape[0]:
                drawn = self._tp_slice(param, one[0])
                if self.weights_transposed and weight:
                    drawn = drawn.t()
                store(e - first, drawn)

    def _tp_slice(self, param, whole):
        """This process's TP slice of one expert's whole w1 [H, 2I] (gate and
        up columns) or w2 [I, H] (rows); the whole when it holds all."""
        if self.tp_rank is None or not (param is self.w1 or param is self.w2):
            return whole
        i, t = self.inter // self.tp, self.tp_rank
        if param is self.w1:
            return torch.cat((whole[:, t * i:(t + 1) * i],
                              whole[:, self.inter + t * i:self.inter + (t + 1) * i]), 1)
        return whole[t * i:(t + 1) * i]

    def reset_parameters(self):
        """Draws the whole [E, ...] weights and keeps this process's experts."""
        with torch.no_grad():
            for name, bound in (("w1", 1 / math.sqrt(self.hidden)),
                                ("w2", 1 / math.sqrt(self.inter))):
                param = getattr(self, name)
                if not self.weight_format:
                    self._draw(param, bound)
                    continue
                # Drawn, then quantized, an expert at a time ([out, in], the
                # transposed layout): no dense copy of the whole weight.
                scale = getattr(self, name + "_scale")

                def store(j, values, param=param, scale=scale):
                    codes, scales = quant.quantize(self.weight_format, values.unsqueeze(0))
                    param[j].copy_(codes[0])
                    scale[j].copy_(scales[0])

                self._draw(param, bound, name, store)
            for name in self.lora_targets:
                # PEFT: A kaiming_uniform(a=sqrt(5)) over fan_in K, i.e.
                # uniform in ±1/sqrt(K); B zero.
                a = getattr(self, f"{name}_lora_A")
                self._draw(a, 1 / math.sqrt(a.shape[1]))
                getattr(self, f"{name}_lora_B").zero_()

    def _tp_here(self):
        """True when this process runs several TP ranks of its EP ranks (one
        process, tp > 1): its tensors go to the runtime's ranks converted."""
        return self.tp > 1 and self.tp_rank is None

    def _mesh(self, x, topk_ids, topk_weights):
        """(x, topk_ids, topk_weights, w1, w2) as the runtime's ranks take them:
        with several TP ranks here, each EP rank's tokens once per TP rank and
        each rank's slice of the experts (differentiable)."""
        if not self._tp_here():
            return x, topk_ids, topk_weights, self.w1, self.w2
        T = self.tp
        w1, w2 = _to_tp(self.w1, self.w2, self.local_experts, T)
        return (_TpShare.apply(x, T), topk_ids.repeat_interleave(T, 0),
                _TpShare.apply(topk_weights, T), w1, w2)

    def _unmesh(self, y):
        """An output of the runtime's ranks as the module gives it."""
        return _TpTake.apply(y, self.tp) if self._tp_here() else y

    def _main_grads(self):
        if not self.main_grad:
            return None
        if self._tp_here():
            return _TpMainGrads((self.w1, self.w2), self.local_experts, self.tp)
        return (self.w1.main_grad, self.w2.main_grad)

    def _check_dropped(self):
        """Raises, once, for a submitted pass whose handle was dropped unwaited."""
        dropped, self._dropped = getattr(self, "_dropped", None), None
        if dropped:
            raise RuntimeError(dropped)

    def _unsqueezed(self, x, *rest):
        """(squeeze, tensors): [S, ...] inputs of a one-rank process get
        their rank dim."""
        squeeze = x.dim() == 2 and self.local_ranks == 1
        tensors = (x, *rest)
        return squeeze, tuple(t.unsqueeze(0) for t in tensors) if squeeze else tensors

    def _check_inputs(self, x, topk_weights):
        if self.check_finite:
            for name, t in (("x", x), ("topk_weights", topk_weights)):
                _check_finite(name, t, "rank", self.first_rank)
            for name, t in (("w1", self.w1), ("w2", self.w2)):
                _check_finite(name, t, "expert", self.first_rank * self.local_experts)

    def _check_dense(self, **tensors):
        """Refuses (checks.dense) an input, weight or adapter that is not a
        dense tensor with data (sparse, mkldnn, nested, meta), naming it."""
        for name, t in tensors.items():
            checks.dense(t, name)
        for name in ("w1", "w2", *(f"{t}_lora_{m}" for t in self.lora_targets for m in "AB")):
            checks.dense(getattr(self, name), name)

    def forward(self, x, topk_ids, topk_weights):
        self._check_dropped()
        self._check_dense(x=x, topk_ids=topk_ids, topk_weights=topk_weights)
        squeeze, (x, topk_ids, topk_weights) = self._unsqueezed(x, topk_ids, topk_weights)
        self._check_inputs(x, topk_weights)
        while True:
            try:
                y = self._unmesh(MoeFFNFunction.apply(
                    self.layer, *self._mesh(x, topk_ids, topk_weights), self.check_finite,
                    self.first_rank, self._main_grads(), None, *self._bound()))
                if self.check_finite:
                    _check_finite("y", y, "rank", self.first_rank)
                return y.squeeze(0) if squeeze else y
            except RuntimeError as error:
                if "moec over capacity:" not in str(error):
                    raise
                self._grow(error)  # grows, or raises (the ranks decide together)

    def submit_forward(self, x, topk_ids, topk_weights):
        """Starts forward(x, topk_ids, topk_weights) on a thread of its own and
        returns a ForwardHandle at once; its wait() gives y, which under grad
        mode takes part in autograd as forward's does. Python work between
        the two runs beside the pass. Every handle must be waited exactly
        once: a second wait() raises, and a handle dropped unwaited makes the
        module's next call raise (its pass still runs to its end first).
        Passes of one module run one at a time, in the order submitted."""
        self._check_dropped()
        self._check_dense(x=x, topk_ids=topk_ids, topk_weights=topk_weights)
        squeeze, (x, topk_ids, topk_weights) = self._unsqueezed(x, topk_ids, topk_weights)
        self._check_inputs(x, topk_weights)
        with torch.no_grad():
            mesh = self._mesh(x, topk_ids, topk_weights)
        ticket = self.layer.submit_forward(*mesh, [a.detach() for a in self._bound()])
        return ForwardHandle(self, ticket, (x, topk_ids, topk_weights), squeeze)

    def submit_backward(self, handle, dy):
        """Starts the backward pass of the waited forward `handle` for the
        output gradient dy and returns a BackwardHandle at once; its wait()
        gives the Gradients (dx, dtopk_weights, dw1, dw2, adapters), for a
        custom autograd.Function to return. As forward's backward: with
        main_grad=True the weight gradients are added into main_grad."""
        self._check_dropped()
        if not isinstance(handle, ForwardHandle) or handle.module is not self:
            raise ValueError("moec: submit_backward takes a ForwardHandle of this module")
        if handle.step is None:
            raise RuntimeError("moec: wait() the forward handle before submitting its backward")
        self._check_dense(dy=dy)
        x, ids, weights = handle.inputs
        squeeze, (dy,) = self._unsqueezed(dy) if handle.squeeze else (False, (dy,))
        main_grads = self._main_grads()
        with torch.no_grad():
            mesh = self._mesh(x, ids, weights)
            dy_mesh = dy.repeat_interleave(self.tp, 0) if self._tp_here() else dy
        ticket = handle.layer.submit_backward(
            handle.step, *mesh, dy_mesh.detach(), *(main_grads or (None, None)),
            [a.detach() for a in self._bound()])
        return BackwardHandle(self, ticket, handle.layer, main_grads, dy, squeeze,
                              handle.inputs)

    @property
    def capacity_policy(self):
        """"grow" or "error" (see the class); may be set after construction.
        Under MPI the ranks decide together at each over-capacity error."""
        return self._capacity_policy

    @capacity_policy.setter
    def capacity_policy(self, value):
        _check_policy(value)
        self._capacity_policy = value

    def _agree(self, mine, what):
        """Every process's `mine` (a dict, sent as JSON), in rank order:
        one bounded exchange over the layer's fabric (timeout_seconds); a
        failure raises RuntimeError("`what`: ...") naming the ranks that did
        not come. Collective under MPI: every rank calls it at the same
        point of its passes."""
        try:
            texts = self.layer.agree(json.dumps(mine, sort_keys=True))
        except RuntimeError as e:
            raise RuntimeError(f"{what}: {e}") from None
        views = []
        for r, text in enumerate(texts):
            try:
                view = json.loads(text)
            except ValueError:
                view = None
            if not isinstance(view, dict):
                raise RuntimeError(f"{what}: rank {r} sent {text[:200]!r}, not a moec_torch "
                                   "agreement (the ranks run different moec_torch)")
            views.append(view)
        return views

    def _agree_options(self, options):
        """Refuses, on every rank, options that differ between the ranks of
        an MPI layer (naming every rank's value): they decide what a rank
        does at a collective point (capacity_policy: whether it grows)."""
        views = self._agree(options, "moec: making the layer: the ranks could not compare "
                            "their options")
        for key, value in options.items():
            values = [v.get(key) for v in views]
            if any(v != value for v in values):
                raise ValueError(
                    f"moec: the ranks of an MPI layer must be given the same {key} (growing "
                    "the layer is collective: every rank grows, or none does); got "
                    + ", ".join(f"{v!r} on rank {r}" for r, v in enumerate(values)))

    def _grow(self, error):
        """After a pass the runtime refused for capacity (`error`; under
        MPI every rank gets it at the same pass), either raises or
        recompiles with room for the routing (the need the runtime recorded)
        and rebuilds the runtime; the weights stay. In one process that is
        capacity_policy's choice. Under MPI it is every rank's: before any
        rank recompiles, the ranks exchange their policy and need (bounded
        by timeout_seconds), and all grow only when every rank's policy is
        "grow", else every rank raises, naming the ranks whose policy
        refused; after compiling they exchange whether each could, so that
        none builds the grown runtime alone."""
        message = str(error)
        need = dict(self.layer.capacity_need())
        if self._collective:
            views = self._agree({"policy": self.capacity_policy, "need": need},
                                f"{message}. The ranks could not decide whether to grow the "
                                "layer")
            policies = [v.get("policy") for v in views]
            refusing = [r for r, p in enumerate(policies) if p != "grow"]
            if len(refusing) == len(policies):
                raise error  # every rank's policy is "error": each raises it
            if refusing:
                raise RuntimeError(
                    f"{message}. No rank grows the layer: capacity_policy "
                    + ", ".join(f"{policies[r]!r} on rank {r}" for r in refusing)
                    + " refuses it, and the ranks grow together or not at all ("
                    + ", ".join(f"{p!r} on rank {r}" for r, p in enumerate(policies)
                                if r not in refusing) + ")") from None
            for key in ("rows_per_rank", "receive_per_rank"):
                need[key] = max(int(v.get("need", {}).get(key, 0)) for v in views)
        elif self.capacity_policy != "grow":
            raise error
        cfg = dict(self.config)
        advice = native.capacity_advice(dict(cfg, ep=self.ranks, tp=self.tp),
                                        need["rows_per_rank"], need["receive_per_rank"],
                                        headroom=True)
        if not advice["fits"]:
            raise RuntimeError(
                "moec over capacity: the routing needs more than the largest binary for this "
                f"layer holds ({need['receive_per_rank']} rows on one rank's experts)")
        changes = []
        if advice["seq_size"] != int(cfg["seq_size"]):
            changes.append(f"seq_size {self.tokens} -> {advice['seq_size']}")
            cfg["seq_size"] = advice["seq_size"]
        old_factor = float(cfg.get("capacity_factor", 2))
        if advice["capacity_factor"] != old_factor:
            # Room for the routing that was refused, and then some: a router's
            # balance drifts, and each growth costs a compile.
            cfg["capacity_factor"] = advice["capacity_factor"]
            changes.append(f"capacity_factor {old_factor:g} -> {cfg['capacity_factor']:g}")
        if not changes:
            raise RuntimeError(
                "moec over capacity: the routing needs no more than the config holds, yet the "
                f"runtime refused it ({need}); this is a bug in moec")
        target, granularity = self._build[2:4]

        def compiled(fresh):
            return compile_layer(cfg, self.ranks, target, granularity, fresh=fresh,
                                 frozen=self.frozen, lora_targets=self.lora_targets, tp=self.tp,
                                 weights_transposed=self.weights_transposed,
                                 weight_format=self.weight_format)

        if self._collective:
            # Every rank compiles; none builds the grown runtime (whose fabric
            # every rank creates together) unless all could.
            try:
                paths, failure = compiled(False), None
            except Exception as e:  # noqa: BLE001 - every failure is told to the peers
                paths, failure = None, f"{type(e).__name__}: {e}"
            # (500 characters fit agree()'s 4096 bytes even as JSON escapes.)
            views = self._agree({"compiled": failure is None, "error": (failure or "")[:500]},
                                f"{message}. The ranks could not tell each other whether "
                                "they compiled the grown layer")
            failed = [(r, v.get("error")) for r, v in enumerate(views) if not v.get("compiled")]
            if failed:
                raise RuntimeError(
                    f"{message}. The layer grows on no rank: compiling the grown layer failed on "
                    + "; ".join(f"rank {r}: {e}" for r, e in failed)) from None
        else:
            paths = compiled(False)
        layer = _from_cache(lambda fresh: compiled(True) if fresh else paths,
                            self._runtime_layer)
        info = layer.info()
        warnings.warn(
            f"moec: a step's routing needed {need['receive_per_rank']} rows on the fullest "
            f"rank's experts (room for {need['receive_capacity']}) and "
            f"{need['rows_per_rank']} routed rows (room for {need['row_capacity']}); "
            f"recompiled with {', '.join(changes)}", RuntimeWarning, stacklevel=3)
        self.config = cfg
        self.layer = layer
        self._binaries = self._made
        self.tokens = info["tokens"]

    def _runtime_layer(self, forward, backward):
        threads, timeout, _, _, fabric, trace = self._build
        layer = torch.classes.moec.Layer(forward, backward, threads, timeout, fabric, trace,
                                         self.pack_weights, *_fabric_args(fabric, self.group))
        self._made = (forward, backward)
        return layer

    def _read_files(self):
        """(what, path) of every file the layer reads: its config file (when
        given as a path), the target profile file, the task binaries, the
        graphs they were compiled from and the libraries. A file the layer
        writes (write_trace, save_adapters) must be none of them."""
        files = [("config", self._config_file), ("target profile", self._target_file)]
        files += [(f"{kind} binary", path)
                  for kind, path in zip(("forward", "backward"), self._binaries)]
        files += [("graph", native.graphs_dir() / g)
                  for g in _layer_graphs(self.frozen, self.lora_targets, self.weights_transposed,
                                         self.weight_format)]
        files += [("op library", native.op_library_path()),
                  ("compiler library", native.library_path())]
        return files

    def _output(self, path, who, argument, writes=True, collective=False):
        """`path` checked (checks.output_path) by the process that writes
        it (`writes`). For a collective call under MPI (`collective`) the
        ranks then agree, so that a path rank 0 refuses is refused on every
        rank rather than leaving the others waiting for it."""
        problem = None
        if writes:
            try:
                path = checks.output_path(path, who, argument, self._read_files())
            except ValueError as e:
                problem = str(e)
        if collective and self._collective:
            # (1000 characters fit agree()'s 4096 bytes even as JSON escapes.)
            views = self._agree({"refused": problem and problem[:1000]},
                                f"moec: {who}: the ranks could not "
                                "compare whether the path can be written")
            refused = [(r, v.get("refused")) for r, v in enumerate(views) if v.get("refused")]
            if refused and problem is None:
                problem = "; ".join(f"{text} (on rank {r})" for r, text in refused)
        if problem is not None:
            raise ValueError(problem)
        return os.fspath(path)

    def times(self):
        """Seconds of the last passes: forward and backward, each as
        (prepare, tasks, finish)."""
        t = self.layer.times()
        return {"forward": tuple(t[0:3]), "backward": tuple(t[3:6])}

    def write_trace(self, path, which="last"):
        """Writes the trace of the last "forward", "backward" or either
        ("last") pass to `path` as Chrome/Perfetto JSON, the format of
        ``moec run --trace``: the pass as it ran in this process (its
        tasks with their tiles, the waits with arrows from the signals that
        ended them, the prepare, tasks and finish phases). Needs
        ``trace=True`` at construction. Under MPI it is collective: every
        process calls it, and rank 0 writes one trace of every rank to
        `path` (the others write nothing).

        `path` is checked before the trace is gathered or built: its folder
        must exist, and it must not be the same file (links followed) as
        the config file, the target profile, the binaries, the graphs or
        the libraries the layer reads (ValueError naming both)."""
        path = self._output(path, "write_trace", "the trace path", self._writes_trace,
                            collective=True)
        self.layer.write_trace(path, which)

    def profile(self, which="forward"):
        """Where the last "forward" or "backward" pass's time went, as the
        table ``moec run --profile`` prints: per op its busy time, FLOPs or
        bytes, rate per core and share of one core's measured peak (measured
        once per process, when first asked for); per worker its busy and
        idle time; the waits of parked cores by event; the host phases; and
        the op call's time around the runtime's pass. Needs ``trace=True``
        at construction."""
        return self.layer.profile(which)

    def workspace(self):
        """The runtime's memory, as the table ``moec run --workspace`` prints:
        each pass's workspace tensors at their capacity and the pages of
        them resident now, the backward slots kept in dead forward ones, and
        the kernels' scratch. ``info()`` has the totals (workspace_bytes,
        workspace_resident, scratch_bytes)."""
        return self.layer.workspace()

    def info(self):
        """The layer's sizes and the runtime's totals (workers, workspace
        bytes allocated and resident, scratch bytes), as a dict."""
        return dict(self.layer.info())

    # Checkpoints. state_dict() holds w1, w2 and the adapters (this process's
    # experts) and, as the module's extra state, the layout they belong to and
    # the main-grad buffers; load_state_dict() checks the layout before it
    # copies anything, and takes this process's experts out of a checkpoint
    # of more (a one-process checkpoint loaded under mpirun).

    def _layout(self):
        first = self.first_rank * self.local_experts
        return {"experts": self.experts, "first_expert": first,
                "local_experts": self.local_ranks * self.local_experts,
                "hidden": self.hidden, "inter": self.inter, "dtype": str(self.dtype),
                "columns": self._columns(),
                "lora_rank": self.lora_rank, "lora_targets": list(self.lora_targets),
                "lora_scaling": self.lora_scaling, "main_grad": self.main_grad,
                "weights_transposed": self.weights_transposed,
                "weight_format": self.weight_format}

    def _columns(self):
        """[first, end) of the intermediate columns (of I) this process holds."""
        if self.tp_rank is None:
            return [0, self.inter]
        i = self.inter // self.tp
        return [self.tp_rank * i, (self.tp_rank + 1) * i]

    def get_extra_state(self):
        state = {"format": "moec.MoeFFN/1", "layout": self._layout()}
        if self.main_grad:
            state["main_grad"] = {"w1": self.w1.main_grad, "w2": self.w2.main_grad}
        return state

    def set_extra_state(self, state):
        # _check_checkpoint has checked the layout and sliced the buffers.
        if self.main_grad and "main_grad" in state:
            with torch.no_grad():
                self.w1.main_grad.copy_(state["main_grad"]["w1"])
                self.w2.main_grad.copy_(state["main_grad"]["w2"])

    def _own_state(self):
        """{name: tensor} of what load_state_dict copies into this layer
        (its parameters and persistent buffers), as nn.Module finds them."""
        state = {n: p for n, p in self._parameters.items() if p is not None}
        state.update({n: b for n, b in self._buffers.items()
                      if b is not None and n not in self._non_persistent_buffers_set})
        return state

    def _check_checkpoint(self, state_dict, prefix, local_metadata, strict, *_):
        """Before load_state_dict copies anything: every refusal is raised
        here, so that a refused checkpoint leaves the layer untouched
        (nn.Module's own checks raise only after copying what fits). The
        checkpoint's layout must be this layer's, with this process's
        experts among its experts; strictly, no key may be missing (the
        layout, _extra_state, included) or unknown; every tensor given must
        be a tensor of this layer's shape and dtype, its main-grad buffers
        too."""
        name = prefix + "_extra_state"
        own = self._own_state()
        for n in own:
            t = state_dict.get(prefix + n)
            if prefix + n in state_dict and not isinstance(t, torch.Tensor):
                raise ValueError(f"moec: '{prefix}{n}' is a {type(t).__name__}, not a tensor")
        extra = None
        if name in state_dict:
            self._check_layout(state_dict[name], prefix, state_dict)
            extra = state_dict[name]
        if strict:
            missing = [prefix + n for n in list(own) + ["_extra_state"]
                       if prefix + n not in state_dict]
            unexpected = [k for k in state_dict if k.startswith(prefix) and
                          k[len(prefix):].split(".", 1)[0] not in
                          {*own, *self._modules, "_extra_state"}]
            if missing or unexpected:
                raise ValueError(
                    "moec: the state dict does not fit the layer: "
                    + "; ".join(f"{what} {keys[:3]}{' ...' if len(keys) > 3 else ''}"
                                for what, keys in (("missing", missing),
                                                   ("unexpected", unexpected)) if keys)
                    + (f" ('{name}' is the layout a MoeFFN checkpoint records: load the "
                       "layer's state_dict(), or strict=False for its tensors alone)"
                       if name in missing else ""))
        given = [(prefix + n, state_dict[prefix + n], t) for n, t in own.items()
                 if prefix + n in state_dict]
        if extra is not None and extra.get("main_grad") is not None:
            given += [(f"{name}['main_grad']['{w}']", extra["main_grad"][w],
                       getattr(self, w).main_grad) for w in ("w1", "w2")]
        for key, t, mine in given:
            if tuple(t.shape) != tuple(mine.shape):
                raise ValueError(f"moec: '{key}' has shape {list(t.shape)}; this layer's is "
                                 f"{list(mine.shape)}")
            if t.dtype != mine.dtype:
                raise ValueError(f"moec: '{key}' is {t.dtype}; this layer's is {mine.dtype}")

    def _check_layout(self, extra, prefix, state_dict):
        """The checks of a checkpoint's extra state (its layout) against this
        layer; a checkpoint of more experts (or of the whole intermediate
        columns, loaded by one TP rank) is sliced in `state_dict` to this
        process's part."""
        name = prefix + "_extra_state"
        if not isinstance(extra, dict) or extra.get("format") != "moec.MoeFFN/1":
            raise ValueError(f"moec: '{name}' is not a moec MoeFFN checkpoint's")
        layout = extra.get("layout")
        keys = ("experts", "hidden", "inter", "dtype", "lora_rank", "lora_targets",
                "lora_scaling", "first_expert", "local_experts")
        if not isinstance(layout, dict) or any(k not in layout for k in keys):
            raise ValueError(f"moec: '{name}' is not a moec MoeFFN checkpoint's: its layout "
                             f"lacks {[k for k in keys if k not in (layout or {})]}")
        theirs, mine = dict(layout), self._layout()
        theirs.setdefault("weights_transposed", False)
        theirs.setdefault("weight_format", None)
        for key in ("experts", "hidden", "inter", "dtype", "lora_rank", "lora_targets",
                    "lora_scaling", "weight_format", "weights_transposed"):
            if theirs[key] != mine[key]:
                raise ValueError(f"moec: the checkpoint is of another layer: its {key} is "
                                 f"{theirs[key]!r}, this layer's {mine[key]!r}")
        grads = extra.get("main_grad")
        if grads is not None and not self.main_grad:
            raise ValueError("moec: the checkpoint holds main-grad buffers; this layer has "
                             "none (main_grad=False)")
        if grads is not None and not (isinstance(grads, dict) and all(
                isinstance(grads.get(w), torch.Tensor) for w in ("w1", "w2"))):
            raise ValueError(f"moec: '{name}': its main_grad is not a dict of tensors w1 and w2")
        lo, n = theirs["first_expert"], theirs["local_experts"]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, n)):
            raise ValueError(f"moec: '{name}': its first_expert and local_experts are not "
                             f"integers: {lo!r}, {n!r}")
        first, count = mine["first_expert"], mine["local_experts"]
        if not (lo <= first and first + count <= lo + n):
            raise ValueError(
                f"moec: the checkpoint holds experts {lo}..{lo + n - 1} of {theirs['experts']}; "
                f"this layer (rank {self.first_rank}) holds experts {first}..{first + count - 1}")
        held = theirs.get("columns", [0, theirs["inter"]])
        if held != mine["columns"] and held != [0, self.inter]:
            raise ValueError(
                f"moec: the checkpoint holds intermediate columns {held[0]}..{held[1] - 1} of "
                f"{self.inter} (a TP rank's); this layer (TP rank {self.tp_rank}) holds "
                f"{mine['columns'][0]}..{mine['columns'][1] - 1}")
        slicing = held != mine["columns"]
        if (lo, n) == (first, count) and not slicing:
            return
        # A checkpoint of more experts: keep this process's.
        names = ["w1", "w2"] + (["w1_scale", "w2_scale"] if self.weight_format else []) + \
            [f"{t}_lora_{m}" for t in self.lora_targets for m in "AB"]

        # A checkpoint of the whole experts loaded by one TP rank: its slice.
        def keep(name, t):
            if t.shape[:1] != (n,):
                raise ValueError(f"moec: '{prefix}{name}' has shape {list(t.shape)}; the "
                                 f"checkpoint's layout holds {n} experts")
            t = t[first - lo:first - lo + count]
            if slicing and name in ("w1", "w2"):
                t = torch.stack([self._tp_slice(getattr(self, name), e) for e in t])
            return t

        for param in names:
            if prefix + param in state_dict:
                state_dict[prefix + param] = keep(param, state_dict[prefix + param])
        if grads is not None:
            state_dict[name] = dict(extra, main_grad={k: keep(k, v) for k, v in grads.items()})

    # LoRA adapters in PEFT's layout.

    PEFT_MODULES = {"w1": "gate_up_proj", "w2": "down_proj"}

    def _peft_names(self, module_prefix, experts=None):
        """(parameter, expert, PEFT name) of every adapter tensor this process
        holds; with `experts` (a range of global experts), the names of
        those experts (the parameter and index are then of no use)."""
        first = self.first_rank * self.local_experts
        held = range(first, first + self.local_ranks * self.local_experts)
        for target in self.lora_targets:
            module = self.PEFT_MODULES[target]
            for m in "AB":
                for e in (held if experts is None else experts):
                    yield (getattr(self, f"{target}_lora_{m}"), e - first,
                           f"base_model.model.{module_prefix}.{e}.{module}.lora_{m}.weight")

    def save_adapters(self, directory, module_prefix="experts"):
        """Writes the LoRA adapters as PEFT saves a LoRA model: adapter_config.json
        (r, lora_alpha, target_modules: "gate_up_proj" for w1, the fused
        gate/up projection, "down_proj" for w2) and adapter_model.safetensors
        with ``base_model.model.{module_prefix}.{expert}.{module}.lora_A.weight``
        [r, in] and ``lora_B.weight`` [out, r] (nn.Linear's layout: A and B
        transposed). These are the names of this layer's own fused modules;
        for a Hugging Face model's gate_proj/up_proj/down_proj adapters see
        moec_torch.hf. Under mpirun each process writes its own experts to
        adapter_model-rank{r}-of-{R}.safetensors and rank 0 the config;
        load_adapters reads either form. The files are replaced whole or
        not at all (safetensors.write_together: written under scratch names,
        then renamed, the config last). Returns the files written."""
        if not self.lora_rank:
            raise RuntimeError("moec: this layer has no LoRA adapters (lora_rank=0)")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        sharded = self.local_ranks != self.ranks
        weights = directory / (adapters.rank_file(self.first_rank, self.ranks) if sharded
                               else adapters.WEIGHTS)
        # Neither file may be one the layer reads (its config file, ...).
        for path in [weights] + ([directory / adapters.CONFIG]
                                 if self.first_rank == 0 else []):
            self._output(path, "save_adapters", "the adapter file")
        tensors = {name: p[e].detach().t().contiguous().clone()
                   for p, e, name in self._peft_names(module_prefix)}
        writes = [(weights, safetensors.file_writer(tensors, weights, {"format": "pt"}))]
        if self.first_rank == 0:
            config = {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": None,
                      "r": self.lora_rank, "lora_alpha": self.lora_scaling * self.lora_rank,
                      "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
                      "inference_mode": True, "modules_to_save": None,
                      "target_modules": [self.PEFT_MODULES[t] for t in self.lora_targets],
                      "moec": {"experts": self.experts, "ranks": self.ranks,
                               "module_prefix": module_prefix, "shards": sharded}}
            writes.append((directory / adapters.CONFIG,
                           json.dumps(config, indent=2).encode()))
        safetensors.write_together(writes)
        return [path for path, _ in writes[::-1]]

    def load_adapters(self, directory, module_prefix="experts"):
        """Loads adapters that save_adapters (or PEFT, with the same names)
        wrote. adapter_config.json is checked (adapters.read_config: every
        field of its type) and must match this layer: r, lora_alpha, the
        target modules and, where save_adapters recorded them, the number
        of experts and the module prefix. Only the files the config names
        are read (adapter_model.safetensors, else adapter_model.bin with
        torch.load(weights_only=True), which runs no code from the file;
        the rank files that hold this process's experts), never another
        file of the folder. Every tensor of this process's experts must be
        there, floating point and of its shape, and no tensor may name an
        expert the layer lacks, before any is copied."""
        if not self.lora_rank:
            raise RuntimeError("moec: this layer has no LoRA adapters (lora_rank=0)")
        directory = Path(directory)
        config = adapters.read_config(directory)
        shown = f"moec: {checks.where(directory / adapters.CONFIG, 'adapter config')}"
        want = {"r": self.lora_rank, "lora_alpha": self.lora_scaling * self.lora_rank,
                "target_modules": sorted(self.PEFT_MODULES[t] for t in self.lora_targets)}
        targets = config["target_modules"]
        got = {"r": config["r"], "lora_alpha": config["lora_alpha"],
               "target_modules": sorted(targets) if isinstance(targets, list) else targets}
        if config["peft_type"] != "LORA" or got != want:
            raise ValueError(f"moec: the adapters in {directory} are {got} "
                             f"(peft_type {config['peft_type']!r}); this layer's are {want}")
        moec = config.get("moec")
        first = self.first_rank * self.local_experts
        count = self.local_ranks * self.local_experts
        ranks = None
        if moec is not None:
            if moec["experts"] != self.experts:
                raise ValueError(f"{shown}: the adapters are of a layer of {moec['experts']} "
                                 f"experts; this layer has {self.experts}")
            if moec["module_prefix"] != module_prefix:
                raise ValueError(f"{shown}: the adapters were saved with module_prefix "
                                 f"{moec['module_prefix']!r}; loading with {module_prefix!r}")
            # The rank files that hold this process's experts.
            per = moec["experts"] // moec["ranks"]
            ranks = range(first // per, (first + count - 1) // per + 1)
        tensors = adapters.read_tensors(adapters.weight_files(directory, config, ranks))
        known = {name for _, _, name in self._peft_names(module_prefix, range(self.experts))}
        adapters.unknown_experts(tensors, f"base_model.model.{module_prefix}.", known,
                                 self.experts)
        updates = []
        for p, e, name in self._peft_names(module_prefix):
            t = adapters.tensor(tensors, name, p.shape[1:][::-1])
            if t is None:
                raise ValueError(f"moec: {directory} has no '{name}'")
            updates.append((p, e, t))
        with torch.no_grad():
            for p, e, t in updates:
                p[e].copy_(t.t())

    def extra_repr(self):
        # A LoRA layer's base weights are frozen and its adapters train: say
        # that, not frozen=True (the frozen= argument's layer trains nothing).
        return (f"ranks={self.ranks}, tp={self.tp}, fabric={self.fabric}, "
                f"first_rank={self.first_rank}, "
                + (f"tp_rank={self.tp_rank}, " if self.tp_rank is not None else "") +
                f"local_ranks={self.local_ranks}, experts={self.experts}, hidden={self.hidden}, "
                f"inter={self.inter}, top_k={self.top_k}, tokens={self.tokens}, "
                f"dtype={self.dtype}, "
                + (f"lora_rank={self.lora_rank}, lora_targets={self.lora_targets}, "
                   f"lora_scaling={self.lora_scaling:g} (base weights frozen, adapters "
                   "trained)" if self.lora_rank else
                   f"frozen={self.frozen}, main_grad={self.main_grad}")
                + (", dispatch_dtype=fp8_e4m3" if self.dispatch_dtype == "fp8_e4m3" else "")
                + (", weights_transposed=True" if self.weights_transposed else "")
                + (f", weight_format={self.weight_format}" if self.weight_format else ""))

    # A layer owns a runtime (compiled binaries, worker threads, under MPI a
    # place in a collective order) that cannot be copied or pickled; its
    # state is state_dict().

    def __reduce_ex__(self, protocol):
        raise TypeError(_NOT_PICKLED.format(what="a MoeFFN layer"))

    def __deepcopy__(self, memo):
        raise TypeError(_NOT_PICKLED.format(what="a MoeFFN layer"))


_NOT_PICKLED = (
    "moec: {what} cannot be copied or pickled (copy.deepcopy, pickle, torch.save of the "
    "module): it owns a runtime of compiled binaries and threads. Save its state instead, "
    "torch.save(layer.state_dict(), path), and rebuild it with the same arguments: "
    "layer = moec_torch.MoeFFN(config, ...); layer.load_state_dict(torch.load(path))")


class DispatchHandle:
    """What Exchange.combine and both backwards need of a dispatch: the
    exchange, the routing (kept, so that a later dispatch of the same
    exchange does not lose it) and the expert row counts."""

    def __init__(self, exchange, route, topk_ids, topk_weights, tokens_per_expert, squeeze):
        self.exchange = exchange
        self.route = route
        self.topk_ids = topk_ids
        self.topk_weights = topk_weights
        self.tokens_per_expert = tokens_per_expert
        self.squeeze = squeeze  # the dispatch took [S, H]: combine returns [S, H]


class _DispatchFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runtime, x, topk_ids, topk_weights, route_box):
        ids, weights = topk_ids.contiguous(), topk_weights.detach().contiguous()
        expert_x, counts, route = runtime.dispatch(x, ids, weights)
        route_box.append(route)  # the route id is no tensor: it goes out beside
        ctx.runtime, ctx.route = runtime, route
        ctx.save_for_backward(ids, weights)
        ctx.mark_non_differentiable(counts)
        return expert_x, counts

    @staticmethod
    def backward(ctx, d_expert_x, _counts):
        ids, weights = ctx.saved_tensors
        dx = ctx.runtime.dispatch_backward(ctx.route, ids, weights, d_expert_x.contiguous())
        return None, dx, None, None, None


class _CombineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runtime, route, topk_ids, expert_y, topk_weights):
        ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
        y, step = runtime.combine(route, ids, weights, expert_y)
        ctx.runtime, ctx.route, ctx.step = runtime, route, step
        ctx.save_for_backward(ids, weights, expert_y)
        return y

    @staticmethod
    def backward(ctx, dy):
        ids, weights, expert_y = ctx.saved_tensors
        d_expert_y, dtopk = ctx.runtime.combine_backward(ctx.route, ctx.step, ids, weights,
                                                         expert_y.contiguous(), dy.contiguous())
        return None, None, None, d_expert_y, dtopk


class Exchange:
    """Dispatch and combine as ops of their own, for expert computation the
    caller brings (another activation, quantized experts, a shared expert),
    as Megatron's FusedDispatch / FusedCombine and DeepEP provide; both are
    differentiable and run graphs/moe_dispatch.json and moe_combine.json on
    the moec runtime and fabric, compiled for `config` as MoeFFN's graphs:

        ex = moec_torch.Exchange("examples/configs/tiny.json", ranks=2)
        expert_x, tokens_per_expert, handle = ex.dispatch(x, topk_ids, topk_weights)
        expert_y = my_experts(expert_x, tokens_per_expert)   # any PyTorch code
        y = ex.combine(expert_y, handle)     # y[t] = sum_k w[t,k] * expert_y row of (t, k)

    x [P, S, H], topk_ids and topk_weights [P, S, K], y [P, S, H], for the P
    ranks this process runs (P = R in process, 1 under MPI, where the
    leading dim may be left out). expert_x [rows, H] holds the rows the
    experts of those ranks receive, rank by rank, each rank's grouped by its
    local expert in global expert order (expert r*L + e), within an expert
    by source rank, token and top-k position; tokens_per_expert [P*L]
    (int64) counts them, as a grouped matmul takes them. expert_y must have
    expert_x's rows in the same order.

    Gradients: the dispatch's backward is a combine of d expert_x (the sum
    over k); the combine's backward is a dispatch of topk_weight * dy, and
    d topk_weights[t, k] = <dy[t], expert_y row of (t, k)>. topk_ids get no
    gradient. A routing over the binaries' capacity raises RuntimeError
    ("moec over capacity: ..."): raise capacity_factor in the config."""

    def __init__(self, config, ranks=None, *, threads=0, target="cpu",
                 granularity="per-tile-range", timeout_seconds=60.0, fabric=None, group=None):
        load_library()
        threads = checks.integer(threads, "Exchange: argument 'threads'", minimum=0,
                                 maximum=1024)
        timeout_seconds = checks.seconds(timeout_seconds,
                                         "Exchange: argument 'timeout_seconds'")
        fabric, ranks, group = _fabric(fabric, group, ranks, 1, "Exchange")
        cfg = checks.read_config(config)
        _register_finalize(fabric)
        self.runtime = _from_cache(
            lambda fresh: compile_graphs(cfg, ranks, ["moe_dispatch.json", "moe_combine.json"],
                                         target, granularity, fresh),
            lambda dispatch, combine: torch.classes.moec.Exchange(
                dispatch, combine, threads, timeout_seconds, fabric,
                *_fabric_args(fabric, group)))
        info = self.runtime.info()
        self.fabric = fabric
        self.ranks = info["ranks"]
        self.first_rank = info["first_rank"]
        self.local_ranks = info["local_ranks"]
        self.experts = info["experts"]
        self.local_experts = info["local_experts"]
        self.hidden = info["hidden"]
        self.top_k = info["top_k"]
        self.tokens = info["tokens"]
        self.dtype = torch.bfloat16 if info["bf16"] else torch.float32

    def dispatch(self, x, topk_ids, topk_weights):
        """-> (expert_x [rows, H], tokens_per_expert [P*L], handle)."""
        for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            checks.dense(t, name)
        squeeze = x.dim() == 2 and self.local_ranks == 1
        if squeeze:
            x, topk_ids, topk_weights = x.unsqueeze(0), topk_ids.unsqueeze(0), \
                topk_weights.unsqueeze(0)
        route = []
        expert_x, counts = _DispatchFunction.apply(self.runtime, x, topk_ids, topk_weights,
                                                   route)
        return expert_x, counts, DispatchHandle(self, route[0], topk_ids, topk_weights, counts,
                                                squeeze)

    def combine(self, expert_y, handle):
        """-> y [P, S, H] (or [S, H] when the dispatch took [S, H])."""
        if handle.exchange is not self:
            raise ValueError("moec: the handle is another exchange's")
        checks.dense(expert_y, "expert_y")
        y = _CombineFunction.apply(self.runtime, handle.route, handle.topk_ids, expert_y,
                                   handle.topk_weights)
        return y.squeeze(0) if handle.squeeze else y

    def __reduce_ex__(self, protocol):
        raise TypeError("moec: an Exchange cannot be copied or pickled: it owns a runtime of "
                        "compiled binaries and threads; make another with "
                        "moec_torch.Exchange(config, ...)")

    def times(self):
        """Seconds of the last dispatch and combine task programs."""
        t = self.runtime.times()
        return {"dispatch": t[0], "combine": t[1]}
