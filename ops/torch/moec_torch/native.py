"""moec's compiler and dump tool, called in this process through libmoec.so
(compiler/api/moec.h) with ctypes: no moec executable and no build tree
are needed at run time.

    import moec_torch
    summary = moec_torch.compile("graphs/moe_ffn_fwd.json", "tiny.json", "fwd.moebin")
    info = moec_torch.dump("fwd.moebin")               # what `moec dump --json` prints
    info["statistics"]["makespan"]                     # simulated seconds
    moec_torch.simulate_trace("fwd.moebin", "sim.json")  # the simulated run, for Perfetto
    trace = moec_torch.load_trace("sim.json")          # tasks, waits, arrows, phases

Where things are found: an installed package carries its libraries and
graphs (moec_torch/lib, moec_torch/graphs); in a checkout they are Bazel's
outputs (bazel-bin) and graphs/. MOEC_LIB, MOEC_TORCH_LIB and MOEC_GRAPHS
override.
"""

import ctypes
import json
import os
import stat
import tempfile
import threading
from pathlib import Path

from . import checks

__all__ = ["compile", "dump", "simulate_trace", "load_trace", "library_path", "op_library_path",
           "graphs_dir", "library_version"]

_PACKAGE = Path(__file__).resolve().parent
_REPO = _PACKAGE.parents[2]


def _find(env, packaged, in_checkout, what, folder=False):
    """$env when set (it must name an existing file, or folder), else the
    package's copy, else the checkout's."""
    value = checks.env_value(env)
    if value is None:
        return packaged if packaged.exists() else in_checkout
    try:
        mode = os.stat(value).st_mode
    except OSError as e:
        raise FileNotFoundError(f"moec: {checks.env_shown(env, value)} names {what}, which "
                                f"cannot be found: {e.strerror}") from None
    if stat.S_ISDIR(mode) != folder:
        raise FileNotFoundError(f"moec: {checks.env_shown(env, value)} names {what}, but it "
                                f"is {'not a folder' if folder else 'a folder'}")
    return Path(value)


def library_path():
    """The compiler library: $MOEC_LIB, the package's, or the checkout's."""
    return _find("MOEC_LIB", _PACKAGE / "lib/libmoec.so",
                 _REPO / "bazel-bin/compiler/api/libmoec.so", "the compiler library libmoec.so")


def op_library_path():
    """The op library: $MOEC_TORCH_LIB, the package's, or the checkout's."""
    return _find("MOEC_TORCH_LIB", _PACKAGE / "lib/moec_torch.so",
                 _REPO / "bazel-bin/ops/torch/moec_torch.so", "the op library moec_torch.so")


def graphs_dir():
    """The layer graphs: $MOEC_GRAPHS, the package's, or the checkout's."""
    return _find("MOEC_GRAPHS", _PACKAGE / "graphs", _REPO / "graphs",
                 "the folder of the layer graphs (moe_ffn_fwd.json, ...)", folder=True)


_lib = None
_lock = threading.Lock()
_group_lib = None


def group_handle(group):
    """The c10d::ProcessGroup behind the torch.distributed group `group`,
    as an integer that a Layer or Exchange constructor takes over (one more
    reference of the C++ group; pass it to exactly one constructor), and the
    group's own timeout in seconds. TypeError when `group` is not one."""
    global _group_lib
    with _lock:
        if _group_lib is None:
            # PyDLL: the call keeps the GIL (it reads a Python object) and
            # raises the Python error it sets.
            _group_lib = ctypes.PyDLL(str(op_library_path()))
            _group_lib.moec_process_group.argtypes = [ctypes.py_object]
            _group_lib.moec_process_group.restype = ctypes.c_void_p
    handle = _group_lib.moec_process_group(group)
    options = getattr(group, "options", None)
    timeout = getattr(options, "_timeout", None)
    seconds = timeout.total_seconds() if timeout is not None else 1800.0
    return handle, seconds


def _library():
    global _lib
    with _lock:
        if _lib is None:
            path = library_path()
            if not path.is_file():
                raise RuntimeError(
                    f"moec: the compiler library {path} does not exist; install the moec_torch "
                    "package, build it with 'bazel build //compiler/api:libmoec.so', or set "
                    "MOEC_LIB")
            lib = ctypes.CDLL(str(path))
            out = ctypes.POINTER(ctypes.c_void_p)
            lib.moec_compile.argtypes = [ctypes.c_char_p] * 5 + [out]
            lib.moec_dump_json.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, out]
            lib.moec_simulate_trace.argtypes = [ctypes.c_char_p] * 3
            lib.moec_capacity_advice.argtypes = [ctypes.c_char_p, ctypes.c_longlong,
                                                 ctypes.c_longlong, ctypes.c_int, out]
            lib.moec_config_check.argtypes = [ctypes.c_char_p]
            lib.moec_free.argtypes = [ctypes.c_void_p]
            lib.moec_compiler_version.argtypes = [ctypes.POINTER(ctypes.c_uint)]
            lib.moec_compiler_version.restype = ctypes.c_char_p
            # Calls that can fail return a moec_status_t (base/moec_status.h):
            # NULL, or an error this module reads and frees.
            for f in (lib.moec_compile, lib.moec_dump_json, lib.moec_simulate_trace,
                      lib.moec_capacity_advice, lib.moec_config_check):
                f.restype = ctypes.c_void_p
            lib.moec_status_message.argtypes = [ctypes.c_void_p]
            lib.moec_status_message.restype = ctypes.c_char_p
            lib.moec_status_free.argtypes = [ctypes.c_void_p]
            _lib = lib
        return _lib


def _arg(value):
    return None if value is None else os.fsencode(str(value))


def _take(lib, pointer):
    """The library's string at `pointer`, freed."""
    if not pointer.value:
        return None
    text = ctypes.string_at(pointer.value).decode("utf-8", "replace")
    lib.moec_free(pointer.value)
    return text


def _call(function, *args, outputs=1):
    lib = _library()
    results = [ctypes.c_void_p() for _ in range(outputs)]
    status = getattr(lib, function)(*args, *[ctypes.byref(r) for r in results])
    texts = [_take(lib, r) for r in results]
    if status:
        message = lib.moec_status_message(status).decode("utf-8", "replace")
        lib.moec_status_free(status)
        raise RuntimeError(f"moec: {message or function + ' failed'}")
    return texts


def library_version():
    """The version of the compiler library in use ("MAJOR.MINOR.PATCH",
    base/Version.h) and the task binary format it writes:
    {"version": "0.2.0", "binary_format": 2}."""
    lib = _library()
    fmt = ctypes.c_uint(0)
    version = lib.moec_compiler_version(ctypes.byref(fmt)).decode()
    return {"version": version, "binary_format": fmt.value}


def compile(graph, config, out, target="cpu", granularity="per-tile-range"):
    """Compiles the graph description `graph` (.json or .mlir; a bare name
    such as "moe_ffn_fwd.json" is looked up in graphs_dir()) for `config`
    into the task binary `out`, as `moec compile` does. `config` is the path
    of a config file, which the compiler reads, or a dict, which goes
    through the same checks as MoeFFN's (checks.read_config) first.
    Returns the one-line summary. Raises RuntimeError with the compiler's
    message (file, line, op) on bad input; `out` is then left alone.

    `out` is checked before anything is compiled: its folder must exist,
    and it must not be the same file (links followed) as the graph, the
    config file, the target profile file or the compiler library, which
    writing it would overwrite (ValueError naming both)."""
    graph = Path(graph)
    if not graph.exists() and not graph.is_absolute() and len(graph.parts) == 1:
        graph = graphs_dir() / graph
    out = checks.output_path(out, "compile", "the output", [
        ("graph", graph), ("config", None if isinstance(config, dict) else config),
        ("target profile", checks.target_file(target)), ("compiler library", library_path())])
    if not isinstance(config, dict):
        (summary,) = _call("moec_compile", _arg(graph), _arg(config), _arg(target),
                           _arg(granularity), _arg(out))
        return summary
    cfg = checks.read_config(config)
    with tempfile.TemporaryDirectory(prefix="moec-config-") as scratch:
        path = Path(scratch) / "config.json"
        path.write_text(json.dumps(cfg, indent=2))
        try:
            (summary,) = _call("moec_compile", _arg(graph), _arg(path), _arg(target),
                               _arg(granularity), _arg(out))
        except RuntimeError as e:
            # The file is gone when the caller reads this: name the dict.
            raise RuntimeError(str(e).replace(str(path), "the config dict")) from None
    return summary


def dump(binary, target=None, rank=None):
    """Returns what `moec dump BINARY --json` prints, as a dict: "file",
    "ops", "events", "queues" (every task, with its simulated start and
    finish), "statistics" (critical path, makespan, balance), "warnings".
    `target` re-costs with another profile; `rank` resolves rank-relative
    fields for that rank."""
    rank = -1 if rank is None else checks.integer(rank, "dump: argument 'rank'", minimum=0)
    (text,) = _call("moec_dump_json", _arg(binary), _arg(target), rank)
    return json.loads(text)


def simulate_trace(binary, out, target=None):
    """Writes the simulated run of `binary` on `target` (default: its own)
    to `out` as a Chrome/Perfetto trace in the runtime's format, so that it
    opens beside a measured trace (`moec run --trace`). `out` must not be
    the binary, the target profile file or the compiler library (ValueError),
    and its folder must exist."""
    out = checks.output_path(out, "simulate_trace", "the output", [
        ("binary", binary), ("target profile", checks.target_file(target)),
        ("compiler library", library_path())])
    _call("moec_simulate_trace", _arg(binary), _arg(target), _arg(out), outputs=0)


def capacity_advice(config, rows_per_rank, receive_per_rank, headroom=False):
    """How to change `config` (a dict, as the config file holds) so that a
    routing that routes `rows_per_rank` rows from its fullest rank and puts
    `receive_per_rank` rows on the experts of its fullest rank fits (the
    runtime's capacity need): a dict of "seq_size", "capacity_factor",
    "row_capacity", "receive_capacity" and "fits". With `headroom` the
    factor grows beyond the need, as before a recompile. The compiler's own
    arithmetic (moec.h), so that it and the binary agree."""
    (text,) = _call("moec_capacity_advice", json.dumps(config).encode(), int(rows_per_rank),
                    int(receive_per_rank),
                    int(checks.boolean(headroom, "capacity_advice: argument 'headroom'")))
    return json.loads(text)


def check_config(config):
    """Checks a config dict as `moec compile` does (the compiler's own rules,
    moec.h's moec_config_check); raises ValueError with its message."""
    try:
        _call("moec_config_check", json.dumps(config).encode(), outputs=0)
    except RuntimeError as e:
        raise ValueError(str(e)) from None


def load_trace(path):
    """Reads a trace (measured or simulated) into a dict: "metadata", and
    lists "tasks" (rank, core, task, op, tile, start_us, dur_us, and
    off_core_us in a measured trace: the run's time off its core), "waits"
    (rank, core, task, event_name, start_us, dur_us, signal_rank,
    signal_task), "phases" (name, start_us, dur_us) and "arrows"
    ((rank, core, ts_us) of the signal, (rank, core, ts_us) of the waiter).
    A file that is not a regular file (checks.open_regular) or not a JSON
    trace raises ValueError naming it."""
    fd, _ = checks.open_regular(path, "trace")
    with os.fdopen(fd, "rb") as f:
        raw = f.read()
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"moec: {checks.where(path, 'trace')}: not a JSON trace: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"moec: {checks.where(path, 'trace')}: not a JSON trace (an object "
                         "with 'traceEvents')")
    cores = {}
    tasks, waits, phases, flows = [], [], [], {}
    for ev in data.get("traceEvents", []):
        ph = ev.get("ph")
        if ph == "M":
            if ev.get("name") == "thread_name":
                cores[(ev["pid"], ev["tid"])] = ev["args"]["name"]
            continue
        if ph in ("s", "f"):
            flows.setdefault(ev["id"], {})[ph] = (ev["pid"], ev["tid"], ev["ts"])
            continue
        if ph != "X":
            continue
        core = cores.get((ev["pid"], ev["tid"]), str(ev["tid"]))
        base = {"rank": ev["pid"], "core": core, "start_us": ev["ts"], "dur_us": ev["dur"]}
        if ev.get("cat") == "phase":
            phases.append({"name": ev["name"], **base})
        elif ev.get("cat") == "wait":
            waits.append({**base, **ev["args"]})
        else:
            tasks.append({**base, **ev["args"], "op_name": ev["name"], "kind": ev.get("cat")})
    arrows = [(f["s"], f["f"]) for f in flows.values() if "s" in f and "f" in f]
    return {"metadata": data.get("metadata", {}), "tasks": tasks, "waits": waits,
            "phases": phases, "arrows": arrows}
