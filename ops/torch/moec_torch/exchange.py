"""Dispatch and combine as differentiable ops of their own (Exchange), for
expert computation the caller brings."""

import torch

from . import checks
from ._launch import _fabric, _fabric_args, _register_finalize, load_library
from .cache import _from_cache, compile_graphs


class DispatchHandle:
    """What Exchange.combine and both backwards need of a dispatch: the
    exchange, the routing (kept, so that a later dispatch of the same
    exchange does not lose it) and the expert row counts."""

    def __init__(self, exchange, route, topk_ids, topk_weights, tokens_per_expert, squeeze):
        self.exchange = exchange
        self.route = route
        self.topk_ids = topk_ids
        self.topk_weights = topk_weights
        self.tokens_per_expert = tokens_per_expert
        self.squeeze = squeeze  # the dispatch took [S, H]: combine returns [S, H]


class _DispatchFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runtime, x, topk_ids, topk_weights, route_box):
        ids, weights = topk_ids.contiguous(), topk_weights.detach().contiguous()
        expert_x, counts, route = runtime.dispatch(x, ids, weights)
        route_box.append(route)  # the route id is no tensor: it goes out beside
        ctx.runtime, ctx.route = runtime, route
        ctx.save_for_backward(ids, weights)
        ctx.mark_non_differentiable(counts)
        return expert_x, counts

    @staticmethod
    def backward(ctx, d_expert_x, _counts):
        ids, weights = ctx.saved_tensors
        dx = ctx.runtime.dispatch_backward(ctx.route, ids, weights, d_expert_x.contiguous())
        return None, dx, None, None, None


class _CombineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runtime, route, topk_ids, expert_y, topk_weights):
        ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
        y, step = runtime.combine(route, ids, weights, expert_y)
        ctx.runtime, ctx.route, ctx.step = runtime, route, step
        ctx.save_for_backward(ids, weights, expert_y)
        return y

    @staticmethod
    def backward(ctx, dy):
        ids, weights, expert_y = ctx.saved_tensors
        d_expert_y, dtopk = ctx.runtime.combine_backward(ctx.route, ctx.step, ids, weights,
                                                         expert_y.contiguous(), dy.contiguous())
        return None, None, None, d_expert_y, dtopk


class Exchange:
    """Dispatch and combine as ops of their own, for expert computation the
    caller brings (another activation, quantized experts, a shared expert),
    as Megatron's FusedDispatch / FusedCombine and DeepEP provide; both are
    differentiable and run graphs/moe_dispatch.json and moe_combine.json on
    the moec runtime and fabric, compiled for `config` as MoeFFN's graphs:

        ex = moec_torch.Exchange("examples/configs/tiny.json", ranks=2)
        expert_x, tokens_per_expert, handle = ex.dispatch(x, topk_ids, topk_weights)
        expert_y = my_experts(expert_x, tokens_per_expert)   # any PyTorch code
        y = ex.combine(expert_y, handle)     # y[t] = sum_k w[t,k] * expert_y row of (t, k)

    x [P, S, H], topk_ids and topk_weights [P, S, K], y [P, S, H], for the P
    ranks this process runs (P = R in process, 1 under MPI, where the
    leading dim may be left out). expert_x [rows, H] holds the rows the
    experts of those ranks receive, rank by rank, each rank's grouped by its
    local expert in global expert order (expert r*L + e), within an expert
    by source rank, token and top-k position; tokens_per_expert [P*L]
    (int64) counts them, as a grouped matmul takes them. expert_y must have
    expert_x's rows in the same order.

    Gradients: the dispatch's backward is a combine of d expert_x (the sum
    over k); the combine's backward is a dispatch of topk_weight * dy, and
    d topk_weights[t, k] = <dy[t], expert_y row of (t, k)>. topk_ids get no
    gradient. A routing over the binaries' capacity raises RuntimeError
    ("moec over capacity: ..."): raise capacity_factor in the config."""

    def __init__(self, config, ranks=None, *, threads=0, target="cpu",
                 granularity="per-tile-range", timeout_seconds=None, fabric=None, group=None):
        load_library()
        threads = checks.integer(threads, "Exchange: argument 'threads'", minimum=0,
                                 maximum=1024)
        timeout_seconds = checks.seconds(timeout_seconds,
                                         "Exchange: argument 'timeout_seconds'")
        fabric, ranks, group = _fabric(fabric, group, ranks, 1, "Exchange")
        cfg = checks.read_config(config)
        _register_finalize(fabric)
        self.runtime = _from_cache(
            lambda fresh: compile_graphs(cfg, ranks, ["moe_dispatch.json", "moe_combine.json"],
                                         target, granularity, fresh),
            lambda dispatch, combine: torch.classes.moec.Exchange(
                dispatch, combine, threads, timeout_seconds, fabric,
                *_fabric_args(fabric, group)))
        info = self.runtime.info()
        self.fabric = fabric
        self.ranks = info["ranks"]
        self.first_rank = info["first_rank"]
        self.local_ranks = info["local_ranks"]
        self.experts = info["experts"]
        self.local_experts = info["local_experts"]
        self.hidden = info["hidden"]
        self.top_k = info["top_k"]
        self.tokens = info["tokens"]
        self.dtype = torch.bfloat16 if info["bf16"] else torch.float32

    def dispatch(self, x, topk_ids, topk_weights):
        """-> (expert_x [rows, H], tokens_per_expert [P*L], handle)."""
        for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            checks.dense(t, name)
        x, topk_weights = checks.autocast(x, self.dtype), checks.autocast(topk_weights,
                                                                          torch.float32)
        squeeze = x.dim() == 2 and self.local_ranks == 1
        if squeeze:
            x, topk_ids, topk_weights = x.unsqueeze(0), topk_ids.unsqueeze(0), \
                topk_weights.unsqueeze(0)
        route = []
        expert_x, counts = _DispatchFunction.apply(self.runtime, x, topk_ids, topk_weights,
                                                   route)
        return expert_x, counts, DispatchHandle(self, route[0], topk_ids, topk_weights, counts,
                                                squeeze)

    def combine(self, expert_y, handle):
        """-> y [P, S, H] (or [S, H] when the dispatch took [S, H])."""
        if handle.exchange is not self:
            raise ValueError("moec: the handle is another exchange's")
        checks.dense(expert_y, "expert_y")
        expert_y = checks.autocast(expert_y, self.dtype)
        y = _CombineFunction.apply(self.runtime, handle.route, handle.topk_ids, expert_y,
                                   handle.topk_weights)
        return y.squeeze(0) if handle.squeeze else y

    def __reduce_ex__(self, protocol):
        raise TypeError("moec: an Exchange cannot be copied or pickled: it owns a runtime of "
                        "compiled binaries and threads; make another with "
                        "moec_torch.Exchange(config, ...)")

    def times(self):
        """Seconds of the last dispatch and combine task programs."""
        t = self.runtime.times()
        return {"dispatch": t[0], "combine": t[1]}
