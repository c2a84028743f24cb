"""2-rank ZeRO-3 + AutoEP runs (CPU, gloo) that really hang or lose a rank, with the Flight Recorder on.

    python tests/jobs/hang_job.py --scenario uneven --root DIR --timeout 6

Scenarios (each its own launch; the collective timeout is ``--timeout`` seconds):

* ``uneven``: rank 1's loader has one more batch than rank 0's (no distributed sampler, no drop_last);
* ``rank0_gather``: at the second step, ``self.all_gather`` runs on rank 0 only (``if rank == 0``);
* ``dies``: rank 1 is SIGKILLed in the middle of its second step (after the forward);
* ``rank0_eval``: ``trainer.validate`` after ``fit`` on rank 0 only. Before that, when ``fit`` has ended
  on every rank, each rank writes its trace, copied to ``DIR/healthy``: a healthy run's dumps.

The strategy writes the dumps to ``DIR/flight_recorder`` (``troubleshooter explain DIR/flight_recorder``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import warnings
from datetime import timedelta
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_zeromoe import ZeroMoEStrategy  # noqa: E402
from lightning_zeromoe.engine import apply_timeout_to_all_groups  # noqa: E402
from lightning_zeromoe.reference.models import SyntheticLMData, TinyMoEConfig, TinyMoEModule  # noqa: E402

BATCH = 2


class Scenario(TinyMoEModule):
    """The tiny MoE LM, with the scenario's fault."""

    def __init__(self, scenario: str) -> None:
        super().__init__(TinyMoEConfig(num_experts=4), batch_size=BATCH, num_samples=BATCH * 8)
        self.scenario = scenario

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 1 and self.scenario == "rank0_gather" and self.global_rank == 0:
            self.all_gather(loss.detach())
        if batch_idx == 1 and self.scenario == "dies" and self.global_rank == 1:
            print("rank 1: dying mid-step", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return loss

    def validation_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx)

    def train_dataloader(self):
        data = SyntheticLMData(self.num_samples, self.model.config.max_seq_len // 2 + 1,
                               self.model.config.vocab_size, seed=self.seed)
        if self.scenario != "uneven":
            return torch.utils.data.DataLoader(data, batch_size=BATCH, drop_last=True)
        # Uneven shards, as a hand-written split without drop_last gives: rank 0 three batches, rank 1 four.
        count = (3 + self.global_rank) * BATCH
        return torch.utils.data.DataLoader(torch.utils.data.Subset(data, range(count)), batch_size=BATCH)

    val_dataloader = train_dataloader


class ShortTimeout(L.Callback):
    """Once every rank is up (the rendezvous of a loaded machine can take longer than the hang's timeout),
    every group gets the short collective timeout."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_start(self, trainer, module) -> None:
        apply_timeout_to_all_groups(timedelta(seconds=self.seconds))


class DumpAtEnd(L.Callback):
    """The healthy run's traces: written by each rank when training ends (as ``SIGUSR1`` would), copied
    to ``<root>/healthy``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def on_train_end(self, trainer, module) -> None:
        recorder = trainer.strategy.flight.recorder
        trace = recorder.dump("end of training")
        (self.root / "healthy").mkdir(parents=True, exist_ok=True)
        for path in (trace, recorder.process_file()):
            shutil.copy(path, self.root / "healthy" / path.name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", choices=("uneven", "rank0_gather", "dies", "rank0_eval"),
                        required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--timeout", type=float, default=6.0)
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_epochs=1, max_steps=4 if args.scenario != "uneven" else -1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=args.root, use_distributed_sampler=args.scenario not in ("uneven",),
        num_sanity_val_steps=0, limit_val_batches=2 if args.scenario in ("uneven", "rank0_eval") else 0,
        strategy=ZeroMoEStrategy(ep_size=2, timeout=timedelta(seconds=120)),
        callbacks=[ShortTimeout(args.timeout)]
        + ([DumpAtEnd(Path(args.root))] if args.scenario == "rank0_eval" else []))
    module = Scenario(args.scenario)
    trainer.fit(module)
    if args.scenario == "rank0_eval" and trainer.global_rank == 0:
        trainer.validate(module)
    print(f"rank {trainer.global_rank} finished", flush=True)


if __name__ == "__main__":
    main()
