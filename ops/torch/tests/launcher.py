"""What the check scripts need of the launcher that started them: mpirun
(the MPI fabric) or torchrun (the fabric over torch.distributed's world
group, gloo). The same script runs under either."""

import os
import sys
import time

import moec_torch


def fabric():
    """"group" under torchrun (torch.distributed initialized here, gloo),
    else "mpi"."""
    if not moec_torch.launched_by_torchrun():
        return "mpi"
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return "group"


def processes():
    """The processes of the job."""
    if fabric() == "group":
        import torch.distributed as dist
        return dist.get_world_size()
    return moec_torch._world_size()


def finish():
    """Ends moec's fabric collectively, as a script does at its end."""
    if fabric() == "group":
        moec_torch.close_groups()
    else:
        moec_torch.finalize_mpi()


def expect_error(rank, run):
    """Calls run(mark); prints "rank r: raised after T s: <the error>" for
    the RuntimeError it raises (T since run's start, or since its last
    call of mark()), or "rank r: no error", and ends the process at once
    with 0 or 1 (the job's fabric is not usable after a failure)."""
    start = [time.monotonic()]
    try:
        run(lambda: start.__setitem__(0, time.monotonic()))
        print(f"rank {rank}: no error", flush=True)
        code = 1
    except RuntimeError as e:
        print(f"rank {rank}: raised after {time.monotonic() - start[0]:.1f} s: {e}", flush=True)
        code = 0
    sys.stdout.flush()
    os._exit(code)
