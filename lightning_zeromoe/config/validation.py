"""Checks that run before any process group or DeepSpeed engine exists.

Each failure names the problem and the fix. DeepSpeed would catch some of these too, but only
after every rank has joined a process group and started building an engine, with a message from
deep inside AutoEP; a few (batch arithmetic, ep_size vs. world size) it reports as an assertion.
Pure functions: they take numbers and the discovery result, and raise or return warnings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from lightning_zeromoe.compat import NATIVE_MOE_ZERO3_MESSAGE
from lightning_zeromoe.discovery.find import Discovery


class ZeroMoEConfigError(ValueError):
    """A setting that cannot work, found before any process starts communicating.

    The message starts with ``[<entry-id>] ``, the troubleshooter knowledge-base entry that explains
    it; ``entry_id`` holds that id.
    """

    @property
    def entry_id(self) -> str | None:
        """The knowledge-base entry the message cites (``[<entry-id>] ...``), if any."""
        message = str(self)
        if message.startswith("[") and "] " in message:
            return message[1:message.index("] ")]
        return None


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
            f"[native-moe-zero3] {len(found.native_moe)} native deepspeed.moe.layer.MoE module(s) found ({found.native_moe[0]}, ...), "
            f"and DeepSpeed refuses them under ZeRO stage 3 (\"{NATIVE_MOE_ZERO3_MESSAGE}\"). Two ways out: "
            "(1) keep stage 3 and let AutoEP convert a plain MoE block: a Hugging Face MoE model "
            "(Mixtral, Qwen3-MoE, DeepSeek-V2/V3) or your own block described with moe_pattern=MoEPattern(...); "
            "(2) keep the native layers and use ZeroMoEStrategy(stage=2) (or 1).")


def _check_blocks_found(layout: Layout, found: Discovery) -> None:
    # Native deepspeed.moe.layer.MoE layers carry their own ep_size (lightning_zeromoe.config.native_moe).
    wants_blocks = layout.grouped_experts or (layout.ep_size > 1 and not found.native_moe)
    if wants_blocks and not found.blocks and not found.fallback:
        where = "\n  ".join(found.candidates) or "(no module name mentions moe/expert/router/gate)"
        asked = f"ep_size={layout.ep_size}" if layout.ep_size > 1 else "grouped_experts=True"
        raise ZeroMoEConfigError(
            f"[autoep-no-moe-layers] {asked} but no MoE block was found for AutoEP to convert "
            f"(searched: {found.source if found.source != 'none' else 'HF presets and self-described modules'}). "
            "Describe your blocks with ZeroMoEStrategy(moe_pattern=MoEPattern(block=r'...', top_k=...)), "
            f"or use ep_size=1{' and grouped_experts=False' if layout.grouped_experts else ''}. Modules that look "
            f"MoE-like:\n  {where}")


def check_ep_divides_world(ep_size: int, world_size: int) -> None:
    """Expert-parallel groups of ``ep_size`` ranks must tile the world."""
    if world_size % ep_size:
        raise ZeroMoEConfigError(
            f"[ep-size-divisibility] ep_size={ep_size} does not divide the world size {world_size} (devices x num_nodes): experts "
            f"are split over groups of ep_size ranks and the groups must tile the world. Use one of "
            f"{divisors(world_size)}, or change devices/num_nodes.")


def _check_experts(layout: Layout, found: Discovery) -> None:
    for block in found.blocks:
        # With native MoE layers AutoEP converts nothing (native_moe.py), so ep_size splits no block.
        if block.num_experts % layout.ep_size and not found.native_moe:
            raise ZeroMoEConfigError(
                f"[ep-size-divisibility] ep_size={layout.ep_size} does not divide num_experts={block.num_experts} in '{block.path}': "
                f"each rank of an expert-parallel group must own the same number of experts. "
                f"Valid ep_size values: {divisors(block.num_experts)}.")
        if block.top_k is not None and block.top_k > block.num_experts:
            raise ZeroMoEConfigError(
                f"[moe-top-k-range] top_k={block.top_k} exceeds num_experts={block.num_experts} in '{block.path}': a token "
                f"cannot pick more experts than exist. Set top_k <= {block.num_experts}.")
        if block.top_k is not None and block.top_k < 1:
            raise ZeroMoEConfigError(f"[moe-top-k-range] top_k={block.top_k} in '{block.path}' must be at least 1.")


def _layout_warnings(layout: Layout, found: Discovery) -> list[str]:
    warnings = []
    if layout.ep_size > layout.devices_per_node:
        warnings.append(
            f"[ep-size-crosses-nodes] ep_size={layout.ep_size} is larger than the {layout.devices_per_node} devices per node: "
            "every MoE layer's all-to-all will cross the network. Keep ep_size <= devices per node "
            "where the experts fit.")
    if found.blocks and layout.precision.startswith("16"):
        warnings.append(
            f"[fp16-moe] precision={layout.precision!r} (fp16) with MoE: router softmax and the aux loss overflow "
            "easily and the loss scaler skips steps. Use precision='bf16-mixed' or 'bf16-true' where the "
            "hardware supports bf16.")
    return warnings


def check_batch_arithmetic(config: Mapping[str, Any], world_size: int, accumulate_grad_batches: int) -> None:
    """train_batch_size must equal micro_batch x accumulation x data-parallel ranks.

    DeepSpeed refuses the config otherwise, but only at ``deepspeed.initialize``; Lightning sets
    the accumulation from ``Trainer(accumulate_grad_batches=...)``.
    """
    accumulation = config.get("gradient_accumulation_steps", accumulate_grad_batches)
    if accumulation != accumulate_grad_batches:
        raise ZeroMoEConfigError(
            f"[lightning-gradient-accumulation] gradient_accumulation_steps={accumulation} in your DeepSpeed config disagrees with "
            f"Trainer(accumulate_grad_batches={accumulate_grad_batches}). Lightning drives accumulation: "
            "remove the key from the config and set it on the Trainer.")
    total, micro = config.get("train_batch_size"), config.get("train_micro_batch_size_per_gpu")
    if total is None or micro is None or "auto" in (total, micro):
        return
    expected = int(micro) * accumulation * world_size
    if int(total) != expected:
        raise ZeroMoEConfigError(
            f"[batch-arithmetic] train_batch_size={total} but train_micro_batch_size_per_gpu x gradient accumulation x "
            f"data-parallel ranks = {micro} x {accumulation} x {world_size} = {expected}. DeepSpeed refuses "
            f"this. Set train_batch_size={expected}, or drop it and let DeepSpeed derive it.")
