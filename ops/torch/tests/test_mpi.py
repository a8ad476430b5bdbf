"""The torch op in a real multi-process job: mpirun -np R python3, one rank
per process (moec's MPI fabric).

  - the op's forward and backward against plain PyTorch autograd and, bit
    for bit, against the one-process op (mpi_layer_check.py), also frozen
    with main_grad, and with LoRA adapters;
  - dispatch and combine as ops of their own, likewise
    (mpi_exchange_check.py);
  - the toy training (examples/torch/train_toy.py) under mpirun -np 2: the
    loss falls, and after 4 steps every parameter is bitwise that of the
    one-process run with the same seed (also in DistributedDataParallel);
  - a put lost on its way (a test hook): every rank's forward raises, and
    rank 0's error carries the report of every rank (mpi_stop_check.py);
  - growing a layer's capacity is collective (mpi_capacity_check.py): all
    ranks grow (bitwise the one-process result), or, with another
    capacity_policy on one rank, a failed compile on one rank, or a layer
    only one rank makes (or makes after the other gave up), every rank that
    waits gets an error naming the rank and the reason within the timeout,
    and the job ends;
  - a patched Hugging Face-structured model (mpi_hf_check.py) and the
    fine-tuning example (examples/hf/finetune.py);
  - DistributedDataParallel around a model with the layer, after
    prepare_ddp (ddp_check.py);
  - across 2 simulated hosts: the op, the toy training and the report."""

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
TOY = Path(os.environ.get("MOEC_TOY", HERE.parents[2] / "examples/torch/train_toy.py"))


def mpirun(ranks, *args, timeout=240, hosts=None, extra_env=None, finalizes=True):
    """mpirun -np RANKS python3 ARGS on this machine, or with `hosts` (the
    folder of a test bed from scripts/hosts.sh), from moec-h0 with one rank
    per simulated host; `extra_env` goes to every rank. A job whose
    processes end by finalizing MPI (`finalizes`) runs once more where
    Open MPI lost a finalize (launcher_lost_finalize)."""
    extra_env = extra_env or {}
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **extra_env)
    launcher = ["mpirun", "--oversubscribe"]
    if hosts:
        env["PATH"] = f"{hosts}/bin:{env['PATH']}:/usr/sbin:/sbin"
        env["MASTER_ADDR"] = "moec-h0"
        launcher = ["bash", HOSTS_SH, "run", "moec-h0", "mpirun", "--hostfile",
                    f"{hosts}/hostfile", "--map-by", "node"]
    cmd = [*launcher, "--bind-to", "none", "-np", str(ranks), "-x", "MASTER_ADDR", "-x",
           "MASTER_PORT", "-x", "PYTHONPATH", "-x", "MOEC_TORCH_LIB", "-x", "MOEC_LIB",
           "-x", "MOEC_GRAPHS", "-x", "MOEC_CACHE_DIR",
           *[arg for name in extra_env for arg in ("-x", name)], sys.executable,
           *map(str, args)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if finalizes and launcher_lost_finalize(run):
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return run


def launcher_lost_finalize(run):
    """Whether `run` failed only by Open MPI 4.1's shutdown race: a process
    called MPI_Finalize, but its launcher, slow on a loaded machine, had not
    acknowledged that within PMIx's 2 s when the process ended, so mpirun
    reports it as "exiting improperly" with PID 0 (open-mpi/ompi#7833).
    Such a job is run once more, and must then pass on its own."""
    return (run.returncode != 0 and "exiting improperly" in run.stderr
            and re.search(r"process rank \d+ with PID 0 on", run.stderr) is not None)


HOSTS_SH = os.environ.get("MOEC_HOSTS_SH")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Two simulated hosts (scripts/hosts.sh), removed after the module."""
    if not HOSTS_SH:
        pytest.fail("MOEC_HOSTS_SH is not set: the tests across hosts run as "
                    "//ops/torch:torch_hosts_test")
    env = dict(os.environ, PATH=os.environ["PATH"] + ":/usr/sbin:/sbin")
    check = subprocess.run(["bash", HOSTS_SH, "check"], env=env, capture_output=True, text=True)
    if check.returncode:
        pytest.fail(f"the tests across hosts cannot run here: {check.stderr.strip()}")
    bed = tmp_path_factory.mktemp("hosts") / "bed"
    up = subprocess.run(["bash", HOSTS_SH, "up", "2", "--dir", str(bed)], env=env,
                        capture_output=True, text=True)
    assert up.returncode == 0, up.stdout + up.stderr
    yield bed
    subprocess.run(["bash", HOSTS_SH, "down", "--dir", str(bed)], env=env)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launcher_lost_finalize_is_told_apart():
    """Only Open MPI's report of a process ending without a finalize it saw,
    with PID 0, reruns a job; a failing rank does not."""
    lost = ("-" * 74 + "\nmpirun has exited due to process rank 0 with PID 0 on\n"
            "node vm exiting improperly. There are three reasons this could occur:\n")
    failed = ("mpirun detected that one or more processes exited with non-zero status, thus "
              "causing\nthe job to be terminated. The first process to do so was:\n")
    job = ["mpirun", "-np", "2"]
    assert launcher_lost_finalize(subprocess.CompletedProcess(job, 1, "", lost))
    assert not launcher_lost_finalize(subprocess.CompletedProcess(job, 0, "", lost))
    assert not launcher_lost_finalize(subprocess.CompletedProcess(job, 1, "", failed))
    other_pid = lost.replace("PID 0 on", "PID 4242 on")
    assert not launcher_lost_finalize(subprocess.CompletedProcess(job, 1, "", other_pid))


@pytest.mark.parametrize("ranks,dtype,hot,variant,tp", [
    (2, "fp32", -1, "full", 1), (3, "fp32", 0, "full", 1), (2, "bf16", -1, "full", 1),
    (2, "bf16", -1, "main_grad", 1), (2, "fp32", -1, "frozen", 1), (2, "bf16", -1, "lora", 1),
    (3, "bf16", 1, "fp8", 1), (3, "fp32", 0, "lora", 1),
    # Expert tensor parallelism, ranks = ep x tp: [2, 2], [1, 2], [1, 4].
    (4, "fp32", 1, "full", 2), (4, "bf16", -1, "main_grad", 2), (2, "fp32", -1, "frozen", 2),
    (4, "bf16", 0, "full", 4),
    # Quantized frozen base weights with LoRA adapters.
    (2, "bf16", -1, "fp8_block128", 1), (2, "fp32", 0, "int8", 1),
    (3, "bf16", -1, "int4_g64_zp", 1),
    # Quantized frozen base weights with expert tensor parallelism: [2, 2], [1, 2].
    (4, "bf16", -1, "frozen_fp8_block128", 2), (4, "fp32", 0, "frozen_int8", 2),
    (2, "bf16", 1, "frozen_int4_g64_zp", 2),
    # LoRA adapters with expert tensor parallelism: [2, 2], and on an FP8 base [1, 2].
    (4, "fp32", -1, "lora", 2), (2, "bf16", -1, "fp8_block128", 2)])
def test_op_under_mpirun(ranks, dtype, hot, variant, tp):
    run = mpirun(ranks, HERE / "mpi_layer_check.py", dtype, 0, hot, variant, tp)
    assert run.returncode == 0, run.stdout + run.stderr
    for r in range(ranks):
        assert f"rank {r}: ok: bitwise equal to the one-process op" in run.stdout, run.stdout


@pytest.mark.parametrize("ranks,dtype", [(2, "fp32"), (3, "bf16")])
def test_exchange_under_mpirun(ranks, dtype):
    run = mpirun(ranks, HERE / "mpi_exchange_check.py", dtype)
    assert run.returncode == 0, run.stdout + run.stderr
    for r in range(ranks):
        assert f"rank {r}: ok: bitwise equal to the one-process exchange" in run.stdout, run.stdout


@pytest.mark.parametrize("variant", ["full", "world_mismatch"])
def test_ddp_around_the_layer_under_mpirun(variant, tmp_path):
    """DistributedDataParallel (gloo, from the launcher's ranks) around a
    model whose layer runs on moec's MPI fabric, after prepare_ddp: the
    one-process model's parameters (ddp_check.py); "world_mismatch":
    torch.distributed started as a world of one in each process, which
    prepare_ddp refuses."""
    run = mpirun(2, HERE / "ddp_check.py", variant, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    for r in range(2):
        assert f"rank {r}: ddp ok" in run.stdout, run.stdout


@pytest.mark.parametrize("family,layout,ranks,form", [("qwen3_moe", "modules", 2, "modules"),
                                                       ("deepseek_v3", "fused", 2, "modules"),
                                                       ("mixtral", "modules", 4, "modules"),
                                                       ("qwen3_moe", "fused", 2, "parameters"),
                                                       ("qwen3_5_moe_text", "fused", 2,
                                                        "parameters")])
def test_hf_model_under_mpirun(tmp_path, family, layout, ranks, form):
    """A patched Hugging Face-structured model, one rank per process, each
    with its own number of tokens, against the unpatched model on the whole
    batch; load_experts, save_adapters and save_pretrained make one
    checkpoint (mpi_hf_check.py)."""
    run = mpirun(ranks, HERE / "mpi_hf_check.py", family, layout, tmp_path, form)
    assert run.returncode == 0, run.stdout + run.stderr
    for r in range(ranks):
        assert f"rank {r}: hf ok" in run.stdout, run.stdout


@pytest.mark.parametrize("family,layout", [("qwen3_moe", "modules"), ("deepseek_v3", "fused")])
def test_hf_model_with_expert_tensor_parallelism(tmp_path, family, layout):
    """patch_model(tp=2) on 4 processes ([ep 2, tp 2]): each process's
    logits and its slice of its experts' gradients against the unpatched
    model; load_experts reads the slices; the state dicts merge into the
    one-process model; save_pretrained refuses; the experts held in int8
    give the one-process int8 model's logits; LoRA adapters of the model
    patched in one process load as each process's part and give its logits
    and adapter gradients (mpi_hf_tp_check.py)."""
    run = mpirun(4, HERE / "mpi_hf_tp_check.py", family, layout, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    for ep in range(2):
        for t in range(2):
            assert f"ep {ep} tp {t}: hf tp ok" in run.stdout, run.stdout


def hf_example_runs(tmp_path, launch, *args):
    """examples/hf/finetune.py's train and check in 2 processes that
    `launch` (mpirun, or test_torchrun's torchrun) starts, with the example's
    `args`: the losses of PEFT's LoRA in one process, the adapters reloaded
    bit for bit."""
    from test_hf import FINETUNE
    one = subprocess.run([sys.executable, str(FINETUNE), "make-checkpoint", str(tmp_path),
                          *args], capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stdout + one.stderr
    runs = {}
    for command in ("train", "check"):
        run = runs[command] = launch(2, FINETUNE, command, tmp_path, "--steps", "8", *args)
        assert run.returncode == 0, run.stdout + run.stderr
    assert "bit for bit" in run.stdout, run.stdout
    return runs


def test_hf_example_under_mpirun(tmp_path):
    hf_example_runs(tmp_path, mpirun)


def test_hf_example_on_an_fp8_checkpoint_under_mpirun(tmp_path):
    """The FP8 checkpoint's experts taken as they are, each process its own
    half (a quarter of their fp32 bytes, scales included)."""
    train = hf_example_runs(tmp_path, mpirun, "--weight-format", "fp8_block128")["train"]
    # 4 of the 8 experts in each of 2 layers: w1's 256 x 128 and w2's 128 x
    # 128 byte codes, 2 + 1 fp32 block scales; in fp32 4 bytes a value.
    assert 4 * 2 * (256 * 128 + 128 * 128 + 3 * 4) == 393312
    assert "experts (fp8_block128, this process): 393312 bytes of codes and scales, 0.250 of " \
        "1572864 in fp32" in train.stdout, train.stdout


def one_process_toy(tmp_path):
    """The toy training's parameters after 4 steps in one process."""
    single = tmp_path / "single.pt"
    one = subprocess.run([sys.executable, str(TOY), "--steps", "4", "--threads", "1",
                          "--torch-threads", "1", "--fabric", "inproc", "--save", str(single)],
                         capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stdout + one.stderr
    return torch.load(single, weights_only=True)


def check_toy(want, run, saved, ranks):
    """The toy training `run` with a process per rank (files `saved`.rankN,
    each process's parameters: its experts) against the one-process run's
    parameters `want`, bit for bit."""
    assert run.returncode == 0, run.stdout + run.stderr
    assert "one per process" in run.stdout, run.stdout
    got_ranks = [torch.load(f"{saved}.rank{r}", weights_only=True) for r in range(ranks)]
    for name, value in want.items():
        if name.startswith("moe."):
            got = torch.cat([g[name] for g in got_ranks])  # each rank's experts
        else:
            got = got_ranks[0][name]
            for g in got_ranks[1:]:
                assert torch.equal(g[name], got), f"{name} differs between the ranks"
        assert torch.equal(got, value), f"{name} is not bitwise that of the one-process run"


def toy_training_matches_one_process(tmp_path, hosts=None):
    """The toy training, 4 steps, under mpirun -np 2 (on `hosts` when given):
    every parameter bit for bit that of the one-process run."""
    want = one_process_toy(tmp_path)
    run = mpirun(2, TOY, "--steps", "4", "--ranks", "2", "--threads", "1", "--torch-threads", "1",
                 "--save", tmp_path / "mpi.pt", hosts=hosts)
    check_toy(want, run, tmp_path / "mpi.pt", 2)


def test_toy_training_matches_one_process(tmp_path):
    toy_training_matches_one_process(tmp_path)


def test_toy_training_in_ddp_under_mpirun_matches_one_process(tmp_path):
    """The toy training in DistributedDataParallel (--ddp) on the MPI
    fabric: bitwise the one-process run after 4 steps with 2 ranks."""
    want = one_process_toy(tmp_path)
    run = mpirun(2, TOY, "--steps", "4", "--ranks", "2", "--threads", "1", "--torch-threads", "1",
                 "--ddp", "--save", tmp_path / "ddp.pt")
    assert "in DistributedDataParallel" in run.stdout, run.stdout + run.stderr
    check_toy(want, run, tmp_path / "ddp.pt", 2)


def test_toy_training_loss_falls_under_mpirun():
    run = mpirun(2, TOY, "--steps", "60", "--ranks", "2", "--threads", "1")
    assert run.returncode == 0, run.stdout + run.stderr
    losses = [float(line.split()[-1]) for line in run.stdout.splitlines()
              if line.startswith("step")]
    assert losses and losses[-1] < 0.2 * losses[0], run.stdout


def needs_test_hooks():
    """Skips a test of the fabrics' test hooks (MOEC_TEST_DROP_PUT) where
    the loaded moec_torch.so was built without them (outside `bazel test`,
    which builds them in, as scripts/test.sh runs it)."""
    import moec_torch
    moec_torch.load_library()
    if not torch.ops.moec.test_hooks_built():
        pytest.skip("this moec_torch.so has no test hooks (bazel test builds them in; "
                    "outside it: bazel build --config=hooks //ops/torch:moec_torch.so)")


def stopped_job_reports_every_rank(hosts=None):
    """A put lost on its way (the test hook MOEC_TEST_DROP_PUT=1:2: rank 1
    drops its second put to rank 0 and the signal after it): the forward of
    both ranks raises, and rank 0's error carries the report of both: the
    dispatch event rank 0 waits for, rank 1's missing signal, the rows that
    did not arrive."""
    needs_test_hooks()
    run = mpirun(2, HERE / "mpi_stop_check.py", hosts=hosts, timeout=120,
                 extra_env={"MOEC_TEST_DROP_PUT": "1:2"}, finalizes=False)
    check_stop_report(run)


def check_stop_report(run):
    """The output of mpi_stop_check.py with a put dropped (under mpirun or
    torchrun): what stopped_job_reports_every_rank says."""
    out = run.stdout
    for r in range(2):
        assert re.search(rf"rank {r}: raised after [\d.]+ s: moec forward: \[rank {r}\]", out), \
            out + run.stderr
    assert "report of the 2 ranks, gathered on rank 0:" in out, out
    assert re.search(r"^  \[rank 0\] .*waits for event \d+ 'dispatch\[[\d.]+\]' .*"
                     r"signalled by rank 1 \(\d+ of \d+ arrived, 1 missing\)", out, re.M), out
    assert re.search(r"^  \[rank 0\] .*arrived from rank 1 \d+ of \d+ \(short\)", out, re.M), out
    assert re.search(r"^  \[rank 1\] .*rank 1 event \d+ 'terminate' is at \d+ of \d+; "
                     r"signalled by rank 0 \(\d+ of \d+ arrived, \d+ missing\)", out, re.M), out


def test_stopped_job_reports_every_rank():
    stopped_job_reports_every_rank()


def capacity_check(mode):
    """mpi_capacity_check.py MODE under mpirun -np 2 (timeout_seconds 3): the
    job must end well within a minute, each rank saying it is done."""
    start = time.monotonic()
    try:
        run = mpirun(2, HERE / "mpi_capacity_check.py", mode, timeout=60)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the job did not end within 60 s:\n{e.stdout}\n{e.stderr}")
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    assert time.monotonic() - start < 60
    for r in range(2):
        assert f"rank {r}: done in" in out, out + run.stderr
    return out


def test_capacity_grows_on_every_rank():
    out = capacity_check("grow")
    for r in range(2):
        assert f"rank {r}: ok: grew (receive capacity 256 -> " in out, out
        assert "bitwise equal to the one-process op" in out, out


def test_ranks_with_other_capacity_policies_are_refused():
    out = capacity_check("mixed-construct")
    for r in range(2):
        assert (f"rank {r}: raised ValueError: moec: the ranks of an MPI layer must be given "
                "the same capacity_policy") in out, out
    assert out.count("got 'grow' on rank 0, 'error' on rank 1") == 2, out


def test_growth_refused_by_one_rank_fails_on_every_rank():
    # The hostile case: rank 1's policy is "error" when the step overflows.
    out = capacity_check("mixed-grow")
    for r in range(2):
        assert (f"rank {r}: raised RuntimeError: moec over capacity: routing over capacity: "
                "the experts of rank 0 receive 512 rows") in out, out
        assert f"rank {r}: ok: a step that fits ran after" in out, out
    assert out.count("No rank grows the layer: capacity_policy 'error' on rank 1 refuses it, "
                     "and the ranks grow together or not at all ('grow' on rank 0)") == 2, out


def test_growth_whose_compile_fails_on_one_rank_fails_on_every_rank():
    out = capacity_check("compile-fails")
    for r in range(2):
        assert f"rank {r}: raised RuntimeError: moec over capacity: " in out, out
        assert f"rank {r}: ok: a step that fits ran after" in out, out
    assert out.count("The layer grows on no rank: compiling the grown layer failed on rank 1: "
                     "RuntimeError: moec compile moe_ffn_fwd.json failed") == 2, out


def test_fabric_only_one_rank_creates_fails_within_the_timeout():
    # Rank 0 makes a layer that rank 1 does not: its fabric's communicators
    # would never be created; rank 0 gets an error after timeout_seconds.
    out = capacity_check("extra-layer")
    found = re.search(r"rank 0: raised RuntimeError after ([\d.]+) s: moec MPI fabric: rank 0: "
                      r"rank 1 did not come to create MPI fabric #2 within 3 s", out)
    assert found, out
    assert float(found.group(1)) < 15, out
    assert "rank 1: ok: made one layer" in out, out


def test_fabric_a_rank_makes_too_late_fails_on_both_ranks():
    # Rank 1 comes to the second layer after rank 0 gave up: it must not
    # enter MPI's communicator creation alone either.
    out = capacity_check("late-layer")
    assert re.search(r"rank 0: raised RuntimeError after [\d.]+ s: moec MPI fabric: rank 0: "
                     r"rank 1 did not come to create MPI fabric #2 within 3 s", out), out
    found = re.search(r"rank 1: raised RuntimeError after ([\d.]+) s: moec MPI fabric: rank 1: "
                      r"rank 0 came to create MPI fabric #2 but did not go on within 3 s", out)
    assert found and float(found.group(1)) < 15, out


def test_fabric_errors():
    import moec_torch
    moec_torch.load_library()
    cfg = {"name": "t", "hidden_size": 64, "intermediate_size": 32, "num_experts": 4,
           "top_k": 2, "ep": 1, "tp": 1, "seq_size": 128, "dtype": "fp32"}
    forward, backward = moec_torch.compile_layer(cfg, 2)
    with pytest.raises(RuntimeError, match="fabric must be 'inproc', 'mpi' or 'group', got 'tcp'"):
        torch.classes.moec.Layer(forward, backward, 1, 60.0, "tcp", False, "all", 0, 0.0)
    with pytest.raises(RuntimeError, match="the fabric 'group' takes a process group"):
        torch.classes.moec.Layer(forward, backward, 1, 60.0, "group", False, "all", 0, 0.0)
    with pytest.raises(ValueError, match="fabric must be 'inproc', 'mpi' or 'group'"):
        moec_torch.MoeFFN(cfg, 2, fabric="tcp")
    with pytest.raises(ValueError, match="fabric='group' needs torch.distributed initialized"):
        moec_torch.MoeFFN(cfg, 2, fabric="group")
    with pytest.raises(TypeError, match="group must be a torch.distributed process group"):
        moec_torch.MoeFFN(cfg, 2, group="world")
    with pytest.raises(ValueError, match="group= runs the ranks over a torch.distributed group"):
        moec_torch.MoeFFN(cfg, 2, fabric="mpi", group=object())
    if not moec_torch.launched_by_mpi():
        with pytest.raises(ValueError, match="needs ranks="):
            moec_torch.MoeFFN(cfg)


# Across 2 simulated hosts, one rank on each (no memory shared between the
# ranks): //ops/torch:torch_hosts_test runs these alone (-k across_hosts).
# tp 2: an [ep, tp] = [1, 2] mesh, the TP partials crossing between hosts.
@pytest.mark.parametrize("dtype,variant,tp", [("fp32", "full", 1), ("bf16", "main_grad", 1),
                                              ("bf16", "lora", 1), ("fp32", "frozen", 1),
                                              ("bf16", "full", 2)])
def test_op_across_hosts(hosts, dtype, variant, tp):
    run = mpirun(2, HERE / "mpi_layer_check.py", dtype, 0, -1, variant, tp, hosts=hosts)
    assert run.returncode == 0, run.stdout + run.stderr
    for r in range(2):
        assert f"rank {r}: ok: bitwise equal to the one-process op" in run.stdout, run.stdout


def test_toy_training_across_hosts(hosts, tmp_path):
    toy_training_matches_one_process(tmp_path, hosts)


def test_stopped_job_reports_every_rank_across_hosts(hosts):
    stopped_job_reports_every_rank(hosts)
