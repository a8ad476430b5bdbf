"""MoeFFN: the MoE-FFN layer as a torch.nn.Module on the moec runtime."""

import json
import math
import os
import warnings

import torch

from . import adapters, cache, capacity, checkpoint, checks, native, quant
from ._launch import _fabric, _fabric_args, _register_finalize, load_library
from .autograd import (MoeFFNFunction, _adapter_tp, _adapters_to_tp, _check_finite, _scaled_dy,
                       _sum_tp, _to_tp, _to_tp_stored, _TpMainGrads, _TpShare, _TpTake)
from .cache import LORA_TARGETS, _from_cache, _layer_graphs, _lora_suffix, _lora_targets, \
    compile_layer
from .capacity import _check_policy
from .handles import BackwardHandle, ForwardHandle

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _matches(layer, cfg, ranks, frozen=False, lora_targets=(), tp=1, transposed=False,
             weight_format=None):
    """True when a built layer's binaries are those of `cfg` on `ranks` EP
    ranks of `tp` TP ranks each: their layer record (the config they were
    compiled from) holds every value `cfg` gives, and their ops are the graph
    asked for."""
    record = json.loads(layer.layer_record())
    if any(record[k] != cfg[k] for k in record if k in cfg):
        return False
    info = layer.info()
    fmt = quant.parse(weight_format)
    targets = sum(1 << i for i, t in enumerate(LORA_TARGETS) if t in (lora_targets or ()))
    want = {"ranks": int(ranks) * tp, "tp": tp,
            "frozen": int(bool(frozen) or targets != 0), "lora_targets": targets,
            "weights_transposed": int(bool(transposed)),
            "weight_format": quant.FORMAT_CODES[fmt.kind if fmt else None],
            "weight_zero_points": int(bool(fmt and fmt.zero_points))}
    return all(int(info[k]) == v for k, v in want.items())


class MoeFFN(torch.nn.Module):
    """The MoE-FFN layer of `config` (a dict or a JSON path, see
    docs/graph-format.md) on an EP group of `ranks` ranks (``ep=`` is the
    same argument).

    tp: expert tensor parallelism (default: the config's "tp", else 1): the
    layer runs on an [ep, tp] mesh of ep * tp ranks, and each expert's
    intermediate size I is split over the tp ranks of its EP rank (w1's gate
    and up columns column-parallel, w2's rows row-parallel); the tp ranks of
    an EP rank share its tokens, and their partial down projections are
    summed in the combine. In one process the module holds the whole
    experts and takes the EP ranks' tokens exactly as with tp=1, so the same
    script runs with either; under MPI process r is EP rank r // tp, TP rank
    r % tp, gives its EP rank's tokens, and holds w1 [L, H, 2I/tp] (gate then
    up columns of its slice) and w2 [L, I/tp, H], drawn so that a run with
    the same seed starts from the same whole weights. LoRA adapters are not
    supported with tp > 1. Weights stored transposed (quantized ones too)
    are held as each TP rank's part of the whole experts (quant.tp_part:
    w1's gate and up rows, w2's columns, with the scales covering them).

    fabric: "inproc" (all ranks in this process) or "mpi" (one rank per
    process, under mpirun); default "mpi" when started by mpirun, else
    "inproc". Under MPI, `ranks` defaults to the number of processes.

    Parameters: w1 [P*L, H, 2I] (gate columns first, then up) and
    w2 [P*L, I, H], in the config's dtype, for the P ranks this process runs
    (in process P = R and P*L = E; under MPI P = 1, the rank's own experts).
    forward(x, topk_ids, topk_weights) takes x [P, S, H] (S up to the
    config's seq_size), topk_ids [P, S, K] (int32 or int64, distinct experts
    per token) and topk_weights [P, S, K] (float32), and returns y [P, S, H];
    with P = 1 the leading dim may be left out (x [S, H] -> y [S, H]).

    The weights are initialized from torch's global generator as the whole
    [E, ...] tensors, of which this process keeps its experts: every process
    draws the same numbers, so a run under MPI starts from the same weights
    as a run in one process with the same seed.

    threads: the runtime's worker threads (0: the hardware threads, at most
    1024). ranks, ep, tp, threads and lora_rank are integers (an int, or a
    numpy or torch integer scalar): a float or a bool raises TypeError
    naming the argument, nothing is rounded. check_finite, frozen,
    main_grad and trace are bools (a Python or numpy bool, or a 0-dim torch
    bool tensor): "no", 1 or None raises TypeError naming the argument, no
    value is taken as truthy. timeout_seconds is the watchdog of a pass (and
    under MPI of each wait for the other ranks): 0.001 to 1000000 seconds,
    as the CLI's --timeout, else ValueError; None, the default, is the
    runtime's (60 s; base/Time.h, checks.timeout_limits()).

    Tensors (x, topk_ids, topk_weights, dy, the weights and adapters) must
    be dense: a sparse, mkldnn or nested tensor raises ValueError naming it
    and its layout, a meta tensor RuntimeError, before any work. x must be
    in the layer's dtype and topk_weights float32 (another dtype raises,
    naming it), except inside torch.autocast("cpu"), which casts them to
    those as it casts the inputs of torch's own ops (y is in the layer's
    dtype; x's gradient comes back in x's).

    config: a dict, or the path of a regular file of at most 1 MiB; both go
    through checks.read_config (numpy scalars become numbers; non-finite
    numbers and values JSON cannot hold are refused naming the key).

    capacity_policy: what a step whose routing needs more rows than the
    compiled binary holds does (the config's ``capacity_factor``, and
    ``seq_size`` for more tokens than compiled). "grow" (the default)
    compiles (or takes from the cache) binaries with room for it, rebuilds
    the runtime, runs the step again and warns once per growth; the capacity
    never shrinks. "error" raises the runtime's over-capacity error instead.
    Under MPI growing is collective: every rank gets the error at the same
    pass, the ranks exchange their policy and need (bounded by
    timeout_seconds) before any recompiles, and either all grow or all
    raise, naming the ranks whose policy refused. The ranks must be given
    the same capacity_policy (a layer whose ranks differ raises ValueError
    on every rank, naming each rank's value).

    check_finite: raise a ValueError naming the tensor and rank (or expert)
    when an input, the output or a gradient holds NaN or infinity (they
    pass through the layer silently otherwise); off by default, it costs a
    pass over each tensor.

    trace: record every pass (its tasks, waits and phases) so that
    write_trace(path) writes the last one as a Chrome/Perfetto trace; off
    by default, it costs a few percent of a pass.

    frozen: the expert weights are frozen (requires_grad False): backward
    runs graphs/moe_ffn_bwd_frozen.json, which has no weight-gradient GMMs,
    and gives dx and d topk_weights only. The weights' requires_grad decides
    from then on: a pass under grad mode with neither w1 nor w2 requiring
    grad runs the frozen graphs (freezing a layer built to train, as
    PEFT's `requires_grad_(False)` does, skips the weight-gradient GMMs,
    about half of the backward), and one with either requiring grad runs
    the training graphs (both gradients computed), recompiling (cached)
    and rebuilding the runtime at the first pass after a change. A LoRA,
    quantized or weights_transposed layer's base weights train in no graph:
    a pass with one of them (or a quantized weight's scale) requiring grad
    raises ValueError.

    main_grad: gradient-accumulation fusion, as Megatron's
    gradient_accumulation_fusion: w1.main_grad and w2.main_grad are fp32
    buffers the module owns, and every backward adds its weight gradients
    into them inside the weight-gradient GMMs (C += AᵀB, no separate add, no
    bf16 rounding of the running sum); w1.grad and w2.grad stay None, and
    backward sets w.grad_added_to_main_grad = True. The buffers start at
    zero; zero them between optimizer steps (zero_main_grad()), as a
    Megatron training loop does.

    lora_rank, lora_alpha, lora_targets: LoRA adapters on the experts, as
    PEFT puts them on a linear layer: for each target projection W ("w1",
    the gate/up projection, and/or "w2", the down projection; one name,
    lora_targets="w1", is that one target) of each
    expert, Y = X W + (lora_alpha / lora_rank) (X A) B with parameters
    w1_lora_A [P*L, H, r], w1_lora_B [P*L, r, 2I], w2_lora_A [P*L, I, r],
    w2_lora_B [P*L, r, H]. A is initialised as PEFT does (uniform in
    ±1/sqrt(fan_in), PEFT's kaiming_uniform(a=√5)), B to zero, so a fresh
    layer computes the base layer. The base weights are frozen (requires_grad
    False): backward gives dx, d topk_weights and the adapters' gradients
    only. lora_alpha defaults to lora_rank (a scaling of 1); it must be a
    positive finite number, and the config must not set lora_rank or
    lora_alpha (the module sets them). The adapters are
    graph nodes (graphs/moe_ffn_{fwd,bwd}_lora*.json), compiled and scheduled
    with the rest. merge_adapters() folds them into w1 and w2. With a TP
    rank per process (tp > 1 under MPI or a torch.distributed group) the
    process holds its TP rank's I / tp columns of w1_lora_B (gate's, then
    up's) and rows of w2_lora_A; the gradients of w1_lora_A and w2_lora_B,
    which every TP rank holds whole, are summed over the TP ranks after
    each backward pass (an exchange over the fabric, collective).

    dispatch_dtype: "fp8_e4m3" sends the dispatched token rows as FP8 e4m3
    with one fp32 scale per 128 values (about half the bytes of bf16 rows),
    dequantized to the compute dtype on arrival, as DeepEP's and Megatron's
    fp8_dispatch do; the combine, and everything backward sends, stay in the
    compute dtype. The default (None) takes the config's "dispatch_dtype",
    which defaults to the compute dtype. The experts then compute on the
    rounded rows, and backward treats the rounding as the identity (the
    gradients are those of the layer at the rounded x).

    weights_transposed: the base weights are stored with each expert's
    matrix transposed, w1 [P*L, 2I, H] (gate rows, then up) and w2
    [P*L, H, I]: the layout of Hugging Face's fused experts (transformers
    v5's gate_up_proj and down_proj), which the layer then reads in place
    (its forward GMMs read them transposed, its backward ones as they are;
    graphs/*_transposed.json). For a frozen or LoRA layer only (ValueError
    otherwise): the base weights' gradients are computed in the
    [P*L, H, 2I] layout. The adapters keep their layout (A [P*L, K, r],
    B [P*L, r, N] on the projection X W, W [K, N]).

    weight_format: stores the frozen base weights quantized, in the
    transposed layout (which weight_format implies), as codes w1, w2 and
    fp32 scales w1_scale, w2_scale (moec_torch.quant says each format):
      "fp8_block128": FP8 e4m3 codes (uint8 [P*L, 2I, H], [P*L, H, I]) with
        a scale per 128 x 128 block ([P*L, 2I/128, H/128], [P*L, H/128,
        I/128]): DeepSeek-V3's weight and weight_scale_inv as its checkpoint
        ships them; H and I multiples of 128;
      "int8": int8 codes with a scale per row ([P*L, 2I], [P*L, H]);
      "int4_g32", "int4_g64", "int4_g128": 4-bit codes two a byte (uint8
        [P*L, 2I, H/2], [P*L, H, I/2]) with a scale per group of G values
        along a row ([P*L, 2I, H/G], [P*L, H, I/G]); "int4_gG_zp": with a
        zero point per group too ([..., 2] pairs); H and I multiples of G.
    FP8 and int8 hold half the bytes of bf16, int4 a quarter (plus the
    scales). Each tile dequantizes the part it reads to the layer's dtype;
    outputs are those of the dense layer on the dequantized weights
    (dequantized_weights()). A frozen or LoRA layer only; with tp > 1 each
    TP rank's part of I holds whole blocks or groups.
    quantize_weights(weight_format) makes one from a dense layer.

    pack_weights: True keeps the weights the layer's matmuls read (w1, w2
    and the adapters) packed in the layout of moec's GEMM tile, each packed
    once, by the first tile that reads it, and again only when it changed:
    frozen weights are packed at the second pass and never again; trained
    ones once per optimizer step where several tiles read each part of
    them, else not at all. Off by default, for its memory: on the AVX-512
    tile it buys a frozen layer's step about 7% for one more copy of its
    frozen weights' bytes, on AMX tiles 1.2-1.3x (frozen and LoRA) for two
    more (docs/torch.md, docs/performance.md). "forward" keeps the forward
    pass's packed only (on AMX tiles one more copy instead of two, for a
    slower backward; on the AVX-512 tile the same as True unless
    weights_transposed, whose packed copy is the backward's). PyTorch counts
    every in-place write to a tensor (an optimizer's, a copy_ into it or a
    view of it) and the layer reads that count at each pass; a write it
    does not count, through a parameter's .data, needs weights_changed()
    before the next pass. The outputs are the same bits as with False.
    Only where moec's tile runs
    the product (bf16 on a CPU with avx512_bf16; quantized base weights
    are not packed).

    init_weights: False leaves w1, w2 and the adapters uninitialized
    (torch.empty), for a caller that fills them (moec_torch.hf does, from a
    model or a checkpoint); drawing the whole experts costs seconds at a
    real model's size.

    A layer cannot be copied or pickled (copy.deepcopy, pickle, torch.save
    of the module raise TypeError): it owns a runtime. Its state is
    state_dict(); rebuild with MoeFFN(config, ...) and load_state_dict."""

    def __init__(self, config, ranks=None, *, ep=None, tp=None, threads=0, target="cpu",
                 granularity="per-tile-range", timeout_seconds=None, fabric=None,
                 capacity_policy="grow", check_finite=False, frozen=False, main_grad=False,
                 lora_rank=0, lora_alpha=None, lora_targets=LORA_TARGETS, trace=False,
                 dispatch_dtype=None, init_weights=True, weights_transposed=False,
                 weight_format=None, pack_weights=False, group=None):
        super().__init__()
        load_library()
        arg = "MoeFFN: argument "
        if ranks is not None:
            ranks = checks.integer(ranks, arg + "'ranks'", minimum=1)
        if ep is not None:
            ep = checks.integer(ep, arg + "'ep'", minimum=1)
            if ranks is not None and ranks != ep:
                raise ValueError(f"moec: ranks={ranks} and ep={ep} name the same thing; "
                                 "give one")
            ranks = ep
        threads = checks.integer(threads, arg + "'threads'", minimum=0, maximum=1024)
        timeout_seconds = checks.seconds(timeout_seconds, arg + "'timeout_seconds'")
        lora_rank = checks.integer(lora_rank, arg + "'lora_rank'", minimum=0)
        check_finite = checks.boolean(check_finite, arg + "'check_finite'")
        frozen = checks.boolean(frozen, arg + "'frozen'")
        main_grad = checks.boolean(main_grad, arg + "'main_grad'")
        trace = checks.boolean(trace, arg + "'trace'")
        init_weights = checks.boolean(init_weights, arg + "'init_weights'")
        weights_transposed = checks.boolean(weights_transposed, arg + "'weights_transposed'")
        if not (isinstance(pack_weights, str) and pack_weights == "forward"):
            try:
                pack_weights = checks.boolean(pack_weights, arg + "'pack_weights'")
            except TypeError:
                raise TypeError(f"{arg}'pack_weights' must be True, False or \"forward\", got "
                                f"{pack_weights!r} ({type(pack_weights).__name__})") from None
        cfg = checks.read_config(config)
        # The files the layer reads, which no file it writes may be.
        self._config_file = None if isinstance(config, dict) else os.fspath(config)
        self._target_file = checks.target_file(target)
        tp = checks.integer(tp, arg + "'tp'", minimum=1) if tp is not None else \
            checks.integer(cfg.get("tp", 1), "moec: config key 'tp'", minimum=1)
        fabric, ranks, group = _fabric(fabric, group, ranks, tp, "MoeFFN")
        _check_policy(capacity_policy)
        if frozen and main_grad:
            raise ValueError("moec: a frozen layer has no weight gradients to accumulate "
                             "(frozen=True and main_grad=True)")
        if dispatch_dtype is not None:
            # The compiler's rule, checked now (ValueError) rather than at
            # the first compile.
            cfg["dispatch_dtype"] = dispatch_dtype
            native.check_config(cfg)
        lora_keys = [k for k in ("lora_rank", "lora_alpha") if k in cfg]
        if lora_keys:
            raise ValueError("moec: LoRA adapters are set by lora_rank= (and lora_alpha=) of "
                             f"the module, not the config (it sets {', '.join(lora_keys)})")
        if lora_rank:
            lora_targets = _lora_targets(lora_targets)
            _lora_suffix(lora_targets)
            if main_grad:
                raise ValueError("moec: main_grad buffers with LoRA adapters are not supported "
                                 "(the adapters' gradients go to .grad)")
            cfg["lora_rank"] = lora_rank
            cfg["lora_alpha"] = checks.number(lora_alpha, arg + "'lora_alpha'") \
                if lora_alpha is not None else float(lora_rank)
            frozen = True
        elif lora_alpha is not None:
            raise ValueError("moec: lora_alpha= needs lora_rank= (the adapters' rank)")
        fmt = quant.parse(weight_format)
        if fmt is not None:
            if not frozen:
                raise ValueError(f"moec: weight_format={weight_format!r} needs a frozen or LoRA "
                                 "layer (frozen=True or lora_rank=): quantized weights get no "
                                 "gradients")
            weights_transposed = True
            fmt.check_sizes(cfg.get("hidden_size"), cfg.get("intermediate_size"))
            for key, value in fmt.config().items():
                if cfg.get(key, value) != value:
                    raise ValueError(f"moec: the config's {key!r} is {cfg[key]!r}, and "
                                     f"weight_format={weight_format!r} says {value}")
                cfg[key] = value
        self.weight_format = weight_format
        if weights_transposed and not frozen:
            raise ValueError("moec: weights_transposed=True needs a frozen or LoRA layer "
                             "(frozen=True or lora_rank=): the base weights' gradients are "
                             "computed in the [E, H, 2I] layout only")
        unit = quant.tp_unit(weight_format)
        inter = cfg.get("intermediate_size")
        if tp > 1 and fmt is not None and isinstance(inter, int) and inter % (tp * unit):
            raise ValueError(f"moec: weight_format={weight_format!r} with tensor parallelism: "
                             f"each TP rank's part of intermediate_size ({inter} / tp={tp}) "
                             f"must hold whole {'blocks' if fmt.kind == 'fp8' else 'groups'} "
                             f"of {unit} values")
        self.weights_transposed = weights_transposed
        self.tp = tp
        self.lora_targets = tuple(t for t in LORA_TARGETS if t in lora_targets) \
            if lora_rank else ()
        self.lora_rank = lora_rank
        self.lora_scaling = cfg["lora_alpha"] / lora_rank if lora_rank else 0.0
        if main_grad:
            cfg["main_grad"] = True
        elif cfg.get("main_grad"):
            raise ValueError("moec: the config sets \"main_grad\"; pass main_grad=True to the "
                             "module, which owns the buffers")
        self.config = cfg
        self.capacity_policy = capacity_policy
        self.check_finite = check_finite
        self.frozen = bool(frozen)
        self.main_grad = bool(main_grad)
        self._build = (threads, timeout_seconds, target, granularity, fabric, trace)
        self.group = group
        self.pack_weights = pack_weights
        # The weight gradients' factor (moec_torch.prepare_ddp's), folded
        # into dy (MoeFFNFunction).
        self._grad_scale = 1.0
        self._ddp_group = None  # the DDP group prepare_ddp prepared it for
        self._warned_dtype = False  # _apply's warning, given once
        _register_finalize(fabric)

        def compiled(fresh):
            return compile_layer(cfg, ranks, target, granularity, fresh=fresh,
                                 frozen=self.frozen, lora_targets=self.lora_targets, tp=tp,
                                 weights_transposed=weights_transposed,
                                 weight_format=weight_format)

        def other_layer(layer):
            if not _matches(layer, cfg, ranks, self.frozen, self.lora_targets, tp,
                            weights_transposed, weight_format):
                return (f"the compiled layer (its config {layer.layer_record()}, its sizes "
                        f"{dict(layer.info())}) is not the config's {cfg}")
            return None

        self.layer = _from_cache(compiled, self._runtime_layer, other_layer)
        self._binaries = self._made
        info = self.layer.info()
        # "fp8_e4m3", or the dtype: the config's as compiled (its layer record).
        self.dispatch_dtype = json.loads(self.layer.layer_record())["dispatch_dtype"]
        self._writes_trace = info["first_rank"] == 0  # under MPI, rank 0 writes
        self.fabric = fabric
        # Ranks in other processes (MPI): what the binaries do not carry is
        # agreed through the fabric's bounded exchange.
        self._collective = fabric in ("mpi", "group") and info["local_ranks"] < info["ranks"]
        if self._collective:
            self._agree_options({"capacity_policy": capacity_policy})
        # EP ranks; the runtime's ranks are the [ep, tp] mesh's.
        self.ranks = info["ranks"] // tp
        self.first_rank = info["first_rank"] // tp
        self.local_ranks = max(1, info["local_ranks"] // tp)
        # The TP rank this process runs (under MPI), or None (all of them).
        self.tp_rank = info["first_rank"] % tp if info["local_ranks"] < tp else None
        self._mesh_cache = None
        self.experts = info["experts"]
        self.local_experts = self.experts // self.ranks
        self.hidden = info["hidden"]
        self.inter = info["inter"] * tp
        self.top_k = info["top_k"]
        self.tokens = info["tokens"]
        dtype = torch.bfloat16 if info["bf16"] else torch.float32
        self.dtype = dtype  # of the activations and the computation
        mine = self.local_ranks * self.local_experts
        # The intermediate columns this process holds: all, or its TP slice.
        self.local_inter = self.inter if self.tp_rank is None else self.inter // tp
        w1, w2 = (self.hidden, 2 * self.local_inter), (self.local_inter, self.hidden)
        if weights_transposed:
            w1, w2 = w1[::-1], w2[::-1]
        stored = fmt.codes_dtype if fmt else dtype
        self.w1 = torch.nn.Parameter(
            torch.empty(mine, *(fmt.stored_shape(*w1) if fmt else w1), dtype=stored),
            requires_grad=not self.frozen)
        self.w2 = torch.nn.Parameter(
            torch.empty(mine, *(fmt.stored_shape(*w2) if fmt else w2), dtype=stored),
            requires_grad=not self.frozen)
        if fmt:  # the codes' fp32 scales (quant)
            for name, shape in (("w1_scale", w1), ("w2_scale", w2)):
                setattr(self, name, torch.nn.Parameter(
                    torch.empty(mine, *fmt.scale_shape(*shape)), requires_grad=False))
        if self.main_grad:
            for w in (self.w1, self.w2):
                w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
        # Adapters: A [P*L, K, r] and B [P*L, r, N] on a projection [P*L, K, N].
        for name in self.lora_targets:
            k, n = self._projection(name)
            setattr(self, f"{name}_lora_A", torch.nn.Parameter(
                torch.empty(mine, k, lora_rank, dtype=dtype)))
            setattr(self, f"{name}_lora_B", torch.nn.Parameter(
                torch.empty(mine, lora_rank, n, dtype=dtype)))
        if init_weights:
            self.reset_parameters()
        self._register_load_state_dict_pre_hook(self._check_checkpoint)

    def _projection(self, name, whole=False):
        """(K, N) of projection "w1" [L, H, 2I] or "w2" [L, I, H]: this
        process's TP part of I, or with `whole` all of it."""
        i = self.inter if whole else self.local_inter
        return (self.hidden, 2 * i) if name == "w1" else (i, self.hidden)

    def _whole_shape(self, name):
        """The shape of one whole expert's tensor `name` (w1, w2 in moec's
        layout; an adapter "w1_lora_A" ...), whichever TP part it holds."""
        if name in ("w1", "w2"):
            return self._projection(name, whole=True)
        k, n = self._projection(name[:2], whole=True)
        return (k, self.lora_rank) if name.endswith("_A") else (self.lora_rank, n)

    def projections(self, w1=None, w2=None):
        """(gate [N, I, H], up [N, I, H], down [N, H, I]): views of w1 and w2
        (default the layer's) as the experts' nn.Linear weights [out, in],
        whichever layout the layer stores them in."""
        w1 = self.w1 if w1 is None else w1
        w2 = self.w2 if w2 is None else w2
        i = self.local_inter
        if self.weights_transposed:
            return w1[:, :i], w1[:, i:], w2
        return w1[:, :, :i].transpose(1, 2), w1[:, :, i:].transpose(1, 2), w2.transpose(1, 2)

    def adapter_names(self):
        """The LoRA parameters' names in the order the op takes them: A then
        B, on w1 then w2 (those in lora_targets): "w1_lora_A", ..."""
        return [f"{name}_lora_{m}" for name in self.lora_targets for m in "AB"]

    def adapters(self):
        """The LoRA parameters, in adapter_names() order."""
        return [getattr(self, n) for n in self.adapter_names()]

    def _read_parameters(self):
        """(name, tensor) of the parameters a pass reads: w1, w2, the
        adapters, the scales."""
        return [("w1", self.w1), ("w2", self.w2)] + \
            [(n, getattr(self, n)) for n in (
                self.adapter_names() +
                (["w1_scale", "w2_scale"] if self.weight_format else []))]

    def _bound(self):
        """What the op takes after w1 and w2: the adapters, then the block
        scales of quantized weights (each TP rank's, several here)."""
        if not self._tp_here():
            scales = [self.w1_scale, self.w2_scale] if self.weight_format else []
            return self.adapters() + scales
        adapters = _adapters_to_tp(self.adapters(), self.adapter_names(), self.local_experts,
                                   self.tp)
        return adapters + (list(self._stored_mesh()[2]) if self.weights_transposed else [])

    def _stored_mesh(self):
        """(w1, w2, scales) of weights stored transposed (frozen; quantized
        or not) as the runtime's TP ranks here take them, copies made again
        only when a weight or scale changed (another tensor, or a write
        PyTorch counts), so that packed weights stay packed."""
        params = [self.w1, self.w2] + ([self.w1_scale, self.w2_scale] if self.weight_format
                                       else [])
        key = tuple((p.data_ptr(), p._version) for p in params)
        if self._mesh_cache is None or self._mesh_cache[0] != key:
            with torch.no_grad():
                self._mesh_cache = (key, _to_tp_stored(self.weight_format, self.w1, self.w2,
                                                       tuple(params[2:]), self.local_experts,
                                                       self.tp))
        return self._mesh_cache[1]

    def merged_weights(self):
        """(w1, w2) with the adapters folded in: W + (lora_alpha / r) A B per
        expert, computed in float32 and returned in the weights' dtype."""
        merged = []
        with torch.no_grad():
            for name, w in zip(LORA_TARGETS, self.dequantized_weights()):
                if name in self.lora_targets:
                    a = getattr(self, f"{name}_lora_A").float()
                    b = getattr(self, f"{name}_lora_B").float()
                    ab = torch.bmm(a, b)
                    if self.weights_transposed:
                        ab = ab.transpose(1, 2)
                    w = (w.float() + self.lora_scaling * ab).to(w.dtype)
                merged.append(w.detach().clone())
        return tuple(merged)

    def dequantized_weights(self):
        """(w1, w2) as the layer computes with them, in its dtype: the
        weights themselves, or for quantized ones code x scale (views of the
        parameters where they are dense)."""
        if not self.weight_format:
            return self.w1, self.w2
        return tuple(quant.dequantize(self.weight_format, getattr(self, n),
                                      getattr(self, n + "_scale"), self.dtype)
                     for n in LORA_TARGETS)

    def weights_changed(self):
        """Says that the layer's weights were written where PyTorch does not
        count it (through a parameter's .data): the next pass packs them
        again (pack_weights). Writes PyTorch counts need no call."""
        self._mesh_cache = None  # the TP ranks' copies of weights stored transposed
        self.layer.weights_changed()

    def quantize_weights(self, weight_format="fp8_block128"):
        """A new layer with this one's configuration and options, its base
        weights quantized to `weight_format` (frozen, in the transposed
        layout) and its adapters copied: the fine-tuning form of a dense
        layer. This layer is left as it is. With a TP rank per process an
        int8 w2's row scales span every TP rank's columns: refused (quantize
        in one process and load the checkpoint); the other formats' blocks
        and groups lie within a TP rank's part."""
        if self.tp_rank is not None and quant.parse(weight_format).kind == "int8":
            raise ValueError(
                f"moec: quantize_weights({weight_format!r}) with a TP rank per process (tp="
                f"{self.tp}): an int8 row scale of w2 spans every TP rank's columns, and this "
                "process holds its own only; quantize the layer in one process (tp=1, or its TP "
                "ranks in one process) and load its checkpoint here")
        threads, timeout, target, granularity, fabric, trace = self._build
        config = {k: v for k, v in self.config.items()
                  if k not in ("lora_rank", "lora_alpha", "main_grad")}
        options = dict(lora_rank=self.lora_rank, lora_targets=self.lora_targets,
                       lora_alpha=self.lora_scaling * self.lora_rank) if self.lora_rank \
            else dict(frozen=True)
        layer = MoeFFN(config, self.ranks, tp=self.tp, threads=threads, target=target,
                       granularity=granularity, timeout_seconds=timeout, fabric=fabric,
                       group=self.group, capacity_policy=self.capacity_policy, check_finite=self.check_finite,
                       trace=trace, init_weights=False, weight_format=weight_format,
                       pack_weights=self.pack_weights, **options)
        with torch.no_grad():
            for name, w in zip(LORA_TARGETS, self.dequantized_weights()):
                if not self.weights_transposed:
                    w = w.transpose(1, 2)
                for j in range(w.shape[0]):  # an expert at a time: no float copy of all
                    codes, scales = quant.quantize(weight_format, w[j:j + 1])
                    getattr(layer, name)[j].copy_(codes[0])
                    getattr(layer, name + "_scale")[j].copy_(scales[0])
            for mine, theirs in zip(self.adapters(), layer.adapters()):
                theirs.copy_(mine)
        return layer

    def merge_adapters(self):
        """Folds the adapters into w1 and w2 (merged_weights()) and zeroes
        the B matrices, so the layer computes the same function with the
        adapters contributing nothing; training may go on from there."""
        if self.weight_format:
            raise ValueError(f"moec: the adapters cannot be folded into {self.weight_format} "
                             "weights (the merged weights are dense): merged_weights() gives "
                             "them")
        w1, w2 = self.merged_weights()
        with torch.no_grad():
            self.w1.copy_(w1)
            self.w2.copy_(w2)
            for name in self.lora_targets:
                getattr(self, f"{name}_lora_B").zero_()

    def zero_main_grad(self):
        """Zeroes w1.main_grad and w2.main_grad (main_grad=True)."""
        if not self.main_grad:
            raise RuntimeError("moec: this layer has no main_grad buffers (main_grad=False)")
        for w in (self.w1, self.w2):
            w.main_grad.zero_()
            w.grad_added_to_main_grad = False

    def _draw(self, param, bound, weight=None, store=None):
        """Draws the whole [E, ...] tensor uniform in ±bound, one expert at a
        time (the same numbers as one draw of the whole: the CPU generator
        fills in element order), and keeps this process's experts: the
        process never holds the other ranks' experts. `weight` ("w1", "w2",
        an adapter "w1_lora_A" ...) names the tensor whose whole values are
        drawn (of which this TP rank keeps its part), and `store(j, values)`
        keeps local expert j's values (a quantized weight's codes and
        scales) instead of param[j].copy_(values)."""
        first = self.first_rank * self.local_experts
        weight = weight or ("w1" if param is self.w1 else "w2" if param is self.w2 else None)
        whole = self._whole_shape(weight) if weight else param.shape[1:]
        store = store or (lambda j, values: param[j].copy_(
            self._tp_part(weight, values)[0] if weight else values))
        one = torch.empty(1, *whole)
        stored_transposed = self.weights_transposed and weight in ("w1", "w2")
        for e in range(self.experts):
            one.uniform_(-bound, bound)
            if first <= e < first + param.shape[0]:
                # The whole expert (as stored: [out, in] where transposed),
                # of which store() keeps this TP rank's part.
                drawn = one[0]
                store(e - first, drawn.t() if stored_transposed else drawn)

    def _tp_part(self, name, stored=None, scales=None):
        """This process's TP part (quant.tp_part) of whole experts' tensors
        `name` ("w1", "w2" or their "_scale": codes and scales of a
        quantized one, in the layer's layout; a LoRA adapter "w1_lora_B"
        ...): the whole where it holds all."""
        if self.tp_rank is None:
            return stored, scales
        return quant.tp_part(self.weight_format, name.removesuffix("_scale"), self.tp_rank,
                             self.tp, stored, scales, self.weights_transposed)

    def reset_parameters(self):
        """Draws the whole [E, ...] weights and keeps this process's experts."""
        with torch.no_grad():
            for name, bound in (("w1", 1 / math.sqrt(self.hidden)),
                                ("w2", 1 / math.sqrt(self.inter))):
                param = getattr(self, name)
                if not self.weight_format:
                    self._draw(param, bound)
                    continue
                # Drawn, then quantized, an expert at a time ([out, in], the
                # transposed layout): no dense copy of the whole weight.
                scale = getattr(self, name + "_scale")

                def store(j, values, param=param, scale=scale, name=name):
                    # The whole expert quantized, then this TP rank's part.
                    codes, scales = self._tp_part(name, *quant.quantize(self.weight_format,
                                                                        values.unsqueeze(0)))
                    param[j].copy_(codes[0])
                    scale[j].copy_(scales[0])

                self._draw(param, bound, name, store)
            for name in self.lora_targets:
                # PEFT: A kaiming_uniform(a=sqrt(5)) over fan_in K, i.e.
                # uniform in ±1/sqrt(K) (K whole: w2's A is drawn whole and
                # a TP rank keeps its rows); B zero.
                a = getattr(self, f"{name}_lora_A")
                self._draw(a, 1 / math.sqrt(self._projection(name, whole=True)[0]),
                           f"{name}_lora_A")
                getattr(self, f"{name}_lora_B").zero_()

    def _adapter_sum(self):
        """_sum_adapter_grads where this process runs one TP rank of a LoRA
        layer (its gradients of w1's A and w2's B are partial sums), else
        None."""
        return self._sum_adapter_grads if self.tp_rank is not None and self.lora_rank else None

    def _sum_adapter_grads(self, layer, grads):
        """The adapters' gradients of this process's TP rank with those of
        w1's A and w2's B (which every TP rank holds whole) summed over its
        EP rank's TP ranks, in TP rank order as in one process (_sum_tp):
        one exchange of them over the layer's fabric (layer.all_gather),
        collective, after every backward pass."""
        whole = [i for i, n in enumerate(self.adapter_names()) if _adapter_tp(n) is None]
        flat = torch.cat([grads[i].reshape(-1) for i in whole])
        T, e = self.tp, self.first_rank
        mine = layer.all_gather(flat)[e * T:(e + 1) * T]  # [T, n]: this EP rank's TP ranks
        summed = _sum_tp(mine, 1, T)[0]
        grads = list(grads)
        at = 0
        for i in whole:
            n = grads[i].numel()
            grads[i] = summed[at:at + n].view_as(grads[i])
            at += n
        return grads

    def _tp_here(self):
        """True when this process runs several TP ranks of its EP ranks (one
        process, tp > 1): its tensors go to the runtime's ranks converted."""
        return self.tp > 1 and self.tp_rank is None

    def _mesh(self, x, topk_ids, topk_weights):
        """(x, topk_ids, topk_weights, w1, w2) as the runtime's ranks take them:
        with several TP ranks here, each EP rank's tokens once per TP rank and
        each rank's slice of the experts (differentiable)."""
        if not self._tp_here():
            return x, topk_ids, topk_weights, self.w1, self.w2
        T = self.tp
        w1, w2 = self._stored_mesh()[:2] if self.weights_transposed else \
            _to_tp(self.w1, self.w2, self.local_experts, T)
        return (_TpShare.apply(x, T), topk_ids.repeat_interleave(T, 0),
                _TpShare.apply(topk_weights, T), w1, w2)

    def _unmesh(self, y):
        """An output of the runtime's ranks as the module gives it."""
        return _TpTake.apply(y, self.tp) if self._tp_here() else y

    def _main_grads(self):
        if not self.main_grad or not self._trains:
            return None
        if self._tp_here():
            return _TpMainGrads((self.w1, self.w2), self.local_experts, self.tp)
        return (self.w1.main_grad, self.w2.main_grad)

    def _check_ddp(self):
        """Refuses a pass inside DistributedDataParallel's forward of a
        layer whose ranks are one per process when that DDP does not leave
        its parameters alone (moec_torch.prepare_ddp tells it to): DDP then
        copied rank 0's experts into every process as it wrapped the model,
        and would average different experts' gradients. Every process
        raises, before any exchange."""
        if not self._collective or self._ddp_group is not None:
            return
        mine = [id(p) for p in self.parameters()]
        for call in checks.callers(torch.nn.parallel.DistributedDataParallel.forward):
            ddp = call.get("self")
            held = {id(p): n for n, p in ddp.module.named_parameters()}
            if not any(i in held for i in mine):
                continue  # another DDP's forward calls this layer: not its
            ignored = set(ddp.parameters_to_ignore)
            if all(held.get(i) in ignored for i in mine):
                return  # told to leave them alone (by hand)
            raise RuntimeError(
                "moec: this layer runs inside DistributedDataParallel without "
                "moec_torch.prepare_ddp(model) before DistributedDataParallel(model): DDP "
                "treats each process's experts as replicas, so it copied rank 0's into "
                "every process when it wrapped the model and would average different "
                "experts' gradients; build the model again and call prepare_ddp first "
                "(docs/torch.md, \"DistributedDataParallel around the layer\")")

    def _check_dropped(self):
        """Raises, once, for a submitted pass whose handle was dropped unwaited."""
        dropped, self._dropped = getattr(self, "_dropped", None), None
        if dropped:
            raise RuntimeError(dropped)

    def _unsqueezed(self, x, *rest):
        """(squeeze, tensors): [S, ...] inputs of a one-rank process get
        their rank dim."""
        squeeze = x.dim() == 2 and self.local_ranks == 1
        tensors = (x, *rest)
        return squeeze, tuple(t.unsqueeze(0) for t in tensors) if squeeze else tensors

    def _forward_inputs(self, x, topk_ids, topk_weights):
        """What forward and submit_forward do before a pass: the checks
        (a dropped handle, DDP, dense tensors, finite values), autocast's
        casts, the rank dim of a one-rank process's [S, ...] inputs.
        Returns (squeeze, (x, topk_ids, topk_weights))."""
        self._check_dropped()
        self._check_ddp()
        self._check_dense(x=x, topk_ids=topk_ids, topk_weights=topk_weights)
        x, topk_weights = checks.autocast(x, self.dtype), checks.autocast(topk_weights,
                                                                          torch.float32)
        squeeze, (x, topk_ids, topk_weights) = self._unsqueezed(x, topk_ids, topk_weights)
        self._check_inputs(x, topk_weights)
        self._follow_requires_grad()
        return squeeze, (x, topk_ids, topk_weights)

    def _follow_requires_grad(self):
        """Before a pass under grad mode: the runtime's graphs follow the
        base weights' requires_grad (the class docstring, frozen). A layer
        whose base weights train in no graph (LoRA, quantized, stored
        transposed) raises where one of them requires grad, rather than
        leaving its .grad None."""
        if not torch.is_grad_enabled():
            return
        trained = [n for n in ("w1", "w2", *(("w1_scale", "w2_scale") if self.weight_format
                                              else ())) if getattr(self, n).requires_grad]
        if self.lora_rank or self.weight_format or self.weights_transposed:
            if trained:
                why, instead = (
                    (f"weight_format={self.weight_format!r} weights get no gradients",
                     "train a dense layer (no weight_format=, frozen=False)")
                    if self.weight_format else
                    (f"a LoRA layer (lora_rank={self.lora_rank}) trains its adapters, not its "
                     "base weights", "build the layer without lora_rank= to train them")
                    if self.lora_rank else
                    ("weights_transposed=True weights get no gradients (they are computed in "
                     "the [E, H, 2I] layout only)",
                     "build the layer with weights_transposed=False to train them"))
                them = "it" if len(trained) == 1 else "them"
                raise ValueError(
                    f"moec: {' and '.join(trained)} require{'s' if len(trained) == 1 else ''} "
                    f"grad, but {why}; call requires_grad_(False) on {them}, or {instead}")
            return
        trains = bool(trained)
        if trains == self._trains:
            return
        self.layer = self._recompiled(
            self.config, not trains,
            f"moec: w1 and w2 {'now require' if trains else 'no longer require'} grad, and "
            "the layer could not switch to the graphs that "
            f"{'compute' if trains else 'skip'} their gradients")
        self._binaries = self._made

    def _recompiled(self, cfg, frozen, message, what="the layer"):
        """A new runtime of this layer (`what`) for `cfg` with the weights
        frozen or trained (`frozen`), compiled (through the cache) and built.
        Under MPI every rank compiles, the ranks then tell each other whether
        they could, and none builds the runtime (whose fabric every rank
        creates together) unless all could: a failure raises
        RuntimeError("`message`: ...") on every rank. Collective: every rank
        calls it at the same pass. In one process the same RuntimeError
        carries the compiler's."""
        target, granularity = self._build[2:4]
        if frozen:  # (main_grad buffers take a trained layer's gradients)
            cfg = {k: v for k, v in cfg.items() if k != "main_grad"}

        def compiled(fresh):  # (through the module: a test stands in for it)
            return cache.compile_layer(cfg, self.ranks, target, granularity, fresh=fresh,
                                       frozen=frozen, lora_targets=self.lora_targets, tp=self.tp,
                                       weights_transposed=self.weights_transposed,
                                       weight_format=self.weight_format)

        if self._collective:
            try:
                paths, failure = compiled(False), None
            except Exception as e:  # noqa: BLE001 - every failure is told to the peers
                paths, failure = None, f"{type(e).__name__}: {e}"
            # (500 characters fit agree()'s 4096 bytes even as JSON escapes.)
            views = self._agree({"compiled": failure is None, "error": (failure or "")[:500]},
                                f"{message}: the ranks could not tell each other whether "
                                f"they compiled {what}")
            failed = [(r, v.get("error")) for r, v in enumerate(views) if not v.get("compiled")]
            if failed:
                raise RuntimeError(
                    f"{message}: compiling {what} failed on "
                    + "; ".join(f"rank {r}: {e}" for r, e in failed)) from None
        else:
            try:
                paths = compiled(False)
            except Exception as e:  # noqa: BLE001 - told with what was being compiled, and why
                raise RuntimeError(f"{message}: compiling {what} failed: "
                                   f"{type(e).__name__}: {e}") from e
        return _from_cache(lambda fresh: compiled(True) if fresh else paths,
                           self._runtime_layer)

    def _check_inputs(self, x, topk_weights):
        if self.check_finite:
            for name, t in (("x", x), ("topk_weights", topk_weights)):
                _check_finite(name, t, "rank", self.first_rank)
            for name, t in (("w1", self.w1), ("w2", self.w2)):
                _check_finite(name, t, "expert", self.first_rank * self.local_experts)

    def _check_dense(self, **tensors):
        """Refuses (checks.dense) an input, weight or adapter that is not a
        dense tensor with data (sparse, mkldnn, nested, meta), naming it."""
        for name, t in tensors.items():
            checks.dense(t, name)
        for name in ("w1", "w2", *self.adapter_names()):
            checks.dense(getattr(self, name), name)

    def forward(self, x, topk_ids, topk_weights):
        squeeze, (x, topk_ids, topk_weights) = self._forward_inputs(x, topk_ids, topk_weights)
        while True:
            try:
                y = self._unmesh(MoeFFNFunction.apply(
                    self.layer, *self._mesh(x, topk_ids, topk_weights), self.check_finite,
                    self.first_rank, self._main_grads(), None, self._grad_scale,
                    self._adapter_sum(), *self._bound()))
                if self.check_finite:
                    _check_finite("y", y, "rank", self.first_rank)
                return y.squeeze(0) if squeeze else y
            except RuntimeError as error:
                if "moec over capacity:" not in str(error):
                    raise
                capacity.grow(self, error)  # grows, or raises (the ranks decide together)

    def submit_forward(self, x, topk_ids, topk_weights):
        """Starts forward(x, topk_ids, topk_weights) on a thread of its own and
        returns a ForwardHandle at once; its wait() gives y, which under grad
        mode takes part in autograd as forward's does. Python work between
        the two runs beside the pass. Every handle must be waited exactly
        once: a second wait() raises, and a handle dropped unwaited makes the
        module's next call raise (its pass still runs to its end first).
        Passes of one module run one at a time, in the order submitted."""
        squeeze, (x, topk_ids, topk_weights) = self._forward_inputs(x, topk_ids, topk_weights)
        with torch.no_grad():
            mesh = self._mesh(x, topk_ids, topk_weights)
        ticket = self.layer.submit_forward(*mesh, [a.detach() for a in self._bound()])
        return ForwardHandle(self, ticket, (x, topk_ids, topk_weights), squeeze)

    def submit_backward(self, handle, dy):
        """Starts the backward pass of the waited forward `handle` for the
        output gradient dy and returns a BackwardHandle at once; its wait()
        gives the Gradients (dx, dtopk_weights, dw1, dw2, adapters), for a
        custom autograd.Function to return. As forward's backward: with
        main_grad=True the weight gradients are added into main_grad."""
        self._check_dropped()
        if not isinstance(handle, ForwardHandle) or handle.module is not self:
            raise ValueError("moec: submit_backward takes a ForwardHandle of this module")
        if handle.step is None:
            raise RuntimeError("moec: wait() the forward handle before submitting its backward")
        self._check_dense(dy=dy)
        x, ids, weights = handle.inputs
        squeeze, (dy,) = self._unsqueezed(dy) if handle.squeeze else (False, (dy,))
        main_grads = self._main_grads()
        with torch.no_grad():
            mesh = self._mesh(x, ids, weights)
            dy_mesh = dy.repeat_interleave(self.tp, 0) if self._tp_here() else dy
        ticket = handle.layer.submit_backward(
            handle.step, *mesh, _scaled_dy(dy_mesh.detach(), self._grad_scale),
            *(main_grads or (None, None)),
            [a.detach() for a in self._bound()])
        return BackwardHandle(self, ticket, handle.layer, main_grads, dy, squeeze,
                              handle.inputs)

    @property
    def capacity_policy(self):
        """"grow" or "error" (see the class); may be set after construction.
        Under MPI the ranks decide together at each over-capacity error."""
        return self._capacity_policy

    @capacity_policy.setter
    def capacity_policy(self, value):
        _check_policy(value)
        self._capacity_policy = value

    def _agree(self, mine, what):
        """Every process's `mine` (a dict, sent as JSON), in rank order:
        one bounded exchange over the layer's fabric (timeout_seconds); a
        failure raises RuntimeError("`what`: ...") naming the ranks that did
        not come. Collective under MPI: every rank calls it at the same
        point of its passes."""
        try:
            texts = self.layer.agree(json.dumps(mine, sort_keys=True))
        except RuntimeError as e:
            raise RuntimeError(f"{what}: {e}") from None
        views = []
        for r, text in enumerate(texts):
            try:
                view = json.loads(text)
            except ValueError:
                view = None
            if not isinstance(view, dict):
                raise RuntimeError(f"{what}: rank {r} sent {text[:200]!r}, not a moec_torch "
                                   "agreement (the ranks run different moec_torch)")
            views.append(view)
        return views

    def _agree_options(self, options):
        """Refuses, on every rank, options that differ between the ranks of
        an MPI layer (naming every rank's value): they decide what a rank
        does at a collective point (capacity_policy: whether it grows)."""
        views = self._agree(options, "moec: making the layer: the ranks could not compare "
                            "their options")
        for key, value in options.items():
            values = [v.get(key) for v in views]
            if any(v != value for v in values):
                raise ValueError(
                    f"moec: the ranks of an MPI layer must be given the same {key} (growing "
                    "the layer is collective: every rank grows, or none does); got "
                    + ", ".join(f"{v!r} on rank {r}" for r, v in enumerate(values)))

    def _runtime_layer(self, forward, backward):
        threads, timeout, _, _, fabric, trace = self._build
        packing = {True: "all", False: "none", "forward": "forward"}[self.pack_weights]
        layer = torch.classes.moec.Layer(forward, backward, threads, timeout, fabric, trace,
                                         packing, *_fabric_args(fabric, self.group))
        self._made = (forward, backward)
        # Whether its graphs compute w1's and w2's gradients (the binaries'
        # own record), which _follow_requires_grad keeps as requires_grad asks.
        self._trains = not layer.info()["frozen"]
        return layer

    def _read_files(self):
        """(what, path) of every file the layer reads: its config file (when
        given as a path), the target profile file, the task binaries, the
        graphs they were compiled from and the libraries. A file the layer
        writes (write_trace, save_adapters) must be none of them."""
        files = [("config", self._config_file), ("target profile", self._target_file)]
        files += [(f"{kind} binary", path)
                  for kind, path in zip(("forward", "backward"), self._binaries)]
        files += [("graph", native.graphs_dir() / g)
                  for g in _layer_graphs(not self._trains, self.lora_targets,
                                         self.weights_transposed,
                                         self.weight_format)]
        files += [("op library", native.op_library_path()),
                  ("compiler library", native.library_path())]
        return files

    def _output(self, path, who, argument, writes=True, collective=False):
        """`path` checked (checks.output_path) by the process that writes
        it (`writes`). For a collective call under MPI (`collective`) the
        ranks then agree, so that a path rank 0 refuses is refused on every
        rank rather than leaving the others waiting for it."""
        problem = None
        if writes:
            try:
                path = checks.output_path(path, who, argument, self._read_files())
            except ValueError as e:
                problem = str(e)
        if collective and self._collective:
            # (1000 characters fit agree()'s 4096 bytes even as JSON escapes.)
            views = self._agree({"refused": problem and problem[:1000]},
                                f"moec: {who}: the ranks could not "
                                "compare whether the path can be written")
            refused = [(r, v.get("refused")) for r, v in enumerate(views) if v.get("refused")]
            if refused and problem is None:
                problem = "; ".join(f"{text} (on rank {r})" for r, text in refused)
        if problem is not None:
            raise ValueError(problem)
        return os.fspath(path)

    def times(self):
        """Seconds of the last passes: forward and backward, each as
        (prepare, tasks, finish)."""
        t = self.layer.times()
        return {"forward": tuple(t[0:3]), "backward": tuple(t[3:6])}

    def write_trace(self, path, which="last"):
        """Writes the trace of the last "forward", "backward" or either
        ("last") pass to `path` as Chrome/Perfetto JSON, the format of
        ``moec run --trace``: the pass as it ran in this process (its
        tasks with their tiles, the waits with arrows from the signals that
        ended them, the prepare, tasks and finish phases). Needs
        ``trace=True`` at construction. Under MPI it is collective: every
        process calls it, and rank 0 writes one trace of every rank to
        `path` (the others write nothing).

        `path` is checked before the trace is gathered or built: its folder
        must exist, and it must not be the same file (links followed) as
        the config file, the target profile, the binaries, the graphs or
        the libraries the layer reads (ValueError naming both)."""
        path = self._output(path, "write_trace", "the trace path", self._writes_trace,
                            collective=True)
        self.layer.write_trace(path, which)

    def profile(self, which="forward"):
        """Where the last "forward" or "backward" pass's time went, as the
        table ``moec run --profile`` prints: per op its busy time, FLOPs or
        bytes, rate per core and share of one core's measured peak (measured
        once per process, when first asked for); per worker its busy and
        idle time and its time off its core in task runs (the OS ran
        something else there); the task runs that stalled (3x or more their
        op's median time for their work), each with its time off its core;
        the waits of parked cores by event; the host
        phases; and the op call's time around the runtime's pass. Needs
        ``trace=True`` at construction."""
        return self.layer.profile(which)

    def workspace(self):
        """The runtime's memory, as the table ``moec run --workspace`` prints:
        each pass's workspace tensors at their capacity and the pages of
        them resident now, the backward slots kept in dead forward ones, and
        the kernels' scratch. ``info()`` has the totals (workspace_bytes,
        workspace_resident, scratch_bytes, packed_weight_bytes)."""
        return self.layer.workspace()

    def info(self):
        """The layer's sizes and the runtime's totals (workers, workspace
        bytes allocated and resident, scratch bytes), as a dict."""
        return dict(self.layer.info())

    # Checkpoints (checkpoint): the layout that state_dict() records with the
    # weights, and load_state_dict()'s checks before it copies anything.

    def get_extra_state(self):
        return checkpoint.extra_state(self)

    def set_extra_state(self, state):
        checkpoint.load_extra_state(self, state)

    def _check_checkpoint(self, state_dict, prefix, *_):
        """load_state_dict's pre-hook: checkpoint.check_state_dict (which
        reads the call's strict itself: the hook's is always True)."""
        checkpoint.check_state_dict(self, state_dict, prefix)

    # LoRA adapters in PEFT's layout.

    PEFT_MODULES = {"w1": "gate_up_proj", "w2": "down_proj"}

    def _peft_names(self, module_prefix, experts=None):
        """(parameter name, expert, PEFT name) of every adapter tensor this
        process holds; with `experts` (a range of global experts), the names
        of those experts (the parameter and index are then of no use)."""
        first = self.first_rank * self.local_experts
        held = range(first, first + self.local_ranks * self.local_experts)
        for target in self.lora_targets:
            module = self.PEFT_MODULES[target]
            for m in "AB":
                for e in (held if experts is None else experts):
                    yield (f"{target}_lora_{m}", e - first,
                           f"base_model.model.{module_prefix}.{e}.{module}.lora_{m}.weight")

    def save_adapters(self, directory, module_prefix="experts"):
        """Writes the LoRA adapters as PEFT saves a LoRA model: adapter_config.json
        (r, lora_alpha, target_modules: "gate_up_proj" for w1, the fused
        gate/up projection, "down_proj" for w2) and adapter_model.safetensors
        with ``base_model.model.{module_prefix}.{expert}.{module}.lora_A.weight``
        [r, in] and ``lora_B.weight`` [out, r] (nn.Linear's layout: A and B
        transposed). These are the names of this layer's own fused modules;
        for a Hugging Face model's gate_proj/up_proj/down_proj adapters see
        moec_torch.hf. Under mpirun each process writes its own experts to
        adapter_model-rank{r}-of-{R}.safetensors and rank 0 the config (with
        a TP rank per process it holds parts of the adapters, and this is
        refused: merge the state dicts);
        load_adapters reads either form. The files are replaced whole or
        not at all (safetensors.write_together: written under scratch names,
        then renamed, the config last). Returns the files written."""
        return adapters.save_layer(self, directory, module_prefix)

    def load_adapters(self, directory, module_prefix="experts"):
        """Loads adapters that save_adapters (or PEFT, with the same names)
        wrote. adapter_config.json is checked (adapters.read_config: every
        field of its type) and must match this layer: r, lora_alpha, the
        target modules and, where save_adapters recorded them, the number
        of experts and the module prefix. Only the files the config names
        are read (adapter_model.safetensors, else adapter_model.bin with
        torch.load(weights_only=True), which runs no code from the file;
        the rank files that hold this process's experts), never another
        file of the folder. Every tensor of this process's experts must be
        there, floating point and of its whole expert's shape, and no tensor
        may name an expert the layer lacks, before any is copied; a TP rank
        per process keeps its part (w1's B's columns, w2's A's rows)."""
        adapters.load_layer(self, directory, module_prefix)

    def extra_repr(self):
        # A LoRA layer's base weights are frozen and its adapters train: say
        # that, not frozen=True (the frozen= argument's layer trains nothing).
        return (f"ranks={self.ranks}, tp={self.tp}, fabric={self.fabric}, "
                f"first_rank={self.first_rank}, "
                + (f"tp_rank={self.tp_rank}, " if self.tp_rank is not None else "") +
                f"local_ranks={self.local_ranks}, experts={self.experts}, hidden={self.hidden}, "
                f"inter={self.inter}, top_k={self.top_k}, tokens={self.tokens}, "
                f"dtype={self.dtype}, "
                + (f"lora_rank={self.lora_rank}, lora_targets={self.lora_targets}, "
                   f"lora_scaling={self.lora_scaling:g} (base weights frozen, adapters "
                   "trained)" if self.lora_rank else
                   f"frozen={not (self.w1.requires_grad or self.w2.requires_grad)}, "
                   f"main_grad={self.main_grad}")
                + (", dispatch_dtype=fp8_e4m3" if self.dispatch_dtype == "fp8_e4m3" else "")
                + (", weights_transposed=True" if self.weights_transposed else "")
                + (f", weight_format={self.weight_format}" if self.weight_format else "")
                + (f", pack_weights={self.pack_weights!r}" if self.pack_weights else ""))

    def _apply(self, fn):
        """nn.Module's conversions (.to(), .float(), .bfloat16(), .half(), a
        model's of its submodules) over the layer's tensors, which keep
        their dtypes: the layer's binaries are compiled for its dtype, and a
        quantized layer's scales are float32 in any dtype. A conversion that
        would change the layer's dtype (model.to(torch.bfloat16) around an
        fp32 layer) leaves it and warns once; one off the CPU is refused
        before any of its tensors moves (the runtime runs on the CPU)."""
        made = {}  # dtype -> what fn makes of a tensor of it

        def probe(dtype):
            if dtype not in made:
                made[dtype] = fn(torch.zeros((), dtype=dtype))
            return made[dtype]

        tensors = [t for t in (*self._parameters.values(), *self._buffers.values())
                   if t is not None]
        for t in tensors:
            if probe(t.dtype).device.type != "cpu":
                raise RuntimeError(
                    f"moec: a MoeFFN layer cannot move to {probe(t.dtype).device}: the moec "
                    "runtime runs on the CPU (its tensors stay there)")
        asked = probe(self.dtype).dtype
        if asked != self.dtype and not self._warned_dtype:
            self._warned_dtype = True
            warnings.warn(
                f"moec: the MoeFFN layer stays {self.dtype} ({asked} asked): its binaries are "
                f"compiled for {self.dtype}, and it keeps its tensors' dtypes. For another "
                "dtype make the layer with the config's \"dtype\" (MoeFFN(config, ...), "
                "then load_state_dict); patch_model(model, dtype=...) for a Hugging Face model",
                stacklevel=3)
        return super()._apply(lambda t: fn(t) if probe(t.dtype).dtype == t.dtype else t)

    # A layer owns a runtime (compiled binaries, worker threads, under MPI a
    # place in a collective order) that cannot be copied or pickled; its
    # state is state_dict().

    def __reduce_ex__(self, protocol):
        raise TypeError(_NOT_PICKLED.format(what="a MoeFFN layer"))

    def __deepcopy__(self, memo):
        raise TypeError(_NOT_PICKLED.format(what="a MoeFFN layer"))


_NOT_PICKLED = (
    "moec: {what} cannot be copied or pickled (copy.deepcopy, pickle, torch.save of the "
    "module): it owns a runtime of compiled binaries and threads. Save its state instead, "
    "moec_torch.save_state(layer.state_dict(), path), and rebuild it with the same "
    "arguments: layer = moec_torch.MoeFFN(config, ...); "
    "layer.load_state_dict(torch.load(path, weights_only=True))")
