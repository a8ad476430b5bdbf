"""moec in Hugging Face-structured MoE models: patch the experts of a model,
fill them from a checkpoint, save PEFT adapters and merged checkpoints.

    import moec_torch.hf as mhf
    names = mhf.patch_model(model, ranks=2, threads=2, lora_rank=16, lora_alpha=32)
    mhf.load_experts(model, "Qwen3-30B-A3B/")      # or load_checkpoint: every tensor
    ...train...
    mhf.save_adapters(model, "adapter/")           # adapter_config.json + adapter_model.safetensors
    mhf.load_adapters(model, "adapter/")
    mhf.save_pretrained(model, "merged/", max_shard_size="5GB")

A model is "Hugging Face-structured" when its MoE blocks are transformers'
classes (or classes with their names, attributes and forward math, as
moec_torch.hf_models' stand-ins): Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V2,
DeepSeek-V3, OLMoE, GLM-4.5, Qwen3-Next and Qwen3.5-MoE (v5 only), with experts either as per-expert modules
(``experts.<e>.gate_proj/up_proj/down_proj``, Mixtral ``w1/w3/w2``;
transformers v4) or fused parameters (``experts.gate_up_proj [E, 2I, H]``,
``experts.down_proj [E, H, I]``; transformers v5).

patch_model replaces each block's experts with a MoecExperts module that runs
a moec MoeFFN layer: the block's router and shared experts stay the model's
own; in the v5 layout the block's forward is untouched (its experts module
is called as the model calls it), in the v4 layout the block's forward (or
DeepSeek's ``moe`` method) is replaced by one with the same routing math that
calls the moec experts. Fused (v5) experts of a frozen or LoRA layer stay
where they are: the layer stores its weights transposed (MoeFFN
weights_transposed=True) and takes the model's gate_up_proj and down_proj
as its w1 and w2, the same tensors, when it holds every expert in their
dtype on the CPU (else it copies them once, in that layout). Otherwise the
model's expert weights are converted once into the layer's w1 [E, H, 2I] /
w2 [E, I, H] and the model's copies are freed.

LoRA, in either of PEFT's forms. target_modules (lora_targets): PEFT puts
one adapter on each targeted nn.Linear, so gate_proj and up_proj have an A
and a B each. The moec layer holds them as one adapter on its fused w1 of
the gate and up ranks summed, with A = [A_gate | A_up] and a
block-diagonal B, and one on w2 whose columns past down's rank are zero; a
gradient hook keeps the zero blocks zero, so the layer computes exactly
PEFT's per-module adapters. save_adapters writes them under PEFT's names
for the unpatched model with per-expert modules (which PEFT and
transformers v5 also load onto fused experts, converting them).
target_parameters (lora_target_parameters; v5's fused experts): PEFT's
ParamWrapper puts one adapter on each targeted parameter, gate_up_proj's
one A and B over both halves; the layer's w1 and w2 adapters are exactly
those. save_adapters writes them as PEFT does: per block
``base_model.model.<block>.experts[.base_layer].lora_A.weight`` [r E, in]
(expert e's rows e r .. e r + r - 1) and ``lora_B.weight`` [out, r E]
(expert e's rank k in column k E + e); the wrappers nest in the experts
module's parameter order, the first (gate_up_proj) innermost, under
base_layer. patch_model(lora_config=folder) patches a model for any
adapter folder of either form, with its rank_pattern, alpha_pattern and
use_rslora.
"""

from .families import (  # noqa: F401
    Family,
    _known,
    _looks_like_moe,
    _fused,
    _expert_sizes,
    _expert_weights,
    _dtype_name,
    PROJECTIONS,
    FAMILIES,
    _BY_BLOCK,
)
from .patch import (  # noqa: F401
    find_blocks,
    _expert_entries,
    _Lora,
    FUSED_PARAMETERS,
    _peft_matches,
    _pattern_value,
    _lora_request,
    _block_lora,
    MoecExperts,
    _route_softmax,
    _softmax_block_forward,
    _moe_method,
    _config_of,
    _family_of_config,
    _top_k,
    patch_model,
    _local_experts,
    _adopt,
    _set_expert,
    _copy_in,
    _init_lora,
    _patched,
    _checkpoint_prefix,
    _first_layer,
    barrier,
    all_sum,
)
from .checkpoint_in import (  # noqa: F401
    _open,
    _dequantize_fp8,
    _read_weight,
    _check_weight,
    _expert_keys,
    load_experts,
    _copy_fp8_expert,
    load_checkpoint,
    _materialize,
    _non_expert_state,
    FLOATS,
)
from .peft_files import (  # noqa: F401
    _lora_of,
    _stem,
    _adapter_tensors,
    _parameter_key,
    _parameter_pieces,
    _stacked,
    _unstacked,
    _target_regex,
    save_adapters,
    _all_adapter_names,
    load_adapters,
    ADAPTER_FILE,
    ADAPTER_CONFIG,
)
from .pretrained import (  # noqa: F401
    _parse_size,
    _merged_experts,
    _nbytes,
    save_pretrained,
    INDEX,
)

__all__ = ["FAMILIES", "MoecExperts", "all_sum", "barrier", "find_blocks", "load_adapters",
           "load_checkpoint", "load_experts", "patch_model",
           "save_adapters", "save_pretrained"]
