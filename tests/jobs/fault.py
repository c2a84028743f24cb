"""A 2-rank run with a short collective timeout in which one rank raises mid-training.

Records, on each rank, the timeout of every process group training uses (world, expert-parallel,
expert-data-parallel) at the start of training, then rank --fail-rank raises at step --fail-step.

    python tests/jobs/fault.py --out DIR --timeout 15 --fail-step 3
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from datetime import timedelta
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_zeromoe import ZeroMoEStrategy  # noqa: E402
from lightning_zeromoe.reference.models import TinyMoEModule  # noqa: E402
from lightning_zeromoe.strategy import group_timeout  # noqa: E402


class InjectedFault(RuntimeError):
    pass


class GroupTimeouts(L.Callback):
    def __init__(self, out: Path, fail_rank: int, fail_step: int) -> None:
        self.out, self.fail_rank, self.fail_step = out, fail_rank, fail_step

    def on_train_start(self, trainer, module) -> None:
        from deepspeed.utils import groups
        from torch.distributed import distributed_c10d as c10d

        found = {"world": group_timeout(c10d._get_default_group())}
        for name, group in groups._get_expert_parallel_group_dict().items():
            found[f"expert_parallel/{name}"] = group_timeout(group)
        for name, group in groups._get_expert_data_parallel_group_dict().items():
            found[f"expert_data_parallel/{name}"] = group_timeout(group)
        # A group created the way DeepSpeed creates its groups, after the strategy's fix-up ran:
        # it shows the backend default the expert groups would have kept without the fix-up.
        found["fresh_new_group"] = group_timeout(torch.distributed.new_group([0, 1]))
        seconds = {k: v.total_seconds() if v is not None else None for k, v in found.items()}
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"timeouts{trainer.global_rank}.json").write_text(json.dumps(seconds))

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_rank == self.fail_rank and trainer.global_step == self.fail_step:
            (self.out / "failed_at").write_text(f"{time.time()}")
            raise InjectedFault(f"injected failure on rank {self.fail_rank} at step {self.fail_step}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=15.0, help="seconds")
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--fail-step", type=int, default=-1, help="-1: no failure")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    args.out.mkdir(parents=True, exist_ok=True)
    rank = os.environ.get("LOCAL_RANK", "0")
    (args.out / f"pid{rank}").write_text(str(os.getpid()))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=ZeroMoEStrategy(ep_size=2, timeout=timedelta(seconds=args.timeout)),
        callbacks=[GroupTimeouts(args.out, args.fail_rank, args.fail_step)])
    trainer.fit(TinyMoEModule(batch_size=4))
    print(f"rank {trainer.global_rank} finished at {time.time():.1f}", flush=True)


if __name__ == "__main__":
    main()
