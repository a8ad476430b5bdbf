"""MoeFFN(pack_weights=True): the weights packed once in the
GEMM tile's layout give the bits of packing them in every tile, through
optimizer steps (PyTorch's version counters say which weight changed), a
parameter replaced, and writes through .data with weights_changed();
pack_weights="forward" packs the forward pass's alone."""

import pytest
import torch

import moec_torch

from test_lora import randomize_adapters
from test_moe_ffn import config, inputs


def packs(layer):
    """Whether the layer holds packed weights (moec's bf16 tile runs here)."""
    return "packed weights" in layer.layer.workspace()


def twins(**options):
    """A bf16 layer with packed weights and one without, the same values.
    Depths past one 256-value block and ending mid-pair, columns cut into
    48-column panels unevenly."""
    cfg = config(experts=4, top_k=2, hidden=301, inter=70, tokens=48, dtype="bf16")
    torch.manual_seed(3)
    packed = moec_torch.MoeFFN(cfg, 2, threads=2, pack_weights=True, **options)
    plain = moec_torch.MoeFFN(cfg, 2, threads=2, pack_weights=False, **options)
    if packed.lora_rank:
        randomize_adapters(packed, 5)
    plain.load_state_dict(packed.state_dict())
    return packed, plain


def step(layer, x, ids, weights, dy):
    """y, and the gradients of x, the top-k weights and every parameter."""
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    layer.zero_grad()
    y = layer(x, ids, weights)
    y.backward(dy)
    return [y.detach(), x.grad, weights.grad] + [p.grad for p in layer.parameters()
                                                  if p.grad is not None]


def same(a, b):
    return all(torch.equal(u, v) for u, v in zip(a, b)) and len(a) == len(b)


@pytest.mark.parametrize("options", [{}, {"lora_rank": 8}], ids=["full", "lora"])
def test_optimizer_steps_give_the_bits_of_unpacked_weights(options):
    packed, plain = twins(**options)
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
                  for m in (packed, plain)]
    for s in range(3):
        data = inputs(packed, seed=s)
        results = [step(m, *data) for m in (packed, plain)]
        assert same(*results), f"step {s}"
        for opt in optimizers:
            opt.step()
    # The steps changed what the layers compute (the optimizer's writes were
    # seen), and both changed alike.
    assert not torch.equal(results[0][0], step(packed, *inputs(packed, seed=0))[0])
    if packs(packed):
        assert not packs(plain)


def test_writes_through_data_need_weights_changed():
    packed, plain = twins()
    data = inputs(packed, seed=1)
    # The second pass packs what the first found unchanged.
    for _ in range(2):
        assert same(step(packed, *data), step(plain, *data))
    if not packs(packed):
        pytest.skip("moec's bf16 tile does not run on this CPU: nothing is packed")
    for m in (packed, plain):
        m.w1.data.mul_(-1)  # PyTorch does not count a write through .data
    assert not same(step(packed, *data), step(plain, *data))
    packed.weights_changed()
    assert same(step(packed, *data), step(plain, *data))


def test_a_replaced_parameter_is_packed_anew():
    packed, plain = twins()
    data = inputs(packed, seed=2)
    assert same(step(packed, *data), step(plain, *data))
    for m in (packed, plain):
        m.w2 = torch.nn.Parameter(m.w2.detach() * 0.5)
    assert same(step(packed, *data), step(plain, *data))


def test_weights_changed_while_a_pass_is_pending_is_refused():
    packed, _ = twins()
    x, ids, weights, _ = inputs(packed, seed=4)
    handle = packed.submit_forward(x, ids, weights)
    with pytest.raises(RuntimeError, match="weights_changed\\(\\) while a submitted pass"):
        packed.weights_changed()
    handle.wait()


@pytest.mark.parametrize("options", [{"frozen": True}, {"lora_rank": 8}, {"frozen": True, "weights_transposed": True}],
                         ids=["frozen", "lora", "frozen_transposed"])
def test_forward_packing_keeps_the_forward_pass_cells_only(options):
    """pack_weights="forward": the forward pass's packed weights alone,
    those of pack_weights=True's forward; the backward reads the weights as
    stored and packs nothing; the bits of the unpacked layer."""
    cfg = config(experts=4, top_k=2, hidden=301, inter=70, tokens=48, dtype="bf16")
    torch.manual_seed(6)
    modes = (True, "forward", False)
    layers = {mode: moec_torch.MoeFFN(cfg, 2, threads=2, pack_weights=mode, **options)
              for mode in modes}
    if layers[True].lora_rank:
        randomize_adapters(layers[True], 5)
    for mode in modes[1:]:
        layers[mode].load_state_dict(layers[True].state_dict())
    assert layers["forward"].pack_weights == "forward"
    # Two forward passes: the second packs what the first found unchanged.
    for s in range(2):
        x, ids, weights, _ = inputs(layers[True], seed=s)
        with torch.no_grad():
            ys = [layers[mode](x, ids, weights) for mode in modes]
        assert same(ys[:2], ys[1:])
    forward_bytes = {mode: layers[mode].info()["packed_weight_bytes"] for mode in modes}
    assert forward_bytes[True] == forward_bytes["forward"]
    for s in range(3):
        data = inputs(layers[True], seed=s)
        results = [step(layers[mode], *data) for mode in modes]
        assert same(results[0], results[1]) and same(results[1], results[2]), f"step {s}"
    after = {mode: layers[mode].info()["packed_weight_bytes"] for mode in modes}
    assert after["forward"] == forward_bytes["forward"]
    assert after[True] >= after["forward"] and after[False] == 0
    if packs(layers[True]) and not options.get("weights_transposed"):
        assert after["forward"] > 0


def test_pack_weights_takes_true_false_or_forward():
    cfg = config(experts=4, top_k=2, hidden=64, inter=32, tokens=16, dtype="bf16")
    for value in ("all", "yes", 1, None):
        with pytest.raises(TypeError, match="MoeFFN: argument 'pack_weights' must be True, False "
                                            "or \"forward\", got "):
            moec_torch.MoeFFN(cfg, 2, pack_weights=value)


@pytest.mark.parametrize("weight_format", ["fp8_block128", "int8", "int4_g32", "int4_g64_zp"])
@pytest.mark.parametrize("options", [{"frozen": True}, {"lora_rank": 8}], ids=["frozen", "lora"])
def test_quantized_codes_packed_give_the_bits_of_decoding_them_as_stored(weight_format, options):
    """A quantized base in the packed-weight store: its codes packed once in
    the order of the tile's panels, decoded straight into them (both reads:
    the forward's transposed, the backward's dX as stored); the bits of
    decoding the codes as they are stored, on hidden and intermediate sizes
    that cut the 48-column panels unevenly and go past one 256-value depth
    block, and in fewer bytes than packed bf16 weights."""
    cfg = config(experts=4, top_k=2, hidden=384, inter=128, tokens=48, dtype="bf16")
    torch.manual_seed(5)
    packed = moec_torch.MoeFFN(cfg, 2, threads=2, pack_weights=True,
                               weight_format=weight_format, **options)
    plain = moec_torch.MoeFFN(cfg, 2, threads=2, pack_weights=False,
                              weight_format=weight_format, **options)
    if packed.lora_rank:
        randomize_adapters(packed, 5)
    plain.load_state_dict(packed.state_dict())
    # The first pass packs what it finds unchanged from the pass before.
    for s in range(3):
        data = inputs(packed, seed=s)
        assert same(step(packed, *data), step(plain, *data)), f"step {s}"
    if not packs(packed):
        pytest.skip("moec's bf16 tile does not run on this CPU: nothing is packed")
    assert not packs(plain)
    dense = moec_torch.MoeFFN(cfg, 2, threads=2, pack_weights=True, weights_transposed=True,
                              **options)
    for s in range(2):
        step(dense, *inputs(dense, seed=s))
    packed_bytes = [layer.info()["packed_weight_bytes"] for layer in (packed, dense)]
    assert 0 < packed_bytes[0] < packed_bytes[1] * (0.7 if "int4" in weight_format else 0.6)
    # The scales are packed with the codes: scales written in place (PyTorch
    # counts it) are packed again, as new codes would be.
    data = inputs(packed, seed=7)
    before = step(packed, *data)
    with torch.no_grad():
        for m in (packed, plain):  # (with zero points, [..., 0] are the scales)
            (m.w1_scale[..., 0] if weight_format.endswith("_zp") else m.w1_scale).mul_(2)
    after = step(packed, *data)
    assert same(after, step(plain, *data))
    assert not torch.equal(after[0], before[0])
    # Scales are checked again when they change: a NaN written in place is
    # refused at the next step (the store skips the check of unchanged ones).
    with torch.no_grad():
        packed.w1_scale.view(-1)[0] = float("nan")
    with pytest.raises(RuntimeError, match="'w1_scale'.*nan"):
        step(packed, *data)



LIMITED = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
import moec_torch
import test_packed_weights as t
from test_moe_ffn import config, inputs
cfg = config(experts=4, top_k=2, hidden=1024, inter=512, tokens=64, dtype="bf16")
torch.manual_seed(3)
packed = moec_torch.MoeFFN(cfg, 2, threads=2, pack_weights=True, frozen=True)
plain = moec_torch.MoeFFN(cfg, 2, threads=2, pack_weights=False, frozen=True)
plain.load_state_dict(packed.state_dict())
same = []
for s in range(3):
    data = inputs(packed, seed=s)
    same.append(t.same(t.step(packed, *data), t.step(plain, *data)))
print(json.dumps({"same": same, "packed": packed.info()["packed_weight_bytes"]}))
"""


def test_a_limit_on_the_packed_weights_leaves_the_rest_as_stored(tmp_path):
    """MOEC_PACKED_MIB caps the process's packed-weight store: the weights
    past it are read as stored (by the tiles that read them), the bits the
    same; a value that is no number of MiB is said and means no limit."""
    import json
    import os
    import subprocess
    import sys
    script = tmp_path / "limited.py"
    script.write_text(LIMITED)
    here = os.path.dirname(os.path.abspath(__file__))

    def run(limit):
        env = {k: v for k, v in os.environ.items() if k != "MOEC_PACKED_MIB"}
        if limit is not None:
            env["MOEC_PACKED_MIB"] = limit
        done = subprocess.run([sys.executable, str(script), here], capture_output=True,
                              text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr

    whole = run(None)[0]
    assert whole["same"] == [True] * 3
    if whole["packed"] == 0:
        pytest.skip("moec's bf16 tile does not run here: nothing is packed")
    half_mib = whole["packed"] // 2 >> 20
    assert half_mib >= 1, whole
    for limit, most in (("0", 0), (str(half_mib), half_mib << 20)):
        got, _ = run(limit)
        assert got["same"] == [True] * 3, limit
        assert got["packed"] <= most, (limit, got)
    assert 0 < run(str(half_mib))[0]["packed"]
    got, said = run("many")
    assert got == whole
    assert "MOEC_PACKED_MIB='many' is not a number of MiB" in said
