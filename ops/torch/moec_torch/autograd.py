"""The layer's autograd: MoeFFNFunction (a forward and backward pass of
the runtime), the tensor-parallel conversions of one process (tokens shared
by the TP ranks, weights sliced per TP rank, main-grad buffers), what every
backward does after its pass, and the finite checks."""

import collections

import torch

from . import quant


def _check_finite(name, tensor, part, first):
    """Raises naming `name` and the first of its dim-0 slices (ranks from
    `first`, or experts) that holds NaN or infinity."""
    bad = ~torch.isfinite(tensor.detach())
    if bad.any():
        rows = bad.reshape(tensor.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
        raise ValueError(f"moec: '{name}' of {part} {first + rows[0]} holds "
                         f"{int(bad.sum())} NaN/inf value(s) in all"
                         + (f" ({part}s {[first + r for r in rows]})" if len(rows) > 1 else ""))


class _TpShare(torch.autograd.Function):
    """The tokens of each EP rank, once per TP rank: [P, ...] -> [P*T, ...]
    (rank e*T + t gets EP rank e's). Every TP rank returns the whole
    gradient of the shared tokens, so backward takes TP rank 0's (it does
    not sum them)."""

    @staticmethod
    def forward(ctx, t, tp):
        ctx.tp = tp
        return t.repeat_interleave(tp, 0)

    @staticmethod
    def backward(ctx, g):
        return g.unflatten(0, (-1, ctx.tp))[:, 0].contiguous(), None


class _TpTake(torch.autograd.Function):
    """The output of each EP rank from its TP ranks, which all hold the same
    bits: [P*T, ...] -> [P, ...] (TP rank 0's). Every TP rank's backward
    needs the whole output gradient, so backward gives it to each."""

    @staticmethod
    def forward(ctx, t, tp):
        ctx.tp = tp
        return t.unflatten(0, (-1, tp))[:, 0].contiguous()

    @staticmethod
    def backward(ctx, g):
        return g.repeat_interleave(ctx.tp, 0), None


def _gate_up_to_tp(w, experts_per_rank, tp):
    """[P*L, K, 2I] (gate columns, then up: w1, B of w1's adapter) ->
    [P*T*L, K, 2I/T], where TP rank t of an expert holds its gate and up
    columns t*I/T .. (t+1)*I/T - 1; rank e*T + t's experts come e*T + t-th.
    Differentiable (a permuted copy)."""
    L, T = experts_per_rank, tp
    n, k, two_i = w.shape
    return w.view(n // L, L, k, 2, T, two_i // 2 // T).permute(0, 4, 1, 2, 3, 5) \
        .reshape(n * T, k, two_i // T)


def _rows_to_tp(w, experts_per_rank, tp):
    """[P*L, I, N] (w2, A of w2's adapter) -> [P*T*L, I/T, N]: TP rank t
    holds rows t*I/T .. (t+1)*I/T - 1. Differentiable."""
    L, T = experts_per_rank, tp
    n, i, k = w.shape
    return w.view(n // L, L, T, i // T, k).permute(0, 2, 1, 3, 4).reshape(n * T, i // T, k)


def _sum_tp(g, experts_per_rank, tp):
    """[P*T*L, ...] -> [P*L, ...]: the TP ranks' partial sums of a tensor
    each holds whole, added in TP rank order."""
    L, T = experts_per_rank, tp
    parts = g.view(g.shape[0] // T // L, T, L, *g.shape[1:])
    total = parts[:, 0].clone()
    for t in range(1, T):
        total += parts[:, t]
    return total.reshape(-1, *g.shape[1:])


class _TpWhole(torch.autograd.Function):
    """[P*L, ...] -> [P*T*L, ...], all of each EP rank's experts' tensor on
    every one of its TP ranks (A of w1's adapter, B of w2's); backward adds
    the TP ranks' partial gradients (_sum_tp)."""

    @staticmethod
    def forward(ctx, w, experts_per_rank, tp):
        ctx.split = (experts_per_rank, tp)
        L, T = experts_per_rank, tp
        n = w.shape[0]
        return w.view(n // L, 1, L, *w.shape[1:]).expand(n // L, T, L, *w.shape[1:]) \
            .reshape(n * T, *w.shape[1:])

    @staticmethod
    def backward(ctx, g):
        return _sum_tp(g, *ctx.split), None, None


def _to_tp(w1, w2, experts_per_rank, tp):
    """The weights of every TP rank, from the whole experts of this process's
    EP ranks: w1 [P*L, H, 2I] -> [P*T*L, H, 2I/T] (_gate_up_to_tp), w2
    [P*L, I, H] -> [P*T*L, I/T, H] (_rows_to_tp). Differentiable."""
    return _gate_up_to_tp(w1, experts_per_rank, tp), _rows_to_tp(w2, experts_per_rank, tp)


def _to_tp_stored(weight_format, w1, w2, scales, experts_per_rank, tp):
    """_to_tp for weights stored [out, in] (weights_transposed; the
    quantized formats' codes, with `scales` (w1's, w2's) or ()): each EP
    rank's experts' part for each of its TP ranks (quant.tp_part), rank
    e*T + t's experts e*T + t-th. Returns (w1, w2, scales), copies."""
    L, T = experts_per_rank, tp
    n = w1.shape[0]
    out = []
    for which, stored, scale in (("w1", w1, scales[0] if scales else None),
                                 ("w2", w2, scales[1] if scales else None)):
        parts = [quant.tp_part(weight_format, which, t, T, stored[e:e + L],
                               None if scale is None else scale[e:e + L])
                 for e in range(0, n, L) for t in range(T)]
        out.append((torch.cat([p for p, _ in parts]),
                    None if scale is None else torch.cat([s for _, s in parts])))
    (w1t, s1), (w2t, s2) = out
    return w1t, w2t, ((s1, s2) if scales else ())


def _gate_up_from_tp(wt, experts_per_rank, tp):
    """The inverse of _gate_up_to_tp: [P*T*L, K, 2I/T] -> [P*L, K, 2I]."""
    L, T = experts_per_rank, tp
    nt, k, two_is = wt.shape
    n = nt // T
    return wt.view(n // L, T, L, k, 2, two_is // 2).permute(0, 2, 3, 4, 1, 5) \
        .reshape(n, k, two_is * T)


def _rows_from_tp(wt, experts_per_rank, tp):
    """The inverse of _rows_to_tp: [P*T*L, I/T, N] -> [P*L, I, N]."""
    L, T = experts_per_rank, tp
    nt, i_s, k = wt.shape
    n = nt // T
    return wt.view(n // L, T, L, i_s, k).permute(0, 2, 1, 3, 4).reshape(n, i_s * T, k)


def _from_tp(w1t, w2t, experts_per_rank, tp):
    """The inverse of _to_tp: per-TP-rank slices back to whole experts."""
    return _gate_up_from_tp(w1t, experts_per_rank, tp), _rows_from_tp(w2t, experts_per_rank, tp)


def _adapter_tp(name):
    """(to, from) of adapter `name` split by TP as quant.tp_split says (w1's
    B: gate and up columns, as w1; w2's A: rows, as w2), or None for one
    every TP rank holds whole."""
    split = quant.tp_split(name, False)
    if split is None:
        return None
    return (_gate_up_to_tp, _gate_up_from_tp) if split[2] else (_rows_to_tp, _rows_from_tp)


def _adapters_to_tp(adapters, names, experts_per_rank, tp):
    """The LoRA adapters (`names`: MoeFFN.adapter_names) of every TP rank:
    those tp_split splits sliced as w1 and w2 are, the others (w1's A, w2's
    B) whole on every TP rank, their gradients the sums of the TP ranks'
    partial ones (_TpWhole). Differentiable."""
    split = [_adapter_tp(n) for n in names]
    return [s[0](a, experts_per_rank, tp) if s else _TpWhole.apply(a, experts_per_rank, tp)
            for s, a in zip(split, adapters)]


def _adapters_from_tp(grads, names, experts_per_rank, tp):
    """The inverse of _adapters_to_tp for the TP ranks' gradients: slices
    put back, the whole ones' partial gradients summed in TP rank order."""
    split = [_adapter_tp(n) for n in names]
    return [s[1](g, experts_per_rank, tp) if s else _sum_tp(g, experts_per_rank, tp)
            for s, g in zip(split, grads)]


class _TpMainGrads:
    """main_grad under tensor parallelism in one process: when the backward
    pass starts, the main-grad buffers as the runtime's ranks hold them (each
    TP rank's slice, a copy); the runtime adds each rank's weight gradient
    into its slice inside the weight-gradient GMMs, as it adds into a
    rank's own buffer under MPI (the same bits); fold() copies the slices
    back into the whole experts' main_grad."""

    def __init__(self, weights, experts_per_rank, tp):
        self.weights, self.experts_per_rank, self.tp = weights, experts_per_rank, tp
        self.buffers = None

    def __iter__(self):
        self.buffers = tuple(t.contiguous() for t in _to_tp(
            *(w.main_grad for w in self.weights), self.experts_per_rank, self.tp))
        return iter(self.buffers)

    def fold(self):
        for w, g in zip(self.weights, _from_tp(*self.buffers, self.experts_per_rank, self.tp)):
            w.main_grad.copy_(g)
            w.grad_added_to_main_grad = True


class MoeFFNFunction(torch.autograd.Function):
    """y = MoE-FFN(x) on the moec runtime; backward gives dx, d topk_weights,
    dw1 and dw2 (topk_ids get no gradient). `done`, when given, is the
    (y, step) a submitted forward pass already gave (ForwardHandle.wait).
    The weights' and adapters' gradients are those of dy times
    `grad_scale` (prepare_ddp's), dx and d topk_weights those of dy.
    `adapter_sum`, when given, takes (the op's layer, the adapters'
    gradients) and returns them with those the TP ranks of other processes
    hold partial sums of added (MoeFFN._sum_adapter_grads)."""

    @staticmethod
    def forward(ctx, layer, x, topk_ids, topk_weights, w1, w2, check_finite=False,
                first_rank=0, main_grads=None, done=None, grad_scale=1.0, adapter_sum=None,
                *adapters):
        y, step = done if done is not None else torch.ops.moec.forward(
            layer, x, topk_ids, topk_weights, w1, w2, list(adapters))
        ctx.layer = layer
        ctx.step = step
        ctx.main_grads = main_grads
        ctx.grad_scale = grad_scale
        ctx.adapter_sum = adapter_sum
        ctx.check = (check_finite, first_rank, w1.shape[0] // max(1, x.shape[0]))
        ctx.save_for_backward(x, topk_ids, topk_weights, w1, w2, *adapters)
        ctx.mark_non_differentiable()
        return y

    @staticmethod
    def backward(ctx, dy):
        x, topk_ids, topk_weights, w1, w2, *adapters = ctx.saved_tensors
        main_grads = ctx.main_grads or (None, None)
        dx, dtopk, dw1, dw2, dadapters = _unscaled(ctx.grad_scale, *torch.ops.moec.backward(
            ctx.layer, ctx.step, x, topk_ids, topk_weights, w1, w2,
            _scaled_dy(dy, ctx.grad_scale), *main_grads, adapters))
        if isinstance(ctx.main_grads, _TpMainGrads):
            ctx.main_grads.fold()
        if ctx.adapter_sum is not None:
            dadapters = ctx.adapter_sum(ctx.layer, dadapters)
        _after_backward(ctx.check, ctx.main_grads, (w1, w2), dy,
                        Gradients(dx, dtopk, dw1, dw2, tuple(dadapters)))
        scales = [None] * (len(adapters) - len(dadapters))  # quantized weights' scales
        return (None, dx, None, dtopk, dw1, dw2, None, None, None, None, None, None,
                *dadapters, *scales)


def _scaled_dy(dy, scale):
    """dy for a backward pass whose weight gradients are to be `scale` times
    dy's: every gradient of the layer is linear in dy, so the pass scales
    them all, and _unscaled takes the scale off dx and d topk_weights (a
    power of two, as for DDP over 2, 4, 8 ... processes, changes no bit of
    them). One pass over dy and dx, not over the weights' gradients."""
    return dy if scale == 1.0 else dy * scale


def _unscaled(scale, dx, dtopk, *rest):
    """The backward's outputs with the scale of _scaled_dy taken off dx and
    d topk_weights (in place: they are the pass's own)."""
    if scale != 1.0:
        dx.mul_(1.0 / scale)
        dtopk.mul_(1.0 / scale)
    return (dx, dtopk, *rest)


Gradients = collections.namedtuple("Gradients",
                                   ["dx", "dtopk_weights", "dw1", "dw2", "adapters"])
Gradients.__doc__ = """What a backward pass gives: dx, dtopk_weights, dw1 and dw2 (None for a
frozen or LoRA layer, and with main_grad=True, whose gradients went into
w1.main_grad and w2.main_grad), and the adapters' gradients (A then B,
w1's then w2's; empty without LoRA)."""


def _after_backward(check, main_grads, weights, dy, grads):
    """What every backward does after the runtime's pass: Megatron's flag
    on main-grad weights, and the finite checks (check_finite)."""
    if main_grads:
        # Megatron's flag: the gradient went into main_grad, not .grad.
        for w in weights:
            w.grad_added_to_main_grad = True
    check_finite, first, local_experts = check
    if check_finite:
        _check_finite("dy", dy, "rank", first)
        for name, t in (("dx", grads.dx), ("dtopk_weights", grads.dtopk_weights)):
            _check_finite(name, t, "rank", first)
        for name, t in zip(("dw1", "dw2"), main_grads or (grads.dw1, grads.dw2)):
            if t is not None:
                _check_finite(name, t, "expert", first * local_experts)
        for i, t in enumerate(grads.adapters):
            _check_finite(f"adapter gradient {i}", t, "expert", first * local_experts)
