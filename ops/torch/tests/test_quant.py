"""Frozen base weights stored as FP8 e4m3 codes with an fp32 scale per
128 x 128 block (weight_format="fp8_block128"): against PyTorch autograd in
float64 on the dequantized weights, frozen and with LoRA, fp32 and bf16;
quantize_weights from a dense layer; the format's refusals."""

import pytest
import torch

import moec_torch
from moec_torch import quant

from test_lora import check_step, randomize_adapters, reference_step
from test_moe_ffn import BF16_TOL, FP32_TOL, config, inputs, rel_err


def fp8_config(dtype):
    # H and I multiples of 128: whole blocks.
    return config(hidden=256, inter=128, tokens=64, dtype=dtype)


def test_blocks_round_trip():
    """quantize_fp8_blocks: one scale per 128 x 128 block (amax / 448, 1 for
    zeros), codes within e4m3's resolution, partial edge blocks."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, 200, 300, generator=g) * torch.tensor([10.0, 1e-3]).view(2, 1, 1)
    w[0, :128, 256:] = 0
    codes, scales = quant.quantize_fp8_blocks(w)
    assert codes.dtype == torch.uint8 and codes.shape == w.shape
    assert scales.shape == (2, 2, 3)
    assert scales[0, 0, 2] == 1.0
    assert scales[1, 1, 1] == w[1, 128:, 128:256].abs().max() / 448
    back = quant.dequantize_fp8_blocks(codes, scales)
    spread = scales.repeat_interleave(128, 1)[:, :200].repeat_interleave(128, 2)[:, :, :300]
    assert ((back - w).abs() <= torch.maximum(w.abs() / 16, spread / 512)).all()
    with pytest.raises(ValueError, match=r"the scales have shape \[2, 1, 3\]; codes of shape "
                                         r"\[2, 200, 300\] in 128x128 blocks need \[2, 2, 3\]"):
        quant.dequantize_fp8_blocks(codes, scales[:, :1])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("lora", [False, True])
def test_fp8_layer_matches_autograd_on_the_dequantized_weights(dtype, lora):
    torch.manual_seed(4)
    options = dict(lora_rank=4, lora_alpha=8) if lora else dict(frozen=True)
    layer = moec_torch.MoeFFN(fp8_config(dtype), ranks=2, threads=2,
                              weight_format="fp8_block128", **options)
    assert layer.weights_transposed and layer.w1.dtype == torch.uint8
    assert layer.w1.shape == (4, 256, 256) and layer.w2.shape == (4, 256, 128)
    assert layer.w1_scale.shape == (4, 2, 2) and layer.w2_scale.shape == (4, 2, 1)
    assert layer.info()["weight_format"] == 1
    if lora:
        randomize_adapters(layer, seed=2)
    check_step(layer, 3, BF16_TOL if dtype == "bf16" else FP32_TOL)
    assert layer.w1_scale.grad is None


def test_quantize_weights_of_a_dense_layer():
    """quantize_weights(): the dense layer's weights in FP8 blocks, its
    adapters copied; the outputs move by the quantization's error only;
    the dense layer is left as it is; state_dict round-trips."""
    torch.manual_seed(6)
    dense = moec_torch.MoeFFN(fp8_config("fp32"), ranks=2, threads=2, lora_rank=4,
                              lora_alpha=8)
    randomize_adapters(dense, seed=7)
    before = dense.w1.clone()
    fp8 = dense.quantize_weights("fp8_block128")
    assert torch.equal(dense.w1, before)
    codes, scales = quant.quantize_fp8_blocks(dense.w1.transpose(1, 2))
    assert torch.equal(fp8.w1, codes) and torch.equal(fp8.w1_scale, scales)
    for a, b in zip(dense.adapters(), fp8.adapters()):
        assert torch.equal(a, b)
    x, ids, weights, _ = inputs(dense, seed=8)
    with torch.no_grad():
        y_dense, y_fp8 = dense(x, ids, weights), fp8(x, ids, weights)
    err = rel_err(y_fp8, y_dense.double())
    assert 1e-4 < err < 0.1, err  # e4m3's 3 mantissa bits, not garbage
    again = moec_torch.MoeFFN(fp8_config("fp32"), ranks=2, threads=2, lora_rank=4,
                              lora_alpha=8, weight_format="fp8_block128", init_weights=False)
    again.load_state_dict(fp8.state_dict())
    with torch.no_grad():
        assert torch.equal(again(x, ids, weights), y_fp8)
    with pytest.raises(ValueError, match="weight_format"):
        dense.load_state_dict(fp8.state_dict())
    with pytest.raises(ValueError, match="cannot be folded into fp8_block128"):
        fp8.merge_adapters()
    merged = fp8.merged_weights()
    assert merged[0].dtype == torch.float32 and merged[0].shape == fp8.w1.shape


def test_fp8_refusals():
    cfg = fp8_config("bf16")
    with pytest.raises(ValueError, match="needs a frozen or LoRA layer"):
        moec_torch.MoeFFN(cfg, ranks=2, weight_format="fp8_block128")
    with pytest.raises(ValueError, match="weight_format must be one of"):
        moec_torch.MoeFFN(cfg, ranks=2, frozen=True, weight_format="int3")
    with pytest.raises(ValueError, match="must be multiples of 128"):
        moec_torch.MoeFFN(config(), ranks=2, frozen=True, weight_format="fp8_block128")
    layer = moec_torch.MoeFFN(cfg, ranks=2, threads=2, frozen=True, weight_format="fp8_block128")
    x, ids, weights, _ = inputs(layer, seed=1)
    layer.w1 = torch.nn.Parameter(layer.dequantized_weights()[0], requires_grad=False)
    with pytest.raises(RuntimeError, match="'w1' is bf16; expected uint8, the FP8 e4m3 codes"):
        layer(x, ids, weights)


def test_a_grown_fp8_layer_keeps_its_format():
    """Capacity growth recompiles the layer's own graphs (the FP8, transposed
    ones): a routing past the compiled capacity still matches autograd."""
    torch.manual_seed(9)
    cfg = dict(fp8_config("fp32"), capacity_factor=1.0)
    layer = moec_torch.MoeFFN(cfg, ranks=2, threads=2, frozen=True, weight_format="fp8_block128")
    x, ids, weights, dy = inputs(layer, seed=10, hot=0)  # every first choice on expert 0
    with pytest.warns(RuntimeWarning, match="recompiled with capacity_factor"):
        y = layer(x, ids, weights)
    want, _, _, _ = reference_step(layer, x, ids, weights, dy)
    assert rel_err(y, want) < FP32_TOL
    assert layer.info()["weight_format"] == 1 and layer.info()["weights_transposed"] == 1
