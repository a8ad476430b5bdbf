"""LoRA fine-tuning of a Hugging Face-format MoE model with moec's layer, end
to end, against the same model with PEFT's LoRA in plain PyTorch.

    finetune.py make-checkpoint DIR     a small Qwen3-MoE checkpoint (config.json,
                                        safetensors shards, index), random weights
    finetune.py train DIR               patch the model, load the checkpoint, train
                                        LoRA adapters on a synthetic task beside the
                                        plain-PyTorch LoRA model, save the adapters
                                        and the merged checkpoint
    finetune.py check DIR               in a fresh process: reload the adapters and
                                        check the logits; load the merged checkpoint
                                        into the unpatched model and check them again

DIR holds ckpt/, adapter/, merged/ and probe.safetensors (the trained model's
logits on a probe batch). With --weight-format the experts are held
quantized and frozen under the adapters: fp8_block128 makes the checkpoint as
DeepSeek-V3 ships one (every linear weight of the layers but the router's as
F8_E4M3 codes with a weight_scale_inv per 128 x 128 block), whose experts the
layer takes as they are; int8 and int4_g* quantize the experts of the bf16 or
fp32 checkpoint as they load. The judge is then PEFT's LoRA on the
dequantized experts. Under torchrun (--nproc_per_node R) or mpirun
(-np R) `train` and `check` run one rank per process, each with its share
of the batch; make-checkpoint runs in one process. The model is moec_torch.hf_models' stand-in of transformers'
Qwen3MoeForCausalLM; with transformers installed, the same calls take
AutoModelForCausalLM.from_pretrained(...) (docs/hf.md).
"""

import argparse
import os
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ops/torch"))
import moec_torch  # noqa: E402
import moec_torch.hf as mhf  # noqa: E402
from moec_torch import hf_lora, hf_models, quant, safetensors  # noqa: E402

CONFIG = dict(model_type="qwen3_moe", vocab_size=96, hidden_size=64, intermediate_size=128,
              moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, initializer_range=0.1, tie_word_embeddings=False)


def world():
    """(rank, size) under torchrun or mpirun, else (0, 1)."""
    if moec_torch.launched_by_torchrun():
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return (int(os.environ.get("OMPI_COMM_WORLD_RANK", 0)),
            int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1)))


def log(*args):
    if world()[0] == 0:
        print(*args, flush=True)


def batch(step, args, vocab):
    """The synthetic task: each label is one of 8 tokens, a fixed function of its token."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(7))
    return ids, perm[ids % 8]


def loss_of(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             labels.reshape(-1), reduction="sum")


# The routed experts' weights in a Qwen3-MoE checkpoint.
EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(?:gate|up|down)_proj\.weight$")


def make_checkpoint(args):
    torch.manual_seed(args.seed)
    fp8 = args.weight_format == "fp8_block128"
    # A quantized layer's sizes are whole blocks or groups: H and the
    # experts' I 128 (then FP8 experts are copied as they are, docs/hf.md).
    config = hf_models.config_from_dict(
        dict(CONFIG, hidden_size=128, moe_intermediate_size=128) if args.weight_format
        else CONFIG)
    model = hf_models.model_from_config(config).to(args.torch_dtype)
    out = args.dir / "ckpt"
    out.mkdir(parents=True, exist_ok=True)
    config.torch_dtype = str(args.torch_dtype).replace("torch.", "")
    state = {k: v.detach().contiguous() for k, v in
             hf_models.checkpoint_state_dict(model).items()}
    dtypes = {}
    if fp8:  # as DeepSeek-V3: every linear weight of the layers but the router's
        config.quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
                                      "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
        for k in [k for k in state if k.startswith("model.layers.") and k.endswith(".weight")
                  and state[k].dim() == 2 and not k.endswith(".mlp.gate.weight")]:
            codes, scales = quant.quantize_fp8_blocks(state[k].float().unsqueeze(0))
            state[k], state[k + "_scale_inv"], dtypes[k] = codes[0], scales[0], "F8_E4M3"
    config.save_pretrained(out)
    safetensors.save_sharded(state, out, args.shard_bytes, dtypes=dtypes)
    log(f"checkpoint: {out} ({len(os.listdir(out))} files, {len(state)} tensors"
        + (f", {len(dtypes)} of them F8_E4M3 with a weight_scale_inv" if fp8 else "") + ")")


def judge_state(args):
    """The judge's weights: the checkpoint's, an FP8 tensor dequantized (as
    load_checkpoint does for a layer that is not fp8_block128), and with
    int8 or int4 experts each expert's weights what its codes stand for."""
    ckpt = safetensors.Checkpoint(args.dir / "ckpt")
    state = {}
    for k in ckpt.keys():
        if k.endswith("_scale_inv"):
            continue
        t = ckpt.get_tensor(k)
        if ckpt.dtype(k) == "F8_E4M3":
            t = quant.dequantize_fp8_blocks(t, ckpt.get_tensor(k + "_scale_inv"))
        if args.weight_format not in (None, "fp8_block128") and EXPERT.search(k):
            t = quant.dequantize(args.weight_format, *quant.quantize(args.weight_format, t))
        state[k] = t.to(args.torch_dtype)
    return state


def moec_layers(model):
    """The patched model's moec layers (each block's experts.layer)."""
    return [m.layer for m in model.modules() if isinstance(m, mhf.MoecExperts)]


def expert_bytes(model):
    """(bytes the patched model's experts take, codes and scales; bytes
    they would take in the layers' dtype)."""
    held = dense = 0
    for layer in moec_layers(model):
        held += sum(t.numel() * t.element_size() for t in
                    (layer.w1, layer.w2, getattr(layer, "w1_scale", None),
                     getattr(layer, "w2_scale", None)) if t is not None)
        dense += (layer.w1.shape[0] * 3 * layer.hidden * layer.inter
                  * torch.tensor([], dtype=layer.dtype).element_size())
    return held, dense


def load_model(args, lora=True):
    """The stand-in model from the checkpoint's config, its experts on the meta
    device, patched, filled from the checkpoint."""
    config = hf_models.config_from_pretrained(args.dir / "ckpt")
    config.experts_layout = args.layout
    model = hf_models.model_from_config(config).to(args.torch_dtype)
    for _, block, _ in mhf.find_blocks(model):
        block.experts.to(device="meta")
    kwargs = dict(lora_rank=args.rank, lora_alpha=2 * args.rank) if lora else {}
    if args.weight_format:
        ckpt = safetensors.Checkpoint(args.dir / "ckpt")
        fp8 = any(ckpt.dtype(k) == "F8_E4M3" for k in ckpt.keys())
        if (args.weight_format == "fp8_block128") != fp8:
            sys.exit(f"finetune: --weight-format {args.weight_format} on "
                     f"{'an FP8' if fp8 else 'a bf16 or fp32'} checkpoint: make the checkpoint "
                     "and train with the same --weight-format")
        kwargs["weight_format"] = args.weight_format
    if lora and args.lora_form == "parameters":
        kwargs["lora_target_parameters"] = ["gate_up_proj", "down_proj"]
    ranks = None if world()[1] > 1 else args.ranks
    mhf.patch_model(model, ranks=ranks, threads=args.threads, **kwargs)
    mhf.load_checkpoint(model, args.dir / "ckpt")
    return model


def my_rows(t):
    """This process's share of a batch's sequences (all of it in one process)."""
    rank, size = world()
    return t.chunk(size)[rank] if size > 1 else t


def train(args):
    rank, size = world()
    model = load_model(args)
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = [p for layer in moec_layers(model) for p in layer.adapters()]
    for p in adapters:
        p.requires_grad_(True)
    # The judge: the unpatched model with PEFT's LoRA, from the same start
    # (on the fused experts' parameters for --lora-form parameters).
    start = args.dir / "adapter-start"
    mhf.save_adapters(model, start)
    mhf.barrier(model)
    config = hf_models.config_from_pretrained(args.dir / "ckpt")
    if args.lora_form == "parameters":
        config.experts_layout = "fused"
    judge = hf_models.model_from_config(config)
    judge = judge.to(args.torch_dtype)
    hf_models.load_checkpoint_state_dict(judge, judge_state(args))
    hf_lora.load_lora(judge, start)
    judge_params = [p for p in judge.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(adapters, lr=args.lr)
    judge_opt = torch.optim.AdamW(judge_params, lr=args.lr)
    vocab = CONFIG["vocab_size"]
    if args.weight_format:
        held, dense = expert_bytes(model)
        log(f"experts ({args.weight_format}, this process): {held} bytes of codes and scales, "
            f"{held / dense:.3f} of {dense} in {args.dtype}")
    log(f"{'step':>4} {'moec loss':>10} {'PyTorch+LoRA loss':>18} {'moec s':>7} {'PyTorch s':>9}")
    first = last = None
    for step in range(args.steps):
        ids, labels = batch(step, args, vocab)
        n = labels.numel()
        t0 = time.perf_counter()
        loss = loss_of(model(my_rows(ids)).logits, my_rows(labels)) / n
        loss.backward()
        opt.step()
        opt.zero_grad()
        t1 = time.perf_counter()
        total = mhf.all_sum(model, loss.item())
        t2 = time.perf_counter()
        want = loss_of(judge(ids).logits, labels) / n
        want.backward()
        judge_opt.step()
        judge_opt.zero_grad()
        t3 = time.perf_counter()
        first = first if first is not None else total
        last = total
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            log(f"{step:4d} {total:10.5f} {want.item():18.5f} {t1 - t0:7.3f} {t3 - t2:9.3f}")
    log(f"loss {first:.4f} -> {last:.4f}")
    files = mhf.save_adapters(model, args.dir / "adapter")
    log("adapters:", ", ".join(str(f) for f in files))
    ids, _ = batch(-1, args, vocab)
    with torch.no_grad():
        probe = model(my_rows(ids)).logits.float()
    safetensors.save_file({"logits": probe.contiguous()},
                          args.dir / f"probe-{rank}-of-{size}.safetensors")
    files = mhf.save_pretrained(model, args.dir / "merged", max_shard_size=args.shard_bytes)
    log(f"merged checkpoint: {args.dir / 'merged'}")
    if last >= first:
        sys.exit("finetune: the loss did not fall")


def check(args):
    """A fresh process: the adapters reload onto a freshly patched model and
    give the probe's logits bit for bit; the merged checkpoint loads into
    the unpatched model and gives them within rounding."""
    rank, size = world()
    probe = safetensors.load_file(args.dir / f"probe-{rank}-of-{size}.safetensors")["logits"]
    vocab = CONFIG["vocab_size"]
    ids, _ = batch(-1, args, vocab)
    model = load_model(args)
    mhf.load_adapters(model, args.dir / "adapter")
    with torch.no_grad():
        got = model(my_rows(ids)).logits.float()
    if not torch.equal(got, probe):
        sys.exit(f"check: rank {rank}: reloaded adapters give other logits "
                 f"(max difference {(got - probe).abs().max().item():.3g})")
    log("check: reloaded adapters give the trained model's logits bit for bit")
    merged = hf_models.model_from_config(hf_models.config_from_pretrained(args.dir / "merged"))
    merged = merged.to(args.torch_dtype)
    ckpt = safetensors.Checkpoint(args.dir / "merged")
    hf_models.load_checkpoint_state_dict(merged, {k: ckpt.get_tensor(k) for k in ckpt.keys()})
    with torch.no_grad():
        plain = merged(my_rows(ids)).logits.float()
    err = (plain - probe).abs().max().item() / probe.abs().max().item()
    tol = 1e-5 if args.torch_dtype == torch.float32 else 3e-2
    if err > tol:
        sys.exit(f"check: rank {rank}: the merged checkpoint's logits differ by {err:.3g} "
                 f"of their scale (tolerance {tol})")
    log(f"check: the unpatched model on the merged checkpoint: logits within {err:.2g} of "
        "their scale")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["make-checkpoint", "train", "check"])
    p.add_argument("dir", type=Path, help="the work folder")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ranks", type=int, default=2, help="in-process ranks (one process)")
    p.add_argument("--threads", type=int, default=1, help="moec workers per MoE block")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r (lora_alpha = 2r)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--batch", type=int, default=6, help="sequences per step")
    p.add_argument("--seq", type=int, default=11, help="tokens per sequence")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--layout", choices=["modules", "fused"], default="modules",
                   help="the patched model's experts: per-expert modules (transformers v4) "
                        "or fused gate_up_proj/down_proj (v5, which the LoRA layer reads "
                        "in place)")
    p.add_argument("--lora-form", choices=["modules", "parameters"], default="modules",
                   help="PEFT's LoRA on the per-expert modules (target_modules: gate_proj, "
                        "up_proj, down_proj) or on the fused parameters (target_parameters: "
                        "gate_up_proj, down_proj; needs --layout fused)")
    p.add_argument("--weight-format", choices=quant.WEIGHT_FORMATS, default=None,
                   help="hold the experts quantized under the adapters (fp8_block128 also "
                        "makes the checkpoint FP8, as DeepSeek-V3 ships one); give it to "
                        "every command")
    p.add_argument("--shard-bytes", type=int, default=200_000,
                   help="largest safetensors shard of the checkpoints")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.lora_form == "parameters" and args.layout != "fused":
        p.error("--lora-form parameters puts LoRA on v5's fused expert parameters: "
                "add --layout fused")
    args.torch_dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    torch.set_num_threads(1)
    torchrun = moec_torch.launched_by_torchrun()
    if torchrun:
        # The patched model's layers run over torch.distributed's world
        # group (the default once it is initialized).
        import torch.distributed as dist
        dist.init_process_group("gloo")
    {"make-checkpoint": make_checkpoint, "train": train, "check": check}[args.command](args)
    if torchrun:
        moec_torch.close_groups()
        dist.destroy_process_group()
    moec_torch.finalize_mpi()


if __name__ == "__main__":
    main()
