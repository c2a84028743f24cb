"""Checks that run before any process group or DeepSpeed engine exists.

Each failure names the problem and the fix. DeepSpeed would catch some of these too, but only
after every rank has joined a process group and started building an engine, with a message from
deep inside AutoEP; a few (batch arithmetic, ep_size vs. world size) it reports as an assertion.
Pure functions: they take numbers and the discovery result, and raise or return warnings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_zeromoe.compat import NATIVE_MOE_ZERO3_MESSAGE
from lightning_zeromoe.discovery.find import Discovery
from lightning_zeromoe.knowledge import entry_of, say

if TYPE_CHECKING:
    from lightning_zeromoe.config.schema import BatchSection


class ZeroMoEConfigError(ValueError):
    """A setting that cannot work, found before any process starts communicating.

    The message (``knowledge.say(entry_id, ...)``) starts with ``[<entry-id>] ``, the knowledge-base
    entry that explains it; ``entry_id`` holds that id.
    """

    @property
    def entry_id(self) -> str | None:
        """The knowledge-base entry the message cites (``[<entry-id>] ...``), if any."""
        return entry_of(str(self))


@dataclass(frozen=True)
class Layout:
    """The parallel layout Lightning will launch."""

    world_size: int
    devices_per_node: int
    ep_size: int
    stage: int
    precision: str = "32-true"
    #: AutoEP's layer at ep_size=1 (``ZeroMoEStrategy(grouped_experts=True)``).
    grouped_experts: bool = False


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_layout(layout: Layout, found: Discovery) -> list[str]:
    """Errors for impossible ep_size / top_k / native MoE; returns warnings for poor choices."""
    _check_native_moe(layout, found)
    _check_blocks_found(layout, found)
    check_ep_divides_world(layout.ep_size, layout.world_size)
    _check_experts(layout, found)
    return _layout_warnings(layout, found)


def _check_native_moe(layout: Layout, found: Discovery) -> None:
    if layout.stage == 3 and found.native_moe:
        raise ZeroMoEConfigError(
            say("native-moe-zero3", "refused-under-zero3", "autoep-or-stage2", count=len(found.native_moe),
                first=found.native_moe[0], refusal=NATIVE_MOE_ZERO3_MESSAGE))


def _check_blocks_found(layout: Layout, found: Discovery) -> None:
    # Native deepspeed.moe.layer.MoE layers carry their own ep_size (lightning_zeromoe.config.native_moe).
    wants_blocks = layout.grouped_experts or (layout.ep_size > 1 and not found.native_moe)
    if wants_blocks and not found.blocks and not found.fallback:
        where = "\n  ".join(found.candidates) or "(no module name mentions moe/expert/router/gate)"
        asked = f"ep_size={layout.ep_size}" if layout.ep_size > 1 else "grouped_experts=True"
        raise ZeroMoEConfigError(
            say("autoep-no-moe-layers", "no-block-found", "describe-blocks", asked=asked,
                searched=found.source if found.source != 'none' else 'HF presets and self-described modules',
                also=' and grouped_experts=False' if layout.grouped_experts else '', candidates=where))


def check_ep_divides_world(ep_size: int, world_size: int) -> None:
    """Expert-parallel groups of ``ep_size`` ranks must tile the world."""
    if world_size % ep_size:
        raise ZeroMoEConfigError(
            say("ep-size-divisibility", "world-size", "use-world-divisor", ep_size=ep_size, world_size=world_size,
                valid=divisors(world_size)))


def _check_experts(layout: Layout, found: Discovery) -> None:
    for block in found.blocks:
        # With native MoE layers AutoEP converts nothing (native_moe.py), so ep_size splits no block.
        if block.num_experts % layout.ep_size and not found.native_moe:
            raise ZeroMoEConfigError(
                say("ep-size-divisibility", "num-experts", ep_size=layout.ep_size, num_experts=block.num_experts,
                    path=block.path, valid=divisors(block.num_experts)))
        if block.top_k is not None and block.top_k > block.num_experts:
            raise ZeroMoEConfigError(
                say("moe-top-k-range", "above-num-experts", "top-k-at-most", top_k=block.top_k,
                    num_experts=block.num_experts, path=block.path))
        if block.top_k is not None and block.top_k < 1:
            raise ZeroMoEConfigError(say("moe-top-k-range", "below-one", top_k=block.top_k, path=block.path))


def _layout_warnings(layout: Layout, found: Discovery) -> list[str]:
    warnings = []
    if layout.ep_size > layout.devices_per_node:
        warnings.append(
            say("ep-size-crosses-nodes", "crosses-nodes", "keep-within-node", ep_size=layout.ep_size,
                devices_per_node=layout.devices_per_node))
    if found.blocks and layout.precision.startswith("16"):
        warnings.append(
            say("fp16-moe", "fp16-precision", "lightning-bf16-precision", precision=layout.precision))
    return warnings


def check_batch_arithmetic(batch: BatchSection, world_size: int, accumulate_grad_batches: int) -> None:
    """train_batch_size must equal micro_batch x accumulation x data-parallel ranks.

    DeepSpeed refuses the config otherwise, but only at ``deepspeed.initialize``; Lightning sets
    the accumulation from ``Trainer(accumulate_grad_batches=...)``.
    """
    accumulation = batch.gradient_accumulation_steps
    accumulation = accumulate_grad_batches if accumulation is None else accumulation
    if accumulation != accumulate_grad_batches:
        raise ZeroMoEConfigError(
            say("lightning-gradient-accumulation", "disagrees", "use-accumulate-grad-batches",
                accumulation=accumulation, accumulate_grad_batches=accumulate_grad_batches,
                value=accumulate_grad_batches))
    total, micro = batch.train_batch_size, batch.train_micro_batch_size_per_gpu
    if total is None or micro is None or "auto" in (total, micro):
        return
    expected = int(micro) * accumulation * world_size
    if int(total) != expected:
        raise ZeroMoEConfigError(
            say("batch-arithmetic", "strategy-total", "set-derived-total", total=total, micro=micro,
                accumulation=accumulation, world_size=world_size, expected=expected))
