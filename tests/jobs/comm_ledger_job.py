"""The communication ledger on real training: several (stage, ep_size) setups, each trained for a
few steps with the ledger on, in one launch (the process group and DeepSpeed's expert groups are
created once and reused, as in ``strategy_paths.py``)::

    python -m torch.distributed.run --nproc_per_node 2 tests/jobs/comm_ledger_job.py --out DIR \
        --runs s1e1,s3e2 --raw s1e1,s2e1,s3e1,s1e2,s2e2,s3e2

``--runs``: real ``Trainer.fit`` with ``ZeroMoEStrategy(comm_stats=True)``. ``--raw``: raw DeepSpeed
engines (the config the strategy would build, ``lightning_zeromoe.config.deepspeed.build_config``) with
``CommLedger.install()`` and ``close_step()`` called by the loop: the same counting, without
Lightning's start-up per setup, so that every setup fits in the CI's time. Run names:
``s<stage>e<ep_size>`` with an optional ``a<accumulation>`` (``s2e2a2``), and ``fail`` (Lightning
only: a training step raises at the second step; the ledger must put torch.distributed back).
Per run and rank it writes ``DIR/<run>/rank<R>.json`` (raw runs: ``DIR/raw_<run>/``): the ledger's
steps, the model's parameter sizes (dense and expert, from the model before AutoEP, in forward
order) and the shapes the comm model needs, whether every wrapped function was restored, and
(rank 0, Lightning run ``s3e2``) the ``comm/...`` metrics a CSVLogger received, and those the
``ExpertUtilizationMonitor`` logged beside its per-expert shares (``experts/comm/...``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_zeromoe import ZeroMoEStrategy  # noqa: E402
from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoEModule  # noqa: E402
from lightning_zeromoe.observe.comm_ledger import COUNTED  # noqa: E402
from lightning_zeromoe.planner import count_params  # noqa: E402

BATCH = 4
#: Large enough that a bucket boundary is not the whole story, small enough for 2 busy cores.
MODEL = dict(hidden_size=64, ffn_hidden_size=96, num_experts=4, top_k=2, num_layers=2)
STEPS = 3


class Failing(TinyMoEModule):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise RuntimeError("planned failure at the second step")
        return super().training_step(batch, batch_idx)


def originals() -> dict[str, object]:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    return {f"{owner.__name__}.{name}": getattr(owner, name) for owner in (dist, c10d) for name in COUNTED
            if hasattr(owner, name)}


def parse(name: str) -> tuple[int, int, int, dict]:
    """``s<stage>e<ep>[a<accumulation>][r<stage3_max_reuse_distance>][p<stage3_prefetch_bucket_size>][b]``
    (``b``: bf16, raw runs only)."""
    match = re.fullmatch(r"s(\d)e(\d)(?:a(\d))?(?:r(\d+))?(?:p(\d+))?b?", name)
    if not match:
        return 2, 2, 1, {}
    zero = {key: int(value) for key, value in (("stage3_max_reuse_distance", match[4]),
                                               ("stage3_prefetch_bucket_size", match[5])) if value}
    return int(match[1]), int(match[2]), int(match[3] or 1), zero


def model_record(model) -> dict:
    from lightning_zeromoe.planner import is_expert_param

    counts = count_params(model)
    return {"dense": list(counts.dense), "expert": list(counts.expert), "model": MODEL,
            "order": [[p.numel(), is_expert_param(n), n.rpartition(".")[0]] for n, p in model.named_parameters()]}


def run(name: str, out: Path, world: int) -> None:
    failing = name == "fail"
    stage, ep, accum, _ = parse(name)
    L.seed_everything(0, verbose=False)
    cls = Failing if failing else TinyMoEModule
    module = cls(TinyMoEConfig(**MODEL), batch_size=BATCH, num_samples=BATCH * world * accum * (STEPS + 1))
    record = model_record(module.model)  # before fit: AutoEP replaces the MoE blocks
    seq = len(module.train_dataloader().dataset[0]["input_ids"]) - 1
    logger = L.pytorch.loggers.CSVLogger(str(out / name / "logs"), name="") if name == "s3e2" else False
    before = originals()
    strategy = ZeroMoEStrategy(ep_size=ep, stage=stage, param_persistence_threshold=0, comm_stats=True,
                               grad_audit_steps=0)
    from lightning_zeromoe import ExpertUtilizationMonitor

    # The monitor's window ends at step 3; its own all-reduce of the expert counters then counts
    # towards step 4, so steps 1-3 hold only training traffic (step 4 is not compared).
    monitor = [ExpertUtilizationMonitor(every_n_steps=STEPS)] if logger else []
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=STEPS + (1 if logger else 0), logger=logger,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        accumulate_grad_batches=accum, strategy=strategy, callbacks=monitor)
    error = None
    try:
        trainer.fit(module)
    except RuntimeError as err:
        error = str(err)
    after = originals()
    result = {"run": name, "stage": stage, "ep_size": ep, "accumulation": accum, "world": world,
              "rank": trainer.global_rank, "error": error, "lightning": True,
              "restored": [k for k in before if after[k] is not before[k]] == [],
              "steps": [s.as_dict() for s in strategy.comm_ledger.steps],
              **record, "tokens_per_micro_batch": BATCH * seq,
              "zero": trainer.strategy.config.get("zero_optimization", {}),
              "precision": str(trainer.precision)}
    if logger and trainer.global_rank == 0:
        rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
        result["logged"] = [{k: v for k, v in r.items() if k.startswith("comm/") and v} | {"step": r["step"]}
                            for r in rows if any(k.startswith("comm/") and v for k, v in r.items())]
        result["monitor"] = [{k: v for k, v in r.items() if k.startswith("experts/") and v} | {"step": r["step"]}
                             for r in rows if any(k.startswith("experts/comm/") and v for k, v in r.items())]
    (out / name).mkdir(parents=True, exist_ok=True)
    (out / name / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def run_raw(name: str, out: Path, world: int) -> None:
    """One setup on a raw DeepSpeed engine: 3 optimizer steps of ``accumulation`` micro-batches."""
    import argparse as ap

    import deepspeed
    import torch.nn.functional as F

    from lightning_zeromoe.config.deepspeed import ZeroOptions, build_config
    from lightning_zeromoe.discovery.find import discover
    from lightning_zeromoe.reference.models import TinyMoELM, load_balancing_loss
    from lightning_zeromoe.observe.comm_ledger import CommLedger

    stage, ep, accum, zero = parse(name)
    torch.manual_seed(0)
    model = TinyMoELM(TinyMoEConfig(**MODEL))
    record = model_record(model)
    opts = ZeroOptions(stage=stage, ep_size=ep, param_persistence_threshold=0)
    config = build_config(opts, discover(model, None).autoep if ep > 1 else None, use_grouped_mm=False)
    config["zero_optimization"].update(zero)
    bf16 = name.endswith("b")
    if bf16:
        config["bf16"] = {"enabled": True}  # bf16-mixed: the engine casts the fp32 model
    config.update({"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": accum,
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}}})
    engine, *_ = deepspeed.initialize(args=ap.Namespace(device_rank=int(os.environ.get("LOCAL_RANK", 0))),
                                      model=model, model_parameters=list(model.parameters()), config=config,
                                      dist_init_required=False)
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(1 + rank)
    seq = 32
    before = originals()
    ledger = CommLedger()
    ledger.install()
    try:
        for step in range(1, STEPS + 1):
            for _ in range(accum):
                ids = torch.randint(0, model.config.vocab_size, (BATCH, seq + 1), generator=gen)
                logits, router = engine(ids[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
                loss = loss + 0.01 * load_balancing_loss(router, MODEL["top_k"], BATCH).mean()
                engine.backward(loss)
                engine.step()
            ledger.close_step(step)
    finally:
        ledger.uninstall()
    after = originals()
    result = {"run": name, "stage": stage, "ep_size": ep, "accumulation": accum, "world": world, "rank": rank,
              "restored": [k for k in before if after[k] is not before[k]] == [], "lightning": False,
              "steps": [s.as_dict() for s in ledger.steps], **record, "tokens_per_micro_batch": BATCH * seq,
              "zero": config["zero_optimization"], "precision": "bf16-mixed" if bf16 else "32-true"}
    engine.destroy()
    (out / f"raw_{name}").mkdir(parents=True, exist_ok=True)
    (out / f"raw_{name}" / f"rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", default="", help="Lightning fits")
    parser.add_argument("--raw", default="", help="raw DeepSpeed engines")
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", 2))
    if args.raw:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    import time

    for name in filter(None, args.raw.split(",")):
        start = time.perf_counter()
        run_raw(name, args.out, world)
        print(f"raw {name}: {time.perf_counter() - start:.1f} s", flush=True)
    for name in filter(None, args.runs.split(",")):
        start = time.perf_counter()
        run(name, args.out, world)
        print(f"fit {name}: {time.perf_counter() - start:.1f} s", flush=True)
    from _teardown import end_job  # tests/jobs: the script's own directory

    end_job()


if __name__ == "__main__":
    main()
