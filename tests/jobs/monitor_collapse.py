"""Two runs of the tiny MoE under ZeroMoEStrategy(ep_size=2), one process group: a provoked router
collapse, then a healthy run, each watched by ExpertUtilizationMonitor and logged to a CSVLogger.

Run it with plain ``python``: it starts itself under torchrun (2 ranks), so both Trainers share
one process group instead of Lightning re-launching the script per Trainer. Each rank writes
``DIR/rank{r}.json`` (the ExpertCollapseWarnings it saw, the monitor's alarms, the final step);
rank 0's CSVLogger writes ``DIR/<case>/version_0/metrics.csv``.

    python tests/jobs/monitor_collapse.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning)

EVERY, DEAD_STEPS, MAX_STEPS, BATCH = 5, 10, 30, 4


def provoke_collapse(model, expert: int = 0) -> None:
    """An extreme router init that every token agrees with: one embedding feature that is large and
    positive for every token (as "massive activation" dimensions are in real LLMs) and a gate row
    that weighs it heavily. Softmax saturates, so without an aux loss the gradient cannot undo it.

    (``TinyMoEConfig.router_bias_expert`` adds +1 to every weight of the row: its logit is then the
    *sum* of the normed hidden state, which is as often negative as positive, so it does not
    collapse routing: measured ~50% of tokens to that expert at init, the uniform top-2 share.)
    """
    import torch

    with torch.no_grad():
        model.embed.weight[:, 0] += 1.0
        for layer in model.layers:
            layer.mlp.gate.weight[expert, 0] = 5.0


def run_case(name: str, out: Path, *, aux_weight: float, collapse: bool) -> dict:
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_zeromoe import ZeroMoEStrategy
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoEModule
    from lightning_zeromoe.observe.monitor import ExpertCollapseWarning, ExpertUtilizationMonitor

    L.seed_everything(0, verbose=False)
    world = int(os.environ["WORLD_SIZE"])
    module = TinyMoEModule(TinyMoEConfig(aux_loss_weight=aux_weight), batch_size=BATCH,
                           num_samples=BATCH * world * MAX_STEPS)
    if collapse:
        provoke_collapse(module.model)
    monitor = ExpertUtilizationMonitor(every_n_steps=EVERY, patience=2, dead_steps=DEAD_STEPS,
                                       stop_on_collapse=True)
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=MAX_STEPS, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1,
                        logger=CSVLogger(str(out), name=name, version=0),
                        strategy=ZeroMoEStrategy(ep_size=2, param_persistence_threshold=0), callbacks=[monitor])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExpertCollapseWarning)
        trainer.fit(module)
    seen = [str(w.message) for w in caught if issubclass(w.category, ExpertCollapseWarning)]
    return {"warnings": seen, "alarms": [a.__dict__ for a in monitor.alarms], "global_step": trainer.global_step,
            "should_stop": trainer.should_stop}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:  # become the launcher
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               *sys.argv[1:]]
        raise SystemExit(subprocess.call(cmd))

    import torch

    torch.set_num_threads(1)
    result = {"rank": int(os.environ["RANK"])}
    result["collapse"] = run_case("collapse", args.out, aux_weight=0.0, collapse=True)
    result["healthy"] = run_case("healthy", args.out, aux_weight=0.01, collapse=False)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{result['rank']}.json").write_text(json.dumps(result))
    from _teardown import end_job  # tests/jobs: the script's own directory

    end_job()


if __name__ == "__main__":
    main()
