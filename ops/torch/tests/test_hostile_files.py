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
