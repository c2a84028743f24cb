"""NCCL: is it there, which version, and the environment switches that slow MoE down.

Why: expert parallelism moves every token twice per MoE layer with all-to-all. NCCL picks the
fastest transport it may use (NVLink/PCIe peer-to-peer, shared memory, InfiniBand); the
``*_DISABLE`` switches, often copied from a forum answer to get past a hang, force slower ones
for every collective, and all-to-all suffers most.
"""

from __future__ import annotations

from collections.abc import Mapping

from troubleshooter.doctor.base import CheckResult, DoctorOptions, error_result
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
        return error_result("nccl.available", title, f"torch probe: {reason}",
                            details={"stderr_tail": outcome.stderr[-2000:]})
    cpu_build = stage.get("torch_cuda") is None
    if stage["nccl_available"]:
        return CheckResult("nccl.available", title, "ok",
                           f"NCCL {stage.get('version') or '(version unknown)'} available to torch",
                           details=stage)
    if cpu_build or not stage.get("distributed"):
        return CheckResult("nccl.available", title, "skip",
                           "not available: this torch has no NCCL (CPU build)",
                           why="CPU training uses the gloo backend, which needs no NCCL.",
                           details=stage)
    return CheckResult("nccl.available", title, "fail", "torch was built without NCCL support",
                       why="multi-GPU training with DeepSpeed uses the nccl backend.",
                       fix="Install a CUDA build of torch from pytorch.org (it bundles NCCL).",
                       details=stage)


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
        why="expert parallelism does two all-to-alls per MoE layer; with faster transports off, "
            "every one of them (and ZeRO-3's all-gathers) takes the slow path.",
        fix="Unset them; if they were set to get past a hang, find the cause with NCCL_DEBUG=INFO "
            "(often ACS/IOMMU settings for P2P, or a wrong NCCL_SOCKET_IFNAME / IB port).",
        entry="nccl-p2p-ib-disabled", details=details)


def debug_result(env: Mapping[str, str]) -> CheckResult:
    """NCCL_DEBUG: advice for the level that is set."""
    title = "NCCL_DEBUG"
    value = env.get("NCCL_DEBUG")
    advice = ("NCCL_DEBUG=WARN prints only NCCL's errors and is cheap; use NCCL_DEBUG=INFO "
              "(with NCCL_DEBUG_SUBSYS=INIT,NET) to see the transports chosen when diagnosing a "
              "hang or slow all-to-all, and NCCL_DEBUG_FILE=/tmp/nccl.%h.%p to keep ranks apart.")
    if value is None:
        return CheckResult("nccl.debug", title, "ok", "not set: NCCL stays silent, even on errors",
                           why=advice)
    level = value.strip().upper()
    if level not in DEBUG_LEVELS:
        return CheckResult("nccl.debug", title, "warn", f"NCCL_DEBUG={value}: not a level NCCL knows",
                           why=f"NCCL accepts {', '.join(DEBUG_LEVELS)}.", fix=advice)
    if level == "TRACE":
        return CheckResult("nccl.debug", title, "warn", "NCCL_DEBUG=TRACE",
                           why="TRACE logs every call; it slows collectives and floods the logs.",
                           fix="Use WARN for training runs and INFO for diagnosis. " + advice)
    return CheckResult("nccl.debug", title, "ok", f"NCCL_DEBUG={value}", why=advice)
