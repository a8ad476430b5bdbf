"""MoeFFN's asynchronous calls: submit_forward / submit_backward return
handles whose wait() gives y and the gradients; Python work between submit
and wait runs beside the pass; autograd works with handles waited inside a
custom autograd.Function; a handle waited twice, or dropped unwaited, is an
error and not a hang."""

import gc
import time
import warnings

import pytest
import torch

import moec_torch
from moec_torch import reference
from test_moe_ffn import config, inputs, rel_err, FP32_TOL


def make(ranks=2, threads=1, **kw):
    torch.manual_seed(0)
    return moec_torch.MoeFFN(config(**kw), ranks=ranks, threads=threads)


def test_handle_gives_the_forward_and_autograd_works():
    layer = make()
    x, ids, weights, dy = inputs(layer, 1)
    x1 = x.clone().requires_grad_()
    w1 = weights.clone().requires_grad_()
    y_sync = layer(x1, ids, w1)
    y_sync.backward(dy)
    want = (x1.grad.clone(), w1.grad.clone(), layer.w1.grad.clone(), layer.w2.grad.clone())
    layer.zero_grad()

    x2 = x.clone().requires_grad_()
    w2 = weights.clone().requires_grad_()
    handle = layer.submit_forward(x2, ids, w2)
    y = handle.wait()
    assert torch.equal(y, y_sync)
    assert y.grad_fn is not None
    y.backward(dy)
    got = (x2.grad, w2.grad, layer.w1.grad, layer.w2.grad)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


class _Fused(torch.autograd.Function):
    """A user's Function that waits the layer's handles inside forward and
    backward, with Python work in between."""

    @staticmethod
    def forward(ctx, layer, x, ids, weights, w1, w2):
        handle = layer.submit_forward(x, ids, weights)
        shared = x * 2          # other work while the layer runs
        y = handle.wait()
        ctx.layer, ctx.handle = layer, handle
        return y + shared

    @staticmethod
    def backward(ctx, dy):
        pending = ctx.layer.submit_backward(ctx.handle, dy)
        dshared = dy * 2        # other work while the backward runs
        g = pending.wait()
        assert isinstance(g, moec_torch.Gradients)
        return None, g.dx + dshared, None, g.dtopk_weights, g.dw1, g.dw2


@pytest.mark.parametrize("ranks", [1, 2])
def test_handles_inside_a_custom_function_match_autograd(ranks):
    layer = make(ranks=ranks, experts=4, top_k=2)
    x, ids, weights, dy = inputs(layer, 2)
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    y = _Fused.apply(layer, x, ids, weights, layer.w1, layer.w2)
    y.backward(dy)

    xd = x.detach().double().requires_grad_()
    wd = weights.detach().double().requires_grad_()
    w1 = layer.w1.detach().double().requires_grad_()
    w2 = layer.w2.detach().double().requires_grad_()
    yd = reference.moe_ffn(xd, ids, wd, w1, w2) + xd * 2
    yd.backward(dy.double())
    errors = {"y": rel_err(y, yd), "dx": rel_err(x.grad, xd.grad),
              "dtopk": rel_err(weights.grad, wd.grad), "dw1": rel_err(layer.w1.grad, w1.grad),
              "dw2": rel_err(layer.w2.grad, w2.grad)}
    assert all(v <= FP32_TOL for v in errors.values()), errors


def test_main_grad_handles_add_into_main_grad():
    torch.manual_seed(0)
    layer = moec_torch.MoeFFN(config(), ranks=2, threads=1, main_grad=True)
    x, ids, weights, dy = inputs(layer, 3)
    layer(x, ids, weights.clone().requires_grad_()).backward(dy)
    want = (layer.w1.main_grad.clone(), layer.w2.main_grad.clone())
    layer.zero_main_grad()
    handle = layer.submit_forward(x, ids, weights)
    with torch.no_grad():
        handle.wait()
    g = layer.submit_backward(handle, dy).wait()
    assert g.dw1 is None and g.dw2 is None
    assert layer.w1.grad_added_to_main_grad
    assert torch.equal(layer.w1.main_grad, want[0]) and torch.equal(layer.w2.main_grad, want[1])


def _python_work(seconds):
    """Pure Python work (it holds the GIL) for about `seconds`."""
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        n += sum(range(100))
    return n


def test_python_work_overlaps_the_pass():
    # One runtime worker, so that the pass and the Python thread each have a
    # core of a 2-core machine; a pass of some 0.1 s.
    layer = make(ranks=2, threads=1, hidden=512, inter=512, tokens=512, experts=8)
    x, ids, weights, dy = inputs(layer, 4)
    with torch.no_grad():
        layer(x, ids, weights)  # warm: pages, caches
        trials = []
        for _ in range(3):  # the best of three: the machine is shared
            start = time.perf_counter()
            layer(x, ids, weights)
            alone = time.perf_counter() - start
            start = time.perf_counter()
            handle = layer.submit_forward(x, ids, weights)
            assert not handle.done()  # a pass of some 0.1 s has just begun
            _python_work(alone)
            while not handle.done():  # polling, as a training loop might
                time.sleep(0.001)
            handle.wait()
            assert handle.done()
            trials.append((time.perf_counter() - start) / (2 * alone))
    # Serial, the pass and the work would take the sum, twice the pass.
    assert min(trials) < 0.8, trials


def test_waited_twice_is_an_error():
    layer = make()
    x, ids, weights, dy = inputs(layer, 5)
    handle = layer.submit_forward(x, ids, weights)
    handle.wait()
    with pytest.raises(RuntimeError, match="already waited"):
        handle.wait()
    pending = layer.submit_backward(handle, dy)
    pending.wait()
    with pytest.raises(RuntimeError, match="already waited"):
        pending.wait()


def test_dropped_handle_is_an_error_at_the_next_call_and_no_hang():
    layer = make()
    x, ids, weights, dy = inputs(layer, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = layer.submit_forward(x, ids, weights)
        del handle
        gc.collect()
    assert any("dropped without wait()" in str(w.message) for w in caught)
    assert layer.layer.pending() == 0
    with pytest.raises(RuntimeError, match="dropped without wait"):
        layer(x, ids, weights)
    # Said once; the layer works after.
    y = layer(x, ids, weights)
    assert torch.isfinite(y).all()


def test_errors_come_out_of_wait():
    layer = make(experts=4)
    x, ids, weights, dy = inputs(layer, 7)
    bad = ids.clone()
    bad[1, 5, 0] = 9
    handle = layer.submit_forward(x, bad, weights)
    with pytest.raises(RuntimeError, match="is not an expert"):
        handle.wait()
    with pytest.raises(RuntimeError, match="wait\\(\\) the forward handle"):
        layer.submit_backward(layer.submit_forward(x, ids, weights), dy)
    # That handle was never waited either: the next call says so.
    gc.collect()
    with pytest.raises(RuntimeError, match="dropped without wait"):
        layer(x, ids, weights)


def test_backward_handle_of_an_older_forward_recomputes_it():
    layer = make()
    x, ids, weights, dy = inputs(layer, 8)
    x2, ids2, weights2, _ = inputs(layer, 9)
    first = layer.submit_forward(x, ids, weights)
    second = layer.submit_forward(x2, ids2, weights2)
    first.wait()
    second.wait()
    g = layer.submit_backward(first, dy).wait()
    layer.zero_grad()
    xr = x.clone().requires_grad_()
    layer(xr, ids, weights).backward(dy)
    assert torch.equal(g.dx, xr.grad)
    assert torch.equal(g.dw1, layer.w1.grad)


# --- inputs changed while a submitted pass runs ---------------------------------------

@pytest.mark.parametrize("change", ["x", "topk_weights", "w2", "adapters"])
def test_an_input_changed_before_wait_is_an_error(change, tmp_path):
    lora = change == "adapters"
    layer = moec_torch.MoeFFN(config(), ranks=2, threads=1,
                              **({"lora_rank": 4} if lora else {}))
    x, ids, weights, _ = inputs(layer, 3)
    if lora:
        layer.save_adapters(tmp_path)
    handle = layer.submit_forward(x, ids, weights)
    with torch.no_grad():
        if change == "x":
            x.fill_(float("nan"))
        elif change == "topk_weights":
            weights.mul_(2)
        elif change == "w2":
            layer.w2.zero_()
        else:
            layer.load_adapters(tmp_path)
    name = {"adapters": "w1_lora_A"}.get(change, change)
    with pytest.raises(RuntimeError, match=f"'{name}'.* changed in place after submit_forward "
                                           "and before wait"):
        handle.wait()
    # The layer goes on: the next pass runs on the inputs as they are now.
    x2, ids2, weights2, _ = inputs(layer, 4)
    assert torch.isfinite(layer.submit_forward(x2, ids2, weights2).wait()).all()


def test_dy_changed_before_the_backward_wait_is_an_error():
    layer = make()
    x, ids, weights, dy = inputs(layer, 5)
    with torch.no_grad():
        forward = layer.submit_forward(x, ids, weights)
        forward.wait()
    backward = layer.submit_backward(forward, dy)
    dy.zero_()
    with pytest.raises(RuntimeError, match="'dy' changed in place after submit_backward"):
        backward.wait()


def test_inputs_left_alone_until_wait_give_the_result():
    layer = make()
    x, ids, weights, _ = inputs(layer, 6)
    want = layer(x, ids, weights)
    handle = layer.submit_forward(x, ids, weights)
    x_copy = x.clone()
    x_copy.fill_(1)  # a clone may change: the pass reads x
    assert torch.equal(handle.wait(), want)


# --- fork -------------------------------------------------------------------------------

FORK_CHILD = r"""
import os, sys, time
import torch
import moec_torch
sys.path.insert(0, os.environ["TESTS"])
from test_moe_ffn import config, inputs
layer = moec_torch.MoeFFN(config(), ranks=2, threads=1, timeout_seconds=5)
x, ids, weights, _ = inputs(layer, 1)
want = layer(x, ids, weights)
pending = layer.submit_forward(x, ids, weights) if sys.argv[1] == "in-flight" else None
pid = os.fork()
if pid == 0:
    code = 0
    for call in ("forward", "submit"):
        start = time.time()
        try:
            layer(x, ids, weights) if call == "forward" else layer.submit_forward(x, ids, weights)
            print(f"child: {call} returned", flush=True)
            code = 3
        except RuntimeError as e:
            print(f"child: {call}: {e}", flush=True)
            if time.time() - start > 2 or "a child of fork()" not in str(e):
                code = 4
    # A layer made after the fork works.
    fresh = moec_torch.MoeFFN(config(), ranks=2, threads=1)
    fresh.load_state_dict(layer.state_dict())
    if not torch.equal(fresh(x, ids, weights), want):
        code = 5
    print("child: done", flush=True)
    os._exit(code) if sys.argv[2] == "os-exit" else sys.exit(code)
_, status = os.waitpid(pid, 0)
if pending is not None:
    assert torch.equal(pending.wait(), want)
print("parent: child exit", os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.mark.parametrize("when", ["idle", "in-flight"])
@pytest.mark.parametrize("end", ["os-exit", "sys-exit"])
def test_a_layer_in_a_forked_child_is_refused_at_once(when, end, tmp_path):
    import os
    import subprocess
    import sys
    script = tmp_path / "fork.py"
    script.write_text(FORK_CHILD)
    env = dict(os.environ, TESTS=os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, str(script), when, end], env=env, timeout=120,
                          capture_output=True, text=True)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "parent: child exit 0" in out, out
    assert "child: forward: moec: this layer was created in process" in out, out
    assert "a child of fork()" in out and "child: done" in out, out


@pytest.mark.parametrize("scale", [0.25, 0.375])
def test_a_gradient_scale_reaches_the_weights_only(scale):
    """The weight gradients' factor prepare_ddp sets (folded into dy): dw1,
    dw2 and the adapters' gradients are that times the unscaled ones, dx
    and dtopk_weights the unscaled ones, blocking and submitted alike;
    bitwise for a power of two (0.25), within 1e-5 of each tensor's largest
    value otherwise."""
    def grads(layer, submitted):
        x, ids, weights, dy = inputs(layer, 5)
        x = x.clone().requires_grad_()
        w = weights.clone().requires_grad_()
        layer.zero_grad()
        if not submitted:
            layer(x, ids, w).backward(dy)
            return [x.grad, w.grad] + [p.grad.clone() for p in layer.parameters()
                                       if p.requires_grad]
        handle = layer.submit_forward(x.detach(), ids, w.detach())
        with torch.no_grad():
            handle.wait()
        g = layer.submit_backward(handle, dy).wait()
        return [g.dx, g.dtopk_weights] + [t for t in (g.dw1, g.dw2) if t is not None] + \
            list(g.adapters)

    for kw in ({}, {"lora_rank": 4}):
        torch.manual_seed(0)
        layer = moec_torch.MoeFFN(config(), ranks=2, threads=1, **kw)
        if kw:
            with torch.no_grad():
                for p in layer.adapters():
                    p.uniform_(-0.5, 0.5)
        for submitted in (False, True):
            want = grads(layer, submitted)
            layer._grad_scale = scale
            got = grads(layer, submitted)
            layer._grad_scale = 1.0
            assert len(got) == len(want) > 2
            for i, (g, w) in enumerate(zip(got, want)):
                w = w if i < 2 else w * scale
                if scale == 0.25:
                    assert torch.equal(g, w), (kw, submitted, i)
                else:
                    assert (g - w).abs().max() <= 1e-5 * w.abs().max(), (kw, submitted, i)
