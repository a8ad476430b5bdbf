"""The stand-ins' configs (transformers' configuration_<family>.py). See the package's docstring."""

import json
from pathlib import Path


# --- configs -------------------------------------------------------------------
# models/<family>/configuration_<family>.py, 4.5x (fields, defaults) and 5.x
# (Qwen2-MoE's qkv_bias, rope_parameters, the attribute_map aliases).

class PretrainedConfig:
    """transformers' PretrainedConfig, reduced: the family's fields with its
    defaults (``defaults``, from its configuration_*.py), any other keyword
    kept as given (as from a Hub config.json), ``attribute_map`` aliases read
    through; to_dict, to_json_file, save_pretrained (config.json, as
    transformers writes it), from_dict, from_pretrained.

    ``experts_layout`` is the stand-ins' own field (written to config.json,
    where transformers ignores it):

    - "modules" (default): the transformers v4 (4.5x) model. A block's
      ``experts`` is an nn.ModuleList of per-expert MLPs (gate_proj, up_proj,
      down_proj; Mixtral's MixtralBlockSparseTop2MLP w1, w3, w2); the Qwen,
      Mixtral and OLMoE blocks route inline with ``gate`` an nn.Linear and
      return (hidden_states, router_logits); DeepSeek's blocks call their
      router module (DeepseekV3TopkRouter, DeepseekV2MoEGate) and a ``moe``
      method, and return hidden_states. Mixtral's block is the decoder
      layer's ``block_sparse_moe``.
    - "fused": the transformers v5 model. ``experts`` is a <Family>Experts
      module (Qwen3MoeExperts, MixtralExperts, DeepseekV3Experts, ...)
      holding gate_up_proj [E, 2I, H] (gate rows, then up rows) and
      down_proj [E, H, I] as parameters, called experts(hidden_states,
      top_k_index, top_k_weights); ``gate`` is the router module
      (Qwen3MoeTopKRouter, MixtralTopKRouter, DeepseekV3TopkRouter,
      DeepseekV2TopkRouter, ...) returning (router_logits, top-k weights,
      top-k indices); blocks return hidden_states. Mixtral's block is the
      decoder layer's ``mlp``; DeepSeek-V2's block class is DeepseekV2Moe.

    Expert e holds the same numbers in both: gate_up_proj[e] =
    cat(gate_proj.weight, up_proj.weight), down_proj[e] = down_proj.weight.
    Checkpoints (the Hub's) always have the v4 names: checkpoint_state_dict
    and load_checkpoint_state_dict convert."""

    model_type = None
    architecture = None      # architectures[0] of the family's causal LM
    experts_field = None     # the field that counts the routed experts
    attribute_map = {}
    defaults = {}
    common = dict(hidden_act="silu", initializer_range=0.02, rms_norm_eps=1e-6,
                  rope_theta=10000.0, rope_scaling=None, attention_dropout=0.0, use_cache=True,
                  tie_word_embeddings=False, torch_dtype=None, pad_token_id=None,
                  bos_token_id=None, eos_token_id=None, experts_layout="modules")

    layouts = ("modules", "fused")  # the expert layouts transformers has of the family

    def __init__(self, **kwargs):
        kwargs.pop("model_type", None)
        fields = {**self.common, "architectures": [self.architecture], **self.defaults, **kwargs}
        for key, value in fields.items():
            setattr(self, key, value)
        if getattr(self, "num_key_value_heads", 0) is None:
            self.num_key_value_heads = self.num_attention_heads
        if "mlp_only_layers" in fields and self.mlp_only_layers is None:
            self.mlp_only_layers = []
        if self.experts_layout not in ("modules", "fused"):
            raise ValueError(f"experts_layout must be 'modules' or 'fused', got "
                             f"{self.experts_layout!r}")
        if self.experts_layout not in self.layouts:
            raise ValueError(f"{type(self).__name__}: transformers has the {self.model_type} "
                             f"model with experts_layout {' or '.join(map(repr, self.layouts))} "
                             f"only, not {self.experts_layout!r}")

    def __getattr__(self, name):  # only for names that are not set: the aliases
        alias = type(self).attribute_map.get(name)
        if alias is None:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(self, alias)

    def to_dict(self):
        return {"model_type": self.model_type, **vars(self)}

    def to_json_string(self):
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def to_json_file(self, path):
        Path(path).write_text(self.to_json_string())

    def save_pretrained(self, folder):
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.to_json_file(Path(folder) / "config.json")

    @classmethod
    def from_dict(cls, d):
        return cls(**d)

    @classmethod
    def from_pretrained(cls, folder):
        """The config of folder/config.json (or of that file)."""
        path = Path(folder)
        return cls.from_dict(json.loads((path / "config.json" if path.is_dir() else path)
                                        .read_text()))

    def __repr__(self):
        return f"{type(self).__name__} {self.to_json_string()}"


# Defaults as in transformers' configuration_<family>.py (v4; v5 keeps them,
# moving rope_theta into rope_parameters, which is read when given).

class Qwen2MoeConfig(PretrainedConfig):
    model_type, architecture, experts_field = "qwen2_moe", "Qwen2MoeForCausalLM", "num_experts"
    defaults = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                    num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                    max_position_embeddings=32768, use_sliding_window=False, sliding_window=4096,
                    max_window_layers=28, decoder_sparse_step=1, moe_intermediate_size=1408,
                    shared_expert_intermediate_size=5632, num_experts_per_tok=4,
                    num_experts=60, norm_topk_prob=False, output_router_logits=False,
                    router_aux_loss_coef=0.001, mlp_only_layers=None, qkv_bias=True)


class Qwen3MoeConfig(PretrainedConfig):
    model_type, architecture, experts_field = "qwen3_moe", "Qwen3MoeForCausalLM", "num_experts"
    defaults = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                    num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4,
                    max_position_embeddings=32768, attention_bias=False,
                    use_sliding_window=False, sliding_window=4096, max_window_layers=28,
                    decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8,
                    num_experts=128, norm_topk_prob=False, output_router_logits=False,
                    router_aux_loss_coef=0.001, mlp_only_layers=None)


class MixtralConfig(PretrainedConfig):
    """Mixtral's intermediate_size is the size of each expert."""
    model_type, architecture, experts_field = "mixtral", "MixtralForCausalLM", "num_local_experts"
    defaults = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=None, max_position_embeddings=4096 * 32, rms_norm_eps=1e-5,
                    rope_theta=1e6, sliding_window=None, num_experts_per_tok=2,
                    num_local_experts=8, output_router_logits=False, router_aux_loss_coef=0.001,
                    router_jitter_noise=0.0, bos_token_id=1, eos_token_id=2)


class OlmoeConfig(PretrainedConfig):
    """OLMoE's intermediate_size is the size of each expert."""
    model_type, architecture, experts_field = "olmoe", "OlmoeForCausalLM", "num_experts"
    attribute_map = {"num_local_experts": "num_experts"}
    defaults = dict(vocab_size=50304, hidden_size=2048, intermediate_size=2048,
                    num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=None,
                    max_position_embeddings=4096, rms_norm_eps=1e-5, attention_bias=False,
                    clip_qkv=None, num_experts_per_tok=8, num_experts=64,
                    output_router_logits=False, router_aux_loss_coef=0.01, norm_topk_prob=False,
                    pad_token_id=1, eos_token_id=50279)


class DeepseekV2Config(PretrainedConfig):
    """topk_method "greedy" or "group_limited_greedy"; scoring_func is the
    Hub config.json's (softmax), which transformers does not read."""
    model_type, architecture, experts_field = \
        "deepseek_v2", "DeepseekV2ForCausalLM", "n_routed_experts"
    attribute_map = {"num_experts": "n_routed_experts"}
    defaults = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                    moe_intermediate_size=1407, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=None, n_shared_experts=2, n_routed_experts=64,
                    routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=1536,
                    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
                    topk_method="greedy", scoring_func="softmax", n_group=None, topk_group=None,
                    num_experts_per_tok=None, first_k_dense_replace=0, norm_topk_prob=False,
                    aux_loss_alpha=0.001, seq_aux=True, max_position_embeddings=2048,
                    attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2)


class DeepseekV3Config(PretrainedConfig):
    """topk_method and scoring_func are the Hub config.json's (noaux_tc,
    sigmoid), which transformers does not read: its DeepSeek-V3 router is
    always that one."""
    model_type, architecture, experts_field = \
        "deepseek_v3", "DeepseekV3ForCausalLM", "n_routed_experts"
    attribute_map = {"num_local_experts": "n_routed_experts"}
    defaults = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                    num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
                    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
                    topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
                    norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid",
                    max_position_embeddings=4096, rope_interleave=True, attention_bias=False,
                    bos_token_id=0, eos_token_id=1)


class Qwen3NextConfig(PretrainedConfig):
    """Qwen3-Next (configuration_qwen3_next.py): Qwen2-MoE's block (shared
    expert gated by sigmoid) with norm_topk_prob; its hybrid attention
    (linear attention layers, gated full attention every
    full_attention_interval) the stand-in simplifies (see the package's
    docstring)."""
    model_type, architecture, experts_field = "qwen3_next", "Qwen3NextForCausalLM", "num_experts"
    defaults = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                    num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
                    max_position_embeddings=32768, attention_bias=False, head_dim=256,
                    partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
                    linear_key_head_dim=128, linear_value_head_dim=128,
                    linear_num_key_heads=16, linear_num_value_heads=32, decoder_sparse_step=1,
                    moe_intermediate_size=512, shared_expert_intermediate_size=512,
                    num_experts_per_tok=10, num_experts=512, norm_topk_prob=True,
                    output_router_logits=False, router_aux_loss_coef=0.001,
                    mlp_only_layers=None)


class Qwen3_5MoeTextConfig(PretrainedConfig):
    """Qwen3.5-MoE's text model (configuration_qwen3_5_moe.py, 5.x; the
    Hub's config.json nests it as text_config of a qwen3_5_moe config):
    Qwen3-Next's block (shared expert gated by sigmoid) whose router always
    renormalizes its top-k weights (no norm_topk_prob); transformers v5
    only, so experts_layout "fused" only; its hybrid attention the stand-in
    simplifies as Qwen3-Next's."""
    model_type, architecture = "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"
    experts_field, layouts = "num_experts", ("fused",)
    defaults = dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
                    num_attention_heads=16, num_key_value_heads=2,
                    max_position_embeddings=32768, attention_bias=False, head_dim=256,
                    partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
                    linear_key_head_dim=128, linear_value_head_dim=128,
                    linear_num_key_heads=16, linear_num_value_heads=32,
                    moe_intermediate_size=512, shared_expert_intermediate_size=512,
                    num_experts_per_tok=8, num_experts=256, output_router_logits=False,
                    router_aux_loss_coef=0.001, layer_types=None, experts_layout="fused")


class Glm4MoeConfig(PretrainedConfig):
    """GLM-4.5 / 4.6 (transformers' modular_glm4_moe.py): DeepSeek-V3's MoE
    (sigmoid router with e_score_correction_bias, groups, shared experts,
    first_k_dense_replace dense layers) under grouped-query attention with
    partial rotary embeddings (partial_rotary_factor), q/k/v biases by
    attention_bias and per-head q/k norms by use_qk_norm; the Hub's
    config.json gives head_dim."""
    model_type, architecture, experts_field = "glm4_moe", "Glm4MoeForCausalLM", "n_routed_experts"
    attribute_map = {"num_local_experts": "n_routed_experts"}
    defaults = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944,
                    num_hidden_layers=46, num_attention_heads=96, partial_rotary_factor=0.5,
                    num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                    attention_bias=False, moe_intermediate_size=1408, num_experts_per_tok=8,
                    n_shared_experts=1, n_routed_experts=128, routed_scaling_factor=1.0,
                    n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                    use_qk_norm=False)


CONFIGS = {c.model_type: c for c in (Qwen2MoeConfig, Qwen3MoeConfig, MixtralConfig,
                                     DeepseekV2Config, DeepseekV3Config, OlmoeConfig,
                                     Glm4MoeConfig, Qwen3NextConfig, Qwen3_5MoeTextConfig)}


def config_from_dict(d):
    """The config class of d["model_type"], with d's fields."""
    cls = CONFIGS.get(d.get("model_type"))
    if cls is None:
        raise ValueError(f"hf_models: no stand-in for model_type {d.get('model_type')!r} "
                         f"(known: {', '.join(CONFIGS)})")
    return cls.from_dict(d)


def config_from_pretrained(folder):
    """The config of a checkpoint folder's config.json, by its model_type."""
    return config_from_dict(json.loads((Path(folder) / "config.json").read_text()))
