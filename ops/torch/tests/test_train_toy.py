"""The toy training example learns: its loss falls, through moec's backward
pass (router through d topk_weights, experts through dw1 and dw2)."""

import pytest

import train_toy


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_loss_falls(dtype):
    losses = train_toy.train(steps=60, ranks=2, dtype=dtype, threads=2, out=lambda line: None)
    first, last = losses[0], sum(losses[-5:]) / 5
    assert last < 0.2 * first, losses


def test_experts_and_router_get_gradients():
    import torch
    torch.manual_seed(0)
    model = train_toy.ToyModel(ranks=2, dtype="fp32", features=16, threads=2)
    x = torch.randn(2, model.moe.tokens, 16)
    model(x).square().mean().backward()
    for name in ("moe.w1", "moe.w2", "router.weight", "inp.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().max() > 0, name
