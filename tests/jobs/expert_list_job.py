"""Hand-written MoE blocks (router Linear + ModuleList of expert MLPs) under ZeroMoEStrategy, in one launch.

Launched once with ``torchrun --nproc_per_node 2`` (Lightning joins the torchrun world). Each
``--runs kind:ep`` trains the tiny LM of ``tests/support/expert_list_models.py`` with that block for a few
steps under ``ZeroMoEStrategy(ep_size=ep)`` (ZeRO-3), with every router's logits skewed per rank
(``Skew``: rank 0's tokens go to the second half of the experts, rank 1's to the first half, so
the ranks route to disjoint experts, the data that made ZeRO-3 hang). Afterwards rank 0 replays
the batches both ranks received on a plain single-process copy (same initial weights, same
AdamW, each rank's batch with that rank's skew) and records both runs' per-step losses.

``--save kind:ep`` also saves that run (``trainer.save_checkpoint``), evaluates it
(``trainer.validate``: logits on held-out tokens), exports it with ``zeromoe-export``'s function to
one safetensors file, loads that into a plain model with ``load_state_dict(strict=True)`` (the
model's own names, ``experts.{i}.<proj>.weight``) and compares the logits. ``--resume kind:ep=N``
then resumes that checkpoint in a new job with other initial weights and ``ep_size=N`` for
``RESUMED_STEPS`` more steps; the plain run is continued over those batches too.

Writes ``OUT/expert_list.json`` (rank 0). ``tests/test_expert_list_moe.py`` asserts on it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[2]
for extra in (REPO, REPO / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from support.expert_list_models import VOCAB, HandMoELM, Skew  # noqa: E402
from lightning_zeromoe import ZeroMoEStrategy  # noqa: E402
from lightning_zeromoe.reference.models import SyntheticLMData  # noqa: E402

SEQ_LEN = 9
BATCH = 2
LR = 1e-2
STEPS = 3
RESUMED_STEPS = 2


def _data() -> SyntheticLMData:
    return SyntheticLMData(num_samples=64, seq_len=SEQ_LEN, vocab_size=VOCAB, seed=0)


def held_out_ids() -> torch.Tensor:
    return SyntheticLMData(num_samples=2, seq_len=SEQ_LEN, vocab_size=VOCAB, seed=7).tokens


class HandModule(L.LightningModule):
    def __init__(self, net: HandMoELM) -> None:
        super().__init__()
        self.net = net
        self.skew = Skew()
        self.records: list[dict[str, Any]] = []

    def on_fit_start(self) -> None:
        # After deepspeed.initialize: hook the routers the model now has (AutoEP's router.gate when converted).
        self.skew.rank = self.global_rank
        self.skew.install(self.net)
        self.expert_tokens = {f"layers.{i}": [0] * self.net.num_experts for i in range(len(self.net.layers))}
        self._count_handles = []
        for i, layer in enumerate(self.net.layers):
            if getattr(type(layer.moe), "_is_autoep_layer", False):
                layer.moe.tokens_per_expert.zero_()  # AutoEP counts this rank's routing choices itself
                continue
            for e, expert in enumerate(layer.moe.experts):
                def count(_m: Any, args: Any, key: str = f"layers.{i}", e: int = e) -> None:
                    self.expert_tokens[key][e] += int(args[0].shape[0])
                self._count_handles.append(expert.register_forward_pre_hook(count))

    def on_fit_end(self) -> None:
        self.skew.remove()
        for h in self._count_handles:
            h.remove()
        for i, layer in enumerate(self.net.layers):
            if getattr(type(layer.moe), "_is_autoep_layer", False):
                self.expert_tokens[f"layers.{i}"] = [int(c) for c in layer.moe.tokens_per_expert.tolist()]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, aux = self.net.loss(batch["input_ids"])
        self.records.append({"indices": [int(i) for i in batch["index"]], "loss": float(loss.detach()), "aux": aux})
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.eval_logits = self.net(held_out_ids())[0].detach().float().cpu()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=BATCH, shuffle=False, drop_last=True)


def _trainer(ep_size: int, max_steps: int) -> tuple[L.Trainer, ZeroMoEStrategy]:
    strategy = ZeroMoEStrategy(ep_size=ep_size, param_persistence_threshold=0, timeout=timedelta(seconds=120))
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=max_steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1)
    return trainer, strategy


def reference(kind: str, per_rank_indices: list[list[list[int]]]) -> list[list[dict[str, Any]]]:
    """The plain run: one process, the same model and AdamW; each step the mean of the ranks' losses,
    each rank's batch routed with that rank's skew."""
    net = HandMoELM(kind)
    net.train()
    skew = Skew()
    skew.install(net)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)
    data = _data()
    out: list[list[dict[str, Any]]] = [[] for _ in per_rank_indices]
    for step in range(len(per_rank_indices[0])):
        opt.zero_grad()
        losses = []
        for rank, indices in enumerate(per_rank_indices):
            skew.rank = rank
            loss, aux = net.loss(torch.stack([data[i]["input_ids"] for i in indices[step]]))
            out[rank].append({"loss": float(loss.detach()), "aux": aux})
            losses.append(loss)
        torch.stack(losses).mean().backward()
        opt.step()
    return out


def export_round_trip(kind: str, ckpt: Path, out_file: Path, want: torch.Tensor) -> dict[str, Any]:
    """Rank 0: export ``ckpt`` to one safetensors file, load it into a plain model by its own names."""
    from safetensors.torch import load_file

    from lightning_zeromoe.checkpoint import export

    try:
        export(ckpt, out_file, overwrite=True, progress=False)
        state = load_file(out_file)
        net = HandMoELM(kind, seed=5)
        own = {k.removeprefix("net."): v for k, v in state.items()}
        report = net.load_state_dict(own, strict=True)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        return {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
    net.eval()
    with torch.no_grad():
        got = net(held_out_ids())[0]
    return {"names": sorted(own), "missing": list(report.missing_keys), "unexpected": list(report.unexpected_keys),
            "max_abs_logit_gap": float((got - want).abs().max()), "logit_scale": float(want.abs().max())}


def run(kind: str, ep_size: int, ckpt: Path | None, resume_ep: int | None) -> dict[str, Any]:
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    t0 = time.perf_counter()
    module = HandModule(HandMoELM(kind))
    trainer, strategy = _trainer(ep_size, STEPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    result: dict[str, Any] = {
        "kind": kind, "ep_size": ep_size, "records": module.records,
        "warnings": [str(w.message) for w in caught if str(w.message).startswith("[")],
        "converted": sorted(n for n, m in module.named_modules() if isinstance(m, AutoEPMoELayer)),
        "leaf_blocks": sorted(n for n, m in module.named_modules() if getattr(m, "_z3_leaf", False)),
        # tokens this rank routed to each expert over the run (forward passes of training only)
        "expert_tokens": module.expert_tokens,
    }
    found = strategy.discovery
    if found is not None:
        result.update(source=found.source, ep_blocks=[b.path for b in found.blocks],
                      fallback=[[b.path, b.reason] for b in found.fallback], summary=found.summary(ep_size > 1),
                      autoep=found.autoep)
    if ckpt is not None:
        trainer.save_checkpoint(ckpt)
        trainer.validate(module, dataloaders=module.train_dataloader(), verbose=False)
        result["eval_logits"] = module.eval_logits
    if ckpt is not None and resume_ep is not None:
        resumed = HandModule(HandMoELM(kind, seed=1))  # other initial weights: the checkpoint must bring them all
        again, _ = _trainer(resume_ep, STEPS + RESUMED_STEPS)
        again.fit(resumed, ckpt_path=ckpt)
        result["resumed_records"] = resumed.records
        result["resume_ep"] = resume_ep
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", nargs="+", required=True, help="kind:ep_size, e.g. switch:1 topk_softmax:2")
    parser.add_argument("--save", nargs="*", default=[], help="kind:ep runs to save, validate and export")
    parser.add_argument("--resume", nargs="*", default=[], help="kind:ep=new_ep (a saved run): resume with new_ep")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    rank = dist.get_rank()
    resumes = {spec: int(e) for spec, _, e in (r.partition("=") for r in args.resume)}
    results: dict[str, Any] = {}
    for spec in args.runs:
        kind, _, ep = spec.partition(":")
        ckpt = args.out / spec.replace(":", "_ep") / "checkpoint" if spec in args.save else None
        try:
            result = run(kind, int(ep), ckpt, resumes.get(spec) if ckpt is not None else None)
        except Exception as exc:  # noqa: BLE001 - one run failing must not hide the others
            result = {"kind": kind, "ep_size": int(ep), "error": f"{type(exc).__name__}: {exc}",
                      "trace": traceback.format_exc()[-4000:]}
            print(f"[expert-list] {spec} failed on rank {rank}: {result['error'][:2000]}", file=sys.stderr, flush=True)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [r["indices"] for r in result.get("records", [])])
        resumed: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(resumed, [r["indices"] for r in result.get("resumed_records", [])])
        records: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(records, {"records": result.get("records"),
                                         "resumed_records": result.get("resumed_records"),
                                         "expert_tokens": result.get("expert_tokens")})
        eval_logits = result.pop("eval_logits", None)
        if rank == 0 and "error" not in result and all(gathered):
            result["per_rank_records"] = records
            result["reference"] = reference(kind, [a + b for a, b in zip(gathered, resumed)])
            if ckpt is not None and eval_logits is not None:
                result["export"] = export_round_trip(kind, ckpt, ckpt.parent / "model.safetensors", eval_logits)
        results[spec] = result
        if rank == 0:
            print(f"[expert-list] {spec}: {result.get('summary') or result.get('error', '')[:300]} "
                  f"({result.get('seconds', '?')}s)", flush=True)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "expert_list.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
