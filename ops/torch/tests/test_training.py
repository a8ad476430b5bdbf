"""What training jobs need from the layer, against PyTorch autograd
(moec_torch.reference): fp32 main-grad accumulation across micro-batches,
and frozen expert weights (a backward without weight gradients)."""

import pytest
import torch

import moec_torch
from moec_torch import reference

from test_moe_ffn import BF16_TOL, FP32_TOL, config, inputs, rel_err


def micro_batch(layer, x, ids, weights, dy):
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    layer(x, ids, weights).backward(dy)
    return x.grad, weights.grad


def reference_weight_grads(layer, x, ids, weights, dy):
    """dw1, dw2 of plain autograd in float64 on the layer's values."""
    w1 = layer.w1.detach().double().requires_grad_()
    w2 = layer.w2.detach().double().requires_grad_()
    reference.moe_ffn(x.double(), ids, weights.double(), w1, w2).backward(dy.double())
    return w1.grad, w2.grad


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_main_grad_accumulates_micro_batches_in_fp32(dtype):
    torch.manual_seed(0)
    layer = moec_torch.MoeFFN(config(dtype=dtype), ranks=2, threads=2, main_grad=True)
    batches = [inputs(layer, seed) for seed in range(4)]
    for w in (layer.w1, layer.w2):
        assert w.main_grad.dtype == torch.float32 and w.main_grad.shape == w.shape
        assert not w.main_grad.any()

    # Each micro-batch alone, from zero: its fp32 weight gradients.
    alone = []
    for batch in batches:
        layer.zero_main_grad()
        micro_batch(layer, *batch)
        alone.append((layer.w1.main_grad.clone(), layer.w2.main_grad.clone()))

    # The four accumulated, as a training step does.
    layer.zero_main_grad()
    for batch in batches:
        micro_batch(layer, *batch)
    accumulated = (layer.w1.main_grad.clone(), layer.w2.main_grad.clone())
    assert layer.w1.grad is None and layer.w2.grad is None
    assert layer.w1.grad_added_to_main_grad and layer.w2.grad_added_to_main_grad

    for i, name in enumerate(("dw1", "dw2")):
        fp32_sum = sum(grads[i] for grads in alone)
        # Within fp32 rounding of the fp32 sum: the running sum is never
        # rounded to bf16 ...
        assert rel_err(accumulated[i], fp32_sum.double()) < 1e-5, name
        # ... which a bf16 running sum would be, far beyond that.
        if dtype == "bf16":
            bf16_sum = alone[0][i].bfloat16()
            for grads in alone[1:]:
                bf16_sum = bf16_sum + grads[i].bfloat16()
            assert rel_err(bf16_sum.float(), fp32_sum.double()) > 1e-3, name
        # And the sum of plain autograd's gradients of the four.
        want = sum(reference_weight_grads(layer, *batch)[i] for batch in batches)
        tol = BF16_TOL if dtype == "bf16" else FP32_TOL
        assert rel_err(accumulated[i], want) < tol, name

    # Bitwise reproducible.
    layer.zero_main_grad()
    for batch in batches:
        micro_batch(layer, *batch)
    assert torch.equal(layer.w1.main_grad, accumulated[0])
    assert torch.equal(layer.w2.main_grad, accumulated[1])


def test_main_grad_checks():
    with pytest.raises(ValueError, match="frozen=True and main_grad=True"):
        moec_torch.MoeFFN(config(), ranks=2, frozen=True, main_grad=True)
    with pytest.raises(ValueError, match="pass main_grad=True"):
        moec_torch.MoeFFN(config(main_grad=True), ranks=2)
    layer = moec_torch.MoeFFN(config(), ranks=2)
    with pytest.raises(RuntimeError, match="no main_grad buffers"):
        layer.zero_main_grad()
    # The op refuses a main-grad buffer of the wrong dtype.
    mg = moec_torch.MoeFFN(config(), ranks=2, main_grad=True)
    mg.w1.main_grad = mg.w1.main_grad.double()
    x, ids, weights, dy = inputs(mg, 0)
    with pytest.raises(RuntimeError, match="main_grad of w1.*expected float32"):
        micro_batch(mg, x, ids, weights, dy)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_frozen_layer_matches_autograd_and_the_full_layer(dtype):
    torch.manual_seed(0)
    frozen = moec_torch.MoeFFN(config(dtype=dtype), ranks=2, threads=2, frozen=True)
    full = moec_torch.MoeFFN(config(dtype=dtype), ranks=2, threads=2)
    full.load_state_dict(frozen.state_dict())
    assert not frozen.w1.requires_grad and not frozen.w2.requires_grad
    assert frozen.layer.info()["frozen"] and not full.layer.info()["frozen"]

    x, ids, weights, dy = inputs(frozen, 3)
    dx, dtopk = micro_batch(frozen, x, ids, weights, dy)
    assert frozen.w1.grad is None and frozen.w2.grad is None
    full_dx, full_dtopk = micro_batch(full, x, ids, weights, dy)
    # The same dgrad tiles in the same order: bit for bit the full layer's.
    assert torch.equal(dx, full_dx) and torch.equal(dtopk, full_dtopk)

    xd = x.double().requires_grad_()
    wd = weights.double().requires_grad_()
    yd = reference.moe_ffn(xd, ids, wd, frozen.w1.double(), frozen.w2.double())
    yd.backward(dy.double())
    tol = BF16_TOL if dtype == "bf16" else FP32_TOL
    assert rel_err(dx, xd.grad) < tol and rel_err(dtopk, wd.grad) < tol


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_requires_grad_chooses_the_graphs(dtype):
    """A layer built to train whose weights are frozen by requires_grad (as
    PEFT freezes a base model) runs the frozen graphs: no weight-gradient
    GMMs, dx and d topk_weights bit for bit the frozen layer's; a frozen
    layer whose weights are made to require grad trains them; one weight
    requiring grad gets its gradient; grad mode off switches nothing."""
    torch.manual_seed(0)
    layer = moec_torch.MoeFFN(config(dtype=dtype), ranks=2, threads=2)
    frozen = moec_torch.MoeFFN(config(dtype=dtype), ranks=2, threads=2, frozen=True)
    frozen.load_state_dict(layer.state_dict())
    x, ids, weights, dy = inputs(layer, 5)
    frozen_dx, frozen_dtopk = micro_batch(frozen, x, ids, weights, dy)
    full_dx, full_dtopk = micro_batch(layer, x, ids, weights, dy)
    dw1, dw2 = layer.w1.grad.clone(), layer.w2.grad.clone()
    assert not layer.layer.info()["frozen"]

    layer.requires_grad_(False)
    layer.w1.grad = layer.w2.grad = None
    with torch.no_grad():  # no backward to spare: the graphs stay
        layer(x, ids, weights)
    assert not layer.layer.info()["frozen"]
    dx, dtopk = micro_batch(layer, x, ids, weights, dy)
    assert layer.layer.info()["frozen"]
    assert layer.w1.grad is None and layer.w2.grad is None
    assert torch.equal(dx, frozen_dx) and torch.equal(dtopk, frozen_dtopk)
    assert torch.equal(dx, full_dx)

    # Only w2 trains: both are computed, w2's lands in .grad.
    layer.w2.requires_grad_(True)
    micro_batch(layer, x, ids, weights, dy)
    assert not layer.layer.info()["frozen"]
    assert layer.w1.grad is None and torch.equal(layer.w2.grad, dw2)

    # A layer built frozen, its weights made trainable: their gradients.
    frozen.requires_grad_(True)
    dx, _ = micro_batch(frozen, x, ids, weights, dy)
    assert not frozen.layer.info()["frozen"]
    assert torch.equal(frozen.w1.grad, dw1) and torch.equal(frozen.w2.grad, dw2)
    assert torch.equal(dx, full_dx)


def test_requires_grad_and_main_grad():
    """A main_grad layer frozen by requires_grad leaves main_grad alone, and
    adds into it again once its weights train."""
    torch.manual_seed(0)
    layer = moec_torch.MoeFFN(config(), ranks=2, threads=2, main_grad=True)
    x, ids, weights, dy = inputs(layer, 6)
    micro_batch(layer, x, ids, weights, dy)
    once = layer.w1.main_grad.clone()
    assert once.any()
    layer.requires_grad_(False)
    micro_batch(layer, x, ids, weights, dy)
    assert torch.equal(layer.w1.main_grad, once)
    layer.requires_grad_(True)
    micro_batch(layer, x, ids, weights, dy)
    assert torch.allclose(layer.w1.main_grad, 2 * once, rtol=1e-6, atol=0)


def test_base_weights_that_train_in_no_graph_are_refused():
    """LoRA, quantized and transposed base weights (and a quantized weight's
    scales) requiring grad: a ValueError naming the tensor and why, not a
    .grad left None."""
    torch.manual_seed(0)
    lora = moec_torch.MoeFFN(config(), ranks=2, threads=2, lora_rank=4)
    x, ids, weights, dy = inputs(lora, 7)
    lora.w2.requires_grad_(True)
    with pytest.raises(ValueError, match=r"w2 requires grad, but a LoRA layer \(lora_rank=4\)"):
        micro_batch(lora, x, ids, weights, dy)
    with torch.no_grad():
        lora(x, ids, weights)  # no gradients asked for: runs
    lora.w2.requires_grad_(False)
    micro_batch(lora, x, ids, weights, dy)

    quantized = moec_torch.MoeFFN(config(dtype="bf16", hidden=128, inter=128), ranks=2,
                                  threads=2, frozen=True, weight_format="int8")
    x, ids, weights, dy = inputs(quantized, 7)
    quantized.w1_scale.requires_grad_(True)
    with pytest.raises(ValueError, match="w1_scale requires grad, but weight_format='int8'"):
        micro_batch(quantized, x, ids, weights, dy)

    transposed = moec_torch.MoeFFN(config(), ranks=2, threads=2, frozen=True,
                                   weights_transposed=True)
    transposed.requires_grad_(True)
    with pytest.raises(ValueError, match="w1 and w2 require grad, but weights_transposed=True"):
        micro_batch(transposed, x.float(), ids, weights, dy.float())


def test_a_switch_that_cannot_compile_leaves_the_layer_as_it_was(monkeypatch):
    """The frozen graphs failing to compile: the pass raises the compiler's
    error with what the layer was switching to, and the layer still runs its
    training graphs."""
    torch.manual_seed(0)
    layer = moec_torch.MoeFFN(config(), ranks=2, threads=2)
    x, ids, weights, dy = inputs(layer, 8)
    dx, _ = micro_batch(layer, x, ids, weights, dy)

    def compile_layer(*args, **kwargs):
        raise RuntimeError("moec compile moe_ffn_fwd_frozen.json failed: no space left (a test)")

    monkeypatch.setattr(moec_torch.cache, "compile_layer", compile_layer)
    layer.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"^moec: w1 and w2 no longer require grad, and the "
                       r"layer could not switch to the graphs that skip their gradients: "
                       r"compiling the layer failed: RuntimeError: moec compile "
                       r"moe_ffn_fwd_frozen.json failed: no space left \(a test\)$"):
        micro_batch(layer, x, ids, weights, dy)
    assert not layer.layer.info()["frozen"]
    layer.requires_grad_(True)
    again, _ = micro_batch(layer, x, ids, weights, dy)
    assert torch.equal(again, dx) and layer.w1.grad is not None
