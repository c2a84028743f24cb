"""The three ZeRO-3 pitfalls on 2 CPU ranks: plain DeepSpeed first, then ``lightning_zeromoe.engine.pitfalls``.

Started twice by :func:`troubleshooter.repro.pitfalls.run_all` (RANK 0 and 1, env rendezvous,
gloo, DeepSpeed's CPU accelerator). Every case is run on both ranks, because ZeRO-3 needs both
for every gather; rank 0 prints one JSON line per case. The "handled" half calls the same
functions ``ZeroMoEStrategy`` calls around ``deepspeed.initialize`` (``find_tied_parameters``,
``broken_ties``, ``DeviceMoveGuard``, ``GradAudit``), on a plain DeepSpeed engine, so a case
costs seconds instead of a Lightning start-up.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback

RANK = int(os.environ["RANK"])
faulthandler.dump_traceback_later(float(os.environ.get("REPRO_RANK_TIMEOUT", "300")), exit=True)

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from lightning_zeromoe.engine import collectives  # noqa: E402
from lightning_zeromoe.reference.models import SyntheticLMData, TinyMoEConfig, TinyMoELM  # noqa: E402

CONFIG = {"train_micro_batch_size_per_gpu": 4, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
STEPS = 3


def emit(case: str, **data) -> None:
    if RANK == 0:
        print(json.dumps({"case": case, **data}, default=str), flush=True)


def engine_for(model: nn.Module):
    # No weight decay: a parameter that gets no gradient must then not move at all.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=CONFIG)
    return engine


def full(param: nn.Parameter) -> torch.Tensor:
    """The whole parameter, gathered from both ranks (the documented way to read one)."""
    with deepspeed.zero.GatheredParameters([param]):
        return param.detach().clone()


def error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err).strip() else ''}"


# ------------------------------------------------------------------------------ tied weights


def tied_case() -> None:
    from lightning_zeromoe.reference.models import MoEBlock

    data = SyntheticLMData(64, 17, 128, seed=0)
    torch.manual_seed(0)
    model = TinyMoELM(TinyMoEConfig(tie_embeddings=True))
    # Plain ZeRO-3 on a token-choice MoE: an expert that gets no tokens on one rank is not called
    # there, so the ranks would gather different parameters and wait on each other forever (we hit
    # exactly that). Gathering each MoE block as a whole avoids it (entry zero3-inflight-params);
    # ZeroMoEStrategy uses AutoEP instead.
    deepspeed.utils.set_z3_leaf_modules(model, [MoEBlock])
    engine = engine_for(model)
    root = engine.module
    losses = []
    for step in range(STEPS):
        ids = data.tokens[8 * step + 4 * RANK: 8 * step + 4 * RANK + 4]
        logits, _ = engine(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    ids = data.tokens[:2, :8]
    # Plain DeepSpeed: outside the engine's forward, the tied weight is a partitioned placeholder.
    shape_outside = list(root.embed.weight.shape)
    try:
        F.embedding(ids, root.embed.weight)
        outside = "no error"
    except Exception as err:  # noqa: BLE001 - the failure is the result
        outside = error_text(err)
    # Handled: what the strategy checks, and the documented way to use the weight outside forward.
    from lightning_zeromoe.engine.pitfalls import broken_ties, describe_sharing, find_tied_parameters

    tied = find_tied_parameters(root)
    with deepspeed.zero.GatheredParameters([root.embed.weight]):
        shape_gathered = list(root.embed.weight.shape)
        inside = list(F.embedding(ids, root.embed.weight).shape)
    emit("tied_weights", losses=losses, shape_outside=shape_outside, outside_forward=outside,
         tie_kept=root.lm_head.weight is root.embed.weight, tied=[list(t.paths) for t in tied],
         broken=broken_ties(root, tied), messages=describe_sharing(tied), shape_gathered=shape_gathered,
         embedding_inside_gather=inside)


# ------------------------------------------------------------------------------ stale copies


class CachingLinear(nn.Module):
    """Caches ``weight.data`` the first time it runs and multiplies by the cache from then on."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(size, size) * 0.1)
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            self.cache = self.weight.data  # the pitfall: a plain tensor, outside autograd and ZeRO
        return F.linear(x, self.cache)


class StaleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.cached = CachingLinear(16)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.cached(torch.tanh(self.inp(x)))))


def batch(step: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + RANK))


def train(engine, audit=None) -> list[float]:
    losses = []
    for step in range(STEPS):
        loss = engine(batch(step)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if audit is not None:
            audit.step()
    return losses


def stale_case() -> None:
    from lightning_zeromoe.engine.pitfalls import GradAudit

    torch.manual_seed(0)
    engine = engine_for(StaleNet())
    root = engine.module
    w0, inp0 = full(root.cached.weight), full(root.inp.weight)
    plain_losses = train(engine)
    plain = {"losses": plain_losses, "cached_weight_change": float((full(root.cached.weight) - w0).abs().max()),
             "other_weight_change": float((full(root.inp.weight) - inp0).abs().max()),
             "cache_numel": root.cached.cache.numel(), "partition_numel": root.cached.weight.ds_tensor.numel(),
             "full_numel": int(root.cached.weight.ds_numel)}
    torch.manual_seed(0)
    engine = engine_for(StaleNet())
    audit = GradAudit(engine.module, steps=STEPS).install()
    train(engine, audit)
    report = audit.report
    emit("stale_param_copy", plain=plain, stale=[s.name for s in report.stale],
         aliases=[a.attribute for a in report.aliases], messages=report.messages(), hooks_left=audit.active)


# ------------------------------------------------------------------------------ device moves


class CastingNet(nn.Module):
    """Casts a submodule in forward, as code written for one device sometimes does."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.proj = nn.Linear(16, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.proj.double()  # the pitfall: a dtype move of ZeRO-3 parameters inside forward
        h = torch.tanh(self.inp(x))
        return self.out(self.proj(h.to(self.proj.weight.dtype)).float())


def device_case() -> None:
    from lightning_zeromoe.engine.pitfalls import DeviceMoveGuard

    torch.manual_seed(0)
    engine = engine_for(CastingNet())
    root = engine.module
    w0 = full(root.proj.weight)
    plain: dict = {}
    try:
        plain["losses"] = train(engine)
        plain["outcome"] = "completed without an error"
        plain["proj_weight_change"] = float((full(root.proj.weight).double() - w0.double()).abs().max())
    except Exception as err:  # noqa: BLE001 - the failure is the result
        plain["outcome"] = error_text(err)
        plain["traceback"] = traceback.format_exc()[-1500:]
    plain["param_data"] = f"{root.proj.weight.data.dtype}"
    plain["partition"] = f"{root.proj.weight.ds_tensor.dtype}"
    torch.manual_seed(0)
    engine = engine_for(CastingNet())
    guard = DeviceMoveGuard(engine.module, torch.device("cpu")).install()
    handled: dict = {}
    try:
        handled["losses"] = train(engine)
        handled["outcome"] = "completed without an error"
    except Exception as err:  # noqa: BLE001
        handled["outcome"] = error_text(err)
        handled["message"] = str(err)
    finally:
        guard.remove()
    emit("device_move", plain=plain, handled=handled)


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    cases = {"tied_weights": tied_case, "stale_param_copy": stale_case, "device_move": device_case}
    for name in json.loads(sys.argv[1])["cases"]:
        try:
            cases[name]()
        except Exception as err:  # noqa: BLE001 - report and go on with the next case
            emit(name, crashed=error_text(err), traceback=traceback.format_exc()[-3000:])
        collectives.barrier()


if __name__ == "__main__":
    main()
