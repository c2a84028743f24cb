"""Every Hugging Face MoE family under ``ZeroMoEStrategy(ep_size=2)``, against a plain run, in one launch.

Launched once with ``torchrun --nproc_per_node 2`` (Lightning joins the torchrun world instead of
re-running the script), it loops over the families of ``tests/support/hf_zoo.py``: one tiny model, one
``Trainer.fit`` (ZeRO-3, AutoEP where the setup-time probe allows it, the ZeRO-3 fallback
elsewhere), a few steps of HF's own loss (LM + ``router_aux_loss_coef`` x aux loss, with
``output_router_logits=True``). Afterwards rank 0 replays the batches both ranks received on a
plain single-process copy of the same model (same initial weights, same AdamW) and records the
per-step, per-rank loss and aux loss of both runs. With ``--export DIR`` each family's trained
model is also saved (``trainer.save_checkpoint``); once every family has trained, the ranks share
the exports (rank r every world-th family), each with ``zeromoe-export``'s function, loaded back with ``AutoModelForCausalLM.from_pretrained`` and compared with the trained
model: the loader's report, and logits on held-out tokens against what ``trainer.validate`` (our
evaluation engine, after ``fit``) computed. (Not against the plain run's copy: two AdamW steps
amplify float noise in near-zero gradients to ~1e-3 relative weight differences, measured on
GraniteMoE-Hybrid, although the losses agree to 3e-7.) ``tests/test_hf_coverage.py`` asserts on the
JSON and writes the coverage table.

Usage::

    torchrun --nproc_per_node 2 tests/jobs/hf_zoo_parity.py --out /tmp/zoo [--archs mixtral olmoe:1]
        [--uneven olmoe:1 gpt_oss:2] [--export /tmp/zoo_export [--resume hunyuan_v1_moe:1]]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
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

from support.hf_zoo import ARCHS, VOCAB, build  # noqa: E402
from lightning_zeromoe import ZeroMoEStrategy  # noqa: E402
from lightning_zeromoe.reference.models import SyntheticLMData  # noqa: E402

SEQ_LEN = 9
BATCH = 2
LR = 1e-2


def hf_loss(net: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, float | None, int]:
    """HF's loss, its aux loss, and how many router-logit tensors HF's recorder returned."""
    out = net(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
    aux = getattr(out, "aux_loss", None)
    logits = getattr(out, "router_logits", None)
    count = len(logits) if isinstance(logits, (tuple, list)) else 0
    return out.loss, (None if aux is None else float(aux.detach())), count


def skew_routers(net: torch.nn.Module, rank: int) -> int:
    """Uneven routing on purpose: every router of ``net`` sends all of rank 0's tokens to the first
    half of the experts and all of rank 1's tokens to the second half, by adding a large
    rank-dependent offset to the router logits (a forward hook on each router module that, for
    routers returning ``(logits, weights, indices)``, also re-selects the top-k from the skewed
    logits). Returns the number of routers hooked."""
    from lightning_zeromoe.discovery.structure import find_blocks

    hooked = 0
    for layout in find_blocks(net):
        router = net.get_submodule(f"{layout.path}.{layout.router}")
        offset = torch.zeros(layout.num_experts)
        offset[: layout.num_experts // 2] = 50.0 if rank == 0 else -50.0

        def hook(_m: torch.nn.Module, _a: Any, out: Any, offset: torch.Tensor = offset) -> Any:
            if not isinstance(out, tuple):
                return out + offset.to(out.dtype)
            # (logits, top-k weights, top-k indices): route again from the skewed logits
            logits = out[0] + offset.to(out[0].dtype)
            top = torch.topk(torch.softmax(logits.float(), dim=-1), k=out[2].shape[-1], dim=-1)
            weights = (top.values / top.values.sum(dim=-1, keepdim=True)).to(out[1].dtype)
            return (logits, weights, top.indices)
        router.register_forward_hook(hook)
        hooked += 1
    return hooked


class ZooModule(L.LightningModule):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net
        self.records: list[dict[str, Any]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, aux, count = hf_loss(self.net, batch["input_ids"])
        self.records.append({"indices": [int(i) for i in batch["index"]], "loss": float(loss.detach()), "aux": aux,
                             "router_logits": count})
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """The trained model's logits on fixed held-out tokens (the same on every rank)."""
        self.eval_logits = self.net(input_ids=held_out_ids(), use_cache=False).logits.detach().float().cpu()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_data(), batch_size=BATCH, shuffle=False, drop_last=True)


def _data() -> SyntheticLMData:
    return SyntheticLMData(num_samples=64, seq_len=SEQ_LEN, vocab_size=VOCAB, seed=0)


def reference(arch: str, per_rank_indices: list[list[list[int]]]) -> list[list[dict[str, Any]]]:
    """The plain run: one process, the same model, each step the mean of the ranks' losses."""
    net = build(arch)
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)
    data = _data()
    steps = len(per_rank_indices[0])
    out: list[list[dict[str, Any]]] = [[] for _ in per_rank_indices]
    for step in range(steps):
        opt.zero_grad()
        losses = []
        for rank, indices in enumerate(per_rank_indices):
            ids = torch.stack([data[i]["input_ids"] for i in indices[step]])
            loss, aux, count = hf_loss(net, ids)
            out[rank].append({"loss": float(loss.detach()), "aux": aux, "router_logits": count})
            losses.append(loss)
        torch.stack(losses).mean().backward()
        opt.step()
    return out


def held_out_ids() -> torch.Tensor:
    return SyntheticLMData(num_samples=2, seq_len=SEQ_LEN, vocab_size=VOCAB, seed=7).tokens


def export_round_trip(ckpt: Path, out_dir: Path, want: torch.Tensor) -> dict[str, Any]:
    """Export ``ckpt`` to an HF directory, ``from_pretrained`` it, and compare it with the
    trained model: what the loader reported, and the logits on held-out tokens (``want``)."""
    from transformers import AutoModelForCausalLM

    from lightning_zeromoe.checkpoint import export

    try:
        export(ckpt, out_dir, overwrite=True, progress=False)
        loaded, info = AutoModelForCausalLM.from_pretrained(out_dir, output_loading_info=True)
    except Exception as exc:  # noqa: BLE001 - reported per family
        return {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
    loaded.eval()
    with torch.no_grad():
        got = loaded(input_ids=held_out_ids(), use_cache=False).logits
    return {"class": type(loaded).__name__, "loading_info": {k: sorted(map(str, v)) for k, v in info.items()},
            "max_abs_logit_gap": float((got - want).abs().max()), "logit_scale": float(want.abs().max()),
            "files": sorted(p.name for p in out_dir.iterdir())}


#: Steps trained after resuming: the second one's loss depends on the restored optimizer state.
RESUMED_STEPS = 2


def run_arch(arch: str, ep_size: int, steps: int, uneven: bool = False, ckpt: Path | None = None,
             resume_ep: int | None = None) -> dict[str, Any]:
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    t0 = time.perf_counter()
    module = ZooModule(build(arch))
    skewed = skew_routers(module.net, dist.get_rank()) if uneven else 0
    strategy = ZeroMoEStrategy(ep_size=ep_size, param_persistence_threshold=0, timeout=timedelta(seconds=120))
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1)
    trainer.fit(module)
    if ckpt is not None:
        trainer.save_checkpoint(ckpt)
        trainer.validate(module, dataloaders=module.train_dataloader(), verbose=False)
    resumed_records = None
    if ckpt is not None and resume_ep is not None:
        # A new job on another shape: other initial weights (the checkpoint must bring them all,
        # frozen routing biases included), ep_size changed, RESUMED_STEPS more steps.
        resumed = ZooModule(build(arch, seed=1))
        again = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), max_steps=steps + RESUMED_STEPS,
                          strategy=ZeroMoEStrategy(ep_size=resume_ep, param_persistence_threshold=0,
                                                   timeout=timedelta(seconds=120)),
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
        again.fit(resumed, ckpt_path=ckpt)
        resumed_records = resumed.records
    found = strategy.discovery
    converted = sorted(n for n, m in module.named_modules() if isinstance(m, AutoEPMoELayer))
    return {
        "arch": arch, "hf_class": type(module.net).__name__, "records": module.records,
        "source": found.source if found else None,
        "ep_blocks": [b.path for b in found.blocks] if found else [],
        "fallback": [[b.path, b.reason] for b in found.fallback] if found else [],
        "converted": converted, "summary": found.summary() if found else "",
        "leaf_blocks": sorted(n for n, m in module.named_modules() if getattr(m, "_z3_leaf", False)),
        "seconds": round(time.perf_counter() - t0, 2), "ep_size": ep_size, "skewed_routers": skewed,
        "eval_logits": getattr(module, "eval_logits", None), "resumed_records": resumed_records,
        "resume_ep": resume_ep,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--archs", nargs="*", default=list(ARCHS))
    parser.add_argument("--ep-size", type=int, default=2, help="default ep_size; 'arch:N' in --archs overrides")
    parser.add_argument("--uneven", nargs="*", default=[],
                        help="after the parity runs, these 'arch:ep' with the routers skewed per rank (skew_routers)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--export", type=Path, default=None,
                        help="save, export and reload every family's trained model under this directory")
    parser.add_argument("--resume", nargs="*", default=[],
                        help="'arch:ep' (needs --export): resume the saved checkpoint with this ep_size for "
                             f"{RESUMED_STEPS} more steps, compared with the plain run continued")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    resumes = {a: int(e) for a, _, e in (r.partition(":") for r in args.resume)}
    to_export: dict[str, tuple[Path, torch.Tensor | None]] = {}
    for spec in [*args.archs, *(f"uneven:{u}" for u in args.uneven)]:
        uneven = spec.startswith("uneven:")
        arch, _, ep = spec.removeprefix("uneven:").partition(":")
        key = f"uneven:{arch}" if uneven else arch
        ckpt = None if uneven or args.export is None else args.export / arch / "checkpoint"
        resume_ep = None if uneven else resumes.get(arch)
        # One full collection per family, then everything alive is frozen out of later collections:
        # the gc.collect() calls inside a family (DeepSpeed's defragment, the conversion probe, the
        # export's shard release) then scan only that family's objects, not the whole process
        # (0.35 s each here, ~4 per family). What the family leaves behind is collected next round.
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        try:
            result = run_arch(arch, int(ep or args.ep_size), args.steps, uneven, ckpt, resume_ep)
        except Exception as exc:  # noqa: BLE001 - one family failing must not hide the others
            result = {"arch": arch, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [r["indices"] for r in result.get("records", [])])
        resumed: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(resumed, result.get("resumed_records"))
        result["per_rank_resumed"] = resumed
        if rank == 0 and "error" not in result and all(gathered) and not uneven:
            result["per_rank_indices"] = gathered
            # the plain run continued over the batches the resumed job received
            more = [[r["indices"] for r in rank_records or []] for rank_records in resumed]
            result["reference"] = reference(arch, [a + b for a, b in zip(gathered, more)])
        logits = result.pop("eval_logits", None)  # a tensor: not for the JSON
        if ckpt is not None and "error" not in result and not uneven:
            to_export[arch] = (ckpt, logits)
        gathered_results: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered_results, result.get("records"))
        result["per_rank_records"] = gathered_results
        results[key] = result
        if rank == 0:
            print(f"[zoo] {key}: {result.get('summary') or result.get('error', '')[:200]} "
                  f"({result.get('seconds', '?')}s)", flush=True)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "zoo.json").write_text(json.dumps(results, indent=1))
    if args.export is not None:
        # Every checkpoint is on disk: the ranks export and reload them side by side, rank r taking
        # every world-th family of rank 0's list (the validated logits are the same on every rank).
        names: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(names, sorted(to_export))
        mine: dict[str, Any] = {}
        for arch in names[0][rank::dist.get_world_size()]:
            if arch not in to_export:
                mine[arch] = {"error": f"rank {rank} has no trained {arch} to export"}
                continue
            ckpt, logits = to_export[arch]
            mine[arch] = export_round_trip(ckpt, args.export / arch / "hf", logits)
        exported: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(exported, mine)
        if rank == 0:
            for part in exported:
                for arch, outcome in part.items():
                    results[arch]["export"] = outcome
            (args.out / "zoo.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
