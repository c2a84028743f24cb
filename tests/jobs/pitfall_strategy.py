"""The three ZeRO-3 pitfalls under ZeroMoEStrategy (ZeRO-3 + AutoEP=2), 2 CPU ranks, one launch.

Fit 1 ("train", 2 steps, gradient audit over K=2 steps): PitfallLM with a tied lm_head, a functional use of
``layers.0.attn.out.weight`` (not declared), a Sidecar that caches ``weight.data``, and a Mover that
calls ``.to('cpu')``, ``.float()``, ``.half()``, ``.to('meta')`` and ``.cuda()`` on its child during
forward (errors are caught by the Mover and recorded). Saves a checkpoint.
Fit 2 ("resume", 1 step): the same architecture without the traps, ``shared_parameters`` declared,
resumed from fit 1's checkpoint.

    python tests/jobs/pitfall_strategy.py --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning)

from _pitfall_common import FUNCTIONAL_PARAM, GatherCounter, PitfallLM  # noqa: E402

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_zeromoe import ZeroMoEStrategy  # noqa: E402
from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoEModule  # noqa: E402

MOVES = [("to", ("cpu",)), ("float", ()), ("half", ()), ("to", ("meta",)), ("cuda", ())]


def build(cache_data: bool, moves: list) -> L.LightningModule:
    config = TinyMoEConfig(tie_embeddings=True)
    module = TinyMoEModule(config, batch_size=4, num_samples=4 * 2 * 8)
    torch.manual_seed(0)
    module.model = PitfallLM(config, functional=True, cache_data=cache_data, moves=moves)
    return module


def gathered_stats(param: torch.nn.Parameter) -> list[float]:
    import deepspeed

    with deepspeed.zero.GatheredParameters([param]):
        t = param.detach().double()
        return [float(t.sum()), float(t.pow(2).sum())]


class Probe(L.Callback):
    """Per step: gather counts. At the first batch: the tie and the weights as the engine holds them."""

    def __init__(self, counter: GatherCounter) -> None:
        self.counter = counter
        self.record: dict = {"steps": []}

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if "tie_is_one_object" not in self.record:
            lm = trainer.strategy.model.module.model
            self.record["tie_is_one_object"] = lm.lm_head.weight is lm.embed.weight
            self.record["embed_at_start"] = gathered_stats(lm.embed.weight)
            self.record["lm_head_at_start"] = gathered_stats(lm.lm_head.weight)
            self.record["sidecar_at_start"] = gathered_stats(lm.sidecar.weight)
        self.counter.take()  # after the probe's own gathers: count only the training step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.record["steps"].append(self.counter.take())

    def on_train_end(self, trainer, module) -> None:
        lm = trainer.strategy.model.module.model
        self.record["embed_at_end"] = gathered_stats(lm.embed.weight)
        self.record["sidecar_at_end"] = gathered_stats(lm.sidecar.weight)
        # Outside forward (a callback), with the guard still on: same device passes, a cast is refused.
        outside = {}
        for method, args in (("to", ("cpu",)), ("half", ())):
            try:
                getattr(lm.mover.lin, method)(*args)
                outside[method] = "ok"
            except Exception as err:  # noqa: BLE001 - recorded for the test
                outside[method] = f"{type(err).__name__}: {err}"
        self.record["outside_forward"] = outside
        lin = lm.mover.lin.weight
        self.record["mover_weight"] = {"still_zero_param": hasattr(lin, "ds_tensor"), "dtype": str(lin.dtype),
                                       "device": str(lin.device)}


def fit(module: L.LightningModule, steps: int, resume: Path | None = None, **strategy_kwargs) -> tuple[dict, L.Trainer]:
    counter = GatherCounter().install()
    probe = Probe(counter)
    strategy = ZeroMoEStrategy(ep_size=2, param_persistence_threshold=0, **strategy_kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_progress_bar=False, strategy=strategy,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[probe])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, ckpt_path=resume)
    counter.remove()
    state = strategy.pitfalls.state
    audit = state.audit
    record = {
        **probe.record,
        "warnings": [str(w.message) for w in caught if "ZeroMoEStrategy" in str(w.message)],
        "tied": [list(t.paths) for t in state.tied],
        "external": [dataclasses.asdict(u) for u in state.external or []],
        "declared": state.declared,
        "audit_done": audit is not None and audit.report is not None,
        "audit_hooks_left": bool(audit and audit.active),
        "stale": [s.name for s in (audit.report.stale if audit and audit.report else [])],
        "aliases": [dataclasses.asdict(a) for a in (audit.report.aliases if audit and audit.report else [])],
        "mover_errors": module.model.mover.errors,
        "buffers_moved": state.buffers_moved,
    }
    return record, trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    ckpt = args.out / "ckpt"
    result: dict = {}

    result["train"], trainer = fit(build(cache_data=True, moves=MOVES), steps=2, grad_audit_steps=2)
    trainer.save_checkpoint(ckpt)
    trainer.strategy.barrier()
    rank = trainer.global_rank
    if rank == 0:
        states = torch.load(ckpt / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        result["train"]["checkpoint_shared_params"] = states.get("shared_params")

    result["resume"], trainer = fit(build(cache_data=False, moves=[]), steps=3, resume=ckpt,
                                    shared_parameters={"model": [f"model.{FUNCTIONAL_PARAM}"]})
    result["rank"] = rank
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
