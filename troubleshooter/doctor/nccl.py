"""NCCL: is it there, which version, and the environment switches that slow MoE down.

Why: expert parallelism moves every token twice per MoE layer with all-to-all. NCCL picks the
fastest transport it may use (NVLink/PCIe peer-to-peer, shared memory, InfiniBand); the
``*_DISABLE`` switches, often copied from a forum answer to get past a hang, force slower ones
for every collective, and all-to-all suffers most.
"""

from __future__ import annotations

from collections.abc import Mapping

from troubleshooter import knowledge
from troubleshooter.doctor.base import CheckResult, DoctorOptions, cite, error_result
from troubleshooter.doctor.probes import ProbeSet

#: Switches that force NCCL onto a slower transport, with what they remove.
SLOWING_SWITCHES = {
    "NCCL_P2P_DISABLE": "GPU peer-to-peer (NVLink / PCIe) inside a node",
    "NCCL_IB_DISABLE": "InfiniBand / RoCE between nodes (falls back to TCP sockets)",
    "NCCL_SHM_DISABLE": "shared-memory transport inside a node",
}
DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")


def check(options: DoctorOptions, probes: ProbeSet) -> list[CheckResult]:
    """Availability/version, slowing switches, NCCL_DEBUG."""
    return [available_result(options, probes), switches_result(options.env),
            debug_result(options.env)]


def available_result(options: DoctorOptions, probes: ProbeSet) -> CheckResult:
    """NCCL as torch sees it (from the torch probe)."""
    title = "NCCL"
    stage, outcome = probes.stage("nccl")
    if stage is None or "exception" in stage:
        reason = stage["exception"] if stage else outcome.describe_failure(options.timeout)
        return error_result("nccl.available", title, f"torch probe: {reason}", timeout=options.timeout,
                            why=knowledge.message("doctor-run", "probe-died").render(what="NCCL version"),
                            details={"stderr_tail": outcome.stderr[-2000:]})
    cpu_build = stage.get("torch_cuda") is None
    if stage["nccl_available"]:
        return CheckResult("nccl.available", title, "ok",
                           f"NCCL {stage.get('version') or '(version unknown)'} available to torch",
                           details=stage)
    if cpu_build or not stage.get("distributed"):
        return CheckResult("nccl.available", title, "skip",
                           "not available: this torch has no NCCL (CPU build)",
                           why=knowledge.message("nccl-unavailable", "cpu-gloo").render(),
                           details=stage)
    return CheckResult("nccl.available", title, "fail", "torch was built without NCCL support",
                       why=knowledge.message("nccl-unavailable", "needed").render(), entry="nccl-unavailable",
                       **cite(knowledge.fix("nccl-unavailable", "cuda-torch")), details=stage)


def _enabled(value: str) -> bool:
    """NCCL reads these switches as integers; anything but 0 / empty counts as set."""
    return value.strip() not in ("", "0")


def switches_result(env: Mapping[str, str]) -> CheckResult:
    """Warn about NCCL_*_DISABLE switches that are on."""
    title = "NCCL transport switches"
    on = {k: env[k] for k in SLOWING_SWITCHES if k in env and _enabled(env[k])}
    details = {"set": {k: env[k] for k in SLOWING_SWITCHES if k in env}}
    if not on:
        return CheckResult("nccl.switches", title, "ok",
                           "no NCCL_P2P_DISABLE / NCCL_IB_DISABLE / NCCL_SHM_DISABLE in effect",
                           details=details)
    found = "; ".join(f"{k}={v} turns off {SLOWING_SWITCHES[k]}" for k, v in on.items())
    return CheckResult(
        "nccl.switches", title, "warn", found,
        why=knowledge.message("nccl-p2p-ib-disabled", "slow-path").render(), entry="nccl-p2p-ib-disabled",
        **cite(knowledge.fix("nccl-p2p-ib-disabled", "unset-named-switches"), names=" ".join(on)),
        details=details)


def debug_result(env: Mapping[str, str]) -> CheckResult:
    """NCCL_DEBUG: advice for the level that is set."""
    title = "NCCL_DEBUG"
    value = env.get("NCCL_DEBUG")
    advice = knowledge.message("nccl-debug-level", "advice").render()
    if value is None:
        return CheckResult("nccl.debug", title, "ok", "not set: NCCL stays silent, even on errors",
                           why=advice)
    level = value.strip().upper()
    if level not in DEBUG_LEVELS:
        return CheckResult("nccl.debug", title, "warn", f"NCCL_DEBUG={value}: not a level NCCL knows",
                           why=knowledge.message("nccl-debug-level", "unknown-level").render(
                               levels=", ".join(DEBUG_LEVELS)), entry="nccl-debug-level",
                           **cite(knowledge.fix("nccl-debug-level", "warn-or-info")))
    if level == "TRACE":
        return CheckResult("nccl.debug", title, "warn", "NCCL_DEBUG=TRACE",
                           why=knowledge.message("nccl-debug-level", "trace").render(),
                           entry="nccl-debug-level", **cite(knowledge.fix("nccl-debug-level", "warn-or-info")))
    return CheckResult("nccl.debug", title, "ok", f"NCCL_DEBUG={value}", why=advice)
