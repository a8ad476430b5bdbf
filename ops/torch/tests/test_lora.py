"""LoRA adapters on the experts (frozen base weights), against PyTorch
autograd on PEFT's formula (moec_torch.reference with `lora`): outputs and
adapter gradients, no gradient for the base weights, merging, and a toy
fine-tune that lowers the loss."""

import pytest
import torch

import moec_torch
from moec_torch import reference

from test_moe_ffn import BF16_TOL, FP32_TOL, config, inputs, rel_err


def randomize_adapters(layer, seed):
    """Nonzero B (a fresh layer's B is zero, which would hide B's role)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.adapters():
            p.copy_(((torch.rand(p.shape, generator=g) * 2 - 1) * 0.5).to(p.dtype))


def reference_step(layer, x, ids, weights, dy):
    """y, dx, dtopk_weights and the adapters' gradients of plain autograd in
    float64 on the layer's values (its weights as it computes with them:
    dequantized where they are stored quantized, in either layout)."""
    x = x.double().requires_grad_()
    weights = weights.double().requires_grad_()
    adapters = [p.detach().double().requires_grad_() for p in layer.adapters()]
    lora = {name: tuple(adapters[2 * i:2 * i + 2]) for i, name in enumerate(layer.lora_targets)}
    w1, w2 = (w.detach().double() for w in layer.dequantized_weights())
    if layer.weights_transposed:  # [E, 2I, H], [E, H, I]
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    y = reference.moe_ffn(x, ids, weights, w1, w2, lora or None, layer.lora_scaling or 1.0)
    y.backward(dy.double())
    return y.detach(), x.grad, weights.grad, [a.grad for a in adapters]


def check_step(layer, seed, tol):
    """One forward + backward of `layer` against reference_step: y, dx,
    d topk_weights and every adapter's gradient (in its parameter's dtype)
    within `tol`; no gradient for the base weights. Returns (x, ids,
    weights, y) and the reference's y."""
    x, ids, weights, dy = inputs(layer, seed=seed)
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    y = layer(x, ids, weights)
    y.backward(dy)
    want_y, want_dx, want_dw, want_adapters = reference_step(layer, x.detach(), ids,
                                                             weights.detach(), dy)
    assert rel_err(y, want_y) < tol
    assert rel_err(x.grad, want_dx) < tol
    assert rel_err(weights.grad, want_dw) < tol
    names = [f"{t}_lora_{m}" for t in layer.lora_targets for m in "AB"]
    for p, want, name in zip(layer.adapters(), want_adapters, names):
        assert p.grad is not None and p.grad.dtype == p.dtype, name
        assert rel_err(p.grad, want) < tol, name
    assert layer.w1.grad is None and layer.w2.grad is None
    return (x.detach(), ids, weights.detach(), y.detach()), want_y


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("targets", [("w1", "w2"), ("w1",), ("w2",)])
@pytest.mark.parametrize("transposed", [False, True])
def test_lora_matches_autograd(dtype, targets, transposed):
    """transposed: the base weights stored w1 [E, 2I, H], w2 [E, H, I]
    (weights_transposed=True, Hugging Face's fused layout)."""
    torch.manual_seed(3)
    layer = moec_torch.MoeFFN(config(dtype=dtype), ranks=2, threads=2, lora_rank=4,
                              lora_alpha=8, lora_targets=targets,
                              weights_transposed=transposed)
    h, i = layer.hidden, layer.inter
    assert layer.w1.shape[1:] == ((2 * i, h) if transposed else (h, 2 * i))
    assert layer.lora_scaling == 2.0 and layer.frozen
    assert not layer.w1.requires_grad and not layer.w2.requires_grad
    assert [n for n, _ in layer.named_parameters() if "lora" in n] == \
        [f"{t}_lora_{m}" for t in targets for m in "AB"]
    randomize_adapters(layer, seed=1)
    tol = BF16_TOL if dtype == "bf16" else FP32_TOL
    (x, ids, weights, y), want_y = check_step(layer, 2, tol)

    # The adapters change the output (the test above would pass with them
    # ignored only if they did nothing).
    base = reference.moe_ffn(x.detach().double(), ids, weights.detach().double(),
                             *(w.double().transpose(1, 2) if transposed else w.double()
                               for w in (layer.w1, layer.w2)))
    assert rel_err(base, want_y) > 10 * tol

    # Bitwise reproducible.
    for p in layer.adapters():
        p.grad = None
    y2 = layer(x.detach(), ids, weights.detach())
    assert torch.equal(y2, y.detach())


@pytest.mark.parametrize("target", ["cpu", "h100"])
def test_adapter_sums_are_written_over_the_base_outputs(target):
    """Compiled for the cpu target, each adapter's second product is summed
    inside its base's GMM (moe-fuse-low-rank): the workspace holds no base
    output of its own. Compiled for a target with a shared cache (h100, run
    here on the cpu backend), the products that add an adapter's sums onto
    the base's output (up_lora_b, down_lora_b; backward down_lora_dz,
    up_lora_dx) write them over it, in place: the workspace holds one tensor
    for the two. Either way a second backward of the same forward
    (retain_graph), and a new step, give the same bits (the backward's slots
    placed in the forward's dead ones do not take the memory the sums were
    written over, which holds Y for the backward)."""
    torch.manual_seed(3)
    layer = moec_torch.MoeFFN(config(), ranks=2, threads=2, lora_rank=4, lora_alpha=8,
                              target=target)
    randomize_adapters(layer, seed=6)
    x, ids, weights, dy = inputs(layer, seed=8)

    def step(retain=False):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y = layer(xi, ids, weights)
        y.backward(dy, retain_graph=retain)
        return y, xi, [p.grad.clone() for p in layer.adapters()]

    y, xi, first = step(retain=True)
    dx = xi.grad.clone()
    xi.grad = None
    for p in layer.adapters():
        p.grad = None
    y.backward(dy)
    assert torch.equal(xi.grad, dx)
    assert all(torch.equal(p.grad, g) for p, g in zip(layer.adapters(), first))
    y2, xi2, again = step()
    assert torch.equal(y2, y.detach()) and torch.equal(xi2.grad, dx)
    assert all(torch.equal(a, b) for a, b in zip(again, first))
    table = layer.workspace()
    for out, base in (("up_proj_y", "up_proj_base_y"), ("down_proj_y", "down_proj_base_y"),
                      ("act_grad_y", "act_grad_base_y"), ("gate_grad_y", "gate_grad_base_y")):
        line = next(row for row in table.splitlines() if row.split()[1:2] == [out])
        if target == "cpu":
            assert "written over" not in line and base not in table, line
        else:
            assert f"written over {base}" in line, line
    # What the table itemizes is what the layer holds: no bytes for the
    # tensors written over others.
    owned = [row.split() for row in table.splitlines()
             if "no memory of its own" not in row and row.split()[:1] in (["forward"], ["backward"])]
    mib = sum(float(row[2]) for row in owned)
    assert abs(mib * 2**20 - layer.info()["workspace_bytes"]) < 0.05 * 2**20 * len(owned)


def test_transposed_weights_compute_the_same_layer():
    """weights_transposed=True draws the same weights, transposed, and gives
    the same outputs, gradients and merged weights as the [E, H, 2I] layout
    (within fp32 rounding: the GEMMs read their operands in another order);
    a checkpoint of one layout is refused by the other; trained base
    weights and tp > 1 are refused."""
    torch.manual_seed(7)
    plain = moec_torch.MoeFFN(config(), ranks=2, threads=2, lora_rank=4, lora_alpha=8)
    torch.manual_seed(7)
    swapped = moec_torch.MoeFFN(config(), ranks=2, threads=2, lora_rank=4, lora_alpha=8,
                                weights_transposed=True)
    assert swapped.info()["weights_transposed"] and not plain.info()["weights_transposed"]
    assert torch.equal(swapped.w1, plain.w1.transpose(1, 2))
    assert torch.equal(swapped.w2, plain.w2.transpose(1, 2))
    for a, b in zip(plain.projections(), swapped.projections()):
        assert torch.equal(a, b)
    randomize_adapters(plain, seed=4)
    randomize_adapters(swapped, seed=4)
    x, ids, weights, dy = inputs(plain, seed=5)
    ys = []
    for layer in (plain, swapped):
        xi = x.clone().requires_grad_()
        y = layer(xi, ids, weights)
        y.backward(dy)
        ys.append((y.detach(), xi.grad, [p.grad for p in layer.adapters()]))
    (y0, dx0, da0), (y1, dx1, da1) = ys
    assert rel_err(y1, y0.double()) < FP32_TOL and rel_err(dx1, dx0.double()) < FP32_TOL
    for a, b in zip(da1, da0):
        assert rel_err(a, b.double()) < FP32_TOL
    for a, b in zip(swapped.merged_weights(), plain.merged_weights()):
        assert torch.equal(a, b.transpose(1, 2))
    with pytest.raises(ValueError, match="weights_transposed"):
        plain.load_state_dict(swapped.state_dict())
    with pytest.raises(ValueError, match="frozen or LoRA layer"):
        moec_torch.MoeFFN(config(), ranks=2, weights_transposed=True)


def test_fresh_adapters_compute_the_base_layer_and_merge():
    torch.manual_seed(5)
    lora = moec_torch.MoeFFN(config(), ranks=2, threads=2, lora_rank=8, lora_alpha=16)
    torch.manual_seed(5)
    base = moec_torch.MoeFFN(config(), ranks=2, threads=2)
    assert torch.equal(lora.w1, base.w1) and torch.equal(lora.w2, base.w2)
    # PEFT's initialisation: A uniform in +-1/sqrt(fan_in), B zero.
    for name in ("w1", "w2"):
        a = getattr(lora, f"{name}_lora_A")
        assert a.abs().max() <= 1 / a.shape[1] ** 0.5 and a.abs().max() > 0.5 / a.shape[1] ** 0.5
        assert not getattr(lora, f"{name}_lora_B").any()
    x, ids, weights, _ = inputs(lora, seed=1)
    with torch.no_grad():
        assert torch.equal(lora(x, ids, weights), base(x, ids, weights))

    randomize_adapters(lora, seed=2)
    with torch.no_grad():
        y = lora(x, ids, weights)
        w1, w2 = lora.merged_weights()
        base.w1.copy_(w1)
        base.w2.copy_(w2)
        assert rel_err(base(x, ids, weights), y.double()) < FP32_TOL
        lora.merge_adapters()
        assert torch.equal(lora.w1, w1) and torch.equal(lora.w2, w2)
        assert not lora.w1_lora_B.any() and not lora.w2_lora_B.any()
        assert rel_err(lora(x, ids, weights), y.double()) < FP32_TOL


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_toy_fine_tune_lowers_the_loss(dtype):
    """Frozen base, LoRA only: fit a teacher layer whose weights differ from
    the base by a low-rank update."""
    torch.manual_seed(7)
    student = moec_torch.MoeFFN(config(dtype=dtype), ranks=2, threads=2, lora_rank=4,
                                lora_alpha=8)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        w1 = student.w1.float() + 0.3 * torch.bmm(torch.randn(4, 64, 2, generator=g),
                                                 torch.randn(4, 2, 64, generator=g)) / 8
        w2 = student.w2.float() + 0.3 * torch.bmm(torch.randn(4, 32, 2, generator=g),
                                                 torch.randn(4, 2, 64, generator=g)) / 8
    batches = [inputs(student, seed)[:3] for seed in range(4)]
    targets = [reference.moe_ffn(x.double(), ids, w.double(), w1.double(), w2.double())
               for x, ids, w in batches]
    opt = torch.optim.Adam(student.adapters(), lr=1e-2)
    frozen = (student.w1.clone(), student.w2.clone())

    def loss_of(batch, target):
        y = student(*batch)
        return ((y.double() - target) ** 2).mean()

    with torch.no_grad():
        start = sum(loss_of(b, t).item() for b, t in zip(batches, targets))
    for _ in range(15):
        for batch, target in zip(batches, targets):
            opt.zero_grad()
            loss_of(batch, target).backward()
            opt.step()
    with torch.no_grad():
        end = sum(loss_of(b, t).item() for b, t in zip(batches, targets))
    assert end < 0.5 * start, (start, end)
    assert torch.equal(student.w1, frozen[0]) and torch.equal(student.w2, frozen[1])


def test_lora_checks():
    with pytest.raises(ValueError, match="main_grad buffers with LoRA"):
        moec_torch.MoeFFN(config(), ranks=2, lora_rank=4, main_grad=True)
    with pytest.raises(ValueError, match="lora_targets must name"):
        moec_torch.MoeFFN(config(), ranks=2, lora_rank=4, lora_targets=("w3",))
    with pytest.raises(ValueError, match="not the config"):
        moec_torch.MoeFFN(config(lora_rank=4), ranks=2)
    with pytest.raises(ValueError, match="'lora_alpha' must be a positive finite number"):
        moec_torch.MoeFFN(config(), ranks=2, lora_rank=4, lora_alpha=-1)
    layer = moec_torch.MoeFFN(config(), ranks=2, threads=2, lora_rank=4, lora_targets=("w2",))
    x, ids, weights, _ = inputs(layer, seed=0)
    with pytest.raises(RuntimeError, match="takes 2 LoRA adapter tensors"):
        torch.ops.moec.forward(layer.layer, x, ids, weights, layer.w1, layer.w2, [])
    with pytest.raises(RuntimeError, match="lora_b2"):
        torch.ops.moec.forward(layer.layer, x, ids, weights, layer.w1, layer.w2,
                               [layer.w2_lora_A, layer.w2_lora_A])
