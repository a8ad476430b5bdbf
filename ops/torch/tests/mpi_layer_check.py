"""Run under mpirun or torchrun (by test_mpi.py, test_torchrun.py): the moec
op with one rank per process, on the MPI fabric or over torch.distributed.

Every process draws the same global inputs from a seed and keeps its rank's
share: x, topk_ids, topk_weights [S, ...] and its L experts' w1, w2. It runs
forward and backward with MoeFFN(fabric="mpi" or "group") and checks its outputs:

  - against plain PyTorch autograd (moec_torch.reference) in float64 on the
    global inputs, its rank's slice, within 1e-4 (fp32) or 3e-2 (bf16) of
    the output's scale;
  - bit for bit against the one-process op (MoeFFN(ranks=R), in-process
    fabric) on the same global inputs, in this same process.

Then the same forward and backward through submit_forward / submit_backward
(bit for bit), and checkpoints (check_checkpoints). Prints "rank r: ok ..." and exits 0, or says what differs and exits 1.

    mpirun -np R python3 mpi_layer_check.py [fp32|bf16] [SEED] [HOT] [VARIANT] [TP]
    torchrun --nproc_per_node R --tee 2 --redirects 2 --log_dir DIR \
        mpi_layer_check.py [...]

VARIANT: full (the default); frozen (frozen=True: no weight gradients; full
and frozen then run one more pass with the weights' requires_grad turned
the other way, which switches every rank's graphs);
main_grad (main_grad=True: the weight gradients of two steps accumulated in
w.main_grad); lora (LoRA adapters of rank 4 on w1 and w2, nonzero B, base
frozen: the adapters' gradients are checked; with TP > 1 each process holds
its TP rank's columns of w1's B and rows of w2's A, and the gradients of
w1's A and w2's B are summed over the TP ranks); fp8 (dispatch_dtype fp8_e4m3:
autograd runs on x rounded as the experts receive it); a weight format
(moec_torch.quant.WEIGHT_FORMATS: the base weights stored quantized, with
LoRA adapters as for lora; autograd runs on the dequantized weights; H 256
and I 128 a TP rank, whole blocks and groups); frozen_<weight format> (the
same without adapters, frozen: with TP > 1, each process holds its TP
rank's part of the whole experts' codes and scales, and the processes'
state dicts merge into the one-process layer's).

TP (default 1): expert tensor parallelism, R = EP x TP processes; process r
is EP rank r // TP and holds TP slice r % TP of its experts (gate and up
columns of w1, rows of w2), compared with that slice of the one-process
layer's whole experts.
"""

import os
import sys
from pathlib import Path

import torch

import launcher
import moec_torch
from moec_torch import quant, reference


def routing(ranks, tokens, experts, top_k, g, hot):
    scores = torch.rand(ranks * tokens, experts, generator=g)
    if hot >= 0:
        scores[:, hot] = 2.0
    ids = scores.argsort(dim=1, descending=True)[:, :top_k]
    weights = torch.rand(ranks * tokens, top_k, generator=g) * 0.8 + 0.2
    return ids.view(ranks, tokens, top_k), weights.view(ranks, tokens, top_k)


def main():
    dtype = sys.argv[1] if len(sys.argv) > 1 else "fp32"
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    hot = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    variant = sys.argv[4] if len(sys.argv) > 4 else "full"
    tp = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    form = variant[len("frozen_"):] if variant.startswith("frozen_") else variant
    quantized = form in quant.WEIGHT_FORMATS
    dense = {"full": {}, "frozen": {"frozen": True}, "main_grad": {"main_grad": True},
             "lora": {"lora_rank": 4, "lora_alpha": 8},
             "fp8": {"dispatch_dtype": "fp8_e4m3"}}
    options = dense[variant] if variant in dense else \
        {"frozen": True, "weight_format": form} if form != variant else \
        {"lora_rank": 4, "lora_alpha": 8, "weight_format": variant}
    torch.set_num_threads(1)
    cfg = {"name": "mpi-check", "hidden_size": 64, "intermediate_size": 32,
           "num_experts": 0, "top_k": 2, "ep": 1, "tp": 1, "seq_size": 128,
           "dtype": dtype, "capacity_factor": 4}
    if quantized:
        cfg.update(hidden_size=256, intermediate_size=128 * tp)
    torch.manual_seed(seed)
    layer = moec_torch.MoeFFN(dict(cfg, num_experts=2 * launcher.processes() // tp),
                              tp=tp, threads=1, fabric=launcher.fabric(), **options)
    R, r, L, S = layer.ranks, layer.first_rank, layer.local_experts, layer.tokens
    E, H = layer.experts, layer.hidden
    torch.manual_seed(seed)
    single = moec_torch.MoeFFN(dict(cfg, num_experts=E), R, tp=tp, threads=1,
                               fabric="inproc", **options)

    me = r * tp + (layer.tp_rank or 0)  # the process's rank in the [ep, tp] mesh
    # The op library's all_gather (the adapters' gradient exchange): every
    # process's tensor, in mesh rank order.
    gathered = layer.layer.all_gather(torch.tensor([me, 10 * me], dtype=torch.float64))
    order = torch.arange(launcher.processes(), dtype=torch.float64)
    assert torch.equal(gathered, torch.stack((order, 10 * order), 1)), gathered

    def share(name, whole):
        """This process's part of a whole-layer tensor of `name`'s kind: its
        EP rank's experts, and of w1, w2 (and their gradients) and of w1's B
        and w2's A its TP slice."""
        part = whole[r * L:(r + 1) * L]
        kind = {"dw1": "w1", "dw2": "w2"}.get(name, name)
        if kind in ("w1_scale", "w2_scale"):
            return layer._tp_part(kind, None, part)[1]
        return layer._tp_part(kind, part)[0]  # w1, w2, the adapters split by TP

    # Same seed, same draws: the MPI layer holds the single layer's experts.
    assert torch.equal(layer.w1, share("w1", single.w1)), "initial w1 differs"
    assert torch.equal(layer.w2, share("w2", single.w2)), "initial w2 differs"
    if quantized:
        for name in ("w1_scale", "w2_scale"):
            assert torch.equal(getattr(layer, name), share(name, getattr(single, name))), \
                f"initial {name} differs"
    names = [f"{t}_lora_{m}" for t in layer.lora_targets for m in "AB"]
    for name, mine, whole in zip(names, layer.adapters(), single.adapters()):
        assert torch.equal(mine, share(name, whole)), f"initial {name} differs"
    if "lora_rank" in options:
        # Nonzero B (a fresh one is zero), the same global values in both.
        ga = torch.Generator().manual_seed(seed + 2)
        with torch.no_grad():
            for name, mine, whole in zip(names, layer.adapters(), single.adapters()):
                whole.copy_(((torch.rand(whole.shape, generator=ga) * 2 - 1) * 0.5)
                            .to(whole.dtype))
                mine.copy_(share(name, whole))

    g = torch.Generator().manual_seed(seed + 1)
    tdt = layer.dtype
    x = (torch.rand(R, S, H, generator=g) * 2 - 1).to(tdt)
    ids, weights = routing(R, S, E, 2, g, hot)
    dy = (torch.rand(R, S, H, generator=g) * 2 - 1).to(tdt)

    def run(module, xs, idss, ws, dys):
        xs = xs.clone().requires_grad_()
        ws = ws.clone().requires_grad_()
        module.zero_grad()
        y = module(xs, idss, ws)
        y.backward(dys)
        out = {"y": y.detach(), "dx": xs.grad, "dtopk_weights": ws.grad}
        if variant == "main_grad":
            # A second micro-batch adds into the same fp32 buffers.
            module(xs.detach(), idss, ws.detach()).backward(dys)
            out.update(dw1=module.w1.main_grad, dw2=module.w2.main_grad)
        elif variant in ("full", "fp8"):
            out.update(dw1=module.w1.grad, dw2=module.w2.grad)
        for name, p in zip(names, module.adapters()):
            out[name] = p.grad
        return out

    got = run(layer, x[r], ids[r], weights[r], dy[r])     # this rank, [S, H]
    whole = run(single, x, ids, weights, dy)              # all ranks, [R, S, H]
    mine = {"y": whole["y"][r], "dx": whole["dx"][r], "dtopk_weights": whole["dtopk_weights"][r]}
    for n in [k for k in got if k.startswith("dw") or k in names]:
        mine[n] = share(n, whole[n])
    failed = [n for n in got if not torch.equal(got[n], mine[n])]

    # FP8 dispatch: autograd runs on x as the experts receive it.
    xd = (reference.fp8_round_rows(x) if variant == "fp8" else x).double().requires_grad_()
    wd = weights.double().requires_grad_()
    w1, w2 = single.w1.detach(), single.w2.detach()
    if quantized:  # the values the layer computes with, as [E, H, 2I], [E, I, H]
        w1, w2 = (w.transpose(1, 2) for w in single.dequantized_weights())
    w1 = w1.double().requires_grad_()
    w2 = w2.double().requires_grad_()
    adapters = [p.detach().double().requires_grad_() for p in single.adapters()]
    lora = {t: tuple(adapters[2 * i:2 * i + 2]) for i, t in enumerate(single.lora_targets)}
    yd = reference.moe_ffn(xd, ids, wd, w1, w2, lora, single.lora_scaling)
    yd.backward(dy.double())
    steps = 2 if variant == "main_grad" else 1
    want = {"y": yd[r], "dx": xd.grad[r], "dtopk_weights": wd.grad[r]}
    if variant in ("full", "main_grad", "fp8"):
        want.update(dw1=steps * share("dw1", w1.grad), dw2=steps * share("dw2", w2.grad))
    for name, a in zip(names, adapters):
        want[name] = share(name, a.grad)
    tol = 1e-4 if dtype == "fp32" else 3e-2
    errors = {}
    for n in got:
        scale = want[n].abs().max().item() or 1.0
        errors[n] = (got[n].double() - want[n]).abs().max().item() / scale
    over = [n for n, e in errors.items() if not e <= tol]
    text = ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
    if failed or over:
        print(f"rank {me}: FAILED: not bitwise equal to the one-process op: {failed}; "
              f"over {tol}: {over} ({text})", flush=True)
        return 1
    if variant in ("full", "frozen"):
        # The weights' requires_grad turned the other way: every rank runs
        # the other graphs from the next pass, dx the same bits.
        trains = variant == "frozen"
        layer.requires_grad_(trains)
        layer.w1.grad = layer.w2.grad = None
        xs = x[r].clone().requires_grad_()
        layer(xs, ids[r], weights[r]).backward(dy[r])
        if bool(layer.layer.info()["frozen"]) == trains or (layer.w1.grad is None) == trains \
                or not torch.equal(xs.grad, got["dx"]):
            print(f"rank {me}: FAILED: with requires_grad {trains} the layer ran "
                  f"{'frozen' if layer.layer.info()['frozen'] else 'trained'} graphs, w1.grad "
                  f"{'set' if layer.w1.grad is not None else 'None'}, dx "
                  f"{'equal' if torch.equal(xs.grad, got['dx']) else 'different'}", flush=True)
            return 1
        layer.requires_grad_(not trains)
    # The asynchronous calls under MPI: the same bits.
    with torch.no_grad():
        handle = layer.submit_forward(x[r], ids[r], weights[r])
        if not torch.equal(handle.wait(), got["y"]):
            failed.append("y of submit_forward")
        if variant != "main_grad":  # (its buffers hold two steps' sums by now)
            grads = layer.submit_backward(handle, dy[r]).wait()
            if not torch.equal(grads.dx, got["dx"]):
                failed.append("dx of submit_backward")
            failed += [f"{n} of submit_backward" for n, g in zip(names, grads.adapters)
                       if not torch.equal(g, got[n])]
    if failed:
        print(f"rank {me}: FAILED: the asynchronous calls differ: {failed}", flush=True)
        return 1
    problem = check_checkpoints(layer, single, cfg, options, seed, share)
    if problem:
        print(f"rank {me}: FAILED: checkpoint: {problem}", flush=True)
        return 1
    print(f"rank {me}: ok: bitwise equal to the one-process op; against PyTorch autograd: {text}; "
          "checkpoints round-trip", flush=True)
    launcher.finish()
    return 0


def check_checkpoints(layer, single, cfg, options, seed, share):
    """Checkpoints under MPI (collective: every rank runs it): the rank's
    state_dict loads bit for bit into a fresh layer; the one-process layer's
    whole checkpoint loads as this rank's experts; another rank's shard is
    refused; with TP the processes' state dicts merge into the one-process
    layer's; LoRA adapters go through save_adapters / load_adapters (rank
    files in a shared folder; with a TP rank per process save_adapters is
    refused and the one-process layer's adapters load as this rank's part). Returns what failed, or None."""
    r, L = layer.first_rank, layer.local_experts
    cfg = dict(cfg, num_experts=layer.experts)

    def fresh():
        torch.manual_seed(seed + 11)  # other initial weights
        return moec_torch.MoeFFN(cfg, tp=layer.tp, threads=1, fabric=launcher.fabric(),
                                 **options)

    mine = layer.state_dict()
    other = fresh()
    other.load_state_dict(mine)
    for (name, p), (_, q) in zip(layer.named_parameters(), other.named_parameters()):
        if not torch.equal(p, q):
            return f"{name} differs after a round trip of the rank's state_dict"
    if layer.main_grad and not torch.equal(layer.w1.main_grad, other.w1.main_grad):
        return "main_grad of w1 differs after a round trip"
    other = fresh()
    other.load_state_dict(single.state_dict())
    for (name, p), (_, q) in zip(other.named_parameters(), single.named_parameters()):
        if not torch.equal(p, share(name, q)):
            return f"{name} is not rank {r}'s slice of the one-process checkpoint"
    if layer.ranks > 1:
        shard = dict(mine)
        peer = (r + 1) % layer.ranks
        shard["_extra_state"] = dict(mine["_extra_state"], layout=dict(
            mine["_extra_state"]["layout"], first_expert=peer * L))
        before = other.w1.clone()
        try:
            other.load_state_dict(shard)
            return "another rank's shard was loaded"
        except ValueError as e:
            if f"this layer (rank {r})" not in str(e) or not torch.equal(before, other.w1):
                return f"another rank's shard: {e}"
    if layer.tp > 1 and (layer.weights_transposed or layer.lora_rank):
        # The processes' state dicts put together: the one-process layer's.
        folder = Path(os.environ["MOEC_CACHE_DIR"]) / f"shards-{seed}-{layer.ranks}-{layer.tp}"
        folder.mkdir(parents=True, exist_ok=True)
        me = r * layer.tp + layer.tp_rank
        torch.save(mine, folder / f"state-{me}.pt")
        other = fresh()
        other(torch.zeros(layer.tokens, layer.hidden, dtype=layer.dtype),
              torch.zeros(layer.tokens, 2, dtype=torch.long) + torch.tensor([0, 1]),
              torch.ones(layer.tokens, 2))  # collective: every rank has written its file
        merged = moec_torch.merge_state_dicts(
            [torch.load(folder / f"state-{k}.pt", weights_only=True)
             for k in range(layer.ranks * layer.tp)])
        for name, q in single.state_dict().items():
            if isinstance(q, torch.Tensor) and not torch.equal(merged[name], q):
                return f"{name} of the merged state dicts is not the one-process layer's"
    if layer.lora_rank:
        folder = Path(os.environ["MOEC_CACHE_DIR"]) / f"adapters-{seed}-{layer.ranks}-{layer.tp}"
        if layer.tp_rank is None:
            layer.save_adapters(folder)
        else:
            # A TP rank holds parts of the adapters: refused; the whole
            # layer's adapters (written by one process) load as its part.
            try:
                layer.save_adapters(folder)
                return "save_adapters wrote a TP rank's parts"
            except ValueError as e:
                if "save_adapters with a TP rank per process" not in str(e):
                    return f"save_adapters: {e}"
            if r == 0 and layer.tp_rank == 0:
                single.save_adapters(folder)
        other = fresh()
        other(torch.zeros(layer.tokens, layer.hidden, dtype=layer.dtype),
              torch.zeros(layer.tokens, 2, dtype=torch.long) + torch.tensor([0, 1]),
              torch.ones(layer.tokens, 2))  # collective: every rank has written its file
        other.load_adapters(folder)
        for p, q in zip(layer.adapters(), other.adapters()):
            if not torch.equal(p, q):
                return "the adapters differ after save_adapters / load_adapters"
    return None


if __name__ == "__main__":
    sys.exit(main())
