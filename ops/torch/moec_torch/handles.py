"""Passes submitted to the runtime and waited later: MoeFFN.submit_forward
and submit_backward return these handles."""

import warnings

import torch

from . import capacity
from .autograd import (Gradients, MoeFFNFunction, _adapters_from_tp, _after_backward,
                       _check_finite, _from_tp, _TpMainGrads, _unscaled)


class _Pending:
    """A pass submitted to the runtime, running on a thread of its own: a
    ticket of the op library's layer, waited once. Dropped unwaited, it
    waits for the pass, drops its result, and the module's next call raises."""

    what = "pass"

    def __init__(self, module, ticket, layer, reads=()):
        self.module = module
        self.layer = layer  # the runtime it runs on (growth replaces module.layer)
        self.ticket = ticket
        self.waited = False
        # What the pass reads while it runs, with each tensor's version
        # counter (bumped by every in-place change, as autograd's saved
        # tensors are checked): a change before wait() is an error there.
        self.reads = [(name, t, t._version) for name, t in reads if t is not None]

    def _check_unchanged(self):
        """Raises when a tensor the pass read was changed in place between
        submit and wait: the result would mix old and new values."""
        changed = [name for name, t, version in self.reads if t._version != version]
        if changed:
            raise RuntimeError(
                f"moec: {', '.join(repr(n) for n in changed)} changed in place after "
                f"submit_{self.what} and before wait(): the pass reads its inputs and weights "
                "while it runs, so its result would mix old and new values and is dropped. "
                "Keep every tensor a submitted pass reads (x, topk_ids, topk_weights, dy, the "
                "weights, adapters and scales) unchanged until wait() returns; to reuse a "
                "buffer, submit a clone")

    def done(self):
        """True once the pass has ended: wait() then returns at once."""
        return self.waited or self.layer.ready(self.ticket)

    def _take(self):
        if self.waited:
            raise RuntimeError(f"moec: this {self.what} handle was already waited "
                               "(a handle gives its result once)")
        self.waited = True

    def __del__(self):
        if getattr(self, "waited", True):
            return
        try:
            self.layer.discard(self.ticket)
        except Exception:  # noqa: BLE001 - the interpreter may be going down
            return
        self.module._dropped = (f"moec: a {self.what} handle (ticket {self.ticket}) was "
                                "dropped without wait(); its pass ran and its result is lost")
        warnings.warn(self.module._dropped, RuntimeWarning, stacklevel=2)


class ForwardHandle(_Pending):
    """What MoeFFN.submit_forward returns: wait() gives y. Under grad mode
    y takes part in autograd as the module's forward does; inside a custom
    autograd.Function's forward it is a plain tensor, and
    MoeFFN.submit_backward(handle, dy) gives the gradients."""

    what = "forward"

    def __init__(self, module, ticket, inputs, squeeze):
        super().__init__(module, ticket, module.layer,
                         list(zip(("x", "topk_ids", "topk_weights"), inputs)) +
                         module._read_parameters())
        self.inputs = inputs      # x, topk_ids, topk_weights (as the op took them)
        self.squeeze = squeeze
        self.step = None          # the runtime's pass, once waited

    def wait(self):
        """Waits for the forward pass and returns y (raises its error)."""
        self._take()
        m = self.module
        x, ids, weights = self.inputs
        try:
            done = self.layer.wait_forward(self.ticket)
        except RuntimeError as error:
            if "moec over capacity:" not in str(error) or self.layer is not m.layer:
                raise
            self._check_unchanged()
            capacity.grow(m, error)  # grows, or raises (the ranks decide together)
            self.layer = m.layer
            with torch.no_grad():
                done = torch.ops.moec.forward(self.layer, *m._mesh(x, ids, weights),
                                              m._bound())
        self._check_unchanged()
        self.step = done[1]
        y = m._unmesh(MoeFFNFunction.apply(self.layer, *m._mesh(x, ids, weights),
                                           m.check_finite, m.first_rank, m._main_grads(), done,
                                           m._grad_scale, m._adapter_sum(), *m._bound()))
        if m.check_finite:
            _check_finite("y", y, "rank", m.first_rank)
        return y.squeeze(0) if self.squeeze else y


class BackwardHandle(_Pending):
    """What MoeFFN.submit_backward returns: wait() gives the Gradients."""

    what = "backward"

    def __init__(self, module, ticket, layer, main_grads, dy, squeeze, inputs):
        super().__init__(module, ticket, layer,
                         [("dy", dy)] + list(zip(("x", "topk_ids", "topk_weights"), inputs)) +
                         module._read_parameters())
        self.main_grads = main_grads
        self.dy = dy
        self.squeeze = squeeze

    def wait(self):
        """Waits for the backward pass and returns its Gradients (dx and
        dtopk_weights shaped as the forward's inputs were)."""
        self._take()
        m = self.module
        dx, dtopk, dw1, dw2, dadapters = _unscaled(m._grad_scale,
                                                   *self.layer.wait_backward(self.ticket))
        self._check_unchanged()
        if m._tp_here():
            # Every TP rank's dx and dtopk_weights are the whole ones: TP rank
            # 0's; the weight gradients are slices of the whole experts'.
            dx, dtopk = (t.unflatten(0, (-1, m.tp))[:, 0].contiguous() for t in (dx, dtopk))
            if dw1 is not None:
                dw1, dw2 = _from_tp(dw1, dw2, m.local_experts, m.tp)
            dadapters = _adapters_from_tp(dadapters, m.adapter_names(), m.local_experts, m.tp)
            if isinstance(self.main_grads, _TpMainGrads):
                self.main_grads.fold()
        if m._adapter_sum() is not None:
            dadapters = m._sum_adapter_grads(self.layer, dadapters)
        grads = Gradients(dx, dtopk, dw1, dw2, tuple(dadapters))
        _after_backward((m.check_finite, m.first_rank, m.local_experts), self.main_grads,
                        (m.w1, m.w2), self.dy, grads)
        if self.squeeze:
            grads = grads._replace(dx=dx.squeeze(0), dtopk_weights=dtopk.squeeze(0))
        return grads
