"""``ZeroMoEStrategy(load_full_weights=True)`` on several ranks: record which experts each rank holds.

The launching process first trains the tiny MoE for a few steps in one plain process (no
DeepSpeed, Lightning's default strategy) and saves an ordinary Lightning checkpoint file: the
model's own parameter names, every expert. Then the multi-rank run loads it with
``load_full_weights=True`` and, before its first step, every rank writes the full local tensors
it holds (gathered from ZeRO-3 partitions) to ``--out/rank<r>.pt``:

    python tests/jobs/full_weights_job.py --out DIR --devices 4 --ep-size 2 [--stock]

``--stock`` loads with Lightning's own ``DeepSpeedStrategy.load_model_state_dict`` (the
reproduction of the bug the strategy fixes).
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import DeepSpeedStrategy  # noqa: E402

from lightning_zeromoe import ZeroMoEStrategy  # noqa: E402
from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoEModule  # noqa: E402

PLAIN_STEPS = 3


class StockLoading(ZeroMoEStrategy):
    """Lightning's own full-weights loading (rank 0 loads, GatheredParameters broadcasts)."""

    def load_model_state_dict(self, checkpoint, strict=True):
        return DeepSpeedStrategy.load_model_state_dict(self, checkpoint, strict=strict)


class Holdings(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, module) -> None:
        import deepspeed

        from lightning_zeromoe.checkpoint.autoep_names import autoep_layers, local_experts

        engine_module = trainer.strategy.deepspeed_engine.module
        params = dict(engine_module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):  # collective: every rank
            held = {name: p.detach().clone() for name, p in params.items()}
        experts = {path: local_experts(layer) for path, layer in autoep_layers(engine_module).items()}
        torch.save({"held": held, "experts": experts}, self.out / f"rank{trainer.global_rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--ep-size", type=int, default=2)
    parser.add_argument("--stock", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    full = args.out / "plain.ckpt"
    config = TinyMoEConfig()
    if "LOCAL_RANK" not in os.environ:  # the launching process, before any rank exists
        L.seed_everything(1, verbose=False)
        plain = L.Trainer(accelerator="cpu", devices=1, max_steps=PLAIN_STEPS, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False)
        plain.fit(TinyMoEModule(config, batch_size=4, num_samples=64))
        plain.save_checkpoint(full)

    L.seed_everything(0, verbose=False)
    strategy_cls = StockLoading if args.stock else ZeroMoEStrategy
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, max_steps=PLAIN_STEPS + 1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[Holdings(args.out)],
        strategy=strategy_cls(ep_size=args.ep_size, param_persistence_threshold=0, load_full_weights=True))
    trainer.fit(TinyMoEModule(config, batch_size=4, num_samples=64), ckpt_path=full)


if __name__ == "__main__":
    main()
