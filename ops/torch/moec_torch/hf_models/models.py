"""The stand-ins' decoder layer, base model and causal LMs. See the package's docstring."""

import torch
import torch.nn.functional as F
from torch import nn

from .configs import (
    DeepseekV2Config,
    DeepseekV3Config,
    Glm4MoeConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    Qwen3_5MoeTextConfig,
    config_from_dict,
)
from .modules import (
    Attention,
    DeepseekV2MLP,
    DeepseekV3MLP,
    Glm4MoeMLP,
    MLP,
    OlmoeMLP,
    Qwen2MoeMLP,
    Qwen3MoeMLP,
    Qwen3NextMLP,
    Qwen3_5MoeMLP,
    RMSNorm,
)
from .moe import (
    DeepseekV2MoE,
    DeepseekV2Moe,
    DeepseekV3MoE,
    Glm4MoeMoE,
    MixtralSparseMoeBlock,
    OlmoeSparseMoeBlock,
    Qwen2MoeSparseMoeBlock,
    Qwen3MoeSparseMoeBlock,
    Qwen3NextSparseMoeBlock,
    Qwen3_5MoeSparseMoeBlock,
    SparseMoeBlock,
    TopKRouter,
)
from .checkpoints import checkpoint_state_dict


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
    """<Family>Model: embed_tokens (padding_idx = pad_token_id), layers, norm;
    _keys_to_ignore_on_load_unexpected as the family's model class has it
    (checkpoint names transformers skips: DeepSeek-V3's multi-token
    prediction layer, stored as layer 61)."""

    def __init__(self, config, model_class):
        super().__init__()
        self._keys_to_ignore_on_load_unexpected = list(model_class.keys_to_ignore)
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
    # The experts' names in the Hub's checkpoints: "modules", v4's per-expert
    # ones (checkpoint_state_dict converts v5's), or "fused", v5's own.
    checkpoint_experts = "modules"
    keys_to_ignore = ()  # the <Family>Model's _keys_to_ignore_on_load_unexpected
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


class Qwen3NextForCausalLM(ForCausalLM):
    """Qwen3-Next's MoE layers (Qwen3NextSparseMoeBlock, dense Qwen3NextMLP
    ones by mlp_only_layers and decoder_sparse_step); every layer's
    attention the plain one with head_dim, partial rotary embeddings and
    per-head q/k norms, in place of its linear attention and gated
    attention; the checkpoint's multi-token prediction head (mtp.*)
    skipped on load, as transformers' Qwen3NextPreTrainedModel does."""
    config_class, sparse_block, dense_mlp = Qwen3NextConfig, Qwen3NextSparseMoeBlock, Qwen3NextMLP
    is_sparse = classmethod(_qwen_is_sparse)
    keys_to_ignore = (r"^mtp.*",)

    @classmethod
    def attention(cls, config):
        return Attention(config, qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                         qk_norm="head")


class Qwen3_5MoeForCausalLM(ForCausalLM):
    """Qwen3.5-MoE's text model (transformers v5: Qwen3_5MoeForCausalLM;
    the Hub's Qwen3_5MoeForConditionalGeneration holds the same under
    model.language_model, beside its vision tower): every layer sparse,
    attention as Qwen3-Next's stand-in; its checkpoints keep the experts
    fused (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]);
    mtp.* skipped on load."""
    config_class, sparse_block, dense_mlp = (Qwen3_5MoeTextConfig, Qwen3_5MoeSparseMoeBlock,
                                             Qwen3_5MoeMLP)
    keys_to_ignore = (r"^mtp.*",)
    checkpoint_experts = "fused"

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
    keys_to_ignore = (r"model\.layers\.61.*",)  # DeepseekV3Model's

    @classmethod
    def block_class(cls, config):
        return DeepseekV3MoE


class Glm4MoeForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.5's: DeepSeek-V3's layers (dense before first_k_dense_replace,
    Glm4MoeMoE after) under grouped-query attention with head_dim, partial
    rotary embeddings, q/k/v biases by attention_bias (o_proj none) and
    per-head q/k norms by use_qk_norm."""
    config_class, dense_mlp = Glm4MoeConfig, Glm4MoeMLP
    # Glm4MoeModel's: the multi-token prediction layer of GLM-4.5 (92
    # layers) and GLM-4.5-Air (46).
    keys_to_ignore = (r"model\.layers\.92.*", r"model\.layers\.46.*")

    @classmethod
    def block_class(cls, config):
        return Glm4MoeMoE

    @classmethod
    def attention(cls, config):
        return Attention(config, qkv_bias=config.attention_bias,
                         qk_norm="head" if config.use_qk_norm else None)


MODELS = {cls.__name__: cls for cls in (Qwen2MoeForCausalLM, Qwen3MoeForCausalLM,
                                        MixtralForCausalLM, OlmoeForCausalLM,
                                        DeepseekV2ForCausalLM, DeepseekV3ForCausalLM,
                                        Glm4MoeForCausalLM, Qwen3NextForCausalLM, Qwen3_5MoeForCausalLM)}


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
