"""moec_torch.hf against the unpatched stand-in models (moec_torch.hf_models):
every family and both expert layouts, fp32 and bf16, skewed routing and a
token count that is no multiple of anything; adapters against PEFT's LoRA in
plain PyTorch (moec_torch.hf_lora); checkpoints in (bf16, FP8) and out."""

import copy
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import moec_torch
import moec_torch.hf as mhf
from moec_torch import hf_lora, hf_models, quant, safetensors

FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "olmoe",
            "glm4_moe", "qwen3_next"]
LAYOUTS = ["modules", "fused"]
# Every family in each layout transformers has of it: Qwen3.5-MoE (its text
# model) exists in v5, fused, only.
FAMILY_LAYOUTS = [(f, layout) for f in FAMILIES for layout in LAYOUTS] + \
    [("qwen3_5_moe_text", "fused")]


def make_config(family, layout="modules", **extra):
    """A tiny config of the family: H 32, expert I 16, 8 experts, top-2,
    2 layers (DeepSeek's first dense), vocab 64."""
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, experts_layout=layout, initializer_range=0.05)
    sizes = {
        "qwen2_moe": dict(intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                          num_experts_per_tok=2, shared_expert_intermediate_size=24,
                          norm_topk_prob=False),
        "qwen3_moe": dict(intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                          num_experts_per_tok=2, norm_topk_prob=True),
        "mixtral": dict(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2),
        "deepseek_v2": dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
                            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                            n_group=4, topk_group=2, topk_method="group_limited_greedy",
                            routed_scaling_factor=1.5),
        "deepseek_v3": dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
                            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                            n_group=4, topk_group=2, routed_scaling_factor=2.5,
                            norm_topk_prob=True),
        "olmoe": dict(intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=False),
        "qwen3_next": dict(intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                           num_experts_per_tok=2, shared_expert_intermediate_size=24,
                           norm_topk_prob=True, head_dim=8, partial_rotary_factor=0.25),
        "qwen3_5_moe_text": dict(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                                 shared_expert_intermediate_size=24, head_dim=8,
                                 partial_rotary_factor=0.25),
        "glm4_moe": dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
                         num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                         n_group=4, topk_group=2, routed_scaling_factor=1.5,
                         attention_bias=True, use_qk_norm=True, head_dim=8,
                         partial_rotary_factor=0.5),
    }[family]
    return hf_models.config_from_dict({"model_type": family, **common, **sizes, **extra})


def make_model(family, layout="modules", dtype=torch.float32, seed=0, skew=True, **extra):
    """The stand-in model, its routers skewed so that a few experts take most
    tokens (and some experts none)."""
    torch.manual_seed(seed)
    model = hf_models.model_from_config(make_config(family, layout, **extra)).to(dtype)
    if skew:
        with torch.no_grad():
            for name, m in model.named_modules():
                gate = getattr(m, "gate", None)
                w = getattr(gate, "weight", None)
                if w is not None and w.dim() == 2 and w.shape[0] == 8:
                    w[:2] += 3 * w[2:].mean(0, keepdim=True) + 0.2 * torch.randn_like(w[:2])
                    w[5:] *= 0.1
    return model


def tokens(n_batch=3, n_seq=7, vocab=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n_batch, n_seq), generator=g)


def expert_grads(model, family):
    """{(block name, expert): (dW1 [H, 2I], dW2 [I, H])} of an unpatched model."""
    out = {}
    for name, block, fam in mhf.find_blocks(model):
        ex = block.experts
        for e in range(fam_experts(block)):
            if isinstance(ex, torch.nn.ModuleList):
                g, u, d = (grad_or_zero(getattr(ex[e], p).weight) for p in fam.projections)
                out[name, e] = (torch.cat((g.t(), u.t()), 1), d.t())
            else:
                out[name, e] = (ex.gate_up_proj.grad[e].t(), ex.down_proj.grad[e].t())
    return out


def grad_or_zero(p):
    """An expert that no token reached has no .grad in the unpatched model."""
    return p.grad if p.grad is not None else torch.zeros_like(p)


def fam_experts(block):
    ex = block.experts
    return len(ex) if isinstance(ex, torch.nn.ModuleList) else ex.gate_up_proj.shape[0]


def scale_of(t):
    return t.detach().abs().max().item()


def close(a, b, tol, what):
    err = (a.detach().float() - b.detach().float()).abs().max().item()
    assert err <= tol * max(scale_of(b.float()), 1e-30), f"{what}: {err} vs scale {scale_of(b)}"


def run_both(family, layout, dtype, ranks, tol, ids=None, **options):
    ref = make_model(family, layout, dtype)
    model = copy.deepcopy(ref)
    names = mhf.patch_model(model, ranks=ranks, threads=1, **options)
    assert names == [n for n, _, _ in mhf.find_blocks(ref)]
    ids = tokens() if ids is None else ids
    out, want = model(ids), ref(ids)
    close(out.logits, want.logits, tol, "logits")
    g = torch.randn_like(want.logits)
    out.logits.backward(g)
    want.logits.backward(g)
    return ref, model


@pytest.mark.parametrize("family,layout", FAMILY_LAYOUTS)
def test_patched_model_matches_the_stand_in(family, layout):
    """fp32: logits and the gradients of every trainable parameter (the
    embedding's is the inputs') within 1e-5 of their scale, 21 tokens on 2
    ranks (a padded last rank), skewed routing."""
    ref, model = run_both(family, layout, torch.float32, 2, 1e-5)
    params = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        if ".experts." in name or name.startswith("experts."):
            continue
        assert name in params, name
        close(params[name].grad, p.grad, 1e-5, name)
    want = expert_grads(ref, family)
    for name, block, experts in mhf._patched(model):
        layer = experts.layer
        for e in range(layer.experts):
            close(layer.w1.grad[e], want[name, e][0], 1e-5, f"{name} expert {e} w1")
            close(layer.w2.grad[e], want[name, e][1], 1e-5, f"{name} expert {e} w2")


@pytest.mark.parametrize("family", FAMILIES + ["qwen3_5_moe_text"])
@pytest.mark.parametrize("mode", ["frozen", "lora"])
def test_fused_experts_of_a_frozen_layer_are_read_in_place(family, mode):
    """v5 fused experts of a frozen or LoRA layer: the layer's w1 and w2 are
    the model's gate_up_proj and down_proj, the same tensors (no copy, the
    model holds its experts once), and the patched model still gives the
    stand-in's logits and input gradients (fp32, within 1e-5)."""
    ref = make_model(family, "fused")
    model = copy.deepcopy(ref)
    before = {name: (b.experts.gate_up_proj, b.experts.down_proj)
              for name, b, _ in mhf.find_blocks(model)}
    params = sum(p.numel() for p in model.parameters())
    options = dict(frozen=True) if mode == "frozen" else dict(lora_rank=2, lora_alpha=4)
    if mode == "lora" and family == "qwen3_5_moe_text":  # (fused parameters only)
        with pytest.raises(ValueError, match=r"qwen3_5_moe models and checkpoints have no "
                                             r"per-expert modules .* lora_target_parameters="):
            mhf.patch_model(copy.deepcopy(ref), ranks=2, threads=1, **options)
        options["lora_target_parameters"] = ["gate_up_proj", "down_proj"]
    mhf.patch_model(model, ranks=2, threads=1, **options)
    for name, block, experts in mhf._patched(model):
        layer = experts.layer
        assert layer.weights_transposed
        assert layer.w1 is before[name][0] and layer.w2 is before[name][1]
        assert not layer.w1.requires_grad and not layer.w2.requires_grad
    adapters = sum(p.numel() for n, p in model.named_parameters() if "_lora_" in n)
    assert sum(p.numel() for p in model.parameters()) == params + adapters
    ids = tokens()
    embed_ref, embed = (m.get_input_embeddings() for m in (ref, model))
    out, want = model(ids), ref(ids)
    close(out.logits, want.logits, 1e-5, "logits")
    g = torch.randn_like(want.logits)
    out.logits.backward(g)
    want.logits.backward(g)
    close(embed.weight.grad, embed_ref.weight.grad, 1e-5, "embedding gradient")


def test_where_the_experts_cannot_be_read_in_place():
    """Per-expert (v4) modules and trained fused experts convert to the
    [E, H, 2I] layout; fused experts of another dtype are copied once into
    the transposed layout; each still gives the stand-in's logits."""
    ids = tokens()
    for layout, options, transposed in (("modules", dict(frozen=True), False),
                                        ("fused", {}, False),
                                        ("fused", dict(frozen=True, dtype=torch.bfloat16), True)):
        ref = make_model("qwen3_moe", layout)
        model = copy.deepcopy(ref)
        mhf.patch_model(model, ranks=2, threads=1, **options)
        for name, block, experts in mhf._patched(model):
            layer = experts.layer
            assert layer.weights_transposed == transposed, (layout, options)
            want = dict(ref.named_modules())[name].experts
            if layout == "fused":
                assert not any(p is want.gate_up_proj for p in model.parameters())
                gate = want.gate_up_proj[:, :layer.inter].to(layer.w1.dtype)
                assert torch.equal(layer.projections()[0], gate)
        tol = 1e-5 if "dtype" not in options else 5e-2
        close(model(ids).logits.float(), ref(ids).logits, tol, f"{layout} {options}")


def err_of(a, b):
    return (a.detach().float() - b.detach().float()).abs().max().item()


@pytest.mark.parametrize("family,layout", FAMILY_LAYOUTS)
def test_bf16(family, layout):
    """bf16, block by block on the same inputs (a whole bf16 model's
    difference would be dominated by a near tie in a later router picking
    another expert, whoever computes the layer before): judged against the
    fp32 block, the patched block's output and input gradient are as close
    as the unpatched block's in bf16; against the unpatched bf16 block, whose
    router picks the same experts, within 3e-2 of their scale."""
    ref32 = make_model(family, layout, torch.float32)
    ref = copy.deepcopy(ref32).to(torch.bfloat16)
    model = copy.deepcopy(ref)
    mhf.patch_model(model, ranks=2, threads=1)
    blocks = [dict(m.named_modules())[name] for m in (model, ref, ref32)
              for name in [n for n, _, _ in mhf.find_blocks(ref32)]]
    per_model = len(blocks) // 3
    g = torch.Generator().manual_seed(3)
    for b in range(per_model):
        h = torch.randn(3, 7, 32, generator=g)
        dy = torch.randn(3, 7, 32, generator=g)
        outs, grads = [], []
        for block in blocks[b::per_model]:
            x = h.to(next(block.parameters()).dtype).requires_grad_()
            out = block(x)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(dy.to(out.dtype))
            outs.append(out)
            grads.append(x.grad)
        for (a, b16, c), what in ((outs, "output"), (grads, "input gradient")):
            scale = scale_of(c)
            assert err_of(a, c) <= 1.5 * err_of(b16, c) + 2e-3 * scale, what
            assert err_of(a, b16) <= 3e-2 * scale_of(b16), what  # the same routing


def test_a_patched_model_cast_to_bf16_keeps_its_fp32_experts():
    """model.to(torch.bfloat16) after patch_model with fp32 experts (as
    Trainer's bf16_full_eval does): the rest of the model is bf16, the
    experts stay fp32 (one warning), and the model runs: its logits those
    of the unpatched model whose experts alone stay fp32."""
    ref = make_model("qwen3_moe", "fused")
    model = copy.deepcopy(ref)
    mhf.patch_model(model, ranks=2, threads=1)
    with pytest.warns(UserWarning, match="the MoeFFN layer stays torch.float32"):
        model.to(torch.bfloat16)
    ref.to(torch.bfloat16)
    for block in [m for m in ref.modules() if type(m).__name__.endswith("SparseMoeBlock")]:
        block.experts.float()
        forward = block.experts.forward  # fp32 experts on the bf16 stream, cast as moec's

        def cast(hidden, *rest, forward=forward):
            return forward(hidden.float(), *rest).to(hidden.dtype)
        block.experts.forward = cast
    layer = next(m for m in model.modules() if isinstance(m, moec_torch.MoeFFN))
    assert layer.w1.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = tokens()
    got, want = model(ids).logits, ref(ids).logits
    assert got.dtype == torch.bfloat16
    close(got.float(), want.float(), 1e-2, "logits")


def test_any_batch_shape_and_size():
    """One process, 3 ranks: batches of 1, 5 and 40 tokens, [T, H] blocks
    fed directly, and the same model after a batch of another size."""
    ref = make_model("qwen3_moe")
    model = copy.deepcopy(ref)
    mhf.patch_model(model, ranks=4, threads=1, tokens_per_rank=4)
    for shape in [(1, 1), (1, 5), (4, 10), (2, 3)]:
        ids = tokens(*shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the layer grows
            close(model(ids).logits, ref(ids).logits, 1e-5, f"batch {shape}")
    block = model.model.layers[0].mlp
    h = torch.randn(13, 32)
    out, logits = block(h)
    want, _ = ref.model.layers[0].mlp(h.view(1, 13, 32))
    assert out.shape == (13, 32)
    close(out, want.view(13, 32), 1e-5, "[T, H] input")
    empty, logits = block(torch.randn(2, 0, 32))
    assert empty.shape == (2, 0, 32) and logits.shape == (0, 8)


def test_refusals():
    model = make_model("qwen3_moe")

    class Mystery(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(4, 2)
            self.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

    model.model.layers[1].mlp = Mystery()
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp' \(Mystery\) looks like an MoE "
                                         r"block.*known: qwen2_moe"):
        mhf.patch_model(model, ranks=1)
    # nothing was patched: the first block keeps its experts
    assert isinstance(model.model.layers[0].mlp.experts, torch.nn.ModuleList)
    dense = torch.nn.Sequential(torch.nn.Linear(4, 4))
    dense.config = make_config("qwen3_moe")
    with pytest.raises(ValueError, match="found no MoE block"):
        mhf.patch_model(dense)
    with pytest.raises(ValueError, match="patch_model\\(model\\) first"):
        mhf.save_adapters(make_model("qwen3_moe"), "/tmp/never")
    patched = make_model("qwen3_moe")
    mhf.patch_model(patched, ranks=1, threads=1)
    with pytest.raises(ValueError, match="patched already"):
        mhf.patch_model(patched)
    with pytest.raises(ValueError, match="lora_targets.*gate_proj, up_proj, down_proj"):
        mhf.patch_model(make_model("qwen3_moe"), lora_rank=4, lora_targets=("w1",))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        mhf.patch_model(make_model("qwen3_moe", dtype=torch.float16))
    with pytest.raises(ValueError, match="the 8 experts of 'model.layers.0.mlp' do not divide "
                                         "over 3 ranks"):
        mhf.patch_model(make_model("qwen3_moe"), ranks=3)
    gelu = make_model("qwen3_moe")
    gelu.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act 'gelu'; the layer computes SwiGLU"):
        mhf.patch_model(gelu)
    old = make_model("deepseek_v3")
    old.model.layers[1].mlp.moe = None  # a version of the block without the method
    with pytest.raises(ValueError, match="has no moe method to replace"):
        mhf.patch_model(old)


def lora_pair(tmp_path, family="qwen3_moe", layout="modules", targets=None, r=4, alpha=8,
              ranks=2):
    """A patched model with adapters trained away from zero, and the
    unpatched stand-in with PEFT's LoRA loaded from what save_adapters
    wrote."""
    ref = make_model(family, layout)
    model = copy.deepcopy(ref)
    mhf.patch_model(model, ranks=ranks, threads=1, lora_rank=r, lora_alpha=alpha,
                    lora_targets=targets)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = [p for _, _, ex in mhf._patched(model) for p in ex.layer.adapters()]
    for p in adapters:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(adapters, lr=0.05)
    ids = tokens(seed=5)
    for _ in range(3):
        out = model(ids)
        out.logits.square().mean().backward()
        opt.step()
        opt.zero_grad()
    files = mhf.save_adapters(model, tmp_path / "adapter")
    ref = as_modules(ref)
    hf_lora.load_lora(ref, tmp_path / "adapter")
    return ref, model, files, trainable


def as_modules(model):
    """The same model with per-expert modules (v4), which PEFT's LoRA on
    nn.Linear targets: a fused (v5) model's adapters are saved under the
    per-expert names of its checkpoints."""
    if model.config.experts_layout == "modules":
        return model
    config = hf_models.config_from_dict({**model.config.to_dict(), "experts_layout": "modules"})
    out = hf_models.model_from_config(config).to(next(model.parameters()).dtype)
    hf_models.load_checkpoint_state_dict(out, hf_models.checkpoint_state_dict(model))
    return out


@pytest.mark.parametrize("family,layout,targets", [
    ("qwen3_moe", "modules", None), ("qwen3_moe", "fused", ("gate_proj", "down_proj")),
    ("mixtral", "modules", ("w1", "w3")), ("deepseek_v3", "fused", ("up_proj",)),
    ("qwen2_moe", "modules", ("down_proj",))])
def test_adapters_load_onto_the_unpatched_model(tmp_path, family, layout, targets):
    """PEFT's LoRA on the unpatched model, loaded by name from the saved file,
    gives the patched model's logits; after one more step on both, the
    adapters' gradients agree; the zero blocks stayed zero."""
    ref, model, files, _ = lora_pair(tmp_path, family, layout, targets)
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert "target_parameters" not in config  # a key older PEFT releases refuse
    names = safetensors.load_file(tmp_path / "adapter/adapter_model.safetensors")
    proj = mhf._BY_BLOCK[type(mhf.find_blocks(make_model(family, layout))[0][1]).__name__] \
        .projections
    wanted = set(targets or proj)
    assert {k.split(".")[-3] for k in names} == wanted
    prefix = "base_model.model.model.layers.1." + ("block_sparse_moe" if family == "mixtral"
                                                   else "mlp")
    key = f"{prefix}.experts.7.{sorted(wanted)[0]}.lora_A.weight"
    assert key in names and names[key].shape[0] == 4
    # PEFT's target regex hits exactly the routed experts' projections
    lora_modules = {n for n, m in ref.named_modules() if isinstance(m, hf_lora.LoraLinear)}
    assert all(".experts." in n and ".shared_expert" not in n for n in lora_modules)
    assert len(lora_modules) == len(names) // 2
    ids = tokens(seed=9)
    out, want = model(ids), ref(ids)
    close(out.logits, want.logits, 1e-5, "logits with adapters")
    g = torch.randn_like(out.logits)
    out.logits.backward(g)
    want.logits.backward(g)
    grads = {k: grad_or_zero(p) for k, p in hf_lora.lora_state_dict(ref).items()}
    for name, _, experts in mhf._patched(model):
        for key, p, j, (rows, cols) in mhf._adapter_tensors(name, experts):
            close(p.grad[j][rows, cols].t(), grads[key], 1e-5, key)
        for pname, mask in experts._masks.items():
            p = getattr(experts.layer, pname)
            assert torch.count_nonzero(p.detach() * (1 - mask)) == 0, pname
            assert torch.count_nonzero(p.grad * (1 - mask)) == 0, pname


def test_adapters_round_trip_and_refusals(tmp_path):
    ref, model, files, _ = lora_pair(tmp_path)
    ids = tokens(seed=3)
    before = model(ids).logits.detach()
    fresh = make_model("qwen3_moe")
    mhf.patch_model(fresh, ranks=2, threads=1, lora_rank=4, lora_alpha=8)
    assert mhf.load_adapters(fresh, tmp_path / "adapter") == []
    assert torch.equal(fresh(ids).logits, before)
    # another r is refused before anything is copied
    other = make_model("qwen3_moe")
    mhf.patch_model(other, ranks=2, threads=1, lora_rank=2, lora_alpha=8)
    state = [p.detach().clone() for _, _, ex in mhf._patched(other) for p in ex.layer.adapters()]
    with pytest.raises(ValueError, match="ranks {'gate_proj': 4, 'up_proj': 4, 'down_proj': 4} "
                       r"\(scaling 2\); the model's are \{'gate_proj': 2.*scaling 4"):
        mhf.load_adapters(other, tmp_path / "adapter")
    # a tensor of the wrong shape: refused, nothing copied
    tensors = safetensors.load_file(tmp_path / "adapter/adapter_model.safetensors")
    bad = sorted(tensors)[-1]
    tensors = {k: v.clone() for k, v in tensors.items()}
    tensors[bad] = tensors[bad][:, :-1].contiguous()
    safetensors.save_file(tensors, tmp_path / "adapter/adapter_model.safetensors")
    target = make_model("qwen3_moe")
    mhf.patch_model(target, ranks=2, threads=1, lora_rank=4, lora_alpha=8)
    state = [p.detach().clone() for _, _, ex in mhf._patched(target) for p in ex.layer.adapters()]
    with pytest.raises(ValueError, match=f"'{bad}'.*has shape"):
        mhf.load_adapters(target, tmp_path / "adapter")
    after = [p.detach() for _, _, ex in mhf._patched(target) for p in ex.layer.adapters()]
    assert all(torch.equal(a, b) for a, b in zip(state, after))


def test_pickled_adapter_runs_no_code(tmp_path):
    """An adapter_model.bin whose pickle would run a command is refused, and
    the command does not run."""
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    folder = tmp_path / "evil"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8,
             "target_modules": ["gate_proj", "up_proj", "down_proj"]}))
    torch.save({"x": torch.zeros(1), "y": Evil()}, folder / "adapter_model.bin")
    model = make_model("qwen3_moe")
    mhf.patch_model(model, ranks=1, threads=1, lora_rank=4, lora_alpha=8)
    with pytest.raises(ValueError, match="weights_only load refused it"):
        mhf.load_adapters(model, folder)
    assert not marker.exists()
    # and MoeFFN's own loader reads the same way
    layer = moec_torch.MoeFFN("examples/configs/tiny.json", ranks=2, threads=1, lora_rank=4)
    layer.save_adapters(tmp_path / "layer")
    os.remove(tmp_path / "layer/adapter_model.safetensors")
    torch.save({"x": Evil()}, tmp_path / "layer/adapter_model.bin")
    with pytest.raises(ValueError, match="weights_only load refused it"):
        layer.load_adapters(tmp_path / "layer")
    assert not marker.exists()


@pytest.mark.parametrize("family,layout", [("qwen3_moe", "modules"), ("mixtral", "fused"),
                                           ("deepseek_v3", "modules")])
def test_save_pretrained_loads_into_the_unpatched_model(tmp_path, family, layout):
    """The merged checkpoint, in several shards, loads by name into the
    unpatched stand-in, which then gives the patched model's logits."""
    ref, model, _, _ = lora_pair(tmp_path, family, layout)
    files = mhf.save_pretrained(model, tmp_path / "merged", max_shard_size=20_000)
    index = json.loads((tmp_path / "merged/model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(Path(f).name for f in files) == sorted(
        shards + ["config.json", "model.safetensors.index.json"])
    assert all(os.path.getsize(tmp_path / "merged" / s) <= 20_000 + 4096 or
               len(safetensors.load_file(tmp_path / "merged" / s)) == 1 for s in shards)
    fresh = hf_models.model_from_config(
        hf_models.config_from_pretrained(tmp_path / "merged"))
    state = {k: safetensors.load_file(tmp_path / "merged" / f)[k]
             for k, f in index["weight_map"].items()}
    hf_models.load_checkpoint_state_dict(fresh, state)
    ids = tokens(seed=4)
    close(fresh(ids).logits, model(ids).logits, 1e-5, "merged checkpoint")


def write_checkpoint(model, folder, max_shard_size=30_000, fp8=False):
    """The unpatched model as a Hugging Face checkpoint folder; with fp8, the
    routed experts' weights as F8_E4M3 codes with a weight_scale_inv per
    128x128 block, as DeepSeek-V3 ships them (the codes from the format's
    definition: moec_torch.reference's e4m3 rounding)."""
    state = {k: v.detach().contiguous() for k, v in
             hf_models.checkpoint_state_dict(model).items()}
    dtypes = {}
    if fp8:
        for k in [k for k in state if ".experts." in k and k.endswith(".weight")]:
            w = state[k].float()
            scale = torch.zeros(-(-w.shape[0] // 128), -(-w.shape[1] // 128))
            codes = torch.empty(w.shape, dtype=torch.uint8)
            for i in range(scale.shape[0]):
                for j in range(scale.shape[1]):
                    block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
                    s = block.abs().max().clamp_min(1e-12) / 448
                    scale[i, j] = s
                    codes[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = \
                        safetensors.float_to_fp8_e4m3(block / s)
            state[k] = codes
            state[k + "_scale_inv"] = scale
            dtypes[k] = "F8_E4M3"
    os.makedirs(folder, exist_ok=True)
    model.config.save_pretrained(folder)
    safetensors.save_sharded(state, folder, max_shard_size, dtypes=dtypes)
    return state


@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_checkpoint_fills_a_meta_model(tmp_path, layout):
    """A model built with its experts on the meta device, patched, and filled
    from a sharded bf16 checkpoint gives the source model's logits."""
    src = make_model("qwen3_moe", layout, torch.bfloat16)
    write_checkpoint(src, tmp_path / "ckpt")
    empty = make_model("qwen3_moe", layout, torch.bfloat16, seed=7)
    for _, block, _ in mhf.find_blocks(empty):
        block.experts.to(device="meta")
    mhf.patch_model(empty, ranks=2, threads=1)
    mhf.load_checkpoint(empty, tmp_path / "ckpt")
    ids = tokens()
    assert torch.equal(empty(ids).logits.float().isnan().any(), torch.tensor(False))
    close(empty(ids).logits, src(ids).logits, 3e-2, "after load_checkpoint")
    # the experts only: a patched copy of another model takes the source's experts
    other = make_model("qwen3_moe", layout, torch.bfloat16, seed=8)
    mhf.patch_model(other, ranks=1, threads=1)
    read = mhf.load_experts(other, tmp_path / "ckpt")
    assert len(read) == 2 * 8 * 3 and all(".experts." in k for k in read)
    layer = other.model.layers[0].mlp.experts.layer
    assert torch.equal(layer.w2[3], src.model.layers[0].mlp.experts.down_proj[3].t()
                       if layout == "fused" else
                       src.model.layers[0].mlp.experts[3].down_proj.weight.t())


@pytest.mark.parametrize("tied", [False, True])
def test_load_checkpoint_fills_a_model_wholly_on_meta(tmp_path, tied):
    """Made on the meta device, patched, filled: every weight is read once,
    tied embeddings stay tied, and the logits are the source's."""
    src = make_model("mixtral", "fused", tie_word_embeddings=tied)
    write_checkpoint(src, tmp_path / "ckpt")
    model = make_model("mixtral", "fused", seed=4, tie_word_embeddings=tied).to("meta")
    mhf.patch_model(model, ranks=2, threads=1)
    mhf.load_checkpoint(model, tmp_path / "ckpt")
    assert not any(t.is_meta for t in model.state_dict().values() if torch.is_tensor(t))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids = tokens()
    close(model(ids).logits, src(ids).logits, 1e-5, "logits")


def test_fp8_checkpoint_is_dequantized(tmp_path):
    """DeepSeek-V3's FP8 experts (H 256 so that a weight spans two 128-wide
    blocks) read into a bf16 layer equal the dequantized reference."""
    src = make_model("deepseek_v3", hidden_size=256, moe_intermediate_size=160,
                     num_attention_heads=4)
    state = write_checkpoint(src, tmp_path / "ckpt", max_shard_size=400_000, fp8=True)
    model = make_model("deepseek_v3", hidden_size=256, moe_intermediate_size=160,
                       num_attention_heads=4, seed=3)
    mhf.patch_model(model, ranks=2, threads=1)
    mhf.load_checkpoint(model, tmp_path / "ckpt")
    key = "model.layers.1.mlp.experts.5.up_proj.weight"
    codes, scale = state[key], state[key + "_scale_inv"]
    want = safetensors.fp8_e4m3_to_float(codes) * \
        scale.repeat_interleave(128, 0)[:codes.shape[0]].repeat_interleave(128, 1)[:, :256]
    layer = model.model.layers[1].mlp.experts.layer
    assert torch.equal(layer.w1[5, :, 160:], want.t())
    # within e4m3's rounding of the source weights
    close(layer.w1[5, :, 160:], src.model.layers[1].mlp.experts[5].up_proj.weight.t(), 0.07,
          "fp8 weight")
    # a weight without its scale is refused, naming it
    del state[key + "_scale_inv"]
    os.makedirs(tmp_path / "bad")
    src.config.save_pretrained(tmp_path / "bad")
    safetensors.save_sharded(state, tmp_path / "bad", 400_000,
                             dtypes={k: "F8_E4M3" for k, v in state.items()
                                     if v.dtype == torch.uint8})
    with pytest.raises(ValueError, match=f"'{key}' is F8_E4M3.*no '{key}_scale_inv'"):
        mhf.load_checkpoint(model, tmp_path / "bad")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_checkpoint_stays_fp8(tmp_path, layout):
    """DeepSeek-V3's FP8 experts into a LoRA layer with
    weight_format="fp8_block128" (H 256, I 128: whole blocks): the codes and
    weight_scale_inv are copied as they are (nothing dequantized), and the
    patched model's logits and embedding gradient are the unpatched model's
    on the dequantized weights. A bf16 checkpoint is quantized on load."""
    sizes = dict(hidden_size=256, moe_intermediate_size=128, num_attention_heads=4)
    src = make_model("deepseek_v3", layout, **sizes)
    state = write_checkpoint(src, tmp_path / "ckpt", max_shard_size=400_000, fp8=True)
    model = make_model("deepseek_v3", layout, seed=3, **sizes)
    mhf.patch_model(model, ranks=2, threads=1, lora_rank=2, lora_alpha=4,
                    weight_format="fp8_block128")
    mhf.load_checkpoint(model, tmp_path / "ckpt")
    layer = model.model.layers[1].mlp.experts.layer
    assert layer.weight_format == "fp8_block128" and layer.w1.dtype == torch.uint8
    key = "model.layers.1.mlp.experts.5.{}_proj.weight"
    assert torch.equal(layer.w1[5, :128], state[key.format("gate")])
    assert torch.equal(layer.w1[5, 128:], state[key.format("up")])
    assert torch.equal(layer.w2[5], state[key.format("down")])
    assert torch.equal(layer.w1_scale[5, 1:], state[key.format("up") + "_scale_inv"])
    assert torch.equal(layer.w2_scale[5], state[key.format("down") + "_scale_inv"])
    # The judge: the unpatched model on the dequantized checkpoint.
    ref = make_model("deepseek_v3", "modules", seed=5, **sizes)
    dense = {k: quant.dequantize_fp8_blocks(v, state[k + "_scale_inv"]) if v.dtype == torch.uint8
             else v for k, v in state.items() if not k.endswith("_scale_inv")}
    hf_models.load_checkpoint_state_dict(ref, dense)
    ids = tokens()
    out, want = model(ids), ref(ids)
    close(out.logits, want.logits, 1e-5, "logits")
    g = torch.randn_like(want.logits)
    out.logits.backward(g)
    want.logits.backward(g)
    close(model.get_input_embeddings().weight.grad, ref.get_input_embeddings().weight.grad, 1e-5,
          "embedding gradient")
    # A bf16 (here fp32) checkpoint is quantized as it loads.
    write_checkpoint(src, tmp_path / "dense", max_shard_size=400_000)
    mhf.load_checkpoint(model, tmp_path / "dense")
    (_, block, family), = [b for b in mhf.find_blocks(src) if b[0] == "model.layers.1.mlp"]
    gate = mhf._expert_weights(block, family, 5)[0]
    codes, scales = quant.quantize_fp8_blocks(gate.unsqueeze(0))
    assert torch.equal(layer.w1[5, :128], codes[0]) and torch.equal(layer.w1_scale[5, :1], scales[0])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("weight_format", ["int8", "int4_g32", "int4_g32_zp"])
def test_int8_and_int4_experts_quantized_as_they_are_copied_in(layout, weight_format):
    """patch_model(weight_format="int8" or "int4_g*") with LoRA adapters:
    the model's experts quantized as the layer takes them, by the same rule
    as moec_torch.quant; the patched model's logits and the adapters' and
    embedding's gradients are those of the unpatched model with PEFT's LoRA
    on the dequantized experts."""
    sizes = dict(hidden_size=64, moe_intermediate_size=32)
    src = make_model("qwen3_moe", layout, **sizes)
    model = copy.deepcopy(src)
    mhf.patch_model(model, ranks=2, threads=1, lora_rank=2, lora_alpha=4,
                    weight_format=weight_format)
    layer = model.model.layers[0].mlp.experts.layer
    assert layer.weight_format == weight_format
    assert layer.w1.dtype == (torch.int8 if weight_format == "int8" else torch.uint8)
    # The judge: the per-expert layout (PEFT's LoRA takes nn.Linear), the
    # same weights (the same seed), its experts what the codes stand for.
    ref = make_model("qwen3_moe", "modules", **sizes)
    with torch.no_grad():
        for _, block, family in mhf.find_blocks(ref):
            for e in range(fam_experts(block)):
                for w in mhf._expert_weights(block, family, e):
                    w.copy_(quant.dequantize(weight_format, *quant.quantize(weight_format, w)))
    adapter = Path(os.environ.get("TEST_TMPDIR", "/tmp")) / f"int-{layout}-{weight_format}"
    # A step first, so that the adapters' B are not zero (as they start).
    ids = tokens()
    trained = [p for p in model.parameters() if p.requires_grad]
    model(ids).logits.square().mean().backward()
    torch.optim.SGD(trained, lr=1.0).step()
    model.zero_grad()
    mhf.save_adapters(model, adapter)
    for p in ref.parameters():
        p.requires_grad_(False)
    hf_lora.load_lora(ref, adapter)
    theirs = dict(ref.named_parameters())
    with torch.no_grad():  # the step's other parameters (embedding, attention, router)
        for n, p in model.named_parameters():
            if ".experts." not in n:
                theirs[n].copy_(p)
    out, want = model(ids), ref(ids)
    close(out.logits, want.logits, 1e-5, "logits")
    g = torch.randn_like(want.logits)
    out.logits.backward(g)
    want.logits.backward(g)
    got_a = layer.adapters()[0].grad  # gate_up's A: [L, H, 2r], gate's r first
    name = "model.layers.0.mlp.experts.3.gate_proj"
    want_a = dict(ref.named_modules())[name].lora_A.weight.grad  # [r, H]
    assert want_a.abs().max() > 0  # expert 3 had tokens
    close(got_a[3, :, :2].t(), want_a, 1e-4, "gate_proj lora_A gradient of expert 3")


def gptq_words(q, bits=4):
    """int32 words of the codes q [n, m] (0 .. 2^bits - 1), 32 / bits of
    them a word along dim 0, from the low bits up: AutoGPTQ's pack()."""
    per = 32 // bits
    words = torch.zeros(q.shape[0] // per, q.shape[1], dtype=torch.int64)
    for s in range(per):
        words |= q[s::per].to(torch.int64) << (bits * s)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def gptq_values(qweight, qzeros, scales, g_idx, v1=True, bits=4):
    """AutoGPTQ's dequantization of a layer (its QuantLinear forward's):
    the weight [out, in] in float32."""
    per, mask = 32 // bits, (1 << bits) - 1
    q = torch.cat([(qweight.to(torch.int64) >> (bits * s)) & mask for s in range(per)], 1)
    q = q.reshape(qweight.shape[0], per, -1).reshape(-1, qweight.shape[1])  # [in, out]: p r + s
    z = torch.stack([(qzeros.to(torch.int64) >> (bits * s)) & mask for s in range(per)], -1)
    z = z.reshape(qzeros.shape[0], -1) + (1 if v1 else 0)                   # [groups, out]
    g = g_idx.long()
    return ((q - z[g]).float() * scales.float()[g]).t().contiguous()


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order: the column in each slot


def awq_words(q):
    """AutoAWQ's WQLinear_GEMM packing of codes q [n, m]: int32 [n, m / 8],
    slot i of word [r, c] holding column 8c + AWQ_ORDER[i]."""
    words = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for i, col in enumerate(AWQ_ORDER):
        words |= q[:, col::8].to(torch.int64) << (4 * i)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def awq_values(qweight, qzeros, scales, group):
    """AutoAWQ's dequantize_gemm: unpack each word's 8 slots, put the
    columns back in order, (code - zero) x scale; the weight [out, in]."""
    def unpack(words):
        slots = torch.stack([(words.to(torch.int64) >> (4 * i)) & 15 for i in range(8)], -1)
        back = torch.empty_like(slots)
        for i, col in enumerate(AWQ_ORDER):
            back[..., col] = slots[..., i]
        return back.reshape(words.shape[0], -1)
    q, z = unpack(qweight), unpack(qzeros).repeat_interleave(group, 0)
    return ((q - z).float() * scales.float().repeat_interleave(group, 0)).t().contiguous()


def ct_values(weight_packed, weight_scale, weight_shape, weight_zero_point=None, bits=4):
    """compressed-tensors' decompression of a pack-quantized weight
    (unpack_from_int32, signed by the offset 2^(bits-1), then (q - zp) x
    scale, the group of column i being i // (in / groups)): the weight
    [out, in]."""
    out, cols = weight_shape.tolist()
    per, mask, offset = 32 // bits, (1 << bits) - 1, 1 << (bits - 1)
    q = torch.zeros(out, weight_packed.shape[1] * per, dtype=torch.int64)
    for i in range(per):
        q[:, i::per] = (weight_packed.to(torch.int64) >> (bits * i)) & mask
    q = q[:, :cols] - offset
    scale = weight_scale.float()
    zp = torch.zeros_like(scale)
    if weight_zero_point is not None:
        z = torch.zeros(weight_zero_point.shape[0] * per, scale.shape[1], dtype=torch.int64)
        for i in range(per):
            z[i::per] = (weight_zero_point.to(torch.int64) >> (bits * i)) & mask
        zp = (z[:out] - offset).float()
    group = cols // scale.shape[1]
    return (q.float() - zp.repeat_interleave(group, 1)) * scale.repeat_interleave(group, 1)


def write_int_checkpoint(model, folder, group=32, sym=True, act_order=False, v1=True, bits=4,
                          method="gptq"):
    """The unpatched model as a GPTQ checkpoint, as AutoGPTQ writes
    one: every linear weight of the decoder layers but the routers' as
    qweight, qzeros (v1: zero - 1), fp16 scales and g_idx (with act_order a
    permutation's groups); codes by rounding to nearest (GPTQ's own choice of
    codes is the quantizer's business, not the format's). With method "awq",
    as AutoAWQ writes one (GEMM: qweight [in, out / 8] in its column order,
    zeros as they are, no g_idx); with "compressed-tensors", as
    llm-compressor's pack-quantized format (weight_packed [out, in / 8],
    weight_scale [out, groups], a packed weight_zero_point where not
    symmetric, weight_shape). Returns the checkpoint's state with each
    quantized weight as AutoGPTQ, AutoAWQ or compressed-tensors
    dequantizes it."""
    state = {k: v.detach().contiguous() for k, v in
             hf_models.checkpoint_state_dict(model).items()}
    judge = dict(state)
    for k in [k for k in state if k.startswith("model.layers.") and k.endswith(".weight")
              and state[k].dim() == 2 and not k.endswith("mlp.gate.weight")
              and state[k].shape[0] % 8 == 0 and state[k].shape[1] % group == 0]:
        w = state.pop(k).float().t()                                       # [in, out]
        rows = w.shape[0]
        g_idx = torch.arange(rows) // group
        if act_order:
            g_idx = g_idx[torch.randperm(rows, generator=torch.Generator().manual_seed(rows))]
        groups, top = rows // group, (1 << bits) - 1
        lo = torch.stack([w[g_idx == g].amin(0) for g in range(groups)]).clamp(max=0)
        hi = torch.stack([w[g_idx == g].amax(0) for g in range(groups)]).clamp(min=0)
        if sym:
            hi = torch.maximum(-lo, hi)
            scale = (2 * hi / top).clamp(min=1e-8).half()
            zero = torch.full_like(hi, (top + 1) // 2)
        else:
            scale = ((hi - lo) / top).clamp(min=1e-8).half()
            zero = torch.round(-lo / scale.float()).clamp(1, top)
        q = (torch.round(w / scale.float()[g_idx]) + zero[g_idx]).clamp(0, top).long()
        stem = k[:-len("weight")]
        if method == "awq":
            tensors = {"qweight": awq_words(q), "qzeros": awq_words(zero.long()),
                       "scales": scale}
            judge[k] = awq_values(*tensors.values(), group)
        elif method == "compressed-tensors":  # stored codes: the signed ones + 8
            tensors = {"weight_packed": gptq_words(q, bits).t(), "weight_scale": scale.t(),
                       "weight_shape": torch.tensor([w.shape[1], w.shape[0]])}
            if not sym:
                tensors["weight_zero_point"] = gptq_words(zero.long().t(), bits)
            judge[k] = ct_values(**tensors, bits=bits)
        else:
            tensors = {"qweight": gptq_words(q, bits),
                       "qzeros": gptq_words(zero.long().t() - int(v1), bits).t(),
                       "scales": scale, "g_idx": g_idx.to(torch.int32)}
            judge[k] = gptq_values(*tensors.values(), v1=v1, bits=bits)
        state.update({stem + n: t.contiguous() for n, t in tensors.items()})
    scheme = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group",
              "group_size": group, "dynamic": False, "actorder": None}
    model.config.quantization_config = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
         "version": "gemm"} if method == "awq" else
        {"quant_method": "compressed-tensors", "format": "pack-quantized",
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme}},
         "ignore": ["lm_head", "re:.*mlp.gate$"]} if method == "compressed-tensors" else
        {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
         "sym": sym, "checkpoint_format": "gptq" if v1 else "gptq_v2"})
    os.makedirs(folder, exist_ok=True)
    model.config.save_pretrained(folder)
    del model.config.quantization_config
    safetensors.save_sharded(state, folder, 30_000)
    return state, judge


@pytest.mark.parametrize("method,sym,weight_format,v1", [
    ("gptq", True, "int4_g32", True), ("gptq", False, "int4_g32_zp", True),
    ("gptq", False, "int4_g32_zp", False), ("awq", False, "int4_g32_zp", False),
    ("compressed-tensors", True, "int4_g32", False),
    ("compressed-tensors", False, "int4_g32_zp", False)])
def test_integer_checkpoints_held_as_they_are(tmp_path, method, sym, weight_format, v1):
    """A 4-bit GPTQ or AWQ checkpoint (group 32) into LoRA layers of its
    format, the model made on the meta device: the experts' codes, scales
    and zeros copied as they are
    (nothing rounded again: the layer's values are AutoGPTQ's or AutoAWQ's
    dequantization bit for bit); the other linear weights dequantized into
    the model; the patched model's logits those of the unpatched model on
    those values."""
    sizes = dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=64)
    src = make_model("qwen3_moe", **sizes)
    state, judge = write_int_checkpoint(src, tmp_path / "ckpt", sym=sym, v1=v1, method=method)
    model = make_model("qwen3_moe", seed=3, **sizes).to("meta")  # every weight from the files
    mhf.patch_model(model, ranks=2, threads=1, lora_rank=2, lora_alpha=4,
                    weight_format=weight_format)
    mhf.load_checkpoint(model, tmp_path / "ckpt")
    assert not any(t.is_meta for t in model.state_dict().values() if torch.is_tensor(t))
    layer = model.model.layers[1].mlp.experts.layer
    w1, w2 = layer.dequantized_weights()
    key = "model.layers.1.mlp.experts.5.{}_proj.weight"
    assert torch.equal(w1[5], torch.cat((judge[key.format("gate")], judge[key.format("up")])))
    assert torch.equal(w2[5], judge[key.format("down")])
    scales = state[key.format("down")[:-len("weight")] + "weight_scale"].float() \
        if method == "compressed-tensors" else \
        state[key.format("down")[:-len("weight")] + "scales"].float().t()
    assert torch.equal(layer.w2_scale[5][..., 0] if not sym else layer.w2_scale[5], scales)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert q not in state and torch.equal(model.model.layers[0].self_attn.q_proj.weight, judge[q])
    ref = make_model("qwen3_moe", seed=5, **sizes)
    hf_models.load_checkpoint_state_dict(ref, judge)
    ids = tokens()
    close(model(ids).logits, ref(ids).logits, 1e-5, "logits")


def write_scaled_checkpoint(model, folder, fmt, strategy):
    """The unpatched model as compressed-tensors writes its W8A8 int8
    ("int-quantized") or FP8 ("float-quantized") checkpoints: every linear
    weight of the decoder layers but the routers' as int8 or F8_E4M3 codes
    [out, in] with a weight_scale by channel [out, 1] or, for FP8, by
    128 x 128 block, in bf16 (the model's dtype), int8's 2 amax / 255 as its
    observer makes it. Returns (the state, each such weight as code x
    scale)."""
    state = {k: v.detach().contiguous() for k, v in
             hf_models.checkpoint_state_dict(model).items()}
    judge, dtypes = dict(state), {}
    top = 127.5 if fmt == "int-quantized" else 448
    for k in [k for k in state if k.startswith("model.layers.") and k.endswith(".weight")
              and state[k].dim() == 2 and not k.endswith("mlp.gate.weight")]:
        w = state[k].float()
        if strategy == "block":
            scale = (torch.stack([torch.stack([b.abs().max() for b in r.split(128, 1)])
                                  for r in w.split(128, 0)]) / top).bfloat16()
            spread = scale.float().repeat_interleave(128, 0)[:w.shape[0]]
            spread = spread.repeat_interleave(128, 1)[:, :w.shape[1]]
        else:
            scale = (w.abs().amax(1, keepdim=True) / top).bfloat16()
            spread = scale.float()
        if fmt == "int-quantized":
            codes = torch.round(w / spread).clamp(-128, 127).to(torch.int8)
            judge[k] = codes.float() * spread
        else:
            codes = safetensors.float_to_fp8_e4m3(w / spread)
            judge[k] = safetensors.fp8_e4m3_to_float(codes) * spread
            dtypes[k] = "F8_E4M3"
        state[k], state[k + "_scale"] = codes, scale.contiguous()
    weights = {"num_bits": 8, "type": "int" if fmt == "int-quantized" else "float",
               "symmetric": True, "strategy": strategy, "dynamic": False}
    if strategy == "block":
        weights["block_structure"] = [128, 128]
    model.config.quantization_config = {
        "quant_method": "compressed-tensors", "format": fmt,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": {"num_bits": 8, "dynamic": True}}}}
    os.makedirs(folder, exist_ok=True)
    model.config.save_pretrained(folder)
    del model.config.quantization_config
    safetensors.save_sharded(state, folder, 60_000, dtypes=dtypes)
    return state, judge


@pytest.mark.parametrize("fmt,strategy,weight_format", [
    ("int-quantized", "channel", "int8"), ("float-quantized", "block", "fp8_block128"),
    ("float-quantized", "channel", None)])
def test_compressed_tensors_int8_and_fp8_checkpoints(tmp_path, fmt, strategy, weight_format):
    """compressed-tensors' W8A8 int8 checkpoints into an int8 LoRA layer and
    its FP8 block checkpoints into an fp8_block128 one: codes and scales
    copied as they are; FP8 by channel into a dense layer: dequantized. The
    layers' values are code x scale bit for bit, the other linear weights
    dequantized into the model, the logits those of the unpatched model on
    those values."""
    sizes = dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=128)
    src = make_model("qwen3_moe", **sizes)
    state, judge = write_scaled_checkpoint(src, tmp_path / "ckpt", fmt, strategy)
    model = make_model("qwen3_moe", seed=3, **sizes).to("meta")  # every weight from the files
    options = dict(lora_rank=2, lora_alpha=4, weight_format=weight_format) if weight_format \
        else {}
    mhf.patch_model(model, ranks=2, threads=1, **options)
    mhf.load_checkpoint(model, tmp_path / "ckpt")
    layer = model.model.layers[1].mlp.experts.layer
    key = "model.layers.1.mlp.experts.5.{}_proj.weight"
    if weight_format:
        assert torch.equal(layer.w2[5], state[key.format("down")])
        w1, w2 = layer.dequantized_weights()
        assert torch.equal(w1[5], torch.cat((judge[key.format("gate")],
                                             judge[key.format("up")])))
        assert torch.equal(w2[5], judge[key.format("down")])
    else:
        gate, up, down = layer.projections()
        assert torch.equal(gate[5], judge[key.format("gate")])
        assert torch.equal(down[5], judge[key.format("down")])
    o = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight, judge[o])
    ref = make_model("qwen3_moe", seed=5, **sizes)
    hf_models.load_checkpoint_state_dict(ref, judge)
    ids = tokens()
    close(model(ids).logits, ref(ids).logits, 1e-5, "logits")
    # a scale of no shape the weight's codes can take is refused, naming it
    bad = dict(state)
    bad[key.format("up") + "_scale"] = torch.ones(3, 5)
    folder = tmp_path / "bad"
    os.makedirs(folder)
    (folder / "config.json").write_text((tmp_path / "ckpt/config.json").read_text())
    safetensors.save_sharded(bad, folder, 60_000,
                             dtypes={k: "F8_E4M3" for k in bad if bad[k].dtype == torch.uint8})
    with pytest.raises(ValueError, match=rf"'{key.format('up')}_scale' in .* is F32 \[3, 5\]; "
                                         r"an (I8|F8_E4M3) weight of shape \[128, 128\] needs"):
        mhf.load_checkpoint(model, folder)


@pytest.mark.parametrize("family,layout,sizes", [
    ("mixtral", "fused", dict(hidden_size=64, intermediate_size=32)),
    ("deepseek_v3", "modules", dict(hidden_size=64, moe_intermediate_size=32,
                                    intermediate_size=64, num_attention_heads=4))])
def test_integer_checkpoints_of_other_families(tmp_path, family, layout, sizes):
    """An AWQ checkpoint of Mixtral (experts w1, w3, w2 under
    block_sparse_moe, the v5 model's mlp) and of DeepSeek-V3 (its dense
    first layer and shared experts quantized too) into int4_g32_zp LoRA
    layers of a model made on the meta device: the logits those of the
    unpatched model on AutoAWQ's values."""
    src = make_model(family, layout, **sizes)
    state, judge = write_int_checkpoint(src, tmp_path / "ckpt", sym=False, method="awq")
    assert any(".experts.0." in k and k.endswith(".qweight") for k in state)
    model = make_model(family, layout, seed=3, **sizes).to("meta")
    mhf.patch_model(model, ranks=2, threads=1, lora_rank=2, lora_alpha=4,
                    weight_format="int4_g32_zp")
    mhf.load_checkpoint(model, tmp_path / "ckpt")
    ref = make_model(family, "modules", seed=5, **sizes)
    hf_models.load_checkpoint_state_dict(ref, judge)
    ids = tokens()
    close(model(ids).logits, ref(ids).logits, 1e-5, "logits")


@pytest.mark.parametrize("method,bits", [("gptq", 4), ("gptq", 8),
                                         ("compressed-tensors", 8)])
def test_integer_checkpoint_dequantized_or_quantized_again(tmp_path, method, bits):
    """Where a layer cannot hold a checkpoint's experts as they are: a dense
    layer takes AutoGPTQ's or compressed-tensors' values (GPTQ's desc_act
    groups out of order included; 4 and 8 bits) bit for bit; an int4_g64
    layer, a g32 checkpoint's values quantized again (close to them, not
    equal)."""
    sizes = dict(hidden_size=64, moe_intermediate_size=64, intermediate_size=64)
    src = make_model("qwen3_moe", **sizes)
    _, judge = write_int_checkpoint(src, tmp_path / "ckpt", sym=False,
                                     act_order=method == "gptq", bits=bits, method=method)
    model = make_model("qwen3_moe", seed=3, **sizes)
    mhf.patch_model(model, ranks=2, threads=1)
    mhf.load_checkpoint(model, tmp_path / "ckpt")
    key = "model.layers.0.mlp.experts.2.{}_proj.weight"
    gate, up, down = model.model.layers[0].mlp.experts.layer.projections()
    assert torch.equal(gate[2], judge[key.format("gate")])
    assert torch.equal(down[2], judge[key.format("down")])
    ref = make_model("qwen3_moe", seed=5, **sizes)
    hf_models.load_checkpoint_state_dict(ref, judge)
    ids = tokens()
    close(model(ids).logits, ref(ids).logits, 1e-5, "logits")
    again = make_model("qwen3_moe", seed=3, **sizes)
    mhf.patch_model(again, ranks=2, threads=1, frozen=True, weight_format="int4_g64")
    mhf.load_checkpoint(again, tmp_path / "ckpt")
    w1, _ = again.model.layers[0].mlp.experts.layer.dequantized_weights()
    want = judge[key.format("gate")]
    assert not torch.equal(w1[2, :64], want)
    close(w1[2, :64], want, 0.15, "int4_g64 from a GPTQ g32 checkpoint")


def test_integer_checkpoint_refusals(tmp_path):
    """GPTQ tensors without settings, AWQ's GEMV layout, settings moec cannot read, and tensors
    of the wrong shape: each refused naming the file or tensor, before
    anything is copied."""
    sizes = dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=64)
    src = make_model("qwen3_moe", **sizes)
    state, _ = write_int_checkpoint(src, tmp_path / "ckpt")
    model = make_model("qwen3_moe", seed=3, **sizes)
    mhf.patch_model(model, ranks=2, threads=1, frozen=True, weight_format="int4_g32")
    before = {k: v.detach().clone() for k, v in model.state_dict().items()
              if isinstance(v, torch.Tensor)}
    config = json.loads((tmp_path / "ckpt/config.json").read_text())
    stem = "model.layers.1.mlp.experts.6.up_proj"
    for edit, message in [
            (lambda c, s: c.pop("quantization_config"),
             r"'model\.layers\.0\.self_attn\.q_proj\.qweight' in .* is a GPTQ or AWQ weight, "
             r"and .* has no settings of that kind to read it by"),
            (lambda c, s: c["quantization_config"].update(bits=3),
             r"config.json: a GPTQ checkpoint of 3-bit codes; moec reads 4 and 8-bit ones"),
            (lambda c, s: c["quantization_config"].update(checkpoint_format="marlin"),
             r"config.json: GPTQ checkpoint_format 'marlin'"),
            (lambda c, s: c["quantization_config"].update(group_size=0),
             r"config.json: GPTQ group_size 0 is not a positive integer or -1"),
            (lambda c, s: c["quantization_config"].update(quant_method="awq", version="gemv"),
             r"config.json: AWQ version 'gemv': moec reads 'gemm'"),
            (lambda c, s: c["quantization_config"].update(quant_method="compressed-tensors",
                                                          format="marlin-24"),
             r"config.json: a compressed-tensors checkpoint of format 'marlin-24': moec "
             r"reads 'pack-quantized', 'int-quantized', 'float-quantized'"),
            (lambda c, s: c.update(quantization_config={"quant_method": "bitsandbytes",
                                                        "load_in_4bit": True}),
             r"config.json: a checkpoint quantized by 'bitsandbytes': moec reads FP8"),
            (lambda c, s: c.update(quantization_config={"quant_method": "fp8",
                                                        "weight_block_size": [1, 128]}),
             r"config.json: FP8 weights in blocks of \[1, 128\]: moec reads 128 x 128"),
            (lambda c, s: c["quantization_config"].update(quant_method="awq"),
             r"'model\.layers\.0\.self_attn\.q_proj\.qweight' is I32 \[8, 64\]; a 4-bit AWQ "
             r"weight \[64, 64\] with group_size 32 needs I32 \[64, 8\]"),
            (lambda c, s: c.update(quantization_config={
                "quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int",
                                                    "strategy": "channel"}}}}),
             r"'model\.layers\.0\.self_attn\.q_proj\.qweight' .* GPTQ or AWQ weight, and .* "
             r"has no settings of that kind"),
            (lambda c, s: s.update({f"{stem}.qzeros": s[f"{stem}.qzeros"][:1]}),
             rf"'{stem}.qzeros' is I32 \[1, 4\]; a 4-bit GPTQ weight \[32, 64\] with "
             r"group_size 32 needs I32 \[2, 4\]"),
            (lambda c, s: s.pop(f"{stem}.scales"),
             f"'{stem}.qweight' has no '{stem}.scales' beside it"),
            (lambda c, s: s.update({f"{stem}.g_idx": s[f"{stem}.g_idx"] * 3}),
             rf"'{stem}.g_idx' names group 3; the weight has groups 0 \.\. 1")]:
        bad_config, bad = json.loads(json.dumps(config)), dict(state)
        edit(bad_config, bad)
        folder = tmp_path / f"bad{len(os.listdir(tmp_path))}"
        os.makedirs(folder)
        (folder / "config.json").write_text(json.dumps(bad_config))
        safetensors.save_sharded(bad, folder, 30_000)
        with pytest.raises(ValueError, match=message):
            mhf.load_checkpoint(model, folder)
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
    # a config.json that is not JSON
    (tmp_path / "bad1/config.json").write_text("{")
    with pytest.raises(ValueError, match=r"bad1/config.json: cannot read it: Expecting"):
        mhf.load_checkpoint(model, tmp_path / "bad1")
    # compressed-tensors' "dense" format: its weights are plain; read as such
    dense = tmp_path / "dense"
    write_checkpoint(src, dense)
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "dense"}
    (dense / "config.json").write_text(json.dumps(config))
    plain = make_model("qwen3_moe", seed=3, **sizes)
    mhf.patch_model(plain, ranks=2, threads=1)
    mhf.load_checkpoint(plain, dense)
    ids = tokens()
    close(plain(ids).logits, src(ids).logits, 1e-5, "a dense compressed-tensors checkpoint")
    # compressed-tensors: a weight_shape that is not the model's weight's
    state, _ = write_int_checkpoint(src, tmp_path / "ct", method="compressed-tensors")
    state[f"{stem}.weight_shape"] = torch.tensor([32, 32])
    safetensors.save_sharded(state, tmp_path / "ct", 30_000)
    with pytest.raises(ValueError, match=rf"'{stem}.weight_shape' holds \[32, 32\]; the "
                                         r"model's weight is \[32, 64\]"):
        mhf.load_checkpoint(model, tmp_path / "ct")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_qwen3_5_moe_checkpoints_keep_the_experts_fused(tmp_path):
    """Qwen3.5-MoE's checkpoints hold each block's experts fused
    (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]):
    load_checkpoint reads them into a model made on the meta device and
    patched with LoRA on the fused parameters (PEFT's target_parameters),
    its logits the source's; after a step, save_pretrained writes them
    fused again, the adapters merged in, which the unpatched stand-in loads
    by name and gives the patched model's logits; a checkpoint with
    per-expert names is refused, naming the fused tensor it lacks, and one
    of FP8 fused experts as moec does not read them (under mpirun:
    mpi_hf_check.py, where save_pretrained is refused)."""
    src = make_model("qwen3_5_moe_text", "fused")
    state = write_checkpoint(src, tmp_path / "ckpt", max_shard_size=20_000)
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    model = make_model("qwen3_5_moe_text", "fused", seed=4).to("meta")
    mhf.patch_model(model, ranks=2, threads=1, lora_rank=2, lora_alpha=4,
                    lora_target_parameters=["gate_up_proj", "down_proj"])
    read = mhf.load_experts(model, tmp_path / "ckpt")
    assert sorted(read) == sorted(k for k in state if ".experts." in k)
    mhf.load_checkpoint(model, tmp_path / "ckpt")
    ids = tokens()
    close(model(ids).logits, src(ids).logits, 1e-5, "logits")
    trained = [p for p in model.parameters() if p.requires_grad]
    model(ids).logits.square().mean().backward()
    torch.optim.SGD(trained, lr=1.0).step()
    files = mhf.save_pretrained(model, tmp_path / "merged", max_shard_size=20_000)
    index = json.loads((tmp_path / "merged/model.safetensors.index.json").read_text())
    assert "model.layers.0.mlp.experts.down_proj" in index["weight_map"]
    assert not any(".experts.0." in k for k in index["weight_map"]) and len(files) > 3
    merged = hf_models.model_from_config(hf_models.config_from_pretrained(tmp_path / "merged"))
    hf_models.load_checkpoint_state_dict(merged, {
        k: safetensors.load_file(tmp_path / "merged" / f)[k] for k, f in index["weight_map"].items()})
    with torch.no_grad():
        close(merged(ids).logits, model(ids).logits, 1e-5, "merged checkpoint")
    per_expert = {k: v for k, v in state.items() if ".experts." not in k}
    for k in [k for k in state if k.endswith("experts.gate_up_proj")]:
        for e in range(8):
            per_expert[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = state[k][e, :16]
    os.makedirs(tmp_path / "bad")
    src.config.save_pretrained(tmp_path / "bad")
    safetensors.save_sharded(per_expert, tmp_path / "bad", 20_000)
    with pytest.raises(ValueError, match=r"has no 'model\.layers\.0\.mlp\.experts\.gate_up_proj' "
                                         r"\(the experts of 'model\.layers\.0\.mlp', fused as "
                                         r"qwen3_5_moe checkpoints keep them\)"):
        mhf.load_experts(model, tmp_path / "bad")
    # fused experts stored as FP8 codes: refused, not read
    fp8 = dict(state)
    for k in [k for k in state if k.endswith("experts.gate_up_proj")]:
        fp8[k] = safetensors.float_to_fp8_e4m3(state[k])
        fp8[k + "_scale_inv"] = torch.ones(8, 1, 1)
    os.makedirs(tmp_path / "fp8")
    src.config.save_pretrained(tmp_path / "fp8")
    safetensors.save_sharded(fp8, tmp_path / "fp8", 20_000,
                             dtypes={k: "F8_E4M3" for k, v in fp8.items() if v.dtype == torch.uint8})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj' in .* is "
                                         r"F8_E4M3 \[8, 32, 32\]: moec reads FP8 and int8 codes of "
                                         r"\[out, in\] weights only"):
        mhf.load_experts(model, tmp_path / "fp8")


def test_load_checkpoint_refusals(tmp_path):
    src = make_model("qwen3_moe")
    state = write_checkpoint(src, tmp_path / "ckpt")
    model = make_model("qwen3_moe")
    mhf.patch_model(model, ranks=2, threads=1)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()
              if isinstance(v, torch.Tensor)}
    for change, message in [
            (lambda s: s.pop("model.layers.1.mlp.experts.6.up_proj.weight"),
             "no 'model.layers.1.mlp.experts.6.up_proj.weight'"),
            (lambda s: s.update({"model.layers.0.mlp.gate.weight": torch.zeros(8, 31)}),
             "'model.layers.0.mlp.gate.weight'.*has shape \\[8, 31\\]"),
            (lambda s: s.update({"model.layers.0.mlp.experts.0.gate_proj.weight":
                                 torch.zeros(16, 33)}),
             "'model.layers.0.mlp.experts.0.gate_proj.weight'.*has shape"),
            (lambda s: s.update({"model.extra.weight": torch.zeros(2)}),
             "the model has no 'model.extra.weight'")]:
        bad = {k: v.clone() for k, v in state.items()}
        change(bad)
        folder = tmp_path / f"bad{len(os.listdir(tmp_path))}"
        os.makedirs(folder)
        src.config.save_pretrained(folder)
        safetensors.save_sharded(bad, folder, 30_000)
        with pytest.raises(ValueError, match=message):
            mhf.load_checkpoint(model, folder)
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_load_checkpoint_skips_what_transformers_skips(tmp_path):
    """DeepSeek-V3's checkpoints hold its multi-token prediction layer as
    model.layers.61.*, which transformers' DeepseekV3Model skips
    (_keys_to_ignore_on_load_unexpected): load_checkpoint skips and
    returns them, and loads the rest; in a family without that list the
    same names are refused, unless ignore= names them."""
    def mtp_of(layer):
        if layer == "mtp":  # Qwen3-Next's head, at the top level
            return {"mtp.fc.weight": torch.ones(32, 64), "mtp.norm.weight": torch.ones(32),
                    "mtp.layers.0.mlp.experts.0.gate_proj.weight": torch.ones(16, 32)}
        return {f"model.layers.{layer}.embed_tokens.weight": torch.ones(64, 32),
                f"model.layers.{layer}.mlp.experts.0.gate_proj.weight": torch.ones(16, 32),
                f"model.layers.{layer}.shared_head.norm.weight": torch.ones(32)}

    for family, ignore, refused, layer in (
            ("deepseek_v3", (), False, 61), ("glm4_moe", (), False, 46),  # GLM-4.5-Air's
            ("glm4_moe", (), False, 92), ("qwen3_moe", (), True, 61),
            ("qwen3_next", (), False, "mtp"),
            ("qwen3_moe", r"model\.layers\.61\.", False, 61)):
        mtp = mtp_of(layer)
        src = make_model(family)
        folder = tmp_path / f"{family}-{bool(ignore)}-{layer}"
        state = write_checkpoint(src, folder)
        safetensors.save_sharded({**state, **mtp}, folder, 30_000)
        model = make_model(family, seed=7)
        mhf.patch_model(model, ranks=2, threads=1)
        if refused:
            with pytest.raises(ValueError, match="the model has no 'model.layers.61.embed_tokens"
                                                 ".weight' .*\\(and 2 more\\)"):
                mhf.load_checkpoint(model, folder, ignore=ignore)
            continue
        assert mhf.load_checkpoint(model, folder, ignore=ignore) == sorted(mtp)
        ref = make_model(family)
        mhf.patch_model(ref, ranks=2, threads=1)
        write_checkpoint(src, tmp_path / f"plain-{family}")
        mhf.load_checkpoint(ref, tmp_path / f"plain-{family}")
        ids = tokens()
        assert torch.equal(model(ids).logits, ref(ids).logits)
    with pytest.raises(ValueError, match="'\\(x' is not a regex of names to skip"):
        mhf.load_checkpoint(model, folder, ignore="(x")


@pytest.mark.parametrize("layout,options", [("modules", {}), ("fused", {"frozen": True})])
def test_expert_tensor_parallelism_in_one_process(layout, options):
    """patch_model(tp=2) in one process (an [ep 2, tp 2] mesh of in-process
    ranks): the unpatched model's logits and input gradients; a frozen
    layer of fused experts is converted (the layout it reads in place takes
    no tp); LoRA adapters with tp: the logits and adapter gradients of the
    same adapters patched in at tp=1 (test_mpi.py runs tp one rank per
    process, LoRA too)."""
    ref = make_model("qwen3_moe", layout)
    model = copy.deepcopy(ref)
    mhf.patch_model(model, ranks=2, threads=1, tp=2, **options)
    layer = mhf._patched(model)[0][2].layer
    assert layer.tp == 2 and not layer.weights_transposed
    ids = tokens()
    out, want = model(ids), ref(ids)
    close(out.logits, want.logits, 1e-5, "logits")
    models = []
    for tp in (1, 2):
        lora = make_model("qwen3_moe", layout)
        mhf.patch_model(lora, ranks=2, threads=1, tp=tp, lora_rank=4, lora_alpha=8)
        for (_, _, block) in mhf._patched(lora):
            g = torch.Generator().manual_seed(5)
            with torch.no_grad():
                for p in block.layer.adapters():  # B nonzero
                    p.copy_(torch.rand(p.shape, generator=g) - 0.5)
        out = lora(ids).logits
        out.square().sum().backward()
        models.append((out, lora))
    (out1, one), (out2, two) = models
    for (_, _, a), (_, _, b) in zip(mhf._patched(one), mhf._patched(two)):
        for pa, pb in zip(a.layer.adapters(), b.layer.adapters()):
            close(pb.grad, pa.grad, 1e-5, "LoRA adapter gradients at tp=2")


FINETUNE = Path(os.environ.get("MOEC_HF_EXAMPLE",
                               Path(__file__).resolve().parents[3] / "examples/hf/finetune.py"))


def run_example(command, work, *args, launcher=()):
    return subprocess.run([*launcher, sys.executable, str(FINETUNE), command, str(work),
                           "--steps", "12", *args], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))


@pytest.mark.parametrize("layout,form,weight_format", [
    ("modules", "modules", None), ("fused", "modules", None), ("fused", "parameters", None),
    ("modules", "modules", "fp8_block128"), ("fused", "parameters", "int4_g32_zp")])
def test_the_example_end_to_end(tmp_path, layout, form, weight_format):
    """examples/hf/finetune.py: checkpoint, patched fine-tune beside PEFT's
    LoRA (the same losses), adapters reloaded in a fresh process (the same
    logits), the merged checkpoint in the unpatched model; with the patched
    model's experts as per-expert modules, and fused (read in place); the
    adapters on the per-expert modules, or on the fused parameters; the
    experts held quantized (an FP8 checkpoint as DeepSeek-V3's, its experts
    taken as they are; int4 quantized as they load) beside PEFT's LoRA on
    the dequantized experts."""
    fmt = ["--weight-format", weight_format] if weight_format else []
    for command in ("make-checkpoint", "train", "check"):
        out = run_example(command, tmp_path, "--layout", layout, "--lora-form", form, *fmt)
        assert out.returncode == 0, out.stdout + out.stderr
        if command == "make-checkpoint" and weight_format == "fp8_block128":
            assert "56 of them F8_E4M3 with a weight_scale_inv" in out.stdout, out.stdout
        if command == "train" and weight_format:
            held = re.search(r"experts \(\S+, this process\): \d+ bytes of codes and scales, "
                             r"([\d.]+) of", out.stdout)
            # A byte a value (fp32 scales of 128 x 128 blocks), or half a byte
            # and an fp32 scale and zero point for each 32: of 4 bytes in fp32.
            want = 1 / 4 if weight_format == "fp8_block128" else (1 / 2 + 8 / 32) / 4
            assert held and abs(float(held[1]) - want) < 1e-3, out.stdout
        if command == "train":
            rows = [line.split() for line in out.stdout.splitlines()
                    if line.split() and line.split()[0].isdigit()]
            assert len(rows) >= 3
            for row in rows:   # moec's loss and the plain LoRA model's, step by step
                assert abs(float(row[1]) - float(row[2])) <= 1e-4 * float(row[2]), row
            assert float(rows[-1][1]) < float(rows[0][1]) - 0.5
    assert "bit for bit" in out.stdout and "merged checkpoint" in out.stdout


def test_adapter_and_checkpoint_error_paths(tmp_path):
    """The refusals that the other tests do not reach, each before anything
    is written or copied."""
    plain = make_model("qwen3_moe")
    mhf.patch_model(plain, ranks=1, threads=1)
    with pytest.raises(ValueError, match="have no LoRA adapters; patch it with lora_rank="):
        mhf.save_adapters(plain, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    for size in ("big", "0MB", 0, -5):
        with pytest.raises(ValueError, match="max_shard_size|must be"):
            mhf.save_pretrained(plain, tmp_path / "m", max_shard_size=size)
    assert not (tmp_path / "m").exists()
    _, model, _, _ = lora_pair(tmp_path)
    tensors = safetensors.load_file(tmp_path / "adapter/adapter_model.safetensors")
    gone = sorted(tensors)[0]
    safetensors.save_file({k: v.clone() for k, v in tensors.items() if k != gone},
                          tmp_path / "adapter/adapter_model.safetensors")
    with pytest.raises(ValueError, match=f"have no '{gone}'"):
        mhf.load_adapters(model, tmp_path / "adapter")
    codes = safetensors.float_to_fp8_e4m3(torch.ones(130, 200))
    with pytest.raises(ValueError, match=r"'w_scale_inv': the scales have shape \[1, 2\]; codes "
                                         r"of shape \[130, 200\] in 128x128 blocks need \[2, 2\]"):
        mhf._dequantize_fp8(codes, torch.ones(1, 2), "w")


@pytest.mark.parametrize("mode", [True, "forward"])
def test_pack_weights_reaches_the_layers_and_keeps_the_bits(mode):
    """patch_model(pack_weights=True or "forward") hands it to every block's
    layer, whose logits and input gradients are then the bits of the
    unpacked layer's, over two steps (the second reads the frozen base
    packed)."""
    ref = make_model("qwen3_moe", "modules", torch.bfloat16)
    packed, plain = copy.deepcopy(ref), copy.deepcopy(ref)
    torch.manual_seed(5)  # the adapters' A is drawn: the same in both
    mhf.patch_model(packed, ranks=2, threads=1, lora_rank=2, lora_alpha=4, pack_weights=mode)
    torch.manual_seed(5)
    mhf.patch_model(plain, ranks=2, threads=1, lora_rank=2, lora_alpha=4)
    assert all(e.layer.pack_weights == mode for _, _, e in mhf._patched(packed))
    assert not any(e.layer.pack_weights for _, _, e in mhf._patched(plain))
    ids = tokens()
    for _ in range(2):
        outs = [m(ids).logits for m in (packed, plain)]
        assert torch.equal(outs[0], outs[1])
        g = torch.randn_like(outs[1])
        for out in outs:
            out.backward(g)
    grads = [[p.grad for n, p in m.named_parameters() if p.grad is not None]
             for m in (packed, plain)]
    assert len(grads[0]) == len(grads[1]) > 0
    assert all(torch.equal(x, y) for x, y in zip(*grads))
