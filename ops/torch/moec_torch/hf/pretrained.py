"""Merged checkpoints out: save_pretrained, in the Hub's sharded safetensors layout. See the
package's docstring."""

import json
import math
import re
from pathlib import Path

import torch

from .. import checks, safetensors

from .patch import (
    _checkpoint_prefix,
    _config_of,
    _expert_entries,
    _local_experts,
    _patched,
    barrier,
)
from .checkpoint_in import _non_expert_state


# --- merged checkpoints out ----------------------------------------------------

def _parse_size(size):
    """Bytes of a shard size: a positive int, or text such as "5GB", "500MiB"."""
    if isinstance(size, int) and not isinstance(size, bool):
        return checks.integer(size, "save_pretrained: argument 'max_shard_size'", minimum=1)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)?\s*", str(size), re.I)
    units = {None: 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    n = int(float(m.group(1)) * units[m.group(2).upper() if m.group(2) else None]) if m else 0
    if n < 1:
        raise ValueError(f"moec: max_shard_size {size!r} is not a size such as 5GB or 500MB")
    return n


def _merged_experts(name, experts):
    """{checkpoint name: tensor} of one block's merged experts this process
    holds (adapters folded in), in the model's layout [out, in]."""
    layer = experts.layer
    gate, up, down = layer.projections(*(layer.merged_weights() if layer.lora_rank
                                         else layer.dequantized_weights()))
    prefix = _checkpoint_prefix(name, experts.family)
    if experts.family.checkpoint_experts == "fused":  # every expert here (save_pretrained)
        return {f"{prefix}.experts.gate_up_proj": torch.cat((gate, up), 1),
                f"{prefix}.experts.down_proj": down}
    g, u, d = experts.family.projections
    out = {}
    for j, e in enumerate(_local_experts(layer)):
        for p, w in zip((g, u, d), (gate, up, down)):
            out[f"{prefix}.experts.{e}.{p}.weight"] = w[j]
    return out


def _nbytes(dtype, shape):
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def save_pretrained(model, directory, max_shard_size="5GB"):
    """Writes a patched model as a Hugging Face checkpoint: config.json, the
    weights with their original names (the experts per expert, the adapters
    merged in) in safetensors shards of at most max_shard_size, and
    model.safetensors.index.json (one model.safetensors, no index, when it
    fits one shard), as transformers' save_pretrained does. Under mpirun
    every process writes its experts' shards and rank 0 the rest, the config
    and the index, so that the folder is one checkpoint. A source
    checkpoint's quantization_config is dropped: the weights are written in
    the model's dtype. Each process's files are replaced whole or not at
    all (safetensors.write_together; the index and config last). Returns
    the files this process wrote."""
    blocks = _patched(model)
    config = _config_of(model)
    directory = Path(directory)
    limit = _parse_size(max_shard_size)
    layer = blocks[0][2].layer
    if layer.tp_rank is not None:
        raise ValueError(
            f"moec: save_pretrained: with expert tensor parallelism (tp={layer.tp}) each "
            "process holds a slice of its experts' columns, and a checkpoint holds whole "
            "experts: save each process's model.state_dict(), put them together with "
            "moec_torch.merge_state_dicts, load that into the model patched in one process "
            "(tp=1), and save_pretrained it there")
    if layer.local_ranks != layer.ranks and \
            any(ex.family.checkpoint_experts == "fused" for _, _, ex in blocks):
        raise ValueError(
            f"moec: save_pretrained: {blocks[0][2].family.name} checkpoints keep each block's "
            "experts in one tensor, and each process here holds its own experts only: save "
            "each process's model.state_dict(), put them together with "
            "moec_torch.merge_state_dicts, load that into the model patched in one process, "
            "and save_pretrained it there")
    rest = {k: v.detach() for k, v in _non_expert_state(model).items()}
    if getattr(config, "tie_word_embeddings", False):
        rest.pop("lm_head.weight", None)
    entries = [(k, v.dtype, tuple(v.shape), 0) for k, v in rest.items()]
    for r in range(layer.ranks):
        entries += [(n, dt, shape, r) for n, dt, shape in _expert_entries(blocks, r)]
    # Every process plans every rank's shards alike (the shapes are known to
    # all), so rank 0's index names the files the other processes write.
    plan = safetensors.plan_shards([(n, _nbytes(dt, s), r) for n, dt, s, r in entries], limit)
    files = safetensors.shard_files(len(plan))
    mine = range(layer.first_rank, layer.first_rank + layer.local_ranks)
    directory.mkdir(parents=True, exist_ok=True)
    for path in ([directory / f for f, (owner, _) in zip(files, plan) if owner in mine]
                 + ([directory / "config.json", directory / INDEX] if 0 in mine else [])):
        checks.output_path(path, "save_pretrained", "the checkpoint file")
    tensors = dict(rest) if 0 in mine else {}
    for name, _, experts in blocks:
        tensors.update(_merged_experts(name, experts))
    def shard(path, names):
        # The contiguous copies of one shard's tensors, made as it is written.
        return lambda f: safetensors.file_writer({n: tensors[n].contiguous() for n in names},
                                                 path, {"format": "pt"})(f)

    writes = [(directory / file, shard(directory / file, names))
              for file, (owner, names) in zip(files, plan) if owner in mine]
    if 0 in mine:
        if len(plan) > 1:
            total = sum(_nbytes(dt, s) for _, dt, s, _ in entries)
            writes.append((directory / INDEX, safetensors.index_data(
                {n: f for f, (_, names) in zip(files, plan) for n in names}, total)))
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
        cfg.pop("quantization_config", None)
        writes.append((directory / "config.json",
                       json.dumps(cfg, indent=2, sort_keys=True).encode()))
    # This process's files, replaced together: written under scratch names,
    # then renamed, the index and the config last.
    safetensors.write_together(writes)
    barrier(model)
    written = [path for path, _ in writes]
    return written[-1:] + written[:-1] if 0 in mine else written


INDEX = "model.safetensors.index.json"

