"""moec_torch.hf under mpirun or torchrun (one rank per process), run by
test_mpi.py and test_torchrun.py:

    mpirun -np R python3 mpi_hf_check.py FAMILY LAYOUT WORKDIR [FORM]

Every process builds the same stand-in model (same seed), patches it (MPI
fabric: it holds only its experts) and passes its share of the batch, a
different number of tokens on each rank. Checked on each rank, against the
unpatched model run on the whole batch in the same process: its logits, the
gradients of its inputs and of the non-expert parameters it owns, and its
experts' gradients (which gather every rank's tokens). FORM "parameters"
(fused experts): the adapters in PEFT's target_parameters form, against
PEFT's ParamWrapper on the fused model; else per-expert modules, against
PEFT's LoRA on the model with per-expert modules. Then: load_experts
reads only this process's experts (and, for qwen3_moe, takes a GPTQ
checkpoint's codes as they are); save_adapters writes one PEFT file;
save_pretrained writes one checkpoint that the unpatched model loads (rank 0
checks it)."""

import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launcher  # noqa: E402
import moec_torch  # noqa: E402
import moec_torch.hf as mhf  # noqa: E402
from moec_torch import hf_lora, hf_models, safetensors  # noqa: E402
from test_hf import (as_modules, close, grad_or_zero, make_model, tokens,  # noqa: E402
                     write_checkpoint, write_int_checkpoint)


def main():
    family, layout, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    form = sys.argv[4] if len(sys.argv) > 4 else "modules"
    launcher.fabric()  # under torchrun: torch.distributed before the model is patched
    torch.set_num_threads(1)
    ref = make_model(family, layout)
    model = copy.deepcopy(ref)
    targets = dict(lora_target_parameters=["gate_up_proj", "down_proj"]) \
        if form == "parameters" else {}
    mhf.patch_model(model, threads=1, lora_rank=4, lora_alpha=8, **targets)
    layer = mhf._patched(model)[0][2].layer
    rank, ranks = layer.first_rank, layer.ranks
    assert layer.local_ranks == 1 and layer.fabric in ("mpi", "group")
    # Adapters away from zero, the same on every process (a seeded draw of
    # the whole, of which each keeps its experts), so that they take part.
    torch.manual_seed(11)
    for _, _, ex in mhf._patched(model):
        for name, mask in ex._masks.items():
            p = getattr(ex.layer, name)
            whole = torch.randn(ex.layer.experts, *p.shape[1:]) * 0.05
            with torch.no_grad():
                p.copy_(whole[rank * p.shape[0]:(rank + 1) * p.shape[0]] * mask)
    mhf.save_adapters(model, work / "start")
    ref = ref if form == "parameters" else as_modules(ref)
    hf_lora.load_lora(ref, work / "start")
    # 3 sequences of 7 tokens each for rank 0, 2 for rank 1, ...
    ids = tokens(n_batch=sum(3 - r % 2 for r in range(ranks)), n_seq=7)
    first = sum(3 - r % 2 for r in range(rank))
    mine = ids[first:first + 3 - rank % 2]
    out = model(mine)
    want = ref(ids)
    close(out.logits, want.logits[first:first + len(mine)], 1e-5, f"rank {rank} logits")
    g = torch.randn(want.logits.shape, generator=torch.Generator().manual_seed(2))
    out.logits.backward(g[first:first + len(mine)])
    want.logits.backward(g)
    grads = {k: grad_or_zero(p) for k, p in hf_lora.lora_state_dict(ref).items()}
    if form == "parameters":
        # this process's experts' rows of lora_A and columns of lora_B
        grads = mhf._unstacked({k: (g, None) for k, g in grads.items()},
                               mhf._patched(model), work)
        grads = {k: g for k, (g, _) in grads.items()}
    for name, _, experts in mhf._patched(model):
        for key, p, j, (rows, cols) in mhf._adapter_tensors(name, experts):
            close(p.grad[j][rows, cols].t(), grads[key], 1e-5, f"rank {rank} {key}")
    # checkpoints in: only this process's experts are read
    if rank == 0:
        write_checkpoint(ref_base(family, layout), work / "ckpt")
    mhf.barrier(model)
    other = make_model(family, layout, seed=5)
    mhf.patch_model(other, threads=1)
    read = mhf.load_experts(other, work / "ckpt")
    local = range(rank * layer.local_experts, (rank + 1) * layer.local_experts)
    if family == "qwen3_5_moe_text":  # every process reads its experts' slices of the fused ones
        assert sorted(read) == sorted(n for n in hf_models.checkpoint_state_dict(ref_base(
            family, layout)) if ".experts." in n), read
        fused_checkpoints(model, work, rank)
        return
    assert read and all(int(k.split(".experts.")[1].split(".")[0]) in local for k in read), read
    if family == "qwen3_moe" and form == "modules":
        gptq_experts(rank, model, work / "gptq")
    # adapters out: one file, PEFT's names
    mhf.save_adapters(model, work / "adapter")
    if rank == 0:
        names = safetensors.load_file(work / "adapter/adapter_model.safetensors")
        if form == "parameters":  # every expert's in one tensor of each adapter
            assert sorted(names) == sorted(hf_lora.lora_state_dict(ref)), sorted(names)
        else:
            assert len({k.split(".experts.")[1].split(".")[0] for k in names}) == layer.experts
        assert sorted(p.name for p in (work / "adapter").iterdir()) == \
            ["adapter_config.json", "adapter_model.safetensors"]
    # merged checkpoint out: one folder, loaded by the unpatched model
    mhf.save_pretrained(model, work / "merged", max_shard_size=20_000)
    if rank == 0:
        index = json.loads((work / "merged/model.safetensors.index.json").read_text())
        fresh = hf_models.model_from_config(hf_models.config_from_pretrained(work / "merged"))
        ckpt = safetensors.Checkpoint(work / "merged")
        assert set(ckpt.keys()) == set(index["weight_map"])
        hf_models.load_checkpoint_state_dict(fresh, {k: ckpt.get_tensor(k)
                                                     for k in ckpt.keys()})
        with torch.no_grad():
            close(fresh(ids).logits, ref(ids).logits, 1e-5, "merged checkpoint")
    mhf.barrier(model)
    print(f"rank {rank}: hf ok", flush=True)
    launcher.finish()


def fused_checkpoints(model, work, rank):
    """A family whose checkpoints keep every expert of a block in one tensor
    (Qwen3.5-MoE): save_pretrained is refused, on every process, as no
    process holds them all."""
    try:
        mhf.save_pretrained(model, work / "merged")
    except ValueError as e:
        assert "keep each block's experts in one tensor" in str(e), e
    else:
        raise AssertionError("save_pretrained wrote fused experts no process holds whole")
    assert not (work / "merged").exists()
    mhf.barrier(model)
    print(f"rank {rank}: hf ok", flush=True)
    launcher.finish()


def gptq_experts(rank, model, folder):
    """A 4-bit GPTQ checkpoint into int4_g32 layers: each process takes its
    own experts' codes as they are (AutoGPTQ's values bit for bit)."""
    sizes = dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=64)
    src = make_model("qwen3_moe", **sizes)
    if rank == 0:
        write_int_checkpoint(src, folder, sym=False)
    mhf.barrier(model)
    _, judge = write_int_checkpoint(src, folder.with_name("gptq-" + str(rank)), sym=False)
    held = make_model("qwen3_moe", seed=5, **sizes)
    mhf.patch_model(held, threads=1, frozen=True, weight_format="int4_g32_zp")
    mhf.load_checkpoint(held, folder)
    layer = held.model.layers[1].mlp.experts.layer
    w1, w2 = layer.dequantized_weights()
    for j, e in enumerate(range(rank * layer.local_experts, (rank + 1) * layer.local_experts)):
        key = f"model.layers.1.mlp.experts.{e}.{{}}_proj.weight"
        assert torch.equal(w1[j], torch.cat((judge[key.format("gate")],
                                             judge[key.format("up")]))), (rank, e)
        assert torch.equal(w2[j], judge[key.format("down")]), (rank, e)


def ref_base(family, layout):
    return make_model(family, layout)


if __name__ == "__main__":
    main()
