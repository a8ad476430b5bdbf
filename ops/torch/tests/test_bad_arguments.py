"""Bad arguments to the torch op, each refused with a message that names the
argument, the config key or the file: integer arguments that are floats or
bools, config values JSON cannot hold (and numpy scalars, which it can once
converted), config paths that are not regular files, tensors of the wrong
dtype, copies and pickles of a layer, and a compile cache with a failed
compile or a damaged entry in it. Also what print(layer) says of a LoRA
layer."""

import copy
import io
import json
import os
import pickle
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import moec_torch
from moec_torch import checks
from test_moe_ffn import config, inputs

RANKS = 2


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    return moec_torch.MoeFFN(config(), RANKS, threads=2)


# --- integer and number arguments -------------------------------------------------

@pytest.mark.parametrize("name,value", [
    ("ranks", 2.9), ("ranks", 2.0), ("ranks", "2"), ("ranks", True), ("ep", 2.5),
    ("tp", 1.5), ("tp", True), ("threads", 1.7), ("threads", True),
    ("threads", np.float64(2.0)), ("lora_rank", 2.7), ("lora_rank", True),
    ("lora_rank", np.bool_(True)), ("lora_rank", torch.tensor(4.0)),
])
def test_integer_arguments_refuse_floats_and_bools(name, value):
    kwargs = {"ranks": RANKS, name: value}
    if name == "ep":
        del kwargs["ranks"]
    with pytest.raises(TypeError, match=f"MoeFFN: argument '{name}' must be an integer, "
                                        f"got {re.escape(repr(value))}"):
        moec_torch.MoeFFN(config(), **kwargs)


@pytest.mark.parametrize("name,value,bound", [
    ("ranks", 0, "positive"), ("tp", 0, "positive"), ("threads", -1, "0 to 1024"),
    ("threads", 1025, "0 to 1024"), ("lora_rank", -4, "at least 0"),
])
def test_integer_arguments_out_of_range(name, value, bound):
    with pytest.raises(ValueError, match=f"MoeFFN: argument '{name}' must be {bound}, "
                                         f"got {value}"):
        moec_torch.MoeFFN(config(), **{"ranks": RANKS, name: value})


def test_integer_arguments_take_numpy_and_torch_integers():
    layer = moec_torch.MoeFFN(config(), np.int64(2), threads=np.int32(2),
                              lora_rank=torch.tensor(4), lora_alpha=np.float32(8.0))
    assert (layer.ranks, layer.lora_rank, layer.lora_scaling) == (2, 4, 2.0)
    assert type(layer.lora_rank) is int and layer.info()["workers"] == 2
    assert moec_torch.MoeFFN(config(), ep=np.int16(2), tp=np.uint8(1)).ranks == 2


@pytest.mark.parametrize("value", [0, -8, 0.0, float("inf"), float("nan")])
def test_lora_alpha_argument_must_be_positive_and_finite(value):
    with pytest.raises(ValueError, match="MoeFFN: argument 'lora_alpha' must be a positive "
                                         f"finite number, got {value!r}"):
        moec_torch.MoeFFN(config(), RANKS, lora_rank=4, lora_alpha=value)


def test_number_arguments_refuse_bools_and_strings():
    for name, value in (("timeout_seconds", "60"), ("timeout_seconds", True),
                        ("lora_alpha", True)):
        with pytest.raises(TypeError, match=f"argument '{name}' must be a number"):
            moec_torch.MoeFFN(config(), RANKS, lora_rank=4, **{name: value})


def test_other_integer_arguments(tmp_path):
    with pytest.raises(TypeError, match="Exchange: argument 'ranks' must be an integer, got 2.5"):
        moec_torch.Exchange(config(), 2.5)
    with pytest.raises(TypeError, match="Exchange: argument 'threads' must be an integer"):
        moec_torch.Exchange(config(), RANKS, threads=1.5)
    with pytest.raises(TypeError, match="compile_graphs: argument 'ranks' must be an integer"):
        moec_torch.compile_layer(config(), 2.5)
    with pytest.raises(TypeError, match="compile_graphs: argument 'tp' must be an integer"):
        moec_torch.compile_layer(config(), RANKS, tp=1.0)
    with pytest.raises(TypeError, match="config key 'tp' must be an integer, got 1.5"):
        moec_torch.compile_layer(config(tp=1.5), RANKS)
    forward, _ = moec_torch.compile_layer(config(), RANKS)
    with pytest.raises(TypeError, match="dump: argument 'rank' must be an integer, got 1.5"):
        moec_torch.dump(forward, rank=1.5)


# --- config dicts and files ---------------------------------------------------------

@pytest.mark.parametrize("alpha", [0, 0.0, -8])
def test_config_lora_alpha_zero_is_refused_like_negative(alpha, tmp_path):
    cfg = config(lora_rank=4, lora_alpha=alpha)
    with pytest.raises(ValueError, match="config key 'lora_alpha' must be a positive number, "
                                         f"got {alpha!r}"):
        moec_torch.compile("moe_ffn_fwd_lora.json", cfg, tmp_path / "l.bin")
    # The module sets the adapters' keys itself, and refuses a config that does.
    with pytest.raises(ValueError, match=r"not the config \(it sets lora_alpha\)"):
        moec_torch.MoeFFN(config(lora_alpha=8), RANKS)
    with pytest.raises(ValueError, match="config key 'lora_alpha' must be a positive number"):
        moec_torch.MoeFFN(config(lora_alpha=alpha), RANKS, lora_rank=4)
    assert not (tmp_path / "l.bin").exists()
    # A positive alpha compiles.
    moec_torch.compile("moe_ffn_fwd_lora.json", config(lora_rank=4, lora_alpha=8),
                       tmp_path / "l.bin")


@pytest.mark.parametrize("key,value", [("capacity_factor", float("inf")),
                                       ("capacity_factor", float("nan")),
                                       ("capacity_factor", np.float32("inf"))])
def test_config_non_finite_numbers_name_the_key(key, value):
    with pytest.raises(ValueError, match=f"config key '{key}' must be a finite number"):
        moec_torch.MoeFFN(config(**{key: value}), RANKS)
    with pytest.raises(ValueError, match=f"config key '{key}' must be a finite number"):
        moec_torch.compile("moe_ffn_fwd.json", config(**{key: value}), "never.bin")


def test_config_takes_numpy_and_torch_scalars(tmp_path):
    cfg = config(hidden=np.int64(64), inter=np.int32(32), experts=torch.tensor(4),
                 capacity_factor=np.float32(2.0), ep=np.int64(2))
    layer = moec_torch.MoeFFN(cfg, RANKS, threads=2)
    assert layer.hidden == 64 and layer.experts == 4
    assert type(layer.config["hidden_size"]) is int
    assert type(layer.config["capacity_factor"]) is float
    # compile() takes the same dict, through the same normalization.
    summary = moec_torch.compile("moe_ffn_fwd.json", dict(cfg, ep=2), tmp_path / "f.bin")
    assert "moe_ffn_fwd" in summary and (tmp_path / "f.bin").is_file()


def test_config_values_json_cannot_hold_name_the_key():
    with pytest.raises(TypeError, match=r"config key 'dtype' must be a JSON value .*"
                                        r"got torch.float32 \(dtype\)"):
        moec_torch.MoeFFN(config(dtype=torch.float32), RANKS)
    with pytest.raises(TypeError, match="config keys must be strings, got 3"):
        moec_torch.MoeFFN({**config(), 3: 4}, RANKS)


def test_compile_error_of_a_config_dict_names_the_dict(tmp_path):
    with pytest.raises(RuntimeError, match=r"the config dict: 'num_experts' \(3\) must be a "
                                           r"multiple of 'ep' \(2\)"):
        moec_torch.compile("moe_ffn_fwd.json", config(experts=3, top_k=1, ep=2),
                           tmp_path / "f.bin")
    assert list(tmp_path.iterdir()) == []


def test_config_file_checks(tmp_path):
    nan = tmp_path / "nan.json"
    nan.write_text('{"hidden_size": NaN}')
    with pytest.raises(ValueError, match=f"config '{re.escape(str(nan))}': NaN is not a JSON number"):
        moec_torch.MoeFFN(nan, RANKS)
    twice = tmp_path / "twice.json"
    twice.write_text('{"seq_size": 64, "seq_size": 128}')
    with pytest.raises(ValueError, match=f"config '{re.escape(str(twice))}': key 'seq_size' appears twice"):
        moec_torch.MoeFFN(twice, RANKS)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"config '{re.escape(str(listed))}' must hold a JSON object"):
        moec_torch.MoeFFN(listed, RANKS)


def test_config_path_must_be_a_regular_file(tmp_path):
    with pytest.raises(ValueError, match=f"config '{re.escape(str(tmp_path))}': is a directory, not a regular "
                                         "file"):
        moec_torch.MoeFFN(tmp_path, RANKS)
    with pytest.raises(ValueError, match="config '/dev/null': is a character device, not a "
                                         "regular file"):
        moec_torch.MoeFFN("/dev/null", RANKS)
    link = tmp_path / "link.json"
    link.symlink_to("/dev/null")
    with pytest.raises(ValueError, match=f"config '{re.escape(str(link))}' \\(a link to '/dev/null'\\): is a "
                                         "character device"):
        moec_torch.MoeFFN(link, RANKS)
    big = tmp_path / "big.json"
    big.write_text('{"name": "' + "x" * (1 << 20) + '"}')
    with pytest.raises(ValueError, match=f"config '{re.escape(str(big))}' has {big.stat().st_size} bytes; a "
                                         "config of more than 1048576 bytes is refused"):
        moec_torch.MoeFFN(big, RANKS)


def test_config_fifo_is_refused_without_blocking(tmp_path):
    from test_hostile_files import without_blocking
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    error = without_blocking(lambda: moec_torch.MoeFFN(fifo, RANKS), fifo)
    assert isinstance(error, ValueError), error
    assert f"config '{fifo}': is a FIFO, not a regular file" in str(error)


# --- tensor dtypes ------------------------------------------------------------------

@pytest.mark.parametrize("dtype,name", [(torch.int16, "i16"), (torch.uint8, "u8"),
                                        (torch.bool, "bool"), (torch.float32, "f32"),
                                        (torch.float64, "f64")])
def test_topk_ids_dtype_message_says_what_is_accepted(layer, dtype, name):
    x, ids, weights, _ = inputs(layer, seed=1)
    with pytest.raises(RuntimeError, match=f"topk_ids is {name}; expected i32 or i64$"):
        layer(x, ids.to(dtype), weights)


@pytest.mark.parametrize("dtype,name", [(torch.float64, "f64"), (torch.bfloat16, "bf16"),
                                        (torch.int32, "i32"), (torch.float16, "f16")])
def test_topk_weights_and_x_dtype_messages(layer, dtype, name):
    x, ids, weights, _ = inputs(layer, seed=1)
    with pytest.raises(RuntimeError, match=f"topk_weights is {name}; expected f32$"):
        layer(x, ids, weights.to(dtype))
    with pytest.raises(RuntimeError, match=f"'x' is {name}; expected f32, the layer's dtype$"):
        layer(x.to(dtype), ids, weights)
    with pytest.raises(RuntimeError, match=f"'w1' is {name}; expected f32, the layer's dtype$"):
        torch.ops.moec.forward(layer.layer, x, ids, weights, layer.w1.detach().to(dtype),
                               layer.w2.detach(), [])


def test_exchange_dtype_messages(layer):
    ex = moec_torch.Exchange(config(), RANKS, threads=2)
    x, ids, weights, _ = inputs(layer, seed=1)
    with pytest.raises(RuntimeError, match="topk_ids is u8; expected i32 or i64$"):
        ex.dispatch(x, ids.to(torch.uint8), weights)
    with pytest.raises(RuntimeError, match="topk_weights is f64; expected f32$"):
        ex.dispatch(x, ids, weights.double())
    with pytest.raises(RuntimeError, match="'x' is f64; expected f32, the layer's dtype$"):
        ex.dispatch(x.double(), ids, weights)
    expert_x, _, handle = ex.dispatch(x, ids, weights)
    with pytest.raises(RuntimeError, match="'expert_y' is bf16; expected f32, the layer's dtype$"):
        ex.combine(expert_x.bfloat16(), handle)
    with pytest.raises(TypeError, match="an Exchange cannot be copied or pickled"):
        pickle.dumps(ex)


# --- copies, pickles and checkpoints ------------------------------------------------

@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle", "torch.save"])
def test_layer_copies_and_pickles_are_refused_with_the_way_to_save(layer, how):
    save = {"deepcopy": copy.deepcopy, "copy": copy.copy, "pickle": pickle.dumps,
            "torch.save": lambda m: torch.save(m, io.BytesIO())}[how]
    with pytest.raises(TypeError, match=r"a MoeFFN layer cannot be copied or pickled.*"
                                        r"save_state\(layer.state_dict\(\), path\).*"
                                        r"MoeFFN\(config, ...\); layer.load_state_dict"
                                        r"\(torch.load\(path, weights_only=True\)\)"):
        save(layer)
    # A model holding the layer says the same (a shallow copy copies no layer).
    if how == "copy":
        return
    with pytest.raises(TypeError, match="a MoeFFN layer cannot be copied or pickled"):
        save(torch.nn.Sequential(torch.nn.Identity(), layer))


def test_state_dict_saves_and_rebuilds_the_layer(tmp_path):
    torch.manual_seed(5)
    layer = moec_torch.MoeFFN(config(), RANKS, threads=2, lora_rank=4, lora_alpha=8)
    with torch.no_grad():
        for a in layer.adapters():
            a.uniform_(-0.1, 0.1)
    moec_torch.save_state(layer.state_dict(), tmp_path / "layer.pt")
    torch.manual_seed(6)
    rebuilt = moec_torch.MoeFFN(config(), RANKS, threads=2, lora_rank=4, lora_alpha=8)
    assert not torch.equal(rebuilt.w1, layer.w1)
    rebuilt.load_state_dict(torch.load(tmp_path / "layer.pt", weights_only=True))
    for name, p in layer.named_parameters():
        assert torch.equal(p, dict(rebuilt.named_parameters())[name]), name
    x, ids, weights, _ = inputs(layer, seed=2)
    assert torch.equal(layer(x, ids, weights), rebuilt(x, ids, weights))


# --- the compile cache --------------------------------------------------------------

@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(moec_torch.cache, "_compiled", {})
    return tmp_path / "cache"


def test_a_failed_compile_leaves_nothing_in_the_cache(cache):
    with pytest.raises(RuntimeError, match=r"'num_experts' \(3\) must be a multiple of 'ep'"):
        moec_torch.MoeFFN(config(experts=3, top_k=1), RANKS)
    assert not cache.exists() or list(cache.iterdir()) == []


def damage(path):
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:len(data) // 2])
    return len(data)


def test_a_truncated_cache_entry_is_compiled_anew(cache):
    forward, backward = moec_torch.compile_layer(config(), RANKS)
    entry = Path(forward).parent
    assert sorted(p.name for p in entry.iterdir()) == [
        "config.json", "manifest.json", "moe_ffn_bwd.moebin", "moe_ffn_fwd.moebin"]
    assert [p.name for p in cache.iterdir()] == [entry.name]  # no scratch folder left
    size = damage(forward)
    # Another process's view: the cache in memory is empty, the entry on disk
    # is checked against its manifest.
    moec_torch.cache._compiled.clear()
    with pytest.warns(RuntimeWarning, match=f"compile cache entry {re.escape(str(entry))} is damaged "
                                            r"\(moe_ffn_fwd.moebin has \d+ bytes; "
                                            f"{size} were written\\); removed, compiling it anew"):
        layer = moec_torch.MoeFFN(config(), RANKS, threads=2)
    assert Path(forward).stat().st_size == size
    assert [p.name for p in cache.iterdir()] == [entry.name]
    # Damaged after this process took the entry: the load fails, and the
    # layer compiles it anew.
    damage(backward)
    with pytest.warns(RuntimeWarning, match=r"cached binaries cannot be used \(moec backward "
                                            r"binary: .*truncated.*\); compiling them anew"):
        again = moec_torch.MoeFFN(config(), RANKS, threads=2)
    x, ids, weights, dy = inputs(layer, seed=3)
    with torch.no_grad():
        again.w1.copy_(layer.w1)
        again.w2.copy_(layer.w2)
    y = again(x, ids, weights)
    y.backward(dy)
    assert torch.equal(y, layer(x, ids, weights)) and again.w1.grad is not None
    # A whole entry is taken as it is, without a warning.
    moec_torch.cache._compiled.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert moec_torch.compile_layer(config(), RANKS) == (forward, backward)


def test_an_entry_without_manifest_is_compiled_anew(cache):
    forward, _ = moec_torch.compile_layer(config(), RANKS)
    (Path(forward).parent / "manifest.json").unlink()
    moec_torch.cache._compiled.clear()
    with pytest.warns(RuntimeWarning, match="no readable manifest.json"):
        moec_torch.compile_layer(config(), RANKS)
    assert (Path(forward).parent / "manifest.json").is_file()


# --- print(layer) -------------------------------------------------------------------

def test_repr_says_what_trains():
    lora = repr(moec_torch.MoeFFN(config(), RANKS, lora_rank=4, lora_alpha=8,
                                  lora_targets=("w2",)))
    assert "frozen=True" not in lora and "main_grad" not in lora, lora
    assert ("lora_rank=4, lora_targets=('w2',), lora_scaling=2 (base weights frozen, "
            "adapters trained)") in lora, lora
    assert "frozen=True, main_grad=False" in repr(moec_torch.MoeFFN(config(), RANKS,
                                                                    frozen=True))
    assert "frozen=False, main_grad=True" in repr(moec_torch.MoeFFN(config(), RANKS,
                                                                    main_grad=True))
    assert "pack_weights" not in repr(moec_torch.MoeFFN(config(), RANKS, frozen=True))
    assert repr(moec_torch.MoeFFN(config(), RANKS, frozen=True, pack_weights="forward")).endswith(
        "pack_weights='forward')")


# --- files written over files read -----------------------------------------------

@pytest.fixture
def graphs(tmp_path, monkeypatch):
    """A copy of the graph folder as MOEC_GRAPHS, so that a test that writes
    over a graph writes over the copy."""
    folder = tmp_path / "graphs"
    folder.mkdir()
    for g in Path(moec_torch.native.graphs_dir()).glob("*.json"):
        (folder / g.name).write_bytes(g.read_bytes())
    monkeypatch.setenv("MOEC_GRAPHS", str(folder))
    monkeypatch.setattr(moec_torch.cache, "_compiled", {})
    return folder


PROFILE = '{"name": "p", "cube_cores": 2, "vector_cores": 2}'


def test_compile_refuses_an_output_that_is_one_of_its_inputs(tmp_path, graphs):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(config(ep=2)))
    text = cfg.read_text()
    with pytest.raises(ValueError, match=f"compile: the output '{re.escape(str(cfg))}' is the "
                                         f"same file as the config '{re.escape(str(cfg))}'"):
        moec_torch.compile("moe_ffn_fwd.json", cfg, cfg)
    link = tmp_path / "link.bin"
    link.symlink_to(cfg)
    with pytest.raises(ValueError, match=f"the output '{re.escape(str(link))}' \\(a link to "
                                         f"'{re.escape(str(cfg))}'\\) is the same file as the "
                                         "config"):
        moec_torch.compile("moe_ffn_fwd.json", cfg, link)
    hard = tmp_path / "hard.bin"
    os.link(cfg, hard)
    with pytest.raises(ValueError, match="is the same file as the config"):
        moec_torch.compile("moe_ffn_fwd.json", cfg, hard)
    assert cfg.read_text() == text
    # The shipped graph, named bare (looked up in MOEC_GRAPHS) or by path.
    graph = graphs / "moe_ffn_fwd.json"
    before = graph.read_bytes()
    for name in ("moe_ffn_fwd.json", graph):
        with pytest.raises(ValueError, match=f"the output '{re.escape(str(graph))}' is the same "
                                             f"file as the graph '{re.escape(str(graph))}'"):
            moec_torch.compile(name, cfg, graph)
    assert graph.read_bytes() == before
    # A target profile file, and a dict config with the graph.
    profile = tmp_path / "p.json"
    profile.write_text(PROFILE)
    with pytest.raises(ValueError, match="is the same file as the target profile"):
        moec_torch.compile("moe_ffn_fwd.json", cfg, profile, target=str(profile))
    with pytest.raises(ValueError, match="is the same file as the graph"):
        moec_torch.compile(graph, config(ep=2), graph)
    assert profile.read_text() == PROFILE and graph.read_bytes() == before
    # Refused before compiling: a folder that is not there, or a folder.
    with pytest.raises(ValueError, match=f"compile: the folder '{re.escape(str(tmp_path))}/no' "
                                         "of the output .*/no/f.bin' does not exist"):
        moec_torch.compile("moe_ffn_fwd.json", cfg, tmp_path / "no/f.bin")
    with pytest.raises(ValueError, match="compile: the output .* is a directory, not a file"):
        moec_torch.compile("moe_ffn_fwd.json", cfg, tmp_path)
    # An output that is another file is written.
    moec_torch.compile("moe_ffn_fwd.json", cfg, tmp_path / "f.bin")
    with pytest.raises(ValueError, match="simulate_trace: the output .* is the same file as the "
                                         "binary"):
        moec_torch.simulate_trace(tmp_path / "f.bin", tmp_path / "f.bin")
    with pytest.raises(ValueError, match="simulate_trace: the folder .* does not exist"):
        moec_torch.simulate_trace(tmp_path / "f.bin", tmp_path / "no/t.json")


def test_write_trace_refuses_files_the_layer_reads(tmp_path, graphs):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(config()))
    text = cfg.read_text()
    layer = moec_torch.MoeFFN(cfg, RANKS, threads=2, trace=True)
    x, ids, weights, _ = inputs(layer, seed=1)
    layer(x, ids, weights)
    with pytest.raises(ValueError, match=f"write_trace: the trace path '{re.escape(str(cfg))}' "
                                         f"is the same file as the config '{re.escape(str(cfg))}'"):
        layer.write_trace(cfg)
    link = tmp_path / "t.json"
    link.symlink_to(cfg)
    with pytest.raises(ValueError, match=r"\(a link to .*cfg.json'\) is the same file as "
                                         "the config"):
        layer.write_trace(link)
    assert cfg.read_text() == text
    forward, _ = layer._binaries
    size = Path(forward).stat().st_size
    with pytest.raises(ValueError, match="is the same file as the forward binary"):
        layer.write_trace(forward)
    with pytest.raises(ValueError, match="is the same file as the graph"):
        layer.write_trace(graphs / "moe_ffn_fwd.json")
    assert Path(forward).stat().st_size == size
    # The folder is checked before the trace is built.
    with pytest.raises(ValueError, match=f"write_trace: the folder '{re.escape(str(tmp_path))}/no' "
                                         "of the trace path .* does not exist"):
        layer.write_trace(tmp_path / "no/t.json")
    layer.write_trace(tmp_path / "trace.json")
    assert moec_torch.load_trace(tmp_path / "trace.json")["tasks"]


def test_save_adapters_refuses_the_config_file(tmp_path):
    cfg = tmp_path / "adapter_config.json"
    cfg.write_text(json.dumps(config()))
    text = cfg.read_text()
    layer = moec_torch.MoeFFN(cfg, RANKS, lora_rank=4)
    with pytest.raises(ValueError, match="save_adapters: the adapter file .*adapter_config.json' "
                                         "is the same file as the config"):
        layer.save_adapters(tmp_path)
    assert cfg.read_text() == text and not (tmp_path / "adapter_model.safetensors").exists()


# --- boolean arguments ------------------------------------------------------------

@pytest.mark.parametrize("name,value", [
    ("main_grad", "no"), ("frozen", "false"), ("trace", "no"), ("check_finite", "yes"),
    ("frozen", 1), ("main_grad", 0), ("trace", None), ("check_finite", 1.0),
    ("frozen", torch.tensor([True])), ("trace", torch.tensor(1)),
])
def test_boolean_arguments_must_be_bools(name, value):
    with pytest.raises(TypeError, match=f"MoeFFN: argument '{name}' must be a bool \\(True or "
                                        f"False\\), got {re.escape(repr(value))} "
                                        f"\\({type(value).__name__}\\)"):
        moec_torch.MoeFFN(config(), RANKS, **{name: value})


def test_boolean_arguments_take_numpy_and_torch_bools():
    layer = moec_torch.MoeFFN(config(), RANKS, frozen=np.bool_(True), trace=torch.tensor(False),
                              check_finite=np.bool_(False))
    assert layer.frozen is True and layer.check_finite is False
    assert moec_torch.MoeFFN(config(), RANKS, main_grad=torch.tensor(True)).main_grad is True


def test_other_boolean_arguments():
    with pytest.raises(TypeError, match="compile_layer: argument 'frozen' must be a bool"):
        moec_torch.compile_layer(config(), RANKS, frozen="no")
    with pytest.raises(TypeError, match="compile_layer: argument 'fresh' must be a bool"):
        moec_torch.compile_layer(config(), RANKS, fresh="false")
    with pytest.raises(TypeError, match="compile_graphs: argument 'fresh' must be a bool"):
        moec_torch.compile_graphs(config(), RANKS, ["moe_ffn_fwd.json"], fresh=1)
    with pytest.raises(TypeError, match="capacity_advice: argument 'headroom' must be a bool"):
        moec_torch.native.capacity_advice(config(ep=2), 64, 64, headroom="no")


# --- timeouts ---------------------------------------------------------------------

@pytest.mark.parametrize("value", [1e-300, 0.0009, 0, -1, 1e300, 1000001, float("inf"),
                                   float("nan"), np.float64(1e-4)])
def test_timeout_must_be_from_a_millisecond_to_a_million_seconds(value):
    for who, make in (("MoeFFN", moec_torch.MoeFFN), ("Exchange", moec_torch.Exchange)):
        with pytest.raises(ValueError, match=f"{who}: argument 'timeout_seconds' must be a number "
                                             "of seconds from 0.001 to 1000000, got "
                                             f"{re.escape(repr(value))}$"):
            make(config(), RANKS, timeout_seconds=value)


def test_timeout_bounds_are_taken():
    for value in (0.001, 1e6, np.float32(30)):
        moec_torch.MoeFFN(config(), RANKS, threads=2, timeout_seconds=value)


# --- the compile cache: target profiles and MOEC_CACHE_DIR ------------------------

def test_cache_key_covers_the_target_profile_file(cache, tmp_path):
    profile = tmp_path / "p.json"
    profile.write_text(PROFILE)
    first = moec_torch.compile_layer(config(), RANKS, target=str(profile))
    assert json.loads(profile.read_text())["cube_cores"] == 2
    profile.write_text(PROFILE.replace('"cube_cores": 2', '"cube_cores": 3'))
    moec_torch.cache._compiled.clear()  # another process's view
    second = moec_torch.compile_layer(config(), RANKS, target=str(profile))
    assert Path(second[0]).parent != Path(first[0]).parent
    # The same contents again: the first entry.
    profile.write_text(PROFILE)
    moec_torch.cache._compiled.clear()
    assert moec_torch.compile_layer(config(), RANKS, target=str(profile)) == first
    # A profile the compiler refuses names the file, not the cache's copy.
    profile.write_text('{"name": "p", "cube_cores": 0, "vector_cores": 2}')
    with pytest.raises(RuntimeError, match=re.escape(str(profile))):
        moec_torch.compile_layer(config(), RANKS, target=str(profile))
    profile.unlink()
    with pytest.raises(ValueError, match="target profile .*p.json': cannot open: No such file"):
        moec_torch.compile_layer(config(), RANKS, target=str(profile))


@pytest.mark.parametrize("where", ["/dev/null", "file", "under-a-file"])
def test_cache_dir_that_is_not_a_folder(where, tmp_path, monkeypatch):
    monkeypatch.setattr(moec_torch.cache, "_compiled", {})
    (tmp_path / "file").write_text("x")
    value = {"/dev/null": "/dev/null", "file": str(tmp_path / "file"),
             "under-a-file": str(tmp_path / "file/cache")}[where]
    monkeypatch.setenv("MOEC_CACHE_DIR", value)
    message = {"/dev/null": "is a character device, not a folder",
               "file": "is a regular file, not a folder",
               "under-a-file": "cannot be used as the compile cache: Not a directory"}[where]
    with pytest.raises(ValueError, match=f"MOEC_CACHE_DIR='{re.escape(value)}' {message}"):
        moec_torch.MoeFFN(config(), RANKS)


# --- lora_targets -----------------------------------------------------------------

def test_lora_targets_takes_one_name():
    layer = moec_torch.MoeFFN(config(), RANKS, lora_rank=4, lora_targets="w1")
    assert layer.lora_targets == ("w1",) and [p.shape[0] for p in layer.adapters()] == [4, 4]
    assert moec_torch.MoeFFN(config(), RANKS, lora_rank=4, lora_targets=["w2"]).lora_targets \
        == ("w2",)
    with pytest.raises(ValueError, match=r"lora_targets must name some of \('w1', 'w2'\), got "
                                         r"\('gate',\)"):
        moec_torch.MoeFFN(config(), RANKS, lora_rank=4, lora_targets="gate")
    with pytest.raises(TypeError, match="lora_targets must be a name or a tuple of names, .*"
                                        "got 5 \\(int\\)"):
        moec_torch.MoeFFN(config(), RANKS, lora_rank=4, lora_targets=5)
    forward, _ = moec_torch.compile_layer(config(lora_rank=4), RANKS, lora_targets="w2")
    assert moec_torch.dump(forward)["ops"]


# --- tensors that are not dense -------------------------------------------------------

LAYOUTS = {"sparse": (lambda t: t.to_sparse(), r"a sparse \(torch.sparse_coo\) tensor"),
           "mkldnn": (lambda t: t.float().to_mkldnn(), r"a mkldnn \(torch._mkldnn\) tensor"),
           "meta": (lambda t: t.to("meta"), None)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("which", ["x", "topk_ids", "topk_weights"])
def test_tensors_that_are_not_dense_are_refused(layer, layout, which):
    make, kind = LAYOUTS[layout]
    if layout == "mkldnn" and which == "topk_ids":
        pytest.skip("mkldnn holds no integers")
    args = dict(zip(("x", "topk_ids", "topk_weights"), inputs(layer, seed=1)[:3]))
    args[which] = make(args[which])
    # A meta tensor: the op library's words, said before any work (check_finite
    # would otherwise fail on it with torch's "item() ... meta tensors").
    error, message = (RuntimeError, f"moec: '{which}' is on meta; the moec runtime runs on "
                                     "the CPU$") if kind is None else \
        (ValueError, f"moec: {which} is {kind}; expected a dense one$")
    checked = moec_torch.MoeFFN(config(), RANKS, threads=2, check_finite=True)
    for call in (layer, layer.submit_forward, checked,
                 moec_torch.Exchange(config(), RANKS, threads=2).dispatch):
        with pytest.raises(error, match=message):
            call(**args)


def test_weights_and_gradients_that_are_not_dense_are_refused(layer):
    x, ids, weights, dy = inputs(layer, seed=1)
    with pytest.raises(TypeError, match="moec: x must be a torch.Tensor, got list"):
        layer(x.tolist(), ids, weights)
    handle = layer.submit_forward(x, ids, weights)
    handle.wait()
    with pytest.raises(ValueError, match=r"moec: dy is a sparse \(torch.sparse_coo\) tensor"):
        layer.submit_backward(handle, dy.to_sparse())
    ex = moec_torch.Exchange(config(), RANKS, threads=2)
    expert_x, _, h = ex.dispatch(x, ids, weights)
    with pytest.raises(ValueError, match=r"moec: expert_y is a sparse \(torch.sparse_coo\)"):
        ex.combine(expert_x.to_sparse(), h)
    other = moec_torch.MoeFFN(config(), RANKS, threads=2)
    other.w1 = torch.nn.Parameter(other.w1.detach().to_sparse())
    with pytest.raises(ValueError, match=r"moec: w1 is a sparse \(torch.sparse_coo\) tensor"):
        other(x, ids, weights)


# --- environment variables ----------------------------------------------------------

def test_graphs_folder_variable_that_names_nothing(monkeypatch):
    monkeypatch.setattr(moec_torch.cache, "_compiled", {})
    monkeypatch.setenv("MOEC_GRAPHS", "abc")
    with pytest.raises(FileNotFoundError, match="MOEC_GRAPHS='abc' names the folder of the "
                                                "layer graphs .*cannot be found"):
        moec_torch.MoeFFN(config(), RANKS)


@pytest.mark.parametrize("env", ["MOEC_LIB", "MOEC_TORCH_LIB"])
def test_library_variable_too_long_is_named_and_cut(env, monkeypatch):
    from moec_torch import native
    monkeypatch.setenv(env, "x" * 5000)
    find = native.library_path if env == "MOEC_LIB" else native.op_library_path
    with pytest.raises(FileNotFoundError) as error:
        find()
    message = str(error.value)
    assert f"{env}='{'x' * 200}'... (5000 characters) names the" in message
    assert "File name too long" in message and len(message) < 500


def test_empty_variable_means_the_default(monkeypatch):
    from moec_torch import native
    default = native.graphs_dir()
    monkeypatch.setenv("MOEC_GRAPHS", "")
    monkeypatch.delenv("MOEC_GRAPHS")
    unset = native.graphs_dir()
    monkeypatch.setenv("MOEC_GRAPHS", "")
    assert native.graphs_dir() == unset
    monkeypatch.setenv("MOEC_CACHE_DIR", "")
    assert moec_torch._cache_root() == Path.home() / ".cache/moec"
    assert default.is_dir()


def test_shown_values_escape_control_characters():
    assert checks.env_shown("MOEC_X", "a\nb\x1b") == "MOEC_X='a\\x0ab\\x1b'"


def test_prepare_ddp_without_torch_distributed():
    """prepare_ddp needs torch.distributed started (the refusals a job can
    make: ddp_check.py under torchrun)."""
    import torch.distributed as dist
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="prepare_ddp: torch.distributed is not initialized"):
        moec_torch.prepare_ddp(torch.nn.Linear(2, 2))


def test_clip_grad_norm_in_one_process_is_torchs():
    """With every expert in this process, moec_torch.clip_grad_norm_ is
    torch's (across processes: ddp_check.py); other norms are refused."""
    torch.manual_seed(0)
    layer = moec_torch.MoeFFN(config(), ranks=2, threads=1)
    x, ids, w = (torch.randn(2, 8, layer.hidden), torch.stack(
        [torch.randperm(layer.experts)[:layer.top_k] for _ in range(16)]).reshape(2, 8, -1),
        torch.rand(2, 8, layer.top_k))
    layer(x, ids, w).square().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    want = torch.nn.utils.clip_grad_norm_(layer.parameters(), 0.01)
    clipped = [p.grad.clone() for p in layer.parameters()]
    for p, g in zip(layer.parameters(), grads):
        p.grad = g.clone()
    got = moec_torch.clip_grad_norm_(layer, 0.01)
    assert want > 0.01 and abs(got - want) <= 1e-6 * want
    assert all(torch.allclose(p.grad, c, rtol=1e-6, atol=0) for p, c in zip(layer.parameters(),
                                                                           clipped))
    with pytest.raises(ValueError, match="norm_type must be 2.0 or inf, got 1.0"):
        moec_torch.clip_grad_norm_(layer, 1.0, norm_type=1)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        moec_torch.clip_grad_norm_(list(layer.parameters()), 1.0)


def test_split_parameters_in_one_process():
    """Every expert in this process: all of a model's parameters are
    replicated ones (each process its own: ddp_check.py's "zero" case)."""
    model = torch.nn.ModuleDict({"moe": moec_torch.MoeFFN(config(), ranks=2, threads=1),
                                 "proj": torch.nn.Linear(4, 4)})
    replicated, own = moec_torch.split_parameters(model)
    assert own == [] and len(replicated) == len(list(model.parameters()))
    with pytest.raises(TypeError, match="split_parameters: model must be an nn.Module"):
        moec_torch.split_parameters([])
