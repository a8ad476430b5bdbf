"""The compile cache: task binaries compiled with the compiler library
(native.compile) once per config, graphs, target and library, kept on disk
in $MOEC_CACHE_DIR and in memory (_compiled); and which graphs make a layer
(compile_layer)."""

import errno
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
import warnings
from pathlib import Path

from . import checks, native, quant

_compiled = {}


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
