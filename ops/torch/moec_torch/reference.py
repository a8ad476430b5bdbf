"""The MoE-FFN layer in plain PyTorch (DESIGN section 2), for autograd.

This is the outside judge of the moec op's numerics and the baseline of its
benchmark. It is written the way a careful PyTorch user would: the (token, k)
rows are sorted by expert once, each expert runs one matmul pair on slices of
``unbind`` (indexing ``w[e]`` in a loop would make autograd build a full-size
gradient per expert), and the weighted combine is one ``index_add`` that
accumulates in fp32.

An EP group of R ranks computes, over all its tokens, the same function as
one rank holding every expert, so the reference works on the global tensors:
x [R, S, H], topk_ids and topk_weights [R, S, K], w1 [E, H, 2I], w2 [E, I, H].
"""

import torch
import torch.nn.functional as F


def moe_ffn(x, topk_ids, topk_weights, w1, w2, lora=None, lora_scaling=1.0):
    """y[t] = sum_k topk_weights[t, k] * FFN_{topk_ids[t, k]}(x[t]).

    lora: LoRA adapters on the experts' projections, PEFT's formula:
    {"w1": (A1 [E, H, r], B1 [E, r, 2I]), "w2": (A2 [E, I, r], B2 [E, r, H])}
    (either or both); a projection X W becomes X W + lora_scaling (X A) B."""
    lora = lora or {}

    def adapters(name):
        if name not in lora:
            return [None] * w1.shape[0]
        a, b = lora[name]
        return list(zip(a.unbind(0), b.unbind(0)))

    def project(rows, w, adapter):
        out = rows @ w
        if adapter is not None:
            out = out + lora_scaling * ((rows @ adapter[0]) @ adapter[1])
        return out

    hidden = x.shape[-1]
    top_k = topk_ids.shape[-1]
    experts, _, two_inter = w1.shape
    inter = two_inter // 2
    tokens = x.reshape(-1, hidden)
    ids = topk_ids.reshape(-1).long()
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=experts).tolist()
    token_of_row = order // top_k
    rows = tokens.index_select(0, token_of_row)
    outs = []
    for chunk, w1_e, w2_e, l1, l2 in zip(rows.split(counts), w1.unbind(0), w2.unbind(0),
                                         adapters("w1"), adapters("w2")):
        if chunk.shape[0] == 0:
            continue
        h = project(chunk, w1_e, l1)
        a = F.silu(h[:, :inter]) * h[:, inter:]
        outs.append(project(a, w2_e, l2))
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    z = (torch.cat(outs) if outs else rows.new_zeros(0, hidden)).to(acc)
    gate = topk_weights.reshape(-1).index_select(0, order).to(acc)
    y = torch.zeros(tokens.shape, dtype=acc, device=x.device)
    y = y.index_add(0, token_of_row, z * gate[:, None])
    return y.to(x.dtype).view(x.shape)


FP8_BLOCK = 128
FP8_MAX = 448.0


def e4m3_round(v):
    """float32 values rounded to the nearest e4m3 number (3 mantissa bits,
    exponents down to 2^-6, subnormal steps of 2^-9, ties to even,
    saturating at +-448; NaN stays NaN), written from the format's
    definition."""
    # The e4m3 step at |v|: 2^(e - 3) for a normal of exponent e >= -6,
    # else the subnormal step 2^-9. frexp gives v = m 2^E, 0.5 <= |m| < 1.
    _, exponent = torch.frexp(v)
    step = torch.pow(2.0, (torch.clamp(exponent - 1, min=-6) - 3).float())
    return torch.clamp(torch.round(v / step) * step, -FP8_MAX, FP8_MAX)


def fp8_round_rows(x):
    """x's rows as an FP8 dispatch delivers them, written from the format's
    definition with plain torch ops (no moec code): each row of the last dim
    is cut into blocks of 128 values; a block's scale is amax / 448 (fp32;
    1 for a block of zeros); value / scale is rounded to the nearest e4m3
    number (3 mantissa bits, exponents down to 2^-6, subnormal steps of 2^-9,
    ties to even, saturating at +-448); times the scale (fp32), rounded once
    to x's dtype. Returns a tensor of x's dtype and shape."""
    values = x.detach().float()
    hidden = values.shape[-1]
    out = torch.empty_like(values)
    for begin in range(0, hidden, FP8_BLOCK):
        block = values[..., begin:begin + FP8_BLOCK]
        amax = block.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        out[..., begin:begin + FP8_BLOCK] = e4m3_round(block / scale) * scale
    return out.to(x.dtype)
