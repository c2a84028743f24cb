"""Expert parallelism against plain ZeRO-3, side by side in one run: tokens/s and all-gathered bytes.

Why: EP's point under ZeRO-3 is that each rank stops all-gathering every expert's weights in
every layer (each rank keeps its own num_experts / ep_size experts whole, and only tokens travel,
by all-to-all). This measures it on one architecture (a Mixtral-style model built from a
config: hidden 256, 4 layers, 8 experts, top-2) under ``ZeroMoEStrategy(ep_size=2)`` and
``ZeroMoEStrategy(ep_size=1)`` on the same 2 ranks, alternating the two modes ``--repeats`` times.

Method: launched once with torchrun (2 ranks); every ``torch.distributed`` all-gather entry point
is wrapped before DeepSpeed binds it, counting the bytes of each output tensor on this rank.
Per mode and repeat: a fresh model and Trainer, ``--warmup`` steps, then ``--steps`` timed steps
(wall time from the first to the last timed step, on rank 0; all-gathered bytes per step
averaged over the timed steps, forward and backward, rank 0). Medians over repeats, and the
ratio EP / ZeRO-3. CPU ranks over gloo: absolute speeds say nothing about GPUs; the byte
counts are exact. Run from the repository root:

    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 benchmarks/ep_vs_zero3.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GATHERED = {"bytes": 0}


def _count_gathers() -> None:
    """Wrap torch.distributed's all-gathers (before DeepSpeed binds them) to count output bytes."""
    for name in ("all_gather_into_tensor", "_all_gather_base", "all_gather", "all_gather_single"):
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def wrapped(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
            out = args[0] if args else kwargs.get("output_tensor", kwargs.get("tensor_list"))
            tensors = out if isinstance(out, (list, tuple)) else [out]
            GATHERED["bytes"] += sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
            return _fn(*args, **kwargs)
        setattr(dist, name, wrapped)


def build_model(seed: int = 0) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False,
                           use_cache=False)
    return MixtralForCausalLM(config)


def run_mode(ep_size: int, warmup: int, steps: int, batch: int, seq: int) -> dict[str, float]:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_zeromoe import ZeroMoEStrategy
    from lightning_zeromoe.reference.models import SyntheticLMData

    marks: list[tuple[float, int]] = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_model()

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            marks.append((time.perf_counter(), GATHERED["bytes"]))

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            ids = batch["input_ids"]
            return self.net(input_ids=ids, labels=ids).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> DataLoader:
            data = SyntheticLMData(num_samples=4096, seq_len=seq + 1, vocab_size=512, seed=0)
            return DataLoader(data, batch_size=batch, shuffle=False, drop_last=True)

    module = Module()
    strategy = ZeroMoEStrategy(ep_size=ep_size, param_persistence_threshold=0, timeout=timedelta(seconds=300))
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy,
                        max_steps=warmup + steps + 1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module)
    (t0, b0), (t1, b1) = marks[warmup], marks[warmup + steps]
    tokens = batch * seq * dist.get_world_size() * steps
    return {"tokens_per_s": tokens / (t1 - t0), "gathered_bytes_per_step": (b1 - b0) / steps,
            "converted_blocks": float(len(strategy.discovery.blocks) if ep_size > 1 else 0)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _count_gathers()
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    runs: dict[str, list[dict[str, float]]] = {"ep2": [], "zero3": []}
    for repeat in range(args.repeats):
        order = ("ep2", "zero3") if repeat % 2 == 0 else ("zero3", "ep2")
        for mode in order:
            runs[mode].append(run_mode(2 if mode == "ep2" else 1, args.warmup, args.steps, args.batch, args.seq))
    if dist.get_rank() == 0:
        med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
        ratio = {k: med["ep2"][k] / med["zero3"][k] for k in ("tokens_per_s", "gathered_bytes_per_step")}
        print(f"{'mode':8} {'tokens/s (median)':>18} {'all-gathered MB/step/rank':>26}  (repeats: {args.repeats})")
        for mode in ("ep2", "zero3"):
            print(f"{mode:8} {med[mode]['tokens_per_s']:18.1f} {med[mode]['gathered_bytes_per_step'] / 1e6:26.2f}")
        print(f"ratio EP=2 / ZeRO-3: tokens/s x{ratio['tokens_per_s']:.2f}, "
              f"all-gathered bytes x{ratio['gathered_bytes_per_step']:.3f}")
        if args.json:
            args.json.write_text(json.dumps({"runs": runs, "median": med, "ratio": ratio}, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
