"""The safetensors format, read and written by moec (Hugging Face's
safetensors package is not a Debian package), with the calls of
``safetensors.torch`` so that user code reads the same:

    from moec_torch.safetensors import load_file, save_file, safe_open
    tensors = load_file("model.safetensors")            # {name: tensor}, mapped
    save_file(tensors, "out.safetensors", metadata={"format": "pt"})
    with safe_open("model.safetensors", framework="pt") as f:
        f.keys(); f.metadata(); f.get_tensor("lm_head.weight"); f.dtype("lm_head.weight")
    ckpt = Checkpoint("Qwen3-30B-A3B/")                  # a folder: one file, or the index's shards
    save_sharded(tensors, "out/", max_shard_bytes)       # model-00001-of-0000N.safetensors + index

The format: an 8-byte little-endian header length N, N bytes of UTF-8 JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}}``, offsets relative to the end of the header), then the bytes,
row-major, little-endian. The tensors' ranges must cover the data area
exactly, in some order, with no gap or overlap. Dtypes: F64, F32, F16, BF16,
F8_E4M3, I64, I32, I16, I8, U8, BOOL. PyTorch 1.13 has no float8 dtype: an
F8_E4M3 tensor is read as uint8 codes (``dtype(name)`` says "F8_E4M3";
``fp8_e4m3_to_float`` decodes them) and written from uint8 with
``dtypes={name: "F8_E4M3"}``.

Reading maps the file (copy-on-write): a tensor's pages are read when it
is used, so a 60 GB checkpoint is never read whole; a tensor is copied only
when its offset is not a multiple of its element size. Every header is
checked before any tensor is made, and a bad file raises SafetensorError
naming the file and, where one is at fault, the tensor. Writing goes
through a scratch file renamed into place: a failed write leaves nothing.
"""

import json
import math
import mmap
import os
import stat
import struct
import tempfile
from pathlib import Path

import torch

from . import checks

__all__ = ["Checkpoint", "SafetensorError", "fp8_e4m3_to_float", "float_to_fp8_e4m3",
           "load_file", "load_tensors", "parse_header", "safe_open", "save_file", "save_sharded",
           "write_atomically", "INDEX_NAME", "MAX_HEADER"]

MAX_HEADER = 100 * 1000 * 1000   # the safetensors package's limit
INDEX_NAME = "model.safetensors.index.json"

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "F8_E4M3": torch.uint8, "I64": torch.int64,
          "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I64": 8, "I32": 4,
            "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
         torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
         torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


class SafetensorError(ValueError):
    """A safetensors file (or index) that is not one, or not this model's."""


class Entry:
    """One tensor of a header: dtype (the file's name), shape, begin, end
    (offsets into the data area)."""
    __slots__ = ("name", "dtype", "shape", "begin", "end")

    def __init__(self, name, dtype, shape, begin, end):
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def parse_header(header, data_bytes):
    """(entries sorted by offset, metadata) of a header's bytes, checked
    against a data area of `data_bytes`; SafetensorError saying what is
    wrong and, where one is, naming the tensor."""
    doc = checks.strict_json(header, "the header", SafetensorError, "a header")
    if not isinstance(doc, dict):
        raise SafetensorError(f"the header is a JSON {type(doc).__name__}, not an object")
    metadata = doc.pop("__metadata__", None)
    if metadata is not None:
        if not isinstance(metadata, dict) or \
                not all(isinstance(v, str) for v in metadata.values()):
            raise SafetensorError("__metadata__ must be an object of strings")
    entries = []
    for name, spec in doc.items():
        where = f"tensor '{name}'"
        if not isinstance(spec, dict):
            raise SafetensorError(f"{where}: its entry is not an object")
        unknown = set(spec) - {"dtype", "shape", "data_offsets"}
        missing = {"dtype", "shape", "data_offsets"} - set(spec)
        if missing or unknown:
            raise SafetensorError(f"{where}: " + (f"no {sorted(missing)[0]!r}" if missing else
                                                  f"unknown key {sorted(unknown)[0]!r}"))
        dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        if dtype not in DTYPES:
            raise SafetensorError(f"{where}: unknown dtype {dtype!r} (known: "
                                  f"{', '.join(DTYPES)})")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise SafetensorError(f"{where}: shape {shape!r} is not a list of sizes >= 0")
        if not isinstance(offsets, list) or len(offsets) != 2 or \
                not all(_is_int(o) and o >= 0 for o in offsets):
            raise SafetensorError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
        begin, end = offsets
        if begin > end:
            raise SafetensorError(f"{where}: data_offsets [{begin}, {end}] end before they begin")
        if end > data_bytes:
            raise SafetensorError(f"{where}: data_offsets [{begin}, {end}] run past the data "
                                  f"area of {data_bytes} bytes (a truncated file?)")
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        if nbytes != end - begin:
            raise SafetensorError(f"{where}: shape {shape} of {dtype} is {nbytes} bytes; its "
                                  f"data_offsets [{begin}, {end}] hold {end - begin}")
        entries.append(Entry(name, dtype, tuple(shape), begin, end))
    entries.sort(key=lambda e: (e.begin, e.end))
    at = 0
    for e in entries:
        if e.begin != at:
            what = "overlaps the tensor before it" if e.begin < at else \
                f"leaves a gap of {e.begin - at} bytes before it"
            raise SafetensorError(f"tensor '{e.name}': data_offsets [{e.begin}, {e.end}] {what}")
        at = e.end
    if at != data_bytes:
        raise SafetensorError(f"the tensors end at byte {at} of a data area of {data_bytes} "
                              "bytes (trailing bytes, or a damaged header)")
    return entries, metadata or {}


def _open_regular(path):
    """An fd of `path`, a regular file (links followed); SafetensorError
    otherwise, naming it."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise SafetensorError(f"{path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise SafetensorError(f"{path} is {kind}")
    try:
        return os.open(path, os.O_RDONLY), st.st_size
    except OSError as e:
        raise SafetensorError(f"{path}: {e.strerror}") from None


class safe_open:
    """One safetensors file, mapped: keys(), metadata(), get_tensor(name),
    dtype(name), shape(name); a context manager, as safetensors.safe_open.
    Only framework "pt" and device "cpu" are served."""

    def __init__(self, filename, framework="pt", device="cpu"):
        if framework not in ("pt", "torch"):
            raise SafetensorError(f"{filename}: framework {framework!r}: only 'pt' is served")
        if str(device) != "cpu":
            raise SafetensorError(f"{filename}: device {device!r}: only 'cpu' is served")
        self.path = Path(filename)
        fd, size = _open_regular(self.path)
        try:
            if size < 8:
                raise SafetensorError(f"{self.path}: {size} bytes, shorter than the 8-byte "
                                      "header length")
            (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            if n > MAX_HEADER:
                raise SafetensorError(f"{self.path}: a header of {n} bytes, over the "
                                      f"{MAX_HEADER}-byte limit")
            if 8 + n > size:
                raise SafetensorError(f"{self.path}: a header of {n} bytes in a file of "
                                      f"{size} (truncated, or not safetensors)")
            header = os.pread(fd, n, 8)
            try:
                entries, self._metadata = parse_header(header, size - 8 - n)
            except SafetensorError as e:
                raise SafetensorError(f"{self.path}: {e}") from None
            self._start = 8 + n
            self._entries = {e.name: e for e in entries}
            self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY) if size > self._start \
                else None
        finally:
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def keys(self):
        return list(self._entries)

    def __contains__(self, name):
        return name in self._entries

    def metadata(self):
        return dict(self._metadata)

    def _entry(self, name):
        try:
            return self._entries[name]
        except KeyError:
            raise SafetensorError(f"{self.path} has no tensor '{name}'") from None

    def dtype(self, name):
        """The file's dtype name of a tensor ("BF16", "F8_E4M3", ...)."""
        return self._entry(name).dtype

    def shape(self, name):
        return list(self._entry(name).shape)

    def get_tensor(self, name):
        """The tensor, a view of the mapped file (copied when misaligned)."""
        e = self._entry(name)
        dtype = DTYPES[e.dtype]
        count = math.prod(e.shape)
        if count == 0:
            return torch.empty(e.shape, dtype=dtype)
        t = torch.frombuffer(self._map, dtype=dtype, count=count, offset=self._start + e.begin)
        if (self._start + e.begin) % ITEMSIZE[e.dtype]:
            t = t.clone()
        return t.view(e.shape)


def load_file(filename, device="cpu"):
    """{name: tensor} of a file, each a view of its mapped bytes."""
    f = safe_open(filename, "pt", device)
    return {name: f.get_tensor(name) for name in f.keys()}


def load_tensors(path):
    """{name: tensor} of a weights file without running code from it: a
    .safetensors file, or a torch.save'd dict (.bin, .pt) read with
    torch.load(weights_only=True), which refuses a pickle that would call
    anything but tensor rebuilds (SafetensorError naming the file)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return load_file(path)
    fd, _ = _open_regular(path)
    os.close(fd)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch's unpickler names what it refused
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise SafetensorError(f"{path}: not a plain dict of tensors (the weights_only load "
                              f"refused it: {first})") from None
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise SafetensorError(f"{path}: not a dict of tensors")
    return state


def write_atomically(path, data):
    """Writes `data` (bytes, or a function of the open file) to `path`
    through a scratch file in its folder, synced and renamed into place: a
    failed write leaves neither."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def save_file(tensors, filename, metadata=None, dtypes=None):
    """Writes {name: tensor} (CPU, dense) as a safetensors file, in name
    order. metadata: {str: str}; dtypes: {name: "F8_E4M3"} for uint8 codes
    to be stored as FP8. Tensors that share memory are refused, as the
    safetensors package refuses them (save a clone)."""
    dtypes = dtypes or {}
    if metadata is not None and (not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise SafetensorError(f"{filename}: metadata must be a dict of str to str")
    header, arrays, at, spans = {}, [], 0, []
    for name in sorted(tensors):
        t = tensors[name]
        if not isinstance(name, str) or name.startswith("__"):
            raise SafetensorError(f"{filename}: {name!r} is not a tensor name (a str not "
                                  "starting with '__')")
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_meta:
            raise SafetensorError(f"{filename}: '{name}' is not a dense tensor")
        kind = dtypes.get(name) or NAMES.get(t.dtype)
        if kind is None or kind == "F8_E4M3" and t.dtype != torch.uint8 or \
                kind not in DTYPES:
            raise SafetensorError(f"{filename}: '{name}' is {t.dtype}"
                                  + (f" marked {dtypes[name]}" if name in dtypes else "")
                                  + f"; safetensors takes {', '.join(DTYPES)}")
        t = t.detach().cpu()
        if t.numel():
            lo = t.data_ptr()
            spans.append((lo, lo + t.numel() * t.element_size(), name))
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() \
            if t.numel() else b""
        header[name] = {"dtype": kind, "shape": list(t.shape),
                        "data_offsets": [at, at + len(data)]}
        arrays.append(data)
        at += len(data)
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise SafetensorError(f"{filename}: '{first}' and '{second}' share memory; save "
                                  "a clone of one")
    if metadata:
        header = {"__metadata__": metadata, **header}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)   # the data area starts 8-aligned

    def write(f):
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in arrays:
            f.write(data)
    write_atomically(filename, write)


def save_sharded(tensors, folder, max_shard_bytes, metadata=None, dtypes=None):
    """Writes {name: tensor} into `folder` as transformers saves a model: one
    model.safetensors when it fits in max_shard_bytes, else shards
    model-00001-of-0000N.safetensors in name order, each at most
    max_shard_bytes (a larger tensor alone), and model.safetensors.index.json
    (metadata.total_size and weight_map). Returns the files written."""
    folder = Path(folder)
    shards, size = [[]], 0
    for name in sorted(tensors):
        t = tensors[name]
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    dtypes = dtypes or {}
    if len(shards) == 1:
        path = folder / "model.safetensors"
        save_file(tensors, path, {"format": "pt", **(metadata or {})}, dtypes)
        return [path]
    files, weight_map = [], {}
    for i, names in enumerate(shards):
        path = folder / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, path, {"format": "pt", **(metadata or {})},
                  {n: dtypes[n] for n in names if n in dtypes})
        weight_map.update({n: path.name for n in names})
        files.append(path)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_atomically(folder / INDEX_NAME, json.dumps(index, indent=2).encode())
    return files + [folder / INDEX_NAME]


class Checkpoint:
    """A Hugging Face checkpoint folder: model.safetensors, or the shards
    that model.safetensors.index.json names (each mapped when first used).
    keys(), `name in`, dtype(name), shape(name), get_tensor(name), and
    where(name), the file that holds it (for messages)."""

    def __init__(self, folder):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise SafetensorError(f"{self.folder} is not a checkpoint folder (not a folder)")
        index = self.folder / INDEX_NAME
        self._files = {}
        if index.exists():
            doc = checks.strict_json(checks.read_small_file(index, "checkpoint index",
                                                            64 << 20), str(index),
                                     SafetensorError, "an index")
            wmap = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
                raise SafetensorError(f"{index}: no weight_map of tensor names to files")
            for name, shard in wmap.items():
                if os.path.isabs(shard) or os.path.normpath(shard) != shard or \
                        shard.startswith(".."):
                    raise SafetensorError(f"{index}: '{name}' is in '{shard}', which is not a "
                                          "file of the folder")
            self._map = dict(wmap)
            for shard in sorted(set(wmap.values())):
                if not (self.folder / shard).is_file():
                    raise SafetensorError(f"{index} names the shard '{shard}', which "
                                          f"{self.folder} does not hold")
        elif (self.folder / "model.safetensors").exists():
            f = self._file("model.safetensors")
            self._map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise SafetensorError(f"{self.folder} holds neither {INDEX_NAME} nor "
                                  "model.safetensors")

    def _file(self, shard):
        if shard not in self._files:
            self._files[shard] = safe_open(self.folder / shard)
        return self._files[shard]

    def _open(self, name):
        try:
            f = self._file(self._map[name])
        except KeyError:
            raise SafetensorError(f"{self.folder} has no tensor '{name}'") from None
        if name not in f:
            raise SafetensorError(f"{self.where(name)}: the index names '{name}' in this "
                                  "shard, which does not hold it")
        return f

    def keys(self):
        return list(self._map)

    def __contains__(self, name):
        return name in self._map

    def where(self, name):
        shard = self._map.get(name)
        return str(self.folder / shard) if shard else str(self.folder)

    def dtype(self, name):
        return self._open(name).dtype(name)

    def shape(self, name):
        return self._open(name).shape(name)

    def get_tensor(self, name):
        return self._open(name).get_tensor(name)


# --- FP8 e4m3 (e4m3fn: bias 7, no infinities, S.1111.111 is NaN) -------------

def _e4m3_table():
    values = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp, man = (code >> 3) & 0xF, code & 0x7
        if exp == 0xF and man == 0x7:
            values.append(math.nan)
        elif exp == 0:
            values.append(sign * man * 2.0 ** -9)
        else:
            values.append(sign * (1 + man / 8) * 2.0 ** (exp - 7))
    return torch.tensor(values, dtype=torch.float32)


E4M3 = _e4m3_table()


def fp8_e4m3_to_float(codes):
    """float32 values of uint8 e4m3 codes, decoded by table."""
    if codes.dtype != torch.uint8:
        raise SafetensorError(f"fp8_e4m3_to_float: codes are {codes.dtype}, not uint8")
    return E4M3[codes.long()]


def float_to_fp8_e4m3(values):
    """uint8 e4m3 codes of float values: the nearest e4m3 value (ties to the
    even code), saturating at +-448; NaN to 0x7F."""
    v = values.float().reshape(-1)
    finite = E4M3[:127]  # 0x00 .. 0x7E: the non-negative values, ascending
    a = v.abs().clamp(max=448.0)
    hi = torch.searchsorted(finite, a).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - finite[lo], finite[hi] - a
    pick = torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    codes = pick.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 7)
    codes[torch.isnan(v)] = 0x7F
    return codes.reshape(values.shape)
