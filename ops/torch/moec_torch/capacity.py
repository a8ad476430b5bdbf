"""Capacity growth: what a layer does when a step's routing needs more rows
than its compiled binaries hold (capacity_policy "grow" or "error"), in one
process and, collectively, under MPI."""

import warnings


CAPACITY_POLICIES = ("grow", "error")


def _check_policy(policy):
    if not isinstance(policy, str) or policy not in CAPACITY_POLICIES:
        raise ValueError(f"moec: capacity_policy must be 'grow' or 'error', got {policy!r}")


def grow(module, error):
    """After a pass the runtime refused for capacity (`error`; under MPI
    every rank gets it at the same pass), either raises or recompiles with
    room for the routing (the need the runtime recorded) and rebuilds the
    runtime of the MoeFFN `module`; the weights stay. In one process that is
    capacity_policy's choice. Under MPI it is every rank's: before any
    rank recompiles, the ranks exchange their policy and need (bounded
    by timeout_seconds), and all grow only when every rank's policy is
    "grow", else every rank raises, naming the ranks whose policy
    refused; after compiling they exchange whether each could, so that
    none builds the grown runtime alone."""
    message = str(error)
    need = dict(module.layer.capacity_need())
    if module._collective:
        views = module._agree({"policy": module.capacity_policy, "need": need},
                              f"{message}. The ranks could not decide whether to grow the "
                              "layer")
        policies = [v.get("policy") for v in views]
        refusing = [r for r, p in enumerate(policies) if p != "grow"]
        if len(refusing) == len(policies):
            raise error  # every rank's policy is "error": each raises it
        if refusing:
            raise RuntimeError(
                f"{message}. No rank grows the layer: capacity_policy "
                + ", ".join(f"{policies[r]!r} on rank {r}" for r in refusing)
                + " refuses it, and the ranks grow together or not at all ("
                + ", ".join(f"{p!r} on rank {r}" for r, p in enumerate(policies)
                            if r not in refusing) + ")") from None
        for key in ("rows_per_rank", "receive_per_rank"):
            need[key] = max(int(v.get("need", {}).get(key, 0)) for v in views)
    elif module.capacity_policy != "grow":
        raise error
    cfg = dict(module.config)
    # The binaries' own arithmetic (format/Capacity.h), on the config they
    # were compiled from (their layer record).
    advice = dict(zip(("seq_size", "capacity_factor", "row_capacity", "receive_capacity", "fits"),
                      module.layer.capacity_advice(need["rows_per_rank"],
                                                   need["receive_per_rank"], True)))
    if not advice["fits"]:
        raise RuntimeError(
            "moec over capacity: the routing needs more than the largest binary for this "
            f"layer holds ({need['receive_per_rank']} rows on one rank's experts)")
    changes = []
    if advice["seq_size"] != int(cfg["seq_size"]):
        changes.append(f"seq_size {module.tokens} -> {advice['seq_size']}")
        cfg["seq_size"] = advice["seq_size"]
    old_factor = float(cfg.get("capacity_factor", 2))
    if advice["capacity_factor"] != old_factor:
        # Room for the routing that was refused, and then some: a router's
        # balance drifts, and each growth costs a compile.
        cfg["capacity_factor"] = advice["capacity_factor"]
        changes.append(f"capacity_factor {old_factor:g} -> {cfg['capacity_factor']:g}")
    if not changes:
        raise RuntimeError(
            "moec over capacity: the routing needs no more than the config holds, yet the "
            f"runtime refused it ({need}); this is a bug in moec")
    layer = module._recompiled(cfg, not module._trains, f"{message}. The layer grows on no rank",
                               "the grown layer")
    info = layer.info()
    warnings.warn(
        f"moec: a step's routing needed {need['receive_per_rank']} rows on the fullest "
        f"rank's experts (room for {need['receive_capacity']}) and "
        f"{need['rows_per_rank']} routed rows (room for {need['row_capacity']}); "
        f"recompiled with {', '.join(changes)}", RuntimeWarning, stacklevel=3)
    module.config = cfg
    module.layer = layer
    module._binaries = module._made
    module.tokens = info["tokens"]
