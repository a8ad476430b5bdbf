"""Checks of what a caller hands moec_torch, with errors that name the
argument, the config key or the file:

    integer(value, what)    an int argument (Python int, or a numpy or torch
                            integer scalar); bools and floats are refused
    number(value, what)     a positive finite number argument
    boolean(value, what)    a bool argument (a Python or numpy bool, or a
                            0-dim torch bool tensor); "no", 1 and None are
                            refused, not taken as truthy
    timeout_limits()        a timeout's least, most and default seconds
                            (base/Time.h, from the op library)
    seconds(value, what)    a timeout: 0.001 to 1000000 seconds, as the
                            CLI's --timeout
    dense(tensor, name)     a tensor input: strided, with storage (not
                            sparse, mkldnn, nested or meta)
    autocast(tensor, dtype) an input as torch.autocast hands an op its
                            inputs: in the dtype the op computes in
    output_path(path, ...)  a path to write: its folder exists, and it is
                            not the same file as one that is read
    target_file(target)     the profile file a target names, or None
    read_config(config)     a config dict or JSON file as a plain dict, the
                            one normalization MoeFFN, Exchange,
                            compile_graphs and compile() share
    open_regular(path, what)  an fd of a regular file, anything else (a FIFO,
                            a device, a directory) refused before it is opened
    read_small_file(path)   the bytes of a regular file of bounded size
    strict_json(data, where)  a JSON document: UTF-8, no duplicate keys, no
                            NaN or Infinity
    env_value(name)         an environment variable's value, None when it is
                            unset or empty (one rule for every variable, as
                            the runtime's base/Env.h)
    env_shown(name, value)  NAME='value' for a message: the value cut to 200
                            characters, control characters escaped
"""

import json
import math
import numbers
import operator
import os
import stat
import sys

import torch

__all__ = ["CONFIG_LIMIT", "TIMEOUT_RANGE", "timeout_limits", "boolean", "dense", "env_shown", "env_value",
           "integer", "number", "open_regular", "output_path", "read_config", "read_small_file",
           "seconds", "strict_json", "target_file", "where"]

# A config is a few hundred bytes; one of more than this is not a config.
CONFIG_LIMIT = 1 << 20


def _is_bool(value):
    """True for a Python, numpy or torch boolean (an integer to
    operator.index, but never meant as one)."""
    if isinstance(value, bool):
        return True
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")


def integer(value, what, minimum=None, maximum=None):
    """`value` as a Python int: an int, or anything operator.index takes (a
    numpy or torch integer scalar). A bool, a float or anything else raises
    TypeError, a value outside [minimum, maximum] ValueError; `what` names
    it ("MoeFFN: argument 'threads'")."""
    if _is_bool(value):
        raise TypeError(f"{what} must be an integer, got {value!r} (a bool)")
    try:
        result = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {value!r}") from None
    if minimum is not None and result < minimum or maximum is not None and result > maximum:
        if maximum is None:
            bound = "positive" if minimum == 1 else f"at least {minimum}"
        else:
            bound = f"{minimum} to {maximum}"
        raise ValueError(f"{what} must be {bound}, got {result}")
    return result


def number(value, what):
    """`value` as a positive finite float: a Python, numpy or torch real
    number. A bool or a string raises TypeError; zero, a negative number,
    infinity and NaN raise ValueError."""
    if _is_bool(value) or isinstance(value, (str, bytes)):
        raise TypeError(f"{what} must be a number, got {value!r}")
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a number, got {value!r}") from None
    if not (math.isfinite(result) and result > 0):
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")
    return result


def boolean(value, what):
    """`value` as a Python bool: a bool, a numpy bool_ or a 0-dim torch
    bool tensor. Anything else (a string such as "no" or "false", an int,
    None) raises TypeError naming `what` ("MoeFFN: argument 'frozen'"): a
    truthy value is not taken for True."""
    if isinstance(value, bool):
        return value
    if isinstance(value, torch.Tensor):
        if (value.dtype == torch.bool and value.dim() == 0 and value.layout == torch.strided
                and not value.is_meta):
            return bool(value)
    elif _is_bool(value):
        return bool(value)
    raise TypeError(f"{what} must be a bool (True or False), got {value!r} "
                    f"({type(value).__name__})")


def timeout_limits():
    """A pass timeout's (least, most, default) seconds: base/Time.h's, which
    the runtime, the CLI's --timeout and the op library check with, read
    from the op library (loaded first). Under a millisecond the watchdog
    would round a timeout to nothing; past 1e6 s (11 days) it guards
    nothing."""
    least, most, default = torch.ops.moec.timeout_limits()
    return least, most, default


def __getattr__(name):
    # TIMEOUT_RANGE, (least, most): read from the op library when asked for.
    if name == "TIMEOUT_RANGE":
        return timeout_limits()[:2]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _number(x):
    return int(x) if float(x).is_integer() else x


def seconds(value, what):
    """`value` as a float number of seconds in timeout_limits()'s range
    (0.001 to 1000000: the CLI's --timeout takes the same), or None for the
    default (60). A bool or a string raises TypeError, a number outside the
    range (or NaN) ValueError."""
    least, most, default = timeout_limits()
    if value is None:
        return default
    rule = f"a number of seconds from {_number(least)} to {_number(most)}"
    if _is_bool(value) or isinstance(value, (str, bytes)):
        raise TypeError(f"{what} must be {rule}, got {value!r}")
    try:
        result = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{what} must be {rule}, got {value!r}") from None
    if not least <= result <= most:
        raise ValueError(f"{what} must be {rule}, got {value!r}")
    return result


def dense(tensor, name):
    """Refuses a tensor input the op cannot read element by element, before
    any work: not a tensor (TypeError); a sparse (COO, CSR, CSC, BSR, BSC),
    mkldnn or nested tensor (ValueError); a meta tensor, which holds no
    data (RuntimeError, the op library's own words for it). `name` names
    it ("x", "topk_ids")."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"moec: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    layout = tensor.layout
    if layout != torch.strided:
        kind = "sparse" if "sparse" in str(layout) else \
            "mkldnn" if "mkldnn" in str(layout) else "non-strided"
        raise ValueError(f"moec: {name} is a {kind} ({layout}) tensor; expected a dense one")
    if getattr(tensor, "is_nested", False):
        raise ValueError(f"moec: {name} is a nested tensor; expected a dense one")
    if tensor.is_meta:
        raise RuntimeError(f"moec: '{name}' is on meta; the moec runtime runs on the CPU")
    return tensor


def autocast(tensor, dtype):
    """`tensor` in `dtype` inside torch.autocast("cpu") where it is a
    floating tensor autocast casts (fp32, bf16, fp16), as autocast casts the
    inputs of torch's own ops (differentiably: its gradient comes back in
    the tensor's dtype); outside autocast, as given (the op refuses another
    dtype, naming it)."""
    if torch.is_autocast_cpu_enabled() and tensor.dtype != dtype and \
            tensor.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return tensor.to(dtype)
    return tensor


def target_file(target):
    """The profile file `target` names, as the compiler tells (a path: it
    holds a '/' or ends in .json), or None for a built-in profile ("cpu")."""
    if target is None:
        return None
    spec = os.fspath(target)
    if isinstance(spec, bytes):
        spec = os.fsdecode(spec)
    return spec if "/" in spec or (len(spec) > 5 and spec.endswith(".json")) else None


def where(path, what=None):
    """How a message names a file: "WHAT 'PATH'" (without `what`, the bare
    path, as the C++ readers name a file), and where a link leads."""
    path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    shown = f"{what} '{path}'" if what else path
    real = os.path.realpath(path)
    if real != os.path.abspath(path):
        shown += f" (a link to '{real}')"
    return shown


def output_path(path, who, argument, inputs=()):
    """`path` (a str), a file `who` ("compile") is about to write, checked
    before any work: it is not empty, its folder exists, it is not a
    folder, and it is not the same file (os.path.samefile: links followed,
    hard links too) as any of `inputs`, (what, path) pairs of the files the
    call reads ("config", ...; a None path is skipped): writing it would
    overwrite that input. ValueError naming `argument` ("the output"), the
    path and the input."""
    path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not path:
        raise ValueError(f"moec: {who}: {argument} is an empty path")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        there = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise ValueError(f"moec: {who}: the folder '{folder}' of {argument} '{path}' {there}")
    if os.path.isdir(path):
        raise ValueError(f"moec: {who}: {where(path, argument)} is a directory, not a file")
    if not os.path.exists(path):
        return path  # nothing there yet: no input it could be
    for what, other in inputs:
        if other is None:
            continue
        try:
            same = os.path.samefile(path, other)
        except (OSError, ValueError):
            continue  # an input that is not there is not overwritten
        if same:
            raise ValueError(f"moec: {who}: {where(path, argument)} is the same file as the "
                             f"{where(other, what)}; writing it would overwrite "
                             f"the {what}")
    return path


def _kind(mode):
    """What a file that is not a regular file is, or None for a regular file."""
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return None if stat.S_ISREG(mode) else "not a regular file"


def open_regular(path, what=None, error=ValueError):
    """(a read-only fd of `path`, its os.stat_result): the file (links
    followed) must be a regular file, and anything else (a directory, a
    device, a FIFO, a socket) is refused before it is opened, as the C++
    readers refuse it: a FIFO would block the reader for ever, /dev/zero
    never end. The fd is opened not blocking and checked again (what was
    opened may not be what was checked). Raises `error` ("moec: WHAT
    'PATH': is a FIFO, not a regular file"; "...: cannot open: No such file
    or directory"). Every loader of moec_torch opens its files here."""
    shown = where(path, what)

    def refuse(st):
        kind = _kind(st.st_mode)
        if kind is not None:
            raise error(f"moec: {shown}: is {kind}, not a regular file")

    try:
        refuse(os.stat(path))
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise error(f"moec: {shown}: cannot open: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        refuse(st)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_small_file(path, what="config", limit=CONFIG_LIMIT):
    """The bytes of the file `path` (open_regular: a regular file, links
    followed) of at most `limit` bytes; nothing past the limit is read.
    Raises ValueError naming `what` and the path."""
    fd, st = open_regular(path, what)
    shown = where(path, what)
    with os.fdopen(fd, "rb") as f:
        if st.st_size > limit:
            raise ValueError(f"moec: {shown} has {st.st_size} bytes; a {what} of more than "
                             f"{limit} bytes is refused")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"moec: {shown} has more than {limit} bytes; a {what} of more than "
                         f"{limit} bytes is refused")
    return data


def strict_json(data, where, error=ValueError, what="a config"):
    """The JSON document of `data` (bytes): UTF-8, no duplicate keys and no
    NaN or Infinity (the compiler's reader takes neither), else `error`
    naming `where` ("moec: config 'c.json'", "the header")."""

    def pairs(items):
        seen = {}
        for key, value in items:
            if key in seen:
                raise error(f"{where}: key '{key}' appears twice")
            seen[key] = value
        return seen

    def constant(name):
        raise error(f"{where}: {name} is not a JSON number (numbers must be finite)")

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{where} is not UTF-8 text: {e}") from None
    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except json.JSONDecodeError as e:
        raise error(f"{where} is not JSON: {e}") from None
    except RecursionError:
        raise error(f"{where} is nested too deeply to be {what}") from None


def _parse_json(data, where):
    return strict_json(data, f"moec: {where}")


def _plain(value, key, where):
    """`value` of config key `key` as a plain JSON value: numpy and torch
    scalars become Python numbers and booleans; a non-finite number, or
    anything JSON cannot hold, raises naming the key."""
    if value is None or isinstance(value, str):
        return value
    if _is_bool(value):
        return bool(value)
    if isinstance(value, (dict, list, tuple)):
        if isinstance(value, dict):
            for k in value:
                if not isinstance(k, str):
                    raise TypeError(f"moec: {where}key '{key}' holds a key {k!r}; JSON keys are "
                                    "strings")
            return {k: _plain(v, f"{key}.{k}", where) for k, v in value.items()}
        return [_plain(v, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if not isinstance(value, float):
        try:
            return operator.index(value)  # int, numpy and torch integers
        except TypeError:
            pass
    if isinstance(value, (numbers.Real, torch.Tensor)):
        try:
            result = float(value)
        except (TypeError, ValueError, RuntimeError):
            result = None
        if result is not None:
            if not math.isfinite(result):
                raise ValueError(f"moec: {where}key '{key}' must be a finite number, "
                                 f"got {value!r}")
            return result
    raise TypeError(f"moec: {where}key '{key}' must be a JSON value (a number, string, "
                    f"boolean, list or object), got {value!r} ({type(value).__name__})")


def read_config(config):
    """The config `config` names as a new dict of plain JSON values: a dict
    (copied), or the path of a JSON file (read_small_file; an object, no
    duplicate keys, no NaN or Infinity). numpy and torch scalars become
    Python numbers. Refused, naming the key: a non-finite number, a value
    JSON cannot hold, and a "lora_alpha" that is not positive (0 is no
    default: leave the key out for lora_alpha = lora_rank)."""
    if isinstance(config, dict):
        where, data = "config ", config
    elif isinstance(config, (str, os.PathLike)):
        where = f"config '{os.fspath(config)}': "
        data = _parse_json(read_small_file(config, "config"), where[:-2])
        if not isinstance(data, dict):
            raise ValueError(f"moec: {where[:-2]} must hold a JSON object (the config's keys), "
                             f"got {type(data).__name__}")
    else:
        raise TypeError("moec: a config is a dict or the path of a JSON file, got "
                        f"{config!r} ({type(config).__name__})")
    for key in data:
        if not isinstance(key, str):
            raise TypeError(f"moec: {where}keys must be strings, got {key!r}")
    cfg = {key: _plain(value, key, where) for key, value in data.items()}
    alpha = cfg.get("lora_alpha")
    if isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha <= 0:
        raise ValueError(f"moec: {where}key 'lora_alpha' must be a positive number, got "
                         f"{data['lora_alpha']!r} (leave it out for lora_alpha = lora_rank)")
    return cfg


def env_value(name):
    """The value of environment variable `name`, or None when it is unset or
    empty: an empty value means the default, for every variable moec reads."""
    return os.environ.get(name) or None


_SHOWN = 200


def env_shown(name, value):
    """NAME='value' for a message, as the user gave it: at most 200
    characters (then "... (N characters)"), control characters as \\xNN."""
    text = "".join(c if " " <= c != "\x7f" else f"\\x{ord(c):02x}" for c in value[:_SHOWN])
    more = f"... ({len(value)} characters)" if len(value) > _SHOWN else ""
    return f"{name}='{text}'{more}"


def callers(function):
    """The local variables of each call of `function` (a plain Python
    function) that the current call runs inside, innermost first: what a
    hook learns of the call that runs it when the call does not pass it
    on (load_state_dict's strict, DistributedDataParallel's self)."""
    code = function.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            yield frame.f_locals
        frame = frame.f_back
