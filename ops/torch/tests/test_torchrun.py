"""The torch op in jobs that torchrun starts, one rank per process over
torch.distributed's world group (gloo): moec's process-group fabric.

  - the op's forward and backward, bit for bit against the one-process op
    and against autograd (mpi_layer_check.py, which runs under either
    launcher): fp32 and bf16, LoRA, main_grad, frozen, FP8 dispatch, ETP,
    a quantized base; two EP groups of new_group inside a world of 4; a
    layer idle longer than its group's timeout;
  - DistributedDataParallel around a model with the layer (prepare_ddp,
    ddp_check.py), also with two EP groups inside data parallelism;
  - activation checkpointing around the layer (checkpointing_check.py);
  - dispatch and combine as ops of their own (mpi_exchange_check.py);
  - the toy training (examples/torch/train_toy.py): bitwise the one-process
    run after 4 steps (also in DistributedDataParallel, and resumed from a
    checkpoint by another launcher), and the loss falls; a patched Hugging Face-structured
    model (mpi_hf_check.py) and the fine-tuning example
    (examples/hf/finetune.py);
  - faults: a put lost on its way (every rank raises, rank 0 reports every
    rank), a rank killed mid-pass (rank 0 raises naming it, torchrun ends
    the job), ranks whose configs differ (both raise, naming the ranks), a
    layer only rank 0 makes (rank 0 raises after the timeout, naming rank 1);
  - across 2 simulated hosts, torchrun on each with the c10d rendezvous:
    1 + 1 and 2 + 2 ranks, the toy training, a link cut mid-pass
    (//ops/torch:torch_hosts_test runs these, -k across_hosts).

Debian's torchrun (PyTorch 1.13, Python 3.11) needs --tee and --redirects
to name a stream each (the default "0" maps to none on Python 3.11 and
torchrun stops in to_map): every call here passes "--tee 2 --redirects 2"."""

import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from test_mpi import (HERE, TOY, check_stop_report, check_toy, free_port,  # noqa: F401
                      hf_example_runs, hosts, needs_test_hooks,
                      one_process_toy)  # (hosts: a fixture)

TORCHRUN = shutil.which("torchrun") or "torchrun"


# torchrun's agent picks the workers' MASTER_PORT by binding a free port and
# letting it go; rank 0 binds it again later, and a process started in
# between (another test's) can take it first.
PORT_TAKEN = "errno: 98 - Address already in use"


def torchrun(ranks, *args, timeout=240, extra_env=None, options=()):
    """torchrun --standalone --nproc_per_node RANKS ARGS on this machine;
    again (up to twice) where the job died because its rendezvous port had
    been taken (PORT_TAKEN) before rank 0 bound it."""
    env = dict(os.environ, **(extra_env or {}))
    for _ in range(3):
        logs = Path(os.environ.get("TEST_TMPDIR", "/tmp")) / f"torchrun-{uuid.uuid4().hex}"
        cmd = [TORCHRUN, "--standalone", "--nproc_per_node", str(ranks), "--tee", "2",
               "--redirects", "2", "--log_dir", str(logs), *options, *map(str, args)]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if run.returncode == 0 or PORT_TAKEN not in run.stdout + run.stderr:
            return run
        print(f"torchrun: the rendezvous port was taken ({PORT_TAKEN}); running the job again",
              file=sys.stderr)
    return run


@pytest.mark.parametrize("ranks,dtype,hot,variant,tp", [
    (2, "fp32", -1, "full", 1), (3, "bf16", 0, "full", 1), (2, "bf16", -1, "lora", 1),
    (2, "fp32", -1, "main_grad", 1), (2, "bf16", -1, "frozen", 1), (2, "bf16", -1, "fp8", 1),
    (4, "fp32", 1, "full", 2), (2, "bf16", -1, "fp8_block128", 1), (4, "bf16", 0, "lora", 2)])
def test_op_under_torchrun(ranks, dtype, hot, variant, tp):
    run = torchrun(ranks, HERE / "mpi_layer_check.py", dtype, 0, hot, variant, tp)
    assert run.returncode == 0, run.stdout + run.stderr
    for r in range(ranks):
        assert f"rank {r}: ok: bitwise equal to the one-process op" in run.stdout, run.stdout


def test_ep_groups_inside_data_parallelism_under_torchrun():
    """4 processes, two EP groups of 2 (new_group([0, 1]), new_group([2,
    3])), each layer over its own group: bitwise the one-process layer on
    that group's inputs (group_subgroups_check.py)."""
    run = torchrun(4, HERE / "group_subgroups_check.py")
    assert run.returncode == 0, run.stdout + run.stderr
    for world, (g, r) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        assert f"rank {world} (group {g}, rank {r}): ok" in run.stdout, run.stdout


@pytest.mark.parametrize("variant,ranks", [("full", 2), ("lora", 2), ("groups", 4),
                                           ("groups_bf16", 4), ("tp", 4), ("zero", 2),
                                           ("refusals", 2)])
def test_ddp_around_the_layer_under_torchrun(variant, ranks, tmp_path):
    """DistributedDataParallel around a model with the layer, after
    moec_torch.prepare_ddp: the parameters after SGD steps are the
    one-process model's trained on the mean of the processes' losses, and
    DDP's construction leaves each process's experts alone (ddp_check.py);
    "groups": two EP groups of 2 inside data parallelism over 4 processes
    (also in bf16, whose gradients are summed in fp32);
    "tp": EP 2 x TP 2 over 4 processes; "zero": the replicated parameters
    under ZeroRedundancyOptimizer (split_parameters), the experts under one
    of their own;
    "refusals": what prepare_ddp refuses, and what it leaves to DDP. Each
    process's state dict saved, merge_state_dicts makes the one-process
    model's of them."""
    run = torchrun(ranks, HERE / "ddp_check.py", variant, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    for r in range(ranks):
        assert f"rank {r}: ddp ok" in run.stdout, run.stdout


@pytest.mark.parametrize("ddp", [False, True])
def test_activation_checkpointing_under_torchrun(ddp):
    """torch.utils.checkpoint (reentrant and not) around the router and the
    layer, bare and inside DDP after prepare_ddp: the gradients bitwise the
    plain run's (checkpointing_check.py)."""
    run = torchrun(2, HERE / "checkpointing_check.py", *(["ddp"] if ddp else []))
    assert run.returncode == 0, run.stdout + run.stderr
    for r in range(2):
        assert f"rank {r}: checkpointing ok" in run.stdout, run.stdout


def test_layer_idle_longer_than_the_group_timeout():
    """A group with a 2 s timeout, 7 s without a pass between two passes:
    the fabric's keep-alive messages keep gloo from closing the group
    (group_idle_check.py; without them the second pass fails)."""
    run = torchrun(2, HERE / "group_idle_check.py", timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    for r in range(2):
        assert f"rank {r}: idle ok" in run.stdout, run.stdout


def test_exchange_under_torchrun():
    run = torchrun(2, HERE / "mpi_exchange_check.py", "bf16")
    assert run.returncode == 0, run.stdout + run.stderr
    for r in range(2):
        assert f"rank {r}: ok: bitwise equal to the one-process exchange" in run.stdout, run.stdout


def test_hf_model_under_torchrun(tmp_path):
    run = torchrun(2, HERE / "mpi_hf_check.py", "qwen3_moe", "modules", tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    for r in range(2):
        assert f"rank {r}: hf ok" in run.stdout, run.stdout


def test_hf_example_under_torchrun(tmp_path):
    hf_example_runs(tmp_path, torchrun)


def test_toy_training_under_torchrun_matches_one_process(tmp_path):
    want = one_process_toy(tmp_path)
    run = torchrun(2, TOY, "--steps", "4", "--ranks", "2", "--threads", "1", "--torch-threads",
                   "1", "--save", tmp_path / "group.pt")
    check_toy(want, run, tmp_path / "group.pt", 2)


def test_toy_training_in_ddp_under_torchrun_matches_one_process(tmp_path):
    """The toy training with the model in DistributedDataParallel (--ddp:
    prepare_ddp, each process its own mean loss): with 2 ranks, bitwise the
    one-process run after 4 steps too (DDP's halving is exact)."""
    want = one_process_toy(tmp_path)
    run = torchrun(2, TOY, "--steps", "4", "--ranks", "2", "--threads", "1", "--torch-threads",
                   "1", "--ddp", "--save", tmp_path / "ddp.pt")
    assert "in DistributedDataParallel" in run.stdout, run.stdout + run.stderr
    check_toy(want, run, tmp_path / "ddp.pt", 2)


def test_toy_training_resumed_by_another_launcher_goes_on_as_uninterrupted(tmp_path):
    """A checkpoint (--checkpoint: each process's model and optimizer state
    by name) of 2 steps under torchrun, each process its experts and Adam
    moments, resumed (--resume: merged, then loaded) in one process for 2
    more; and one of a one-process run resumed under torchrun, in DDP:
    either way the parameters after 4 steps are bitwise those of the
    uninterrupted one-process run."""
    want = one_process_toy(tmp_path)
    common = ["--ranks", "2", "--threads", "1", "--torch-threads", "1"]
    run = torchrun(2, TOY, "--steps", "2", *common, "--checkpoint", tmp_path / "ck")
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(f.name for f in (tmp_path / "ck").iterdir()) == ["rank0.pt", "rank1.pt"]
    one = subprocess.run([sys.executable, str(TOY), "--steps", "4", *common, "--fabric",
                          "inproc", "--resume", str(tmp_path / "ck"), "--save",
                          str(tmp_path / "resumed.pt")],
                         capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stdout + one.stderr
    assert "2 steps in" in one.stdout, one.stdout
    got = torch.load(tmp_path / "resumed.pt", weights_only=True)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    one = subprocess.run([sys.executable, str(TOY), "--steps", "2", *common, "--fabric",
                          "inproc", "--checkpoint", str(tmp_path / "ck1")],
                         capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stdout + one.stderr
    run = torchrun(2, TOY, "--steps", "4", *common, "--ddp", "--resume", tmp_path / "ck1",
                   "--save", tmp_path / "group.pt")
    check_toy(want, run, tmp_path / "group.pt", 2)


def test_toy_training_loss_falls_under_torchrun():
    run = torchrun(2, TOY, "--steps", "60", "--ranks", "2", "--threads", "1")
    assert run.returncode == 0, run.stdout + run.stderr
    losses = [float(line.split()[-1]) for line in run.stdout.splitlines()
              if line.startswith("step")]
    assert losses and losses[-1] < 0.2 * losses[0], run.stdout


def test_stopped_job_under_torchrun_reports_every_rank():
    needs_test_hooks()
    check_stop_report(torchrun(2, HERE / "mpi_stop_check.py", timeout=120,
                               extra_env={"MOEC_TEST_DROP_PUT": "1:2"}))


def test_rank_killed_mid_pass_under_torchrun():
    start = time.monotonic()
    run = torchrun(2, HERE / "group_fault_check.py", "kill", timeout=120)
    out = run.stdout + run.stderr
    assert time.monotonic() - start < 60, out
    found = re.search(r"rank 0: raised after ([\d.]+) s: moec forward: \[rank 0\] .*to rank 1 "
                      r"failed \(rank 1 died, or its link is down\)", out)
    assert found and float(found.group(1)) < 3, out
    assert "[rank 1] no report within" in out, out
    # torchrun's own handling: the job fails, naming the killed rank.
    assert run.returncode != 0, out
    assert re.search(r"exitcode: -9\) local_rank: 1", out), out


def test_ranks_with_other_configs_under_torchrun():
    run = torchrun(2, HERE / "group_fault_check.py", "configs", timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    for r in range(2):
        assert re.search(rf"rank {r}: raised after [\d.]+ s: moec context: ranks 0 and 1 run "
                         "different layers", out), out


GROUP_OF_ONE = """
import sys, torch, torch.distributed as dist, moec_torch
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
cfg = {"name": "one", "hidden_size": 64, "intermediate_size": 32, "num_experts": 4,
       "top_k": 2, "ep": 1, "tp": 1, "seq_size": 64, "dtype": "fp32"}
torch.manual_seed(0)
two = moec_torch.MoeFFN(cfg, 2, threads=1)          # a world of one: in process
print("default with ranks=2:", two.fabric, two.ranks)
torch.manual_seed(0)
group = moec_torch.MoeFFN(cfg, fabric="group", threads=1)
torch.manual_seed(0)
single = moec_torch.MoeFFN(cfg, 1, fabric="inproc", threads=1)
print("group:", group.fabric, group.ranks)
g = torch.Generator().manual_seed(1)
x = torch.randn(64, 64, generator=g)
ids = torch.rand(64, 4, generator=g).argsort(dim=1)[:, :2]
w = torch.rand(64, 2, generator=g)
print("bitwise:", torch.equal(group(x, ids, w), single(x[None], ids[None], w[None])[0]))
try:
    moec_torch.MoeFFN(cfg, 2, group=dist.group.WORLD)
except ValueError as e:
    print("refused:", e)
moec_torch.close_groups()
"""


def test_group_of_one_process(tmp_path):
    """torch.distributed initialized with one process: MoeFFN(cfg, 2) stays
    in process; fabric="group" runs one rank over it, bitwise the
    in-process layer; ranks that the group cannot hold are refused."""
    run = subprocess.run([sys.executable, "-c", GROUP_OF_ONE, str(tmp_path / "store")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "default with ranks=2: inproc 2" in run.stdout, run.stdout
    assert "group: group 1" in run.stdout and "bitwise: True" in run.stdout, run.stdout
    assert "refused: moec: MoeFFN: ranks=2 with tp=1 is a mesh of 2 ranks, and the group has 1 " \
           "processes" in run.stdout, run.stdout


def test_layer_only_one_rank_makes_under_torchrun():
    """Rank 0 makes a second layer that rank 1 never makes: rank 0 gets an
    error naming rank 1 after timeout_seconds (3), not a wait without end."""
    run = torchrun(2, HERE / "group_fault_check.py", "extra-layer", timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "rank 1: ok: made one layer" in out, out
    found = re.search(r"rank 0: raised after ([\d.]+) s: moec context: .*rank 0: rank 1 did not "
                      r"reach the exchange within 3 s", out)
    assert found and float(found.group(1)) < 15, out


# Across 2 simulated hosts: torchrun on each, the c10d rendezvous on
# moec-h0. //ops/torch:torch_hosts_test runs these alone (-k across_hosts).
def torchrun_on_hosts(bed, per_host, *args, timeout=240, logs=None, wait=True):
    """torchrun on moec-h0 and moec-h1, `per_host` processes each, over the
    c10d rendezvous on moec-h0. Returns the two Popen (`wait` False) or
    their (returncode, output) pairs."""
    sh = os.environ["MOEC_HOSTS_SH"]
    port = free_port()
    run_id = uuid.uuid4().hex[:8]
    env = dict(os.environ, PATH=os.environ["PATH"] + ":/usr/sbin:/sbin", GLOO_SOCKET_IFNAME="eth0")
    logs = logs or Path(os.environ.get("TEST_TMPDIR", "/tmp")) / f"torchrun-{run_id}"
    procs = []
    for host in range(2):
        cmd = ["bash", sh, "run", f"moec-h{host}", TORCHRUN, "--nnodes", "2",
               "--nproc_per_node", str(per_host), "--rdzv_backend", "c10d", "--rdzv_endpoint",
               f"moec-h0:{port}", "--rdzv_id", run_id, "--tee", "2", "--redirects", "2",
               "--log_dir", f"{logs}/h{host}", *map(str, args)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    if not wait:
        return procs
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += "\n(timed out)"
        results.append((p.returncode, out))
    return results


@pytest.mark.parametrize("per_host,dtype,variant,tp", [(1, "fp32", "full", 1),
                                                       (1, "bf16", "lora", 1),
                                                       (2, "bf16", "full", 1),
                                                       (2, "fp32", "main_grad", 2)])
def test_op_across_hosts_under_torchrun(hosts, per_host, dtype, variant, tp):  # noqa: F811
    results = torchrun_on_hosts(hosts, per_host, HERE / "mpi_layer_check.py", dtype, 0, -1,
                                variant, tp)
    out = "\n".join(o for _, o in results)
    assert all(code == 0 for code, _ in results), out
    for r in range(2 * per_host):
        assert f"rank {r}: ok: bitwise equal to the one-process op" in out, out


def test_toy_training_across_hosts_under_torchrun(hosts, tmp_path):  # noqa: F811
    want = one_process_toy(tmp_path)
    results = torchrun_on_hosts(hosts, 1, TOY, "--steps", "4", "--ranks", "2", "--threads", "1",
                                "--torch-threads", "1", "--save", tmp_path / "hosts.pt")
    both = SimpleNamespace(returncode=max(code for code, _ in results), stderr="",
                           stdout="\n".join(o for _, o in results))
    check_toy(want, both, tmp_path / "hosts.pt", 2)


def test_link_cut_across_hosts_under_torchrun(hosts, tmp_path):  # noqa: F811
    """moec-h1's link cut while both ranks run passes: each rank raises
    within the timeout (3 s, and the time to report), naming its peer. The
    link is cut once both ranks say their passes run (making the layer can
    take many seconds on a loaded machine), not after a fixed wait."""
    procs = torchrun_on_hosts(hosts, 1, HERE / "group_fault_check.py", "passes", wait=False)
    sh = os.environ["MOEC_HOSTS_SH"]
    env = dict(os.environ, PATH=os.environ["PATH"] + ":/usr/sbin:/sbin")
    lines = [[], []]
    running = [threading.Event(), threading.Event()]

    def read(i):
        for line in procs[i].stdout:
            lines[i].append(line)
            if re.search(r"rank \d+: passes run", line):
                running[i].set()

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
    for t in readers:
        t.start()
    try:
        started = time.monotonic()
        for i in range(2):
            running[i].wait(timeout=max(1, 180 - (time.monotonic() - started)))
        assert all(e.is_set() for e in running), "".join(lines[0] + lines[1])
        time.sleep(1)  # a few passes under way
        subprocess.run(["bash", sh, "run", "moec-h1", "ip", "link", "set", "eth0", "down"],
                       env=env, check=True)
        cut = time.monotonic()
        for i, p in enumerate(procs):
            try:
                p.wait(timeout=max(1, 60 - (time.monotonic() - cut)))
            except subprocess.TimeoutExpired:
                p.kill()
                lines[i].append("\n(still running 60 s after the cut)")
            readers[i].join(timeout=10)
    finally:
        subprocess.run(["bash", sh, "run", "moec-h1", "ip", "link", "set", "eth0", "up"], env=env)
        for p in procs:
            p.kill()
    outs = ["".join(lines[0]), "".join(lines[1])]
    out = "\n".join(outs)
    assert "rank 0: passes run" in out and "rank 1: passes run" in out, out
    for r, peer in ((0, 1), (1, 0)):
        found = re.search(rf"rank {r}: raised after ([\d.]+) s: moec forward: .*rank {peer}", out)
        assert found and float(found.group(1)) < 30, out
