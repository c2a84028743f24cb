"""Real failures on the tiny MoE, reproduced on demand: ``troubleshooter.repro``.

Each function provokes the failure for real (no simulated errors), applies the fix, runs again,
and returns a result object with the measured numbers (and a matplotlib figure where a picture
says more). Every reproduction is seeded, and sized to finish in well under a minute on 2 CPU
cores. Importing this package loads nothing heavy: torch, DeepSpeed and ``lightning_zeromoe`` are
imported inside the functions, or in the child processes that run them.

* :func:`oom` - a training step fails under an OS-enforced memory limit, then the fix ladder
  (measure; micro-batch down with accumulation up; activation checkpointing; ZeRO stage up;
  offload) is walked until it fits.
* :func:`router_collapse` - extreme router init without aux loss collapses routing; the same run
  with each remedy (aux loss, aux-loss-free bias balancing, router z-loss, the router init).
* :func:`native_moe_zero3` - ``deepspeed.moe.layer.MoE`` under ZeRO-3: DeepSpeed's own refusal,
  then the fix really training.
* :func:`tied_weights`, :func:`stale_param_copy`, :func:`device_move` - ZeRO-3 pitfalls on 2 CPU
  ranks: what plain DeepSpeed shows, then what ``lightning_zeromoe.engine.pitfalls`` reports or stops.
* :func:`collective_timeout` - a rank waits on a DeepSpeed-style expert group far past the world
  timeout; with ``ZeroMoEStrategy``'s fix it times out when it should.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "oom": "troubleshooter.repro.memory",
    "OOMResult": "troubleshooter.repro.memory",
    "Rung": "troubleshooter.repro.memory",
    "OOM_LADDER": "troubleshooter.repro.memory",
    "router_collapse": "troubleshooter.repro.router",
    "RouterCollapseResult": "troubleshooter.repro.router",
    "native_moe_zero3": "troubleshooter.repro.zero3",
    "NativeMoEResult": "troubleshooter.repro.zero3",
    "tied_weights": "troubleshooter.repro.pitfalls",
    "stale_param_copy": "troubleshooter.repro.pitfalls",
    "device_move": "troubleshooter.repro.pitfalls",
    "PitfallResult": "troubleshooter.repro.pitfalls",
    "collective_timeout": "troubleshooter.repro.timeout",
    "TimeoutResult": "troubleshooter.repro.timeout",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'troubleshooter.repro' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
