"""ExpertBiasBalancer and the router z-loss under ZeroMoEStrategy, with and without expert parallelism,
in one 2-rank launch (one process group, one Trainer per case). Each case records, per optimizer
step and rank: the samples the rank trained on, its task / aux / z losses, and every balanced
layer's bias after the step's update. Afterwards rank 0 replays the tiny cases' batches on a plain
single-process model that applies the sign rule itself.

Cases (``--cases``; all by default):

* ``tiny_ep2``: the tiny MoE with a choice-only ``gate.e_score_correction_bias``, aux loss and
  z-loss, ``ep_size=2`` (AutoEP: the bias lives in AutoEP's router), 6 steps; saves a checkpoint
  after step 3 and exports it (rank 0, one ``.safetensors`` file);
* ``tiny_ep1``: the same without expert parallelism (the model's own blocks), 6 steps;
* ``tiny_resume``: ``ep_size=1`` resumed from ``tiny_ep2``'s step-3 checkpoint (another shape) with
  other initial weights, to step 6;
* ``<family>:<ep>`` for the Hugging Face families of ``HF``: HF's loss + 1e-3 x router z-loss of
  the router logits HF records, 3 steps;
* ``diverged``: rank 1's bias is changed behind the balancer's back after step 1; the check at
  step 2 must stop both ranks with ``[bias-balancing-diverged]``.

    python tests/jobs/balancing_job.py --out DIR [--cases tiny_ep2 tiny_ep1 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

REPO = Path(__file__).resolve().parents[2]
for extra in (REPO, REPO / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

BATCH, STEPS, SAVE_AT, RATE, Z_WEIGHT, AUX_WEIGHT, LR = 4, 6, 3, 0.05, 1e-3, 0.01, 3e-3
HF_STEPS, HF_BATCH, HF_SEQ, HF_LR, HF_RATE = 3, 2, 9, 1e-2, 0.05
#: Families with a choice-only bias in each place the balancer meets it: DeepSeek-V3's buffer on the
#: router (AutoEP preset), AFMoE's frozen parameter on the block (partitioned by ZeRO-3), LFM2-MoE's
#: buffer on the block, Kolibri-1 (a block AutoEP cannot take: the ZeRO-3 fallback, with EP on).
HF = ("deepseek_v3", "afmoe", "lfm2_moe", "kolibri1")
CASES = ("tiny_ep2", "tiny_ep1", "tiny_resume", *(f"{f}:{e}" for f in HF for e in (2, 1)), "diverged")


def tiny_config() -> Any:
    from lightning_zeromoe.reference.models import TinyMoEConfig

    return TinyMoEConfig(score_bias=True, aux_loss_weight=AUX_WEIGHT, z_loss_weight=Z_WEIGHT)


def _recorder(balancer: Any, save: Path | None = None) -> Any:
    """A callback after the balancer: the biases after each step's update; a checkpoint at SAVE_AT."""
    import lightning as L

    class Recorder(L.Callback):
        def __init__(self) -> None:
            self.biases: list[dict[str, list[float]]] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.biases.append({k: v.reshape(-1).tolist() for k, v in balancer.biases().items()})
            if save is not None and trainer.global_step == SAVE_AT:
                trainer.save_checkpoint(save)

    return Recorder()


def _trainer(ep: int, steps: int, callbacks: list[Any]) -> Any:
    import lightning as L

    from lightning_zeromoe import ZeroMoEStrategy

    return L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, callbacks=callbacks,
                     strategy=ZeroMoEStrategy(ep_size=ep, param_persistence_threshold=0,
                                              timeout=timedelta(seconds=120)))


def tiny_module(seed: int) -> Any:
    import lightning as L
    import torch

    from lightning_zeromoe.reference.models import TinyMoEModule

    class Recorded(TinyMoEModule):  # type: ignore[misc, valid-type]
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.records.append({"indices": [int(i) for i in batch["index"]], **self.last_losses})
            return loss

    L.seed_everything(seed, verbose=False)
    module = Recorded(tiny_config(), batch_size=BATCH, num_samples=BATCH * 2 * STEPS, lr=LR)
    module.records = []
    return module


def run_tiny(case: str, out: Path) -> dict[str, Any]:
    from lightning_zeromoe.balance.balancer import ExpertBiasBalancer

    ckpt = out / "tiny_ep2.ckpt"
    balancer = ExpertBiasBalancer(update_rate=RATE, check_every_n_steps=2)
    if case == "tiny_resume":
        module = tiny_module(seed=1)  # other initial weights: the checkpoint must bring them all
        recorder = _recorder(balancer)
        _trainer(1, STEPS, [balancer, recorder]).fit(module, ckpt_path=ckpt)
    else:
        module = tiny_module(seed=0)
        recorder = _recorder(balancer, ckpt if case == "tiny_ep2" else None)
        _trainer(2 if case == "tiny_ep2" else 1, STEPS, [balancer, recorder]).fit(module)
    result = {"records": module.records, "biases": recorder.biases, "updates": balancer.updates,
              "sites": [[s.layer, s.name, s.kind] for s in balancer.sites]}
    if case == "tiny_ep2" and int(os.environ["RANK"]) == 0:
        from safetensors.torch import load_file

        from lightning_zeromoe.checkpoint import export

        export(ckpt, out / "tiny_ep2.safetensors", overwrite=True, progress=False)
        result["exported"] = {k: v.reshape(-1).tolist() for k, v in load_file(out / "tiny_ep2.safetensors").items()
                              if "e_score_correction_bias" in k}
    return result


def run_hf(family: str, ep: int) -> dict[str, Any]:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from support.hf_zoo import VOCAB, build
    from lightning_zeromoe.balance.balancer import ExpertBiasBalancer, router_z_loss
    from lightning_zeromoe.reference.models import SyntheticLMData

    class HFModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build(family)
            self.records: list[dict[str, Any]] = []

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            out = self.net(input_ids=batch["input_ids"], labels=batch["input_ids"], output_router_logits=True,
                           use_cache=False)
            z = router_z_loss(out.router_logits)
            self.log("train/z_loss", z.detach())
            self.records.append({"indices": [int(i) for i in batch["index"]], "loss": float(out.loss.detach()),
                                 "z_loss": float(z.detach()), "router_logits": len(out.router_logits)})
            return out.loss + Z_WEIGHT * z

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=HF_LR, weight_decay=0.0)

        def train_dataloader(self) -> DataLoader:
            data = SyntheticLMData(num_samples=64, seq_len=HF_SEQ, vocab_size=VOCAB, seed=0)
            return DataLoader(data, batch_size=HF_BATCH, shuffle=False, drop_last=True)

    torch.manual_seed(0)
    module = HFModule()
    balancer = ExpertBiasBalancer(update_rate=HF_RATE, check_every_n_steps=1)
    recorder = _recorder(balancer)
    trainer = _trainer(ep, HF_STEPS, [balancer, recorder])
    trainer.fit(module)
    found = trainer.strategy.discovery
    return {"records": module.records, "biases": recorder.biases, "updates": balancer.updates,
            "sites": [[s.layer, s.name, s.kind] for s in balancer.sites],
            "ep_blocks": [b.path for b in found.blocks] if found and ep > 1 else [],
            "fallback": [b.path for b in found.fallback] if found and ep > 1 else [],
            "partitioned": [s.name for s in balancer.sites if hasattr(s.tensor, "ds_id")]}


def run_diverged() -> dict[str, Any]:
    import lightning as L
    import torch

    from lightning_zeromoe.balance.balancer import BiasBalancingError, ExpertBiasBalancer

    balancer = ExpertBiasBalancer(update_rate=RATE, check_every_n_steps=2)

    class Tamper(L.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == 1 and trainer.global_rank == 1:
                with torch.no_grad():
                    balancer.sites[0].tensor.view(-1)[0] += 0.25
                    balancer._master[0].view(-1)[0] += 0.25  # as code that rewrote the bias and its copy would

    try:
        _trainer(1, STEPS, [Tamper(), balancer]).fit(tiny_module(seed=0))
    except BiasBalancingError as err:
        return {"error": str(err), "entry_id": err.entry_id, "updates": balancer.updates}
    return {"error": None, "updates": balancer.updates}


def reference(per_rank: list[list[list[int]]]) -> dict[str, Any]:
    """The plain run: one process, the same model and AdamW, each step the mean of the ranks'
    losses; after each step, each layer's bias moves by RATE * sign(mean - count), with the
    counts read from the blocks' own tokens_per_expert counters."""
    import lightning as L
    import torch

    from lightning_zeromoe.reference.models import SyntheticLMData, TinyMoELM, lm_loss_terms

    L.seed_everything(0, verbose=False)
    config = tiny_config()
    model = TinyMoELM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    data = SyntheticLMData(BATCH * 2 * STEPS, config.max_seq_len // 2 + 1, config.vocab_size, seed=0)
    records: list[list[dict[str, float]]] = [[] for _ in per_rank]
    biases = []
    for step in range(len(per_rank[0])):
        blocks = [layer.mlp for layer in model.layers]
        for block in blocks:
            block.tokens_per_expert.zero_()
        opt.zero_grad()
        losses = []
        for rank, indices in enumerate(per_rank):
            task, aux, z = (t.mean() for t in lm_loss_terms(model, data.tokens[indices[step]]))
            loss = task + AUX_WEIGHT * aux + Z_WEIGHT * z
            records[rank].append({"task_loss": float(task), "aux_loss": float(aux), "z_loss": float(z),
                                  "loss": float(loss)})
            losses.append(loss)
        torch.stack(losses).mean().backward()
        opt.step()
        with torch.no_grad():
            for block in blocks:
                counts = block.tokens_per_expert
                block.gate.e_score_correction_bias += RATE * torch.sign(counts.mean() - counts)
        biases.append({f"model.layers.{i}.mlp": b.mlp.gate.e_score_correction_bias.tolist()
                       for i, b in enumerate(model.layers)})
    return {"records": records, "biases": biases}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:  # become the launcher
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               *sys.argv[1:]]
        raise SystemExit(subprocess.call(cmd))

    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    rank = int(os.environ["RANK"])
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"rank": rank}
    for case in args.cases:
        start = time.perf_counter()
        try:
            if case.startswith("tiny"):
                result = run_tiny(case, args.out)
            elif case == "diverged":
                result = run_diverged()
            else:
                family, _, ep = case.partition(":")
                result = run_hf(family, int(ep))
        except Exception as exc:  # noqa: BLE001 - one case failing must not hide the others
            import traceback

            result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        result["seconds"] = round(time.perf_counter() - start, 2)
        results[case] = result
        if rank == 0:
            print(f"[balancing] {case}: {result['seconds']} s {result.get('error', '')[:300]}", flush=True)
    # The plain runs: over the batches tiny_ep2 trained on, and over its first SAVE_AT steps' batches
    # followed by those the resumed job trained on.
    for name, cases in (("reference", ("tiny_ep2",)), ("reference_resumed", ("tiny_ep2", "tiny_resume"))):
        if not all(c in results and "records" in results[c] for c in cases):
            continue
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, [[r["indices"] for r in results[c]["records"]] for c in cases])
        if rank == 0:
            start = time.perf_counter()
            per_rank = [got[0][:SAVE_AT] + got[1] if len(got) > 1 else got[0] for got in gathered]
            results[name] = reference(per_rank)
            results[name]["indices"] = per_rank
            print(f"[balancing] {name}: {time.perf_counter() - start:.2f} s", flush=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
