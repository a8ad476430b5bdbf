"""Frozen base weights stored quantized (weight_format): FP8 e4m3 codes
with an fp32 scale per 128 x 128 block, int8 codes with a scale per row,
4-bit codes with a scale (and a zero point) per group. Each against
PyTorch autograd in float64 on the dequantized weights, frozen and with
LoRA, fp32 and bf16; the quantizers against values worked out by hand;
quantize_weights from a dense layer; the formats' refusals."""

import pytest
import torch

import moec_torch
from moec_torch import quant

from test_lora import check_step, randomize_adapters, reference_step
from test_moe_ffn import BF16_TOL, FP32_TOL, config, inputs, rel_err


def fp8_config(dtype):
    # H and I multiples of 128: whole blocks (and groups).
    return config(hidden=256, inter=128, tokens=64, dtype=dtype)


# Every format, and what its layer's info() says of it.
FORMATS = {"fp8_block128": (1, 0, 0), "int8": (2, 0, 0), "int4_g32": (3, 32, 0),
           "int4_g64_zp": (3, 64, 1), "int4_g128": (3, 128, 0)}


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


def test_int8_rows():
    """int8: a scale per row, amax / 127 (1 for a row of zeros, NaN for one
    holding an infinity), codes the nearest integers (ties to even)."""
    w = torch.tensor([[[1.27, -0.6349, 0.3151, 0.0041], [127.0, 2.5, -3.5, 0.5],
                       [0.0, 0.0, 0.0, 0.0], [1.0, float("inf"), 0.0, 0.0]]])
    codes, scales = quant.quantize("int8", w)
    assert codes.dtype == torch.int8 and scales.shape == (1, 4)
    assert scales[0, 0] == torch.tensor(1.27) / 127
    assert scales[0, 1:3].tolist() == [1.0, 1.0] and torch.isnan(scales[0, 3])
    assert codes[0, 0].tolist() == [127, -63, 32, 0]
    assert codes[0, 1].tolist() == [127, 2, -4, 0]  # ties to even
    assert codes[0, 2].tolist() == [0, 0, 0, 0]
    back = quant.dequantize("int8", codes, scales)
    assert torch.equal(back[0, :3], codes[0, :3].float() * scales[0, :3].unsqueeze(-1))


def test_int4_groups():
    """int4: two codes a byte, the even value in the low half; a scale per
    group (amax / 7, codes 8 + round(v / scale)); with zero points the
    group's range with 0 in it over 15 levels."""
    row = torch.arange(64, dtype=torch.float32) - 16  # -16 .. 47
    codes, scales = quant.quantize("int4_g32", row.view(1, 1, 64))
    assert codes.shape == (1, 1, 32) and scales.shape == (1, 1, 2)
    assert torch.equal(scales[0, 0], torch.tensor([16.0, 47.0]) / 7)
    # Values 0 and 1 (-16, -15) of group 0: codes 8 - 7 = 1 and 8 + round(-6.5625) = 1.
    assert codes[0, 0, 0].item() == (1 | 1 << 4)
    lo, hi = codes[0, 0] & 0xF, codes[0, 0] >> 4
    unpacked = torch.stack((lo, hi), -1).reshape(64).float()
    want = torch.round(row / scales[0, 0].repeat_interleave(32)) + 8
    assert torch.equal(unpacked, want.clamp(0, 15))
    codes, pairs = quant.quantize("int4_g64_zp", row.view(1, 1, 64))
    scale, zero = pairs[0, 0, 0].tolist()
    assert scale == torch.tensor(63.0 / 15).item() and zero == round(16 / scale)
    back = quant.dequantize("int4_g64_zp", codes, pairs)
    assert (back - row).abs().max() <= scale / 2 + 1e-6
    with pytest.raises(ValueError, match=r"the scales have shape \[1, 1, 2\]; int4_g64_zp codes "
                                         r"of shape \[1, 1, 32\] need \[1, 1, 1, 2\]"):
        quant.dequantize("int4_g64_zp", codes, pairs.view(1, 1, 2))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("weight_format", list(FORMATS))
def test_layer_matches_autograd_on_the_dequantized_weights(weight_format, dtype, lora):
    torch.manual_seed(4)
    options = dict(lora_rank=4, lora_alpha=8) if lora else dict(frozen=True)
    layer = moec_torch.MoeFFN(fp8_config(dtype), ranks=2, threads=2,
                              weight_format=weight_format, **options)
    fmt = quant.parse(weight_format)
    assert layer.weights_transposed and layer.w1.dtype == fmt.codes_dtype
    assert layer.w1.shape == (4, *fmt.stored_shape(256, 256))
    assert layer.w2.shape == (4, *fmt.stored_shape(256, 128))
    assert layer.w1_scale.shape == (4, *fmt.scale_shape(256, 256))
    assert layer.w2_scale.shape == (4, *fmt.scale_shape(256, 128))
    info = layer.info()
    assert (info["weight_format"], info["weight_group"], info["weight_zero_points"]) == \
        FORMATS[weight_format]
    if lora:
        randomize_adapters(layer, seed=2)
    check_step(layer, 3, BF16_TOL if dtype == "bf16" else FP32_TOL)
    assert layer.w1_scale.grad is None


@pytest.mark.parametrize("weight_format", list(FORMATS))
def test_a_quantized_bf16_layer_gives_the_bits_of_its_dequantized_weights(weight_format):
    """moec's bf16 tile decodes a quantized weight's codes into its panels
    (or, in the swapped form, the rows it reads) as it goes: the operands,
    hence the bits of y, dx and dtopk_weights, are those of a dense frozen
    layer holding the dequantized bf16 weights (both layouts of B: the
    forward reads w stored [out, in] transposed, the backward's dX reads it
    as it is)."""
    with open("/proc/cpuinfo") as f:
        if "avx512_bf16" not in f.read():
            pytest.skip("this CPU has no avx512_bf16: moec's bf16 tile does not run")
    torch.manual_seed(11)
    layer = moec_torch.MoeFFN(fp8_config("bf16"), ranks=2, threads=2, frozen=True,
                              weight_format=weight_format)
    dense = moec_torch.MoeFFN(fp8_config("bf16"), ranks=2, threads=2, frozen=True,
                              weights_transposed=True, init_weights=False)
    w1, w2 = layer.dequantized_weights()
    with torch.no_grad():
        dense.w1.copy_(w1)
        dense.w2.copy_(w2)
    x, ids, weights, dy = inputs(layer, seed=12)
    outputs = []
    for each in (layer, dense):
        xg, wg = x.clone().requires_grad_(), weights.clone().requires_grad_()
        y = each(xg, ids, wg)
        y.backward(dy)
        outputs.append((y, xg.grad, wg.grad))
    for name, q, d in zip(("y", "dx", "dtopk_weights"), *outputs):
        assert torch.equal(q, d), name
    assert outputs[0][0].abs().max() > 0 and outputs[0][1].abs().max() > 0


@pytest.mark.parametrize("weight_format,bounds", [("fp8_block128", (1e-4, 0.1)),
                                                  ("int8", (1e-5, 0.02)),
                                                  ("int4_g64_zp", (1e-3, 0.3))])
def test_quantize_weights_of_a_dense_layer(weight_format, bounds):
    """quantize_weights(): the dense layer's weights in the format, its
    adapters copied; the outputs move by the quantization's error only;
    the dense layer is left as it is; state_dict round-trips."""
    torch.manual_seed(6)
    dense = moec_torch.MoeFFN(fp8_config("fp32"), ranks=2, threads=2, lora_rank=4,
                              lora_alpha=8)
    randomize_adapters(dense, seed=7)
    before = dense.w1.clone()
    fp8 = dense.quantize_weights(weight_format)
    assert torch.equal(dense.w1, before)
    codes, scales = quant.quantize(weight_format, dense.w1.transpose(1, 2))
    assert torch.equal(fp8.w1, codes) and torch.equal(fp8.w1_scale, scales)
    for a, b in zip(dense.adapters(), fp8.adapters()):
        assert torch.equal(a, b)
    x, ids, weights, _ = inputs(dense, seed=8)
    with torch.no_grad():
        y_dense, y_fp8 = dense(x, ids, weights), fp8(x, ids, weights)
    err = rel_err(y_fp8, y_dense.double())
    assert bounds[0] < err < bounds[1], err  # the format's resolution, not garbage
    again = moec_torch.MoeFFN(fp8_config("fp32"), ranks=2, threads=2, lora_rank=4,
                              lora_alpha=8, weight_format=weight_format, init_weights=False)
    again.load_state_dict(fp8.state_dict())
    with torch.no_grad():
        assert torch.equal(again(x, ids, weights), y_fp8)
    with pytest.raises(ValueError, match="weight_format"):
        dense.load_state_dict(fp8.state_dict())
    with pytest.raises(ValueError, match=f"cannot be folded into {weight_format}"):
        fp8.merge_adapters()
    merged = fp8.merged_weights()
    assert merged[0].dtype == torch.float32 and merged[0].shape == (4, 256, 256)


def test_format_refusals():
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
    with pytest.raises(ValueError, match=r"weight_format='int4_g128' holds whole groups of 128 "
                                         r"values along a row: hidden_size and "
                                         r"intermediate_size must be multiples of 128"):
        moec_torch.MoeFFN(dict(cfg, intermediate_size=192), ranks=2, frozen=True,
                          weight_format="int4_g128")
    with pytest.raises(ValueError, match=r"the config's 'weight_group' is 32, and "
                                         r"weight_format='int4_g64' says 64"):
        moec_torch.MoeFFN(dict(cfg, weight_group=32), ranks=2, frozen=True,
                          weight_format="int4_g64")
    layer = moec_torch.MoeFFN(cfg, ranks=2, threads=2, frozen=True, weight_format="int8")
    layer.w1 = torch.nn.Parameter(layer.w1.view(torch.uint8), requires_grad=False)
    with pytest.raises(RuntimeError, match="'w1' is u8; expected int8, the int8 codes of the "
                                           "layer's int8 weights"):
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


@pytest.mark.parametrize("weight_format", ["fp8_block128", "int4_g64_zp"])
def test_model_to_keeps_the_codes_and_float32_scales(weight_format):
    """model.to(torch.bfloat16) around a bf16 quantized layer (as after
    loading a checkpoint in bf16) would cast its float32 scales to bf16:
    the layer keeps them, and its codes, quietly (its dtype is bf16
    already); the outputs are unchanged."""
    import warnings
    torch.manual_seed(1)
    layer = moec_torch.MoeFFN(fp8_config("bf16"), ranks=2, threads=1, frozen=True,
                              weight_format=weight_format)
    x, ids, weights = inputs(layer, 3)[:3]
    y = layer(x, ids, weights)
    before = {n: t.clone() for n, t in layer.state_dict().items() if torch.is_tensor(t)}
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), layer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.to(torch.bfloat16)
    assert model[0].weight.dtype == torch.bfloat16
    assert layer.w1_scale.dtype == torch.float32
    for n, t in layer.state_dict().items():
        if torch.is_tensor(t):
            assert t.dtype == before[n].dtype and torch.equal(t, before[n]), n
    assert torch.equal(layer(x, ids, weights), y)
