"""A 2-rank ZeRO-3 + AutoEP training (the demo's model) in which one rank dies mid-training.

    python tests/jobs/rank_dies.py --mode kill     # rank 1 is SIGKILLed (as the OOM killer does)
    python tests/jobs/rank_dies.py --mode oom      # rank 1 fails a host allocation (its own error)
    python tests/jobs/rank_dies.py --mode none     # healthy run, verbose DeepSpeed/Lightning logs

The surviving rank then fails inside a collective ("Connection closed by peer" / "reset by peer"
from gloo). tests/fixtures/make_rank_logs.py keeps the combined output as explain fixtures.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import warnings
from datetime import timedelta

warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_zeromoe import ZeroMoEStrategy  # noqa: E402
from lightning_zeromoe.reference.models import TinyMoEModule  # noqa: E402


class DieOnRank(L.Callback):
    """At step ``step``, rank ``rank`` is killed, or fails a (real) impossible host allocation."""

    def __init__(self, mode: str, rank: int, step: int) -> None:
        self.mode, self.rank, self.step = mode, rank, step

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        print(f"rank {self.rank}: dying ({self.mode}) at step {self.step}", flush=True)
        if self.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mode == "oom":
            torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: DefaultCPUAllocator refuses it


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("kill", "oom", "none"), default="kill")
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--step", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    args = parser.parse_args()
    logging.basicConfig(level=logging.DEBUG, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("fsspec", "urllib3", "filelock", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=args.steps, logger=False, enable_checkpointing=False,
        enable_model_summary=True, log_every_n_steps=1,
        strategy=ZeroMoEStrategy(ep_size=2, timeout=timedelta(seconds=args.timeout),
                                 logging_level=logging.DEBUG),
        callbacks=[DieOnRank(args.mode, args.rank, args.step)] if args.mode != "none" else [])
    trainer.fit(TinyMoEModule(batch_size=4))
    print(f"rank {trainer.global_rank} finished", flush=True)


if __name__ == "__main__":
    main()
