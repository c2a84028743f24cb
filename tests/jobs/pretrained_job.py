"""Fine-tune a ``save_pretrained`` Mixtral loaded with ``from_pretrained`` inside ``configure_model``.

A standalone 2-rank job (Lightning re-runs this file for rank 1); ``tests/test_pretrained.py``
runs it and asserts on the per-rank JSON it writes. ZeRO-3, ``ep_size=2``, fp32, torch AdamW,
``accumulate_grad_batches`` micro-batches per optimizer step, and a gradient audit of
``--audit-steps`` optimizer steps.

Recorded per rank, from the live objects:

* ``load``: right after ``from_pretrained`` returned inside ``configure_model``: for every
  parameter its full element count (``ds_numel``), the elements this rank stores (its ZeRO-3
  partition, ``ds_tensor``) and the elements materialised in ``param.data`` (0 when partitioned);
  the largest partition :func:`lightning_zeromoe.loading.hf_zero3.copy_into_partition` copied into; and how
  many experts' rows of fused expert tensors there were and how many this rank converted
  (:mod:`lightning_zeromoe.loading.expert_fusion`).
* ``steps``: per micro-batch, the sample indices this rank trained on and its loss.
* ``audit``: how many optimizer steps the gradient audit counted, and at which micro-batch
  (``batch_idx``) it produced its report.

* ``engine``: at the start of training, the engine's ZeRO stage and how many of its parameters
  carry ZeRO-3's ``ds_id``; ``stage_lines``: rank 0's logged lines about the stage.

``--stage auto --plan-for DIR`` runs ``ZeroMoEStrategy(stage="auto", plan_for=DIR)`` instead of ZeRO-3
(``tests/test_plan_for.py``).

    python tests/jobs/pretrained_job.py --pretrained DIR --out OUT [--steps 3 --accumulate 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lightning_zeromoe import ZeroMoEStrategy  # noqa: E402
from lightning_zeromoe.loading import hf_zero3 as hf_loading  # noqa: E402
from lightning_zeromoe.reference.models import SyntheticLMData  # noqa: E402

SEQ_LEN, LR = 17, 3e-3


class PretrainedModule(L.LightningModule):
    def __init__(self, path: str, batch_size: int, num_samples: int, vocab: int) -> None:
        super().__init__()
        self.path, self.batch_size, self.num_samples, self.vocab = path, batch_size, num_samples, vocab
        self.model: torch.nn.Module | None = None
        self.load_report: dict[str, Any] = {}
        self.records: list[dict[str, Any]] = []
        self.audit_reported_at: int | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        largest = [0]
        original = hf_loading.copy_into_partition

        def watched(param: torch.Tensor, source: torch.Tensor, key: str = "") -> str | None:
            part = getattr(param, "ds_tensor", None)
            largest[0] = max(largest[0], int(part.numel()) if part is not None else int(source.numel()))
            return original(param, source, key)

        rows = {"total": 0, "converted": 0}
        original_rows = hf_loading.load_expert_rows

        def watched_rows(item: Any, state_dict: Any, convert: Any, release: Any) -> bool:
            rows["total"] += len(item.rows)

            def counted(part: Any) -> Any:
                rows["converted"] += 1
                return convert(part)

            return original_rows(item, state_dict, counted, release)

        hf_loading.copy_into_partition, hf_loading.load_expert_rows = watched, watched_rows
        try:
            self.model = AutoModelForCausalLM.from_pretrained(self.path)
        finally:
            hf_loading.copy_into_partition, hf_loading.load_expert_rows = original, original_rows
        params = {n: {"ds_numel": int(getattr(p, "ds_numel", p.numel())),
                      "partition": int(p.ds_tensor.numel()) if hasattr(p, "ds_tensor") else None,
                      "materialised": int(p.data.numel())} for n, p in self.model.named_parameters()}
        self.load_report = {"params": params, "largest_slice_copied": largest[0], "expert_rows": rows,
                            "zero3_partitioned": all(hasattr(p, "ds_id") for p in self.model.parameters()),
                            "with_ds_id": sum(hasattr(p, "ds_id") for p in self.model.parameters())}

    def on_train_start(self) -> None:
        engine = self.trainer.strategy.deepspeed_engine
        self.engine_facts = {"zero_stage": int(engine.zero_optimization_stage()),
                             "with_ds_id": sum(hasattr(p, "ds_id") for p in engine.module.parameters())}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        out = self.model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
        self.records.append({"batch_idx": batch_idx, "indices": [int(i) for i in batch["index"]],
                             "loss": float(out.loss.detach())})
        return out.loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        audit = self.trainer.strategy.pitfalls.audit if hasattr(self.trainer.strategy, "pitfalls") else None
        if audit is not None and audit.report is not None and self.audit_reported_at is None:
            self.audit_reported_at = batch_idx

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)

    def train_dataloader(self) -> DataLoader:
        data = SyntheticLMData(num_samples=self.num_samples, seq_len=SEQ_LEN, vocab_size=self.vocab, seed=0)
        return DataLoader(data, batch_size=self.batch_size, shuffle=False, drop_last=True)


class StageLines(logging.Handler):
    """Rank 0's logged lines that mention the ZeRO stage."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "stage" in record.getMessage():
            self.lines.append(record.getMessage())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrained", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--audit-steps", type=int, default=2)
    parser.add_argument("--stage", default="3", help="a ZeRO stage or 'auto'")
    parser.add_argument("--plan-for", help="plan_for= for stage 'auto'")
    args = parser.parse_args()
    from lightning.pytorch.utilities.rank_zero import rank_zero_module  # the module rank_zero_info logs through

    stage_lines = StageLines()
    rank_zero_module.log.addHandler(stage_lines)

    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.pretrained).vocab_size
    module = PretrainedModule(args.pretrained, args.batch_size, args.batch_size * 2 * args.steps * args.accumulate, vocab)
    stage = args.stage if args.stage == "auto" else int(args.stage)
    strategy = ZeroMoEStrategy(ep_size=2, stage=stage, plan_for=args.plan_for, param_persistence_threshold=0,
                               grad_audit_steps=args.audit_steps)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, max_epochs=1,
                        accumulate_grad_batches=args.accumulate, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module)
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    layers = [m for m in module.model.modules() if isinstance(m, AutoEPMoELayer)]
    audit = strategy.pitfalls.audit
    report = {
        "rank": trainer.global_rank, "global_step": int(trainer.global_step),
        "load": module.load_report, "steps": module.records, "engine": module.engine_facts,
        "stage_lines": stage_lines.lines,
        "autoep_layers": [[int(m.num_experts), int(m.num_local_experts), int(m.ep_size)] for m in layers],
        "audit": {"optimizer_steps_counted": None if audit is None else audit.done,
                  "reported_at_batch_idx": module.audit_reported_at,
                  "report_steps": None if audit is None or audit.report is None else audit.report.steps},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
