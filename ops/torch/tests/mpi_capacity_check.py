"""Run under mpirun -np 2 (by test_mpi.py): growing a layer's capacity is
collective. Every step's routing sends every token to experts 0 and 1 (both
on rank 0), which a binary compiled with capacity_factor 1 cannot hold, so
every rank's forward gets the over-capacity error at the same pass.

    mpirun -np 2 python3 mpi_capacity_check.py MODE

MODE:
  grow             every rank's capacity_policy is "grow": every rank grows
                   its layer, and y and the gradients are bit for bit those
                   of the one-process layer (which grows too) on the same
                   global inputs; prints "rank r: ok: grew ..."
  mixed-construct  rank 1 is made with capacity_policy="error", rank 0 with
                   "grow": every rank's MoeFFN raises ValueError naming both
  mixed-grow       both are made with "grow", then rank 1 sets "error": the
                   overflowing step raises on every rank (rank 0 through
                   forward, rank 1 through submit_forward), naming rank 1's
                   policy and the rank whose experts needed more rows; no
                   rank grows, and a step that fits runs after
  compile-fails    both are "grow", but compiling the grown layer fails on
                   rank 1 (a stand-in for compile_layer raises): every rank
                   raises naming rank 1 and its error, none grows, and a
                   step that fits runs after
  extra-layer      rank 0 makes a second layer that rank 1 does not: rank 0
                   gets an error naming rank 1 within timeout_seconds
                   instead of waiting in MPI's communicator creation
  late-layer       both make a second layer, rank 1 after rank 0 gave up
                   waiting for it: rank 0 raises as in extra-layer, and
                   rank 1, which finds rank 0's word that it came but none
                   that it went on, raises within its timeout too (neither
                   enters MPI's communicator creation alone)

Prints "rank r: raised <Type>: <message>" for an expected error and
"rank r: ok: ..." for an expected success, then "rank r: done in S s"; exits
1 on anything unexpected. timeout_seconds is 3 where a rank waits in
vain (30 in grow, where none does).
"""

import os
import sys
import time
import warnings

import torch

import moec_torch

TIMEOUT = 3.0


def config():
    return {"name": "mpi-capacity", "hidden_size": 64, "intermediate_size": 32,
            "num_experts": 4, "top_k": 2, "ep": 2, "tp": 1, "seq_size": 128,
            "dtype": "fp32", "capacity_factor": 1}


def global_inputs(ranks, tokens, hidden):
    """x [R, S, H], topk_ids, topk_weights [R, S, 2]: every token to
    experts 0 and 1 (rank 0's), 512 rows where the binary holds 256."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(ranks, tokens, hidden, generator=g)
    ids = torch.stack([torch.zeros(ranks, tokens, dtype=torch.long),
                       torch.ones(ranks, tokens, dtype=torch.long)], dim=-1)
    weights = torch.rand(ranks, tokens, 2, generator=g) * 0.8 + 0.2
    dy = torch.randn(ranks, tokens, hidden, generator=g)
    return x, ids, weights, dy


def step(layer, x, ids, weights, dy):
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    y = layer(x, ids, weights)
    y.backward(dy)
    return y.detach(), x.grad, weights.grad, layer.w1.grad, layer.w2.grad


def mode_grow(rank):
    torch.manual_seed(0)
    # Nothing waits here but for a peer's compile: a timeout that no loaded
    # machine meets.
    layer = moec_torch.MoeFFN(config(), fabric="mpi", threads=1, timeout_seconds=30.0)
    before = layer.layer.info()["receive_capacity"]
    x, ids, weights, dy = global_inputs(layer.ranks, layer.tokens, layer.hidden)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = step(layer, x[rank], ids[rank], weights[rank], dy[rank])
    grew = [w for w in caught if "recompiled with" in str(w.message)]
    after = layer.layer.info()["receive_capacity"]
    if len(grew) != 1 or after <= before:
        print(f"rank {rank}: FAIL: expected one growth, got {len(grew)} warnings and receive "
              f"capacity {before} -> {after}", flush=True)
        return 1
    torch.manual_seed(0)
    single = moec_torch.MoeFFN(config(), 2, fabric="inproc", threads=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = step(single, x, ids, weights, dy)
    L = layer.local_experts
    want = (want[0][rank], want[1][rank], want[2][rank], want[3][rank * L:(rank + 1) * L],
            want[4][rank * L:(rank + 1) * L])
    for name, a, b in zip(("y", "dx", "dtopk_weights", "dw1", "dw2"), got, want):
        if not torch.equal(a, b):
            print(f"rank {rank}: FAIL: {name} differs from the one-process op by "
                  f"{(a - b).abs().max().item():.3g}", flush=True)
            return 1
    if layer.config["capacity_factor"] != single.config["capacity_factor"]:
        print(f"rank {rank}: FAIL: capacity_factor {layer.config['capacity_factor']} here, "
              f"{single.config['capacity_factor']} in one process", flush=True)
        return 1
    print(f"rank {rank}: ok: grew (receive capacity {before} -> {after}, capacity_factor "
          f"{layer.config['capacity_factor']:g}); bitwise equal to the one-process op",
          flush=True)
    return 0


def mode_mixed_construct(rank):
    try:
        moec_torch.MoeFFN(config(), fabric="mpi", threads=1, timeout_seconds=TIMEOUT,
                          capacity_policy="error" if rank == 1 else "grow")
    except ValueError as e:
        print(f"rank {rank}: raised ValueError: {e}", flush=True)
        return 0
    print(f"rank {rank}: FAIL: the layer was made", flush=True)
    return 1


def mode_mixed_grow(rank, compile_fails=False):
    layer = moec_torch.MoeFFN(config(), fabric="mpi", threads=1, timeout_seconds=TIMEOUT)
    if rank == 1 and not compile_fails:
        layer.capacity_policy = "error"
    if rank == 1 and compile_fails:
        def compile_layer(*args, **kwargs):
            raise RuntimeError("moec compile moe_ffn_fwd.json failed:\nno space left (a test)")
        moec_torch.cache.compile_layer = compile_layer
    before = dict(layer.config)
    x, ids, weights, _ = global_inputs(layer.ranks, layer.tokens, layer.hidden)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if rank == 0:
                layer(x[rank], ids[rank], weights[rank])
            else:
                layer.submit_forward(x[rank], ids[rank], weights[rank]).wait()
        print(f"rank {rank}: FAIL: the step ran", flush=True)
        return 1
    except RuntimeError as e:
        print(f"rank {rank}: raised RuntimeError: {e}", flush=True)
    if caught or layer.config != before:
        print(f"rank {rank}: FAIL: the layer grew ({[str(w.message) for w in caught]})",
              flush=True)
        return 1
    # Nothing was grown or broken: a step that fits runs on every rank.
    g = torch.Generator().manual_seed(rank)
    S = layer.tokens // 2  # at most 2 ranks x 64 tokens x 2 = 256 rows on a rank's experts
    fits = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(S)])
    y = layer(x[rank, :S], fits, weights[rank, :S])
    print(f"rank {rank}: ok: a step that fits ran after (y {list(y.shape)})", flush=True)
    return 0


def mode_extra_layer(rank, late=False):
    moec_torch.MoeFFN(config(), fabric="mpi", threads=1, timeout_seconds=TIMEOUT)
    if rank != 0 and not late:
        print(f"rank {rank}: ok: made one layer", flush=True)
        return 0
    if rank != 0:
        time.sleep(TIMEOUT + 2)
    start = time.monotonic()
    try:
        moec_torch.MoeFFN(dict(config(), name="extra"), fabric="mpi", threads=1,
                          timeout_seconds=TIMEOUT)
    except RuntimeError as e:
        print(f"rank {rank}: raised RuntimeError after {time.monotonic() - start:.1f} s: {e}",
              flush=True)
        return 0
    print(f"rank {rank}: FAIL: the second layer was made", flush=True)
    return 1


def main():
    torch.set_num_threads(1)
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    mode = sys.argv[1]
    start = time.monotonic()
    code = {"grow": mode_grow, "mixed-construct": mode_mixed_construct,
            "mixed-grow": mode_mixed_grow,
            "compile-fails": lambda r: mode_mixed_grow(r, compile_fails=True),
            "extra-layer": mode_extra_layer,
            "late-layer": lambda r: mode_extra_layer(r, late=True)}[mode](rank)
    moec_torch.finalize_mpi()
    print(f"rank {rank}: done in {time.monotonic() - start:.1f} s", flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
