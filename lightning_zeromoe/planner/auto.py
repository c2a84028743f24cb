"""``ep_size="auto"`` (and with ``stage="auto"``): the expert-parallel size chosen by predicted step time.

Candidates are the divisors of the world size that divide every MoE layer's expert count, inside one
node unless allowed otherwise (every expert group of ``ep_size`` consecutive ranks on one node: so
``ep_size`` divides the node's device count, e.g. not 5 on 8-GPU nodes although 160 experts allow it);
each is planned (:func:`lightning_zeromoe.planner.plan.plan`) and the
fastest setup that fits wins. Pure module: no torch import.
"""

from __future__ import annotations

from typing import Any

from lightning_zeromoe.planner.links import spans_nodes
from lightning_zeromoe.planner.plan import _gb, choose_stage, plan
from lightning_zeromoe.planner.setups import LADDER
from lightning_zeromoe.planner.step_time import format_seconds


def _inside_nodes(ep_size: int, world_size: int, devices_per_node: int) -> bool:
    """Whether every expert-parallel group (``ep_size`` consecutive ranks, as DeepSpeed builds them)
    sits on one node: ``ep_size <= devices_per_node`` is not enough (ranks 5-9 of 8-GPU nodes)."""
    return not spans_nodes("expert_parallel", world_size, ep_size, devices_per_node)


def choose_setup(model: Any, world_size: int, devices_per_node: int, ep_sizes: list[int], device_memory_bytes: float,
                 precision: str = "bf16", allow_inter_node_ep: bool = False,
                 **plan_kwargs: Any) -> tuple[int, int, str]:
    """``ep_size="auto"`` with ``stage="auto"``: (stage, ep_size, why) of the fastest on-device setup
    that fits over the candidate ``ep_sizes`` (those above ``devices_per_node`` only with
    ``allow_inter_node_ep``); ties: the lower stage, then the smaller ep_size. Falls back to
    :func:`choose_stage`'s answer at the largest candidate when nothing fits on the device."""
    candidates = [e for e in ep_sizes if allow_inter_node_ep or _inside_nodes(e, world_size, devices_per_node)] \
        or [min(ep_sizes)]
    found = []
    for ep in candidates:
        p = plan(model, num_gpus=world_size, gpus_per_node=devices_per_node, ep_size=ep,
                 gpu_memory_bytes=device_memory_bytes, precision=precision, **plan_kwargs)
        rec = p.recommend(on_device_only=True)
        if rec.setup is not None:
            found.append((p.step_times[rec.setup].total, rec.setup, ep, p, rec))
    if not found:
        stage, why = choose_stage(model, world_size, devices_per_node, max(candidates), device_memory_bytes,
                                  precision, **plan_kwargs)
        return stage, max(candidates), f"ep_size={max(candidates)}: nothing fits on the device at any ep_size. {why}"
    best = min(found, key=lambda f: (f[0], f[1], f[2]))
    _, setup, ep, p, rec = best
    others = sorted((f for f in found if f is not best), key=lambda f: (f[0], f[1], f[2]))
    why = f"ep_size={ep}, stage={setup.stage} chosen by the planner from ep_size in {candidates}. {rec.reason}"
    if others:
        t, s2, ep2, p2, _ = others[0]
        why += (f" Best at another ep_size: ep_size={ep2} {s2.label}, {_gb(p2.device_bytes(s2))} GB, "
                f"{format_seconds(t)}.")
    return setup.stage, ep, why


def choose_ep_size(model: Any, num_experts: list[int], world_size: int, devices_per_node: int,
                   device_memory_bytes: float, precision: str = "bf16", stage: int | None = None,
                   allow_inter_node_ep: bool = False, **plan_kwargs: Any) -> tuple[int, str]:
    """For ``ZeroMoEStrategy(ep_size="auto")``: the ep_size, and why. Candidates: the divisors of the
    world size that divide every MoE layer's expert count, whose groups stay inside one node (unless
    ``allow_inter_node_ep``). With ``stage=None`` (``stage="auto"`` too) the fastest on-device setup
    over all candidates (:func:`choose_setup`); with a stage, the candidate where that stage fits and
    is predicted fastest (ties: the smaller ep_size), else the one that needs the least memory."""
    candidates = [e for e in range(1, world_size + 1)
                  if world_size % e == 0 and all(n % e == 0 for n in num_experts)] if num_experts else [1]
    if stage is None:
        _, ep, why = choose_setup(model, world_size, devices_per_node, candidates, device_memory_bytes, precision,
                                  allow_inter_node_ep, **plan_kwargs)
        return ep, why
    usable = [e for e in candidates if allow_inter_node_ep or _inside_nodes(e, world_size, devices_per_node)] or [1]
    setup = next((s for s in LADDER if s.stage == stage and not s.offload_optimizer), LADDER[0])
    rows = []
    for ep in usable:
        p = plan(model, num_gpus=world_size, gpus_per_node=devices_per_node, ep_size=ep,
                 gpu_memory_bytes=device_memory_bytes, precision=precision, **plan_kwargs)
        fits = p.fits(setup)
        rows.append((not fits, p.step_times[setup].total if fits else p.device_bytes(setup), ep, p, setup))
    too_big, value, ep, p, chosen = min(rows, key=lambda r: (r[0], r[1], r[2]))
    if too_big:
        return ep, (f"ep_size={ep} chosen by the planner from {usable}: {chosen.label} fits at no ep_size; this one "
                    f"needs the least memory ({_gb(value)} GB per GPU).")
    others = sorted((r for r in rows if r[2] != ep and not r[0]), key=lambda r: (r[1], r[2]))
    why = (f"ep_size={ep} chosen by the planner from {usable}: {chosen.label}, {_gb(p.device_bytes(chosen))} GB "
           f"per GPU, predicted step {p.step_time_text(chosen)}")
    if others:
        why += f"; runner-up ep_size={others[0][2]}: {format_seconds(others[0][1])}"
    return ep, why + "."


__all__ = ["choose_ep_size", "choose_setup"]
