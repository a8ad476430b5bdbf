"""What the stand-ins' blocks share: RMSNorm, attention, expert MLPs, experts. See the package's
docstring."""

import torch
import torch.nn.functional as F
from torch import nn


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
        # GLM: rotary embeddings on the first partial_rotary_factor of each head
        self.rotary_dim = int(d * getattr(config, "partial_rotary_factor", 1.0))
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
        d = self.rotary_dim
        inv_freq = 1.0 / self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
        freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1).to(hidden_states.device)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        (q, q_pass), (k, k_pass) = (z.split([d, self.head_dim - d], -1) for z in (q, k))
        q = torch.cat((q * cos + _rotate_half(q) * sin, q_pass), dim=-1)
        k = torch.cat((k * cos + _rotate_half(k) * sin, k_pass), dim=-1)
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


class Qwen3NextMLP(MLP):
    pass


class Qwen3_5MoeMLP(MLP):
    pass


class DeepseekV2MLP(MLP):
    pass


class DeepseekV3MLP(MLP):
    pass


class Glm4MoeMLP(MLP):
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


class Qwen3NextExperts(Experts):
    pass


class Qwen3_5MoeExperts(Experts):
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


class Glm4MoeExperts(Experts):
    """(transformers 5.0 called it Glm4MoeNaiveMoe.)"""
    num_experts_field = "n_routed_experts"
