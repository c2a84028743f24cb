"""The three ZeRO-3 pitfalls under raw DeepSpeed (no ZeroMoEStrategy, no guard, no audit), 2 CPU ranks.

One launch runs every case (start-up is the expensive part); each rank writes ``rank{r}.json``:

* ``sharing``: gathers per step on the tiny model, tied lm_head and functional use, with and without
  ``register_external_parameter`` (the only piece of our handling used here: it is what's measured);
* ``stale``: a module that caches ``weight.data`` in forward;
* ``buffers``: does the engine call ``module.to(device)`` for a ``zero.Init`` model?
* ``moves``: ``.to``/``.half``/``.cuda`` on a submodule during forward.

    python tests/jobs/pitfall_raw.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path

from _pitfall_common import FUNCTIONAL_PARAM, GatherCounter, Mover, PitfallLM, Sidecar, launch_two_ranks_if_needed
from _teardown import end_job

launch_two_ranks_if_needed()

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from lightning_zeromoe.reference.models import SyntheticLMData, TinyMoEConfig, TinyMoELM  # noqa: E402
from lightning_zeromoe.engine.pitfalls import register_shared_parameters  # noqa: E402

ZERO3 = {"train_micro_batch_size_per_gpu": 4, "zero_allow_untested_optimizer": True,
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
RANK = int(os.environ.get("RANK", 0))


def engine_for(model: nn.Module) -> deepspeed.DeepSpeedEngine:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)  # no decay: no grad, no change
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ZERO3)
    return engine


def gathered(param: nn.Parameter) -> torch.Tensor:
    with deepspeed.zero.GatheredParameters([param]):
        return param.detach().clone()


class SmallNet(nn.Module):
    """[B, 16] -> Sidecar -> Mover -> Linear -> scalar: the cheapest model that shows each trap."""

    def __init__(self, cache_data: bool = False, moves=None) -> None:
        super().__init__()
        self.sidecar = Sidecar(16, cache_data)
        self.mover = Mover(16, moves, catch=False)
        self.head = nn.Linear(16, 4)
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mover(self.sidecar(x * self.scale)))


def small_batch(step: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + RANK))


def case_sharing(steps: int) -> dict:
    """Gathers per step: tied lm_head (TinyMoELM, tie_embeddings) and a functional use (PitfallLM)."""
    data = SyntheticLMData(64, 33, 128)
    counter = GatherCounter().install()
    out = {}
    for kind in ("tied", "functional"):
        for register in (False, True):
            torch.manual_seed(0)
            # Without AutoEP our MoEBlock calls each expert only if it got tokens; under raw ZeRO-3 that
            # makes the number of gathers data-dependent and ranks deadlock. top_k = num_experts
            # routes every token to every expert, so every rank runs the same modules.
            config = TinyMoEConfig(tie_embeddings=True, num_experts=2, top_k=2, num_layers=1)
            model = TinyMoELM(config) if kind == "tied" else PitfallLM(config, functional=True)
            engine = engine_for(model)
            root = engine.module
            tie_kept = root.lm_head.weight is root.embed.weight
            if register:
                if kind == "tied":  # the module that uses the tied weight already holds it
                    deepspeed.zero.register_external_parameter(root.lm_head, root.embed.weight)
                else:
                    register_shared_parameters(root, {"": [FUNCTIONAL_PARAM]})
            counter.take()
            per_step = []
            for step in range(steps):
                ids = data.tokens[8 * step + 4 * RANK: 8 * step + 4 * RANK + 4]
                logits, _ = engine(ids[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
                engine.backward(loss)
                engine.step()
                per_step.append({**counter.take(), "loss": loss.item()})
            registry = {name or "<root>": len(m._external_params) for name, m in root.named_modules()
                        if getattr(m, "_external_params", None)}
            out[f"{kind}/{'registered' if register else 'auto'}"] = {
                "steps": per_step, "external_registry": registry, "tie_kept_after_initialize": tie_kept}
    counter.remove()
    return out


def case_stale(steps: int) -> dict:
    """Sidecar caches weight.data: does it train, what does the cache hold, does anything complain?"""
    torch.manual_seed(0)
    engine = engine_for(SmallNet(cache_data=True))
    side = engine.module.sidecar
    before = gathered(side.weight)
    head_before = gathered(engine.module.head.weight)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            loss = engine(small_batch(step)).pow(2).mean()
            engine.backward(loss)
            engine.step()
    return {
        "sidecar_weight_changed": not torch.equal(before, gathered(side.weight)),
        "head_weight_changed": not torch.equal(head_before, gathered(engine.module.head.weight)),
        "cache_numel": side.cached.numel(), "full_numel": int(side.weight.ds_numel),
        "partition_numel": side.weight.ds_tensor.numel(),
        "cache_equals_initial_weight": torch.equal(side.cached, before),
        "warnings": [str(w.message) for w in caught if "stale" in str(w.message) or "gradient" in str(w.message)],
    }


def case_buffers() -> dict:
    """Count engine.module.to(...) calls during deepspeed.initialize: zero.Init model vs plain model."""
    out = {}
    for how in ("plain", "zero_init"):
        calls = []
        original = nn.Module.to

        def counting_to(self, *args, **kwargs):
            calls.append(type(self).__name__)
            return original(self, *args, **kwargs)

        torch.manual_seed(0)
        if how == "zero_init":
            with deepspeed.zero.Init(config_dict_or_path=ZERO3):
                model = SmallNet()
        else:
            model = SmallNet()
        nn.Module.to = counting_to
        try:
            engine_for(model)
        finally:
            nn.Module.to = original
        out[how] = {"root_to_calls": calls.count("SmallNet"), "buffer_device": str(model.scale.device)}
    return out


def case_moves() -> dict:
    """Each move inside forward, unguarded: what happens in 2 steps."""
    out = {}
    for method, args in (("to", ("cpu",)), ("half", ()), ("to", ("meta",)), ("cuda", ())):
        torch.manual_seed(0)
        engine = engine_for(SmallNet(moves=[(method, args)]))
        lin = engine.module.mover.lin
        before = gathered(lin.weight)
        result: dict = {}
        try:
            for step in range(2):
                loss = engine(small_batch(step)).pow(2).mean()
                engine.backward(loss)
                engine.step()
            result["completed"] = True
        except Exception as err:  # noqa: BLE001 - this is what the test looks at
            result.update(completed=False, error=f"{type(err).__name__}: {str(err)[:400]}")
        weight = engine.module.mover.lin.weight
        result["param_data"] = f"{weight.data.dtype}/{weight.data.device}"
        # False when the move replaced the Parameter object: the module now holds a tensor ZeRO-3 never saw.
        result["still_zero_param"] = hasattr(weight, "ds_tensor")
        if result["still_zero_param"]:
            result["partition"] = f"{weight.ds_tensor.dtype}/{weight.ds_tensor.device}"
        if result["completed"] and result["still_zero_param"]:
            result["weight_trained"] = not torch.equal(before, gathered(weight))
        out[f"{method}{args}"] = result
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    deepspeed.init_distributed("gloo")
    result: dict = {"rank": RANK}
    for name, run in (("sharing", lambda: case_sharing(args.steps)), ("stale", lambda: case_stale(args.steps)),
                      ("buffers", case_buffers), ("moves", case_moves)):
        start = time.perf_counter()
        result[name] = run()
        result[f"{name}_seconds"] = round(time.perf_counter() - start, 2)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{RANK}.json").write_text(json.dumps(result, indent=1, default=str))
    # Raw DeepSpeed leaves its gloo group to the interpreter's exit, which can abort a rank after its work is
    # written ("terminate called without an active exception": both ranks did so once in CI, exit 250).
    end_job()


if __name__ == "__main__":
    main()
