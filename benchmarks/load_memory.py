"""Peak memory per rank while ``from_pretrained`` runs inside ``configure_model``, on 2 CPU ranks.

A Mixtral of ~340 M parameters (1.35 GB in fp32; 32 layers, as Mixtral-8x7B has) is built from a config and saved once with
``save_pretrained``; then, for each mode, a real 2-rank ``Trainer(strategy=ZeroMoEStrategy(ep_size=2))``
with ``max_steps=0`` loads it in ``configure_model`` and builds the engines (AutoEP converts the
blocks inside ``deepspeed.initialize``). Each rank reports, from ``/proc/self/status``:

* ``load peak``: the highest resident set (VmHWM, reset through ``/proc/self/clear_refs`` just
  before ``from_pretrained``) minus the resident set just before it, so the ~0.8 GB every
  process pays for importing torch/deepspeed/lightning/transformers is not counted;
* ``init peak``: the same for ``deepspeed.initialize`` (AutoEP conversion), reset after loading;
* ``held``: the resident set once loading is done, minus the one before.

Modes:

* ``partitions``: the strategy as shipped: transformers is told ZeRO-3 is on, and each rank copies
  only its own slice of every tensor into its partition (``lightning_zeromoe.loading.hf_zero3``);
* ``transformers``: the same, but with transformers' own ZeRO-3 loader (the benchmark restores it):
  every module is gathered on all ranks and rank 0 reads the whole checkpoint;
* ``unsharded``: ``configure_model`` outside ``zero.Init`` (what happened before: every rank builds
  and loads the whole model, ``deepspeed.initialize`` partitions it afterwards).

    python benchmarks/load_memory.py                 # all three modes, ~3 min on 2 cores
    python benchmarks/load_memory.py --modes partitions --dir /tmp/mixtral340m
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODES = ("partitions", "transformers", "unsharded")
#: ~340 M parameters: 32 layers x 8 experts x (3 x 512 x 768) = 302 M in experts. The layer count
#: matters: a layer's experts are fused one layer at a time while loading (transient memory).
MIXTRAL = dict(vocab_size=16000, hidden_size=512, intermediate_size=768, num_hidden_layers=32, num_attention_heads=8,
               num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
               tie_word_embeddings=False)


def status_mb() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024
    return out


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def save_model(path: Path) -> int:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**MIXTRAL))
    numel = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    return numel


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch

    sys.path.insert(0, str(REPO))
    from lightning_zeromoe import ZeroMoEStrategy
    from lightning_zeromoe.loading import hf_zero3 as hf_loading

    if args.mode == "transformers":
        hf_loading._partition_loader = lambda original: original  # transformers' own ZeRO-3 loader
    if args.mode == "unsharded":
        ZeroMoEStrategy.model_sharded_context = lambda self: contextlib.nullcontext()  # type: ignore[method-assign]

    class Load(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None
            self.report: dict[str, Any] = {}

        def configure_model(self) -> None:
            from transformers import AutoModelForCausalLM

            before = status_mb()
            reset_peak()
            t0 = time.perf_counter()
            self.model = AutoModelForCausalLM.from_pretrained(args.dir)
            after = status_mb()
            self.report.update(load_seconds=time.perf_counter() - t0, before=before, after_load=after,
                               load_peak=after["VmHWM"] - before["VmRSS"], held=after["VmRSS"] - before["VmRSS"])
            reset_peak()
            self._init_base = status_mb()["VmRSS"]

        def on_fit_start(self) -> None:
            now = status_mb()
            self.report["init_peak"] = now["VmHWM"] - self._init_base

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            raise AssertionError("max_steps=0")

        def configure_optimizers(self) -> Any:
            if args.optimizer == "sgd":  # no optimizer state: what initialize costs besides Adam's moments
                return torch.optim.SGD(self.parameters(), lr=1e-4)
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.zeros(4, 8, dtype=torch.long), batch_size=1)

    module = Load()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ZeroMoEStrategy(ep_size=2), max_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"{args.mode}_rank{trainer.global_rank}.json").write_text(json.dumps(module.report))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--dir", type=Path, default=None, help="where the model is saved (default: a temp dir)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                        help="the optimizer deepspeed.initialize builds state for (default adamw)")
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        worker(args)
        return 0

    tmp = tempfile.TemporaryDirectory(prefix="load_memory_")
    model_dir = args.dir or Path(tmp.name) / "mixtral"
    if not (model_dir / "config.json").exists():
        print(f"saving a {MIXTRAL['num_hidden_layers']}-layer Mixtral to {model_dir} ...", flush=True)
        numel = save_model(model_dir)
    else:
        from safetensors import safe_open

        numel = 0
        for file in model_dir.glob("*.safetensors"):
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    n = 1
                    for d in f.get_slice(key).get_shape():
                        n *= d
                    numel += n
    full_mb = numel * 4 / 2**20
    print(f"model: {numel / 1e6:.0f} M parameters, {full_mb:.0f} MiB in fp32", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    rows = []
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--mode", mode, "--dir", str(model_dir), "--out", tmp.name,
                               "--optimizer", args.optimizer],
                              env=env, capture_output=True, text=True)
        if proc.returncode:
            print(f"{mode}: failed ({proc.returncode})\n{proc.stderr[-3000:]}")
            continue
        for rank in (0, 1):
            r = json.loads((Path(tmp.name) / f"{mode}_rank{rank}.json").read_text())
            rows.append((mode, rank, r))
        print(f"  {mode}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"\n| mode | rank | load peak (MiB) | x full fp32 | held after load (anon / file-backed) | init peak (MiB) "
          "| load s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, rank, r in rows:
        anon = r["after_load"].get("RssAnon", 0) - r["before"].get("RssAnon", 0)
        mapped = r["after_load"].get("RssFile", 0) - r["before"].get("RssFile", 0)
        print(f"| {mode} | {rank} | {r['load_peak']:.0f} | {r['load_peak'] / full_mb:.2f} | {r['held']:.0f} "
              f"({anon:.0f} / {mapped:.0f}) | {r['init_peak']:.0f} | {r['load_seconds']:.1f} |")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
