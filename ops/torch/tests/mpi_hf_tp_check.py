"""moec_torch.hf with expert tensor parallelism, one rank per process, run
by test_mpi.py:

    mpirun -np 4 python3 mpi_hf_tp_check.py FAMILY LAYOUT WORKDIR

patch_model(tp=2) on 4 processes: an [ep 2, tp 2] mesh, process r EP rank
r // 2 and TP rank r % 2. The two TP ranks of an EP rank pass the same
tokens (the EP rank's share of the batch). Checked on each process against
the unpatched model run on the whole batch: its logits, and the gradients
of the experts it holds, its slice of their columns (gate's and up's rows
t I/2 .. (t+1) I/2 - 1, down's columns). Then load_experts fills a freshly
patched model with the same slices (the same logits bit for bit), the
processes' state dicts put together by moec_torch.merge_state_dicts load
into the model patched in one process (the same logits), and
save_pretrained refuses, saying how to write the checkpoint. Then the
experts held in int8: each process's TP part of its experts quantized
whole gives the logits of the model patched in one process in int8,
load_experts reads the same parts, and quantize_weights("int8") is refused
(a row scale of w2 spans the TP ranks). Then LoRA adapters: those of a model
patched in one process load as each process's part and give its logits and
adapter gradients; save_adapters refuses."""

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launcher  # noqa: E402
import moec_torch  # noqa: E402
import moec_torch.hf as mhf  # noqa: E402
from test_hf import close, expert_grads, make_model, tokens, write_checkpoint  # noqa: E402


def main():
    family, layout, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    launcher.fabric()
    torch.set_num_threads(1)
    ref = make_model(family, layout)
    model = copy.deepcopy(ref)
    mhf.patch_model(model, threads=1, tp=2)
    name0, _, experts0 = mhf._patched(model)[0]
    layer = experts0.layer
    assert (layer.ranks, layer.tp) == (2, 2) and layer.tp_rank is not None
    ep, t = layer.first_rank, layer.tp_rank
    ids = tokens(n_batch=4, n_seq=7)
    mine = ids[2 * ep:2 * ep + 2]   # the EP rank's share, the same on its TP ranks
    out = model(mine)
    want = ref(ids)
    close(out.logits, want.logits[2 * ep:2 * ep + 2], 1e-5, f"ep {ep} tp {t} logits")
    g = torch.randn(want.logits.shape, generator=torch.Generator().manual_seed(2))
    out.logits.backward(g[2 * ep:2 * ep + 2])
    want.logits.backward(g)
    grads = expert_grads(ref, family)   # {(block, e): (dW1 [H, 2I], dW2 [I, H])}
    i = layer.local_inter
    for name, _, experts in mhf._patched(model):
        lay = experts.layer
        for j, e in enumerate(mhf._local_experts(lay)):
            d1, d2 = grads[name, e]
            inter = d1.shape[1] // 2
            want1 = torch.cat((d1[:, t * i:(t + 1) * i], d1[:, inter + t * i:inter + (t + 1) * i]),
                              1)
            close(lay.w1.grad[j], want1, 1e-5, f"ep {ep} tp {t} {name} expert {e} dW1")
            close(lay.w2.grad[j], d2[t * i:(t + 1) * i], 1e-5,
                  f"ep {ep} tp {t} {name} expert {e} dW2")
    # load_experts: each process reads its experts' slices
    if layer.first_rank == 0 and t == 0:
        write_checkpoint(ref, work / "ckpt")
    mhf.barrier(model)
    other = make_model(family, layout, seed=5)
    mhf.patch_model(other, threads=1, tp=2)
    mhf.load_experts(other, work / "ckpt")
    fresh = copy.deepcopy(ref)
    mhf.patch_model(fresh, threads=1, tp=2)
    with torch.no_grad():
        for (_, _, a), (_, _, b) in zip(mhf._patched(other), mhf._patched(fresh)):
            assert torch.equal(a.layer.w1, b.layer.w1) and torch.equal(a.layer.w2, b.layer.w2)
    # the processes' state dicts, put together, load into a one-process model
    torch.save(model.state_dict(), work / f"state-{ep}-{t}.pt")
    mhf.barrier(model)
    if ep == 0 and t == 0:
        whole = moec_torch.merge_state_dicts(
            [torch.load(work / f"state-{p}-{q}.pt", weights_only=True)
             for p in range(2) for q in range(2)])
        one = make_model(family, layout, seed=9)
        mhf.patch_model(one, ranks=1, threads=1, fabric="inproc")
        one.load_state_dict(whole)
        with torch.no_grad():
            close(one(ids).logits, ref(ids).logits, 1e-5, "merged state dicts")
    try:
        mhf.save_pretrained(model, work / "merged")
        raise SystemExit("save_pretrained wrote a checkpoint of column slices")
    except ValueError as e:
        assert "with expert tensor parallelism (tp=2)" in str(e) and \
            "merge_state_dicts" in str(e), e
    mhf.barrier(model)
    # Quantized experts (int8): each process quantizes its experts whole and
    # keeps its TP rank's part, and load_experts reads the same parts; the
    # logits are those of the model patched in one process (tp=1) in int8.
    quantized = copy.deepcopy(ref)
    mhf.patch_model(quantized, threads=1, tp=2, frozen=True, weight_format="int8")
    one = copy.deepcopy(ref)
    mhf.patch_model(one, ranks=1, threads=1, fabric="inproc", frozen=True,
                    weight_format="int8")
    with torch.no_grad():
        close(quantized(mine).logits, one(ids).logits[2 * ep:2 * ep + 2], 1e-5,
              f"ep {ep} tp {t} int8 logits")
        loaded = make_model(family, layout, seed=5)
        mhf.patch_model(loaded, threads=1, tp=2, frozen=True, weight_format="int8")
        mhf.load_experts(loaded, work / "ckpt")
        for (_, _, a), (_, _, b) in zip(mhf._patched(loaded), mhf._patched(quantized)):
            for n in ("w1", "w2", "w1_scale", "w2_scale"):
                assert torch.equal(getattr(a.layer, n), getattr(b.layer, n)), n
    try:
        quantized_layer = mhf._patched(model)[0][2].layer
        quantized_layer.quantize_weights("int8")
        raise SystemExit("quantize_weights('int8') ran on a TP rank's part")
    except ValueError as e:
        assert "an int8 row scale of w2 spans every TP rank's columns" in str(e), e
    mhf.barrier(model)
    # LoRA adapters with a TP rank per process: those of a model patched in
    # one process (B nonzero; written by one process with save_adapters)
    # load here as each process's part, and give that model's logits and,
    # the gradients of w1's A and w2's B summed over the TP ranks, its
    # adapters' gradients (this process's part); save_adapters is refused.
    lora = dict(lora_rank=4, lora_alpha=8)
    one = copy.deepcopy(ref)
    mhf.patch_model(one, ranks=1, threads=1, fabric="inproc", **lora)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for _, _, experts in mhf._patched(one):
            for n in experts.layer.adapter_names():
                p = getattr(experts.layer, n)
                p.copy_((torch.rand(p.shape, generator=gen) - 0.5) * experts._masks[n])
    if ep == 0 and t == 0:
        mhf.save_adapters(one, work / "lora")
    mhf.barrier(model)
    tuned = copy.deepcopy(ref)
    mhf.patch_model(tuned, threads=1, tp=2, **lora)
    mhf.load_adapters(tuned, work / "lora")
    out, want = tuned(mine), one(ids)
    close(out.logits, want.logits[2 * ep:2 * ep + 2], 1e-5, f"ep {ep} tp {t} LoRA logits")
    out.logits.backward(g[2 * ep:2 * ep + 2])
    want.logits.backward(g)
    for (name, _, a), (_, _, b) in zip(mhf._patched(tuned), mhf._patched(one)):
        lay = a.layer
        assert lay.tp_rank == t and lay.w1_lora_B.shape[2] == 2 * lay.local_inter
        first, count = lay.first_rank * lay.local_experts, lay.local_experts
        for n in lay.adapter_names():
            whole = getattr(b.layer, n)
            assert torch.equal(getattr(lay, n), lay._tp_part(n, whole[first:first + count])[0]), \
                f"ep {ep} tp {t} {name} {n} loaded"
            close(getattr(lay, n).grad, lay._tp_part(n, whole.grad[first:first + count])[0],
                  1e-5, f"ep {ep} tp {t} {name} {n} gradient")
    try:
        mhf.save_adapters(tuned, work / "lora-parts")
        raise SystemExit("save_adapters wrote a TP rank's parts")
    except ValueError as e:
        assert "save_adapters with expert tensor parallelism (tp=2" in str(e), e
    mhf.barrier(model)
    print(f"ep {ep} tp {t}: hf tp ok", flush=True)
    launcher.finish()


if __name__ == "__main__":
    main()
