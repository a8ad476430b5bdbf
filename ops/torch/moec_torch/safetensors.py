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

The header is checked by the op library's checker (runtime/tooling/
Safetensors.cpp, through torch.ops.moec.safetensors_read_header) before
any tensor is made; a bad file raises SafetensorError naming the file and,
where one is at fault, the tensor. Reading maps the file (copy-on-write):
a tensor is a view of the mapping, whose pages are read when it is used, so
a 60 GB checkpoint is never read whole; a tensor is copied only when its
offset is not a multiple of its element size. Writing goes through a
scratch file renamed into place (write_together: several files, all written
before any is renamed): a failed write leaves the old files, and the scratch
files of dead writers are removed by the next write into the folder.
"""

import json
import math
import mmap
import os
import pickle
import re
import secrets
import socket
import struct
import zipfile
from pathlib import Path

import torch

from . import checks, reference

__all__ = ["Checkpoint", "SafetensorError", "file_writer", "fp8_e4m3_to_float",
           "float_to_fp8_e4m3", "index_data", "load_file", "load_index", "load_tensors",
           "parse_header", "plan_shards", "remove_stale_scratch", "safe_open", "save_file",
           "save_sharded", "shard_files", "write_atomically", "write_index", "write_together",
           "INDEX_NAME", "MAX_HEADER"]

MAX_HEADER = 100 * 1000 * 1000   # the safetensors package's limit, and the checker's
INDEX_NAME = "model.safetensors.index.json"
INDEX_LIMIT = 64 << 20           # an index of a million tensors is ~100 MB of names; 64 MB

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
    """A safetensors file (or index) that is not one, or not this model's;
    the message starts "moec: " as every moec error does."""

    def __init__(self, message):
        super().__init__(message if message.startswith("moec: ") else f"moec: {message}")


class Entry:
    """One tensor of a header: dtype (the file's name), shape, begin, end
    (offsets into the data area)."""
    __slots__ = ("name", "dtype", "shape", "begin", "end")

    def __init__(self, name, dtype, shape, begin, end):
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end


def _checker():
    """torch.ops.moec, the op library that holds the header checker."""
    from . import load_library
    load_library()
    return torch.ops.moec


def _entries(normalized):
    """(entries in offset order, metadata or None) of the checker's JSON."""
    doc = json.loads(normalized)
    entries = [Entry(t["name"], t["dtype"], tuple(t["shape"]), t["begin"], t["end"])
               for t in doc["tensors"]]
    return entries, doc["metadata"]


def parse_header(header, data_bytes):
    """(entries in offset order, metadata or None) of a header's bytes,
    checked against a data area of `data_bytes`; SafetensorError saying
    what is wrong and, where one is, naming the tensor."""
    data = torch.frombuffer(bytearray(header), dtype=torch.uint8) if header else \
        torch.empty(0, dtype=torch.uint8)
    ops = _checker()
    try:
        return _entries(ops.safetensors_parse_header(data, data_bytes))
    except RuntimeError as e:
        raise SafetensorError(str(e)) from None


def _open_regular(path):
    """(an fd of `path`, its size): checks.open_regular, refusing anything
    but a regular file before it is opened, with SafetensorError."""
    fd, st = checks.open_regular(path, None, SafetensorError)
    return fd, st.st_size


class _Closable:
    """A context manager that calls close() on leaving."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class safe_open(_Closable):
    """One safetensors file, mapped: keys(), metadata(), get_tensor(name),
    dtype(name), shape(name), close(); a context manager, as
    safetensors.safe_open. Only framework "pt" and device "cpu" are
    served."""

    def __init__(self, filename, framework="pt", device="cpu"):
        if framework not in ("pt", "torch"):
            raise SafetensorError(f"{filename}: framework {framework!r}: only 'pt' is served")
        if str(device) != "cpu":
            raise SafetensorError(f"{filename}: device {device!r}: only 'cpu' is served")
        self.path = Path(filename)
        ops = _checker()
        fd, size = _open_regular(self.path)
        try:
            try:
                entries, self._metadata = _entries(ops.safetensors_read_header(fd, size))
            except RuntimeError as e:
                raise SafetensorError(f"{self.path}: {e}") from None
            self._entries = {e.name: e for e in entries}
            # The tensors tile the data area, which ends the file.
            self._start = size - (entries[-1].end if entries else 0)
            # Private and writable: a tensor written to changes this process's
            # copy of its pages, never the file.
            self._map = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) \
                if size > self._start else None
        finally:
            os.close(fd)
        self._open = True

    def close(self):
        """Forgets the file; tensors already made keep their mapping alive."""
        self._open, self._map = False, None

    def keys(self):
        """The tensors' names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name):
        return name in self._entries

    def metadata(self):
        """The header's __metadata__ ({str: str}), or None without one."""
        return None if self._metadata is None else dict(self._metadata)

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
        """The tensor, a view of the mapped file (a copy when its offset is
        not a multiple of its element size)."""
        e = self._entry(name)
        if not self._open:
            raise SafetensorError(f"{self.path} was closed; open it again to read '{name}'")
        dtype = DTYPES[e.dtype]
        if e.begin == e.end:
            return torch.empty(e.shape, dtype=dtype)
        offset = self._start + e.begin
        if offset % ITEMSIZE[e.dtype]:
            # Copied as bytes into memory of torch's alignment, then viewed.
            raw = torch.frombuffer(self._map, dtype=torch.uint8, count=e.end - e.begin,
                                   offset=offset)
            return raw.clone().view(dtype).view(e.shape)
        t = torch.frombuffer(self._map, dtype=dtype, count=math.prod(e.shape), offset=offset)
        return t.view(e.shape)


def load_file(filename, device="cpu"):
    """{name: tensor} of a file, each a view of its mapped bytes."""
    with safe_open(filename, "pt", device) as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _not_torch_save(f, size):
    """What is wrong with an open file that should be torch.save's, before
    torch.load reads it (whose own errors on a damaged file are an EOFError,
    an OSError "Invalid argument" or a KeyError naming no file), or None:
    empty; neither a zip archive (torch.save's format) nor a pickle (its
    legacy format); a zip archive that is damaged (a truncated file has no
    central directory) or lacks the members torch.save writes."""
    if size == 0:
        return "is empty, not a torch.save file"
    magic = f.read(4)
    f.seek(0)
    if magic[:1] == b"\x80":
        return None  # a pickle: the legacy format, checked as torch.load reads it
    if magic != b"PK\x03\x04":
        return f"is not a torch.save file (neither a zip archive nor a pickle; it starts {magic!r})"
    try:
        with zipfile.ZipFile(f) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        return f"is a damaged zip archive, not a whole torch.save file (truncated?): {e}"
    finally:
        f.seek(0)
    roots = {n.split("/", 1)[0] for n in names}
    if len(roots) != 1 or not {f"{r}/data.pkl" for r in roots} <= set(names):
        return ("is a zip archive without the members of a torch.save file (one folder "
                f"holding data.pkl; it holds {sorted(names)[:4]})")
    return None


def _load_pickled(path):
    """The object of a torch.save'd file, read from the file checks.open_regular
    opened with torch.load(weights_only=True), which refuses a pickle that
    would call anything but tensor rebuilds (and, in PyTorch 1.13, floats).
    A file that is not torch.save's, or damaged, or refused raises
    SafetensorError naming the file and what is wrong with it."""
    fd, st = checks.open_regular(path, None, SafetensorError)
    shown = checks.where(path)
    with os.fdopen(fd, "rb") as f:
        problem = _not_torch_save(f, st.st_size)
        if problem:
            raise SafetensorError(f"{shown}: {problem}")
        try:
            return torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # EOFError, RuntimeError, KeyError, OSError, UnpicklingError
            text = str(e).strip()
            detail = text.rsplit("WeightsUnpickler error: ", 1)[-1].strip().splitlines()
            detail = detail[0] if detail else type(e).__name__
            if isinstance(e, pickle.UnpicklingError) and \
                    re.search("[Uu]nsupported|instantiate", detail):
                # torch's unpickler names what it refused to call
                raise SafetensorError(f"{shown}: not a plain dict of tensors (the weights_only "
                                      f"load refused it: {detail})") from None
            raise SafetensorError(f"{shown}: a damaged torch.save file (truncated?): torch.load "
                                  f"failed: {type(e).__name__}: {detail}") from None


def load_tensors(path):
    """{name: tensor} of a weights file without running code from it: a
    .safetensors file, or a torch.save'd dict (.bin, .pt) read by
    _load_pickled. SafetensorError naming the file otherwise."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return load_file(path)
    state = _load_pickled(path)
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise SafetensorError(f"{path}: not a dict of tensors")
    return state


# --- writing -------------------------------------------------------------------

# A scratch file: .NAME.tmp.HOST.PID.RANDOM beside the file NAME it becomes.
_HOST = re.sub(r"[^A-Za-z0-9-]", "_", socket.gethostname()) or "host"
_SCRATCH = re.compile(r"\..+\.tmp\.(?P<host>[A-Za-z0-9_-]+)\.(?P<pid>\d+)\.[0-9a-f]{8}")


def _alive(pid):
    """Whether a process of this id runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's, or an id too large to ask about: left alone
    return True


def remove_stale_scratch(folder):
    """Removes the scratch files in `folder` that writers on this host
    (by host name) left when they died: those whose process id no process
    has. A living writer's, and another host's (a folder that several
    hosts share), are left. Returns the paths removed."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        m = _SCRATCH.fullmatch(name)
        if m and m["host"] == _HOST and not _alive(int(m["pid"])):
            try:
                os.unlink(os.path.join(folder, name))
                removed.append(Path(folder) / name)
            except OSError:
                pass
    return removed


def _sync_folder(folder):
    """fsync of a folder: its renames, on disk."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def write_together(files):
    """Writes [(path, data)] (data: bytes, or a function of the open file)
    so that each file is replaced whole or not at all: each is written to
    a scratch file in its folder (.NAME.tmp.HOST.PID.RANDOM) and synced;
    only once all are written are they renamed into place, in the order
    given, and the folders synced. A failure while writing (a full disk)
    removes the scratch files and leaves every old file as it was; a crash
    before the renames leaves the old files and a scratch file that the
    next write into the folder removes (remove_stale_scratch, done first);
    a crash between two renames leaves the earlier files new and the later
    ones old, each whole. A link is written through to its file; a new
    file's mode is the umask's, as open() gives."""
    targets = []
    for path, data in files:
        path = Path(path)
        if path.is_symlink():
            path = Path(os.path.realpath(path))
        targets.append((path, data))
    for folder in sorted({str(path.parent) for path, _ in targets}):
        remove_stale_scratch(folder)
    staged, renamed, path = [], 0, None
    try:
        for path, data in targets:
            tmp = path.parent / f".{path.name}.tmp.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            staged.append(tmp)
            with os.fdopen(fd, "wb") as f:
                if callable(data):
                    data(f)
                else:
                    f.write(data)
                f.flush()
                os.fsync(f.fileno())
        for tmp, (path, _) in zip(staged, targets):
            os.replace(tmp, path)
            renamed += 1
    except BaseException as e:
        for tmp in staged[renamed:]:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        if isinstance(e, OSError) and e.filename is None and path is not None:
            raise OSError(e.errno, e.strerror, str(path)) from e  # which file could not be written
        raise
    for folder in sorted({str(path.parent) for path, _ in targets}):
        _sync_folder(folder)


def write_atomically(path, data):
    """Writes `data` (bytes, or a function of the open file) to `path`,
    replaced whole or not at all (write_together of one file)."""
    write_together([(path, data)])


def _span(t):
    """(device, first byte, byte past the last) of the memory a tensor reads."""
    reach = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return str(t.device), t.data_ptr(), t.data_ptr() + reach * t.element_size()


def _check_tensors(tensors, where, metadata=None, dtypes=None):
    """[(name, tensor, file dtype)] of {name: tensor} to write, in the order
    the safetensors package lays them out (larger elements first, then by
    name: after an 8-aligned header every tensor is aligned), or
    SafetensorError naming `where` and the tensor: a name that is not a str
    or starts with '__', something that is not a dense tensor, a dtype the
    format lacks, a dtypes override that does not fit, tensors that share
    memory, metadata that is not str to str."""
    if not isinstance(tensors, dict):
        raise SafetensorError(f"{where}: tensors must be a dict of names to tensors, got "
                              f"{type(tensors).__name__}")
    if metadata is not None and (not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise SafetensorError(f"{where}: metadata must be a dict of str to str")
    dtypes = dtypes or {}
    for name in dtypes:
        if name not in tensors:
            raise SafetensorError(f"{where}: dtypes names '{name}', which is not one of the "
                                  "tensors")
    out, spans = [], []
    for name, t in tensors.items():
        if not isinstance(name, str) or name.startswith("__"):
            raise SafetensorError(f"{where}: {name!r} is not a tensor name (a str not "
                                  "starting with '__')")
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_meta:
            raise SafetensorError(f"{where}: '{name}' is not a dense tensor")
        own = NAMES.get(t.dtype)
        kind = dtypes.get(name, own)
        if own is None or not (kind == own or kind == "F8_E4M3" and t.dtype == torch.uint8):
            raise SafetensorError(f"{where}: '{name}' is {t.dtype}"
                                  + (f" marked {dtypes[name]}" if name in dtypes else "")
                                  + f"; safetensors takes {', '.join(NAMES.values())} "
                                  "(and uint8 marked F8_E4M3)")
        if t.numel():
            spans.append(_span(t) + (name,))
        out.append((name, t, kind))
    spans.sort()
    reach = None
    for device, begin, end, name in spans:
        if reach and reach[0] == device and begin < reach[1]:
            raise SafetensorError(f"{where}: '{reach[2]}' and '{name}' share memory; save a "
                                  "clone of one (the safetensors package refuses them too)")
        if not reach or reach[0] != device or end > reach[1]:
            reach = (device, end, name)
    out.sort(key=lambda item: (-ITEMSIZE[item[2]], item[0]))
    return out


def _writer(filename, items, metadata):
    """The function that writes checked [(name, tensor, file dtype)] as a
    safetensors file into an open file (for write_together); each tensor's
    bytes are made as they are written."""
    header, at = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for name, t, kind in items:
        size = t.numel() * t.element_size()
        header[name] = {"dtype": kind, "shape": list(t.shape), "data_offsets": [at, at + size]}
        at += size
    try:
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise SafetensorError(f"{filename}: a name or metadata string is not UTF-8 text: "
                              f"{e}") from None
    text += b" " * (-len(text) % 8)   # the data area starts 8-aligned

    def write(f):
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, t, _ in items:
            if t.numel():
                data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                f.write(memoryview(data.numpy()))
    return write


def file_writer(tensors, filename, metadata=None, dtypes=None):
    """save_file's checks, and the function that writes the file into an
    open file: for write_together, which writes several files (a
    safetensors file and its config) replaced together."""
    return _writer(filename, _check_tensors(tensors, filename, metadata, dtypes), metadata)


def save_file(tensors, filename, metadata=None, dtypes=None):
    """Writes {name: tensor} as a safetensors file (a strided tensor is
    written as its contiguous copy), replaced whole or not at all
    (write_atomically). metadata: {str: str}; dtypes: {name: "F8_E4M3"}
    for uint8 codes to be stored as FP8. Tensors that share memory are
    refused, as the safetensors package refuses them (save a clone)."""
    write_atomically(filename, file_writer(tensors, filename, metadata, dtypes))


def plan_shards(sizes, limit):
    """[(owner, [names])], one per shard, of [(name, bytes, owner)] in order,
    as huggingface_hub's split_state_dict_into_shards (which transformers'
    save_pretrained uses) makes them: a tensor joins the current shard
    unless that would take it past `limit`, which starts a new one; a
    tensor larger than `limit` gets a shard of its own, placed before the
    current shard. A shard holds one owner's tensors (the process that
    writes it, under mpirun): another owner starts a new shard."""
    shards, current, size, holder = [], [], 0, None
    for name, n, owner in sizes:
        if current and (owner != holder or size + n > limit and n <= limit):
            shards.append((holder, current))
            current, size = [], 0
        if n > limit:
            shards.append((owner, [name]))
            continue
        current.append(name)
        size += n
        holder = owner
    if current or not shards:
        shards.append((holder, current))
    return shards


def shard_files(count, prefix="model"):
    """The file names of `count` shards: PREFIX.safetensors alone, else
    PREFIX-00001-of-0000N.safetensors, ..."""
    if count == 1:
        return [f"{prefix}.safetensors"]
    return [f"{prefix}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_index(folder, weight_map, total_size, prefix="model"):
    """Writes PREFIX.safetensors.index.json as transformers does ({"metadata":
    {"total_size"}, "weight_map"}, keys sorted, indent 2) and returns its
    path."""
    path = Path(folder) / f"{prefix}.safetensors.index.json"
    write_atomically(path, index_data(weight_map, total_size))
    return path


def index_data(weight_map, total_size):
    """The bytes of an index as transformers writes it."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def save_sharded(tensors, folder, max_shard_bytes, metadata=None, dtypes=None, prefix="model"):
    """Writes {name: tensor} into `folder` as transformers' save_pretrained
    saves a model: one PREFIX.safetensors when it fits in max_shard_bytes,
    else PREFIX-00001-of-0000N.safetensors, split in the dict's order (see
    plan_shards), and PREFIX.safetensors.index.json ({"metadata":
    {"total_size"}, "weight_map"}, keys sorted, indent 2). Every file's
    metadata is {"format": "pt"} and `metadata`. Everything is checked
    before anything is written; the files are written together
    (write_together: all written under scratch names, then renamed, the
    index last), so a failed save leaves the old checkpoint. Then the files
    of an earlier save under the same prefix that this one did not write
    (other shards, the single file or the index of the other layout) are
    removed, as transformers removes stale shards, so the folder holds one
    checkpoint. Returns the files written."""
    folder = Path(folder)
    limit = checks.integer(max_shard_bytes, "save_sharded: max_shard_bytes", minimum=1)
    items = _check_tensors(tensors, folder, metadata, dtypes)
    if not folder.is_dir():
        raise SafetensorError(f"{folder} is not a folder")
    checked = {name: (t, kind) for name, t, kind in items}
    shards = [names for _, names in plan_shards(
        [(name, t.numel() * t.element_size(), None) for name, t in tensors.items()], limit)]
    meta = {"format": "pt", **(metadata or {})}
    by_offset = [name for name, _, _ in items]
    index_path = folder / f"{prefix}.safetensors.index.json"
    files = [folder / f for f in shard_files(len(shards), prefix)]
    weight_map, writes = {}, []
    for path, names in zip(files, shards):
        chosen = set(names)
        writes.append((path, _writer(path, [(n, *checked[n]) for n in by_offset if n in chosen],
                                     meta)))
        weight_map.update({n: path.name for n in names})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        files.append(index_path)
        writes.append((index_path, index_data(weight_map, total)))
    write_together(writes)
    stale = re.compile(re.escape(prefix) + r"-\d{5}-of-\d{5}\.safetensors")
    for old in folder.iterdir():
        if old not in files and (stale.fullmatch(old.name) or old.name in (
                f"{prefix}.safetensors", index_path.name)) and old.is_file():
            old.unlink()
    return files


# --- checkpoints: a folder with one file, or shards and their index ------------

def load_index(folder, name=INDEX_NAME):
    """The index of a sharded checkpoint in `folder`, checked:
    {"metadata": {...}, "weight_map": {tensor: shard file}}. A shard must be
    a file of the folder (a relative path, no '..') that exists;
    SafetensorError naming the index and the tensor otherwise."""
    index = Path(folder) / name
    try:
        data = checks.read_small_file(index, "checkpoint index", INDEX_LIMIT)
    except ValueError as e:
        raise SafetensorError(str(e)) from None
    doc = checks.strict_json(data, str(index), SafetensorError, "an index")
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise SafetensorError(f"{index}: no weight_map of tensor names to files")
    metadata = doc.get("metadata", {})
    if not isinstance(metadata, dict):
        raise SafetensorError(f"{index}: metadata is not an object")
    for tensor, shard in wmap.items():
        if os.path.isabs(shard) or os.path.normpath(shard) != shard or \
                shard.split(os.sep)[0] == "..":
            raise SafetensorError(f"{index}: '{tensor}' is in '{shard}', which is not a file "
                                  "of the folder")
    for shard in sorted(set(wmap.values())):
        if not os.path.lexists(Path(folder) / shard):  # what it is: checked when opened
            raise SafetensorError(f"{index} names the shard '{shard}', which {folder} does "
                                  "not hold")
    return {"metadata": metadata, "weight_map": wmap}


class Checkpoint(_Closable):
    """A Hugging Face checkpoint folder: model.safetensors or, without one
    (transformers looks in this order), the shards that
    model.safetensors.index.json names, each opened (its header read and
    checked, its file mapped) once, when first used. keys(), `name in`,
    dtype(name), shape(name), get_tensor(name), metadata() (the index's),
    where(name) (the file that holds it, for messages), close(); a context
    manager."""

    def __init__(self, folder):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise SafetensorError(f"{self.folder} is not a checkpoint folder (not a folder)")
        self._files = {}
        self._map, self._metadata = {}, None
        if os.path.lexists(self.folder / "model.safetensors"):
            f = self._file("model.safetensors")
            self._map = {k: "model.safetensors" for k in f.keys()}
        elif os.path.lexists(self.folder / INDEX_NAME):
            index = load_index(self.folder)
            self._map, self._metadata = index["weight_map"], index["metadata"]
        else:
            raise SafetensorError(f"{self.folder} holds neither {INDEX_NAME} nor "
                                  "model.safetensors")
        self._held = {}  # shard: the names the index puts in it
        for name, shard in self._map.items():
            self._held.setdefault(shard, []).append(name)

    def close(self):
        """Forgets the open shards; tensors already made keep theirs mapped."""
        for f in self._files.values():
            f.close()
        self._files = {}

    def _file(self, shard):
        """The open shard; on first use, checked to hold what the index puts
        in it."""
        f = self._files.get(shard)
        if f is None:
            f = safe_open(self.folder / shard)
            for name in getattr(self, "_held", {}).get(shard, ()):
                if name not in f:
                    raise SafetensorError(f"{self.folder / shard}: the index names '{name}' in "
                                          "this shard, which does not hold it")
            self._files[shard] = f
        return f

    def _open(self, name):
        try:
            return self._file(self._map[name])
        except KeyError:
            raise SafetensorError(f"{self.folder} has no tensor '{name}'") from None

    def keys(self):
        return list(self._map)

    def __contains__(self, name):
        return name in self._map

    def metadata(self):
        """The index's metadata ({"total_size": ...}); None for one file."""
        return None if self._metadata is None else dict(self._metadata)

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
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise SafetensorError(f"fp8_e4m3_to_float: codes are "
                              f"{getattr(codes, 'dtype', type(codes).__name__)}, not uint8")
    return E4M3[codes.long()]


def float_to_fp8_e4m3(values):
    """uint8 e4m3 codes of float values: the nearest e4m3 value (ties to the
    even code, saturating at +-448; reference.e4m3_round), NaN to 0x7F."""
    v = values.float()
    rounded = reference.e4m3_round(v).abs()
    codes = torch.searchsorted(E4M3[:127], rounded.reshape(-1)).clamp(max=126)
    codes = codes.to(torch.uint8).reshape(v.shape) | (torch.signbit(v).to(torch.uint8) << 7)
    codes[torch.isnan(v)] = 0x7F
    return codes
