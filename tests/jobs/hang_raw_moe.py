"""A hand-written, non-leaf MoE block under raw DeepSpeed ZeRO-3 on 2 CPU ranks, with disjoint routing.

    python tests/jobs/hang_raw_moe.py --dir DIR --timeout 6     # starts its 2 ranks itself

The block runs only the experts its tokens were routed to (the usual ``for e in used: experts[e](x)``
loop), and rank 0's data routes to expert 0, rank 1's to expert 1. ZeRO-3 gathers each expert when it
is entered, so the ranks' all-gathers part at the first expert. Each rank records the Flight Recorder
(:mod:`lightning_zeromoe.engine.flight_recorder`, as the strategy does) and writes its trace to DIR when
it fails, or at the end.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path

warnings.filterwarnings("ignore")


class NonLeafMoE:
    """Built lazily (torch imported in the ranks only)."""

    @staticmethod
    def build(hidden: int, experts: int):
        import torch

        class Block(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.router = torch.nn.Linear(hidden, experts, bias=False)
                self.experts = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(experts))

            def forward(self, x):
                choice = self.router(x).argmax(-1)
                out = torch.zeros_like(x)
                for e in choice.unique().tolist():  # only the experts this rank's tokens chose
                    mask = choice == e
                    out[mask] = self.experts[e](x[mask])
                return out

        class Model(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inp = torch.nn.Linear(hidden, hidden)
                self.moe = Block()
                self.out = torch.nn.Linear(hidden, 1)

            def forward(self, x):
                return self.out(self.moe(self.inp(x))).mean()

        return Model()


def rank_main(args: argparse.Namespace) -> None:
    import deepspeed
    import torch

    from lightning_zeromoe.engine import apply_timeout_to_all_groups, flight_recorder, use_deepspeed_cpu_accelerator

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    flight_recorder.enable(flight_recorder.DEFAULT_BUFFER, args.dir)
    use_deepspeed_cpu_accelerator()
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=120))
    recorder = flight_recorder.Recorder(args.dir, rank, world)
    recorder.announce()
    torch.manual_seed(0)
    hidden = 8
    model = NonLeafMoE.build(hidden, experts=2)
    with torch.no_grad():  # the router sends x with x[:, 0] > 0 to expert 1, the rest to expert 0
        model.moe.router.weight.zero_()
        model.moe.router.weight[1, 0] = 1.0
        model.inp.weight.copy_(torch.eye(hidden))
        model.inp.bias.zero_()
    config = {"train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    apply_timeout_to_all_groups(timedelta(seconds=args.timeout))
    recorder.gathers.attach(engine.module)
    sign = 1.0 if rank == 1 else -1.0
    try:
        for _ in range(3):
            x = torch.rand(2, hidden) + 0.1
            x[:, 0] *= sign
            loss = engine(x)
            engine.backward(loss)
            engine.step()
        recorder.dump("end")
        print(f"rank {rank} finished", flush=True)
    except Exception as error:  # what the strategy's on_exception does
        recorder.dump(f"{type(error).__name__}: {error}")
        recorder.signal_peers(wait=flight_recorder.PEER_DUMP_WAIT)
        print(f"rank {rank} failed: {type(error).__name__}: {str(error)[:200]}", flush=True)
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=6.0)
    parser.add_argument("--port", type=int, default=29561)
    args = parser.parse_args()
    if "RANK" in os.environ:
        return rank_main(args)
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, *sys.argv], env=env))
    codes = [p.wait() for p in procs]
    print(f"exit codes: {codes}", flush=True)
    sys.exit(max(abs(c) for c in codes))


if __name__ == "__main__":
    main()
