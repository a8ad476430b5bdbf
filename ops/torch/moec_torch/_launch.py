"""Loading the op library, and how the process was started: mpirun or
torchrun, the fabric a layer runs over (in process, MPI, a torch.distributed
group), and ending the fabrics at exit."""

import atexit
import os

import torch

from . import checks, native

_loaded = False


def load_library():
    """Loads the op library once (torch.ops.moec, torch.classes.moec)."""
    global _loaded
    if not _loaded:
        lib = native.op_library_path()
        if not lib.is_file():
            raise RuntimeError(
                f"moec: the op library {lib} does not exist; install the moec_torch package, "
                "build it with 'bazel build //ops/torch:moec_torch.so', or set MOEC_TORCH_LIB")
        torch.ops.load_library(str(lib))
        _loaded = True


def launched_by_mpi():
    """True when this process was started by mpirun (or another PMI launcher)."""
    return any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def launched_by_torchrun():
    """True when torchrun (torch.distributed.run, torch's elastic agent)
    started this process: it sets TORCHELASTIC_RUN_ID, RANK and WORLD_SIZE
    for torch.distributed's env:// rendezvous."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def _world_size():
    for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if v in os.environ:
            return int(os.environ[v])
    raise ValueError("moec: cannot tell the number of MPI processes; pass ranks=")


_finalize_registered = False
_groups_registered = False


def _distributed():
    """True when torch.distributed is initialized in this process."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def _default_fabric():
    """"mpi" when mpirun started the process, else "group" when
    torch.distributed is initialized with more than one process, else
    "inproc"."""
    if launched_by_mpi():
        return "mpi"
    if _distributed():
        import torch.distributed as dist
        if dist.get_world_size() > 1:
            return "group"
    return "inproc"


def _fabric(fabric, group, ranks, tp, who):
    """(fabric, ranks, group): the fabric ("inproc", "mpi" or "group"), the
    EP group's size and the torch.distributed group the ranks are (for
    "group"). Default: "mpi" when mpirun started the process, else "group"
    over the world group when torch.distributed is initialized with more
    than one process, else "inproc". Under "mpi" and "group" the ranks default to the processes
    (the group's size) over tp; one process runs one rank of the [ep, tp]
    mesh, rank r of the group the mesh's rank r (ep rank r // tp, tp rank
    r % tp)."""
    if group is not None:
        if fabric not in (None, "group"):
            raise ValueError(f"moec: {who}: group= runs the ranks over a torch.distributed "
                             f"group, and fabric={fabric!r} says otherwise (leave it out, or "
                             "pass fabric='group')")
        fabric = "group"
    if fabric is None:
        fabric = _default_fabric()
    if fabric not in ("inproc", "mpi", "group"):
        raise ValueError(f"moec: fabric must be 'inproc', 'mpi' or 'group', got {fabric!r}")
    processes = None
    if fabric == "mpi":
        processes = _world_size() if ranks is None else None
    elif fabric == "group":
        import torch.distributed as dist
        if group is None:
            if not _distributed():
                raise ValueError(f"moec: {who}: fabric='group' needs torch.distributed "
                                 "initialized (torch.distributed.init_process_group, as "
                                 "torchrun's scripts do) or group=")
            group = dist.group.WORLD
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"moec: {who}: group must be a torch.distributed process group "
                            f"(torch.distributed.new_group, or group.WORLD), got "
                            f"{type(group).__name__}")
        processes = group.size()
        if ranks is not None and ranks * tp != processes:
            raise ValueError(f"moec: {who}: ranks={ranks} with tp={tp} is a mesh of "
                             f"{ranks * tp} ranks, and the group has {processes} processes "
                             "(one rank each)")
    if ranks is None:
        if processes is None:
            raise ValueError(f"moec: {who} needs ranks= (the EP group's size)")
        if processes % tp:
            raise ValueError(f"moec: {processes} processes do not make an [ep, tp] mesh with "
                             f"tp={tp} (ep * tp processes are needed)")
        ranks = processes // tp
    return fabric, checks.integer(ranks, f"{who}: argument 'ranks'", minimum=1), group


def _fabric_args(fabric, group):
    """The constructor arguments that name the fabric's group: its handle
    and timeout (native.group_handle) for "group", else none."""
    if fabric != "group":
        return 0, 0.0
    return native.group_handle(group)


def _register_finalize(fabric):
    """Runs finalize_mpi at exit once an MPI runtime object exists, and
    close_groups once one over a torch.distributed group does; called
    before creating one, whose construction may start MPI and then fail."""
    global _finalize_registered, _groups_registered
    if fabric == "mpi" and not _finalize_registered:
        atexit.register(finalize_mpi)
        _finalize_registered = True
    if fabric == "group" and not _groups_registered:
        atexit.register(close_groups)
        _groups_registered = True


def finalize_mpi():
    """Frees every MPI layer's runtime (collectively: every rank calls this
    once, at the end) and finalizes MPI if moec started it. The layers refuse
    passes after. Registered to run at exit once an MPI layer exists."""
    if _loaded:
        torch.ops.moec.finalize_mpi()


def close_groups(seconds=10.0):
    """Ends moec's fabrics over torch.distributed groups: tells every peer
    and waits at most `seconds` for theirs (collectively: every rank calls
    this once, at the end, before torch.distributed.destroy_process_group).
    Layers over a group fail their passes after. Registered to run at exit
    once such a layer exists."""
    if _loaded:
        torch.ops.moec.close_groups(float(seconds))
