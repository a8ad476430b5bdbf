"""Stand-ins of Hugging Face transformers' MoE causal LMs, for moec's tests
and examples where transformers is not installed (it is not a Debian
package): Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V2, DeepSeek-V3, OLMoE,
GLM-4.5 (glm4_moe: DeepSeek-V3's MoE under GLM's class names), Qwen3-Next
(qwen3_next: Qwen2-MoE's block under Qwen3-Next's names) and Qwen3.5-MoE's
text model (qwen3_5_moe_text: Qwen3-Next's block with a router that always
renormalizes; transformers v5 only, so fused experts only, and its
checkpoints keep them fused; the Hub's Qwen3_5MoeForConditionalGeneration,
which holds it under model.language_model beside a vision tower, has no
stand-in).

    config = hf_models.config_from_dict({"model_type": "qwen3_moe", "hidden_size": 64, ...})
    model = hf_models.model_from_config(config)          # Qwen3MoeForCausalLM(config)
    out = model(input_ids, labels=input_ids)             # out.loss, out.logits, out.router_logits
    state = hf_models.checkpoint_state_dict(model)       # the Hub's tensor names

What follows transformers: the class names of configs, MoE blocks, expert
MLPs, experts modules and routers; attribute names, so state_dict names
(model.embed_tokens, model.layers.<i>.self_attn.q_proj, .input_layernorm,
.post_attention_layernorm, .mlp / .block_sparse_moe, model.norm, lm_head);
config field names and defaults (each family's configuration_*.py); the MoE
blocks' forward math and return values, the routers' included; which layers
are dense; RMSNorm (variance in fp32); the shifted cross-entropy loss and,
for the families that have one, the router load-balancing loss added to it.

Two expert layouts, picked by the config's ``experts_layout`` (see
PretrainedConfig): transformers v4 (4.5x), per-expert nn.Linear modules, and
v5, fused expert parameters and routers as modules. Given the same weights
they compute the same, but where transformers itself changed: DeepSeek-V3's
masking of the groups not kept (see DeepseekV3TopkRouter) and Mixtral's v5
routing weights, left in fp32.

Simplified, since moec does not touch them: attention is plain causal
multi-head attention with grouped KV heads and rotary embeddings (eager
math; Qwen3's per-head and OLMoE's whole-projection q_norm/k_norm and
clip_qkv kept; GLM's partial rotary embeddings in the same rotate-half
form; Qwen3-Next's linear attention and gated attention layers are all that
plain attention); DeepSeek's multi-head latent attention is replaced by the
same plain attention, so DeepSeek attention weights are named
q_proj/k_proj/v_proj/o_proj rather than the Hub's q_a_proj, kv_a_proj_with_mqa,
...; no KV cache, attention mask (but the causal one), sliding window, rope
scaling or dropout; the decoder layers and base models are one generic class
each (DecoderLayer, MoeModel) rather than <Family>DecoderLayer/<Family>Model.

Sources read (the code here is written anew from them):
  v4: transformers main of the 4.5x series: models/{qwen3_moe,mixtral}/
      modeling_*.py at 00d4b3d (4.56-4.57), deepseek_v3/modeling_deepseek_v3.py
      at 00b676f (4.54-4.55), deepseek_v2/modular_deepseek_v2.py (4.5x),
      qwen2_moe and olmoe of the same series, and their configuration_*.py;
      glm4_moe/modular_glm4_moe.py (4.5x, 0e97420); qwen3_next's
      configuration_qwen3_next.py (5.x) and its modular block
      (Qwen3NextSparseMoeBlock(Qwen2MoeSparseMoeBlock)); qwen3_5_moe's
      modeling_ and configuration_qwen3_5_moe.py (5.x), and vLLM's
      qwen3_5.py for its checkpoints' fused expert names.
  v5: transformers main of the 5.x series (experts under
      @use_experts_implementation, routers as modules, @strict configs), read
      from a fork's snapshot at c0ce2e4: models/<family>/modeling_*.py and
      configuration_*.py.
"""

from .configs import (  # noqa: F401
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
    MixtralConfig,
    OlmoeConfig,
    DeepseekV2Config,
    DeepseekV3Config,
    Glm4MoeConfig,
    Qwen3NextConfig,
    Qwen3_5MoeTextConfig,
    config_from_dict,
    config_from_pretrained,
    CONFIGS)
from .modules import (  # noqa: F401
    RMSNorm,
    Attention,
    MLP,
    Qwen2MoeMLP,
    Qwen3MoeMLP,
    OlmoeMLP,
    DeepseekV2MLP,
    DeepseekV3MLP,
    Glm4MoeMLP,
    Qwen3NextMLP,
    Qwen3_5MoeMLP,
    MixtralBlockSparseTop2MLP,
    Experts,
    Qwen2MoeExperts,
    Qwen3MoeExperts,
    MixtralExperts,
    OlmoeExperts,
    DeepseekV2Experts,
    DeepseekV3Experts,
    Glm4MoeExperts,
    Qwen3NextExperts,
    Qwen3_5MoeExperts,
    ACT2FN)
from .moe import (  # noqa: F401
    TopKRouter,
    Qwen2MoeTopKRouter,
    Qwen3MoeTopKRouter,
    OlmoeTopKRouter,
    MixtralTopKRouter,
    SparseMoeBlock,
    Qwen3MoeSparseMoeBlock,
    Qwen2MoeSparseMoeBlock,
    OlmoeSparseMoeBlock,
    MixtralSparseMoeBlock,
    DeepseekV3TopkRouter,
    DeepseekV2MoEGate,
    DeepseekV2TopkRouter,
    DeepseekV3MoE,
    DeepseekV2MoE,
    DeepseekV2Moe,
    Glm4MoeTopkRouter,
    Glm4MoeMoE,
    Qwen3NextTopKRouter,
    Qwen3NextSparseMoeBlock,
    Qwen3_5MoeTopKRouter,
    Qwen3_5MoeSparseMoeBlock)
from .models import (  # noqa: F401
    DecoderLayer,
    MoeModel,
    CausalLMOutput,
    load_balancing_loss_func,
    ForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
    MixtralForCausalLM,
    OlmoeForCausalLM,
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    Glm4MoeForCausalLM,
    Qwen3NextForCausalLM,
    Qwen3_5MoeForCausalLM,
    model_from_config,
    MODELS)
from .checkpoints import (  # noqa: F401
    checkpoint_state_dict,
    load_checkpoint_state_dict)

__all__ = ["CONFIGS", "MODELS", "CausalLMOutput", "checkpoint_state_dict", "config_from_dict",
           "config_from_pretrained", "load_balancing_loss_func", "load_checkpoint_state_dict",
           "model_from_config"]
