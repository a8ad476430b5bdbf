"""Hostile files where the torch op's loaders and savers expect weights:
what is not a regular file (a FIFO, a socket, a directory) is refused
without blocking, naming it; a save that fails (a full disk) leaves the old
files and a live process; adapters of another layer, of a non-float dtype
or in files the config does not name are not read; a refused state dict
leaves the layer bitwise as it was; a damaged file is refused naming it and
what is wrong; saves replace their files whole, and the scratch files of
dead writers are removed by the next save."""

import errno
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import torch

import moec_torch
import moec_torch.hf as mhf
from moec_torch import hf_models, safetensors
from test_hf import make_model, write_checkpoint
from test_moe_ffn import config


def lora_layer(experts=4, seed=0, **options):
    """A LoRA layer (2 ranks, H 64, I 32, r 4) with random adapters."""
    torch.manual_seed(seed)
    layer = moec_torch.MoeFFN(config(experts=experts), ranks=2, threads=1, lora_rank=4,
                              lora_alpha=8, **options)
    with torch.no_grad():
        for p in layer.adapters():
            p.uniform_(-0.5, 0.5)
    return layer


def snapshot(module):
    """Copies of every parameter and buffer of a module (and main_grad)."""
    out = {k: v.detach().clone() for k, v in module.state_dict().items()
           if isinstance(v, torch.Tensor)}
    for name, p in module.named_parameters():
        if hasattr(p, "main_grad"):
            out[name + ".main_grad"] = p.main_grad.clone()
    return out


def assert_unchanged(before, module):
    after = snapshot(module)
    assert before.keys() == after.keys()
    for k in before:
        assert before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]), k


def hf_lora_model(seed=0, **extra):
    """A patched qwen3_moe stand-in (8 experts unless `extra` says) with LoRA
    adapters of rank 4."""
    model = make_model("qwen3_moe", seed=seed, **extra)
    mhf.patch_model(model, ranks=2, threads=1, lora_rank=4, lora_alpha=8)
    with torch.no_grad():
        for _, _, ex in mhf._patched(model):
            for p in ex.layer.adapters():
                p.uniform_(-0.5, 0.5)
            for name, mask in ex._masks.items():   # the blocks no PEFT module has stay 0
                getattr(ex.layer, name).mul_(mask)
    return model


def hf_adapters(model):
    return [p for _, _, ex in mhf._patched(model) for p in ex.layer.adapters()]


def without_blocking(call, fifo=None):
    """The exception `call` raises, run in a thread: a call still blocked
    after 20 s (in open() or read() of a FIFO) fails the test, after a
    writer opened and closed the FIFO lets it go."""
    outcome = []

    def run():
        try:
            call()
            outcome.append(None)
        except Exception as e:  # noqa: BLE001 - the test looks at what it was
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(20)
        pytest.fail("the loader blocked on a file that is not a regular file")
    return outcome[0]


# --- 1. a FIFO, a socket or a directory where a file is expected ----------------

def make_not_regular(path, kind):
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
    else:
        os.mkdir(path)


def moec_folder(tmp_path, weights="safetensors", sharded=False):
    """A MoeFFN layer and its saved adapters: as save_adapters writes them, as
    a .bin, or as rank files (the config's moec section says shards)."""
    layer = lora_layer()
    folder = tmp_path / "adapters"
    layer.save_adapters(folder)
    if weights == "bin" or sharded:
        tensors = safetensors.load_file(folder / "adapter_model.safetensors")
        os.remove(folder / "adapter_model.safetensors")
    if weights == "bin":
        torch.save({k: v.clone() for k, v in tensors.items()}, folder / "adapter_model.bin")
    if sharded:
        cfg = json.loads((folder / "adapter_config.json").read_text())
        cfg["moec"]["shards"] = True
        (folder / "adapter_config.json").write_text(json.dumps(cfg))
        for r in range(2):
            safetensors.save_file(
                {k: v.clone() for k, v in tensors.items()
                 if int(k.split(".")[3]) // 2 == r},
                folder / f"adapter_model-rank{r}-of-2.safetensors")
    return layer, folder


LOADERS = {
    # (what to build, the file made not regular, the call)
    "moec-config": ("moec", "adapter_config.json"),
    "moec-safetensors": ("moec", "adapter_model.safetensors"),
    "moec-bin": ("moec-bin", "adapter_model.bin"),
    "moec-rank-file": ("moec-sharded", "adapter_model-rank1-of-2.safetensors"),
    "hf-config": ("hf", "adapter_config.json"),
    "hf-safetensors": ("hf", "adapter_model.safetensors"),
    "hf-bin": ("hf-bin", "adapter_model.bin"),
    "checkpoint-single": ("ckpt-single", "model.safetensors"),
    "checkpoint-index": ("ckpt", "model.safetensors.index.json"),
    "checkpoint-shard": ("ckpt", "model-00002-of-00005.safetensors"),
}


def loader(tmp_path, build):
    """(the folder, the load to call) of one of LOADERS' kinds."""
    if build.startswith("moec"):
        layer, folder = moec_folder(tmp_path, "bin" if build == "moec-bin" else "safetensors",
                                    build == "moec-sharded")
        return folder, lambda: layer.load_adapters(folder)
    if build.startswith("hf"):
        model = hf_lora_model()
        folder = tmp_path / "adapters"
        mhf.save_adapters(model, folder)
        if build == "hf-bin":
            tensors = safetensors.load_file(folder / "adapter_model.safetensors")
            os.remove(folder / "adapter_model.safetensors")
            torch.save({k: v.clone() for k, v in tensors.items()}, folder / "adapter_model.bin")
        return folder, lambda: mhf.load_adapters(model, folder)
    src = make_model("qwen3_moe")
    folder = tmp_path / "ckpt"
    write_checkpoint(src, folder, max_shard_size=10**9 if build == "ckpt-single" else 30_000)
    model = make_model("qwen3_moe", seed=1)
    mhf.patch_model(model, ranks=2, threads=1)
    return folder, lambda: mhf.load_checkpoint(model, folder)


@pytest.mark.parametrize("case", list(LOADERS))
def test_every_loader_refuses_a_fifo_without_blocking(tmp_path, case):
    build, name = LOADERS[case]
    folder, load = loader(tmp_path, build)
    os.remove(folder / name)
    make_not_regular(folder / name, "fifo")
    error = without_blocking(load, folder / name)
    assert isinstance(error, ValueError), error
    assert f"{name}': is a FIFO, not a regular file" in str(error) or \
        f"{folder / name}: is a FIFO, not a regular file" in str(error), error
    assert str(error).startswith("moec: "), error


@pytest.mark.parametrize("kind,said", [("socket", "a socket"), ("dir", "a directory")])
def test_a_socket_or_a_directory_for_the_adapters_is_refused(tmp_path, kind, said):
    for build in ("moec-bin", "hf"):
        folder, load = loader(tmp_path / build, build)
        name = "adapter_model.bin" if build == "moec-bin" else "adapter_model.safetensors"
        os.remove(folder / name)
        make_not_regular(folder / name, kind)
        error = without_blocking(load)
        assert isinstance(error, ValueError), error
        assert f"{folder / name}: is {said}, not a regular file" in str(error), error


def test_a_fifo_beside_the_adapters_is_not_read(tmp_path):
    """A FIFO named like a backup (adapter_model.old.bin) or a shard beside
    the files the config names: they load, and the FIFO is never opened."""
    layer, folder = moec_folder(tmp_path, "bin")
    os.mkfifo(folder / "adapter_model.old.bin")
    os.mkfifo(folder / "adapter_model-rank0-of-2.safetensors")
    fresh = lora_layer(seed=1)
    assert without_blocking(lambda: fresh.load_adapters(folder), folder /
                            "adapter_model.old.bin") is None
    assert all(torch.equal(a, b) for a, b in zip(layer.adapters(), fresh.adapters()))


# --- 2. a save into a full filesystem -------------------------------------------

def fail_on_sync(monkeypatch, which):
    """os.fsync raising ENOSPC (a full disk) on its `which`th call."""
    calls = []
    real = os.fsync

    def fsync(fd):
        calls.append(fd)
        if len(calls) == which:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)


def folder_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}


@pytest.mark.parametrize("saver,which", [(s, w) for s in ("moec", "hf", "hf-pretrained",
                                                           "save_sharded") for w in (1, 2)]
                         + [("save_state", 1)])
def test_a_failed_save_leaves_the_old_files(tmp_path, monkeypatch, saver, which):
    """A save whose first or second file fails to be written (ENOSPC)
    raises OSError naming the file, leaves every old file as it was (not
    the new weights beside the old config) and no scratch file."""
    folder = tmp_path / "out"
    if saver == "moec":
        layer = lora_layer()
        save = lambda: layer.save_adapters(folder)  # noqa: E731
    elif saver == "hf":
        model = hf_lora_model()
        save = lambda: mhf.save_adapters(model, folder)  # noqa: E731
    elif saver == "hf-pretrained":
        model = make_model("qwen3_moe")
        mhf.patch_model(model, ranks=2, threads=1)
        save = lambda: mhf.save_pretrained(model, folder, max_shard_size=30_000)  # noqa: E731
    elif saver == "save_sharded":
        state = {f"w{i}": torch.randn(64, 64) for i in range(4)}
        save = lambda: safetensors.save_sharded(state, folder, 20_000)  # noqa: E731
    else:
        state = {"w": torch.randn(64, 64)}
        save = lambda: moec_torch.save_state(state, folder / "state.pt")  # noqa: E731
    folder.mkdir()
    save()
    old = folder_bytes(folder)
    assert len(old) >= (1 if saver == "save_state" else 2)
    if saver == "moec":
        with torch.no_grad():
            layer.w1_lora_A.add_(1)
    elif saver == "hf":
        with torch.no_grad():
            hf_adapters(model)[0].add_(1)
    elif saver == "hf-pretrained":
        with torch.no_grad():
            model.lm_head.weight.add_(1)
    else:
        state["w0" if saver == "save_sharded" else "w"].add_(1)
    fail_on_sync(monkeypatch, which)
    with pytest.raises(OSError, match="No space left on device") as error:
        save()
    assert error.value.filename and str(folder) in error.value.filename
    monkeypatch.undo()
    assert folder_bytes(folder) == old


SCRIPT = """
import os, sys, torch
import moec_torch
folder = sys.argv[1]
moec_torch.save_state({"w": torch.zeros(4)}, folder + "/state.pt")
fd = os.open(folder + "/filler", os.O_WRONLY | os.O_CREAT)   # the rest of the filesystem
try:
    while True:
        os.write(fd, b"x" * 4096)
except OSError:
    os.close(fd)
try:
    SAVE({"w": torch.ones(100000)}, folder + "/state.pt")
except OSError as e:
    print("refused:", e)
print("alive")
"""


def test_a_save_into_a_full_tmpfs_leaves_a_live_process(tmp_path):
    """On a real full filesystem (a tmpfs of 256 KiB: needs root), save_state
    raises OSError and the process goes on, the old file whole; torch.save
    to the path ends the process (SIGABRT: PyTorch's zip writer throws as
    it is destroyed), which is why save_state writes through memory."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        results = {}
        for name, save in (("save_state", "moec_torch.save_state"), ("torch.save", "torch.save")):
            for p in mount.iterdir():
                p.unlink()
            results[name] = subprocess.run(
                [sys.executable, "-c", SCRIPT.replace("SAVE", save), str(mount)],
                capture_output=True, text=True, timeout=120)
            if name == "save_state":
                assert results[name].returncode == 0, results[name].stderr
                assert "refused: [Errno 28] No space left on device" in results[name].stdout
                assert "alive" in results[name].stdout
                saved = torch.load(mount / "state.pt", weights_only=True)
                assert torch.equal(saved["w"], torch.zeros(4))
                assert sorted(p.name for p in mount.iterdir()) == ["filler", "state.pt"]
        assert results["torch.save"].returncode in (-6, 134), results["torch.save"]
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_the_toy_training_saves_through_save_state(tmp_path, monkeypatch):
    """examples/torch/train_toy.py --save writes whole or not at all."""
    import train_toy
    fail_on_sync(monkeypatch, 1)
    (tmp_path / "p.pt").write_bytes(b"old")
    with pytest.raises(OSError, match="No space left on device"):
        train_toy.train(steps=1, ranks=2, save=str(tmp_path / "p.pt"), log_every=1,
                        out=lambda *_: None)
    assert (tmp_path / "p.pt").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.pt"]


# --- 3. adapters of another layer, of another dtype, in other files --------------

def test_adapters_of_a_layer_of_more_experts_are_refused(tmp_path):
    big = lora_layer(experts=8)
    big.save_adapters(tmp_path)
    small = lora_layer(seed=1)
    before = snapshot(small)
    with pytest.raises(ValueError, match="adapter_config.json': the adapters are of a layer of 8 "
                                         "experts; this layer has 4"):
        small.load_adapters(tmp_path)
    assert_unchanged(before, small)
    # Without save_adapters' record (PEFT's config): the tensors of experts 4..7.
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    del cfg["moec"]
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"adapter_model.safetensors: 'base_model.model.experts"
                                         r".[4-7].* is not an adapter of this layer \(expert "
                                         r"[4-7]; the layer has 4 experts\)"):
        small.load_adapters(tmp_path)
    assert_unchanged(before, small)


def test_hf_adapters_of_a_model_of_more_experts_are_refused(tmp_path):
    mhf.save_adapters(hf_lora_model(), tmp_path)
    small = hf_lora_model(seed=1, num_experts=4)
    before = [p.detach().clone() for p in hf_adapters(small)]
    with pytest.raises(ValueError, match=r"is not an adapter of this layer \(expert [4-7]; the "
                                         r"layer has 4 experts\)"):
        mhf.load_adapters(small, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(before, hf_adapters(small)))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_adapters_of_a_non_float_dtype_are_refused(tmp_path, dtype):
    layer, folder = moec_folder(tmp_path)
    path = folder / "adapter_model.safetensors"
    tensors = safetensors.load_file(path)
    safetensors.save_file({k: (v * 100).to(dtype) for k, v in tensors.items()}, path)
    fresh = lora_layer(seed=1)
    before = snapshot(fresh)
    with pytest.raises(ValueError, match=f"adapter_model.safetensors: '.*' is {dtype}; an "
                                         "adapter is a floating-point tensor"):
        fresh.load_adapters(folder)
    assert_unchanged(before, fresh)
    model = hf_lora_model()
    mhf.save_adapters(model, tmp_path / "hf")
    path = tmp_path / "hf/adapter_model.safetensors"
    tensors = safetensors.load_file(path)
    safetensors.save_file({k: (v * 100).to(dtype) for k, v in tensors.items()}, path)
    before = [p.detach().clone() for p in hf_adapters(model)]
    with pytest.raises(ValueError, match=f"is {dtype}; an adapter is a floating-point tensor"):
        mhf.load_adapters(model, tmp_path / "hf")
    assert all(torch.equal(a, b) for a, b in zip(before, hf_adapters(model)))


def test_only_the_files_the_config_names_are_read(tmp_path):
    """A backup adapter_model.old.bin (older adapters) beside the newer
    adapter_model.bin, a stray adapter_model-copy.safetensors of garbage,
    stale rank files of another layout: none is read."""
    new, folder = moec_folder(tmp_path, "bin")
    old = lora_layer(seed=5)
    torch.save({name: getattr(old, p)[e].detach().t().contiguous().clone()
                for p, e, name in old._peft_names("experts")}, folder / "adapter_model.old.bin")
    (folder / "adapter_model-copy.safetensors").write_bytes(os.urandom(100))
    (folder / "adapter_model-rank0-of-4.safetensors").write_bytes(os.urandom(100))
    fresh = lora_layer(seed=1)
    fresh.load_adapters(folder)
    assert all(torch.equal(a, b) for a, b in zip(new.adapters(), fresh.adapters()))
    # The rank files the config names, and no other.
    new, folder = moec_folder(tmp_path / "sharded", sharded=True)
    (folder / "adapter_model.safetensors").write_bytes(os.urandom(100))
    (folder / "adapter_model-rank2-of-4.safetensors").write_bytes(os.urandom(100))
    fresh = lora_layer(seed=1)
    fresh.load_adapters(folder)
    assert all(torch.equal(a, b) for a, b in zip(new.adapters(), fresh.adapters()))
    os.remove(folder / "adapter_model-rank1-of-2.safetensors")
    with pytest.raises(ValueError, match="adapter_model-rank1-of-2.safetensors: cannot open: "
                                         "No such file"):
        fresh.load_adapters(folder)


def test_hf_reads_only_adapter_model_safetensors_or_bin(tmp_path):
    model = hf_lora_model()
    mhf.save_adapters(model, tmp_path)
    tensors = safetensors.load_file(tmp_path / "adapter_model.safetensors")
    # A backup .bin of other values, and the parts of an unfinished sharded save.
    torch.save({k: torch.zeros_like(v) for k, v in tensors.items()},
               tmp_path / "adapter_model.old.bin")
    (tmp_path / "adapter_model-00000-of-00002.safetensors").write_bytes(os.urandom(64))
    fresh = hf_lora_model(seed=1)
    mhf.load_adapters(fresh, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(hf_adapters(model), hf_adapters(fresh)))
    os.remove(tmp_path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="adapter_model.safetensors: cannot open: No such file"):
        mhf.load_adapters(fresh, tmp_path)


# --- 4. a refused state dict leaves the layer untouched ---------------------------

def refusals(layer):
    """(what, state dict, strict, message) of every refusal of a state dict
    made from the layer's own."""
    sd = layer.state_dict()
    out = []

    def case(what, change, message, strict=True):
        bad = dict(sd)
        change(bad)
        out.append((what, bad, strict, message))

    case("missing _extra_state", lambda s: s.pop("_extra_state"), r"missing \['_extra_state'\]")
    case("missing w2", lambda s: s.pop("w2"), r"missing \['w2'\]")
    case("an unexpected key", lambda s: s.update(extra=torch.zeros(1)),
         r"unexpected \['extra'\]")
    for strict in (True, False):
        case("w2 of another shape", lambda s: s.update(w2=s["w2"][:, :-1]),
             "'w2' has shape", strict)
        case("w2 of another dtype", lambda s: s.update(w2=s["w2"].double()),
             "'w2' is torch.float64", strict)
        case("w2 of integers", lambda s: s.update(w2=s["w2"].int()), "'w2' is torch.int32",
             strict)
        case("w2 not a tensor", lambda s: s.update(w2=[1.0]), "'w2' is a list, not a tensor",
             strict)
        case("a layout of another layer",
             lambda s: s.update(_extra_state=dict(s["_extra_state"], layout=dict(
                 s["_extra_state"]["layout"], hidden=32))), "its hidden is 32", strict)
        case("a layout without its keys",
             lambda s: s.update(_extra_state=dict(s["_extra_state"], layout={})),
             "its layout lacks", strict)
    if layer.main_grad:
        case("main_grad of another shape", lambda s: s.update(_extra_state=dict(
            s["_extra_state"], main_grad={"w1": s["_extra_state"]["main_grad"]["w1"],
                                          "w2": torch.zeros(3)})),
             r"main_grad'\]\['w2'\]' has shape \[3\]")
    if layer.lora_rank:
        case("an adapter of another shape",
             lambda s: s.update(w2_lora_B=s["w2_lora_B"][..., :-1]), "'w2_lora_B' has shape")
    return out


@pytest.mark.parametrize("variant", [{}, {"main_grad": True}, {"lora_rank": 4}])
def test_a_refused_state_dict_leaves_the_layer_bitwise_untouched(variant):
    torch.manual_seed(0)
    source = moec_torch.MoeFFN(config(), ranks=2, threads=1, **variant)
    if source.main_grad:
        source.w1.main_grad.uniform_()
        source.w2.main_grad.uniform_()
    torch.manual_seed(1)
    layer = moec_torch.MoeFFN(config(), ranks=2, threads=1, **variant)
    before = snapshot(layer)
    assert not torch.equal(before["w1"], source.w1)
    for what, sd, strict, message in refusals(source):
        with pytest.raises(ValueError, match=message):
            layer.load_state_dict(sd, strict=strict)
        assert_unchanged(before, layer)
    # What it refused, a good checkpoint loads.
    layer.load_state_dict(source.state_dict())
    assert torch.equal(layer.w2, source.w2)


# --- 5. damaged files -----------------------------------------------------------

def zip_bytes(members):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buffer.getvalue()


def torch_bytes(obj, legacy=False):
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=not legacy)
    return buffer.getvalue()


GOOD_BIN = torch_bytes({"a": torch.ones(1000)})
BAD_BINS = {
    "truncated": (GOOD_BIN[:len(GOOD_BIN) // 2], "a damaged zip archive, not a whole torch.save "
                                                 "file \\(truncated\\?\\)"),
    "random bytes": (bytes(range(7, 255)) * 20, "is not a torch.save file \\(neither a zip "
                                                "archive nor a pickle"),
    "empty": (b"", "is empty, not a torch.save file"),
    "a zip without data.pkl": (zip_bytes({"archive/version": b"3"}),
                               "a zip archive without the members of a torch.save file"),
    "a zip without its storages": (zip_bytes({
        n: zipfile.ZipFile(io.BytesIO(GOOD_BIN)).read(n) for n in
        zipfile.ZipFile(io.BytesIO(GOOD_BIN)).namelist() if "/data/" not in n}),
        "a damaged torch.save file \\(truncated\\?\\): torch.load failed"),
    "a truncated pickle": (torch_bytes({"a": torch.ones(3)}, legacy=True)[:30],
                           "a damaged torch.save file \\(truncated\\?\\): torch.load failed"),
    "not a dict": (torch_bytes([torch.ones(2)]), "not a dict of tensors"),
}


@pytest.mark.parametrize("damage", list(BAD_BINS))
@pytest.mark.parametrize("who", ["moec", "hf"])
def test_a_damaged_bin_names_the_file_and_the_damage(tmp_path, damage, who):
    build = "moec-bin" if who == "moec" else "hf-bin"
    folder, load = loader(tmp_path, build)
    data, message = BAD_BINS[damage]
    (folder / "adapter_model.bin").write_bytes(data)
    with pytest.raises(ValueError) as error:
        load()
    text = str(error.value)
    assert text.startswith(f"moec: {folder / 'adapter_model.bin'}: "), text
    assert re.search(message, text), text


@pytest.mark.parametrize("damage", ["truncated", "random bytes", "empty"])
def test_a_damaged_safetensors_names_the_file(tmp_path, damage):
    folder, load = loader(tmp_path, "moec")
    path = folder / "adapter_model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"truncated": data[:len(data) // 2], "random bytes": os.urandom(5000),
                      "empty": b""}[damage])
    with pytest.raises(ValueError, match=f"^moec: {path}: "):
        load()


CONFIG_DAMAGE = {
    "target_modules 5": (dict(target_modules=5),
                         "'target_modules' must be a list of module names or a regex, got 5"),
    "target_modules [1]": (dict(target_modules=[1]), "'target_modules' must be a list"),
    "r 'x'": (dict(r="x"), "'r' must be a positive integer, got 'x'"),
    "r true": (dict(r=True), "'r' must be a positive integer, got True"),
    "lora_alpha null": (dict(lora_alpha=None), "'lora_alpha' must be a positive number, got None"),
    "peft_type 7": (dict(peft_type=7), "'peft_type' must be a string"),
    "moec 3": (dict(moec=3), "'moec' must be an object"),
    "moec.experts '8'": (dict(moec={"experts": "8", "ranks": 2, "module_prefix": "experts",
                                    "shards": False}), "'moec.experts' must be a positive integer"),
    "moec.ranks 3": (dict(moec={"experts": 4, "ranks": 3, "module_prefix": "experts",
                                "shards": False}), r"'moec.experts' \(4\) is not a multiple of"),
}


@pytest.mark.parametrize("damage", list(CONFIG_DAMAGE) + ["a list", "not JSON", "NaN"])
@pytest.mark.parametrize("who", ["moec", "hf"])
def test_a_config_of_wrong_types_names_the_file_and_the_field(tmp_path, damage, who):
    folder, load = loader(tmp_path, who)
    path = folder / "adapter_config.json"
    cfg = json.loads(path.read_text())
    if damage == "a list":
        path.write_text("[1, 2]")
        message = "must hold a JSON object, got list"
    elif damage == "not JSON":
        path.write_text('{"r": 4,')
        message = "is not JSON"
    elif damage == "NaN":
        path.write_text(json.dumps(dict(cfg, lora_alpha=float("nan"))))
        message = "NaN is not a JSON number"
    else:
        change, message = CONFIG_DAMAGE[damage]
        path.write_text(json.dumps(dict(cfg, **change)))
    with pytest.raises(ValueError) as error:
        load()
    assert str(error.value).startswith(f"moec: adapter config '{path}'"), str(error.value)
    assert message in str(error.value) or re.search(message, str(error.value)), \
        str(error.value)


def test_checkpoint_tensors_of_a_non_float_dtype_are_refused(tmp_path):
    src = make_model("qwen3_moe")
    state = write_checkpoint(src, tmp_path / "good")
    model = make_model("qwen3_moe", seed=1)
    mhf.patch_model(model, ranks=2, threads=1)
    before = snapshot(model)
    for key in ("model.layers.0.mlp.experts.3.down_proj.weight", "model.norm.weight"):
        bad = {k: (v.int() if k == key else v).clone() for k, v in state.items()}
        folder = tmp_path / key
        folder.mkdir()
        src.config.save_pretrained(folder)
        safetensors.save_sharded(bad, folder, 30_000)
        with pytest.raises(ValueError, match=f"'{key}' in .* is I32; the model's is "
                                             "torch.float32"):
            mhf.load_checkpoint(model, folder)
        assert_unchanged(before, model)
    plain = make_model("qwen3_moe")
    with pytest.raises(ValueError, match="hf_models: 'model.norm.weight' is torch.int32"):
        hf_models.load_checkpoint_state_dict(plain, dict(state, **{
            "model.norm.weight": state["model.norm.weight"].int()}))
    with pytest.raises(ValueError, match="'model.norm.weight' is a list, not a tensor"):
        hf_models.load_checkpoint_state_dict(plain, dict(state, **{"model.norm.weight": [1]}))


# --- 6. interrupted writes and the scratch files they leave ------------------------

CRASH = """
import os, sys, torch
sys.path[:0] = sys.argv[2:]
from test_hostile_files import lora_layer
layer = lora_layer(seed=int(sys.argv[1].rsplit("-", 1)[1]))
real, calls = os.replace, []
def crash(a, b):
    calls.append(b)
    if len(calls) == CRASH_AT:
        os._exit(9)   # as a kill: no cleanup
    real(a, b)
os.replace = crash
layer.save_adapters(sys.argv[1].rsplit("-", 1)[0])
"""


@pytest.mark.parametrize("crash_at", [1, 2])
def test_a_save_killed_midway_leaves_whole_files_and_its_scratch_is_removed(tmp_path,
                                                                            crash_at):
    """A writer killed before its renames leaves the old adapters (and
    scratch files); killed between the renames, the new weights beside the
    old config, each whole. The next save removes the dead writer's
    scratch files."""
    folder = tmp_path / "adapters"
    old = lora_layer(seed=0)
    old.save_adapters(folder)
    done = subprocess.run([sys.executable, "-c", CRASH.replace("CRASH_AT", str(crash_at)),
                           f"{folder}-3", *sys.path], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 9, done.stderr
    scratch = [p.name for p in folder.iterdir() if p.name.startswith(".")]
    assert len(scratch) == 2 - (crash_at - 1), scratch
    fresh = lora_layer(seed=1)
    fresh.load_adapters(folder)
    want = old if crash_at == 1 else lora_layer(seed=3)
    assert all(torch.equal(a, b) for a, b in zip(want.adapters(), fresh.adapters()))
    old.save_adapters(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json",
                                                        "adapter_model.safetensors"]


def test_only_dead_writers_scratch_files_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = safetensors._HOST
    names = {
        f".adapter_model.safetensors.tmp.{host}.{dead.pid}.0123abcd": False,  # removed
        f".adapter_config.json.tmp.{host}.{dead.pid}.89abcdef": False,
        f".model.safetensors.tmp.{host}.{os.getpid()}.0123abcd": True,       # alive: kept
        f".adapter_model.safetensors.tmp.otherhost.{dead.pid}.0123abcd": True,  # elsewhere
        "adapter_model.safetensors.tmp.x": True,                              # not scratch
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    lora_layer().save_adapters(tmp_path)
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {n for n, kept in names.items() if kept} | {"adapter_config.json",
                                                                "adapter_model.safetensors"}


# --- a trace to load -------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "directory", "not-json", "a-list"])
def test_load_trace_refuses_what_is_not_a_trace(kind, tmp_path):
    path = tmp_path / "trace.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "not-json":
        path.write_bytes(b"\xff\xfe not json")
    else:
        path.write_text("[1, 2]")
    message = {"fifo": "is a FIFO, not a regular file", "directory": "is a directory",
               "not-json": "not a JSON trace", "a-list": "not a JSON trace"}[kind]
    error = without_blocking(lambda: moec_torch.load_trace(path),
                             path if kind == "fifo" else None)
    assert isinstance(error, ValueError) and f"trace '{path}'" in str(error), error
    assert message in str(error), error
