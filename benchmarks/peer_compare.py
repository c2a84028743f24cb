"""Peer comparison: the Hugging Face ``Trainer`` with DeepSpeed ZeRO-3 against ``ZeroMoEStrategy(ep_size=2)``.

The two sides train the same tiny HF Mixtral (``tests/jobs/train_hf.py``: hidden 64, 2 layers, 4
experts, top-2, vocab 128, seed 0) on 2 CPU ranks (gloo), fp32, the same synthetic token data,
micro-batch ``--batch`` x ``--seq`` tokens per rank, no gradient accumulation, AdamW (torch's,
lr 1e-3, no weight decay, constant schedule, no gradient clipping), ``--warmup`` + ``--steps`` optimizer
steps:

* ``hf``: ``transformers.Trainer`` with ``TrainingArguments(deepspeed=<ZeRO-3 config>)``, the MoE
  blocks registered as ZeRO-3 leaf modules as Hugging Face documents it
  (``deepspeed.utils.set_z3_leaf_modules(model, [MixtralSparseMoeBlock])``), sequential sampler.
* ``zeromoe``: a Lightning ``Trainer`` with ``ZeroMoEStrategy(ep_size=2)`` (ZeRO-3, AutoEP: each rank
  keeps 2 of the 4 experts of every layer whole).

DeepSpeed under the HF ``Trainer`` on a machine without GPUs (transformers 5.24, accelerate 1.15):
``TrainingArguments(deepspeed=...)`` alone fails in ``deepspeed.initialize`` with ``AssertionError: Check
batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step *
world_size 4 != 4 * 1 * 2``: Accelerate's ``PartialState``, finding no GPU, keeps its backend ``None``,
has DeepSpeed start a 2-rank gloo group all the same, and then counts one process
(``num_processes=1``, ``process_index=0`` on both ranks), so the Trainer sizes the batch for one
rank and would feed both ranks the same data; ``use_cpu=True`` makes Accelerate leave DeepSpeed out
(plain DDP). So the ``hf`` side first creates ``PartialState(backend="gloo")`` with
``ACCELERATE_USE_DEEPSPEED=true`` and passes ``accelerator_config={"use_configured_state": True}``
(Accelerate's documented way to reuse a configured state): 2 processes, DeepSpeed ZeRO-3, each rank
its own shard of the data. Both sides read the same synthetic sequences; the order in which they
come is each trainer's sampler's (HF's sharded sequential sampler, Lightning's ``DistributedSampler``).

Each side is its own ``torchrun --nproc_per_node 2`` launch of this file (``--worker``); the two
alternate, ``--repeats`` times, the first side swapping each repeat. Per launch and rank: tokens/s
over the timed steps (wall time from the end of the last warm-up step to the end of the last step,
both ranks' tokens), peak RSS (``ru_maxrss``: the whole process, imports included), and the bytes
per optimizer step by collective counted by ``lightning_zeromoe.CommLedger`` at the
``torch.distributed`` boundary (on the HF side through ``CommLedger.counting()``, entered after the
process group exists, so DeepSpeed's own references are wrapped as well). Bytes are the full buffer
of each collective (see ``observe/comm_ledger.py``), the median over the timed steps of rank 0.
The table gives medians over the repeats. CPU ranks over gloo: absolute speeds say nothing about
GPUs; the byte counts are exact. Run from the repository root (6 launches; 18 minutes on 2 cores shared
with other jobs, most of it each launch's start-up)::

    .venv/bin/python benchmarks/peer_compare.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for extra in (REPO, REPO / "tests" / "jobs"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

SIDES = ("hf", "zeromoe")
LABELS = {"hf": "HF Trainer + DeepSpeed ZeRO-3 (MoE blocks as leaf modules)",
          "zeromoe": "Lightning + ZeroMoEStrategy(ep_size=2)"}
LR = 1e-3


# ------------------------------------------------------------------ worker (one torchrun launch)


class _Data:
    """Synthetic token sequences, as a map-style dataset of ``input_ids``/``labels``."""

    def __init__(self, samples: int, seq: int) -> None:
        from train_hf import VOCAB

        from lightning_zeromoe.reference.models import SyntheticLMData

        self.tokens = SyntheticLMData(num_samples=samples, seq_len=seq, vocab_size=VOCAB, seed=0).tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class _Clock:
    """Wall time at the end of every optimizer step, and the ledger's record of it."""

    def __init__(self, ledger: Any) -> None:
        self.ledger = ledger
        self.marks: list[float] = []

    def step_done(self, step: int) -> None:
        self.marks.append(time.perf_counter())
        if self.ledger is not None and not any(s.step == step for s in self.ledger.steps):
            self.ledger.close_step(step)


def _model() -> Any:
    import lightning as L
    from train_hf import build_hf_model

    L.seed_everything(0, verbose=False)
    return build_hf_model("mixtral")


def _run_hf(args: argparse.Namespace, clock: _Clock, ledger: Any) -> dict[str, Any]:
    import deepspeed
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    # On a machine without GPUs, TrainingArguments(deepspeed=...) alone does not give a 2-rank run (module
    # docstring): configure Accelerate's state for DeepSpeed over gloo first, and let TrainingArguments use it.
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    state = PartialState(backend="gloo")
    assert state.num_processes == 2, state
    ds_config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
                 "train_batch_size": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                 "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
                 "bf16": {"enabled": False}, "fp16": {"enabled": False}}
    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="peer_hf_"), per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1, max_steps=args.warmup + args.steps, learning_rate=LR, weight_decay=0.0,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0, optim="adamw_torch", seed=0,
        deepspeed=ds_config, ddp_backend="gloo", train_sampling_strategy="sequential", dataloader_drop_last=True,
        logging_strategy="no", save_strategy="no", report_to=[], disable_tqdm=True,
        accelerator_config={"use_configured_state": True})
    model = _model()
    deepspeed.utils.set_z3_leaf_modules(model, [MixtralSparseMoeBlock])

    class Steps(TrainerCallback):
        def on_train_begin(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            ledger.begin(state.global_step)

        def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            clock.step_done(state.global_step)

    data = _Data(2 * args.batch * (args.warmup + args.steps), args.seq)
    trainer = Trainer(model=model, args=training_args, train_dataset=data, callbacks=[Steps()])
    with ledger.counting():
        trainer.train()
    engine = trainer.model_wrapped
    return {"deepspeed_config": _jsonable(getattr(engine, "config", None) or ds_config),
            "distributed_type": str(trainer.accelerator.distributed_type),
            "hf_process_index": training_args.process_index, "hf_world_size": training_args.world_size}


def _run_zeromoe(args: argparse.Namespace, clock: _Clock, ledger: Any) -> dict[str, Any]:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_zeromoe import ZeroMoEStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            return self.net(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            clock.step_done(self.trainer.global_step)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)

        def train_dataloader(self) -> DataLoader:
            data = _Data(2 * args.batch * (args.warmup + args.steps), args.seq)
            return DataLoader(data, batch_size=args.batch, shuffle=False, drop_last=True)

    strategy = ZeroMoEStrategy(ep_size=2, comm_stats=True)
    clock.ledger = strategy.comm_ledger
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.warmup + args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(Module())
    return {"deepspeed_config": _jsonable(strategy.config)}


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def worker(args: argparse.Namespace) -> int:
    import torch

    from lightning_zeromoe import CommLedger

    torch.set_num_threads(1)
    ledger = CommLedger()
    clock = _Clock(ledger)
    extra = (_run_hf if args.worker == "hf" else _run_zeromoe)(args, clock, ledger)
    ledger = clock.ledger
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    timed = clock.marks[args.warmup - 1:] if args.warmup else clock.marks
    seconds = timed[-1] - timed[0]
    tokens = world * args.batch * args.seq * (len(timed) - 1)
    steps = [s for s in ledger.steps if s.step > args.warmup]
    keys = sorted({k for s in steps for k in s.bytes})
    per_step = {f"{c}/{g}": statistics.median(s.bytes.get((c, g), 0) for s in steps) for c, g in keys}
    calls = {f"{c}/{g}": statistics.median(s.calls.get((c, g), 0) for s in steps) for c, g in keys}
    sizes = {f"{c}/{g}": max(s.group_sizes.get((c, g), 0) for s in steps) for c, g in keys}
    record = {"side": args.worker, "rank": rank, "world": world, "steps_recorded": len(clock.marks),
              "tokens_per_s": tokens / seconds, "seconds": seconds,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "bytes_per_step": per_step, "calls_per_step": calls, "group_sizes": sizes,
              "total_bytes_per_step": sum(per_step.values()), **extra}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    return 0


# ------------------------------------------------------------------ driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(side: str, out: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), str(Path(__file__).resolve()), "--worker", side, "--out", str(out),
           "--batch", str(args.batch), "--seq", str(args.seq), "--warmup", str(args.warmup), "--steps",
           str(args.steps)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    (out / "log.txt").parent.mkdir(parents=True, exist_ok=True)
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{side} failed (exit {proc.returncode}), log {out / 'log.txt'}:\n{proc.stderr[-4000:]}")
    print(f"  {side}: {time.perf_counter() - t0:.0f} s wall", flush=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def on_the_wire(collective: str, nbytes: float, group_size: int) -> float:
    """What a collective's full buffer moves per rank: ``(n - 1) / n`` of it, ``2 (n - 1) / n`` for a
    ring all-reduce; nothing in a group of one rank (``observe/comm_ledger.py``)."""
    if group_size <= 1:
        return 0.0
    share = (group_size - 1) / group_size
    return nbytes * share * (2 if collective == "all_reduce" else 1)


def table(results: dict[str, list[list[dict[str, Any]]]]) -> str:
    med = statistics.median
    keys = sorted({k for side in SIDES for r in results[side] for k in r[0]["bytes_per_step"]})
    size = {k: max(r[0]["group_sizes"].get(k, 0) for side in SIDES for r in results[side]) for k in keys}
    rows = ["| side | tokens/s, median (repeats) | peak RSS per rank, MB (rank 0 / rank 1) | bytes per step, "
            "full buffers | bytes per step, on the wire |", "|---|---:|---:|---:|---:|"]
    for side in SIDES:
        runs = results[side]
        tps = [r[0]["tokens_per_s"] for r in runs]
        rss = [med(r[k]["peak_rss_mb"] for r in runs) for k in (0, 1)]
        per_key = {k: med(r[0]["bytes_per_step"].get(k, 0) for r in runs) for k in keys}
        wire = sum(on_the_wire(k.split("/")[0], b, size[k]) for k, b in per_key.items())
        rows.append(f"| {LABELS[side]} | {med(tps):.0f} ({', '.join(f'{t:.0f}' for t in tps)}) | "
                    f"{rss[0]:.0f} / {rss[1]:.0f} | {sum(per_key.values()):,.0f} | {wire:,.0f} |")
    ratios = [z[0]["tokens_per_s"] / h[0]["tokens_per_s"] for h, z in zip(results["hf"], results["zeromoe"])]
    rows.append(f"| tokens/s ratio zeromoe / hf, paired by repeat | {med(ratios):.2f} "
                f"({', '.join(f'{r:.2f}' for r in ratios)}) | | | |")
    rows += ["", "| collective/group (rank 0, per optimizer step) | " + " | ".join(f"{s}: bytes (calls)" for s in SIDES)
             + " |", "|---|" + "---:|" * len(SIDES)]
    for k in keys:
        cells = []
        for side in SIDES:
            b = med(r[0]["bytes_per_step"].get(k, 0) for r in results[side])
            n = med(r[0]["calls_per_step"].get(k, 0) for r in results[side])
            cells.append(f"{b:,.0f} ({n:g})")
        rows.append(f"| {k} ({size[k]} rank{'s' if size[k] != 1 else ''}) | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="micro-batch per rank (sequences)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    parser.add_argument("--json", type=Path, help="write every rank's record here")
    parser.add_argument("--table", type=Path, help="only print the tables of an earlier run's --json file")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    results: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in SIDES}
    with tempfile.TemporaryDirectory(prefix="peer_compare_") as tmp:
        for repeat in range(args.repeats):
            order = SIDES if repeat % 2 == 0 else SIDES[::-1]
            print(f"repeat {repeat + 1}/{args.repeats}", flush=True)
            for side in order:
                results[side].append(launch(side, Path(tmp) / f"{side}{repeat}", args))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(f"\n{args.repeats} repeats, {args.warmup} warm-up + {args.steps} timed steps, micro-batch "
          f"{args.batch} x {args.seq} tokens per rank, 2 ranks, fp32\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
