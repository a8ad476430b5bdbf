"""Checks of what a caller hands moec_torch, with errors that name the
argument, the config key or the file:

    integer(value, what)    an int argument (Python int, or a numpy or torch
                            integer scalar); bools and floats are refused
    number(value, what)     a positive finite number argument
    read_config(config)     a config dict or JSON file as a plain dict, the
                            one normalization MoeFFN, Exchange,
                            compile_graphs and compile() share
    read_small_file(path)   the bytes of a regular file of bounded size
"""

import json
import math
import numbers
import operator
import os
import stat

import torch

__all__ = ["CONFIG_LIMIT", "integer", "number", "read_config", "read_small_file"]

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


def _kind(mode):
    """What a file that is not a regular file is, or None for a regular file."""
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return None if stat.S_ISREG(mode) else "not a regular file"


def read_small_file(path, what="config", limit=CONFIG_LIMIT):
    """The bytes of the file `path` (symlinks followed), which must be a
    regular file of at most `limit` bytes: a directory, a device, a FIFO or
    a socket is refused before it is opened (a FIFO would block, /dev/zero
    never end), and nothing past the limit is read. Raises ValueError
    naming `what` and the path."""
    path = os.fspath(path)
    where = f"{what} '{path}'"
    real = os.path.realpath(path)
    if real != os.path.abspath(path):
        where += f" (a link to '{real}')"
    try:
        st = os.stat(path)
    except OSError as e:
        raise ValueError(f"moec: cannot read {where}: {e.strerror}") from None

    def refuse(st):
        kind = _kind(st.st_mode)
        if kind is not None:
            raise ValueError(f"moec: {where} is {kind}, not a regular file")
        if st.st_size > limit:
            raise ValueError(f"moec: {where} has {st.st_size} bytes; a {what} of more than "
                             f"{limit} bytes is refused")

    refuse(st)
    try:
        # Not blocking: what is opened may no longer be what was checked.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"moec: cannot read {where}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        refuse(os.fstat(fd))
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"moec: {where} has more than {limit} bytes; a {what} of more than "
                         f"{limit} bytes is refused")
    return data


def _parse_json(data, where):
    """A JSON document: no duplicate keys and no NaN or Infinity (the
    compiler's reader takes neither), else ValueError naming `where`."""

    def pairs(items):
        seen = {}
        for key, value in items:
            if key in seen:
                raise ValueError(f"moec: {where}: key '{key}' appears twice")
            seen[key] = value
        return seen

    def constant(name):
        raise ValueError(f"moec: {where}: {name} is not a JSON number (numbers must be finite)")

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"moec: {where} is not UTF-8 text: {e}") from None
    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"moec: {where} is not JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"moec: {where} is nested too deeply to be a config") from None


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
