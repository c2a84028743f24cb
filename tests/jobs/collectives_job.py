"""One rank of the 2-rank check of ``lightning_zeromoe.engine.collectives`` (run by tests/test_collectives.py).

For each backend string in ``--backends`` (one free port each, from ``--ports``) the rank joins a
2-rank group over TCP on 127.0.0.1, calls every wrapper and two of the package's real call sites
(``conversion_check._agree_over_ranks``, ``telemetry.global_counts``), then leaves the group. It
writes what it got, values, devices and dtypes, to ``OUT/rank{r}.json``; the test asserts.

    python tests/jobs/collectives_job.py --rank R --ports P1,P2 --backends 'gloo;cpu:gloo;none' --out DIR

With ``--world 1`` (a CUDA machine) the one rank runs :func:`run_single_gpu_checks` instead, for
backends such as ``nccl`` and ``cpu:gloo,cuda:nccl``.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path


def tensor_record(t, original=None) -> dict:
    """What a test needs to know about a returned tensor."""
    return {"value": t.tolist(), "device": str(t.device), "dtype": str(t.dtype),
            "same_object": original is not None and t is original}


def run_checks(rank: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn

    from lightning_zeromoe.engine import collectives
    from lightning_zeromoe.conversion.check import _agree_over_ranks
    from lightning_zeromoe.observe.telemetry import global_counts

    out: dict = {"backend": str(dist.get_backend()), "device": str(collectives.backend_device()),
                 "initialized": collectives.is_initialized()}

    t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    out["sum_float32"] = tensor_record(collectives.all_reduce(t), t)

    t = torch.tensor([rank, 5 - rank], dtype=torch.int32)
    out["min_int32"] = tensor_record(collectives.all_reduce(t, op=dist.ReduceOp.MIN), t)

    base = torch.arange(6, dtype=torch.int64).view(2, 3) * (rank + 1)
    view = base.t()  # not contiguous: reduced through a contiguous copy, written back into `base`
    got = collectives.all_reduce(view)
    out["sum_noncontiguous"] = {**tensor_record(got, view), "base": base.tolist(),
                                "contiguous": view.is_contiguous()}

    t = torch.full((3,), float(rank), dtype=torch.float64)
    out["broadcast_float64"] = tensor_record(collectives.broadcast(t, src=1), t)

    gathered = collectives.all_gather(torch.tensor([rank, 100 + rank], dtype=torch.int32))
    out["all_gather_int32"] = [tensor_record(g) for g in gathered]

    out["all_gather_object"] = collectives.all_gather_object({"rank": rank, "name": f"r{rank}"})
    objects = [{"from": rank}, [rank] * 2] if rank == 0 else [None, None]
    out["broadcast_object_list"] = collectives.broadcast_object_list(objects, src=0)

    both = dist.new_group([0, 1])
    only0 = dist.new_group([0])
    t = torch.ones(2, dtype=torch.bfloat16) * (rank + 1)
    out["subgroup_bfloat16"] = tensor_record(collectives.all_reduce(t, group=both), t)
    t = torch.tensor([7 + rank])
    out["outside_group"] = {"all_reduce": tensor_record(collectives.all_reduce(t, group=only0), t),
                            "all_gather_object": collectives.all_gather_object(rank, group=only0)}
    collectives.barrier(timeout=timedelta(seconds=60))
    collectives.barrier(group=both)

    out["agree_over_ranks"] = _agree_over_ranks([True, rank == 0, rank == 1, True])

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("tokens_per_expert", torch.tensor([rank + 1, 2 * rank], dtype=torch.int64))

    counts = global_counts(nn.Sequential(Counting()))
    out["global_counts"] = {name: tensor_record(c) for name, c in counts.items()}
    return out


def run_single_gpu_checks() -> dict:
    """World of one on CUDA device 0: what only a GPU can show (NCCL serves no CPU tensor)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from lightning_zeromoe.engine import collectives
    from lightning_zeromoe.conversion.check import _agree_over_ranks
    from lightning_zeromoe.observe.telemetry import global_counts

    out: dict = {"backend": str(dist.get_backend()), "device": str(collectives.backend_device())}
    try:
        dist.all_reduce(torch.ones(1, dtype=torch.int32))  # torch itself, a CPU tensor
        out["raw_cpu_all_reduce"] = None
    except RuntimeError as err:
        out["raw_cpu_all_reduce"] = str(err).splitlines()[0]
    t = torch.tensor([3, 1], dtype=torch.int32)
    out["min_int32"] = tensor_record(collectives.all_reduce(t, op=dist.ReduceOp.MIN), t)
    t = torch.ones(2, dtype=torch.bfloat16, device="cuda")
    out["sum_cuda_bfloat16"] = tensor_record(collectives.all_reduce(t), t)
    t = torch.full((2,), 5.0, dtype=torch.float64)
    out["broadcast_float64"] = tensor_record(collectives.broadcast(t, src=0), t)
    out["all_gather_int32"] = [tensor_record(g) for g in collectives.all_gather(torch.tensor([4], dtype=torch.int32))]
    out["all_gather_object"] = collectives.all_gather_object({"rank": 0})
    out["broadcast_object_list"] = collectives.broadcast_object_list([{"from": 0}], src=0)
    collectives.barrier()
    out["agree_over_ranks"] = _agree_over_ranks([True, False])

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("tokens_per_expert", torch.tensor([2, 1], dtype=torch.int64))

    out["global_counts"] = {n: tensor_record(c) for n, c in global_counts(nn.Sequential(Counting())).items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--ports", required=True, help="one free port per backend, comma-separated")
    parser.add_argument("--backends", required=True,
                        help="';'-separated (a backend string may hold commas); 'none': no backend")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--world", type=int, default=2, help="1: the single-GPU checks (needs CUDA)")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    if args.world == 1:
        torch.cuda.set_device(0)

    results = {}
    for backend, port in zip(args.backends.split(";"), args.ports.split(","), strict=True):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group(None if backend == "none" else backend, rank=args.rank, world_size=args.world,
                                timeout=timedelta(seconds=120))
        try:
            results[backend] = run_checks(args.rank) if args.world == 2 else run_single_gpu_checks()
        finally:
            dist.destroy_process_group()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{args.rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
