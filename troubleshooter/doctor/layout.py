"""Parallel layout: ep_size against the experts, the world and the node.

Why, from the deepspeed 0.19.8 source: AutoEP raises ValueError when ``autoep_size`` exceeds or
does not divide a layer's expert count (module_inject/auto_ep_config.py); the expert groups need
``world_size % ep_size == 0`` (utils/groups.py ``_ensure_divisibility``); and each expert-parallel
group is ``ep_size`` consecutive ranks (utils/groups.py), so it stays inside a node only when
``ep_size`` divides the GPUs per node. Across nodes, the two all-to-alls per MoE layer run over
the network instead of NVLink.
"""

from __future__ import annotations

from troubleshooter import knowledge
from troubleshooter.doctor.base import CheckResult, DoctorOptions, cite
from troubleshooter.doctor.probes import ProbeSet


def check(options: DoctorOptions, probes: ProbeSet) -> list[CheckResult]:
    """Experts, world and node checks for the given ep_size."""
    ep = options.ep_size
    if ep is None:
        given = [n for n in ("num_experts", "world_size", "gpus_per_node") if getattr(options, n)]
        why = f"{', '.join('--' + g.replace('_', '-') for g in given)} given without --ep-size" \
            if given else "no --ep-size given"
        return [CheckResult("layout.ep_size", "Expert-parallel layout", "skip", why, entry="ep-layout",
                            **cite(knowledge.fix("doctor-run", "pass-layout")))]
    return [experts_result(ep, options.num_experts), world_result(ep, options.world_size),
            node_result(ep, options.gpus_per_node)]


def divisors(n: int) -> list[int]:
    """All divisors of ``n``: the ep_size values that would work."""
    return [d for d in range(1, n + 1) if n % d == 0]


def experts_result(ep: int, experts: int | None) -> CheckResult:
    """ep_size must divide the number of experts (each rank owns experts / ep_size)."""
    title = "ep_size vs experts"
    if experts is None:
        return CheckResult("layout.experts", title, "skip", "no --num-experts given")
    details = {"ep_size": ep, "num_experts": experts, "valid_ep_sizes": divisors(experts)}
    if experts % ep == 0:
        return CheckResult("layout.experts", title, "ok",
                           f"{experts} experts / ep_size {ep} = {experts // ep} local experts per rank",
                           details=details)
    problem = "exceeds" if ep > experts else "does not divide"
    return CheckResult(
        "layout.experts", title, "fail", f"ep_size {ep} {problem} {experts} experts",
        why=knowledge.message("ep-layout", "experts").render(), entry="ep-layout",
        **cite(knowledge.fix("ep-layout", "divisor-of-experts"), valid=divisors(experts), experts=experts),
        details=details)


def world_result(ep: int, world: int | None) -> CheckResult:
    """ep_size must divide the world size (the expert groups tile the ranks)."""
    title = "ep_size vs world size"
    if world is None:
        return CheckResult("layout.world", title, "skip", "no --world-size given")
    details = {"ep_size": ep, "world_size": world}
    if world % ep == 0:
        return CheckResult("layout.world", title, "ok",
                           f"{world // ep} expert group(s) of {ep} ranks; each expert is "
                           f"replicated {world // ep} time(s) (expert data parallelism)",
                           details=details)
    return CheckResult(
        "layout.world", title, "fail", f"world size {world} is not a multiple of ep_size {ep}",
        why=knowledge.message("ep-layout", "world").render(), entry="ep-layout",
        **cite(knowledge.fix("ep-layout", "divisor-of-world"), valid=divisors(world), ep=ep),
        details=details)


def node_result(ep: int, gpus: int | None) -> CheckResult:
    """Keep each expert group inside one node."""
    title = "ep_size vs GPUs per node"
    if gpus is None:
        return CheckResult("layout.node", title, "skip", "no --gpus-per-node given")
    details = {"ep_size": ep, "gpus_per_node": gpus}
    if ep <= gpus and gpus % ep == 0:
        return CheckResult("layout.node", title, "ok",
                           f"each expert group of {ep} fits inside a node of {gpus} GPUs",
                           details=details)
    found = (f"ep_size {ep} > {gpus} GPUs per node" if ep > gpus else
             f"ep_size {ep} does not divide {gpus} GPUs per node, so some groups straddle two nodes")
    return CheckResult(
        "layout.node", title, "warn", found + ": the all-to-all crosses nodes",
        why=knowledge.message("ep-layout", "cross-node").render(), entry="ep-layout",
        **cite(knowledge.fix("ep-layout", "group-in-node"), gpus=gpus,
               suggested=max(d for d in divisors(gpus) if d <= min(ep, gpus))), details=details)
