"""moec_torch.hf_models, the stand-ins of transformers' MoE models: the two
expert layouts compute alike (logits, losses, router logits, gradients);
each block's routing against the formulas written out here (in float64,
plain Python for the choices); state_dict names as the Hub's checkpoints
have them; the checkpoint conversions; configs, registry, initialization,
dense layers, the loss. Needs no built library."""

import ast
import copy
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moec_torch import hf_models as hm

FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "olmoe",
            "glm4_moe", "qwen3_next"]
SHARED_GATED = ("qwen2_moe", "qwen3_next")  # Qwen2-MoE's block: a gated shared expert
V3_ROUTED = ("deepseek_v3", "glm4_moe")  # DeepSeek-V3's router and block
DEEPSEEK_LIKE = ("deepseek_v2", *V3_ROUTED)  # dense first layers, no router logits out
SOFTMAX_FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "qwen3_next"]
LAYOUTS = ["modules", "fused"]
E, H, I = 8, 32, 16


def config(family, layout="modules", **extra):
    """A tiny config: H 32, 8 experts of I 16, top-2, 3 layers of which one
    dense where the family has dense layers (Qwen2 by mlp_only_layers, Qwen3
    by decoder_sparse_step, DeepSeek by first_k_dense_replace), vocab 64."""
    common = dict(vocab_size=64, hidden_size=H, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, initializer_range=0.05,
                  experts_layout=layout)
    sizes = {
        "qwen2_moe": dict(intermediate_size=48, moe_intermediate_size=I, num_experts=E,
                          shared_expert_intermediate_size=24, mlp_only_layers=[1]),
        "qwen3_moe": dict(intermediate_size=48, moe_intermediate_size=I, num_experts=E,
                          decoder_sparse_step=2, norm_topk_prob=True),
        "mixtral": dict(intermediate_size=I, num_local_experts=E),
        "deepseek_v2": dict(intermediate_size=48, moe_intermediate_size=I, n_routed_experts=E,
                            n_shared_experts=2, first_k_dense_replace=1, n_group=4,
                            topk_group=2, topk_method="group_limited_greedy",
                            routed_scaling_factor=1.5),
        "deepseek_v3": dict(intermediate_size=48, moe_intermediate_size=I, n_routed_experts=E,
                            n_shared_experts=1, first_k_dense_replace=1, n_group=4,
                            topk_group=2),
        "olmoe": dict(intermediate_size=I, num_experts=E, clip_qkv=8.0),
        "qwen3_next": dict(intermediate_size=48, moe_intermediate_size=I, num_experts=E,
                           shared_expert_intermediate_size=24, mlp_only_layers=[1],
                           head_dim=16, partial_rotary_factor=0.25),
        "glm4_moe": dict(intermediate_size=48, moe_intermediate_size=I, n_routed_experts=E,
                         n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                         routed_scaling_factor=1.5, attention_bias=True, use_qk_norm=True,
                         head_dim=16, partial_rotary_factor=0.5),
        "qwen3_5_moe_text": dict(moe_intermediate_size=I, num_experts=E,
                                 shared_expert_intermediate_size=24, head_dim=16,
                                 partial_rotary_factor=0.25),
    }[family]
    return hm.config_from_dict({"model_type": family, **common, **sizes, **extra})


def model(family, layout="modules", seed=0, **extra):
    return hm.model_from_config(config(family, layout, **extra), seed=seed)


def tokens(n_batch=3, n_seq=7, seed=1):
    return torch.randint(0, 64, (n_batch, n_seq), generator=torch.Generator().manual_seed(seed))


def close(a, b, what, tol=1e-5):
    a, b = a.detach().double(), b.detach().double()
    err, scale = (a - b).abs().max().item(), max(b.abs().max().item(), 1e-12)
    assert err <= tol * scale, f"{what}: {err:.3g} off, scale {scale:.3g}"


def checkpoint_grads(m):
    """{checkpoint name: gradient} (zero where there is none), by putting
    the gradients into a copy of the model."""
    clone = copy.deepcopy(m)
    with torch.no_grad():
        for p, q in zip(m.parameters(), clone.parameters()):
            q.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    return hm.checkpoint_state_dict(clone)


def sparse_layers(family):
    return {"qwen2_moe": [0, 2], "qwen3_moe": [1], "qwen3_next": [0, 2]}.get(
        family, [1, 2] if family in DEEPSEEK_LIKE else [0, 1, 2])


def block_of(m, i=None):
    layer = m.model.layers[i if i is not None else sparse_layers(m.config.model_type)[0]]
    return getattr(layer, layer.ffn_name)


# --- (a) the two layouts compute alike ---------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_layouts_compute_alike(family):
    """The v5 (fused) model given the v4 (modules) model's weights (copied
    across under checkpoint names) gives the same logits, loss, aux loss
    and router logits, and the same gradients of every checkpoint tensor."""
    mod, fused = model(family, "modules", seed=1), model(family, "fused", seed=2)
    if family in V3_ROUTED:  # a bias that moves choices, kept >= 0 (see the v4/v5 test)
        for i in sparse_layers(family):
            block_of(mod, i).gate.e_score_correction_bias.uniform_(0.0, 0.2)
    hm.load_checkpoint_state_dict(fused, hm.checkpoint_state_dict(mod))
    ids = tokens()
    labels = ids.clone()
    labels[0, 3] = -100
    outs = [m(ids, labels=labels, output_router_logits=True) for m in (mod, fused)]
    close(outs[1].logits, outs[0].logits, "logits")
    close(outs[1].loss, outs[0].loss, "loss")
    if family in DEEPSEEK_LIKE:
        assert outs[0].router_logits is outs[1].router_logits is None
        assert outs[0].aux_loss is outs[1].aux_loss is None
    else:
        assert len(outs[0].router_logits) == len(outs[1].router_logits) == \
            len(sparse_layers(family))
        for a, b in zip(outs[1].router_logits, outs[0].router_logits):
            assert a.shape == b.shape == (ids.numel(), E)
            close(a, b, "router logits")
        close(outs[1].aux_loss, outs[0].aux_loss, "aux loss")
    for out in outs:
        out.loss.backward()
    want, got = checkpoint_grads(mod), checkpoint_grads(fused)
    assert set(want) == set(got)
    for name in want:
        close(got[name], want[name], f"d {name}")


def test_same_seed_same_weights_in_both_layouts():
    for family in FAMILIES:
        a = hm.checkpoint_state_dict(model(family, "modules", seed=5))
        b = hm.checkpoint_state_dict(model(family, "fused", seed=5))
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), family


# --- (b) routing, against the formulas ---------------------------------------------------

def expert_fn(state, prefix, names=("gate_proj", "up_proj", "down_proj")):
    """x -> down (silu(gate x) * (up x)) in float64, from checkpoint tensors."""
    g, u, d = (state[f"{prefix}.{n}.weight"].double() for n in names)
    return lambda x: (F.silu(x @ g.t()) * (x @ u.t())) @ d.t()


def top(values, k):
    """The indices of the k largest values, by plain sorting."""
    return sorted(range(len(values)), key=lambda e: -values[e])[:k]


@pytest.mark.parametrize("family", SOFTMAX_FAMILIES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("norm", [False, True])
def test_softmax_block_routing(family, layout, norm):
    """y = sum over the top-k of p = softmax(x Wg^T) of w_e expert_e(x), w_e
    = p_e, divided by their sum when norm_topk_prob (Mixtral: always); Qwen2
    adds sigmoid(x w_sg^T) * shared_expert(x). v4 returns (y, router
    logits = x Wg^T), v5 y; v5's router returns (logits, weights, indices)."""
    m = model(family, layout, seed=3, norm_topk_prob=norm)
    i = sparse_layers(family)[0]
    block = block_of(m, i)
    state = hm.checkpoint_state_dict(m)
    name = "block_sparse_moe" if family == "mixtral" else "mlp"
    prefix = f"model.layers.{i}.{name}"
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    experts = [expert_fn(state, f"{prefix}.experts.{e}", names) for e in range(E)]
    wg = state[f"{prefix}.gate.weight"].double()
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(7))
    out = block(x)
    if layout == "modules":
        out, logits = out
        close(logits, x.reshape(-1, H).double() @ wg.t(), "router logits")
    else:
        assert torch.is_tensor(out)
        logits, weights, indices = block.gate(x.reshape(-1, H))
        close(logits, x.reshape(-1, H).double() @ wg.t(), "router logits")
        assert weights.shape == indices.shape == (10, 2)
    renorm = norm or family == "mixtral"
    want = []
    for t in x.reshape(-1, H).double():
        p = torch.softmax(t @ wg.t(), dim=-1).tolist()
        chosen = top(p, 2)
        w = [p[e] / (sum(p[c] for c in chosen) if renorm else 1.0) for e in chosen]
        y = sum(wk * experts[e](t) for wk, e in zip(w, chosen))
        if family in SHARED_GATED:
            shared = expert_fn(state, f"{prefix}.shared_expert")
            y = y + torch.sigmoid(t @ state[f"{prefix}.shared_expert_gate.weight"].double().t()) \
                * shared(t)
        want.append(y)
    close(out.reshape(-1, H), torch.stack(want), "block output")


def test_qwen2_shared_expert_gate():
    """Only the shared expert's term depends on shared_expert_gate's weight w:
    out(w) - out(0) = (sigmoid(x w^T) - 1/2) * shared_expert(x), per token."""
    for layout in LAYOUTS:
        block = block_of(model("qwen2_moe", layout, seed=4))
        x = torch.randn(1, 4, H)
        with torch.no_grad():
            out = block(x)
            block.shared_expert_gate.weight.zero_()
            at_zero = block(x)
        if layout == "modules":
            out, at_zero = out[0], at_zero[0]
        gate = torch.sigmoid(x @ block_of(model("qwen2_moe", layout, seed=4))
                             .shared_expert_gate.weight.t())
        close(out - at_zero, (gate - 0.5) * block.shared_expert(x), "gated shared expert")


def test_qwen3_5_moe_block():
    """Qwen3.5-MoE (v5 only): its router's top-k weights always sum to 1 (in
    the logits' dtype), the block adds the sigmoid-gated shared expert;
    its checkpoints keep the experts fused; no per-expert layout."""
    m = model("qwen3_5_moe_text", "fused", seed=4)
    block = block_of(m, 0)
    assert type(block).__name__ == "Qwen3_5MoeSparseMoeBlock"
    x = torch.randn(1, 5, H)
    logits, weights, indices = block.gate(x.reshape(-1, H))
    close(weights.sum(-1), torch.ones(5), "renormalized top-k weights")
    probs = torch.softmax(logits.float(), -1)
    close(weights, probs.gather(1, indices) / probs.gather(1, indices).sum(-1, keepdim=True),
          "top-k weights")
    with torch.no_grad():
        routed = block.experts(x.reshape(-1, H), indices, weights)
        shared = torch.sigmoid(block.shared_expert_gate(x.reshape(-1, H))) * \
            block.shared_expert(x.reshape(-1, H))
        close(block(x).reshape(-1, H), routed + shared, "routed + gated shared expert")
    names = hm.checkpoint_state_dict(m)
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any(".experts.0." in k for k in names)
    with pytest.raises(ValueError, match="experts_layout 'fused' only"):
        config("qwen3_5_moe_text", "modules")


def test_v5_router_weight_dtypes():
    """In bf16, v5's Qwen3/Qwen2/OLMoE routers cast the top-k weights to the
    logits' dtype; Mixtral's leaves them in fp32 (and they sum to 1)."""
    x = torch.randn(6, H).bfloat16()
    for family in SOFTMAX_FAMILIES:
        gate = block_of(model(family, "fused")).gate.bfloat16()
        logits, weights, _ = gate(x)
        assert logits.dtype == torch.bfloat16
        if family == "mixtral":
            assert weights.dtype == torch.float32
            close(weights.sum(-1), torch.ones(6), "Mixtral's renormalized weights")
        else:
            assert weights.dtype == torch.bfloat16, family


def v3_reference(s, bias, n_group, topk_group, k, norm, scale):
    """DeepSeek-V3's choice from the formulas: groups scored by the sum of
    their two best biased scores, the topk_group best kept, the k best
    biased scores among them chosen; weights the unbiased scores,
    renormalized, times scale. -> {expert: weight}."""
    biased = [a + b for a, b in zip(s, bias)]
    size = len(s) // n_group
    groups = top([sum(sorted(biased[g * size:(g + 1) * size])[-2:]) for g in range(n_group)],
                 topk_group)
    kept = [e for g in groups for e in range(g * size, (g + 1) * size)]
    chosen = [kept[j] for j in top([biased[e] for e in kept], k)]
    total = sum(s[e] for e in chosen) if norm else 1.0
    return {e: s[e] / total * scale for e in chosen}


def crafted_router(family, layout, scores, **extra):
    """(model, its first MoE block, x): H = 8, the block's router weight the
    identity, so that x's router logits are logit(scores) (DeepSeek-V3) or
    the given values (DeepSeek-V2)."""
    m = model(family, layout, hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
              **extra)
    block = block_of(m)
    with torch.no_grad():
        block.gate.weight.copy_(torch.eye(8))
    x = torch.tensor(scores, dtype=torch.float32)
    return m, block, (torch.logit(x) if family == "deepseek_v3" else x)


def route(block, x):
    """{expert: weight} per token, from the router's output in either form."""
    out = block.gate(x)
    indices, weights = (out[2], out[1]) if len(out) == 3 else out
    return [dict(zip(i.tolist(), w.tolist())) for i, w in zip(indices, weights)]


# Expert pairs (0,1) (2,3) (4,5) (6,7) are the 4 groups. Token 0: expert 0
# scores best, but its group does not: without bias {2, 3} are chosen; the
# bias lifts expert 4 past 3 (and its group past group 0) and {2, 4} are
# chosen, weighted by their unbiased scores. Token 1: without bias {1, 7};
# the bias lifts group 2 past group 0, whose expert 1 scores best: {6, 7}.
V3_SCORES = [[0.90, 0.10, 0.85, 0.80, 0.60, 0.55, 0.20, 0.15],
             [0.30, 0.95, 0.20, 0.10, 0.40, 0.45, 0.90, 0.92]]
V3_BIAS = [0.0, 0.0, 0.0, 0.0, 0.32, 0.28, 0.0, 0.0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_deepseek_v3_group_limited_routing(layout):
    m, block, x = crafted_router("deepseek_v3", layout, V3_SCORES, routed_scaling_factor=2.5,
                              norm_topk_prob=True)
    no_bias = route(block, x)
    assert [sorted(t) for t in no_bias] == [[2, 3], [1, 7]]
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(torch.tensor(V3_BIAS))
    got = route(block, x)
    assert [sorted(t) for t in got] == [[2, 4], [6, 7]]
    for t, s in enumerate(V3_SCORES):
        want = v3_reference(s, V3_BIAS, 4, 2, 2, True, 2.5)
        assert set(got[t]) == set(want)
        for e in want:
            assert math.isclose(got[t][e], want[e], rel_tol=1e-6), (t, e)
    assert math.isclose(got[0][4], 0.60 / (0.60 + 0.85) * 2.5, rel_tol=1e-6)  # unbiased
    # The block: routed experts' weighted sum plus the shared experts.
    state = {k.replace("model.layers.1.mlp.", ""): v for k, v in
             hm.checkpoint_state_dict(m).items()}
    hidden = x.view(2, 1, 8)
    want = torch.stack([sum(w * expert_fn(state, f"experts.{e}")(x[t].double())
                            for e, w in got[t].items()) for t in range(2)])
    want = want + expert_fn(state, "shared_experts")(x.double())
    close(block(hidden).view(2, 8), want, "DeepSeek-V3 block")


def test_deepseek_v3_v4_and_v5_differ_on_negative_biased_scores():
    """transformers v4 sets the groups not kept to 0.0 before the top-k, v5
    (later 5.x) to -inf: with one kept group (topk_group 1) whose second
    expert's biased score is below 0, v4 picks an expert of another group
    (at 0.0), v5 the kept group's two."""
    scores = [[0.95, 0.6, 0.4, 0.3, 0.3, 0.2, 0.1, 0.1]]
    bias = [0.0, -0.7, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # group 0 kept, expert 1 at -0.1
    chosen = {}
    for layout in LAYOUTS:
        _, block, x = crafted_router("deepseek_v3", layout, scores, topk_group=1)
        with torch.no_grad():
            block.gate.e_score_correction_bias.copy_(torch.tensor(bias))
        chosen[layout] = set(route(block, x)[0])
    assert chosen["fused"] == {0, 1}
    assert 0 in chosen["modules"] and 1 not in chosen["modules"]


# Logits; groups (0,1) (2,3) (4,5) (6,7) scored by their best: groups 0 and 2
# kept, so the top 3 are {0, 4, 5}; greedily {0, 4, 2}.
V2_LOGITS = [[3.0, -5.0, 2.0, 1.9, 2.5, -4.0, -1.0, -1.5]]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_routing(layout, method):
    """Softmax over all experts in fp32; greedy top-k, or top-k among the
    topk_group groups with the best single score; weights the softmax
    probabilities times routed_scaling_factor, not renormalized."""
    _, block, x = crafted_router("deepseek_v2", layout, V2_LOGITS, num_experts_per_tok=3,
                              topk_method=method, routed_scaling_factor=1.5)
    got = route(block, x)[0]
    p = torch.softmax(x[0].double(), dim=-1).tolist()
    if method == "greedy":
        chosen = top(p, 3)
    else:
        groups = top([max(p[2 * g:2 * g + 2]) for g in range(4)], 2)
        kept = [e for g in groups for e in (2 * g, 2 * g + 1)]
        chosen = [kept[j] for j in top([p[e] for e in kept], 3)]
    assert set(chosen) == ({0, 4, 2} if method == "greedy" else {0, 4, 5})
    assert set(got) == set(chosen)
    for e in chosen:
        assert math.isclose(got[e], 1.5 * p[e], rel_tol=1e-6)


def test_block_return_forms():
    """v4: the Qwen/Mixtral/OLMoE blocks return (hidden, router logits),
    DeepSeek's hidden; v5: every block returns hidden."""
    x = torch.randn(2, 3, H)
    for family in FAMILIES:
        for layout in LAYOUTS:
            out = block_of(model(family, layout))(x)
            if layout == "modules" and family in SOFTMAX_FAMILIES:
                assert isinstance(out, tuple) and out[1].shape == (6, E), (family, layout)
                out = out[0]
            assert torch.is_tensor(out) and out.shape == x.shape, (family, layout)


def test_mixtral_jitter_noise_only_in_training():
    block = block_of(model("mixtral", "fused", router_jitter_noise=0.5))
    x = torch.randn(1, 4, H)
    block.eval()
    assert torch.equal(block(x), block(x))
    block.train()
    assert not torch.equal(block(x), block(x))


# --- (c) state_dict names are the Hub's ---------------------------------------------------

def hub_names(family, cfg):
    """The tensor names of the family's checkpoints on the Hub (transformers
    v4 names), written out; DeepSeek's attention as the stand-in simplifies
    it (q/k/v/o_proj, not MLA's)."""
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    n_experts = getattr(cfg, cfg.experts_field)
    proj = ("w1", "w2", "w3") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {f"{p}self_attn.{x}_proj.weight" for x in "qkvo"}
        if family == "qwen2_moe":
            names |= {f"{p}self_attn.{x}_proj.bias" for x in "qkv"}
        if family == "glm4_moe":  # attention_bias on q/k/v, use_qk_norm per head
            names |= {f"{p}self_attn.{x}_proj.bias" for x in "qkv"}
        if family in ("qwen3_moe", "olmoe", "glm4_moe", "qwen3_next"):
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        block = p + ("block_sparse_moe." if family == "mixtral" else "mlp.")
        if i not in sparse_layers(family):
            names |= {f"{block}{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")}
            continue
        names |= {block + "gate.weight"}
        names |= {f"{block}experts.{e}.{x}.weight" for e in range(n_experts) for x in proj}
        shared = {"qwen2_moe": "shared_expert", "qwen3_next": "shared_expert",
                  "deepseek_v2": "shared_experts",
                  "deepseek_v3": "shared_experts", "glm4_moe": "shared_experts"}.get(family)
        if shared:
            names |= {f"{block}{shared}.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")}
        if family in SHARED_GATED:
            names |= {block + "shared_expert_gate.weight"}
        if family in V3_ROUTED:
            names |= {block + "gate.e_score_correction_bias"}
    return names


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_names_are_the_hubs(family):
    """The modules layout's state_dict has the Hub checkpoint's names; so
    does checkpoint_state_dict in both layouts."""
    cfg = config(family)
    want = hub_names(family, cfg)
    assert set(model(family, "modules").state_dict()) == want
    for layout in LAYOUTS:
        assert set(hm.checkpoint_state_dict(model(family, layout))) == want, layout


def test_hub_names_and_shapes():
    """Examples, with shapes [out, in]."""
    state = hm.checkpoint_state_dict(model("qwen2_moe"))
    assert state["model.layers.0.mlp.experts.3.gate_proj.weight"].shape == (I, H)
    assert state["model.layers.0.mlp.experts.3.down_proj.weight"].shape == (H, I)
    assert state["model.layers.0.mlp.gate.weight"].shape == (E, H)
    assert state["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, H)
    assert state["model.layers.0.mlp.shared_expert.up_proj.weight"].shape == (24, H)
    assert state["model.layers.1.mlp.up_proj.weight"].shape == (48, H)  # mlp_only_layers
    for layout in LAYOUTS:
        state = hm.checkpoint_state_dict(model("mixtral", layout))
        assert state["model.layers.1.block_sparse_moe.experts.0.w1.weight"].shape == (I, H)
        assert state["model.layers.1.block_sparse_moe.experts.0.w2.weight"].shape == (H, I)
        state = hm.checkpoint_state_dict(model("deepseek_v3", layout, first_k_dense_replace=0))
        assert state["model.layers.0.mlp.gate.e_score_correction_bias"].shape == (E,)
        assert state["model.layers.0.mlp.shared_experts.gate_proj.weight"].shape == (I, H)
    state = model("olmoe").state_dict()
    assert state["model.layers.0.self_attn.q_norm.weight"].shape == (H,)
    assert state["model.layers.0.self_attn.k_norm.weight"].shape == (H // 4 * 2,)
    assert model("qwen3_moe").state_dict()["model.layers.0.self_attn.q_norm.weight"].shape == \
        (H // 4,)


def test_v5_module_tree():
    """v5 names: fused experts' parameters, routers, Mixtral's mlp, DeepseekV2Moe."""
    for family in FAMILIES:
        m = model(family, "fused")
        i = sparse_layers(family)[0]
        state = m.state_dict()
        assert state[f"model.layers.{i}.mlp.experts.gate_up_proj"].shape == (E, 2 * I, H)
        assert state[f"model.layers.{i}.mlp.experts.down_proj"].shape == (E, H, I)
        assert state[f"model.layers.{i}.mlp.gate.weight"].shape == (E, H)
        block = block_of(m)
        prefix = {"qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral",
                  "olmoe": "Olmoe", "deepseek_v2": "DeepseekV2", "deepseek_v3": "DeepseekV3",
                  "glm4_moe": "Glm4Moe", "qwen3_next": "Qwen3Next"}
        assert type(block.experts).__name__ == prefix[family] + "Experts"
        router = {"deepseek_v3": "DeepseekV3TopkRouter", "deepseek_v2": "DeepseekV2TopkRouter",
                  "glm4_moe": "Glm4MoeTopkRouter"}
        assert type(block.gate).__name__ == router.get(family, prefix[family] + "TopKRouter")
    assert type(block_of(model("deepseek_v2", "fused"))).__name__ == "DeepseekV2Moe"
    assert type(block_of(model("deepseek_v2"))).__name__ == "DeepseekV2MoE"
    assert type(block_of(model("deepseek_v2")).gate).__name__ == "DeepseekV2MoEGate"
    assert type(block_of(model("mixtral")).experts[0]).__name__ == "MixtralBlockSparseTop2MLP"


# --- (d) checkpoint conversion ----------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoints_fuse_and_unfuse(family):
    """load_checkpoint_state_dict fills the fused layout from v4 names:
    gate_up_proj[e] = cat(gate, up), down_proj[e] = down of expert e;
    checkpoint_state_dict gives them back, and a modules model filled from
    the fused one's checkpoint equals the first."""
    mod, fused, again = model(family, seed=1), model(family, "fused", seed=2), model(family, seed=3)
    hm.load_checkpoint_state_dict(fused, hm.checkpoint_state_dict(mod))
    g, u, d = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for i in sparse_layers(family):
        a, b = block_of(mod, i), block_of(fused, i)
        assert torch.equal(a.gate.weight, b.gate.weight)
        for e in range(E):
            ex = a.experts[e]
            assert torch.equal(b.experts.gate_up_proj[e],
                               torch.cat((getattr(ex, g).weight, getattr(ex, u).weight)))
            assert torch.equal(b.experts.down_proj[e], getattr(ex, d).weight)
    hm.load_checkpoint_state_dict(again, hm.checkpoint_state_dict(fused))
    want, got = mod.state_dict(), again.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_checkpoint_errors():
    m = model("qwen3_moe", "fused")
    state = hm.checkpoint_state_dict(model("qwen3_moe"))
    missing = {k: v for k, v in state.items() if "experts.5.up_proj" not in k}
    with pytest.raises(ValueError, match="missing .*experts.5.up_proj"):
        hm.load_checkpoint_state_dict(m, missing)
    with pytest.raises(ValueError, match="unexpected .*extra"):
        hm.load_checkpoint_state_dict(m, {**state, "extra.weight": torch.zeros(1)})
    bad = {**state, "model.layers.1.mlp.experts.0.down_proj.weight": torch.zeros(I, H)}
    with pytest.raises(ValueError, match="experts.0.down_proj.weight' has shape"):
        hm.load_checkpoint_state_dict(m, bad)
    with pytest.raises(ValueError, match="does not fit"):
        hm.load_checkpoint_state_dict(model("qwen3_moe"), hm.checkpoint_state_dict(model("olmoe")))


def test_tied_embeddings():
    """tie_word_embeddings: lm_head is the embedding, checkpoints leave it
    out (a tied lm_head.weight in one is ignored), it stays tied."""
    for layout in LAYOUTS:
        m = model("mixtral", layout, tie_word_embeddings=True)
        assert m.lm_head.weight is m.model.embed_tokens.weight
        state = hm.checkpoint_state_dict(model("mixtral", seed=9, tie_word_embeddings=True))
        assert "lm_head.weight" not in state
        hm.load_checkpoint_state_dict(m, {**state, "lm_head.weight": torch.zeros(64, H)})
        assert m.lm_head.weight is m.model.embed_tokens.weight
        assert torch.equal(m.lm_head.weight, state["model.embed_tokens.weight"])


# --- configs, registry, initialization, layers, loss --------------------------------------

def test_config_defaults_are_transformers():
    c = hm.Qwen3MoeConfig()
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob,
            c.mlp_only_layers, c.decoder_sparse_step) == (128, 8, 768, False, [], 1)
    c = hm.Qwen2MoeConfig()
    assert (c.num_experts, c.num_experts_per_tok, c.shared_expert_intermediate_size,
            c.moe_intermediate_size) == (60, 4, 5632, 1408)
    c = hm.MixtralConfig()
    assert (c.num_local_experts, c.num_experts_per_tok, c.intermediate_size,
            c.router_jitter_noise, c.rms_norm_eps) == (8, 2, 14336, 0.0, 1e-5)
    c = hm.DeepseekV3Config()
    assert (c.n_routed_experts, c.n_shared_experts, c.n_group, c.topk_group,
            c.routed_scaling_factor, c.norm_topk_prob, c.first_k_dense_replace,
            c.num_experts_per_tok) == (256, 1, 8, 4, 2.5, True, 3, 8)
    assert c.num_local_experts == 256  # attribute_map
    c = hm.DeepseekV2Config()
    assert (c.topk_method, c.n_shared_experts, c.n_routed_experts, c.routed_scaling_factor,
            c.num_key_value_heads, c.num_experts) == ("greedy", 2, 64, 1.0, 32, 64)
    c = hm.Qwen3NextConfig()
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
            c.shared_expert_intermediate_size, c.norm_topk_prob, c.head_dim,
            c.partial_rotary_factor, c.mlp_only_layers) == (512, 10, 512, 512, True, 256, 0.25, [])
    c = hm.Glm4MoeConfig()
    assert (c.n_routed_experts, c.n_shared_experts, c.n_group, c.topk_group,
            c.routed_scaling_factor, c.norm_topk_prob, c.first_k_dense_replace,
            c.num_experts_per_tok, c.moe_intermediate_size, c.partial_rotary_factor,
            c.use_qk_norm, c.attention_bias) == (128, 1, 1, 1, 1.0, True, 1, 8, 1408, 0.5,
                                                 False, False)
    c = hm.OlmoeConfig()
    assert (c.num_experts, c.num_experts_per_tok, c.router_aux_loss_coef, c.num_local_experts,
            c.norm_topk_prob) == (64, 8, 0.01, 64, False)
    c = hm.Qwen3_5MoeTextConfig()
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
            c.shared_expert_intermediate_size, c.head_dim, c.hidden_size,
            c.num_hidden_layers, c.vocab_size) == (256, 8, 512, 512, 256, 2048, 40, 248320)
    assert not hasattr(c, "norm_topk_prob")  # its router always renormalizes
    for cls in hm.CONFIGS.values():
        c = cls()
        assert c.architectures == [c.architecture] and c.experts_layout == cls.layouts[0]
        assert c.tie_word_embeddings is False and c.hidden_act == "silu"
    with pytest.raises(AttributeError):
        hm.MixtralConfig().no_such_field
    with pytest.raises(ValueError, match="experts_layout"):
        hm.MixtralConfig(experts_layout="grouped")


def test_config_json_round_trip(tmp_path):
    c = config("deepseek_v3", "fused", some_hub_field=[1, 2])
    c.save_pretrained(tmp_path / "ckpt")
    text = (tmp_path / "ckpt/config.json").read_text()
    d = json.loads(text)
    assert d["model_type"] == "deepseek_v3" and d["architectures"] == ["DeepseekV3ForCausalLM"]
    assert d["experts_layout"] == "fused" and d["some_hub_field"] == [1, 2]
    assert text == json.dumps(d, indent=2, sort_keys=True) + "\n"
    for back in (hm.config_from_pretrained(tmp_path / "ckpt"),
                 hm.DeepseekV3Config.from_pretrained(tmp_path / "ckpt"),
                 hm.config_from_dict(c.to_dict())):
        assert type(back) is hm.DeepseekV3Config and back.to_dict() == c.to_dict()
    with pytest.raises(ValueError, match="no stand-in for model_type 'llama'"):
        hm.config_from_dict({"model_type": "llama"})


def test_registry():
    assert set(hm.MODELS) == {"Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
                              "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                              "OlmoeForCausalLM", "Glm4MoeForCausalLM", "Qwen3NextForCausalLM",
                              "Qwen3_5MoeForCausalLM"}
    for family in FAMILIES:
        cfg = config(family)
        m = hm.model_from_config(cfg.to_dict())
        assert type(m) is hm.MODELS[cfg.architectures[0]] and m.config.model_type == family
        assert type(type(m).from_config(cfg)) is type(m)
    with pytest.raises(ValueError, match="no stand-in for architecture"):
        hm.model_from_config(config("qwen3_moe", architectures=["Qwen3MoeForTokenClassification"]))


def test_initialization():
    """normal(0, initializer_range) weights, one norms, zero biases and
    e_score_correction_bias, the padding row zero; seeded: the same seed the
    same weights, another seed others; seed None: the global generator."""
    a = hm.checkpoint_state_dict(model("olmoe", seed=1))
    assert all(torch.equal(v, hm.checkpoint_state_dict(model("olmoe", seed=1))[k])
               for k, v in a.items())
    other = hm.checkpoint_state_dict(model("olmoe", seed=2))
    assert not torch.equal(a["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert not a["model.embed_tokens.weight"][1].any()  # OLMoE's pad_token_id 1
    weights = torch.cat([v.flatten() for k, v in a.items()
                         if not k.endswith("norm.weight") and k != "model.embed_tokens.weight"])
    assert abs(weights.std().item() - 0.05) < 0.002 and abs(weights.mean().item()) < 0.002
    assert all((v == 1).all() for k, v in a.items() if k.endswith("norm.weight"))
    q2 = hm.checkpoint_state_dict(model("qwen2_moe"))
    assert not q2["model.layers.0.self_attn.q_proj.bias"].any()
    v3 = hm.checkpoint_state_dict(model("deepseek_v3"))
    assert not v3["model.layers.1.mlp.gate.e_score_correction_bias"].any()
    torch.manual_seed(4)
    b = hm.checkpoint_state_dict(model("mixtral", seed=None))
    torch.manual_seed(4)
    c = hm.checkpoint_state_dict(model("mixtral", "fused", seed=None))
    assert all(torch.equal(v, c[k]) for k, v in b.items())


def test_dense_layers():
    """Qwen2: mlp_only_layers; Qwen3: decoder_sparse_step; DeepSeek:
    first_k_dense_replace; dense layers are the family's MLP of
    intermediate_size."""
    kinds = {
        "qwen2_moe": (hm.Qwen2MoeMLP, hm.Qwen2MoeSparseMoeBlock),
        "qwen3_next": (hm.Qwen3NextMLP, hm.Qwen3NextSparseMoeBlock),
        "qwen3_moe": (hm.Qwen3MoeMLP, hm.Qwen3MoeSparseMoeBlock),
        "deepseek_v2": (hm.DeepseekV2MLP, hm.DeepseekV2MoE),
        "deepseek_v3": (hm.DeepseekV3MLP, hm.DeepseekV3MoE),
        "glm4_moe": (hm.Glm4MoeMLP, hm.Glm4MoeMoE),
    }
    for family, (dense, sparse) in kinds.items():
        for layout in LAYOUTS:
            m = model(family, layout)
            for i, layer in enumerate(m.model.layers):
                assert layer.ffn_name == "mlp"
                want = sparse if i in sparse_layers(family) else dense
                assert isinstance(layer.mlp, want), (family, layout, i)
                if want is dense:
                    assert type(layer.mlp) is dense and layer.mlp.intermediate_size == 48
    m = model("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=1, mlp_only_layers=[0, 3])
    assert [type(x.mlp).__name__ for x in m.model.layers] == \
        ["Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP"]


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_loss(family):
    """loss = cross entropy of logits[:, :-1] against labels[:, 1:], -100
    ignored, + router_aux_loss_coef * aux_loss when router logits are
    output; aux_loss = E * sum_e (fraction of tokens with e in their top k)
    * (mean probability of e), over all MoE layers' tokens."""
    m = model(family)
    ids = tokens()
    labels = ids.clone()
    labels[1, 2:5] = -100
    plain = m(ids, labels=labels)
    logits = plain.logits.double()
    keep = labels[:, 1:] != -100
    want = -torch.log_softmax(logits[:, :-1], -1).gather(-1, labels[:, 1:].clamp(min=0)
                                                         .unsqueeze(-1)).squeeze(-1)[keep].mean()
    close(plain.loss, want, "cross entropy")
    out = m(ids, labels=labels, output_router_logits=True)
    if family in DEEPSEEK_LIKE:
        assert out.router_logits is None and out.aux_loss is None
        close(out.loss, plain.loss, "loss without aux")
        return
    p = torch.softmax(torch.cat(out.router_logits).double(), -1)
    picks = torch.zeros_like(p).scatter_(1, p.topk(2, dim=-1).indices, 1.0)
    aux = E * (picks.mean(0) * p.mean(0)).sum()
    close(out.aux_loss, aux, "aux loss")
    close(out.loss, want + m.config.router_aux_loss_coef * aux, "loss with aux")
    assert m(ids).loss is None


def test_imports_only_torch_and_the_standard_library():
    # Every module of the package; imports within it (relative) aside.
    files = sorted(Path(hm.__file__).parent.glob("*.py"))
    assert len(files) > 1
    roots = set()
    for f in files:
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Import):
                roots |= {a.name.split(".")[0] for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.level == 0:
                roots.add(n.module.split(".")[0])
    assert roots - set(sys.stdlib_module_names) == {"torch"}
