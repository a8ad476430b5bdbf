"""Expert tensor parallelism: MoeFFN(config, ep=P, tp=T) in one process
against PyTorch autograd in float64 on the whole experts, and against the
same layer with tp=1 (the same seed gives the same whole weights)."""

import pytest
import torch

import moec_torch
from moec_torch import quant, reference

from test_lora import check_step, randomize_adapters
from test_moe_ffn import config, inputs, rel_err, routing

# Awkward sizes: H not a multiple of 16, I/T small and odd.
HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 40, 12, 4, 2, 37


def layer(ep, tp, dtype="fp32", seed=0, **kw):
    torch.manual_seed(seed)
    cfg = config(experts=EXPERTS, top_k=TOP_K, hidden=HIDDEN, inter=INTER, tokens=TOKENS,
                 dtype=dtype, capacity_factor=8)
    return moec_torch.MoeFFN(cfg, ep=ep, tp=tp, threads=2, **kw)


def data(m, seed=3, hot=0):
    g = torch.Generator().manual_seed(seed)
    dtype = m.w1.dtype
    x = (torch.rand(m.ranks, TOKENS, HIDDEN, generator=g) * 2 - 1).to(dtype)
    dy = (torch.rand(m.ranks, TOKENS, HIDDEN, generator=g) * 2 - 1).to(dtype)
    ids, weights = routing(m.ranks, TOKENS, EXPERTS, TOP_K, seed, hot=hot)
    return x, ids, weights, dy


def step(m, x, ids, weights, dy):
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    y = m(x, ids, weights)
    y.backward(dy)
    return y.detach(), x.grad, weights.grad


def reference_step(m, x, ids, weights, dy, w1=None, w2=None):
    xd = x.detach().double().requires_grad_()
    wd = weights.detach().double().requires_grad_()
    w1 = (m.w1 if w1 is None else w1).detach().double().requires_grad_()
    w2 = (m.w2 if w2 is None else w2).detach().double().requires_grad_()
    y = reference.moe_ffn(xd, ids, wd, w1, w2)
    y.backward(dy.double())
    return y, xd.grad, wd.grad, w1.grad, w2.grad


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-5), ("bf16", 3e-2)])
@pytest.mark.parametrize("ep,tp", [(2, 2), (1, 2), (4, 1), (1, 4)])
def test_against_autograd(ep, tp, dtype, tol):
    m = layer(ep, tp, dtype)
    assert (m.ranks, m.tp, m.inter) == (ep, tp, INTER)
    assert m.w1.shape == (EXPERTS, HIDDEN, 2 * INTER) and m.w2.shape == (EXPERTS, INTER, HIDDEN)
    x, ids, weights, dy = data(m, hot=1)  # skewed: every first choice is expert 1
    y, dx, dtopk = step(m, x, ids, weights, dy)
    want = reference_step(m, x, ids, weights, dy)
    got = (y, dx, dtopk, m.w1.grad, m.w2.grad)
    errors = {name: rel_err(g, w) for name, g, w in
              zip(("y", "dx", "dtopk_weights", "dw1", "dw2"), got, want)}
    assert all(e <= tol for e in errors.values()), errors
    assert m.info()["ranks"] == ep * tp and m.info()["tp"] == tp


def test_same_weights_and_outputs_as_tp1():
    """The same seed draws the same whole weights at tp=1 and tp=2; the
    outputs agree to fp32 rounding (the sums run in other orders)."""
    one, two = layer(2, 1, seed=7), layer(2, 2, seed=7)
    assert torch.equal(one.w1, two.w1) and torch.equal(one.w2, two.w2)
    x, ids, weights, dy = data(one)
    a, b = step(one, x, ids, weights, dy), step(two, x, ids, weights, dy)
    for g, w in zip(a + (one.w1.grad, one.w2.grad), b + (two.w1.grad, two.w2.grad)):
        assert rel_err(g, w.double()) <= 1e-5


def test_threads_and_schedule_do_not_change_bits():
    """The TP partials are summed in TP order: the same bits for 1 or 2
    workers and for the op-by-op schedule."""
    runs = []
    for threads in (1, 2):
        torch.manual_seed(0)
        cfg = config(experts=EXPERTS, top_k=TOP_K, hidden=HIDDEN, inter=INTER, tokens=TOKENS,
                     capacity_factor=8)
        m = moec_torch.MoeFFN(cfg, ep=2, tp=2, threads=threads)
        x, ids, weights, dy = data(m)
        runs.append(step(m, x, ids, weights, dy) + (m.w1.grad, m.w2.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_main_grad_accumulates_whole_experts():
    m = layer(2, 2, main_grad=True)
    x, ids, weights, dy = data(m)
    for _ in range(2):
        step(m, x, ids, weights, dy)
    assert m.w1.grad is None and m.w1.grad_added_to_main_grad
    _, _, _, dw1, dw2 = reference_step(m, x, ids, weights, dy)
    assert rel_err(m.w1.main_grad, 2 * dw1) <= 1e-5
    assert rel_err(m.w2.main_grad, 2 * dw2) <= 1e-5


def test_frozen_gives_dx_only():
    m = layer(2, 2, frozen=True)
    x, ids, weights, dy = data(m)
    y, dx, dtopk = step(m, x, ids, weights, dy)
    want = reference_step(m, x, ids, weights, dy)
    assert m.w1.grad is None
    for g, w in zip((y, dx, dtopk), want):
        assert rel_err(g, w) <= 1e-5


def test_submitted_passes_match_blocking_ones():
    m = layer(2, 2)
    x, ids, weights, dy = data(m)
    y, dx, dtopk = step(m, x, ids, weights, dy)
    dw1, dw2 = m.w1.grad.clone(), m.w2.grad.clone()

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.handle = m.submit_forward(x, ids, weights)
            return ctx.handle.wait()

        @staticmethod
        def backward(ctx, g):
            grads = m.submit_backward(ctx.handle, g).wait()
            return grads.dx

    m.zero_grad()
    xs = x.clone().requires_grad_()
    out = Fn.apply(xs)
    out.backward(dy)
    assert torch.equal(out, y) and torch.equal(xs.grad, dx)
    handle = m.submit_forward(x, ids, weights)
    handle.wait()
    grads = m.submit_backward(handle, dy).wait()
    assert torch.equal(grads.dx, dx) and torch.equal(grads.dtopk_weights, dtopk)
    assert torch.equal(grads.dw1, dw1) and torch.equal(grads.dw2, dw2)


LORA_FORMS = {
    # name: (hidden, inter, MoeFFN options)
    "dense": (HIDDEN, INTER, {}),
    "transposed": (HIDDEN, INTER, {"weights_transposed": True}),
    "int4": (64, 256, {"weight_format": "int4_g64"}),
}


def lora_layer(ep, tp, form, targets, dtype="fp32"):
    """A LoRA layer of `form` with nonzero B (a fresh layer's B is zero)."""
    hidden, inter, options = LORA_FORMS[form]
    torch.manual_seed(0)
    cfg = config(experts=EXPERTS, top_k=TOP_K, hidden=hidden, inter=inter, tokens=TOKENS,
                 dtype=dtype, capacity_factor=8)
    m = moec_torch.MoeFFN(cfg, ep=ep, tp=tp, threads=2, lora_rank=4, lora_alpha=8,
                          lora_targets=targets, **options)
    randomize_adapters(m, seed=1)
    return m


@pytest.mark.parametrize("form", sorted(LORA_FORMS))
@pytest.mark.parametrize("targets", [("w1", "w2"), ("w1",), ("w2",)])
@pytest.mark.parametrize("ep,tp", [(2, 2), (1, 4)])
def test_lora_against_autograd(ep, tp, targets, form):
    """LoRA adapters with TP in one process: each TP rank takes its slice of
    w1's B and w2's A and all of w1's A and w2's B, whose gradients are the
    TP ranks' partial ones added; against autograd in float64 (PEFT's
    formula on the whole experts), and the same layer at tp=1."""
    m = lora_layer(ep, tp, form, targets)
    assert all(p.shape[0] == EXPERTS for p in m.adapters())
    (x, ids, weights, y), _ = check_step(m, seed=2, tol=1e-5)
    grads = [p.grad.clone() for p in m.adapters()]
    one = lora_layer(ep, 1, form, targets)
    for a, b in zip(one.adapters(), m.adapters()):
        assert torch.equal(a, b)
    (_, _, _, y1), _ = check_step(one, seed=2, tol=1e-5)
    assert rel_err(y, y1) <= 1e-5
    for g, g1 in zip(grads, (p.grad for p in one.adapters())):
        assert rel_err(g, g1) <= 1e-5


def test_lora_bf16_and_submitted_passes():
    """bf16 LoRA with TP against autograd; the handles' Gradients give the
    adapters' gradients of the blocking pass, bit for bit."""
    m = lora_layer(2, 2, "dense", ("w1", "w2"), dtype="bf16")
    (x, ids, weights, y), _ = check_step(m, seed=2, tol=3e-2)
    want = [p.grad.clone() for p in m.adapters()]
    dy = inputs(m, seed=2)[3]  # check_step's
    handle = m.submit_forward(x, ids, weights)
    assert torch.equal(handle.wait(), y)
    grads = m.submit_backward(handle, dy).wait()
    assert len(grads.adapters) == 4
    for g, w, p in zip(grads.adapters, want, m.adapters()):
        assert g.shape == p.shape and torch.equal(g, w)


def test_fp8_dispatch_with_tp():
    torch.manual_seed(0)
    cfg = config(experts=EXPERTS, top_k=TOP_K, hidden=256, inter=INTER, tokens=16,
                 dtype="bf16", capacity_factor=8)
    m = moec_torch.MoeFFN(cfg, ep=2, tp=2, threads=2, dispatch_dtype="fp8_e4m3")
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(2, 16, 256, generator=g) * 2 - 1).bfloat16()
    ids, weights = routing(2, 16, EXPERTS, TOP_K, 1)
    y = m(x, ids, weights)
    want = reference.moe_ffn(reference.fp8_round_rows(x).double(), ids, weights.double(),
                             m.w1.detach().double(), m.w2.detach().double())
    assert rel_err(y, want) <= 3e-2


def test_checkpoint_round_trip():
    m = layer(2, 2, seed=1)
    state = m.state_dict()
    assert state["_extra_state"]["layout"]["columns"] == [0, INTER]
    other = layer(2, 2, seed=2)
    other.load_state_dict(state)
    assert torch.equal(other.w1, m.w1) and torch.equal(other.w2, m.w2)
    # A TP rank's checkpoint (a slice of the columns) does not load as the
    # whole experts, and nothing is copied.
    shard = dict(state)
    shard["_extra_state"] = dict(state["_extra_state"], layout=dict(
        state["_extra_state"]["layout"], columns=[0, INTER // 2]))
    fresh = layer(2, 2, seed=3)
    before = fresh.w1.clone()
    with pytest.raises(ValueError, match=r"holds intermediate columns 0..5 of 12 \(a TP rank's\)"):
        fresh.load_state_dict(shard)
    assert torch.equal(fresh.w1, before)


# Weights stored transposed, quantized or not: sizes that hold FP8's 128 x
# 128 blocks and int4's groups in each TP rank's part of I.
FORMATS = ["fp8_block128", "int8", "int4_g32", "int4_g64_zp", "int4_g128", None]


def stored_layers(weight_format, dtype="fp32", hidden=256, inter=256, tokens=24,
                  pack_weights=False):
    """(the layer at ep 2, tp 2, the same at tp 1) on the same frozen
    weights stored transposed: a dense layer's, each 32 x 32 block of every
    expert's matrices scaled by one of 1..5 (so that a block's or a group's
    scale taken for another's shows), quantized to `weight_format` (None:
    bf16/fp32 as they are); the tp 2 one with `pack_weights`."""
    torch.manual_seed(5)
    cfg = config(experts=EXPERTS, top_k=TOP_K, hidden=hidden, inter=inter, tokens=tokens,
                 dtype=dtype, capacity_factor=8)
    dense = moec_torch.MoeFFN(cfg, ep=2, frozen=True, weights_transposed=True, threads=2)
    with torch.no_grad():
        for w in (dense.w1, dense.w2):
            r = torch.arange(w.shape[1]).div(32, rounding_mode="floor")
            c = torch.arange(w.shape[2]).div(32, rounding_mode="floor")
            w.mul_((1 + (r[:, None] * 3 + c[None, :]) % 5).to(w.dtype))
    state = (dense.quantize_weights(weight_format) if weight_format else dense).state_dict()
    layers = []
    for tp in (2, 1):
        m = moec_torch.MoeFFN(cfg, ep=2, tp=tp, threads=2, frozen=True, init_weights=False,
                              pack_weights=pack_weights and tp > 1,
                              **({"weight_format": weight_format} if weight_format else
                                 {"weights_transposed": True}))
        m.load_state_dict(state)
        layers.append(m)
    return layers


@pytest.mark.parametrize("weight_format", FORMATS)
def test_stored_parts_are_the_whole_experts_slices(weight_format):
    """Each TP rank's part of weights stored [out, in] (codes and scales),
    dequantized, is its gate and up rows of w1 and its columns of w2 of the
    whole experts' dequantized values, bit for bit."""
    m = stored_layers(weight_format)[0]
    T, L, I = m.tp, m.local_experts, m.inter
    scales = (m.w1_scale, m.w2_scale) if weight_format else ()
    w1t, w2t, st = moec_torch._to_tp_stored(weight_format, m.w1, m.w2, scales, L, T)
    whole1, whole2 = m.dequantized_weights()
    part1, part2 = (quant.dequantize(weight_format, w, s, m.dtype) if weight_format else w
                    for w, s in zip((w1t, w2t), st or (None, None)))
    n = I // T
    for e in range(m.w1.shape[0] // L):
        for t in range(T):
            k = (e * T + t) * L
            rows = list(range(t * n, (t + 1) * n)) + list(range(I + t * n, I + (t + 1) * n))
            assert torch.equal(part1[k:k + L], whole1[e * L:(e + 1) * L][:, rows])
            assert torch.equal(part2[k:k + L], whole2[e * L:(e + 1) * L, :, t * n:(t + 1) * n])


@pytest.mark.parametrize("weight_format", FORMATS)
def test_stored_weights_with_tp_against_autograd(weight_format):
    """A frozen layer on weights stored transposed (quantized or not) at
    tp=2 in one process: forward and backward against autograd in float64
    on the dequantized whole experts, and against the same weights at
    tp=1; with packed weights, whose TP ranks' parts are copied once while
    the weights do not change."""
    m, one = stored_layers(weight_format, pack_weights=True)
    x = (torch.rand(m.ranks, 24, m.hidden) * 2 - 1)
    dy = (torch.rand(m.ranks, 24, m.hidden) * 2 - 1)
    ids, weights = routing(m.ranks, 24, EXPERTS, TOP_K, 3)
    got = step(m, x, ids, weights, dy)
    w1, w2 = (w.transpose(1, 2) for w in m.dequantized_weights())
    want = reference_step(m, x, ids, weights, dy, w1, w2)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-5
    for g, w in zip(got, step(one, x, ids, weights, dy)):
        assert rel_err(g, w) < 1e-5
    # Packed weights: the same bits again, from the parts copied once.
    cached = m._stored_mesh()
    again = step(m, x, ids, weights, dy)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    assert m._stored_mesh() is cached
    with torch.no_grad():
        m.w2.mul_(1)  # an in-place write: the parts are made again
    step(m, x, ids, weights, dy)
    assert m._stored_mesh() is not cached


@pytest.mark.parametrize("weight_format", FORMATS)
def test_tp_parts_merge_into_the_whole_layer(weight_format):
    """The state dicts a TP rank per process saves of weights stored
    transposed (each EP rank's experts, each TP rank's part of their codes
    and scales, made here from the whole layer's) merge into the whole
    layer's (merge_state_dicts); a part of the wrong size, and a copy of
    int8's w2 row scales that differs between the TP ranks of an expert,
    are refused by name."""
    m = stored_layers(weight_format)[0]
    whole = m.state_dict()
    layout = whole["_extra_state"]["layout"]
    T, L, I = m.tp, m.local_experts, m.inter
    names = ["w1", "w2"] + (["w1_scale", "w2_scale"] if weight_format else [])
    shards = []
    for e in range(m.ranks):
        for t in range(T):
            part = {}
            for name in names:
                experts = whole[name][e * L:(e + 1) * L]
                stored, scales = (None, experts) if name.endswith("_scale") else (experts, None)
                got = quant.tp_part(weight_format, name[:2], t, T, stored, scales)
                part[name] = (got[1] if name.endswith("_scale") else got[0]).clone()
            part["_extra_state"] = {"format": whole["_extra_state"]["format"], "layout": dict(
                layout, first_expert=e * L, local_experts=L,
                columns=[t * I // T, (t + 1) * I // T])}
            shards.append(part)
    merged = moec_torch.merge_state_dicts(reversed(shards))
    for name in names:
        assert torch.equal(merged[name], whole[name]), name
    assert merged["_extra_state"]["layout"]["columns"] == [0, I]
    # A part of the wrong size (a row short) is refused by name.
    short = [dict(p) for p in shards]
    short[2]["w1"] = short[2]["w1"][:, :-1]
    with pytest.raises(ValueError, match=r"shard 2's 'w1' has shape \[2, 255, \d+\], not that "
                       r"of its layout's part"):
        moec_torch.merge_state_dicts(short)
    if weight_format == "int8":
        shards[1]["w2_scale"][0, 0] *= 2  # EP rank 0, TP rank 1: its copy of the row scales
        with pytest.raises(ValueError, match=r"'w2_scale' differs between the TP ranks of "
                           r"experts 0..1, which hold it whole"):
            moec_torch.merge_state_dicts(shards)


def test_refusals():
    # Each TP rank's part of I holds whole blocks (FP8) or groups (int4).
    cfg = config(experts=EXPERTS, hidden=256, inter=128)
    for f, unit in (("fp8_block128", "blocks of 128"), ("int4_g128", "groups of 128")):
        with pytest.raises(ValueError, match=rf"weight_format='{f}' with tensor parallelism: "
                           rf"each TP rank's part of intermediate_size \(128 / tp=2\) must "
                           rf"hold whole {unit} values"):
            moec_torch.MoeFFN(cfg, ep=2, tp=2, frozen=True, weight_format=f)
    with pytest.raises(ValueError, match="name the same thing"):
        moec_torch.MoeFFN(config(), ranks=2, ep=1)
    cfg = config(experts=EXPERTS, inter=10)
    with pytest.raises(RuntimeError, match="must be a multiple of 'tp'"):
        moec_torch.MoeFFN(cfg, ep=2, tp=4)
