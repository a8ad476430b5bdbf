"""examples/torch/bench.py --profile VARIANT: one variant's step, profiled,
prints each pass's per-op table with the variant's own ops."""

import json
import math
from pathlib import Path

import pytest

import bench
import moec_torch

TINY = json.loads((Path(bench.REPO) / "examples/configs/tiny.json").read_text())


def test_profile_prints_each_pass_with_the_variants_ops(capsys):
    bench.profile_one(dict(TINY, seq_size=64), 2, "fp32", 2, "lora")
    out = capsys.readouterr().out
    forward, _, backward = out.partition("-- backward")
    assert "fp32 lora: the third step" in out
    assert "-- forward" in forward and "forward pass:" in forward
    # The LoRA layer's own ops, with their busy time and rate (each
    # adapter's second product is summed inside its base's GMM on the cpu
    # target: no up_lora_b, down_lora_b, up_lora_dx or down_lora_dz).
    for op in ("up_proj", "up_lora_a", "down_lora_a", "combine"):
        assert f"\n  {op} " in forward, op
    for op in ("gate_grad", "up_lora_v", "up_lora_a_grad", "down_lora_b_grad"):
        assert f"\n  {op} " in backward, op
    for op in ("up_lora_b", "down_lora_b"):
        assert f"\n  {op} " not in forward, op
    for op in ("up_lora_dx", "down_lora_dz"):
        assert f"\n  {op} " not in backward, op
    assert "backward pass:" in backward and "GFLOP/s" in backward


def test_profile_of_a_quantized_variant(capsys):
    # frozen_int8: the frozen layer with its base in int8 (weight_format),
    # whose backward computes no weight gradients.
    bench.profile_one(dict(TINY, seq_size=64), 2, "bf16", 2, "frozen_int8")
    out = capsys.readouterr().out
    assert "bf16 frozen_int8: the third step" in out
    forward, _, backward = out.partition("-- backward")
    assert "\n  up_proj " in forward and "\n  gate_grad " in backward
    assert "w1_grad" not in backward and "w2_grad" not in backward


def test_variant_suffixes_set_pack_weights():
    assert bench.variant_options("lora_packed")["pack_weights"] is True
    assert bench.variant_options("lora_packed_forward")["pack_weights"] == "forward"
    assert bench.variant_options("frozen_unpacked") == {"frozen": True, "pack_weights": False}
    assert bench.variant_options("frozen_packed_sideways") is None
    assert bench.quantized_variant("lora_int8_packed_forward") == ("lora_packed_forward", "int8")


def test_a_quantized_variant_names_the_layer_it_is_made_from():
    with pytest.raises(SystemExit, match=r"variant lora_int8_packed needs lora_packed before it"):
        bench.bench_training(dict(TINY, seq_size=64), 2, "bf16", 2, 1,
                             ["frozen", "lora_int8_packed"])
    with pytest.raises(SystemExit, match=r"variant lora_int8 needs lora \(or lora_packed\) "):
        bench.bench_training(dict(TINY, seq_size=64), 2, "bf16", 2, 1, ["frozen", "lora_int8"])


def test_profile_refuses_an_unknown_variant():
    with pytest.raises(SystemExit, match="--profile 'lorra' is not a variant"):
        bench.profile_one(dict(TINY, seq_size=64), 2, "fp32", 2, "lorra")


def test_memory_refuses_an_unknown_variant():
    # --memory-variant goes through the same making of a variant's layer.
    with pytest.raises(SystemExit, match="--memory-variant 'lorra' is not a variant"):
        bench.memory_one(dict(TINY, seq_size=64), 2, "fp32", 2, 1, "lorra")


def test_profile_says_why_a_format_does_not_fit_the_config():
    # tiny's hidden size 64 holds no whole int4 group of 128: the op's
    # message, named by the flag, not a traceback.
    with pytest.raises(SystemExit, match="--profile frozen_int4_g128: moec: weight_format="
                                         "'int4_g128' holds whole groups of 128"):
        bench.profile_one(dict(TINY, seq_size=64), 2, "bf16", 2, "frozen_int4_g128")


def test_training_counts_the_base_gmms_each_variant_runs():
    # --training's "of peak" divides these FLOPs by the step: three products
    # of each base weight where the step trains it, two where it is frozen
    # (a LoRA adapter's products not counted).
    result = bench.bench_training(dict(TINY, seq_size=64), 2, "fp32", 2, 2,
                                  ["full", "frozen", "lora", "split"])
    H, I, K = TINY["hidden_size"], TINY["intermediate_size"], TINY["top_k"]
    rows = 2 * 64 * K  # every rank's routed rows
    forward = 2 * rows * H * 2 * I + 2 * rows * I * H  # through w1, then w2
    assert result["full"][2] == 3 * forward
    assert result["split"][2] == 3 * forward
    assert result["frozen"][2] == 2 * forward
    assert result["lora"][2] == 2 * forward
    # The bytes its ceiling divides by the memory rate: the base weights
    # read by the forward and the dX, and the trained ones' gradients
    # written (weight_stream_bytes).
    weights = TINY["num_experts"] * 3 * H * I * 4  # w1 and w2, every rank's experts, fp32
    assert result["full"][4] == 3 * weights
    assert result["split"][4] == 3 * weights
    assert result["frozen"][4] == 2 * weights
    assert result["lora"][4] == 2 * weights
    for name, (step_s, backward_s, _, steps, _) in result.items():
        assert step_s > 0, name
        # The steps the range is printed from, one a round; their median.
        assert len(steps) == 2 and min(steps) <= step_s <= max(steps), name
        assert step_s == sum(steps) / 2, name


def test_bench_returns_every_timed_step_of_each_side():
    # The default table's range line comes from these: one step a round of
    # each side, their median the table's; no PyTorch steps where its
    # baseline is not timed.
    moec_s, torch_s, _, steps, _ = bench.bench(dict(TINY, seq_size=64), 2, "fp32", 2, 2)
    assert len(steps["moec"]) == 2 and moec_s == sum(steps["moec"]) / 2
    assert len(steps["torch"]) == 2 and torch_s == sum(steps["torch"]) / 2
    _, _, _, alone, _ = bench.bench(dict(TINY, seq_size=64), 2, "fp32", 2, 3,
                                    with_torch=False)
    assert len(alone["moec"]) == 3 and alone["torch"] == []


def test_weight_stream_bytes_by_what_the_step_does_with_the_weights():
    cfg = dict(TINY, seq_size=64, dtype="bf16")
    full = moec_torch.MoeFFN(cfg, 2, threads=2)
    weights = full.w1.numel() * 2 + full.w2.numel() * 2
    assert bench.weight_stream_bytes(full) == 3 * weights  # read twice, gradient written
    assert bench.weight_stream_bytes(full, trains=False) == 2 * weights
    # main_grad: the fp32 buffers read and written, not a bf16 gradient.
    main = moec_torch.MoeFFN(cfg, 2, threads=2, main_grad=True)
    assert bench.weight_stream_bytes(main) == 2 * weights + 2 * 2 * weights
    frozen = moec_torch.MoeFFN(cfg, 2, threads=2, frozen=True)
    assert bench.weight_stream_bytes(frozen) == 2 * weights
    # A quantized base: its codes and scales, read twice.
    int8 = frozen.quantize_weights("int8")
    codes = sum(t.numel() * t.element_size()
                for t in (int8.w1, int8.w2, int8.w1_scale, int8.w2_scale))
    assert codes < weights
    assert bench.weight_stream_bytes(int8) == 2 * codes


def test_ceiling_is_the_share_of_the_peak_the_bytes_allow():
    # 10 GFLOP at 100 GFLOP/s take 0.1 s; 4 GB at 20 GB/s take 0.2 s.
    assert bench.ceiling(10e9, 100e9, 4e9, 20e9) == pytest.approx(0.5)
    assert bench.ceiling(10e9, 100e9, 1e9, 20e9) == 1.0  # the FLOPs take longer
    assert math.isnan(bench.ceiling(10e9, 100e9, 4e9, float("nan")))  # no rate measured


def test_the_memory_rate_comes_from_moec_bench(tmp_path):
    fake = tmp_path / "moec"
    fake.write_text("#!/bin/sh\ncat <<'EOF'\n"
                    "fp32 FMA peak, one core: 200.0 GFLOP/s (avx512f, 16 lanes)\n"
                    "fp32 FMA peak, 2 cores at once: 390.0 GFLOP/s (195.0 a core)\n"
                    "memory read, 2 cores at once: 35.5 GB/s (17.8 a core, the slowest 17.6; "
                    "480.0 MiB a core)\n"
                    "EOF\n")
    fake.chmod(0o755)
    bench.MEMORY.clear()
    assert math.isnan(bench.memory_rate())  # not measured
    bench.moec_tile_rates(str(fake), 2)
    assert bench.memory_rate() == 35.5e9
    assert bench.PEAKS["fp32"] == 200.0 and bench.TOGETHER["fp32"] == 390.0
    # With one thread, moec bench says "one core".
    fake.write_text("#!/bin/sh\necho 'memory read, one core: 18.5 GB/s (960.0 MiB)'\n")
    bench.moec_tile_rates(str(fake), 1)
    assert bench.memory_rate() == 18.5e9


def test_contended_cores_are_named_before_the_shares(tmp_path, capsys):
    fake = tmp_path / "moec"

    def probe(fp32_together, bf16_together):
        fake.write_text("#!/bin/sh\ncat <<'EOF'\n"
                        "fp32 FMA peak, one core: 200.0 GFLOP/s (avx512f, 16 lanes)\n"
                        "bf16 dot-product peak, one core: 400.0 GFLOP/s (avx512_bf16)\n"
                        f"fp32 FMA peak, 2 cores at once: {fp32_together} GFLOP/s (x a core)\n"
                        f"bf16 dot-product peak, 2 cores at once: {bf16_together} GFLOP/s\n"
                        "EOF\n")
        fake.chmod(0o755)
        bench.PEAKS.clear()
        bench.TOGETHER.clear()
        bench.moec_tile_rates(str(fake), 2)

    probe(390.0, 780.0)  # 97.5% each: quiet
    assert bench.contention_warning(2) is None
    bench.print_peaks(2)
    assert "warning" not in capsys.readouterr().out
    probe(380.0, 472.0)  # bf16 at 59% of 2 x 400
    line = bench.contention_warning(2)
    assert line.startswith("warning: the 2 cores at once ran bf16 at 59% of 2 x one core alone")
    bench.print_peaks(2)
    assert line in capsys.readouterr().out
    assert bench.contention_warning(1) is None  # one thread: nothing to share
    bench.PEAKS.clear()
    bench.TOGETHER.clear()
    assert bench.contention_warning(2) is None  # not measured


def test_step_range_is_the_fastest_and_slowest_step():
    assert bench.step_range([1.2504, 1.19, 1.3333]) == "1.190-1.333"
    assert bench.step_range([0.5]) == "0.500-0.500"


def test_malloc_warning_names_a_threshold_below_the_largest_tensor():
    # qwen3-30b-a3b: the fp32 w1 gradient is 128 x 2048 x 1536 x 4 bytes.
    qwen3 = json.loads((Path(bench.REPO) / "examples/configs/qwen3-30b-a3b.json").read_text())
    low = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30)}
    warning = bench.malloc_warning(qwen3, ["fp32", "bf16"], low)
    assert warning and "fp32 w1 gradient, 1.61 GB" in warning and str(1 << 30) in warning
    # bf16's is 805 MB: under 1 GiB.
    assert bench.malloc_warning(qwen3, ["bf16"], low) is None
    assert bench.malloc_warning(qwen3, ["fp32", "bf16"], dict(bench.MALLOC_SETTINGS)) is None
    assert bench.malloc_warning(qwen3, ["fp32"], {}) is None
    # glibc reads a value's leading digits: "16GiB" is 16 bytes.
    unit = bench.malloc_warning(qwen3, ["fp32"], {"MALLOC_MMAP_THRESHOLD_": "16GiB"})
    assert unit and "reads '16GiB' as 16" in unit


def test_decode_times_the_three_on_the_experts_hit():
    """bench.py --decode: per token count, the experts the tokens reach and
    their bytes, and every call of moec, moec packed and PyTorch timed."""
    cfg = dict(TINY, seq_size=64)
    out = bench.bench_decode(cfg, "fp32", 2, 3, [1, 8])
    E, K = TINY["num_experts"], TINY["top_k"]
    for n, (hit, moved, med, times) in out.items():
        assert K <= hit <= min(E, n * K)
        assert set(med) == {"moec", "moec packed", "torch"}
        assert all(len(v) == 3 and min(v) > 0 for v in times.values())
        assert med["moec"] == sorted(times["moec"])[1]
    per_expert = out[1][1] // out[1][0]
    assert per_expert == 3 * TINY["hidden_size"] * TINY["intermediate_size"] * 4
