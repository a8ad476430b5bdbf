"""An optimizer's state by parameter name (moec_torch.optimizer_state_dict,
merge_optimizer_state_dicts, load_optimizer_state_dict): training resumed
through it gives the uninterrupted run's parameters bit for bit; the
shards a job's processes save merge into the one-process state; every
refusal names what is wrong and leaves the optimizer as it was. Under
torchrun and mpirun, on the files a trained job's processes save:
ddp_check.py."""

import pytest
import torch

import moec_torch
from test_checkpoint import VARIANTS
from test_moe_ffn import config, inputs


class Net(torch.nn.Module):
    """A dense projection before moec's layer (a parameter outside it)."""

    def __init__(self, layer):
        super().__init__()
        self.inp = torch.nn.Linear(layer.hidden, layer.hidden)
        self.moe = layer

    def forward(self, x, ids, weights):
        return self.moe(self.inp(x), ids, weights)


def make(variant, seed, **kw):
    torch.manual_seed(seed)
    return Net(moec_torch.MoeFFN(config(), ranks=2, threads=1, **VARIANTS[variant], **kw))


def optimizer(net, kind="adamw"):
    """Two groups (the layer's trained tensors at another learning rate)."""
    layer = net.moe.adapters() if net.moe.lora_rank else [net.moe.w1, net.moe.w2]
    groups = [{"params": list(net.inp.parameters())}, {"params": layer, "lr": 3e-3}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.8, 0.95))


def step(net, opt, seed):
    x, ids, weights, dy = inputs(net.moe, seed)
    net(x, ids, weights).backward(dy)
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("variant", ["full", "lora"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_resume_through_the_named_state_gives_the_uninterrupted_parameters(
        variant, kind, tmp_path):
    steps = 3
    whole = make(variant, 0)
    opt = optimizer(whole, kind)
    for i in range(2 * steps):
        step(whole, opt, 10 + i)

    first = make(variant, 0)
    opt = optimizer(first, kind)
    for i in range(steps):
        step(first, opt, 10 + i)
    moec_torch.save_state({"model": first.state_dict(),
                           "optimizer": moec_torch.optimizer_state_dict(first, opt)},
                          tmp_path / "ck.pt")
    want = opt.state_dict()
    del first, opt

    resumed = make(variant, 5)
    opt = optimizer(resumed, kind)
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)  # floats kept as their repr
    resumed.load_state_dict(ck["model"])
    moec_torch.load_optimizer_state_dict(resumed, opt, ck["optimizer"])
    got = opt.state_dict()
    assert got["param_groups"] == want["param_groups"]  # lr, betas: the floats exactly
    assert isinstance(got["param_groups"][0]["lr"], float)
    for i, s in want["state"].items():
        for k, v in s.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    for i in range(steps, 2 * steps):
        step(resumed, opt, 10 + i)
    for (name, pw), (_, pr) in zip(whole.named_parameters(), resumed.named_parameters()):
        assert torch.equal(pw, pr), name
    fresh = make(variant, 0)
    assert any(not torch.equal(p, q) for p, q in zip(whole.parameters(), fresh.parameters()))


def trained(variant="full", kind="sgd", **kw):
    net = make(variant, 0, **kw)
    opt = optimizer(net, kind)
    step(net, opt, 1)
    step(net, opt, 2)
    return net, opt


def cut(state, r, parts, tp=None):
    """What process r of an EP group of `parts` would save of `state` (a
    one-process layer's): its experts' slice of every state tensor of a
    layer parameter's shape (with `tp`, (tp rank, tp size): its
    intermediate columns), its layout and shapes."""
    layout = state["layers"]["moe."]
    n = layout["experts"] // parts
    rows = slice(r * n, (r + 1) * n)
    inter = layout["inter"]

    def piece(name, t):
        t = t[rows]
        if tp is None or name not in ("moe.w1", "moe.w2"):
            return t
        i, k = inter // tp[1], tp[0]
        if name == "moe.w1":
            return torch.cat((t[..., k * i:(k + 1) * i],
                              t[..., inter + k * i:inter + (k + 1) * i]), -1)
        return t[:, k * i:(k + 1) * i]

    out = {"format": state["format"], "param_groups": state["param_groups"],
           "state": {}, "shapes": dict(state["shapes"])}
    for name, values in state["state"].items():
        shaped = name.startswith("moe.")
        out["state"][name] = {k: piece(name, v) if shaped and isinstance(v, torch.Tensor) and
                              list(v.shape) == state["shapes"][name] else v
                              for k, v in values.items()}
        if shaped:
            out["shapes"][name] = list(piece(name, torch.empty(state["shapes"][name])).shape)
    columns = [0, inter] if tp is None else \
        [tp[0] * inter // tp[1], (tp[0] + 1) * inter // tp[1]]
    out["layers"] = {"moe.": dict(layout, first_expert=r * n, local_experts=n, columns=columns)}
    return out


def same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if key != "state":
            assert a[key] == b[key], key
    assert a["state"].keys() == b["state"].keys()
    for name, values in a["state"].items():
        assert values.keys() == b["state"][name].keys(), name
        for k, v in values.items():
            assert moec_torch.checkpoint.same_value(v, b["state"][name][k]), (name, k)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_the_shards_of_a_job_merge_into_the_one_process_state(kind):
    net, opt = trained(kind=kind)
    whole = moec_torch.optimizer_state_dict(net, opt)
    assert whole["shapes"]["moe.w1"] == list(net.moe.w1.shape)
    assert whole["layers"]["moe."]["local_experts"] == net.moe.experts
    assert set(whole["state"]["moe.w1"]) == ({"momentum_buffer"} if kind == "sgd" else
                                             {"step", "exp_avg", "exp_avg_sq"})
    shards = [cut(whole, r, 2) for r in range(2)]
    assert shards[1]["state"]["moe.w2"]["momentum_buffer" if kind == "sgd" else
                                        "exp_avg"].shape[0] == 2
    same(moec_torch.merge_optimizer_state_dicts(shards[::-1]), whole)
    # EP groups inside data parallelism: the same experts twice merge once.
    same(moec_torch.merge_optimizer_state_dicts(shards + shards), whole)
    # A merged state loads into the one-process optimizer: the same state.
    target = make("full", 3)
    again = optimizer(target, kind)
    moec_torch.load_optimizer_state_dict(target, again, moec_torch.merge_optimizer_state_dicts(
        shards))
    same(moec_torch.optimizer_state_dict(target, again), whole)


def test_the_shards_of_tp_ranks_merge():
    net, opt = trained(tp=2)
    whole = moec_torch.optimizer_state_dict(net, opt)
    shards = [cut(whole, e, 2, (t, 2)) for e in range(2) for t in range(2)]
    assert shards[1]["shapes"]["moe.w1"][2] == net.moe.inter  # half of 2I
    same(moec_torch.merge_optimizer_state_dicts(shards[::-1]), whole)


def test_refusals_name_what_is_wrong_and_leave_the_optimizer_alone():
    net, opt = trained()
    whole = moec_torch.optimizer_state_dict(net, opt)
    shards = [cut(whole, r, 2) for r in range(2)]

    def merge_refused(shards, message):
        with pytest.raises(ValueError, match=message):
            moec_torch.merge_optimizer_state_dicts(shards)

    merge_refused([], "give the optimizer state dicts")
    merge_refused([shards[0], opt.state_dict()], "shard 1 is not an optimizer_state_dict's")
    merge_refused([shards[1]], r"\(state 'momentum_buffer'\): no shard holds expert 0 of "
                  r"'moe.w1'")
    other = cut(whole, 1, 2)
    other["param_groups"] = [dict(g, lr=0.5) for g in other["param_groups"]]
    merge_refused([shards[0], other], "shard 1's param_groups are not shard 0's")
    other = cut(whole, 1, 2)
    other["state"]["inp.weight"] = {"momentum_buffer": torch.zeros(64, 64)}
    merge_refused([shards[0], other], "state 'momentum_buffer' of 'inp.weight' differs between "
                  "shard 0 and shard 1: the state of a replicated parameter")
    other = cut(whole, 1, 2)
    other["state"]["moe.w1"] = {"momentum_buffer": torch.zeros(3)}
    merge_refused([shards[0], other], "state 'momentum_buffer' of 'moe.w1' has the parameter's "
                  "shape in shard 0, not in shard 1")
    other = cut(whole, 1, 2)
    del other["state"]["inp.bias"]
    merge_refused([shards[0], other], "state 'momentum_buffer' of 'inp.bias' is in some "
                  "shards, not in shard 1")
    other = cut(whole, 0, 2)
    other["layers"]["moe."] = dict(other["layers"]["moe."], hidden=32)
    merge_refused([other, shards[1]], "the layout of layer 'moe.': shard 1's hidden is 64, "
                  "shard 0's 32")
    other = cut(whole, 1, 2)
    other["layers"]["moe."] = {k: v for k, v in other["layers"]["moe."].items()
                               if k != "first_expert"}
    merge_refused([shards[0], other], r"the layout of layer 'moe.': shard 1's layout has no "
                  r"integer \['first_expert'\] \(a damaged checkpoint\)")
    bad = dict(whole, layers={"moe.": dict(whole["layers"]["moe."])})
    bad["layers"]["moe."].pop("local_experts")

    before = opt.state_dict()
    before = {i: {k: v.clone() for k, v in s.items()} for i, s in before["state"].items()}

    def load_refused(state, message, model=net, optim=opt):
        with pytest.raises(ValueError, match=message):
            moec_torch.load_optimizer_state_dict(model, optim, state)
        got = opt.state_dict()["state"]
        assert all(torch.equal(got[i][k], v) for i, s in before.items() for k, v in s.items())

    load_refused(opt.state_dict(), "the state is not an optimizer_state_dict's")
    # Damaged files: each part of the wrong kind, refused by name.
    for damaged, part in (
            (dict(whole, state={"moe.w1": [1]}), "its state of 'moe.w1'"),
            (dict(whole, param_groups=[5]), "its parameter group 0"),
            (dict(whole, param_groups=[dict(whole["param_groups"][0], params=[0])]),
             "its parameter group 0"),
            (dict(whole, layers={"moe.": "x"}), "its layout of 'moe.'"),
            (dict(whole, shapes={"moe.w1": [4.0, 64]}), "its shape of 'moe.w1'")):
        load_refused(damaged, f"the state is damaged: {part} is not what "
                     "optimizer_state_dict writes")
        merge_refused([damaged], f"shard 0 is damaged: {part}")
    load_refused(shards[1], r"the checkpoint holds experts 2..3 of 4; this layer \(rank 0\) "
                 "holds experts 0..3")
    one = dict(whole, param_groups=[dict(whole["param_groups"][0], params=whole[
        "param_groups"][0]["params"] + whole["param_groups"][1]["params"])])
    load_refused(one, "the state has 1 parameter groups, the optimizer 2")
    swapped = dict(whole, param_groups=whole["param_groups"][::-1])
    load_refused(swapped, "'inp.bias' is in the optimizer's parameter group 0 only")
    wide = dict(whole, state=dict(whole["state"], **{
        "inp.weight": {"momentum_buffer": torch.zeros(64, 32)}}),
        shapes=dict(whole["shapes"], **{"inp.weight": [64, 32]}))
    load_refused(wide, r"state 'momentum_buffer' of 'inp.weight' has shape \[64, 32\]; the "
                 r"parameter's is \[64, 64\]")
    load_refused(dict(whole, layers={}), "the state has no layout of layer 'moe.'")
    load_refused(dict(whole, state=dict(whole["state"], stray={})),
                 "the state holds 'stray', which is not among the optimizer's parameters")
    load_refused(bad, r"the layout of layer 'moe.' is not a moec MoeFFN checkpoint's: its "
                 r"layout lacks \['local_experts'\]")
    lora = make("lora", 0)
    lora_opt = optimizer(lora, "sgd")
    step(lora, lora_opt, 1)
    lora_state = moec_torch.optimizer_state_dict(lora, lora_opt)
    load_refused(lora_state, "'moe.w1' is in the optimizer's parameter group 1 only")
    # A parameter the model does not hold.
    stray = torch.optim.SGD([torch.nn.Parameter(torch.zeros(5))], lr=1)
    with pytest.raises(ValueError, match=r"the optimizer's parameter 0 \(shape \[5\]\) is not "
                       "one of the model's"):
        moec_torch.optimizer_state_dict(net, stray)


def test_a_layer_registered_twice_is_named_by_the_layer():
    net, opt = trained()
    net.alias = torch.nn.Module()
    net.alias.register_parameter("w", net.moe.w1)
    state = moec_torch.optimizer_state_dict(net, opt)
    assert "moe.w1" in state["state"] and "alias.w" not in state["state"]
