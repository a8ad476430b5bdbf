"""The stand-ins' MoE blocks and routers: softmax-routed families, DeepSeek. See the package's
docstring."""

import torch
import torch.nn.functional as F
from torch import nn

from .modules import (
    DeepseekV2Experts,
    DeepseekV2MLP,
    DeepseekV3Experts,
    DeepseekV3MLP,
    Glm4MoeExperts,
    Glm4MoeMLP,
    Experts,
    MLP,
    MixtralBlockSparseTop2MLP,
    MixtralExperts,
    OlmoeExperts,
    OlmoeMLP,
    Qwen2MoeExperts,
    Qwen2MoeMLP,
    Qwen3MoeExperts,
    Qwen3MoeMLP,
    Qwen3NextExperts,
    Qwen3NextMLP,
    Qwen3_5MoeExperts,
    Qwen3_5MoeMLP,
    _dispatch,
)


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


class Qwen3NextTopKRouter(TopKRouter):
    pass


class Qwen3_5MoeTopKRouter(TopKRouter):
    """Always renormalizes (its config has no norm_topk_prob); the weights
    in the logits' dtype."""
    always_renormalize = True


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
        self.shared_expert = self.mlp_class(
            config, intermediate_size=config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def add_shared(self, hidden_states, out):
        gate = torch.sigmoid(self.shared_expert_gate(hidden_states))
        return out + gate * self.shared_expert(hidden_states)


class Qwen3NextSparseMoeBlock(Qwen2MoeSparseMoeBlock):
    """Qwen3-Next's block: Qwen2-MoE's, under Qwen3-Next's names."""
    mlp_class, experts_class, router_class = Qwen3NextMLP, Qwen3NextExperts, Qwen3NextTopKRouter


class Qwen3_5MoeSparseMoeBlock(Qwen2MoeSparseMoeBlock):
    """Qwen3.5-MoE's block (v5 only): Qwen3-Next's, its router always
    renormalizing."""
    mlp_class, experts_class, router_class = Qwen3_5MoeMLP, Qwen3_5MoeExperts, Qwen3_5MoeTopKRouter
    always_renormalize = True


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


class Glm4MoeTopkRouter(DeepseekV3TopkRouter):
    """GLM-4.5's router: DeepSeek-V3's."""


class Glm4MoeMoE(DeepseekV3MoE):
    """GLM-4.5's block: DeepSeek-V3's (its ``moe`` method in v4, the fused
    Glm4MoeExperts in v5), under GLM's names."""
    mlp_class, experts_class = Glm4MoeMLP, Glm4MoeExperts
    routers = (Glm4MoeTopkRouter, Glm4MoeTopkRouter)
