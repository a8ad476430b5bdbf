"""Stand-ins of Hugging Face transformers' MoE causal LMs, for tests and
examples where transformers is not installed (it is not a Debian package):
Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V2, DeepSeek-V3 and OLMoE.

They keep transformers' class names, attribute names (so state_dict names),
config fields and the MoE blocks' forward math, written from
src/transformers/models/<family>/modeling_<family>.py:

- the v4 form (4.5x): ``experts`` is an nn.ModuleList of per-expert MLPs
  (gate_proj/up_proj/down_proj; Mixtral's MixtralBlockSparseTop2MLP w1/w3/w2);
  Qwen/Mixtral/OLMoE blocks route inline and return (hidden states, router
  logits); DeepSeek's blocks call their router module (DeepseekV3TopkRouter:
  sigmoid scores, e_score_correction_bias for choosing only, group-limited
  top-k with groups scored by their top two, weights from the unbiased
  scores, norm_topk_prob, routed_scaling_factor; DeepseekV2MoEGate: softmax,
  greedy or group-limited by the group's best score) and a ``moe`` method
  and return the hidden states;
- the v5 form: ``experts`` holds gate_up_proj [E, 2I, H] (gate rows, then up)
  and down_proj [E, H, I] and is called experts(hidden_states, top_k_index,
  top_k_weights); routers are modules of their own (Qwen3MoeTopKRouter, ...)
  returning (router probabilities, top-k weights, top-k indices), and blocks
  return the hidden states; Mixtral's block is the decoder layer's ``mlp``
  (checkpoints still call it block_sparse_moe).

A config's ``experts_layout`` picks the form: "modules" (v4, the default)
or "fused" (v5); it is the stand-ins' own field. Checkpoints hold the v4
names in either case (checkpoint_state_dict / load_checkpoint_state_dict
convert), as the Hub's do.

Simplified, since moec does not touch them: attention is plain causal
multi-head attention with grouped KV heads and rotary embeddings (Qwen3's
q_norm/k_norm kept; DeepSeek's multi-head latent attention is replaced by
the same plain attention), no KV cache, no attention mask but the causal
one, no dropout, no auxiliary router loss; only hidden_act "silu".
"""

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CONFIGS", "MODELS", "checkpoint_state_dict", "config_from_dict",
           "config_from_pretrained", "load_checkpoint_state_dict", "model_from_config"]


# --- configs -------------------------------------------------------------------

class PretrainedConfig:
    """A config as transformers' PretrainedConfig: the family's fields with
    their defaults, any others kept as given; to_dict(), save_pretrained()."""

    model_type = None
    architectures = None
    defaults = dict(vocab_size=32000, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0,
                    initializer_range=0.02, tie_word_embeddings=False, torch_dtype="float32",
                    output_router_logits=False, router_aux_loss_coef=0.001,
                    experts_layout="modules")

    def __init__(self, **kwargs):
        fields = {**PretrainedConfig.defaults, **type(self).defaults, **kwargs}
        fields.pop("model_type", None)
        fields.setdefault("architectures", [type(self).architectures])
        for key, value in fields.items():
            setattr(self, key, value)
        if self.experts_layout not in ("modules", "fused"):
            raise ValueError(f"experts_layout must be 'modules' or 'fused', got "
                             f"{self.experts_layout!r}")

    def to_dict(self):
        return {"model_type": self.model_type,
                **{k: v for k, v in vars(self).items() if not k.startswith("_")}}

    def to_json_file(self, path):
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    def save_pretrained(self, folder):
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.to_json_file(Path(folder) / "config.json")


class Qwen2MoeConfig(PretrainedConfig):
    model_type, architectures = "qwen2_moe", "Qwen2MoeForCausalLM"
    defaults = dict(moe_intermediate_size=32, shared_expert_intermediate_size=64,
                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                    decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0)


class Qwen3MoeConfig(PretrainedConfig):
    model_type, architectures = "qwen3_moe", "Qwen3MoeForCausalLM"
    defaults = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                    norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
                    head_dim=None, rope_theta=1000000.0)


class MixtralConfig(PretrainedConfig):
    model_type, architectures = "mixtral", "MixtralForCausalLM"
    defaults = dict(num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0,
                    rope_theta=1000000.0, rms_norm_eps=1e-5)


class DeepseekV2Config(PretrainedConfig):
    model_type, architectures = "deepseek_v2", "DeepseekV2ForCausalLM"
    defaults = dict(moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                    num_experts_per_tok=2, first_k_dense_replace=0, n_group=1, topk_group=1,
                    topk_method="greedy", routed_scaling_factor=1.0, norm_topk_prob=False)


class DeepseekV3Config(PretrainedConfig):
    model_type, architectures = "deepseek_v3", "DeepseekV3ForCausalLM"
    defaults = dict(moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                    num_experts_per_tok=2, first_k_dense_replace=0, n_group=1, topk_group=1,
                    routed_scaling_factor=2.5, norm_topk_prob=True, topk_method="noaux_tc",
                    scoring_func="sigmoid")


class OlmoeConfig(PretrainedConfig):
    model_type, architectures = "olmoe", "OlmoeForCausalLM"
    defaults = dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                    rms_norm_eps=1e-5)


CONFIGS = {c.model_type: c for c in (Qwen2MoeConfig, Qwen3MoeConfig, MixtralConfig,
                                     DeepseekV2Config, DeepseekV3Config, OlmoeConfig)}


def config_from_dict(d):
    """The config class of d["model_type"], with d's fields."""
    cls = CONFIGS.get(d.get("model_type"))
    if cls is None:
        raise ValueError(f"hf_models: no stand-in for model_type {d.get('model_type')!r} "
                         f"(known: {', '.join(CONFIGS)})")
    return cls(**d)


def config_from_pretrained(folder):
    """The config of a checkpoint folder's config.json."""
    return config_from_dict(json.loads((Path(folder) / "config.json").read_text()))


# --- shared modules ----------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


class Attention(nn.Module):
    """Causal attention with grouped KV heads and rotary embeddings."""

    def __init__(self, config, qkv_bias=False, qk_norm=False):
        super().__init__()
        h = config.hidden_size
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or h // self.heads
        self.theta = config.rope_theta
        d = self.head_dim
        self.q_proj = nn.Linear(h, self.heads * d, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, x):
        b, t, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, t, -1, d)
        k = self.k_proj(x).view(b, t, -1, d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        inv = 1.0 / self.theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)
        freqs = torch.outer(torch.arange(t, dtype=torch.float), inv)
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = q @ k.transpose(2, 3) * d ** -0.5
        mask = torch.full((t, t), float("-inf")).triu(1)
        p = F.softmax(scores + mask.to(scores.dtype), -1, dtype=torch.float32).to(q.dtype)
        return self.o_proj((p @ v).transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """transformers' <Family>MLP: down_proj(act(gate_proj(x)) * up_proj(x))."""

    def __init__(self, config, intermediate_size=None):
        super().__init__()
        h, i = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act_fn = nn.SiLU()

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
    """Mixtral's expert (v4): w2(act(w1(x)) * w3(x))."""

    def __init__(self, config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.w1 = nn.Linear(h, i, bias=False)
        self.w2 = nn.Linear(i, h, bias=False)
        self.w3 = nn.Linear(h, i, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """transformers v5's fused experts, called experts(hidden_states [N, H],
    top_k_index [N, K], top_k_weights [N, K]) -> [N, H]: per hit expert,
    linear with gate_up_proj[e], chunk into gate and up, act(gate) * up,
    linear with down_proj[e], times the token's weight, index_add_ in the
    hidden dtype."""

    def __init__(self, config, num_experts, intermediate_size):
        super().__init__()
        self.num_experts = num_experts
        h = config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, h))
        self.down_proj = nn.Parameter(torch.empty(num_experts, h, intermediate_size))
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = e[0]
            pos, tok = torch.where(mask[e])
            gate, up = F.linear(hidden_states[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            out = F.linear(self.act_fn(gate) * up, self.down_proj[e])
            out = out * top_k_weights[tok, pos, None]
            final.index_add_(0, tok, out.to(final.dtype))
        return final


class Qwen2MoeExperts(Experts):
    pass


class Qwen3MoeExperts(Experts):
    pass


class MixtralExperts(Experts):
    pass


class OlmoeExperts(Experts):
    pass


class DeepseekV2Experts(Experts):
    pass


class DeepseekV3NaiveMoe(Experts):
    pass


# --- routers and blocks --------------------------------------------------------

def _softmax_topk(logits, top_k, renormalize, dtype):
    """Softmax in fp32, top-k, renormalized or not, cast to dtype: the
    Qwen/Mixtral/OLMoE routing."""
    weights = F.softmax(logits, dim=1, dtype=torch.float)
    weights, selected = torch.topk(weights, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), selected


class TopKRouter(nn.Module):
    """v5's <Family>TopKRouter: weight [E, H]; returns (softmax probabilities,
    top-k weights, top-k indices)."""

    def __init__(self, config, num_experts, renormalize):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = num_experts
        self.norm_topk_prob = renormalize
        self.weight = nn.Parameter(torch.zeros(num_experts, config.hidden_size))

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
        logits = F.linear(hidden_states, self.weight)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top /= top.sum(dim=-1, keepdim=True)
        return probs, top.to(probs.dtype), idx


class Qwen2MoeTopKRouter(TopKRouter):
    pass


class Qwen3MoeTopKRouter(TopKRouter):
    pass


class MixtralTopKRouter(TopKRouter):
    pass


class OlmoeTopKRouter(TopKRouter):
    pass


class SoftmaxMoeBlock(nn.Module):
    """The Qwen2/3-MoE, Mixtral and OLMoE block in either form."""

    mlp_class = MLP
    experts_class = Experts
    router_class = TopKRouter
    experts_key = "num_experts"
    inter_key = "moe_intermediate_size"
    always_renormalize = False

    def __init__(self, config):
        super().__init__()
        self.num_experts = getattr(config, self.experts_key)
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = self.always_renormalize or config.norm_topk_prob
        self.fused = config.experts_layout == "fused"
        inter = getattr(config, self.inter_key)
        if self.fused:
            self.gate = self.router_class(config, self.num_experts, self.norm_topk_prob)
            self.experts = self.experts_class(config, self.num_experts, inter)
        else:
            self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
            self.experts = nn.ModuleList([self._expert(config, inter)
                                          for _ in range(self.num_experts)])

    def _expert(self, config, inter):
        return self.mlp_class(config, intermediate_size=inter)

    def _shared(self, flat):
        return None

    def forward(self, hidden_states):
        b, t, h = hidden_states.shape
        if self.training and getattr(self, "jitter_noise", 0) > 0:
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        flat = hidden_states.view(-1, h)
        if self.fused:
            _, weights, selected = self.gate(flat)
            out = self.experts(flat, selected, weights)
        else:
            logits = self.gate(flat)
            weights, selected = _softmax_topk(logits, self.top_k, self.norm_topk_prob,
                                              flat.dtype)
            out = torch.zeros_like(flat)
            mask = F.one_hot(selected, num_classes=self.num_experts).permute(2, 1, 0)
            for e in range(self.num_experts):
                pos, tok = torch.where(mask[e])
                if tok.numel():
                    y = self.experts[e](flat[tok]) * weights[tok, pos, None]
                    out.index_add_(0, tok, y.to(flat.dtype))
        shared = self._shared(flat)
        if shared is not None:
            out = out + shared
        out = out.reshape(b, t, h)
        return out if self.fused else (out, logits)


class Qwen3MoeSparseMoeBlock(SoftmaxMoeBlock):
    mlp_class, experts_class, router_class = Qwen3MoeMLP, Qwen3MoeExperts, Qwen3MoeTopKRouter


class Qwen2MoeSparseMoeBlock(SoftmaxMoeBlock):
    mlp_class, experts_class, router_class = Qwen2MoeMLP, Qwen2MoeExperts, Qwen2MoeTopKRouter

    def __init__(self, config):
        super().__init__(config)
        self.shared_expert = Qwen2MoeMLP(config, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def _shared(self, flat):
        return torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)


class MixtralSparseMoeBlock(SoftmaxMoeBlock):
    experts_class, router_class = MixtralExperts, MixtralTopKRouter
    experts_key, inter_key, always_renormalize = "num_local_experts", "intermediate_size", True

    def __init__(self, config):
        super().__init__(config)
        self.jitter_noise = config.router_jitter_noise

    def _expert(self, config, inter):
        return MixtralBlockSparseTop2MLP(config)


class OlmoeSparseMoeBlock(SoftmaxMoeBlock):
    mlp_class, experts_class, router_class = OlmoeMLP, OlmoeExperts, OlmoeTopKRouter
    inter_key = "intermediate_size"


class DeepseekV3TopkRouter(nn.Module):
    """Sigmoid scores; e_score_correction_bias for choosing only; the
    top_k among the topk_group groups whose two best biased scores sum
    highest; weights from the unbiased scores, renormalized when
    norm_topk_prob, times routed_scaling_factor. Returns (indices, weights
    in fp32)."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.n_routed_experts = config.n_routed_experts
        self.routed_scaling_factor = config.routed_scaling_factor
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(self.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_routed_experts))

    def get_topk_indices(self, scores):
        e, g = self.n_routed_experts, self.n_group
        choice = scores.view(-1, e) + self.e_score_correction_bias.unsqueeze(0)
        group_scores = choice.view(-1, g, e // g).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, g, e // g).reshape(-1, e)
        choice = choice.masked_fill(~score_mask.bool(), 0.0)
        return torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.weight.shape[1])
        logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        scores = logits.sigmoid()
        idx = self.get_topk_indices(scores)
        weights = scores.gather(1, idx)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return idx, weights * self.routed_scaling_factor


class DeepseekV2MoEGate(nn.Module):
    """Softmax scores in fp32; top_k greedily, or ("group_limited_greedy")
    among the topk_group groups with the best single score; times
    routed_scaling_factor. Returns (indices, weights in fp32)."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.routed_scaling_factor = config.routed_scaling_factor
        self.topk_method = config.topk_method
        self.num_group, self.topk_group = config.n_group, config.topk_group
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
        n = hidden_states.shape[0]
        logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if self.topk_method == "group_limited_greedy":
            group_scores = scores.view(n, self.num_group, -1).max(dim=-1).values
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(
                n, self.num_group, self.num_experts // self.num_group).reshape(n, -1)
            scores = scores.masked_fill(~score_mask.bool(), 0.0)
        weight, idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return idx, weight * self.routed_scaling_factor


class DeepseekMoE(nn.Module):
    """DeepSeek's block: the router module, the routed experts (the v4
    ``moe`` method, or the v5 experts module), plus shared_experts."""

    mlp_class = DeepseekV3MLP
    experts_class = DeepseekV3NaiveMoe
    router_class = DeepseekV3TopkRouter

    def __init__(self, config):
        super().__init__()
        e, inter = config.n_routed_experts, config.moe_intermediate_size
        self.fused = config.experts_layout == "fused"
        self.experts = self.experts_class(config, e, inter) if self.fused else \
            nn.ModuleList([self.mlp_class(config, intermediate_size=inter) for _ in range(e)])
        self.gate = self.router_class(config)
        self.shared_experts = self.mlp_class(config, inter * config.n_shared_experts)

    def moe(self, hidden_states, topk_indices, topk_weights):
        final = torch.zeros_like(hidden_states, dtype=topk_weights.dtype)
        mask = F.one_hot(topk_indices, num_classes=len(self.experts)).permute(2, 0, 1)
        for e in range(len(self.experts)):
            tok, pos = torch.where(mask[e])
            if tok.numel():
                out = self.experts[e](hidden_states[tok]) * topk_weights[tok, pos].unsqueeze(-1)
                final.index_add_(0, tok, out)
        return final.type(hidden_states.dtype)

    def forward(self, hidden_states):
        residuals, shape = hidden_states, hidden_states.shape
        topk_indices, topk_weights = self.gate(hidden_states)
        flat = hidden_states.view(-1, shape[-1])
        if self.fused:
            routed = self.experts(flat, topk_indices, topk_weights)
        else:
            routed = self.moe(flat, topk_indices, topk_weights)
        return routed.view(*shape) + self.shared_experts(residuals)


class DeepseekV3MoE(DeepseekMoE):
    pass


class DeepseekV2MoE(DeepseekMoE):
    mlp_class, experts_class, router_class = DeepseekV2MLP, DeepseekV2Experts, DeepseekV2MoEGate


# --- models --------------------------------------------------------------------

class DecoderLayer(nn.Module):
    def __init__(self, config, idx, family):
        super().__init__()
        self.self_attn = Attention(config, qkv_bias=family.qkv_bias, qk_norm=family.qk_norm)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        ffn = family.block(config) if family.sparse(config, idx) else \
            family.dense(config, config.intermediate_size)
        setattr(self, family.ffn_name(config), ffn)
        self.ffn_name = family.ffn_name(config)

    def forward(self, h):
        h = h + self.self_attn(self.input_layernorm(h))
        out = getattr(self, self.ffn_name)(self.post_attention_layernorm(h))
        logits = None
        if isinstance(out, tuple):
            out, logits = out
        return h + out, logits


class Output:
    """The model's output: logits, loss (with labels), router_logits."""

    def __init__(self, logits, loss=None, router_logits=None):
        self.logits, self.loss, self.router_logits = logits, loss, router_logits


class Model(nn.Module):
    def __init__(self, config, family):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, i, family)
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class ForCausalLM(nn.Module):
    """<Family>ForCausalLM: model.embed_tokens, model.layers, model.norm,
    lm_head; forward(input_ids, labels=None) -> Output."""

    block = None
    dense = MLP
    qkv_bias = False
    qk_norm = False
    config_class = None

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Model(config, type(self))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.init_weights()

    def tie_weights(self):
        """lm_head shares the embedding's weight when tie_word_embeddings, as
        transformers' PreTrainedModel.tie_weights does."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def sparse(config, idx):
        return True

    @staticmethod
    def ffn_name(config):
        return "mlp"

    def init_weights(self):
        std = self.config.initializer_range
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, std)

    def forward(self, input_ids, labels=None, output_router_logits=None):
        h = self.model.embed_tokens(input_ids)
        router_logits = []
        for layer in self.model.layers:
            h, logits = layer(h)
            if logits is not None:
                router_logits.append(logits)
        logits = self.lm_head(self.model.norm(h))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                   labels[:, 1:].reshape(-1))
        keep = output_router_logits if output_router_logits is not None else \
            self.config.output_router_logits
        return Output(logits, loss, tuple(router_logits) if keep else None)


def _qwen_sparse(config, idx):
    return idx not in config.mlp_only_layers and config.num_experts > 0 and \
        (idx + 1) % config.decoder_sparse_step == 0


class Qwen2MoeForCausalLM(ForCausalLM):
    block, dense, qkv_bias, config_class = Qwen2MoeSparseMoeBlock, Qwen2MoeMLP, True, \
        Qwen2MoeConfig
    sparse = staticmethod(_qwen_sparse)


class Qwen3MoeForCausalLM(ForCausalLM):
    block, dense, qk_norm, config_class = Qwen3MoeSparseMoeBlock, Qwen3MoeMLP, True, \
        Qwen3MoeConfig
    sparse = staticmethod(_qwen_sparse)


class MixtralForCausalLM(ForCausalLM):
    block, config_class = MixtralSparseMoeBlock, MixtralConfig

    @staticmethod
    def ffn_name(config):
        return "mlp" if config.experts_layout == "fused" else "block_sparse_moe"


class OlmoeForCausalLM(ForCausalLM):
    block, dense, config_class = OlmoeSparseMoeBlock, OlmoeMLP, OlmoeConfig


class DeepseekV2ForCausalLM(ForCausalLM):
    block, dense, config_class = DeepseekV2MoE, DeepseekV2MLP, DeepseekV2Config

    @staticmethod
    def sparse(config, idx):
        return idx >= config.first_k_dense_replace


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    block, dense, config_class = DeepseekV3MoE, DeepseekV3MLP, DeepseekV3Config


MODELS = {cls.__name__: cls for cls in (Qwen2MoeForCausalLM, Qwen3MoeForCausalLM,
                                        MixtralForCausalLM, OlmoeForCausalLM,
                                        DeepseekV2ForCausalLM, DeepseekV3ForCausalLM)}


def model_from_config(config):
    """The stand-in model of config.architectures[0] (a config object or dict)."""
    if isinstance(config, dict):
        config = config_from_dict(config)
    name = (config.architectures or [None])[0]
    if name not in MODELS:
        raise ValueError(f"hf_models: no stand-in for architecture {name!r} "
                         f"(known: {', '.join(MODELS)})")
    return MODELS[name](config)


# --- checkpoint names ------------------------------------------------------------

def _fused_blocks(model):
    """(state_dict prefix of the experts, checkpoint prefix, experts module,
    expert projection names) of each fused-layout block."""
    for name, m in model.named_modules():
        if isinstance(m, Experts):
            parent = name.rsplit(".", 1)[0]
            ckpt = parent
            proj = ("gate_proj", "up_proj", "down_proj")
            if isinstance(m, MixtralExperts):
                ckpt = parent.rsplit(".", 1)[0] + ".block_sparse_moe"
                proj = ("w1", "w3", "w2")
            yield name, ckpt, m, proj


def checkpoint_state_dict(model):
    """The model's tensors under checkpoint (transformers v4) names: fused
    experts as per-expert [out, in] weights; a tied lm_head left out."""
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, ckpt, m, (g, u, d) in _fused_blocks(model):
        del state[f"{name}.gate_up_proj"], state[f"{name}.down_proj"]
        inter = m.down_proj.shape[2]
        for e in range(m.num_experts):
            state[f"{ckpt}.experts.{e}.{g}.weight"] = m.gate_up_proj[e, :inter].detach()
            state[f"{ckpt}.experts.{e}.{u}.weight"] = m.gate_up_proj[e, inter:].detach()
            state[f"{ckpt}.experts.{e}.{d}.weight"] = m.down_proj[e].detach()
        for key in [k for k in state if k.startswith(name.rsplit(".", 1)[0] + ".")
                    and ckpt != name.rsplit(".", 1)[0]]:
            state[ckpt + key[len(name.rsplit(".", 1)[0]):]] = state.pop(key)
    return state


def load_checkpoint_state_dict(model, state):
    """Loads checkpoint-named tensors into the model (either layout),
    strictly: every name of the model, none other, every shape."""
    state = dict(state)
    with torch.no_grad():
        for name, ckpt, m, (g, u, d) in _fused_blocks(model):
            inter = m.down_proj.shape[2]
            for e in range(m.num_experts):
                m.gate_up_proj[e, :inter].copy_(state.pop(f"{ckpt}.experts.{e}.{g}.weight"))
                m.gate_up_proj[e, inter:].copy_(state.pop(f"{ckpt}.experts.{e}.{u}.weight"))
                m.down_proj[e].copy_(state.pop(f"{ckpt}.experts.{e}.{d}.weight"))
            parent = name.rsplit(".", 1)[0]
            if ckpt != parent:
                for key in [k for k in state if k.startswith(ckpt + ".")]:
                    state[parent + key[len(ckpt):]] = state.pop(key)
        own = {k: v for k, v in model.state_dict(keep_vars=True).items()
               if not k.endswith((".gate_up_proj", ".down_proj"))
               or not isinstance(v, nn.Parameter) or v.dim() != 3}
        if model.config.tie_word_embeddings:
            own.pop("lm_head.weight", None)
        if set(own) != set(state):
            raise ValueError(f"hf_models: the checkpoint does not fit the model: missing "
                             f"{sorted(set(own) - set(state))[:3]}, unexpected "
                             f"{sorted(set(state) - set(own))[:3]}")
        for key, t in own.items():
            if tuple(state[key].shape) != tuple(t.shape):
                raise ValueError(f"hf_models: '{key}' has shape {list(state[key].shape)}; the "
                                 f"model's is {list(t.shape)}")
            t.copy_(state[key])
