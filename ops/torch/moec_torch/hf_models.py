"""Stand-ins of Hugging Face transformers' MoE causal LMs, for moec's tests
and examples where transformers is not installed (it is not a Debian
package): Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V2, DeepSeek-V3 and OLMoE.

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
clip_qkv kept); DeepSeek's multi-head latent attention is replaced by the
same plain attention, so DeepSeek attention weights are named
q_proj/k_proj/v_proj/o_proj rather than the Hub's q_a_proj, kv_a_proj_with_mqa,
...; no KV cache, attention mask (but the causal one), sliding window, rope
scaling or dropout; the decoder layers and base models are one generic class
each (DecoderLayer, MoeModel) rather than <Family>DecoderLayer/<Family>Model.

Sources read (the code here is written anew from them):
  v4: transformers main of the 4.5x series: models/{qwen3_moe,mixtral}/
      modeling_*.py at 00d4b3d (4.56-4.57), deepseek_v3/modeling_deepseek_v3.py
      at 00b676f (4.54-4.55), deepseek_v2/modular_deepseek_v2.py (4.5x),
      qwen2_moe and olmoe of the same series, and their configuration_*.py.
  v5: transformers main of the 5.x series (experts under
      @use_experts_implementation, routers as modules, @strict configs), read
      from a fork's snapshot at c0ce2e4: models/<family>/modeling_*.py and
      configuration_*.py.
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CONFIGS", "MODELS", "CausalLMOutput", "checkpoint_state_dict", "config_from_dict",
           "config_from_pretrained", "load_balancing_loss_func", "load_checkpoint_state_dict",
           "model_from_config"]


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


CONFIGS = {c.model_type: c for c in (Qwen2MoeConfig, Qwen3MoeConfig, MixtralConfig,
                                     DeepseekV2Config, DeepseekV3Config, OlmoeConfig)}


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


# --- shared modules ----------------------------------------------------------------
# <Family>RMSNorm, <Family>MLP, MixtralBlockSparseTop2MLP (4.5x) and the v5
# <Family>Experts (5.x, the eager forward of @use_experts_implementation).

ACT2FN = {"silu": nn.SiLU, "swish": nn.SiLU, "gelu": nn.GELU, "relu": nn.ReLU,
          "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh")}


class RMSNorm(nn.Module):
    """<Family>RMSNorm: x / sqrt(mean(x^2) + eps) in fp32, cast back, times weight."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Causal self-attention (simplified, see the module docstring): grouped
    KV heads, rotary embeddings (rotate-half form, cos/sin made in fp32),
    softmax in fp32. qk_norm "head": RMSNorm over each head of q and k
    (Qwen3); "full": over the whole q and k projections, then clip_qkv
    (OLMoE)."""

    def __init__(self, config, head_dim=None, qkv_bias=False, o_bias=False, qk_norm=None):
        super().__init__()
        h = config.hidden_size
        self.num_heads, self.num_key_value_heads = \
            config.num_attention_heads, config.num_key_value_heads
        self.head_dim = d = head_dim or getattr(config, "head_dim", None) or h // self.num_heads
        self.scaling = d ** -0.5
        rope = getattr(config, "rope_parameters", None)  # v5 configs
        self.rope_theta = rope["rope_theta"] if isinstance(rope, dict) else config.rope_theta
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_key_value_heads * d, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_key_value_heads * d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=o_bias)
        self.qk_norm = qk_norm
        if qk_norm == "head":
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        elif qk_norm == "full":
            self.q_norm = RMSNorm(h, config.rms_norm_eps)
            self.k_norm = RMSNorm((h // self.num_heads) * self.num_key_value_heads,
                                  config.rms_norm_eps)
            self.clip_qkv = config.clip_qkv

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), \
            self.v_proj(hidden_states)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
            if self.clip_qkv is not None:
                q, k, v = (z.clamp(-self.clip_qkv, self.clip_qkv) for z in (q, k, v))
        q, k, v = (z.view(b, t, -1, self.head_dim) for z in (q, k, v))
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        d = self.head_dim
        inv_freq = 1.0 / self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
        freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1).to(hidden_states.device)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        groups = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        future = torch.ones(t, t, dtype=torch.bool, device=scores.device).triu(1)
        probs = F.softmax(scores.masked_fill(future, float("-inf")), dim=-1,
                          dtype=torch.float32).to(q.dtype)
        return self.o_proj(torch.matmul(probs, v).transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """<Family>MLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)); the v4
    experts, the dense layers' MLP and the shared experts."""

    def __init__(self, config, intermediate_size=None):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None \
            else intermediate_size
        bias = getattr(config, "mlp_bias", False)  # DeepSeek-V2's field
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Qwen2MoeMLP(MLP):
    pass


class Qwen3MoeMLP(MLP):
    pass


class OlmoeMLP(MLP):
    pass


class DeepseekV2MLP(MLP):
    pass


class DeepseekV3MLP(MLP):
    pass


class MixtralBlockSparseTop2MLP(nn.Module):
    """Mixtral's v4 expert: w2(act_fn(w1(x)) * w3(x)); w1 is the gate, w3 the up."""

    def __init__(self, config):
        super().__init__()
        self.ffn_dim, self.hidden_dim = config.intermediate_size, config.hidden_size
        self.w1 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.w2 = nn.Linear(self.ffn_dim, self.hidden_dim, bias=False)
        self.w3 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]()

    def forward(self, hidden_states):
        return self.w2(self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states))


def _dispatch(hidden_states, top_k_index, top_k_weights, num_experts, expert, out_dtype=None):
    """sum over k of top_k_weights[t, k] * expert(top_k_index[t, k], x[t]), as
    transformers loops: per expert that some token chose, its tokens' outputs
    times their weights, index_add_ into zeros of out_dtype (default the
    hidden states'). v4's Qwen/Mixtral/OLMoE blocks, every v5 experts module,
    v4 DeepSeek's moe (out_dtype the weights', fp32)."""
    final = torch.zeros_like(hidden_states, dtype=out_dtype or hidden_states.dtype)
    with torch.no_grad():
        mask = F.one_hot(top_k_index, num_classes=num_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit[:, 0].tolist():
        top_k_pos, token_idx = torch.where(mask[e])
        out = expert(e, hidden_states[token_idx]) * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final


class Experts(nn.Module):
    """v5's fused experts (<Family>Experts): gate_up_proj [E, 2I, H],
    down_proj [E, H, I]; forward(hidden_states [N, H], top_k_index [N, K],
    top_k_weights [N, K]) -> [N, H]: per chosen expert, gate, up =
    chunk(x @ gate_up_proj[e].T), act_fn(gate) * up @ down_proj[e].T, times
    the weight, index_add_ in the hidden dtype."""

    num_experts_field, intermediate_field = "num_experts", "moe_intermediate_size"
    checkpoint_names = ("gate_proj", "up_proj", "down_proj")  # v4 names of gate, up, down

    def __init__(self, config):
        super().__init__()
        self.num_experts = getattr(config, self.num_experts_field)
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = getattr(config, self.intermediate_field)
        self.gate_up_proj = nn.Parameter(
            torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(
            torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.act_fn = ACT2FN[config.hidden_act]()

    def expert(self, e, x):
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, self.down_proj[e])

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return _dispatch(hidden_states, top_k_index, top_k_weights, self.num_experts,
                         self.expert)


class Qwen2MoeExperts(Experts):
    pass


class Qwen3MoeExperts(Experts):
    pass


class MixtralExperts(Experts):
    num_experts_field, intermediate_field = "num_local_experts", "intermediate_size"
    checkpoint_names = ("w1", "w3", "w2")


class OlmoeExperts(Experts):
    intermediate_field = "intermediate_size"


class DeepseekV2Experts(Experts):
    num_experts_field = "n_routed_experts"


class DeepseekV3Experts(Experts):
    """(transformers 5.0 called it DeepseekV3NaiveMoe.)"""
    num_experts_field = "n_routed_experts"


# --- the softmax-routed blocks: Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE -------------------
# v4: <Family>SparseMoeBlock of modeling_{qwen2_moe,qwen3_moe,mixtral,olmoe}.py,
# 4.5x (qwen3_moe, mixtral at 00d4b3d); v5: the same files' <Family>TopKRouter
# and <Family>SparseMoeBlock, 5.x (c0ce2e4).

def _softmax_topk(router_logits, top_k, renormalize, dtype):
    """Softmax over the experts in fp32, top-k, divided by the k's sum when
    renormalize, cast to dtype (None: left in fp32). -> (weights, indices)."""
    weights = F.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, indices = torch.topk(weights, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if dtype is None else weights.to(dtype)), indices


class TopKRouter(nn.Module):
    """v5's <Family>TopKRouter: weight [E, H]; forward(hidden_states) ->
    (router_logits = x @ weight.T, top-k weights, top-k indices), the
    weights as _softmax_topk makes them, cast to the logits' dtype."""

    num_experts_field = "num_experts"
    always_renormalize = False  # Mixtral

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = getattr(config, self.num_experts_field)
        self.norm_topk_prob = self.always_renormalize or config.norm_topk_prob
        self.hidden_dim = config.hidden_size
        self.weight = nn.Parameter(torch.zeros(self.num_experts, self.hidden_dim))

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        weights, indices = _softmax_topk(router_logits, self.top_k, self.norm_topk_prob,
                                         self.weights_dtype(router_logits))
        return router_logits, weights, indices

    def weights_dtype(self, router_logits):
        return router_logits.dtype


class Qwen2MoeTopKRouter(TopKRouter):
    pass


class Qwen3MoeTopKRouter(TopKRouter):
    pass


class OlmoeTopKRouter(TopKRouter):
    pass


class MixtralTopKRouter(TopKRouter):
    """Always renormalizes, and (unlike the others and v4) leaves the weights in fp32."""
    num_experts_field, always_renormalize = "num_local_experts", True

    def weights_dtype(self, router_logits):
        return None


class SparseMoeBlock(nn.Module):
    """The softmax-routed block, v4 or v5 by the config's experts_layout.

    v4: router_logits = gate(x) (nn.Linear); weights, experts =
    _softmax_topk(router_logits, top_k, norm_topk_prob, hidden dtype); the
    experts' weighted sum (_dispatch); returns (hidden_states,
    router_logits [tokens, E]). v5: gate is the <Family>TopKRouter, experts
    the <Family>Experts; returns hidden_states. Subclasses name the family's
    classes and config fields."""

    mlp_class, experts_class, router_class = MLP, Experts, TopKRouter
    num_experts_field, intermediate_field = "num_experts", "moe_intermediate_size"
    always_renormalize = False  # Mixtral

    def __init__(self, config):
        super().__init__()
        self.fused = config.experts_layout == "fused"
        if self.fused:
            self.gate = self.router_class(config)
            self.experts = self.experts_class(config)
            return
        self.num_experts = getattr(config, self.num_experts_field)
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = self.always_renormalize or config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList([self.make_expert(config) for _ in range(self.num_experts)])

    def make_expert(self, config):
        return self.mlp_class(config, intermediate_size=getattr(config, self.intermediate_field))

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, hidden_dim)
        if self.fused:
            _, weights, selected = self.gate(hidden_states)
            out = self.experts(hidden_states, selected, weights)
        else:
            router_logits = self.gate(hidden_states)
            weights, selected = _softmax_topk(router_logits, self.top_k, self.norm_topk_prob,
                                              hidden_states.dtype)
            out = _dispatch(hidden_states, selected, weights, self.num_experts,
                            lambda e, x: self.experts[e](x))
        out = self.add_shared(hidden_states, out).reshape(batch_size, sequence_length, hidden_dim)
        return out if self.fused else (out, router_logits)

    def add_shared(self, hidden_states, out):
        return out


class Qwen3MoeSparseMoeBlock(SparseMoeBlock):
    mlp_class, experts_class, router_class = Qwen3MoeMLP, Qwen3MoeExperts, Qwen3MoeTopKRouter


class Qwen2MoeSparseMoeBlock(SparseMoeBlock):
    """Qwen3's block plus the shared expert, gated per token:
    + sigmoid(shared_expert_gate(x)) * shared_expert(x)."""

    mlp_class, experts_class, router_class = Qwen2MoeMLP, Qwen2MoeExperts, Qwen2MoeTopKRouter

    def __init__(self, config):
        super().__init__(config)
        self.shared_expert = Qwen2MoeMLP(config,
                                         intermediate_size=config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def add_shared(self, hidden_states, out):
        gate = torch.sigmoid(self.shared_expert_gate(hidden_states))
        return out + gate * self.shared_expert(hidden_states)


class OlmoeSparseMoeBlock(SparseMoeBlock):
    mlp_class, experts_class, router_class = OlmoeMLP, OlmoeExperts, OlmoeTopKRouter
    intermediate_field = "intermediate_size"


class MixtralSparseMoeBlock(SparseMoeBlock):
    """Always renormalizes the top-k weights; in training multiplies its
    input by uniform(1 - router_jitter_noise, 1 + router_jitter_noise)."""

    experts_class, router_class = MixtralExperts, MixtralTopKRouter
    num_experts_field, intermediate_field = "num_local_experts", "intermediate_size"
    always_renormalize = True

    def __init__(self, config):
        super().__init__(config)
        self.top_k = config.num_experts_per_tok
        self.jitter_noise = config.router_jitter_noise

    def make_expert(self, config):
        return MixtralBlockSparseTop2MLP(config)

    def forward(self, hidden_states):
        if self.training and self.jitter_noise > 0:
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        return super().forward(hidden_states)


# --- DeepSeek ------------------------------------------------------------------------
# v4: DeepseekV3TopkRouter and DeepseekV3MoE of modeling_deepseek_v3.py at
# 00b676f (4.54-4.55), DeepseekV2MoEGate and DeepseekV2MoE of
# modular_deepseek_v2.py (4.5x); v5: DeepseekV3TopkRouter, DeepseekV3Experts,
# DeepseekV3MoE, DeepseekV2TopkRouter, DeepseekV2Experts, DeepseekV2Moe of
# modeling_deepseek_v{3,2}.py, 5.x (c0ce2e4).

def _limit_to_groups(scores, n_group, topk_group, group_score, fill):
    """scores [N, E] with the experts outside the topk_group best of n_group
    equal groups (a group scored by group_score of its [N, n_group, E/n_group]
    scores) set to fill."""
    n, e = scores.shape
    group_scores = group_score(scores.view(n, n_group, e // n_group))
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(n, n_group, e // n_group).reshape(n, e)
    return scores.masked_fill(~score_mask.bool(), fill)


class DeepseekV3TopkRouter(nn.Module):
    """DeepSeek-V3's router: weight [E, H], buffer e_score_correction_bias [E].

    scores = sigmoid(x @ weight.T in fp32); the bias is added for choosing
    only: groups (n_group equal ones) are scored by the sum of their two best
    biased scores, the topk_group best kept, and the top_k biased scores
    among their experts chosen; the weights are the chosen experts' unbiased
    scores, divided by their sum (+1e-20) when norm_topk_prob, times
    routed_scaling_factor (fp32).

    v4 (modules layout): forward -> (topk_indices, topk_weights); the other
    groups' scores are set to 0.0 before the top-k. v5 (fused layout; 5.0
    routed in DeepseekV3MoE.route_tokens_to_experts as v4 does, later 5.x
    here): forward -> (router_logits, topk_weights, topk_indices); they are
    set to -inf. The two choose alike unless a kept expert's biased score is
    below zero (a negative e_score_correction_bias), when v4 may choose an
    expert of a group not kept."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_tok
        self.n_routed_experts = config.n_routed_experts
        self.routed_scaling_factor = config.routed_scaling_factor
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.v5 = config.experts_layout == "fused"
        self.weight = nn.Parameter(torch.empty(self.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_routed_experts))

    @torch.no_grad()
    def get_topk_indices(self, scores):
        choice = scores.view(-1, self.n_routed_experts) + self.e_score_correction_bias
        choice = _limit_to_groups(choice, self.n_group, self.topk_group,
                                  lambda g: g.topk(2, dim=-1)[0].sum(dim=-1),
                                  float("-inf") if self.v5 else 0.0)
        return torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
        router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        scores = router_logits.sigmoid()
        topk_indices = self.get_topk_indices(scores)
        topk_weights = scores.gather(1, topk_indices)
        if self.norm_topk_prob:
            topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        topk_weights = topk_weights * self.routed_scaling_factor
        return (router_logits, topk_weights, topk_indices) if self.v5 else \
            (topk_indices, topk_weights)


class DeepseekV2MoEGate(nn.Module):
    """DeepSeek-V2's v4 gate: weight [E, H]; scores = softmax(x @ weight.T
    in fp32); topk_method "greedy": the top_k scores; "group_limited_greedy":
    the top_k among the topk_group groups with the best single score (the
    others' scores set to 0.0); the chosen scores times
    routed_scaling_factor, not renormalized (norm_topk_prob is unused, as in
    transformers). forward -> (topk_idx, topk_weight)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.routed_scaling_factor = config.routed_scaling_factor
        self.topk_method = config.topk_method
        self.num_group, self.topk_group = config.n_group, config.topk_group
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        if self.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeek-V2: topk_method must be 'greedy' or "
                             f"'group_limited_greedy', got {self.topk_method!r}")

    def route(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
        router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        scores = router_logits.softmax(dim=-1, dtype=torch.float32)
        if self.topk_method == "group_limited_greedy":
            scores = _limit_to_groups(scores, self.num_group, self.topk_group,
                                      lambda g: g.max(dim=-1).values, 0.0)
        topk_weights, topk_indices = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return router_logits, topk_weights * self.routed_scaling_factor, topk_indices

    def forward(self, hidden_states):
        _, topk_weights, topk_indices = self.route(hidden_states)
        return topk_indices, topk_weights


class DeepseekV2TopkRouter(DeepseekV2MoEGate):
    """DeepSeek-V2's v5 router: the same routing; forward -> (router_logits,
    topk_weights, topk_indices)."""

    def forward(self, hidden_states):
        return self.route(hidden_states)


class DeepseekV3MoE(nn.Module):
    """DeepSeek's block: gate (the router module), the routed experts and
    shared_experts, an MLP of moe_intermediate_size * n_shared_experts,
    added unweighted; returns hidden_states.

    v4: experts is an nn.ModuleList and ``moe(hidden_states, topk_indices,
    topk_weights)`` their weighted sum, accumulated in the weights' dtype
    (fp32) and cast back (DeepSeek-V2's v4 moe sorts the tokens by expert and
    sums each token's k products in fp32: the same sum in another order). v5:
    experts is the fused <Family>Experts module."""

    mlp_class, experts_class = DeepseekV3MLP, DeepseekV3Experts
    routers = (DeepseekV3TopkRouter, DeepseekV3TopkRouter)  # v4, v5

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.fused = config.experts_layout == "fused"
        inter = config.moe_intermediate_size
        self.experts = self.experts_class(config) if self.fused else nn.ModuleList(
            [self.mlp_class(config, intermediate_size=inter)
             for _ in range(config.n_routed_experts)])
        self.gate = self.routers[self.fused](config)
        if config.n_shared_experts is not None:
            self.shared_experts = self.mlp_class(config,
                                                 intermediate_size=inter * config.n_shared_experts)

    def moe(self, hidden_states, topk_indices, topk_weights):
        final = _dispatch(hidden_states, topk_indices, topk_weights, len(self.experts),
                          lambda e, x: self.experts[e](x), out_dtype=topk_weights.dtype)
        return final.type(hidden_states.dtype)

    def forward(self, hidden_states):
        residuals, orig_shape = hidden_states, hidden_states.shape
        flat = hidden_states.reshape(-1, orig_shape[-1])
        if self.fused:
            _, topk_weights, topk_indices = self.gate(hidden_states)
            routed = self.experts(flat, topk_indices, topk_weights)
        else:
            topk_indices, topk_weights = self.gate(hidden_states)
            routed = self.moe(flat, topk_indices, topk_weights)
        hidden_states = routed.view(*orig_shape)
        if hasattr(self, "shared_experts"):
            hidden_states = hidden_states + self.shared_experts(residuals)
        return hidden_states


class DeepseekV2MoE(DeepseekV3MoE):
    """DeepSeek-V2's v4 block (DeepseekV2MoEGate's softmax routing)."""
    mlp_class, experts_class = DeepseekV2MLP, DeepseekV2Experts
    routers = (DeepseekV2MoEGate, DeepseekV2TopkRouter)


class DeepseekV2Moe(DeepseekV2MoE):
    """DeepSeek-V2's v5 block: transformers v5 spells it DeepseekV2Moe."""


# --- models ----------------------------------------------------------------------------
# <Family>DecoderLayer, <Family>Model, <Family>ForCausalLM (4.5x; 5.x alike
# but for Mixtral's mlp), load_balancing_loss_func, ForCausalLMLoss.

class DecoderLayer(nn.Module):
    """<Family>DecoderLayer: h += self_attn(input_layernorm(h)); h +=
    ffn(post_attention_layernorm(h)), the ffn being the MoE block (its
    hidden states when it returns a tuple) or the dense MLP, under the
    family's attribute name (``mlp``; v4 Mixtral's ``block_sparse_moe``)."""

    def __init__(self, config, layer_idx, model_class):
        super().__init__()
        self.self_attn = model_class.attention(config)
        self.ffn_name, ffn = model_class.feed_forward(config, layer_idx)
        setattr(self, self.ffn_name, ffn)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states))
        out = getattr(self, self.ffn_name)(self.post_attention_layernorm(hidden_states))
        return hidden_states + (out[0] if isinstance(out, tuple) else out)


class MoeModel(nn.Module):
    """<Family>Model: embed_tokens (padding_idx = pad_token_id), layers, norm."""

    def __init__(self, config, model_class):
        super().__init__()
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([DecoderLayer(config, i, model_class)
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids):
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states)


class CausalLMOutput:
    """transformers' MoeCausalLMOutputWithPast / CausalLMOutputWithPast,
    reduced: logits; loss (with labels); aux_loss and router_logits (a tuple
    of [tokens, experts] logits, one per MoE layer) when router logits are
    asked for and the family gives them (not DeepSeek)."""

    def __init__(self, logits, loss=None, aux_loss=None, router_logits=None):
        self.logits, self.loss, self.aux_loss, self.router_logits = \
            logits, loss, aux_loss, router_logits


def load_balancing_loss_func(gate_logits, num_experts, top_k):
    """transformers' Switch-Transformer load-balancing loss (no attention
    mask): num_experts * sum_e (fraction of the tokens that have e among
    their top k) * (mean router probability of e), over all layers' tokens."""
    routing_weights = F.softmax(torch.cat(gate_logits, dim=0), dim=-1)
    _, selected = torch.topk(routing_weights, top_k, dim=-1)
    tokens_per_expert = F.one_hot(selected, num_experts).float().mean(dim=0)
    router_prob_per_expert = routing_weights.mean(dim=0)
    return (tokens_per_expert * router_prob_per_expert.unsqueeze(0)).sum() * num_experts


class ForCausalLM(nn.Module):
    """<Family>ForCausalLM: model (embed_tokens, layers, norm) and lm_head.

    XForCausalLM(config, seed=None) (or X.from_config(config)) builds it and
    initializes it with init_weights(seed); seed None takes one from the
    global generator (torch.manual_seed). forward(input_ids, labels=None,
    output_router_logits=None) -> CausalLMOutput: loss is the cross entropy
    of logits[:, :-1] (in fp32) against labels[:, 1:] (-100 ignored), plus
    router_aux_loss_coef * aux_loss when router logits are output (default:
    config.output_router_logits). Subclasses give the family's classes and
    layer rules."""

    config_class = None
    sparse_block = None
    dense_mlp = MLP
    checkpoint_block = "mlp"  # the MoE block's attribute name in checkpoints
    # By layout, (module class, output index) whose outputs are the router
    # logits, as transformers' OutputRecorder: v4's blocks, v5's routers.
    router_logits_from = {"modules": (SparseMoeBlock, 1), "fused": (TopKRouter, 0)}

    def __init__(self, config, seed=None):
        super().__init__()
        if seed is None:  # drawn before the modules' own init draws, which differ by layout
            seed = int(torch.randint(0, 2 ** 62, ()))
        self.config = config
        self.vocab_size = config.vocab_size
        self.model = MoeModel(config, type(self))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.num_experts = getattr(config, config.experts_field)
        self.num_experts_per_tok = config.num_experts_per_tok
        self.tie_weights()
        self.init_weights(seed)

    @classmethod
    def from_config(cls, config, seed=None):
        return cls(config, seed=seed)

    @classmethod
    def attention(cls, config):
        return Attention(config)

    @classmethod
    def is_sparse(cls, config, layer_idx):
        return True

    @classmethod
    def block_class(cls, config):
        return cls.sparse_block

    @classmethod
    def feed_forward(cls, config, layer_idx):
        """(attribute name, module) of the layer's feed-forward."""
        if cls.is_sparse(config, layer_idx):
            return cls.block_name(config), cls.block_class(config)(config)
        return "mlp", cls.dense_mlp(config, intermediate_size=config.intermediate_size)

    @classmethod
    def block_name(cls, config):
        return "mlp"

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def tie_weights(self):
        """lm_head shares the embedding's weight when tie_word_embeddings."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self, seed=None):
        """transformers' _init_weights: weights (linear, embedding, experts,
        routers) normal(0, initializer_range), biases and
        e_score_correction_bias zero, norms one, the embedding's padding row
        zero. The draws go tensor by tensor in the sorted order of the
        checkpoint names, from torch.Generator().manual_seed(seed), or from
        the global generator when seed is None: either layout gets the same
        weights for the same seed (or torch.manual_seed)."""
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.config.initializer_range
        with torch.no_grad():
            for name, t in sorted(checkpoint_state_dict(self).items()):
                if name.endswith("norm.weight"):
                    t.fill_(1.0)
                elif name.endswith("bias"):
                    t.zero_()
                else:
                    t.copy_(torch.empty(t.shape, dtype=torch.float32).normal_(
                        0.0, std, generator=generator))
            if self.model.padding_idx is not None:
                self.model.embed_tokens.weight[self.model.padding_idx].zero_()

    def forward(self, input_ids, labels=None, output_router_logits=None):
        if output_router_logits is None:
            output_router_logits = getattr(self.config, "output_router_logits", False)
        recorded, hooks = [], []
        if output_router_logits and self.router_logits_from:
            cls, index = self.router_logits_from[self.config.experts_layout]
            hooks = [m.register_forward_hook(lambda m, args, out: recorded.append(out[index]))
                     for m in self.modules() if isinstance(m, cls)]
        try:
            logits = self.lm_head(self.model(input_ids))
        finally:
            for hook in hooks:
                hook.remove()
        loss = aux_loss = router_logits = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, self.vocab_size),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        if recorded:
            router_logits = tuple(recorded)
            aux_loss = load_balancing_loss_func(router_logits, self.num_experts,
                                                self.num_experts_per_tok)
            if loss is not None:
                loss = loss + self.config.router_aux_loss_coef * aux_loss
        return CausalLMOutput(logits, loss, aux_loss, router_logits)


def _qwen_is_sparse(cls, config, layer_idx):
    return layer_idx not in config.mlp_only_layers and config.num_experts > 0 and \
        (layer_idx + 1) % config.decoder_sparse_step == 0


class Qwen2MoeForCausalLM(ForCausalLM):
    """q/k/v_proj with bias (qkv_bias), o_proj without; dense Qwen2MoeMLP
    layers by mlp_only_layers and decoder_sparse_step."""
    config_class, sparse_block, dense_mlp = Qwen2MoeConfig, Qwen2MoeSparseMoeBlock, Qwen2MoeMLP
    is_sparse = classmethod(_qwen_is_sparse)

    @classmethod
    def attention(cls, config):
        return Attention(config, qkv_bias=getattr(config, "qkv_bias", True))


class Qwen3MoeForCausalLM(ForCausalLM):
    """attention_bias on all four projections, per-head q_norm/k_norm; dense
    Qwen3MoeMLP layers by mlp_only_layers and decoder_sparse_step."""
    config_class, sparse_block, dense_mlp = Qwen3MoeConfig, Qwen3MoeSparseMoeBlock, Qwen3MoeMLP
    is_sparse = classmethod(_qwen_is_sparse)

    @classmethod
    def attention(cls, config):
        return Attention(config, qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                         qk_norm="head")


class MixtralForCausalLM(ForCausalLM):
    """Every layer sparse; the block is block_sparse_moe in v4 (and in
    checkpoints), mlp in v5."""
    config_class, sparse_block = MixtralConfig, MixtralSparseMoeBlock
    checkpoint_block = "block_sparse_moe"

    @classmethod
    def block_name(cls, config):
        return "mlp" if config.experts_layout == "fused" else "block_sparse_moe"


class OlmoeForCausalLM(ForCausalLM):
    """Every layer sparse; attention_bias on all four projections, q_norm and
    k_norm over the whole projections, clip_qkv."""
    config_class, sparse_block, dense_mlp = OlmoeConfig, OlmoeSparseMoeBlock, OlmoeMLP

    @classmethod
    def attention(cls, config):
        return Attention(config, qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                         qk_norm="full")


class DeepseekV2ForCausalLM(ForCausalLM):
    """Layers from first_k_dense_replace on are sparse, the ones before a
    DeepseekV2MLP of intermediate_size; plain attention in place of MLA (head
    dim hidden_size // num_attention_heads); no router logits."""
    config_class, dense_mlp = DeepseekV2Config, DeepseekV2MLP
    router_logits_from = None

    @classmethod
    def block_class(cls, config):
        return DeepseekV2Moe if config.experts_layout == "fused" else DeepseekV2MoE

    @classmethod
    def is_sparse(cls, config, layer_idx):
        return layer_idx >= config.first_k_dense_replace

    @classmethod
    def attention(cls, config):
        return Attention(config, head_dim=config.hidden_size // config.num_attention_heads)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """As DeepseekV2ForCausalLM, with DeepseekV3MoE and DeepseekV3MLP."""
    config_class, dense_mlp = DeepseekV3Config, DeepseekV3MLP

    @classmethod
    def block_class(cls, config):
        return DeepseekV3MoE


MODELS = {cls.__name__: cls for cls in (Qwen2MoeForCausalLM, Qwen3MoeForCausalLM,
                                        MixtralForCausalLM, OlmoeForCausalLM,
                                        DeepseekV2ForCausalLM, DeepseekV3ForCausalLM)}


def model_from_config(config, seed=None):
    """The stand-in model of config.architectures[0] (default: the family's
    causal LM); config is a config object or a dict with model_type."""
    if isinstance(config, dict):
        config = config_from_dict(config)
    name = (getattr(config, "architectures", None) or [config.architecture])[0]
    if name not in MODELS:
        raise ValueError(f"hf_models: no stand-in for architecture {name!r} "
                         f"(known: {', '.join(MODELS)})")
    return MODELS[name](config, seed=seed)


# --- checkpoint names --------------------------------------------------------------------

def _checkpoint_key(key, renames):
    for old, new in renames:
        if key.startswith(old):
            return new + key[len(old):]
    return key


def checkpoint_state_dict(model):
    """The model's tensors under transformers v4 checkpoint names (the Hub's),
    in either layout: each fused experts module's gate_up_proj[e] split into
    experts.<e>.gate_proj.weight and up_proj.weight (Mixtral w1, w3) and
    down_proj[e] as experts.<e>.down_proj.weight (w2), all [out, in]; v5
    Mixtral's mlp named block_sparse_moe; a tied lm_head.weight left out.
    The tensors are the model's own (detached views): writing into them
    writes into the model."""
    fused = {name: m for name, m in model.named_modules() if isinstance(m, Experts)}
    # Blocks that the module tree names otherwise than checkpoints (v5 Mixtral's mlp).
    want = model.checkpoint_block
    renames = [(f"model.layers.{i}.{layer.ffn_name}.", f"model.layers.{i}.{want}.")
               for i, layer in enumerate(model.model.layers) if layer.ffn_name != want]
    out = {}
    for key, t in model.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        experts = fused.get(owner)
        if experts is None:
            out[_checkpoint_key(key, renames)] = t
        elif leaf == "gate_up_proj":
            prefix = _checkpoint_key(owner + ".", renames)
            g, u, d = experts.checkpoint_names
            inter = experts.intermediate_dim
            down = experts.down_proj.detach()
            for e in range(experts.num_experts):
                out[f"{prefix}{e}.{g}.weight"] = t[e, :inter]
                out[f"{prefix}{e}.{u}.weight"] = t[e, inter:]
                out[f"{prefix}{e}.{d}.weight"] = down[e]
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def load_checkpoint_state_dict(model, state):
    """Copies checkpoint-named tensors (the Hub's v4 names, as
    checkpoint_state_dict gives them) into the model, in either layout:
    strictly, every name of the model and no other, each a tensor of its
    shape (and floating point where the model's is, else of its dtype),
    before anything is copied. A tied lm_head.weight in `state` is
    ignored."""
    own = checkpoint_state_dict(model)
    state = dict(state)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"hf_models: the checkpoint does not fit the model: missing "
                         f"{missing[:3]}{' ...' if len(missing) > 3 else ''}, unexpected "
                         f"{unexpected[:3]}{' ...' if len(unexpected) > 3 else ''}")
    for key, t in own.items():
        given = state[key]
        if not isinstance(given, torch.Tensor):
            raise ValueError(f"hf_models: '{key}' is a {type(given).__name__}, not a tensor")
        if tuple(given.shape) != tuple(t.shape):
            raise ValueError(f"hf_models: '{key}' has shape {list(given.shape)}; the "
                             f"model's is {list(t.shape)}")
        # A float tensor takes any float (cast, as transformers' torch_dtype); an
        # integer one its own dtype.
        if given.is_floating_point() != t.is_floating_point() or \
                not t.is_floating_point() and given.dtype != t.dtype:
            raise ValueError(f"hf_models: '{key}' is {given.dtype}; the model's is {t.dtype}")
    with torch.no_grad():
        for key, t in own.items():
            t.copy_(state[key])
