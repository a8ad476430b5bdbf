"""MoeFFN against plain PyTorch autograd (moec_torch.reference) on the same
inputs: forward output and the gradients of x, topk_weights, w1 and w2."""

import ctypes
import json
import os
import re
import warnings
from pathlib import Path

import pytest
import torch

import moec_torch
from moec_torch import reference

GRAPHS = Path(os.environ.get("MOEC_GRAPHS", Path(__file__).resolve().parents[3] / "graphs"))
CONFIGS = GRAPHS.parent / "examples/configs"


def config(experts=4, top_k=2, hidden=64, inter=32, tokens=128, dtype="fp32", **extra):
    return {"name": "test", "hidden_size": hidden, "intermediate_size": inter,
            "num_experts": experts, "top_k": top_k, "ep": 1, "tp": 1,
            "seq_size": tokens, "dtype": dtype, **extra}


def routing(ranks, tokens, experts, top_k, seed=0, hot=None, avoid=()):
    """Distinct experts per token, random; `hot` takes every first choice;
    experts in `avoid` get no tokens."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(experts) if e not in avoid])
    scores = torch.rand(ranks * tokens, len(allowed), generator=g)
    if hot is not None:
        scores[:, (allowed == hot).nonzero().item()] = 2.0
    ids = allowed[scores.argsort(dim=1, descending=True)[:, :top_k]]
    weights = torch.rand(ranks * tokens, top_k, generator=g) * 0.8 + 0.2
    return ids.view(ranks, tokens, top_k), weights.view(ranks, tokens, top_k)


def rel_err(got, want):
    scale = want.abs().max().item()
    return (got.double() - want).abs().max().item() / (scale if scale > 0 else 1.0)


def check_step(layer, x, ids, weights, dy, tol, reference_x=None, errors_out=None):
    """One forward + backward of `layer` and of the reference in float64 on
    the same values (the reference on `reference_x` when given: x as an FP8
    dispatch delivers it); every output within `tol` of the reference's
    scale. `errors_out`, a dict, receives the errors."""
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    layer.zero_grad()
    y = layer(x, ids, weights)
    y.backward(dy)

    xd = (x if reference_x is None else reference_x).detach().double().requires_grad_()
    wd = weights.detach().double().requires_grad_()
    w1 = layer.w1.detach().double().requires_grad_()
    w2 = layer.w2.detach().double().requires_grad_()
    yd = reference.moe_ffn(xd, ids, wd, w1, w2)
    yd.backward(dy.double())

    errors = {"y": rel_err(y, yd), "dx": rel_err(x.grad, xd.grad),
              "dtopk_weights": rel_err(weights.grad, wd.grad),
              "dw1": rel_err(layer.w1.grad, w1.grad), "dw2": rel_err(layer.w2.grad, w2.grad)}
    if errors_out is not None:
        errors_out.update(errors)
    assert y.dtype == x.dtype and x.grad.dtype == x.dtype
    assert layer.w1.grad.dtype == layer.w1.dtype and weights.grad.dtype == torch.float32
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"over {tol}: {bad} (all: {errors})"
    return y, (x.grad, weights.grad, layer.w1.grad, layer.w2.grad), (w1.grad, w2.grad)


def inputs(layer, seed, tokens=None, **route):
    tokens = tokens or layer.tokens
    g = torch.Generator().manual_seed(seed + 1000)
    dtype = layer.dtype
    x = (torch.rand(layer.ranks, tokens, layer.hidden, generator=g) * 2 - 1).to(dtype)
    dy = (torch.rand(layer.ranks, tokens, layer.hidden, generator=g) * 2 - 1).to(dtype)
    ids, weights = routing(layer.ranks, tokens, layer.experts, layer.top_k, seed, **route)
    return x, ids, weights, dy


FP32_TOL = 1e-4
BF16_TOL = 3e-2


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("local_experts,top_k", [(2, 2), (8, 8), (1, 1)])
def test_fp32_matches_autograd(ranks, local_experts, top_k):
    torch.manual_seed(ranks * 100 + local_experts)
    layer = moec_torch.MoeFFN(config(experts=local_experts * ranks, top_k=top_k), ranks,
                              threads=2)
    check_step(layer, *inputs(layer, seed=ranks), tol=FP32_TOL)


@pytest.mark.parametrize("ranks", [1, 2])
def test_bf16_matches_autograd(ranks):
    torch.manual_seed(ranks)
    layer = moec_torch.MoeFFN(config(experts=8, top_k=2, dtype="bf16"), ranks, threads=2)
    assert layer.w1.dtype == torch.bfloat16
    check_step(layer, *inputs(layer, seed=ranks), tol=BF16_TOL)


@pytest.mark.parametrize("ranks,local_experts,top_k,tokens,hidden,inter,dtype", [
    (3, 3, 2, 37, 50, 24, "fp32"),     # E = 3 x 3; S, H, I no multiple of a tile
    (3, 3, 9, 37, 50, 24, "fp32"),     # top-k = every expert
    (1, 4, 1, 1, 20, 12, "fp32"),      # one token
    (2, 2, 2, 1000, 24, 20, "bf16"),   # 1000 tokens per rank
])
def test_awkward_shapes_match_autograd(ranks, local_experts, top_k, tokens, hidden, inter,
                                       dtype):
    torch.manual_seed(tokens + hidden)
    layer = moec_torch.MoeFFN(config(experts=ranks * local_experts, top_k=top_k, hidden=hidden,
                                     inter=inter, tokens=tokens, dtype=dtype,
                                     capacity_factor=2 * ranks), ranks, threads=2)
    check_step(layer, *inputs(layer, seed=tokens), tol=FP32_TOL if dtype == "fp32" else BF16_TOL)


def test_tiny_config_file_and_fewer_tokens():
    """The tiny example config from its JSON path; a step with fewer tokens
    than the compiled seq_size."""
    layer = moec_torch.MoeFFN(CONFIGS / "tiny.json", ranks=2, threads=2)
    check_step(layer, *inputs(layer, seed=3, tokens=layer.tokens // 2 + 1), tol=FP32_TOL)


def test_zero_token_experts_and_skew():
    layer = moec_torch.MoeFFN(config(experts=8, top_k=2), 2, threads=2)
    # Experts 0 and 5 get no token, expert 3 gets every first choice.
    x, ids, weights, dy = inputs(layer, seed=4, hot=3, avoid=(0, 5))
    assert not (ids == 0).any() and not (ids == 5).any()
    _, (_, _, dw1, dw2), _ = check_step(layer, x, ids, weights, dy, tol=FP32_TOL)
    assert dw1[0].abs().max() == 0 and dw2[5].abs().max() == 0
    assert dw1[3].abs().max() > 0


def test_repeated_training_steps():
    """Several SGD steps of one module with new routing each step; the module
    and a float64 copy trained with the reference stay together."""
    torch.manual_seed(7)
    layer = moec_torch.MoeFFN(config(experts=8, top_k=2), 2, threads=2)
    w1 = layer.w1.detach().double().clone().requires_grad_()
    w2 = layer.w2.detach().double().clone().requires_grad_()
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    opt_ref = torch.optim.SGD([w1, w2], lr=0.5)
    for step in range(4):
        x, ids, weights, _ = inputs(layer, seed=10 + step)
        opt.zero_grad()
        loss = layer(x, ids, weights).square().mean()
        loss.backward()
        opt.step()
        opt_ref.zero_grad()
        loss_ref = reference.moe_ffn(x.double(), ids, weights.double(), w1, w2).square().mean()
        loss_ref.backward()
        opt_ref.step()
        assert abs(loss.item() - loss_ref.item()) <= FP32_TOL * abs(loss_ref.item())
    assert rel_err(layer.w1.detach(), w1.detach()) < FP32_TOL
    assert rel_err(layer.w2.detach(), w2.detach()) < FP32_TOL


def test_gradient_buffers_are_recycled_not_shared():
    """The memory of a step's gradients comes back to the layer when they
    die and serves the next step (pages already touched); gradients still
    held are never written over, and every step's values stay right."""
    torch.manual_seed(8)
    layer = moec_torch.MoeFFN(config(experts=4, top_k=2), 2, threads=2)
    x, ids, weights, dy = inputs(layer, seed=60)

    def step():
        layer.zero_grad(set_to_none=True)
        layer(x, ids, weights).backward(dy)
        return layer.w1.grad, layer.w2.grad

    g1, g2 = step()
    first = (g1.data_ptr(), g2.data_ptr())
    held1, held2 = g1.clone(), g2.clone()
    # Still held: the next step must not reuse (or write over) them.
    n1, n2 = step()
    second = (n1.data_ptr(), n2.data_ptr())
    assert set(second).isdisjoint(first)  # g1 and g2 are still alive
    assert torch.equal(g1, held1) and torch.equal(g2, held2)
    assert torch.equal(n1, held1) and torch.equal(n2, held2)  # same inputs, same bits
    # Released (set_to_none drops .grad, and we drop ours): recycled.
    del g1, g2, n1, n2
    layer.zero_grad(set_to_none=True)
    recycled = layer.layer.info()["outputs_recycled"]
    r1, r2 = step()
    # y, dx, dtopk_weights, dw1 and dw2 all came from idle buffers.
    assert layer.layer.info()["outputs_recycled"] == recycled + 5
    assert {r1.data_ptr(), r2.data_ptr()} <= set(first) | set(second)
    assert torch.equal(r1, held1) and torch.equal(r2, held2)


def test_two_forwards_then_backwards():
    """The runtime keeps the last forward's state; the backward of an earlier
    forward recomputes its own and still gets its gradients right."""
    layer = moec_torch.MoeFFN(config(experts=4, top_k=2), 2, threads=2)
    xa, ids_a, wa, _ = inputs(layer, seed=20)
    xb, ids_b, wb, _ = inputs(layer, seed=21)
    xa.requires_grad_()
    xb.requires_grad_()
    loss = layer(xa, ids_a, wa).sum() + 2 * layer(xb, ids_b, wb).sum()
    loss.backward()
    xd = xa.detach().double().requires_grad_()
    xe = xb.detach().double().requires_grad_()
    w1 = layer.w1.detach().double().requires_grad_()
    w2 = layer.w2.detach().double().requires_grad_()
    (reference.moe_ffn(xd, ids_a, wa.double(), w1, w2).sum()
     + 2 * reference.moe_ffn(xe, ids_b, wb.double(), w1, w2).sum()).backward()
    assert rel_err(xa.grad, xd.grad) < FP32_TOL
    assert rel_err(xb.grad, xe.grad) < FP32_TOL
    assert rel_err(layer.w1.grad, w1.grad) < FP32_TOL
    assert rel_err(layer.w2.grad, w2.grad) < FP32_TOL


def test_deterministic_across_runs():
    layer = moec_torch.MoeFFN(config(experts=8, top_k=2), 2, threads=2)
    x, ids, weights, dy = inputs(layer, seed=30)
    outs = []
    for _ in range(2):
        xg = x.clone().requires_grad_()
        layer.zero_grad()
        layer(xg, ids, weights).backward(dy)
        outs.append((xg.grad.clone(), layer.w1.grad.clone(), layer.w2.grad.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_compile_cache():
    cfg = config(experts=4, top_k=2, tokens=128)
    first = moec_torch.compile_layer(cfg, 2)
    mtime = [os.stat(p).st_mtime_ns for p in first]
    assert moec_torch.compile_layer(dict(cfg), 2) == first
    # A new process's view: the in-memory cache cleared, the disk cache hit.
    moec_torch.cache._compiled.clear()
    assert moec_torch.compile_layer(cfg, 2) == first
    assert [os.stat(p).st_mtime_ns for p in first] == mtime
    other = moec_torch.compile_layer(cfg, 1)
    assert other != first and all(Path(p).is_file() for p in other)


def test_the_version_is_base_versions_everywhere(tmp_path):
    """The compiler library reports base/Version.h's version and the task
    binary format that a binary it compiles carries; the package installs
    under the same version."""
    repo = Path(__file__).resolve().parents[3]
    header = (repo / "base" / "Version.h").read_text()
    want = re.search(r'#define MOEC_VERSION_STRING "([0-9.]+)"', header).group(1)
    got = moec_torch.native.library_version()
    assert got["version"] == want
    setup = (repo / "ops" / "torch" / "setup.py").read_text()
    assert re.search(r'version="([0-9.]+)"', setup).group(1) == want
    out = tmp_path / "fwd.moebin"
    moec_torch.compile(str(repo / "graphs" / "moe_ffn_fwd.json"),
                       str(repo / "examples" / "configs" / "tiny.json"), str(out))
    assert moec_torch.dump(str(out))["file"]["format_version"] == got["binary_format"] >= 1


def test_the_package_names_its_modules_state():
    """The package re-exports its modules' names: the in-memory compile
    cache is the cache module's dict, the launch flags are read from
    _launch, and a star import leaves the builtin compile alone."""
    assert moec_torch._compiled is moec_torch.cache._compiled
    moec_torch.load_library()
    assert moec_torch._loaded is True and "_loaded" in dir(moec_torch)
    assert moec_torch.compile is moec_torch.native.compile
    assert "compile" not in moec_torch.__all__
    names = {}
    exec("from moec_torch import *", names)
    assert "compile" not in names and set(moec_torch.__all__) <= set(names)


# Errors cross into Python as exceptions with the runtime's message.

@pytest.fixture(scope="module")
def tiny():
    # The runtime's own errors: no growth on over-capacity.
    return moec_torch.MoeFFN(config(experts=4, top_k=2, tokens=128), 2, threads=2,
                             capacity_policy="error")


def good(layer):
    return inputs(layer, seed=40)[:3]


def test_error_wrong_dtype(tiny):
    x, ids, weights = good(tiny)
    with pytest.raises(RuntimeError, match="'x' is f64; expected f32, the layer's dtype"):
        tiny(x.double(), ids, weights)
    with pytest.raises(RuntimeError, match="topk_weights is bf16; expected f32"):
        tiny(x, ids, weights.bfloat16())
    with pytest.raises(RuntimeError, match="topk_ids is f32; expected i32 or i64"):
        tiny(x, ids.float(), weights)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_autocast_casts_the_inputs_as_torch_ops_do(dtype):
    """Inside torch.autocast("cpu", bfloat16): x of another floating dtype
    and bf16 topk_weights (a router's Linear under autocast gives them) are
    cast to the layer's dtype and float32; y and every gradient bitwise
    those of the same layer on inputs cast by hand, x's gradient back in
    x's dtype. Outside autocast nothing is cast (test_error_wrong_dtype)."""
    torch.manual_seed(0)
    layer = moec_torch.MoeFFN(config(dtype=dtype), ranks=2, threads=1)
    x, ids, weights, dy = inputs(layer, 3)
    given = x.to(torch.float32 if dtype == "bf16" else torch.bfloat16)
    runs = []
    for autocast in (True, False):
        a, w = given.clone().requires_grad_(), weights.bfloat16().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(a, ids, w) if autocast else layer(a.to(layer.dtype), ids, w.float())
        assert y.dtype == layer.dtype
        y.backward(dy)
        assert a.grad.dtype == given.dtype and w.grad.dtype == torch.bfloat16
        runs.append([y, a.grad, w.grad, layer.w1.grad, layer.w2.grad])
        layer.zero_grad(set_to_none=True)
    for name, got, want in zip(("y", "dx", "dtopk_weights", "dw1", "dw2"), *runs):
        assert torch.equal(got, want), name
    ex = moec_torch.Exchange(config(dtype=dtype), ranks=2, threads=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rows, counts, handle = ex.dispatch(given, ids, weights.bfloat16())
        assert rows.dtype == ex.dtype
        y = ex.combine(rows.to(given.dtype), handle)
    want_rows, _, want_handle = ex.dispatch(given.to(ex.dtype), ids, weights.bfloat16().float())
    assert torch.equal(rows, want_rows)
    assert torch.equal(y, ex.combine(want_rows, want_handle))


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_gives_the_same_gradients(reentrant):
    """A router and the layer inside torch.utils.checkpoint (as Hugging
    Face's gradient_checkpointing_enable() wraps each decoder layer): the
    forward runs again inside backward, and every gradient is bitwise the
    plain run's, two steps in a row."""
    import torch.utils.checkpoint as cp
    torch.manual_seed(0)
    layer = moec_torch.MoeFFN(config(), ranks=2, threads=1)
    router = torch.nn.Linear(layer.hidden, layer.experts)
    x = inputs(layer, 5)[0].requires_grad_()

    def block(x):
        weights, ids = router(x).softmax(-1).topk(layer.top_k)
        return layer(x, ids, weights)

    runs = []
    for checkpointed in (False, True):
        for _ in range(2):
            y = cp.checkpoint(block, x, use_reentrant=reentrant) if checkpointed else block(x)
            y.square().sum().backward()
        runs.append([t.grad.clone() for t in (x, router.weight, layer.w1, layer.w2)])
        for t in (x, router.weight, router.bias, layer.w1, layer.w2):
            t.grad = None
    for name, got, want in zip(("x", "router", "w1", "w2"), *runs):
        assert torch.equal(got, want), name


def test_module_conversions_keep_the_layers_dtype():
    """model.to(torch.bfloat16), .half(), .double() around an fp32 layer
    convert the rest of the model; the layer keeps its dtype and values
    (its binaries are fp32), warns once and runs as before; a move off the
    CPU is refused, naming the device; conversions to its own dtype are
    quiet. A quantized layer's float32 scales stay float32
    (test_quant.py); a patched Hugging Face model (test_hf.py)."""
    import warnings
    torch.manual_seed(0)
    layer = moec_torch.MoeFFN(config(), ranks=2, threads=1)
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(layer.hidden, layer.hidden),
                                 "moe": layer})
    x, ids, weights = inputs(layer, 2)[:3]
    before = {n: t.clone() for n, t in layer.state_dict().items() if torch.is_tensor(t)}
    y = layer(x, ids, weights)
    with pytest.warns(UserWarning, match=r"the MoeFFN layer stays torch.float32 "
                      r"\(torch.bfloat16 asked\)"):
        model.to(torch.bfloat16)
    assert model["proj"].weight.dtype == torch.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: no second warning
        model.half()
        model.double()
        model.float()
    assert model["proj"].weight.dtype == torch.float32
    for n, t in layer.state_dict().items():
        if torch.is_tensor(t):
            assert t.dtype == before[n].dtype and torch.equal(t, before[n]), n
    assert torch.equal(layer(x, ids, weights), y)
    with pytest.raises(RuntimeError, match="a MoeFFN layer cannot move to meta: the moec "
                       "runtime runs on the CPU"):
        layer.to("meta")
    assert not layer.w1.is_meta and torch.equal(layer.w1, before["w1"])
    quiet = moec_torch.MoeFFN(config(), ranks=2, threads=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet.to(torch.float32)
        quiet.float()
        quiet.to("cpu")
        quiet.share_memory()


def test_error_wrong_device(tiny):
    x, ids, weights = good(tiny)
    with pytest.raises(RuntimeError, match="'x' is on meta; the moec runtime runs on the CPU"):
        tiny(x.to("meta"), ids, weights)


def test_error_wrong_shape(tiny):
    x, ids, weights = good(tiny)
    with pytest.raises(RuntimeError, match="expected dim 0 to be ranks = 2"):
        tiny(x[:1], ids[:1], weights[:1])
    with pytest.raises(RuntimeError, match=r"rank 0: tensor 'x' has shape \[128, 48\]; expected \[128, 64\]"):
        tiny(x[:, :, :48], ids, weights)
    with pytest.raises(RuntimeError, match="129 tokens x top-2 = 258 rows; the binary serves at most 256"):
        big = torch.zeros(2, 129, tiny.hidden)
        tiny(big, *routing(2, 129, tiny.experts, 2))


def test_error_routing(tiny):
    x, ids, weights = good(tiny)
    bad = ids.clone()
    bad[1, 5, 0] = tiny.experts
    with pytest.raises(RuntimeError, match=r"rank 1: topk_ids\[5\]\[0\] = 4 is not an expert"):
        tiny(x, bad, weights)
    dup = ids.clone()
    dup[0, 3, 1] = dup[0, 3, 0]
    with pytest.raises(RuntimeError, match=r"rank 0: topk_ids: token 3 routes to expert \d twice"):
        tiny(x, dup, weights)


def test_error_capacity():
    layer = moec_torch.MoeFFN(config(experts=4, top_k=2, tokens=128, capacity_factor=1.5), 2,
                              threads=2, capacity_policy="error")
    x, _, weights, _ = inputs(layer, seed=50)
    # Every token of both ranks picks experts 0 and 1, both on rank 0.
    ids = torch.tensor([0, 1]).expand(2, 128, 2).contiguous()
    with pytest.raises(RuntimeError, match="capacity"):
        layer(x, ids, weights)
    # The layer still works after the error.
    check_step(layer, *inputs(layer, seed=51), tol=FP32_TOL)


def test_error_config_does_not_compile():
    # 3 experts cannot be shared by 2 ranks (any token count would compile).
    with pytest.raises(RuntimeError, match=r"moec compile moe_ffn_fwd.json failed:\n.*"
                                           r"'num_experts' \(3\) must be a multiple of 'ep' \(2\)"):
        moec_torch.MoeFFN(config(experts=3, top_k=1), 2)


def test_error_backward_without_backward_binary(tiny):
    forward, _ = moec_torch.compile_layer(config(experts=4, top_k=2, tokens=128), 2)
    layer = torch.classes.moec.Layer(forward, "", 2, 60.0, "inproc", False, "all", 0, 0.0)
    x, ids, weights = good(tiny)
    y, step = torch.ops.moec.forward(layer, x, ids, weights, tiny.w1.detach(), tiny.w2.detach(),
                                     [])
    assert y.shape == x.shape
    with pytest.raises(RuntimeError, match="built without a backward binary"):
        torch.ops.moec.backward(layer, step, x, ids, weights, tiny.w1.detach(),
                                tiny.w2.detach(), torch.ones_like(y), None, None, [])


def test_capacity_grows_when_routing_collapses():
    """A training loop whose router collapses onto one expert keeps going: the
    layer recompiles with more capacity (warning once per growth, never
    shrinking) and its gradients still match autograd."""
    torch.manual_seed(11)
    layer = moec_torch.MoeFFN(config(experts=8, top_k=2, capacity_factor=1.5), 2, threads=2)
    start = layer.layer.info()["receive_capacity"]
    seen = []
    for step, hot in enumerate([None, None, 0, 0, None]):
        x, ids, weights, dy = inputs(layer, seed=20 + step, hot=hot)
        if hot is not None:
            # Every token's second choice is expert 1: all rows to rank 0.
            ids[..., 1] = torch.where(ids[..., 0] == 1, 2, 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_step(layer, x, ids, weights, dy, tol=FP32_TOL)
        seen.append((len([w for w in caught if "recompiled with" in str(w.message)]),
                     layer.layer.info()["receive_capacity"]))
    grew = [n for n, _ in seen]
    capacities = [c for _, c in seen]
    assert grew[0] == grew[1] == 0 and sum(grew) >= 1, seen
    assert capacities[2] > start, seen
    assert capacities == sorted(capacities), seen  # never shrinks
    assert layer.config["capacity_factor"] > 1.5


def test_capacity_advice_is_the_compilers_arithmetic():
    # What libmoec advises for a need is what a binary compiled with the
    # advice holds, and what the runtime advises from the binary's layer
    # record: one function behind the advice and the compile.
    cfg = config(experts=8, top_k=2, capacity_factor=1)
    layer = moec_torch.MoeFFN(cfg, 2, threads=1).layer
    info = layer.info()
    need = info["receive_capacity"] + 5
    advice = moec_torch.native.capacity_advice(dict(cfg, ep=2), info["tokens"] * 2, need)
    for headroom in (False, True):
        assert list(layer.capacity_advice(info["tokens"] * 2, need, headroom)) == list(
            moec_torch.native.capacity_advice(dict(cfg, ep=2), info["tokens"] * 2, need,
                                              headroom).values())
    assert advice["fits"] and advice["seq_size"] == info["tokens"]
    assert advice["capacity_factor"] > 1
    grown = moec_torch.MoeFFN(dict(cfg, capacity_factor=advice["capacity_factor"]), 2, threads=1)
    assert grown.layer.info()["receive_capacity"] == advice["receive_capacity"] >= need
    with pytest.raises(RuntimeError, match="'top_k'"):
        moec_torch.native.capacity_advice(dict(cfg, ep=2, top_k=0), 1, 1)


def test_config_check_is_the_compilers():
    # native.check_config runs the compiler's checks (moec_config_check):
    # what compiles passes, and what would not is refused with its message.
    cfg = dict(config(experts=8, top_k=2), ep=2)
    moec_torch.native.check_config(cfg)
    moec_torch.native.check_config(dict(cfg, dispatch_dtype="fp8_e4m3"))
    with pytest.raises(ValueError, match="the config: 'top_k'"):
        moec_torch.native.check_config(dict(cfg, top_k=0))
    with pytest.raises(ValueError, match="the config: 'dispatch_dtype' must be"):
        moec_torch.native.check_config(dict(cfg, dispatch_dtype="int8"))
    with pytest.raises(RuntimeError, match="row counts must not be negative, got -1 and 1"):
        moec_torch.native.capacity_advice(dict(cfg, ep=2), -1, 1)


def test_the_timeout_has_one_range_and_one_default():
    # base/Time.h's, read through the op library: the Python package writes
    # none of its own, and a layer left to the default gets the runtime's.
    header = (Path(__file__).resolve().parents[3] / "base" / "Time.h").read_text()
    want = [float(re.search(rf"constexpr double {n} = ([0-9.e+-]+);", header).group(1))
            for n in ("kTimeoutMinSeconds", "kTimeoutMaxSeconds", "kDefaultTimeoutSeconds")]
    moec_torch.load_library()
    assert list(moec_torch.checks.timeout_limits()) == want
    assert moec_torch.checks.TIMEOUT_RANGE == tuple(want[:2])
    assert moec_torch.checks.seconds(None, "t") == want[2]
    cfg = dict(config(experts=8, top_k=2), ep=2)
    layer = moec_torch.MoeFFN(cfg, 2, threads=1)
    assert layer._build[1] == want[2]
    with pytest.raises(ValueError, match="from 0.001 to 1000000, got 2000000"):
        moec_torch.MoeFFN(cfg, 2, threads=1, timeout_seconds=2e6)


def test_the_compiler_library_returns_a_status_a_caller_owns():
    # libmoec's calls return a moec_status_t (base/moec_status.h): NULL on
    # success, else an error with its code and message, freed by the caller.
    lib = moec_torch.native._library()
    lib.moec_status_code.argtypes = [ctypes.c_void_p]
    lib.moec_status_code.restype = ctypes.c_int
    assert lib.moec_config_check(json.dumps(dict(config(experts=8, top_k=2), ep=2)).encode()) is None
    status = lib.moec_config_check(None)
    assert status
    assert lib.moec_status_code(status) == 1  # MOEC_ERROR
    assert lib.moec_status_message(status) == b"moec_config_check needs a config"
    lib.moec_status_free(status)
    assert lib.moec_status_code(None) == 0 and lib.moec_status_message(None) == b""
    lib.moec_status_free(None)
    with pytest.raises(RuntimeError, match="moec_simulate_trace needs an output path"):
        moec_torch.native._call("moec_simulate_trace", b"x.moebin", None, None, outputs=0)


def test_the_binaries_carry_the_config_they_were_compiled_from():
    # The layer record: the config's values as compiled, read back from the
    # binaries, whatever the config left to its defaults.
    cfg = config(experts=8, top_k=2, dtype="bf16", capacity_factor=1.25,
                 dispatch_dtype="fp8_e4m3")
    layer = moec_torch.MoeFFN(cfg, 2, threads=1, main_grad=True)
    record = json.loads(layer.layer.layer_record())
    for key in ("hidden_size", "intermediate_size", "num_experts", "top_k", "seq_size",
                "dtype", "capacity_factor", "dispatch_dtype"):
        assert record[key] == cfg[key], key
    assert record["main_grad"] is True and record["lora_rank"] == 0
    assert record["row_capacity"] == 128 * 2
    assert record["receive_capacity"] == layer.layer.info()["receive_capacity"] == 320
    assert layer.dispatch_dtype == "fp8_e4m3"
    lora = moec_torch.MoeFFN(config(), 1, threads=1, lora_rank=4, lora_alpha=8)
    record = json.loads(lora.layer.layer_record())
    assert (record["lora_rank"], record["lora_alpha"]) == (4, 8.0)
    assert record["capacity_factor"] == 2.0 and record["dispatch_dtype"] == "fp32"


def test_more_tokens_than_compiled_grows_seq_size():
    layer = moec_torch.MoeFFN(config(experts=4, top_k=2, tokens=128), 2, threads=2)
    with pytest.warns(RuntimeWarning, match=r"recompiled with seq_size 128 -> 129"):
        check_step(layer, *inputs(layer, seed=5, tokens=129), tol=FP32_TOL)
    assert layer.tokens == 129


def test_growth_whose_compile_fails_says_so_and_keeps_the_layer(monkeypatch):
    """The grown layer failing to compile: the pass raises the compiler's
    error with the growth it was for; the layer keeps its binaries and runs
    the passes they hold."""
    layer = moec_torch.MoeFFN(config(experts=4, top_k=2, tokens=128), 2, threads=2)

    def compile_layer(*args, **kwargs):
        raise RuntimeError("moec compile moe_ffn_fwd.json failed: no space left (a test)")

    monkeypatch.setattr(moec_torch.cache, "compile_layer", compile_layer)
    with pytest.raises(RuntimeError, match=r"^moec over capacity: .*\. The layer grows on no "
                       r"rank: compiling the grown layer failed: RuntimeError: moec compile "
                       r"moe_ffn_fwd.json failed: no space left \(a test\)$"):
        layer(*inputs(layer, seed=5, tokens=129)[:3])
    assert layer.tokens == 128
    check_step(layer, *inputs(layer, seed=5, tokens=128), tol=FP32_TOL)


def test_capacity_policy_error():
    layer = moec_torch.MoeFFN(config(experts=4, top_k=2, capacity_factor=1), 2, threads=2,
                              capacity_policy="error")
    x, ids, weights, dy = inputs(layer, seed=3)
    ids[..., 0] = 0
    ids[..., 1] = 1
    with pytest.raises(RuntimeError, match="moec over capacity: routing over capacity"):
        layer(x, ids, weights)
    with pytest.raises(ValueError, match="capacity_policy must be 'grow' or 'error'"):
        moec_torch.MoeFFN(config(experts=4, top_k=2), 2, capacity_policy="shrink")
    # The policy may change later, checked as at construction.
    with pytest.raises(ValueError, match="capacity_policy must be 'grow' or 'error', got None"):
        layer.capacity_policy = None
    layer.capacity_policy = "grow"
    with pytest.warns(RuntimeWarning, match="recompiled with"):
        layer(x, ids, weights)


def test_check_finite_names_the_tensor_and_rank():
    layer = moec_torch.MoeFFN(config(experts=4, top_k=2), 2, threads=2, check_finite=True)
    x, ids, weights, dy = inputs(layer, seed=6)
    x[1, 7, 3] = float("nan")
    with pytest.raises(ValueError, match=r"'x' of rank 1 holds 1 NaN/inf value"):
        layer(x, ids, weights)
    x, ids, weights, dy = inputs(layer, seed=6)
    y = layer(x, ids, weights)
    dy[0, 2, 2] = float("inf")
    with pytest.raises(ValueError, match=r"'dy' of rank 0 holds 1 NaN/inf value"):
        y.backward(dy)
    # Off by default: the same NaN passes through silently.
    plain = moec_torch.MoeFFN(config(experts=4, top_k=2), 2, threads=2)
    x[1, 7, 3] = float("nan")
    assert torch.isnan(plain(x, ids, weights)).any()


def test_bad_timeout_and_threads():
    moec_torch.load_library()
    forward, backward = moec_torch.compile_layer(config(experts=4, top_k=2), 2)
    for timeout in (0.0, -5.0, float("nan"), float("inf"), 1e300, 1e-9):
        with pytest.raises(RuntimeError, match="timeout_seconds must be from 0.001 to 1e\\+06 "
                                               "seconds"):
            torch.classes.moec.Layer(forward, backward, 1, timeout, "inproc", False, "all", 0, 0.0)
    with pytest.raises(RuntimeError, match="workers must be 0 .* to 1024, got 1000000"):
        torch.classes.moec.Layer(forward, backward, 10**6, 60.0, "inproc", False, "all", 0, 0.0)


def test_compile_cache_checks_what_it_finds(tmp_path, monkeypatch):
    """A cache entry holding another layer's binaries, or a directory where a
    binary belongs, is compiled anew instead of trusted."""
    monkeypatch.setenv("MOEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(moec_torch.cache, "_compiled", {})
    small, big = config(hidden=64), config(hidden=128)
    fwd_small, bwd_small = moec_torch.compile_layer(small, 2)
    fwd_big, bwd_big = moec_torch.compile_layer(big, 2)
    # Plant H=128 binaries in the entry of the H=64 config.
    Path(fwd_small).write_bytes(Path(fwd_big).read_bytes())
    Path(bwd_small).write_bytes(Path(bwd_big).read_bytes())
    monkeypatch.setattr(moec_torch.cache, "_compiled", {})
    layer = moec_torch.MoeFFN(small, 2, threads=2)
    assert layer.hidden == 64
    check_step(layer, *inputs(layer, seed=8), tol=FP32_TOL)
    # A directory where the forward binary belongs.
    Path(fwd_small).unlink()
    Path(fwd_small).mkdir()
    monkeypatch.setattr(moec_torch.cache, "_compiled", {})
    assert moec_torch.MoeFFN(small, 2, threads=2).hidden == 64


def test_trace_of_the_layers_passes(tmp_path):
    """trace=True: write_trace writes each pass as it ran, every task of
    every rank once, in the format load_trace reads (that of moec run)."""
    ranks, tokens = 2, 64
    layer = moec_torch.MoeFFN(config(tokens=tokens), ranks=ranks, threads=2, trace=True)
    ids, weights = routing(ranks, tokens, layer.experts, layer.top_k, seed=3)
    x = torch.randn(ranks, tokens, layer.hidden)
    with pytest.raises(RuntimeError, match="no forward pass has run to the end yet"):
        layer.write_trace(tmp_path / "early.json", "forward")
    y = layer(x, ids, weights.requires_grad_())
    y.square().sum().backward()
    layer.write_trace(tmp_path / "fwd.json", "forward")
    layer.write_trace(tmp_path / "last.json")
    (tmp_path / "config.json").write_text(json.dumps({**config(tokens=tokens), "ep": ranks}))
    binaries = {}
    for name, graph in (("fwd", "moe_ffn_fwd.json"), ("bwd", "moe_ffn_bwd.json")):
        binaries[name] = tmp_path / f"{name}.moebin"
        moec_torch.compile(graph, tmp_path / "config.json", binaries[name])
    for name, path in (("fwd", "fwd.json"), ("bwd", "last.json")):
        trace = moec_torch.load_trace(tmp_path / path)
        info = moec_torch.dump(binaries[name])
        ops = {op["name"]: op["tasks"] for op in info["ops"]}
        # Every task of every rank, once.
        seen = sorted((t["rank"], t["task"]) for t in trace["tasks"])
        assert seen == sorted((r, t) for r in range(ranks) for t in range(sum(ops.values())))
        counts = {}
        for t in trace["tasks"]:
            counts[t["op_name"]] = counts.get(t["op_name"], 0) + 1
        assert counts == {op: n * ranks for op, n in ops.items()}
        # Each run's time off its core lies within the run.
        assert all(0 <= t["off_core_us"] <= t["dur_us"] + 1e-3 for t in trace["tasks"])
        assert {p["name"] for p in trace["phases"]} == {"prepare", "tasks", "finish"}
    with pytest.raises(RuntimeError, match="'forward', 'backward' or 'last'"):
        layer.write_trace(tmp_path / "x.json", "sideways")
    plain = moec_torch.MoeFFN(config(tokens=tokens), ranks=ranks, threads=2)
    plain(x, ids, weights)
    with pytest.raises(RuntimeError, match="tracing is off"):
        plain.write_trace(tmp_path / "off.json")


def test_profile_of_the_layers_passes():
    """profile(): the table of moec run --profile for each pass, with the
    work counted on the routed rows (R S K rows through up_proj: 2 R S K H
    2I FLOPs), and the op call's time around the runtime's pass."""
    ranks, tokens = 2, 64
    layer = moec_torch.MoeFFN(config(tokens=tokens), ranks=ranks, threads=2, trace=True)
    ids, weights = routing(ranks, tokens, layer.experts, layer.top_k, seed=3)
    x = torch.randn(ranks, tokens, layer.hidden)
    with pytest.raises(RuntimeError, match="no traced forward pass"):
        layer.profile("forward")
    y = layer(x, ids, weights.requires_grad_())
    y.square().sum().backward()
    forward = layer.profile("forward")
    rows = ranks * tokens * layer.top_k
    flops = 2 * rows * layer.hidden * 2 * layer.inter
    assert re.search(r"^forward pass: [0-9.]+ ms \(prepare", forward, re.M), forward
    line = next(l for l in forward.splitlines() if l.strip().startswith("up_proj"))
    work = re.search(r"([0-9.]+) ([kMG])FLOP", line)
    scale = {"k": 1e3, "M": 1e6, "G": 1e9}[work.group(2)]
    assert abs(float(work.group(1)) * scale - flops) <= 0.01 * flops, (line, flops)
    assert re.search(r"^the op call: [0-9.]+ ms, the runtime's pass [0-9.]+ ms of it", forward,
                     re.M), forward
    backward = layer.profile("backward")
    assert "swiglu_grad" in backward and "worker 1" in backward, backward
    assert re.search(r"^  worker 1 +busy +[0-9.]+ ms, idle +[0-9.]+ ms, off its core in runs "
                     r"+[0-9.]+ ms$", backward, re.M), backward
    assert re.search(r"^  of that busy time [0-9.]+ ms \([0-9.]+%\) off the cores", backward,
                     re.M), backward
    with pytest.raises(RuntimeError, match="'forward' or 'backward'"):
        layer.profile("last")


def test_workspace_table_and_totals():
    """workspace(): the runtime's tensors per pass, allocated and resident;
    backward's send rows live in forward's dead ones; info() has the
    totals."""
    ranks, tokens = 2, 64
    layer = moec_torch.MoeFFN(config(tokens=tokens), ranks=ranks, threads=2)
    assert "no pass has run yet" in layer.workspace()
    x, ids, weights, dy = inputs(layer, seed=5)
    layer(x, ids, weights).backward(dy)
    table = layer.workspace()
    info = layer.info()
    assert 0 < info["workspace_resident"] <= info["workspace_bytes"], info
    head = re.search(r"([0-9.]+) MiB allocated, ([0-9.]+) MiB resident", table)
    assert head and abs(float(head.group(1)) - info["workspace_bytes"] / 2**20) < 0.1, table
    send = [l.split() for l in table.splitlines() if re.match(r"\s+(forward|backward)\s+src\s", l)]
    assert [s[0] for s in send] == ["forward", "backward"], table
    assert send[1][3] == "-" and "dead forward slot" in " ".join(send[1]), table


def test_reset_parameters_draws_the_whole_layer():
    """The weights are one draw of all E experts (drawn an expert at a
    time), whichever of them this process holds."""
    torch.manual_seed(11)
    layer = moec_torch.MoeFFN(config(experts=4), ranks=2, threads=1)
    torch.manual_seed(11)
    w1 = torch.empty(4, layer.hidden, 2 * layer.inter).uniform_(-layer.hidden ** -0.5,
                                                                 layer.hidden ** -0.5)
    w2 = torch.empty(4, layer.inter, layer.hidden).uniform_(-layer.inter ** -0.5,
                                                            layer.inter ** -0.5)
    assert torch.equal(layer.w1.detach(), w1)
    assert torch.equal(layer.w2.detach(), w2)
