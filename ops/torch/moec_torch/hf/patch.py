"""patch_model: a model's MoE blocks on moec's layer (LoRA in PEFT's layout); its EP group. See
the package's docstring."""

import math
import re
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import adapters, checks, quant

from .families import (
    FAMILIES,
    _dtype_name,
    _expert_sizes,
    _expert_weights,
    _fused,
    _BY_BLOCK,
    _known,
    _looks_like_moe,
)


# --- LoRA in PEFT's layout --------------------------------------------------

FUSED_PARAMETERS = ("gate_up_proj", "down_proj")  # v5's fused experts' parameters


class _Lora:
    """The LoRA adapters of one block as PEFT puts them, held in the layer's
    adapters of w1 and w2.

    form "modules": PEFT's LoRA on the per-expert nn.Linear modules
    (target_modules): the family's gate, up and down modules an A and a B
    each. form "parameters": PEFT's LoRA on v5's fused parameters
    (target_parameters): gate_up_proj one A and B over both its halves,
    down_proj one. ranks: {piece: rank} of the targeted pieces. The layer's
    w1 adapter holds the w1 pieces side by side (A columns and B rows from 0
    in the order gate, up, each over its own columns of w1), w2's its piece
    in its first columns / rows; rank: the larger of the two; masks keep the
    rest zero. scaling: the pieces' common lora_alpha / r (rsLoRA: / sqrt(r));
    alpha: the first piece's lora_alpha; layer_alpha: the layer's lora_alpha
    (its lora_alpha / rank is the scaling). peft: the adapter config's
    fields save_adapters writes (r, lora_alpha, use_rslora, rank_pattern,
    alpha_pattern). nesting: the targeted parameters in the order PEFT wraps
    them, innermost first (the experts module's parameter order)."""

    def __init__(self, family, form, ranks, scaling, alpha, peft, nesting=()):
        self.family = family
        self.form = form
        self.ranks = dict(ranks)
        self.scaling = scaling
        self.peft = peft
        self.nesting = tuple(n for n in nesting if n in ranks)
        g, u, d = family.projections if form == "modules" else \
            (FUSED_PARAMETERS[0], None, FUSED_PARAMETERS[1])
        self._gate = g
        self.w1_targets = [t for t in (g, u) if t in ranks]
        self.down = d if d in ranks else None
        self.rank = max(sum(ranks[t] for t in self.w1_targets), ranks.get(self.down, 0))
        r = self.ranks[next(iter(ranks))]
        self.layer_alpha = alpha / math.sqrt(r) * self.rank if peft["use_rslora"] else \
            alpha * self.rank / r
        self.moec_targets = (("w1",) if self.w1_targets else ()) + (("w2",) if self.down else ())

    def pieces(self, inter):
        """[(module, moec target, A column slice, B row slice, B column slice)]:
        where each PEFT adapter lives in the layer's A [K, rank] and B
        [rank, N]."""
        out, at = [], 0
        for t in self.w1_targets:
            rows = slice(at, at + self.ranks[t])
            at += self.ranks[t]
            cols = slice(0, 2 * inter) if self.form == "parameters" else \
                slice(0, inter) if t == self._gate else slice(inter, 2 * inter)
            out.append((t, "w1", rows, rows, cols))
        if self.down:
            rows = slice(0, self.ranks[self.down])
            out.append((self.down, "w2", rows, rows, slice(None)))
        return out

    def masks(self, layer):
        """{parameter name: 0/1 mask} of the entries that belong to an adapter
        (of B, with a TP rank per process, the TP rank's part)."""
        masks = {}
        for target in self.moec_targets:
            a = getattr(layer, f"{target}_lora_A")
            masks[f"{target}_lora_A"] = torch.zeros(1, 1, a.shape[2], dtype=a.dtype)
            masks[f"{target}_lora_B"] = torch.zeros(
                1, *layer._whole_shape(f"{target}_lora_B"), dtype=a.dtype)
        for _, target, acols, brows, bcols in self.pieces(layer.inter):
            masks[f"{target}_lora_A"][..., acols] = 1
            masks[f"{target}_lora_B"][:, brows, bcols] = 1
        for target in self.moec_targets:
            name = f"{target}_lora_B"
            masks[name] = layer._tp_part(name, masks[name])[0].contiguous()
        return masks


# --- the moec experts module ------------------------------------------------

class MoecExperts(torch.nn.Module):
    """A block's routed experts on a moec MoeFFN layer, called as transformers
    v5 calls its experts module: forward(hidden_states [N, H], top_k_index
    [N, K], top_k_weights [N, K]) -> [N, H], in hidden_states' dtype.

    In one process with R in-process ranks the N tokens are shared out over
    the ranks, ceil(N / R) each, the last padded with tokens of zero weight
    that add exact zeros; under mpirun each process passes its own tokens.
    `layer` is the MoeFFN; `family` the model family; `lora` the PEFT layout
    of its adapters, or None."""

    def __init__(self, layer, family, lora=None):
        super().__init__()
        self.layer = layer
        self.family = family
        self.num_experts = layer.experts
        self.lora = lora
        self._masks = lora.masks(layer) if lora else {}
        for name, mask in self._masks.items():
            getattr(layer, name).register_hook(lambda g, m=mask: g * m.to(g.dtype))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        layer = self.layer
        n, h = hidden_states.shape
        k = top_k_index.shape[-1]
        x = hidden_states.to(layer.dtype)
        weights = top_k_weights.float()
        ids = top_k_index.long()
        # The ranks this process runs: all of them in one process, its own
        # under mpirun. Each gets ceil(n / r) tokens (at least one).
        r = layer.local_ranks
        s = max(1, -(-n // r))
        pad = r * s - n
        if pad:
            x = torch.cat((x, x.new_zeros(pad, h)))
            weights = torch.cat((weights, weights.new_zeros(pad, k)))
            spread = (torch.arange(pad).unsqueeze(1) * k + torch.arange(k)) % layer.experts
            ids = torch.cat((ids, spread))
        if r == 1:
            return layer(x, ids, weights)[:n].to(hidden_states.dtype)
        y = layer(x.view(r, s, h), ids.view(r, s, k), weights.view(r, s, k))
        return y.reshape(r * s, h)[:n].to(hidden_states.dtype)

    def extra_repr(self):
        if not self.lora:
            return f"family={self.family.name}"
        pieces = ", ".join(f"{t} r={r}" for t, r in self.lora.ranks.items())
        return f"family={self.family.name}, lora ({self.lora.form}) {pieces}"


def _route_softmax(block, hidden_states):
    """transformers v4's Qwen2/3-MoE, Mixtral and OLMoE routing: softmax in
    fp32 over all experts, top-k, renormalized (Mixtral always, the others
    when norm_topk_prob), cast back to the hidden dtype."""
    logits = block.gate(hidden_states)
    weights = F.softmax(logits, dim=1, dtype=torch.float)
    weights, selected = torch.topk(weights, block.top_k, dim=-1)
    if getattr(block, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, selected, weights.to(hidden_states.dtype)


def _softmax_block_forward(self, hidden_states):
    """The v4 block's forward with moec's experts: the same routing, shared
    expert and return value ((hidden states, router logits)), for hidden
    states of any shape [..., H]."""
    shape = hidden_states.shape
    if self.training and getattr(self, "jitter_noise", 0) > 0:  # Mixtral
        hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
            1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
    flat = hidden_states.reshape(-1, shape[-1])
    logits, selected, weights = _route_softmax(self, flat)
    out = self.experts(flat, selected, weights)
    if hasattr(self, "shared_expert"):  # Qwen2-MoE
        shared = self.shared_expert(flat)
        out = out + torch.sigmoid(self.shared_expert_gate(flat)) * shared
    return out.reshape(shape), logits


def _moe_method(self, hidden_states, topk_indices, topk_weights):
    """DeepSeek's v4 ``moe`` method (the routed experts' sum) on moec's
    experts; the block's forward (router, shared experts) stays its own."""
    return self.experts(hidden_states, topk_indices, topk_weights).to(hidden_states.dtype)



def find_blocks(model):
    """[(name, block, family)] of every MoE block of `model`, in module
    order. A module that looks like an MoE block (experts and a gate) of
    an unknown class is refused, naming it and the known families."""
    found = []
    for name, module in model.named_modules():
        if any(name.startswith(f + ".") for f, _, _ in found):
            continue
        family = _BY_BLOCK.get(type(module).__name__)
        if isinstance(getattr(module, "experts", None), MoecExperts):
            raise ValueError(f"moec: the model is patched already ('{name}.experts' is moec's)")
        if family is not None:
            found.append((name, module, family))
        elif _looks_like_moe(module) and not isinstance(module, torch.nn.ModuleList):
            raise ValueError(
                f"moec: '{name}' ({type(module).__name__}) looks like an MoE block (it has "
                f"experts and a router) but is not one moec knows; known: {_known()}")
    return found


# --- patching ---------------------------------------------------------------

def _config_of(model):
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError("moec: the model has no .config (a Hugging Face model carries its "
                         "PretrainedConfig as model.config)")
    return config


def _family_of_config(config):
    model_type = getattr(config, "model_type", None)
    return next((f for f in FAMILIES if f.name == model_type), None)


def _top_k(block, config):
    for source in (block, getattr(block, "gate", None), config):
        for key in ("top_k", "num_experts_per_tok"):
            value = getattr(source, key, None) if source is not None else None
            if isinstance(value, int) and value > 0:
                return value
    raise ValueError("moec: cannot tell the block's top-k (no top_k or num_experts_per_tok)")


def _peft_matches(spec, key, shown, field):
    """PEFT's target rule: a string is a regex matched whole against `key`,
    but "all-linear" (any case), PEFT's name for every nn.Linear but the
    output layer, which the experts' projections are; a list matches a key
    equal to an entry or ending with "." + entry."""
    if isinstance(spec, str) and spec.lower() == "all-linear":
        return True
    if isinstance(spec, str):
        try:
            return re.fullmatch(spec, key) is not None
        except re.error as e:
            raise ValueError(f"{shown}: '{field}' {spec!r} is not a regex ({e})") from None
    return any(key == t or key.endswith("." + t) for t in spec or ())


def _pattern_value(patterns, key, default, shown, field):
    """PEFT's rank_pattern / alpha_pattern lookup: the value of the first
    pattern P that `key` matches as (.*[.])?(P)$, else `default`."""
    for pattern, value in (patterns or {}).items():
        try:
            if re.match(rf"(.*\.)?({pattern})$", key):
                return value
        except re.error as e:
            raise ValueError(f"{shown}: '{field}' key {pattern!r} is not a regex ({e})") from None
    return default


def _lora_request(lora_rank, lora_alpha, lora_targets, lora_target_parameters, lora_config):
    """(adapter config, how errors name it, whether it came from the bare
    lora_ arguments) of patch_model's LoRA arguments; (None, None, False)
    without LoRA."""
    if lora_config is not None:
        if lora_rank or any(v is not None for v in (lora_alpha, lora_targets,
                                                     lora_target_parameters)):
            raise ValueError("moec: patch_model: lora_config= gives the adapters' rank, alpha "
                             "and targets; pass it without lora_rank=, lora_alpha=, "
                             "lora_targets= or lora_target_parameters=")
        if isinstance(lora_config, dict):
            shown = "moec: patch_model: lora_config"
            config = adapters.check_config(dict(lora_config), shown)
        else:
            folder = Path(lora_config)
            shown = f"moec: {checks.where(folder / adapters.CONFIG, 'adapter config')}"
            config = adapters.read_config(folder)
        adapters.refuse_unsupported(config, shown)
        return config, shown, False
    lora_rank = checks.integer(lora_rank, "patch_model: argument 'lora_rank'", minimum=0)
    if not lora_rank:
        for value, arg in ((lora_alpha, "lora_alpha"), (lora_targets, "lora_targets"),
                           (lora_target_parameters, "lora_target_parameters")):
            if value is not None:
                raise ValueError(f"moec: {arg}= needs lora_rank= (the adapters' rank)")
        return None, None, False
    alpha = checks.number(lora_alpha, "patch_model: argument 'lora_alpha'") \
        if lora_alpha is not None else float(lora_rank)
    config = {"peft_type": "LORA", "r": lora_rank, "lora_alpha": alpha}
    if lora_target_parameters is not None:
        if lora_targets is not None:
            raise ValueError("moec: patch_model: lora_targets= (PEFT's target_modules) or "
                             "lora_target_parameters= (its target_parameters), not both")
        names = [lora_target_parameters] if isinstance(lora_target_parameters, str) else \
            list(lora_target_parameters)
        if not names or any(t not in FUSED_PARAMETERS for t in names):
            raise ValueError(f"moec: lora_target_parameters {names}: the fused experts' "
                             f"parameters are {', '.join(FUSED_PARAMETERS)}")
        config["target_parameters"] = names
    else:
        config["target_modules"] = [lora_targets] if isinstance(lora_targets, str) else \
            lora_targets
    return config, "moec: patch_model", True


def _block_lora(name, family, experts, fused, nesting, config, shown, bare=False):
    """The _Lora of one block (`experts` experts; `fused`: v5's fused
    parameters, wrapped by PEFT in the order `nesting`) for the adapter
    config (_lora_request's): the pieces it targets, their ranks and their
    common scaling, found by PEFT's rules on the names PEFT gives them
    (per-expert modules under the checkpoint's names, fused parameters
    under the model's)."""
    if config.get("target_parameters"):
        version = re.match(r"(\d+)\.(\d+)", str(config.get("peft_version") or ""))
        if version and (int(version[1]), int(version[2])) < (0, 19):
            raise ValueError(f"{shown}: target_parameters adapters written by PEFT "
                             f"{config['peft_version']}: before PEFT 0.19 lora_A spanned an "
                             "[E, out, in] parameter's dim 1 (out) and lora_B its dim 2, "
                             "the other way round from PEFT 0.19's layout, which moec reads")
        if not fused:
            raise ValueError(f"{shown}: target_parameters name v5's fused expert parameters; "
                             f"the experts of '{name}' are per-expert modules (transformers "
                             "v4): target their modules (target_modules)")
        form, spec, field = "parameters", config["target_parameters"], "target_parameters"
        keys = {p: [f"{name}.experts.{p}"] for p in FUSED_PARAMETERS}
    else:
        if family.checkpoint_experts == "fused":
            raise ValueError(
                f"{shown}: {family.name} models and checkpoints have no per-expert modules "
                "(their experts are fused parameters, with no conversion to and from "
                "per-expert names), so adapters on gate_proj/up_proj/down_proj would be files "
                "no PEFT model of theirs loads: put LoRA on the fused parameters, "
                "lora_target_parameters=['gate_up_proj', 'down_proj'] (PEFT's "
                "target_parameters)")
        form, spec, field = "modules", config.get("target_modules"), "target_modules"
        prefix = _checkpoint_prefix(name, family)
        keys = {p: [f"{prefix}.experts.{e}.{p}" for e in range(experts)]
                for p in family.projections}
        if bare:
            spec = tuple(family.projections if spec is None else spec)
            if not spec or any(t not in family.projections for t in spec):
                raise ValueError(f"moec: lora_targets {list(spec)} of '{name}': {family.name} "
                                 f"experts have {', '.join(family.projections)}")
        elif spec is None:
            raise ValueError(f"{shown}: no target_modules (PEFT then targets the model "
                             "type's defaults, which moec does not guess): name the experts' "
                             "modules or parameters")
    ranks, alphas = {}, {}
    for piece, names in keys.items():
        hits = [_peft_matches(spec, k, shown, field) for k in names]
        if not any(hits):
            continue
        if not all(hits):
            raise ValueError(f"{shown}: {field} adapt some experts of '{name}' only "
                             f"('{names[hits.index(True)]}' but not "
                             f"'{names[hits.index(False)]}'); moec adapts a projection of "
                             "every expert or of none")
        got = {(_pattern_value(config.get("rank_pattern"), k, config["r"], shown,
                               "rank_pattern"),
                _pattern_value(config.get("alpha_pattern"), k, config["lora_alpha"], shown,
                               "alpha_pattern")) for k in names}
        if len(got) > 1:
            raise ValueError(f"{shown}: rank_pattern / alpha_pattern give the experts of "
                             f"'{name}' different ranks or alphas for {piece} "
                             f"({sorted(got)}); moec's layer gives every expert the same")
        ranks[piece], alphas[piece] = got.pop()
    if not ranks:
        raise ValueError(f"{shown}: the adapters ({field} {spec!r}) target none of the "
                         f"experts' {'parameters' if form == 'parameters' else 'modules'} of "
                         f"'{name}' ({', '.join(keys)}); moec puts adapters on every MoE "
                         "block's experts")
    rslora = bool(config.get("use_rslora"))

    def scaling(piece):
        return alphas[piece] / (math.sqrt(ranks[piece]) if rslora else ranks[piece])

    first = next(iter(ranks))
    for piece in ranks:
        if not math.isclose(scaling(piece), scaling(first), rel_tol=1e-12):
            raise ValueError(f"{shown}: the adapters of '{name}' scale {first} by "
                             f"{scaling(first):g} and {piece} by {scaling(piece):g}; moec's layer "
                             "scales all of a block's adapters alike")
    peft = {"r": config["r"], "lora_alpha": config["lora_alpha"], "use_rslora": rslora,
            "rank_pattern": dict(config.get("rank_pattern") or {}),
            "alpha_pattern": dict(config.get("alpha_pattern") or {})}
    return _Lora(family, form, ranks, scaling(first), alphas[first], peft, nesting)


def patch_model(model, ranks=None, *, threads=0, dtype=None, tokens_per_rank=256,
                lora_rank=0, lora_alpha=None, lora_targets=None, lora_target_parameters=None,
                lora_config=None, **options):
    """Replaces the routed experts of every MoE block of `model` with a moec
    layer, in place, and returns the names of the blocks it replaced.

    ranks: the EP group's size (default 1 in one process; under mpirun or
    over a torch.distributed group, the processes); threads: the runtime's workers per block (0: the hardware
    threads); dtype: the layer's (default the experts' weights', float32 or
    bfloat16); tokens_per_rank: the capacity compiled first (it grows with
    the batches). lora_rank, lora_alpha, lora_targets: LoRA adapters as PEFT
    puts them on the experts' projections (lora_targets: the family's module
    names, default all three: gate_proj, up_proj, down_proj, Mixtral w1, w3,
    w2; lora_alpha defaults to lora_rank); the experts' base weights are then
    frozen. lora_target_parameters (instead of lora_targets; fused v5
    experts only): PEFT's target_parameters form, an adapter on each named
    fused parameter (gate_up_proj: one over gate and up; down_proj).
    lora_config (instead of the lora_ arguments): a PEFT adapter folder (its
    adapter_config.json) or such a config as a dict, whose r, lora_alpha,
    use_rslora, target_modules or target_parameters, rank_pattern and
    alpha_pattern give the adapters, as PEFT reads them: patch for the
    adapters, then load_adapters. Other options go to MoeFFN (frozen, main_grad, dispatch_dtype,
    capacity_policy, timeout_seconds, fabric, group, target, check_finite, trace,
    weight_format, pack_weights, tp: with tp > 1 one rank per process, each
    process copies in its TP rank's columns of its experts, and of LoRA
    adapters its part). With a weight_format (frozen or LoRA;
    quant.WEIGHT_FORMATS)
    the experts are held quantized: "fp8_block128" as FP8 e4m3 codes with a
    scale per 128 x 128 block, for which load_experts copies an FP8
    checkpoint's weight and weight_scale_inv as they are; "int8" and
    "int4_g*" (and an FP8 layer from a bf16 or fp32 checkpoint) quantize the
    experts as they are loaded.

    The model's expert weights (on any device but meta) are converted once
    into the layer's and freed, except fused (v5) experts of a frozen or
    LoRA layer, which the layer reads in place (the module docstring); a
    model built with its experts on the meta device is patched with empty
    experts, for load_experts to fill."""
    config = _config_of(model)
    blocks = find_blocks(model)
    if not blocks:
        family = _family_of_config(config)
        what = f"a {family.name} model" if family else \
            f"model_type {getattr(config, 'model_type', None)!r}"
        raise ValueError(f"moec: found no MoE block in {type(model).__name__} ({what}); "
                         f"known blocks: {_known()}")
    tokens_per_rank = checks.integer(tokens_per_rank, "patch_model: argument 'tokens_per_rank'",
                                     minimum=1)
    request, shown, bare = _lora_request(lora_rank, lora_alpha, lora_targets,
                                         lora_target_parameters, lora_config)
    from .. import MoeFFN, _default_fabric, _fabric  # the package imports this lazily
    fabric = options.get("fabric")
    if ranks is None:
        # The processes under mpirun or over a torch.distributed group,
        # else 1.
        spread = options.get("group") is not None or \
            (fabric or _default_fabric()) in ("mpi", "group")
        ranks = _fabric(fabric, options.get("group"), None, options.get("tp", 1),
                        "patch_model")[1] if spread else 1
    group = checks.integer(ranks, "patch_model: argument 'ranks'", minimum=1)
    # Check every block before changing any.
    plans = []
    for name, block, family in blocks:
        e, h, i = _expert_sizes(block, family, name)
        k = _top_k(block, config)
        if e % group:
            raise ValueError(f"moec: the {e} experts of '{name}' do not divide over {group} "
                             "ranks (each rank holds the same number of experts)")
        # (a vision-language model's text settings are its text_config's)
        act = getattr(getattr(config, "text_config", None) or config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"moec: the experts of '{name}' use hidden_act {act!r}; the layer "
                             "computes SwiGLU (silu(gate) * up) only")
        if not _fused(block.experts) and family.routing == "moe_method" and \
                not callable(getattr(block, "moe", None)):
            raise ValueError(f"moec: '{name}' ({type(block).__name__}) has no moe method to "
                             "replace; this version of the block is not one moec knows")
        weight = block.experts.gate_up_proj if _fused(block.experts) else \
            getattr(block.experts[0], family.projections[0]).weight
        layer_dtype = dtype or weight.dtype
        lora = _block_lora(name, family, e, _fused(block.experts),
                           [n for n, _ in block.experts.named_parameters(recurse=False)],
                           request, shown, bare) if request else None
        cfg = {"name": f"hf-{family.name}", "hidden_size": h, "intermediate_size": i,
               "num_experts": e, "top_k": k, "seq_size": tokens_per_rank,
               "dtype": _dtype_name(layer_dtype, f"'{name}'")}
        plans.append((name, block, family, cfg, weight.is_meta, lora))
    names = []
    for name, block, family, cfg, empty, lora in plans:
        lora_args = dict(lora_rank=lora.rank, lora_alpha=lora.layer_alpha,
                         lora_targets=lora.moec_targets) if lora else {}
        # Fused experts of a frozen or LoRA layer stay in the model's layout
        # (gate_up_proj [E, 2I, H], down_proj [E, H, I]), which the layer
        # reads in place; with expert tensor parallelism (which that layout
        # does not take) they are converted as trained ones are.
        fused = _fused(block.experts)
        transposed = (fused and (bool(lora) or bool(options.get("frozen"))) and
                      options.get("tp", 1) == 1) or bool(options.get("weight_format"))
        layer = MoeFFN(cfg, ranks, threads=threads, init_weights=False,
                       weights_transposed=transposed, **lora_args, **options)
        if not (fused and transposed and _adopt(layer, block.experts)):
            _copy_in(layer, block, family, empty)
        if lora:
            _init_lora(layer, lora)
        block.experts = MoecExperts(layer, family, lora)
        if not fused:
            if family.routing == "moe_method":
                block.moe = types.MethodType(_moe_method, block)
            else:
                block.forward = types.MethodType(_softmax_block_forward, block)
        names.append(name)
    return names


def _local_experts(layer):
    first = layer.first_rank * layer.local_experts
    return range(first, first + layer.w1.shape[0])


def _adopt(layer, experts):
    """Makes the model's fused gate_up_proj and down_proj the layer's w1 and
    w2 (the same tensors: nothing is copied) where the layer holds every
    expert in that layout and dtype; returns whether it did."""
    w1, w2 = experts.gate_up_proj, experts.down_proj
    if not all(isinstance(w, torch.nn.Parameter) and not w.is_meta and w.device.type == "cpu"
               and w.dtype == layer.w1.dtype and w.is_contiguous()
               for w in (w1, w2)):
        return False
    if tuple(w1.shape) != tuple(layer.w1.shape) or tuple(w2.shape) != tuple(layer.w2.shape):
        return False  # under mpirun the layer holds its rank's experts only
    w1.requires_grad_(False)
    w2.requires_grad_(False)
    layer.w1, layer.w2 = w1, w2
    return True


def _set_expert(layer, j, gate, up, down):
    """Expert j of the layer from its nn.Linear weights [out, in]: copied,
    or for quantized weights quantized (the stored matrices, gate and up
    rows stacked, in the layer's format). A process of an expert tensor
    parallel layer (tp > 1, one rank per process) takes its TP rank's
    slice: gate's and up's rows t I/T .. (t+1) I/T - 1 and down's columns
    (of a quantized expert, quantized whole: _store_quantized)."""
    if not layer.weight_format:
        if layer.tp_rank is not None:
            i, t = layer.local_inter, layer.tp_rank
            gate, up, down = gate[t * i:(t + 1) * i], up[t * i:(t + 1) * i], \
                down[:, t * i:(t + 1) * i]
        for to, w in zip(layer.projections(), (gate, up, down)):
            to[j].copy_(w)
        return
    _store_quantized(layer, j, *quant.quantize(layer.weight_format, torch.cat((gate, up))),
                     *quant.quantize(layer.weight_format, down))


def _store_quantized(layer, j, w1, w1_scale, w2, w2_scale):
    """Expert j of a quantized layer from the whole expert's codes and
    scales as the format stores them (w1 [2I, H]: gate rows, then up; w2
    [H, I]): a process of one TP rank keeps its part (MoeFFN._tp_part)."""
    for name, codes, scales in (("w1", w1, w1_scale), ("w2", w2, w2_scale)):
        codes, scales = layer._tp_part(name, codes, scales)
        getattr(layer, name)[j].copy_(codes)
        getattr(layer, name + "_scale")[j].copy_(scales)


def _copy_in(layer, block, family, empty):
    """Copies this process's experts of `block` into the layer (unless the
    model's are on meta), one expert at a time."""
    with torch.no_grad():
        if empty:
            for p in (layer.w1, layer.w2, *([layer.w1_scale, layer.w2_scale]
                                            if layer.weight_format else [])):
                p.zero_()
            return
        for j, e in enumerate(_local_experts(layer)):
            _set_expert(layer, j, *_expert_weights(block, family, e))


def _init_lora(layer, lora):
    """PEFT's start: each module's A uniform in ±1/sqrt(in) (its
    kaiming_uniform(a=sqrt(5))), drawn for every expert of the model so that
    every process draws the same; B zero; the entries of no adapter zero."""
    masks = lora.masks(layer)
    with torch.no_grad():
        for target in lora.moec_targets:
            getattr(layer, f"{target}_lora_A").zero_()
            getattr(layer, f"{target}_lora_B").zero_()
        local = _local_experts(layer)
        for e in range(layer.experts):
            for module, target, acols, _, _ in lora.pieces(layer.inter):
                # Drawn whole (fan in K: all of I for w2's A), of which a TP
                # rank per process keeps its part.
                name = f"{target}_lora_A"
                k = layer._whole_shape(name)[0]
                draw = torch.empty(k, acols.stop - acols.start).uniform_(-1, 1) / math.sqrt(k)
                if e in local:
                    a = getattr(layer, name)
                    a[e - local.start][:, acols] = layer._tp_part(name, draw)[0].to(a.dtype)
        for name, mask in masks.items():
            getattr(layer, name).mul_(mask)


def _patched(model):
    """[(name, block, experts)] of the patched blocks; raises if none."""
    out = [(name, m, m.experts) for name, m in model.named_modules()
           if isinstance(getattr(m, "experts", None), MoecExperts)]
    if not out:
        raise ValueError("moec: the model has no moec experts; call patch_model(model) first")
    return out


def _checkpoint_prefix(name, family):
    """The block's name in checkpoints ("model.layers.3.mlp")."""
    if family.checkpoint_block:
        parent, _, last = name.rpartition(".")
        if last != family.checkpoint_block:
            return f"{parent}.{family.checkpoint_block}" if parent else family.checkpoint_block
    return name


def _expert_entries(blocks, rank):
    """[(checkpoint name, dtype, shape)] of rank `rank`'s experts of every
    patched block: what that rank writes; a family whose checkpoints keep a
    block's experts fused (one tensor each of gate_up_proj and down_proj),
    rank 0 writes them."""
    out = []
    for name, _, experts in blocks:
        layer = experts.layer
        prefix = _checkpoint_prefix(name, experts.family)
        if experts.family.checkpoint_experts == "fused":
            if rank == 0:
                out += [(f"{prefix}.experts.gate_up_proj", layer.dtype,
                         (layer.experts, 2 * layer.inter, layer.hidden)),
                        (f"{prefix}.experts.down_proj", layer.dtype,
                         (layer.experts, layer.hidden, layer.inter))]
            continue
        g, u, d = experts.family.projections
        first = rank * layer.local_experts
        for e in range(first, first + layer.local_experts):
            for p, shape in ((g, (layer.inter, layer.hidden)), (u, (layer.inter, layer.hidden)),
                             (d, (layer.hidden, layer.inter))):
                out.append((f"{prefix}.experts.{e}.{p}.weight", layer.dtype, shape))
    return out


# --- the EP group of a patched model ------------------------------------------

def _first_layer(model):
    return _patched(model)[0][2].layer


def barrier(model):
    """Under mpirun, returns once every process of the patched model's EP
    group has called it (bounded by the layers' timeout_seconds); in one
    process, at once."""
    layer = _first_layer(model)
    if layer._collective:
        layer._agree({"at": "barrier"}, "moec barrier: the ranks could not meet")


def all_sum(model, value):
    """The sum of a number over the processes of the patched model's EP group
    (under mpirun; in one process, the number), e.g. a loss."""
    layer = _first_layer(model)
    if not layer._collective:
        return float(value)
    views = layer._agree({"value": float(value)}, "moec all_sum: the ranks could not meet")
    return math.fsum(v["value"] for v in views)
