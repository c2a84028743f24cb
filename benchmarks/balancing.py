"""Which remedy fixes a collapsing router, and how fast: none, aux loss, bias balancing, bias + z-loss.

The collapse-prone tiny MoE (``TinyMoEConfig(num_experts=8, top_k=2, router_bias_expert=0)``: one
gate row initialised large, so most tokens prefer that expert; 2 MoE layers, lr 1e-2, no warm-up)
trains under ``ZeroMoEStrategy(ep_size=2)`` on 2 CPU ranks (gloo, ZeRO-3, AutoEP) for ``--steps``
optimizer steps in each setting and seed:

* ``none``: no load-balancing term;
* ``aux 0.01``: the Switch-style aux loss, weight 0.01;
* ``bias``: ``ExpertBiasBalancer(update_rate=--rate)`` on ``score_bias=True`` (no aux loss);
* ``bias + z-loss``: the same and the router z-loss at weight 1e-3.

The expert counts are summed over both ranks and over windows of 5 steps
(``ExpertUtilizationMonitor(every_n_steps=5)``: 5 x 2 ranks x 8 sequences x 32 tokens = 2560 tokens
per window; a single step's 512 tokens make the busiest share too noisy to compare with a bound).
Reported per setting, as the median over the seeds:

* **steps to balance**: the last step of the first window from which the busiest expert's share of
  tokens (the largest over both layers) stays within 1.5x of uniform (``1.5 * top_k / num_experts``
  = 0.375) in every later window; ``never`` when the last window is not within it;
* **final max share** and **final entropy**: the busiest expert's share, and the routing entropy
  normalised to [0, 1] (1: uniform; mean over the layers), over the last two windows (10 steps);
* **task loss**: the next-token loss (no balancing terms) averaged over the last 10 steps and the ranks.

    python benchmarks/balancing.py [--steps 100] [--seeds 0 1 2] [--rate 5e-3] [--markdown]

It starts itself under ``torchrun`` (2 ranks); one process group runs every setting and seed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

NUM_EXPERTS, TOP_K, LAYERS, BATCH, LR = 8, 2, 2, 8, 1e-2
SETTINGS = ("none", "aux 0.01", "bias", "bias + z-loss")
WITHIN = 1.5  # x uniform
WINDOW = 5  # steps per routing window
TAIL = 10  # steps averaged for the final numbers


def run_one(setting: str, seed: int, steps: int, rate: float) -> dict[str, Any]:
    """One Trainer.fit; every rank returns the same per-step routing, and its own task losses."""
    import lightning as L

    from lightning_zeromoe import ZeroMoEStrategy
    from lightning_zeromoe.balance.balancer import ExpertBiasBalancer
    from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoEModule
    from lightning_zeromoe.observe.monitor import ExpertUtilizationMonitor

    L.seed_everything(seed, verbose=False)
    bias = setting.startswith("bias")
    config = TinyMoEConfig(num_experts=NUM_EXPERTS, top_k=TOP_K, num_layers=LAYERS, router_bias_expert=0,
                           aux_loss_weight=0.01 if setting == "aux 0.01" else 0.0, score_bias=bias,
                           z_loss_weight=1e-3 if "z-loss" in setting else 0.0)
    world = int(os.environ["WORLD_SIZE"])
    module = TinyMoEModule(config, lr=LR, batch_size=BATCH, num_samples=BATCH * world * steps, seed=seed)
    monitor = ExpertUtilizationMonitor(every_n_steps=WINDOW, patience=10**9, dead_steps=10**9, aux_loss_key=None,
                                       task_loss_key=None, top_k=TOP_K)
    callbacks: list[Any] = [monitor] + ([ExpertBiasBalancer(update_rate=rate, check_every_n_steps=25)] if bias else [])

    class TaskLoss(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.losses.append(pl_module.last_losses["task_loss"])

    task = TaskLoss()
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[*callbacks, task],
                        strategy=ZeroMoEStrategy(ep_size=2, timeout=timedelta(seconds=300)))
    start = time.perf_counter()
    trainer.fit(module)
    found = trainer.strategy.discovery
    return {"steps": [step for step, _ in monitor.history],
            "max_share": [max(s.max_share for s in stats.values()) for _, stats in monitor.history],
            "entropy": [statistics.fmean(s.entropy for s in stats.values()) for _, stats in monitor.history],
            "task": task.losses, "seconds": time.perf_counter() - start,
            "ep_blocks": len(found.blocks) if found else 0}


def summarise(steps: list[int], max_share: list[float], entropy: list[float], task: list[float]) -> dict[str, Any]:
    """The reported numbers of one run (see the module docstring); ``steps``: each window's last step."""
    bound = WITHIN * TOP_K / NUM_EXPERTS
    settled = None
    for i in range(len(max_share) - 1, -1, -1):
        if max_share[i] > bound:
            break
        settled = steps[i]
    tail = TAIL // WINDOW
    return {"steps_to_balance": settled, "final_max_share": statistics.fmean(max_share[-tail:]),
            "final_entropy": statistics.fmean(entropy[-tail:]), "task_loss": statistics.fmean(task[-TAIL:])}


def table(results: dict[str, list[dict[str, Any]]], steps: int, seeds: list[int], rate: float) -> str:
    """The Markdown table of the medians (and each seed's steps to balance)."""
    lines = [f"| setting | steps until busiest share <= {WITHIN}x uniform (median; per seed) | final max share "
             f"| final entropy | task loss after {steps} steps |", "|---|---|---:|---:|---:|"]
    for setting, runs in results.items():
        per_seed = [r["steps_to_balance"] for r in runs]
        never = steps + 1  # ranks after every real step in the median
        median = statistics.median([s if s is not None else never for s in per_seed])
        shown = "never" if median >= never else f"{median:g}"
        seeds_text = ", ".join("never" if s is None else str(s) for s in per_seed)
        name = f"bias (rate {rate:g})" if setting == "bias" else (
            f"bias (rate {rate:g}) + z-loss 1e-3" if setting == "bias + z-loss" else setting)
        lines.append(f"| {name} | {shown} ({seeds_text}) | {statistics.median(r['final_max_share'] for r in runs):.3f} "
                     f"| {statistics.median(r['final_entropy'] for r in runs):.3f} "
                     f"| {statistics.median(r['task_loss'] for r in runs):.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rate", type=float, default=5e-3, help="ExpertBiasBalancer's update_rate")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--json", type=Path, default=None, help="also write every run's numbers here")
    parser.add_argument("--markdown", action="store_true", help="print only the table")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:  # become the launcher
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               *sys.argv[1:]]
        raise SystemExit(subprocess.call(cmd, env=env))

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    results: dict[str, list[dict[str, Any]]] = {}
    raw: dict[str, list[dict[str, Any]]] = {}
    for setting in args.settings:
        for seed in args.seeds:
            run = run_one(setting, seed, args.steps, args.rate)
            losses: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(losses, run["task"])
            task = [statistics.fmean(step) for step in zip(*losses)]
            summary = summarise(run["steps"], run["max_share"], run["entropy"], task)
            results.setdefault(setting, []).append(summary)
            raw.setdefault(setting, []).append({**run, "task": task, "seed": seed, **summary})
            if rank == 0 and not args.markdown:
                print(f"[balancing] {setting:>14} seed {seed}: {json.dumps(summary)} "
                      f"({run['seconds']:.1f} s, {run['ep_blocks']} EP blocks)", flush=True)
    if rank == 0:
        print(table(results, args.steps, args.seeds, args.rate), flush=True)
        if args.json:
            args.json.write_text(json.dumps(raw, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
