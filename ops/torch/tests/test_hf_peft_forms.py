"""moec_torch.hf's adapters in PEFT's two forms, against PEFT's LoRA in plain
PyTorch (moec_torch.hf_lora): target_parameters on v5's fused experts
(PEFT's ParamWrapper), patch_model(lora_config=) from an adapter folder with
rank_pattern, alpha_pattern and use_rslora, and the adapter configs moec
refuses."""

import copy
import json

import pytest
import torch

import moec_torch.hf as mhf
from moec_torch import hf_lora, safetensors
from test_hf import close, grad_or_zero, make_model, tokens

BOTH = ["gate_up_proj", "down_proj"]


def adapters_of(model):
    return [p for _, _, ex in mhf._patched(model) for p in ex.layer.adapters()]


def train_adapters(model, steps=3):
    """A few AdamW steps of the adapters alone, so that they are away from
    their start (B zero)."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = adapters_of(model)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=0.05)
    ids = tokens(seed=5)
    for _ in range(steps):
        model(ids).logits.square().mean().backward()
        opt.step()
        opt.zero_grad()


def moec_grads(model):
    """{PEFT name: gradient} of the patched model's adapters, in the file's
    layout (stacked over experts in the parameters form)."""
    blocks = mhf._patched(model)
    per_expert = {key: p.grad[j][rows, cols].t()
                  for name, _, experts in blocks
                  for key, p, j, (rows, cols) in mhf._adapter_tensors(name, experts)}
    return mhf._stacked(per_expert, blocks)


def same_as_peft(model, ref, ids, only=lambda key: True):
    """The patched model's logits are PEFT's model's (`ref`), and after a
    backward of the same gradient so are its adapters' gradients (those
    whose names `only` keeps); returns the patched model's output."""
    out, want = model(ids), ref(ids)
    close(out.logits, want.logits, 1e-5, "logits with adapters")
    g = torch.randn_like(out.logits)
    out.logits.backward(g)
    want.logits.backward(g)
    ours = moec_grads(model)
    for key, p in hf_lora.lora_state_dict(ref).items():
        if only(key):
            close(ours[key], grad_or_zero(p), 1e-5, key)
    return out


def write_folder(folder, config, tensors):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    safetensors.save_file({k: v.detach().contiguous() for k, v in tensors.items()},
                          folder / "adapter_model.safetensors")


@pytest.mark.parametrize("family,targets", [("qwen3_moe", BOTH), ("mixtral", BOTH),
                                            ("deepseek_v3", ["gate_up_proj"]),
                                            ("olmoe", ["down_proj"])])
def test_target_parameters_match_peft_param_wrapper(tmp_path, family, targets):
    """LoRA on the fused parameters: the saved file is PEFT's (names, nesting,
    shapes, config); PEFT's ParamWrapper on the unpatched model, loaded from
    it by name, gives the patched model's logits, and after one more
    backward the same adapter gradients."""
    ref = make_model(family, "fused")
    model = copy.deepcopy(ref)
    mhf.patch_model(model, ranks=2, threads=1, lora_rank=4, lora_alpha=8,
                    lora_target_parameters=targets)
    train_adapters(model)
    files = mhf.save_adapters(model, tmp_path / "adapter")
    assert [f.name for f in files] == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    blocks = [n for n, _, _ in mhf.find_blocks(ref)]
    assert config["target_modules"] == []
    assert config["target_parameters"] == sorted(f"{b}.experts.{t}" for b in blocks
                                                 for t in targets)
    names = safetensors.load_file(tmp_path / "adapter/adapter_model.safetensors")
    b = f"base_model.model.{blocks[-1]}.experts"
    if len(targets) == 2:  # down_proj's wrapper around gate_up_proj's
        assert names[f"{b}.base_layer.lora_A.weight"].shape == (8 * 4, 32)   # [E r, H]
        assert names[f"{b}.base_layer.lora_B.weight"].shape == (2 * 16, 4 * 8)  # [2I, r E]
        assert names[f"{b}.lora_A.weight"].shape == (8 * 4, 16)             # [E r, I]
        assert names[f"{b}.lora_B.weight"].shape == (32, 4 * 8)             # [H, r E]
    else:
        assert {k for k in names if k.startswith(b)} == {f"{b}.lora_A.weight",
                                                         f"{b}.lora_B.weight"}
    assert len(names) == 2 * len(targets) * len(blocks)
    assert hf_lora.load_lora(ref, tmp_path / "adapter") == sorted(names)
    ids = tokens(seed=9)
    out = same_as_peft(model, ref, ids)
    # and back: a fresh patched model loads the file, bit for bit
    fresh = make_model(family, "fused")
    mhf.patch_model(fresh, ranks=2, threads=1, lora_config=tmp_path / "adapter")
    assert mhf.load_adapters(fresh, tmp_path / "adapter") == []
    assert torch.equal(fresh(ids).logits, out.logits)


def peft_made(tmp_path, family, layout, config, seed=3):
    """An adapter folder made by PEFT's LoRA (the stand-in) on the unpatched
    model, its B drawn away from zero; returns the folder and the model."""
    ref = make_model(family, layout)
    args = (config["r"], config["lora_alpha"], config.get("rank_pattern"),
            config.get("alpha_pattern"), bool(config.get("use_rslora")))
    if config.get("target_parameters"):
        hf_lora.add_param_lora(ref, config["target_parameters"], *args)
    else:
        hf_lora.add_lora(ref, config["target_modules"], *args)
    torch.manual_seed(seed)
    state = hf_lora.lora_state_dict(ref)
    with torch.no_grad():
        for key, p in state.items():
            if key.endswith("lora_B.weight"):
                p.normal_(0, 0.05)
    write_folder(tmp_path / "peft", config, state)
    return tmp_path / "peft", ref


@pytest.mark.parametrize("family,layout,config", [
    # what PEFT makes of per-expert adapters on a v5 model: gate_up_proj's
    # rank and alpha doubled (transformers' weight conversion)
    ("qwen3_moe", "fused", {"r": 4, "lora_alpha": 8, "target_modules": [],
                            "target_parameters": ["mlp.experts.gate_up_proj",
                                                  "mlp.experts.down_proj"],
                            "rank_pattern": {r".*\.gate_up_proj": 8},
                            "alpha_pattern": {r".*\.gate_up_proj": 16}}),
    ("mixtral", "fused", {"r": 2, "lora_alpha": 3, "use_rslora": True,
                          "target_parameters": ["gate_up_proj"]}),
    # per-expert modules, a regex, rsLoRA and a rank by module
    ("qwen3_moe", "modules", {"r": 4, "lora_alpha": 6, "use_rslora": True,
                              "target_modules": r".*\.experts\.\d+\.(gate_proj|down_proj)",
                              "rank_pattern": {"down_proj": 4, "q_proj": 16}}),
    ("mixtral", "modules", {"r": 2, "lora_alpha": 4, "target_modules": ["w1", "w3", "w2"],
                            "rank_pattern": {"w1": 3, "w3": 5}, "alpha_pattern": {"w1": 6,
                                                                                   "w3": 10}}),
])
def test_lora_config_patches_for_an_adapter_folder(tmp_path, family, layout, config):
    """An adapter folder PEFT wrote, with its patterns and scalings: the model
    patched with lora_config=folder loads it and gives PEFT's logits and
    adapter gradients; save_adapters writes the same tensors and patterns
    back."""
    folder, ref = peft_made(tmp_path, family, layout, config)
    model = make_model(family, layout)
    mhf.patch_model(model, ranks=2, threads=1, lora_config=folder)
    assert mhf.load_adapters(model, folder) == []
    same_as_peft(model, ref, tokens(seed=4))
    mhf.save_adapters(model, tmp_path / "again")
    back = json.loads((tmp_path / "again/adapter_config.json").read_text())
    for key in ("r", "lora_alpha", "rank_pattern", "alpha_pattern"):
        assert back[key] == config.get(key, {}), key
    assert back["use_rslora"] == bool(config.get("use_rslora"))
    written = safetensors.load_file(tmp_path / "again/adapter_model.safetensors")
    given = safetensors.load_file(folder / "adapter_model.safetensors")
    assert sorted(written) == sorted(given)
    assert all(torch.equal(written[k], given[k]) for k in given)


def test_forms_and_configs_refused(tmp_path):
    """Each refusal names what is wrong, before anything is changed."""
    folder, _ = peft_made(tmp_path, "qwen3_moe", "fused",
                          {"r": 4, "lora_alpha": 8, "target_parameters": BOTH})
    # a target_parameters folder into a model patched for per-expert modules
    model = make_model("qwen3_moe", "fused")
    mhf.patch_model(model, ranks=1, threads=1, lora_rank=4, lora_alpha=8)
    before = [p.detach().clone() for p in adapters_of(model)]
    with pytest.raises(ValueError, match="PEFT's target_parameters, on v5's fused expert "
                                         "parameters; the model's are target_modules"):
        mhf.load_adapters(model, folder)
    assert all(torch.equal(a, b) for a, b in zip(before, adapters_of(model)))
    # another rank, by a rank pattern
    other = make_model("qwen3_moe", "fused")
    mhf.patch_model(other, ranks=1, threads=1, lora_rank=4, lora_alpha=8,
                    lora_target_parameters=["gate_up_proj"])
    with pytest.raises(ValueError, match=r"ranks \{'gate_up_proj': 4, 'down_proj': 4\}.*"
                                         r"the model's are \{'gate_up_proj': 4\}"):
        mhf.load_adapters(other, folder)
    # PEFT before 0.19 laid target_parameters adapters out the other way round
    old = json.loads((folder / "adapter_config.json").read_text())
    for version, refused in (("0.18.1", True), ("0.17.0", True), ("0.19.0", False),
                             ("0.21.0.dev0@abc", False)):
        write_folder(tmp_path / version, {**old, "peft_version": version},
                     safetensors.load_file(folder / "adapter_model.safetensors"))
        fresh = make_model("qwen3_moe", "fused")
        if refused:
            with pytest.raises(ValueError, match=f"written by PEFT {version}: before PEFT 0.19"):
                mhf.patch_model(fresh, ranks=1, threads=1, lora_config=tmp_path / version)
        else:
            mhf.patch_model(fresh, ranks=1, threads=1, lora_config=tmp_path / version)
            assert mhf.load_adapters(fresh, tmp_path / version) == []
    # v5's parameters on a model with per-expert modules
    with pytest.raises(ValueError, match="target_parameters name v5's fused expert parameters; "
                                         "the experts of 'model.layers.0.mlp' are per-expert"):
        mhf.patch_model(make_model("qwen3_moe"), lora_rank=2, lora_target_parameters=BOTH)
    with pytest.raises(ValueError, match="lora_target_parameters \\['gate_proj'\\]"):
        mhf.patch_model(make_model("qwen3_moe", "fused"), lora_rank=2,
                        lora_target_parameters=["gate_proj"])
    with pytest.raises(ValueError, match="not both"):
        mhf.patch_model(make_model("qwen3_moe", "fused"), lora_rank=2, lora_targets=["up_proj"],
                        lora_target_parameters=BOTH)
    with pytest.raises(ValueError, match="without lora_rank="):
        mhf.patch_model(make_model("qwen3_moe", "fused"), lora_rank=2, lora_config=folder)
    with pytest.raises(ValueError, match="lora_target_parameters= needs lora_rank="):
        mhf.patch_model(make_model("qwen3_moe", "fused"), lora_target_parameters=BOTH)
    base = {"peft_type": "LORA", "r": 4, "lora_alpha": 8,
            "target_modules": ["gate_proj", "up_proj", "down_proj"]}
    for extra, message in [
            ({"use_dora": True}, "'use_dora' is True \\(DoRA's magnitude vectors\\)"),
            ({"bias": "all"}, "'bias' is 'all'"),
            ({"lora_bias": True}, "'lora_bias' is True"),
            ({"fan_in_fan_out": True}, "'fan_in_fan_out' is True"),
            ({"layers_to_transform": [1]}, "'layers_to_transform' is \\[1\\]"),
            ({"peft_type": "IA3"}, "peft_type is 'IA3'; moec reads LoRA"),
            ({"use_rslora": "yes"}, "'use_rslora' must be true or false"),
            ({"rank_pattern": {"gate_proj": 0}}, "'rank_pattern' must be an object of positive"),
            ({"target_parameters": "gate_up_proj"}, "'target_parameters' must be a list"),
            ({"target_modules": r".*\.experts\.[0-3]\.gate_proj"},
             "adapt some experts of 'model.layers.0.mlp' only \\('model.layers.0.mlp.experts.0."
             "gate_proj' but not 'model.layers.0.mlp.experts.4.gate_proj'\\)"),
            ({"target_modules": "(gate"}, "'target_modules' '\\(gate' is not a regex"),
            ({"target_modules": ["q_proj"]}, "target none of the experts' modules of "
                                             "'model.layers.0.mlp'"),
            ({"target_modules": None}, "no target_modules"),
            ({"rank_pattern": {"(up": 2}}, "'rank_pattern' key '\\(up' is not a regex"),
            ({"rank_pattern": {r"experts\.3\.up_proj": 2}},
             "different ranks or alphas for up_proj"),
            ({"alpha_pattern": {"down_proj": 4}},
             "scale gate_proj by 2 and down_proj by 1; moec's layer scales all of a block's "
             "adapters alike")]:
        with pytest.raises(ValueError, match=message):
            mhf.patch_model(make_model("qwen3_moe"), ranks=1, lora_config={**base, **extra})
    # the same refusals where the folder is loaded into a patched model
    model = make_model("qwen3_moe")
    mhf.patch_model(model, ranks=1, threads=1, lora_rank=4, lora_alpha=8)
    write_folder(tmp_path / "dora", {**base, "use_dora": True}, {})
    with pytest.raises(ValueError, match="adapter config .*dora/adapter_config.json'.*use_dora"):
        mhf.load_adapters(model, tmp_path / "dora")
    write_folder(tmp_path / "rs", {**base, "use_rslora": True}, {})
    with pytest.raises(ValueError, match="scaling 4\\); the model's are .* \\(scaling 2\\)"):
        mhf.load_adapters(model, tmp_path / "rs")


def test_damaged_target_parameters_files(tmp_path):
    """A stacked tensor of the wrong shape, a missing one and a stray tensor
    under the experts are refused, naming the tensor; nothing is copied."""
    folder, _ = peft_made(tmp_path, "qwen3_moe", "fused",
                          {"r": 4, "lora_alpha": 8, "target_parameters": BOTH})
    given = safetensors.load_file(folder / "adapter_model.safetensors")
    config = json.loads((folder / "adapter_config.json").read_text())
    key = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"
    model = make_model("qwen3_moe", "fused")
    mhf.patch_model(model, ranks=2, threads=1, lora_config=folder)
    before = [p.detach().clone() for p in adapters_of(model)]
    for name, tensors, message in [
            ("short", {**given, key: given[key][:, :-1]}, f"'{key}' has shape \\[32, 31\\]; "
                                                          "expected \\[32, 32\\]"),
            ("missing", {k: v for k, v in given.items() if k != key}, f"have no '{key}'"),
            ("stray", {**given, key.replace("lora_B", "lora_magnitude_vector"): given[key].clone()},
             "lora_magnitude_vector.weight' is not an adapter of the model's experts of "
             "'model.layers.1.mlp'"),
            ("integer", {**given, key: given[key].to(torch.int32)}, "is torch.int32")]:
        write_folder(tmp_path / name, config, tensors)
        with pytest.raises(ValueError, match=message):
            mhf.load_adapters(model, tmp_path / name)
        assert all(torch.equal(a, b) for a, b in zip(before, adapters_of(model)))


def test_moe_ffn_adapters_refuse_peft_features(tmp_path):
    """A MoeFFN layer's own adapters (its save_adapters' names) take none of
    the LoRA features whose math it does not do: rsLoRA, patterns, DoRA."""
    model = make_model("qwen3_moe")
    mhf.patch_model(model, ranks=1, threads=1, lora_rank=4, lora_alpha=8)
    layer = mhf._patched(model)[0][2].layer
    layer.save_adapters(tmp_path / "layer")
    config = json.loads((tmp_path / "layer/adapter_config.json").read_text())
    for extra, message in [({"use_rslora": True}, "'use_rslora' is True \\(rsLoRA's scaling"),
                           ({"rank_pattern": {"w1": 8}}, "'rank_pattern' .*ranks by module"),
                           ({"use_dora": True}, "'use_dora' is True"),
                           ({"peft_type": "IA3"}, "peft_type is 'IA3'; moec reads LoRA")]:
        (tmp_path / "layer/adapter_config.json").write_text(json.dumps({**config, **extra}))
        with pytest.raises(ValueError, match=message):
            layer.load_adapters(tmp_path / "layer")


def converted_as_peft_does(tensors, block, experts, r, gate="gate_proj", up="up_proj",
                           down="down_proj"):
    """PEFT's conversion (transformers v5's weight conversion of a LoRA
    adapter, as its source does it) of one block's per-expert adapters to
    the target_parameters form: gate's and up's A stacked over the rank
    then flattened over experts; their B block-diagonal, permuted rank
    first, flattened, transposed; down's A flattened, its B permuted,
    flattened, transposed."""
    def per_expert(module, m):
        return torch.stack([tensors[f"base_model.model.{block}.experts.{e}.{module}.lora_{m}."
                                    "weight"] for e in range(experts)])
    a = torch.cat((per_expert(gate, "A"), per_expert(up, "A")), dim=1).flatten(0, 1)
    b = torch.stack([torch.block_diag(g, u) for g, u in zip(per_expert(gate, "B"),
                                                             per_expert(up, "B"))])
    b = b.permute(2, 0, 1).flatten(0, 1).T
    da = per_expert(down, "A").flatten(0, 1)
    db = per_expert(down, "B").permute(2, 0, 1).flatten(0, 1).T
    stem = f"base_model.model.{block}.experts"
    return {f"{stem}.base_layer.lora_A.weight": a, f"{stem}.base_layer.lora_B.weight": b,
            f"{stem}.lora_A.weight": da, f"{stem}.lora_B.weight": db}


def test_per_expert_adapters_through_peft_conversion(tmp_path):
    """The round trip a v5 user makes: adapters moec saved per expert,
    converted as PEFT converts them onto a fused model (gate_up_proj at
    twice the rank and alpha), are read back by a model patched with
    lora_config and by PEFT's ParamWrapper, both giving the trained model's
    logits."""
    ref = make_model("qwen3_moe", "fused")
    model = copy.deepcopy(ref)
    mhf.patch_model(model, ranks=2, threads=1, lora_rank=4, lora_alpha=8)
    train_adapters(model)
    mhf.save_adapters(model, tmp_path / "moec")
    tensors = safetensors.load_file(tmp_path / "moec/adapter_model.safetensors")
    blocks = [n for n, _, _ in mhf.find_blocks(ref)]
    converted = {}
    for block in blocks:
        converted.update(converted_as_peft_does(tensors, block, 8, 4))
    write_folder(tmp_path / "peft", {
        "r": 4, "lora_alpha": 8, "target_modules": [],
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        "rank_pattern": {r".*\.gate_up_proj": 8}, "alpha_pattern": {r".*\.gate_up_proj": 16}},
        converted)
    ids = tokens(seed=6)
    want = model(ids).logits.detach()
    back = make_model("qwen3_moe", "fused")
    mhf.patch_model(back, ranks=2, threads=1, lora_config=tmp_path / "peft")
    assert mhf.load_adapters(back, tmp_path / "peft") == []
    close(back(ids).logits, want, 1e-5, "moec on the converted adapters")
    hf_lora.load_lora(ref, tmp_path / "peft")
    close(ref(ids).logits, want, 1e-5, "PEFT's ParamWrapper on the converted adapters")


def test_all_linear_adapters_load_the_experts_and_return_the_rest(tmp_path):
    """PEFT's target_modules "all-linear" (every nn.Linear but the output
    layer): a model patched with that lora_config loads the routed
    experts' adapters and returns the others' names (attention, router,
    shared expert), which are not moec's; with those at zero the logits are
    PEFT's, and so are the experts' adapter gradients."""
    ref = make_model("qwen2_moe")
    hf_lora.add_lora(ref, "all-linear", 4, 8)
    state = hf_lora.lora_state_dict(ref)
    torch.manual_seed(3)
    with torch.no_grad():
        for key, p in state.items():
            if key.endswith("lora_B.weight") and ".experts." in key:
                p.normal_(0, 0.05)
    write_folder(tmp_path / "peft", {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"},
                 state)
    model = make_model("qwen2_moe")
    mhf.patch_model(model, ranks=2, threads=1, lora_config=tmp_path / "peft")
    rest = mhf.load_adapters(model, tmp_path / "peft")
    assert rest == sorted(k for k in state if ".experts." not in k)
    for part in (".self_attn.q_proj.", ".mlp.gate.", ".mlp.shared_expert.gate_proj.",
                 ".mlp.shared_expert_gate."):
        assert any(part in k for k in rest), part
    assert not any("lm_head" in k for k in state)
    same_as_peft(model, ref, tokens(seed=4), only=lambda key: ".experts." in key)
