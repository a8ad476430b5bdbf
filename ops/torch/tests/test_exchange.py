"""Dispatch and combine as ops of their own (moec_torch.Exchange): dispatch,
then plain PyTorch experts, then combine, against PyTorch autograd on the
whole layer (moec_torch.reference) and against the fused layer, gradients
included."""

import pytest
import torch

import moec_torch
from moec_torch import reference

from test_moe_ffn import FP32_TOL, config, inputs, rel_err

SPLIT_BF16_TOL = 4e-2


def plain_experts(expert_x, tokens_per_expert, w1, w2):
    """SwiGLU experts in plain PyTorch on rows grouped by global expert."""
    outs = []
    for e, rows in enumerate(expert_x.split(tokens_per_expert.tolist())):
        h = rows @ w1[e]
        inter = h.shape[1] // 2
        outs.append((torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ w2[e])
    return torch.cat(outs)


def run_split(ex, x, ids, weights, dy, w1, w2):
    """dispatch -> plain experts -> combine, forward and backward."""
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    w1 = w1.detach().clone().requires_grad_()
    w2 = w2.detach().clone().requires_grad_()
    expert_x, counts, handle = ex.dispatch(x, ids, weights)
    y = ex.combine(plain_experts(expert_x, counts, w1, w2), handle)
    y.backward(dy)
    return y, counts, {"dx": x.grad, "dtopk_weights": weights.grad, "dw1": w1.grad,
                       "dw2": w2.grad}


def run_reference(x, ids, weights, dy, w1, w2):
    xd = x.double().requires_grad_()
    wd = weights.double().requires_grad_()
    w1d = w1.detach().double().requires_grad_()
    w2d = w2.detach().double().requires_grad_()
    y = reference.moe_ffn(xd, ids, wd, w1d, w2d)
    y.backward(dy.double())
    return y, {"dx": xd.grad, "dtopk_weights": wd.grad, "dw1": w1d.grad, "dw2": w2d.grad}


@pytest.mark.parametrize("dtype,avoid", [("fp32", ()), ("bf16", ()), ("fp32", (1, 2))])
def test_dispatch_experts_combine_matches_autograd_and_the_fused_layer(dtype, avoid):
    torch.manual_seed(0)
    cfg = config(dtype=dtype)
    layer = moec_torch.MoeFFN(cfg, ranks=2, threads=2)
    ex = moec_torch.Exchange(cfg, ranks=2, threads=2)
    x, ids, weights, dy = inputs(layer, 5, avoid=avoid)
    y, counts, grads = run_split(ex, x, ids, weights, dy, layer.w1, layer.w2)
    want_y, want = run_reference(x, ids, weights, dy, layer.w1, layer.w2)

    # tokens_per_expert: every expert's (token, k) rows, zero for unused ones.
    assert counts.dtype == torch.int64 and counts.shape == (layer.experts,)
    assert counts.tolist() == torch.bincount(ids.flatten(), minlength=layer.experts).tolist()
    for e in avoid:
        assert counts[e] == 0
    # In bf16 the experts between dispatch and combine are PyTorch's own bf16
    # ops, which round every intermediate (h, silu, the gate product) to
    # bf16: their error against float64 reaches 3.2e-2 on some BLAS builds.
    tol = SPLIT_BF16_TOL if dtype == "bf16" else FP32_TOL
    errors = {"y": rel_err(y, want_y), **{k: rel_err(grads[k], want[k]) for k in grads}}
    assert all(v < tol for v in errors.values()), errors
    assert y.dtype == x.dtype and grads["dx"].dtype == x.dtype

    # The fused layer on the same inputs.
    xf = x.clone().requires_grad_()
    wf = weights.clone().requires_grad_()
    yf = layer(xf, ids, wf)
    yf.backward(dy)
    fused = {"y": rel_err(y, yf.double()), "dx": rel_err(grads["dx"], xf.grad.double()),
             "dtopk_weights": rel_err(grads["dtopk_weights"], wf.grad.double()),
             "dw1": rel_err(grads["dw1"], layer.w1.grad.double()),
             "dw2": rel_err(grads["dw2"], layer.w2.grad.double())}
    assert all(v < tol for v in fused.values()), fused


def test_expert_rows_are_grouped_by_expert_in_dispatch_order():
    torch.manual_seed(0)
    ex = moec_torch.Exchange(config(), ranks=2, threads=2)
    x, ids, weights, _ = inputs(ex_layer_shape(ex), 2)
    expert_x, counts, _ = ex.dispatch(x, ids, weights)
    # Expert g's rows: its (token, k) rows by source rank, token, k.
    want = []
    for g in range(ex.experts):
        for r in range(ex.ranks):
            tokens = (ids[r] == g).any(dim=1).nonzero().flatten()
            want.append(x[r, tokens])
    assert torch.equal(expert_x, torch.cat(want))
    assert counts.sum().item() == expert_x.shape[0]


class ex_layer_shape:
    """What inputs() needs of a layer, from an Exchange."""

    def __init__(self, ex):
        self.ranks, self.tokens, self.hidden = ex.ranks, ex.tokens, ex.hidden
        self.experts, self.top_k = ex.experts, ex.top_k
        self.dtype = ex.dtype


def test_interleaved_dispatches_keep_their_own_routing():
    torch.manual_seed(0)
    layer = moec_torch.MoeFFN(config(), ranks=2, threads=2)
    ex = moec_torch.Exchange(config(), ranks=2, threads=2)
    a = inputs(layer, 7)
    b = inputs(layer, 8, tokens=64)
    xa, xb = a[0].clone().requires_grad_(), b[0].clone().requires_grad_()
    ex_a, counts_a, ha = ex.dispatch(xa, a[1], a[2])
    ex_b, counts_b, hb = ex.dispatch(xb, b[1], b[2])
    ya = ex.combine(plain_experts(ex_a, counts_a, layer.w1, layer.w2), ha)
    yb = ex.combine(plain_experts(ex_b, counts_b, layer.w1, layer.w2), hb)
    (ya * a[3]).sum().backward()
    (yb * b[3]).sum().backward()
    for (x, ids, weights, dy), y, xg in ((a, ya, xa), (b, yb, xb)):
        want_y, want = run_reference(x, ids, weights, dy, layer.w1, layer.w2)
        assert rel_err(y, want_y) < FP32_TOL and rel_err(xg.grad, want["dx"]) < FP32_TOL


def test_exchange_errors():
    ex = moec_torch.Exchange(config(), ranks=2, threads=2)
    other = moec_torch.Exchange(config(), ranks=2, threads=2)
    x, ids, weights, _ = inputs(ex_layer_shape(ex), 0)
    expert_x, counts, handle = ex.dispatch(x, ids, weights)
    with pytest.raises(RuntimeError, match=r"'expert_y' has shape \[3, 64\]; expected \[512, 64\]"):
        ex.combine(expert_x[:3], handle)
    with pytest.raises(ValueError, match="another exchange's"):
        other.combine(expert_x, handle)
    bad = ids.clone()
    bad[1, 5, 0] = 99
    with pytest.raises(RuntimeError, match="rank 1: topk_ids\\[5\\]\\[0\\] = 99 is not an expert"):
        ex.dispatch(x, bad, weights)
    with pytest.raises(RuntimeError, match="'x' has shape"):
        ex.dispatch(x[:, :, :32], ids, weights)
