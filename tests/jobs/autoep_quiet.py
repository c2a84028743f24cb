"""Which warnings DeepSpeed logs while it builds an engine for a tiny Mixtral, with our AutoEP section.

One process (a 1-rank gloo group), run by ``tests/test_autoep_wire.py``:

1. ``strategy``: ``Trainer.fit`` (one step) of a tiny Mixtral held as ``self.net`` (so the preset's
   block pattern has to be re-rooted) under ``ZeroMoEStrategy(grouped_experts=True)``: AutoEP
   converts the blocks at ``autoep_size=1``;
2. ``old``: ``deepspeed.initialize`` on a fresh copy of the module with the strategy's own config
   sent as it is, ``preset_model`` next to ``moe_layer_pattern`` (what the strategy sent before
   ``lightning_zeromoe.config.autoep_wire``), the Mixtral config lent to the root as the strategy does.

For each it records every WARNING record of DeepSpeed's logger and the AutoEP layers built, in
``<out>/quiet.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning)

import lightning as L  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from train_hf import HFMoEModule, build_hf_model  # noqa: E402

from lightning_zeromoe import ZeroMoEStrategy  # noqa: E402
from lightning_zeromoe.engine.build import lend_root_config  # noqa: E402


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def autoep_layers(module: torch.nn.Module) -> list[str]:
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    return sorted(n for n, m in module.named_modules() if isinstance(m, AutoEPMoELayer))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from deepspeed.utils import logger

    records = Records()
    logger.addHandler(records)
    out: dict = {}

    L.seed_everything(0, verbose=False)
    module = HFMoEModule(build_hf_model("mixtral"))
    strategy = ZeroMoEStrategy(grouped_experts=True, param_persistence_threshold=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    out["strategy"] = {"warnings": list(records.lines), "layers": autoep_layers(module),
                       "section": strategy.config.get("expert_parallel")}

    import deepspeed

    records.lines.clear()
    L.seed_everything(0, verbose=False)
    fresh = HFMoEModule(build_hf_model("mixtral"))
    config = {k: v for k, v in strategy.config.items() if k != "zero_optimization"}
    config["zero_optimization"] = {"stage": 0}
    from lightning_zeromoe._private.deepspeed import autoep_output_capture_shim

    with lend_root_config(fresh, fresh.net.config), autoep_output_capture_shim():  # transformers >= 5.23
        engine, *_ = deepspeed.initialize(args=argparse.Namespace(device_rank=0), model=fresh, config=config,
                                          model_parameters=[p for p in fresh.parameters() if p.requires_grad],
                                          dist_init_required=False)
    out["old"] = {"warnings": list(records.lines), "layers": autoep_layers(engine.module),
                  "section": config["expert_parallel"]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quiet.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
