"""MoeFFN checkpoints: state_dict() / load_state_dict() round-trip bit for bit
for every variant (full, main_grad, frozen, LoRA), refuse a checkpoint of
another layer before copying anything, and resuming training from a
checkpoint gives the parameters of an uninterrupted run; LoRA adapters
saved and loaded in PEFT's layout."""

import json

import pytest
import torch

import moec_torch
from moec_torch import reference
from test_moe_ffn import config, inputs

VARIANTS = {"full": {}, "main_grad": {"main_grad": True}, "frozen": {"frozen": True},
            "lora": {"lora_rank": 4, "lora_alpha": 8}}


def make(variant, seed, dtype="fp32", ranks=2, **cfg):
    torch.manual_seed(seed)
    return moec_torch.MoeFFN(config(dtype=dtype, **cfg), ranks=ranks, threads=1,
                             **VARIANTS[variant])


def trainable(layer):
    return layer.adapters() if layer.lora_rank else [layer.w1, layer.w2]


def step(layer, opt, seed):
    """One training step: forward, backward, the optimizer (main_grad: the
    optimizer reads the fp32 sums, as Megatron's does)."""
    x, ids, weights, dy = inputs(layer, seed)
    x = x.clone().requires_grad_()
    layer(x, ids, weights).backward(dy)
    if layer.main_grad:
        for w in (layer.w1, layer.w2):
            w.grad = w.main_grad.to(w.dtype)
    if opt is not None:
        opt.step()
        opt.zero_grad()
    if layer.main_grad:
        layer.zero_main_grad()


def state(layer):
    return {k: v.clone() for k, v in layer.state_dict().items() if torch.is_tensor(v)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_state_dict_round_trips_bitwise(variant, dtype, tmp_path):
    a = make(variant, 0, dtype)
    if variant == "lora":
        with torch.no_grad():
            for p in a.adapters():
                p.uniform_(-0.5, 0.5)
    opt = None if variant == "frozen" else torch.optim.SGD(trainable(a), lr=0.1)
    step(a, opt, 1)
    if variant == "main_grad":
        # A checkpoint between micro-batches keeps the running sums.
        x, ids, weights, dy = inputs(a, 2)
        a(x, ids, weights).backward(dy)
        assert a.w1.main_grad.abs().sum() > 0
    # As the docs say to: written whole, read as tensors only (PyTorch 1.13's
    # weights-only reader refuses anything else, floats included).
    moec_torch.save_state(a.state_dict(), tmp_path / "layer.pt")

    b = make(variant, 7, dtype)  # other initial weights
    assert not torch.equal(a.w1, b.w1)
    b.load_state_dict(torch.load(tmp_path / "layer.pt", weights_only=True))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    if variant == "main_grad":
        assert torch.equal(a.w1.main_grad, b.w1.main_grad)
        assert torch.equal(a.w2.main_grad, b.w2.main_grad)
    x, ids, weights, _ = inputs(a, 3)
    with torch.no_grad():
        assert torch.equal(a(x, ids, weights), b(x, ids, weights))


@pytest.mark.parametrize("variant", ["full", "main_grad", "lora"])
def test_resume_gives_the_uninterrupted_parameters(variant, tmp_path):
    steps = 3
    whole = make(variant, 0)
    opt = torch.optim.AdamW(trainable(whole), lr=1e-2)
    for i in range(2 * steps):
        step(whole, opt, 10 + i)

    first = make(variant, 0)
    opt = torch.optim.AdamW(trainable(first), lr=1e-2)
    for i in range(steps):
        step(first, opt, 10 + i)
    torch.save({"layer": first.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ck.pt")
    del first, opt

    resumed = make(variant, 5)
    opt = torch.optim.AdamW(trainable(resumed), lr=1e-2)
    ck = torch.load(tmp_path / "ck.pt")
    resumed.load_state_dict(ck["layer"])
    opt.load_state_dict(ck["optimizer"])
    for i in range(steps, 2 * steps):
        step(resumed, opt, 10 + i)
    for (name, pw), (_, pr) in zip(whole.named_parameters(), resumed.named_parameters()):
        assert torch.equal(pw, pr), name
    fresh = make(variant, 0)
    assert any(not torch.equal(p, q) for p, q in zip(trainable(whole), trainable(fresh))), \
        "training changed nothing"


def test_a_checkpoint_of_another_layer_is_refused_before_anything_is_copied():
    a = make("full", 0)
    b = make("full", 1, experts=8)
    before = b.w1.clone()
    with pytest.raises(ValueError, match="its experts is 4, this layer's 8"):
        b.load_state_dict(a.state_dict())
    assert torch.equal(b.w1, before)
    with pytest.raises(ValueError, match="main-grad buffers"):
        make("full", 0).load_state_dict(make("main_grad", 0).state_dict())
    with pytest.raises(ValueError, match="its dtype"):
        make("full", 0, "bf16").load_state_dict(a.state_dict())
    # A shard of other experts (as one MPI rank's checkpoint would be).
    sd = a.state_dict()
    sd["_extra_state"]["layout"] = dict(sd["_extra_state"]["layout"], first_expert=2,
                                        local_experts=2)
    sd["w1"], sd["w2"] = sd["w1"][2:], sd["w2"][2:]
    b2 = make("full", 1)
    with pytest.raises(ValueError, match="holds experts 2..3 of 4; this layer"):
        b2.load_state_dict(sd)
    # The LoRA scaling: recorded as its repr; a float (as earlier checkpoints
    # recorded it) is read as the same value; another scaling is refused.
    lora = make("lora", 0)
    sd = lora.state_dict()
    assert sd["_extra_state"]["layout"]["lora_scaling"] == repr(lora.lora_scaling)
    sd["_extra_state"]["layout"] = dict(sd["_extra_state"]["layout"],
                                        lora_scaling=lora.lora_scaling)
    make("lora", 1).load_state_dict(sd)
    sd["_extra_state"]["layout"] = dict(sd["_extra_state"]["layout"], lora_scaling=0.5)
    with pytest.raises(ValueError, match="its lora_scaling is '0.5', this layer's '2.0'"):
        make("lora", 1).load_state_dict(sd)


def test_strict_false_loads_what_is_given_from_the_layer_or_a_model_above_it():
    """load_state_dict(strict=False) loads a partial dict (the base weights
    alone into a LoRA layer, without the layout), from the layer or from a
    model that holds it: PyTorch hands the layer's pre-hook strict=True
    whatever the call said, so the hook reads the call's own. strict=True
    (the default) still refuses the same dict before copying anything."""
    source = make("lora", 0)
    with torch.no_grad():
        for p in source.adapters():
            p.uniform_(-0.5, 0.5)
    base = {"w1": source.w1.detach().clone(), "w2": source.w2.detach().clone()}
    layer = make("lora", 1)
    adapters = [p.detach().clone() for p in layer.adapters()]
    result = layer.load_state_dict(base, strict=False)
    assert torch.equal(layer.w1, base["w1"]) and torch.equal(layer.w2, base["w2"])
    assert all(torch.equal(p, q) for p, q in zip(layer.adapters(), adapters))
    assert set(result.missing_keys) == {"w1_lora_A", "w1_lora_B", "w2_lora_A", "w2_lora_B",
                                        "_extra_state"}
    assert result.unexpected_keys == []

    model = torch.nn.ModuleDict({"experts": make("lora", 2)})
    before = model["experts"].w1.detach().clone()
    nested = {"experts." + k: v for k, v in base.items()}
    with pytest.raises(ValueError, match=r"missing \['experts.w1_lora_A'"):
        model.load_state_dict(nested)
    assert torch.equal(model["experts"].w1, before)
    result = model.load_state_dict(dict(nested, **{"experts.stray": torch.zeros(1)}),
                                   strict=False)
    assert torch.equal(model["experts"].w1, base["w1"])
    assert "experts._extra_state" in result.missing_keys
    assert result.unexpected_keys == ["experts.stray"]
    # Shapes and dtypes are checked either way, before anything is copied.
    with pytest.raises(ValueError, match="'experts.w2' has shape"):
        model.load_state_dict({"experts.w1": base["w1"] * 2,
                               "experts.w2": base["w2"][:1]}, strict=False)
    assert torch.equal(model["experts"].w1, base["w1"])


def test_merge_state_dicts_of_processes():
    """merge_state_dicts of the shards a job's processes save (made here
    from a one-process layer's state dict, as two processes of its EP
    group would hold it, main-grad buffers included, in either order): the
    whole layer's state dict, which loads; and its refusals. Under torchrun
    and mpirun: ddp_check.py."""
    a = make("main_grad", 0)
    step(a, None, 1)
    whole = a.state_dict()
    half = a.experts // 2

    def shard(r, **change):
        extra = whole["_extra_state"]
        out = {k: v[r * half:(r + 1) * half].clone() for k, v in whole.items()
               if k != "_extra_state"}
        out["_extra_state"] = dict(
            extra, layout=dict(extra["layout"], first_expert=r * half, local_experts=half,
                               **change),
            main_grad={w: g[r * half:(r + 1) * half] for w, g in extra["main_grad"].items()})
        return out

    merged = moec_torch.merge_state_dicts([shard(1), shard(0)])
    assert list(merged) == list(whole)
    assert all(torch.equal(merged[k], whole[k]) for k in ("w1", "w2"))
    assert merged["_extra_state"]["layout"] == whole["_extra_state"]["layout"]
    assert all(torch.equal(merged["_extra_state"]["main_grad"][w], a.__getattr__(w).main_grad)
               for w in ("w1", "w2"))
    b = make("main_grad", 1)
    b.load_state_dict(merged)
    assert torch.equal(b.w1, a.w1) and torch.equal(b.w2.main_grad, a.w2.main_grad)
    # The same experts twice (EP groups inside data parallelism) merge once.
    assert torch.equal(moec_torch.merge_state_dicts([shard(0), shard(1), shard(0)])["w2"],
                       whole["w2"])

    def refused(shards, message):
        with pytest.raises(ValueError, match=message):
            moec_torch.merge_state_dicts(shards)

    refused([shard(1)], r"no shard holds expert 0 of 'w1'")
    other = shard(0)
    other["w1"] = other["w1"] + 1
    refused([shard(0), shard(1), other], r"'w1' differs between shards that hold the same "
            r"experts \(0..1\)")
    refused([shard(0), shard(1, hidden=32)], "shard 1's hidden is 32, shard 0's 64")
    # A model's: the layer under "moe.", and a tensor of the model's own.
    def nest(r, value):
        return {**{"moe." + k: v for k, v in shard(r).items()}, "step": value}

    merged = moec_torch.merge_state_dicts([nest(0, torch.ones(1)), nest(1, torch.ones(1))])
    assert torch.equal(merged["moe.w1"], whole["w1"]) and torch.equal(merged["step"],
                                                                       torch.ones(1))
    refused([nest(0, torch.zeros(1)), nest(1, torch.ones(1))],
            "'step' differs between shard 0 and shard 1: a tensor outside the layers is a "
            "replica")
    refused([shard(0), dict(shard(1), step=1)], r"shard 1's keys are not shard 0's: \['step'\]")
    refused([], "give the state dicts")
    refused([shard(0), dict(shard(1), _extra_state=None)],
            "'_extra_state' is not a moec MoeFFN checkpoint's in every shard")
    refused([shard(0), dict(shard(1), w2=whole["w2"])],
            r"shard 1's 'w2' has shape \[4, 32, 64\]; its layout holds 2 experts")
    wider = shard(1)
    wider["_extra_state"] = dict(wider["_extra_state"], layout=dict(
        wider["_extra_state"]["layout"], first_expert=1))
    refused([shard(0), wider], "shard 1's 'w1' holds part of what another shard holds")
    damaged = shard(1)
    damaged["_extra_state"] = dict(damaged["_extra_state"], layout=dict(
        damaged["_extra_state"]["layout"], local_experts="2"))
    refused([shard(0), damaged], r"shard 1's layout has no integer \['local_experts'\]")


def test_merge_state_dicts_of_tp_ranks():
    """The shards of an [ep 2, tp 2] job (each process its experts' TP
    slice of the intermediate columns: w1's gate and up columns, w2's rows,
    and their main-grad buffers alike), cut here from a one-process layer
    with the layer's own slicing, merge into that layer's state dict."""
    torch.manual_seed(0)
    a = moec_torch.MoeFFN(config(), ep=2, tp=2, threads=1, main_grad=True)
    step(a, None, 1)
    whole = a.state_dict()
    extra, half, i = whole["_extra_state"], a.experts // 2, a.inter // 2

    def cut(name, t, tp):  # what TP rank tp holds of experts' whole w1 or w2
        if name == "w1":
            return torch.cat((t[..., tp * i:(tp + 1) * i],
                              t[..., a.inter + tp * i:a.inter + (tp + 1) * i]), -1)
        return t[:, tp * i:(tp + 1) * i]

    shards = []
    for ep in range(2):
        for tp in range(2):
            rows = slice(ep * half, (ep + 1) * half)
            shards.append({
                "w1": cut("w1", whole["w1"][rows], tp), "w2": cut("w2", whole["w2"][rows], tp),
                "_extra_state": dict(extra, layout=dict(
                    extra["layout"], first_expert=ep * half, local_experts=half,
                    columns=[tp * i, (tp + 1) * i]),
                    main_grad={w: cut(w, g[rows], tp) for w, g in extra["main_grad"].items()})})
    merged = moec_torch.merge_state_dicts(shards[::-1])
    assert torch.equal(merged["w1"], whole["w1"]) and torch.equal(merged["w2"], whole["w2"])
    for w in ("w1", "w2"):
        assert torch.equal(merged["_extra_state"]["main_grad"][w], extra["main_grad"][w]), w
    assert merged["_extra_state"]["layout"] == extra["layout"]


def test_peft_layout_of_the_adapters(tmp_path):
    a = make("lora", 0)
    with torch.no_grad():
        for p in a.adapters():
            p.uniform_(-0.5, 0.5)
    files = a.save_adapters(tmp_path, module_prefix="model.layers.3.mlp.experts")
    assert sorted(f.name for f in files) == ["adapter_config.json", "adapter_model.safetensors"]
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    assert cfg["target_modules"] == ["gate_up_proj", "down_proj"]
    tensors = moec_torch.safetensors.load_file(tmp_path / "adapter_model.safetensors")
    H, I, r = a.hidden, a.inter, 4
    assert len(tensors) == 4 * a.experts
    A = tensors["base_model.model.model.layers.3.mlp.experts.1.gate_up_proj.lora_A.weight"]
    B = tensors["base_model.model.model.layers.3.mlp.experts.1.gate_up_proj.lora_B.weight"]
    assert list(A.shape) == [r, H] and list(B.shape) == [2 * I, r]
    # PEFT's nn.Linear form: lora_B(lora_A(x)) * alpha / r.
    x = torch.randn(5, H)
    peft = torch.nn.functional.linear(torch.nn.functional.linear(x, A), B) * (8 / 4)
    ours = x @ a.w1_lora_A[1].detach() @ a.w1_lora_B[1].detach() * a.lora_scaling
    assert torch.allclose(peft, ours, atol=1e-5)
    D = tensors["base_model.model.model.layers.3.mlp.experts.3.down_proj.lora_B.weight"]
    assert list(D.shape) == [H, r]

    b = make("lora", 0)  # the same base weights; other adapters
    with torch.no_grad():
        for p in b.adapters():
            p.uniform_(-1, 1)
    b.load_adapters(tmp_path, module_prefix="model.layers.3.mlp.experts")
    for pa, pb in zip(a.adapters(), b.adapters()):
        assert torch.equal(pa, pb)
    xs, ids, weights, _ = inputs(a, 4)
    with torch.no_grad():
        assert torch.equal(a(xs, ids, weights), b(xs, ids, weights))
        # And the layer with them loaded is PEFT's formula on the base weights.
        adapters = [p.double() for p in b.adapters()]
        want = reference.moe_ffn(xs.double(), ids, weights.double(), b.w1.double(),
                                 b.w2.double(), {"w1": tuple(adapters[:2]),
                                                 "w2": tuple(adapters[2:])}, b.lora_scaling)
        got = b(xs, ids, weights)
        assert (got.double() - want).abs().max() <= 1e-4 * want.abs().max()


def test_peft_load_refuses_other_adapters(tmp_path):
    a = make("lora", 0)
    a.save_adapters(tmp_path)
    other = moec_torch.MoeFFN(config(), ranks=2, threads=1, lora_rank=8)
    with pytest.raises(ValueError, match="'r': 4"):
        other.load_adapters(tmp_path)
    only_w1 = moec_torch.MoeFFN(config(), ranks=2, threads=1, lora_rank=4, lora_alpha=8,
                                lora_targets=("w1",))
    with pytest.raises(ValueError, match="target_modules"):
        only_w1.load_adapters(tmp_path)
    with pytest.raises(ValueError, match="saved with module_prefix 'experts'; loading with "
                                         "'mlp.experts'"):
        make("lora", 1).load_adapters(tmp_path, module_prefix="mlp.experts")
    # Without save_adapters' record of the prefix (as PEFT writes the config).
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    del cfg["moec"]
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="has no 'base_model.model.mlp.experts.0"):
        make("lora", 1).load_adapters(tmp_path, module_prefix="mlp.experts")
    with pytest.raises(RuntimeError, match="no LoRA adapters"):
        make("full", 0).save_adapters(tmp_path / "x")
