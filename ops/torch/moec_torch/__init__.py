"""moec's MoE-FFN layer as a PyTorch module with autograd.

    import moec_torch
    layer = moec_torch.MoeFFN("examples/configs/tiny.json", ranks=2)
    y = layer(x, topk_ids, topk_weights)      # x [R, S, H] -> y [R, S, H]
    y.square().sum().backward()               # x.grad, topk_weights.grad,
                                              # layer.w1.grad, layer.w2.grad

The layer runs an EP group of R ranks on the moec CPU runtime: rank r holds
experts r*L .. r*L+L-1 of E. The ranks are threads of this process (the
default), and tensors then carry the rank as their first dim, as in
``moec run``; or, started by mpirun, each process runs one rank (the MPI
fabric), holds only its L experts, and passes its own tokens:

    # mpirun -np 2 python3 train.py
    layer = moec_torch.MoeFFN("examples/configs/tiny.json")   # R = the processes
    y = layer(x, topk_ids, topk_weights)      # x [S, H] -> y [S, H]; w1 [L, H, 2I]
    ...
    moec_torch.finalize_mpi()                 # at the end (also run at exit)

Forward and backward run the task binaries that ``moec compile`` makes of
graphs/moe_ffn_{fwd,bwd}.json for the config; they are compiled once per
config and cached on disk. A layer cannot be copied or pickled: save
``layer.state_dict()`` (save_state writes it whole or not at all) and
rebuild it with MoeFFN(config, ...) + load_state_dict.

Where things are found: an installed package (pip install ops/torch, see
docs/torch.md) carries its libraries and graphs; in a checkout built with
Bazel they are found there. These override:

    MOEC_TORCH_LIB   the op library         moec_torch/lib/moec_torch.so, or
                                            bazel-bin/ops/torch/moec_torch.so
    MOEC_LIB         the compiler library   moec_torch/lib/libmoec.so, or
                                            bazel-bin/compiler/api/libmoec.so
    MOEC_GRAPHS      the graph folder       moec_torch/graphs, or graphs/
    MOEC_CACHE_DIR   compiled binaries      ~/.cache/moec

The package's modules, by concept; their names are re-exported here:

    _launch      the op library; mpirun / torchrun; the fabric; finalize_mpi
    cache        compile_graphs, compile_layer: the compile cache
    autograd     MoeFFNFunction, Gradients; the tensor-parallel conversions
    handles      ForwardHandle, BackwardHandle (submit_forward/submit_backward)
    layer        MoeFFN
    capacity     capacity growth (capacity_policy)
    checkpoint   save_state; MoeFFN's state dict and its checks; merge_state_dicts
    optimizer_state  an optimizer's state by parameter name: optimizer_state_dict,
                 merge_optimizer_state_dicts, load_optimizer_state_dict
    ddp          prepare_ddp: expert-parallel layers inside DistributedDataParallel;
                 clip_grad_norm_ over the whole model's gradient;
                 split_parameters (replicated / each process's own)
    exchange     Exchange, DispatchHandle: dispatch and combine alone
    native       compile, dump, simulate_trace, load_trace (the compiler library)

``compile`` is not in __all__, so that ``from moec_torch import *`` leaves
the builtin compile alone; moec_torch.compile is the compiler's. State
lives in the module that keeps it (the compile cache's paths in
cache._compiled): replace it there, not on the package.
"""

from . import adapters, checks, int_checkpoints, native, quant, reference, safetensors
from . import _launch, autograd, cache, capacity, checkpoint, ddp, exchange, handles, layer
from . import optimizer_state
from ._launch import (_default_fabric, _distributed, _fabric, _fabric_args, _register_finalize,
                      _world_size, close_groups, finalize_mpi, launched_by_mpi,
                      launched_by_torchrun, load_library)
from .autograd import (Gradients, MoeFFNFunction, _after_backward, _check_finite, _from_tp,
                       _to_tp, _to_tp_stored, _TpMainGrads, _TpShare, _TpTake)
from .cache import (_BINARY_ERROR, LORA_TARGETS, MANIFEST, _cache_root, _compile_entry,
                    _compiled, _entry_problem, _from_cache, _layer_graphs, _lora_suffix,
                    _lora_targets, _remove, _sha256, compile_graphs, compile_layer)
from .capacity import CAPACITY_POLICIES, _check_policy
from .checkpoint import merge_state_dicts, save_state
from .ddp import clip_grad_norm_, prepare_ddp, split_parameters
from .exchange import DispatchHandle, Exchange, _CombineFunction, _DispatchFunction
from .handles import BackwardHandle, ForwardHandle, _Pending
from .layer import _DTYPES, _NOT_PICKLED, MoeFFN, _matches
from .native import compile, dump, load_trace, simulate_trace
from .optimizer_state import (load_optimizer_state_dict, merge_optimizer_state_dicts,
                              optimizer_state_dict)

__all__ = ["BackwardHandle", "DispatchHandle", "Exchange", "ForwardHandle", "Gradients",
           "MoeFFN", "MoeFFNFunction", "checks", "clip_grad_norm_", "compile_graphs",
           "compile_layer",
           "close_groups", "dump", "finalize_mpi", "launched_by_mpi", "launched_by_torchrun",
           "load_library", "load_optimizer_state_dict", "load_trace",
           "merge_optimizer_state_dicts", "merge_state_dicts", "native",
           "optimizer_state_dict", "prepare_ddp",
           "quant", "reference", "safetensors", "save_state", "simulate_trace",
           "split_parameters"]

# Flags that _launch rebinds as the process runs: read there, not copied here.
_LAUNCH_STATE = ("_loaded", "_finalize_registered", "_groups_registered")


def __getattr__(name):
    if name in _LAUNCH_STATE:
        return getattr(_launch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_LAUNCH_STATE})
