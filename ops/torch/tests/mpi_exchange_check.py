"""Run under mpirun or torchrun (by test_mpi.py, test_torchrun.py): moec_torch.Exchange with one rank per
process. Every process draws the same global inputs and expert weights from
a seed, dispatches its rank's tokens, runs its own experts in plain PyTorch,
combines, and runs backward; it checks every result bit for bit against the
one-process exchange (in-process fabric, all ranks) on the same inputs, in
this same process, and against PyTorch autograd on the whole layer.

Prints "rank r: ok ..." and exits 0, or says what differs and exits 1.

    mpirun -np R python3 mpi_exchange_check.py [fp32|bf16]
"""

import sys

import torch

import launcher
import moec_torch
from moec_torch import reference

from test_exchange import plain_experts


def main():
    dtype = sys.argv[1] if len(sys.argv) > 1 else "fp32"
    torch.set_num_threads(1)
    R = launcher.processes()
    cfg = {"name": "mpi-exchange", "hidden_size": 64, "intermediate_size": 32,
           "num_experts": 2 * R, "top_k": 2, "ep": 1, "tp": 1, "seq_size": 64,
           "dtype": dtype, "capacity_factor": 4}
    ex = moec_torch.Exchange(cfg, threads=1, fabric=launcher.fabric())
    single = moec_torch.Exchange(cfg, R, threads=1, fabric="inproc")
    r, L, S, E, H, I = ex.first_rank, ex.local_experts, ex.tokens, ex.experts, ex.hidden, 32
    g = torch.Generator().manual_seed(1)
    tdt = ex.dtype
    x = (torch.rand(R, S, H, generator=g) * 2 - 1).to(tdt)
    ids = torch.rand(R * S, E, generator=g).argsort(dim=1)[:, :2].reshape(R, S, 2)
    weights = torch.rand(R, S, 2, generator=g) * 0.8 + 0.2
    dy = (torch.rand(R, S, H, generator=g) * 2 - 1).to(tdt)
    w1 = (torch.rand(E, H, 2 * I, generator=g) * 0.2 - 0.1).to(tdt)
    w2 = (torch.rand(E, I, H, generator=g) * 0.2 - 0.1).to(tdt)

    def run(exchange, xs, idss, ws, dys, w1s, w2s):
        xs = xs.clone().requires_grad_()
        ws = ws.clone().requires_grad_()
        w1s = w1s.clone().requires_grad_()
        w2s = w2s.clone().requires_grad_()
        expert_x, counts, handle = exchange.dispatch(xs, idss, ws)
        y = exchange.combine(plain_experts(expert_x, counts, w1s, w2s), handle)
        y.backward(dys)
        return {"expert_x": expert_x.detach(), "counts": counts, "y": y.detach(),
                "dx": xs.grad, "dtopk_weights": ws.grad, "dw1": w1s.grad, "dw2": w2s.grad}

    mine = slice(r * L, (r + 1) * L)
    got = run(ex, x[r], ids[r], weights[r], dy[r], w1[mine], w2[mine])
    whole = run(single, x, ids, weights, dy, w1, w2)
    first = int(whole["counts"][:r * L].sum())
    rows = slice(first, first + int(whole["counts"][mine].sum()))
    want = {"expert_x": whole["expert_x"][rows], "counts": whole["counts"][mine],
            "y": whole["y"][r], "dx": whole["dx"][r], "dtopk_weights": whole["dtopk_weights"][r],
            "dw1": whole["dw1"][mine], "dw2": whole["dw2"][mine]}
    failed = [n for n in got if not torch.equal(got[n], want[n])]

    xd = x.double().requires_grad_()
    yd = reference.moe_ffn(xd, ids, weights.double(), w1.double(), w2.double())
    scale = yd[r].abs().max().item()
    err = (got["y"].double() - yd[r]).abs().max().item() / scale
    tol = 1e-4 if dtype == "fp32" else 3e-2
    if failed or not err <= tol:
        print(f"rank {r}: FAILED: not bitwise equal to the one-process exchange: {failed}; "
              f"y against autograd {err:.1e} (tolerance {tol})", flush=True)
        return 1
    print(f"rank {r}: ok: bitwise equal to the one-process exchange; y against autograd "
          f"{err:.1e}", flush=True)
    launcher.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
