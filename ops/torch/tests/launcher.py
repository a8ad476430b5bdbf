"""What the check scripts need of the launcher that started them: mpirun
(the MPI fabric) or torchrun (the fabric over torch.distributed's world
group, gloo). The same script runs under either."""

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
