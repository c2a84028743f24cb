"""The pitfall checks over one engine's life: what the strategy calls, hook by hook, and what they found.

``ZeroMoEStrategy`` holds one :class:`ZeroPitfalls` and calls it at four points; everything the
checks learn lives in its typed :class:`PitfallState`:

1. :meth:`ZeroPitfalls.before_engine` (before ``deepspeed.initialize``): move buffers to the root
   device, find tied parameters.
2. :meth:`ZeroPitfalls.after_engine` (ZeRO-3 only): check the ties survived, register declared
   shared parameters, install the :class:`DeviceMoveGuard` and the :class:`GradAudit`.
3. :meth:`ZeroPitfalls.after_step` (after every ``optimizer_step`` call Lightning makes): log the
   shared parameters DeepSpeed found in the first forward, and count *optimizer* steps for the
   audit. Lightning calls the strategy's ``optimizer_step`` once per micro-batch under DeepSpeed
   (DeepSpeed accumulates itself), so a step is counted only when the engine's ``global_steps``
   advanced, i.e. at a gradient-accumulation boundary.
4. :meth:`ZeroPitfalls.teardown`: lift the guard (Lightning's teardown moves the module to the CPU)
   and drop the audit hooks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from lightning_zeromoe.engine.pitfalls.device_guard import DeviceMoveGuard, move_buffers_to_device
from lightning_zeromoe.engine.pitfalls.grad_audit import GradAudit
from lightning_zeromoe.engine.pitfalls.sharing import (ExternalUse, TiedParameter, broken_ties, describe_sharing,
                                                find_external_uses, find_tied_parameters, register_shared_parameters)


@dataclass(frozen=True)
class PitfallOptions:
    """The strategy's pitfall options (see ``ZeroMoEStrategy``'s docstring)."""

    register_tied_parameters: bool = True
    shared_parameters: dict[str, list[str]] = field(default_factory=dict)
    guard_device_moves: bool = True
    grad_audit_steps: int = 3

    def __post_init__(self) -> None:
        if self.grad_audit_steps < 0:
            raise ValueError(f"grad_audit_steps={self.grad_audit_steps} must be >= 0 (0 turns the gradient audit off).")


@dataclass
class PitfallState:
    """What the checks found and installed for the current engine."""

    buffers_moved: list[str] = field(default_factory=list)
    tied: list[TiedParameter] = field(default_factory=list)
    declared: list[tuple[str, str]] = field(default_factory=list)
    external: list[ExternalUse] | None = None  # filled after the first step
    guard: DeviceMoveGuard | None = None
    audit: GradAudit | None = None
    #: ``optimizer_step`` calls seen (micro-batches) and optimizer steps counted, since the engine exists.
    calls: int = 0
    optimizer_steps: int = 0
    engine_ready: bool = False
    _last_global_steps: int = 0


class ZeroPitfalls:
    """Runs the ZeRO-3 pitfall checks for one strategy; the strategy only calls its four methods.

    ``info`` and ``warn`` are the strategy's rank-zero loggers.
    """

    def __init__(self, options: PitfallOptions, info: Callable[[str], None], warn: Callable[[str], None]) -> None:
        self.options = options
        self.state = PitfallState()
        self._info, self._warn = info, warn

    @property
    def audit(self) -> GradAudit | None:
        return self.state.audit

    def before_engine(self, model: nn.Module, device: torch.device) -> None:
        """Move buffers to ``device`` (``zero.Init`` leaves them where they were created); find ties.

        Buffers are not partitioned, so moving them is safe; parameters are left to DeepSpeed.
        """
        self.state = PitfallState()
        moved = move_buffers_to_device(model, device)
        if moved:
            self._info(f"ZeroMoEStrategy: moved {len(moved)} buffer(s) to {device} (zero.Init leaves "
                       f"buffers where they were created): {', '.join(moved[:10])}{' ...' if len(moved) > 10 else ''}")
        self.state.buffers_moved = moved
        self.state.tied = find_tied_parameters(model)
        for line in describe_sharing(self.state.tied):
            self._info(f"ZeroMoEStrategy: {line}")

    def after_engine(self, engine: Any, device: torch.device, zero_stage_3: bool) -> None:
        """ZeRO-3 only: check ties, register declared shared parameters, guard moves, start the audit.

        The audit is driven from the strategy's ``optimizer_step`` rather than a callback, so the
        user's callback list is never touched and the hooks live and die with the engine.
        """
        if not zero_stage_3:
            return
        module = engine.module
        broken = broken_ties(module, self.state.tied)
        if broken:
            raise RuntimeError("ZeroMoEStrategy: deepspeed.initialize broke tied parameters, so each side would train "
                               f"separately: {'; '.join(broken)}")
        opts = self.options
        self.state.declared = register_shared_parameters(module, opts.shared_parameters) \
            if opts.register_tied_parameters else []
        if opts.guard_device_moves:
            self.state.guard = DeviceMoveGuard(module, device).install()
        if opts.grad_audit_steps:
            self.state.audit = GradAudit(module, opts.grad_audit_steps, device=device).install()
        self.state._last_global_steps = int(getattr(engine, "global_steps", 0))
        self.state.engine_ready = True

    def after_step(self, engine: Any) -> None:
        """After each ``optimizer_step`` call: first call, log run-time shared parameters; at each real
        optimizer step, advance the audit and log its warnings when it reports."""
        state = self.state
        if not state.engine_ready or engine is None:
            return
        state.calls += 1
        if state.calls == 1:
            state.external = find_external_uses(engine.module, state.declared)
            for line in describe_sharing([], state.external):
                self._info(f"ZeroMoEStrategy: {line}")
        global_steps = int(getattr(engine, "global_steps", state._last_global_steps + 1))
        if global_steps == state._last_global_steps:
            return  # a micro-batch inside gradient accumulation: no optimizer step yet
        state._last_global_steps = global_steps
        state.optimizer_steps += 1
        audit = state.audit
        if audit is not None and audit.report is None:
            report = audit.step()
            if report is not None:
                for message in report.messages():
                    self._warn(f"ZeroMoEStrategy: {message}")

    def teardown(self) -> None:
        """Lift the guard first (Lightning's teardown moves the module to the CPU); drop audit hooks."""
        guard, self.state.guard = self.state.guard, None
        if guard is not None:
            guard.remove()
        if self.state.audit is not None:
            self.state.audit.remove()
