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


def test_resume_refuses_a_folder_without_checkpoints_or_of_mixed_steps(tmp_path):
    """--resume of a folder without rankN.pt files, or of files of
    different steps (two runs' checkpoints in one folder), exits naming
    the folder; a checkpoint resumed goes on from its step."""
    import torch
    with pytest.raises(SystemExit, match="no rankN.pt checkpoint files there"):
        train_toy.train(steps=2, threads=1, resume=tmp_path, out=lambda line: None)
    train_toy.train(steps=1, threads=1, checkpoint=tmp_path, out=lambda line: None)
    saved = torch.load(tmp_path / "rank0.pt", weights_only=True)
    assert saved["step"] == 1
    assert len(train_toy.train(steps=3, threads=1, resume=tmp_path, out=lambda line: None)) == 2
    torch.save(dict(saved, step=2), tmp_path / "rank1.pt")
    with pytest.raises(SystemExit, match=r"the files are of different steps \[1, 2\]"):
        train_toy.train(steps=3, threads=1, resume=tmp_path, out=lambda line: None)
