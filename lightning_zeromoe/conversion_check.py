"""Prove each AutoEP conversion before training: the converted block computes what the original did.

Before ``deepspeed.initialize`` (which replaces the blocks), every rank builds, for each block
the discovery wants converted, the very ``AutoEPMoELayer`` AutoEP would build, from the same
``expert_parallel`` section, but with ``ep_size=1`` so it holds every expert and needs no
communication. It runs the original block and that layer on the same seeded probe batch and
compares the outputs, and the router logits where the model records them for its aux loss
(what the converted layer will hand Hugging Face's recorder after :func:`restore_router_logits`).
A block that differs by more than the dtype's tolerance is not converted: it falls back to
ZeRO-3 without EP, and the message says which block, by how much, and what the mapping was.

Under ZeRO-3 the block's parameters may already be partitioned (``zero.Init``): they are
gathered one block at a time for the probe and released. The verdicts are all-reduced (a block
converts only if it passed on every rank), so the ranks cannot disagree on the module tree.

DeepSpeed internals used here and only here: ``AutoEP.ep_parser``, ``AutoEPMoELayer``,
``parse_autoep_config`` (``deepspeed.module_inject``, 0.19.8); transformers'
``install_output_capuring_hook`` (``transformers.utils.output_capturing``, 5.22).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from lightning_zeromoe import collectives
from lightning_zeromoe.discovery import Discovery, MoEBlock
from lightning_zeromoe.moe_structure import SCORE_BIAS

ENTRY_ID = "moe-conversion-mismatch"
#: AutoEP presets whose adapter already hands HF's recorder the raw router logits.
_RETARGETING_PRESETS = ("mixtral", "qwen3_moe", "minimax_m3")


@dataclass(frozen=True)
class BlockCheck:
    """The verdict for one block: relative errors of the output and of the recorded router logits."""

    path: str
    passed: bool
    output_error: float | None
    logits_error: float | None
    tolerance: float
    detail: str = ""
    returns_tuple: bool = False

    def message(self, section: dict[str, Any]) -> str:
        """The user-facing warning; ``section`` is the ``expert_parallel`` section that was probed."""
        keys = ("preset_model", "score_func", "route_norm", "routed_scaling_factor", "top_k", "score_apply",
                "num_expert_groups", "shared_experts_pattern", "shared_experts_gate_pattern", "expert_activation")
        mapping = ", ".join(f"{k}={section[k]!r}" for k in keys if k in section) or "AutoEP defaults"
        return (f"[{ENTRY_ID}] {self.path}: the expert-parallel conversion does not compute what the original "
                f"block does ({self.detail}; tolerance {self.tolerance:g}; AutoEP section: {mapping}). This block "
                "trains under ZeRO-3 without expert parallelism instead. If the mapping is wrong, set it with "
                "moe_pattern=MoEPattern(..., route_norm=..., score_func=...).")


def tolerance_for(dtype: torch.dtype) -> float:
    """Relative max-abs error allowed between two implementations of the same block."""
    return {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 1e-2}.get(dtype, 1e-4)


@contextlib.contextmanager
def _gathered(module: nn.Module) -> Iterator[None]:
    """Full parameters of ``module`` for the probe: ZeRO-3 partitioned ones are gathered (read-only)."""
    params = list(module.parameters())
    if not any(hasattr(p, "ds_id") for p in params):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield


@contextlib.contextmanager
def _attributes_kept(module: nn.Module) -> Iterator[None]:
    """Undo what building an AutoEPMoELayer marks on the source's parameters (allreduce, placement)."""
    before = {id(p): set(vars(p)) for p in module.parameters()}
    try:
        yield
    finally:
        for p in module.parameters():
            for name in set(vars(p)) - before.get(id(p), set()):
                delattr(p, name)


class _Holder(nn.Module):
    """What AutoEP's parser sees for one block: the block as ``block`` and the HF config as ``.config``."""

    def __init__(self, block: nn.Module, config: Any) -> None:
        super().__init__()
        self.block = block
        self.config = config


def router_logit_recorders(root: nn.Module) -> list[tuple[type, int, str | None]]:
    """``(target class, output index, layer_name)`` of every HF recorder of ``router_logits`` under root."""
    found: list[tuple[type, int, str | None]] = []
    for module in root.modules():
        specs = getattr(type(module), "_can_record_outputs", None)
        spec = specs.get("router_logits") if isinstance(specs, dict) else None
        for item in (spec if isinstance(spec, list) else [spec] if spec is not None else []):
            target = getattr(item, "target_class", item)
            if isinstance(target, type):
                entry = (target, int(getattr(item, "index", 1)), getattr(item, "layer_name", None))
                if entry not in found:
                    found.append(entry)
    return found


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
    if a.numel() != b.numel():
        return float("inf")
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-12))


def _record(module: nn.Module, recorders: list[tuple[type, int, str | None]]) -> tuple[list[torch.Tensor], list]:
    got: list[torch.Tensor] = []
    handles = []
    for name, sub in module.named_modules():
        for target, index, _ in recorders:
            if isinstance(sub, target):
                def hook(_m: nn.Module, _a: Any, out: Any, index: int = index) -> None:
                    got.append(out[index] if isinstance(out, tuple) else out)
                handles.append(sub.register_forward_hook(hook))
    return got, handles


def _section_for_probe(found: Discovery) -> dict[str, Any]:
    section = {k: v for k, v in found.autoep.items() if k not in ("enabled", "autoep_size")}
    section.update(enabled=True, autoep_size=1, use_grouped_mm=False, moe_layer_pattern="block")
    return section


def check_block(root: nn.Module, block_info: MoEBlock, found: Discovery, *, tokens: int = 16,
                seed: int = 1234) -> BlockCheck:
    """Probe one block against the AutoEP layer its section would build (see the module docstring)."""
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    block = root.get_submodule(block_info.path)
    recorders = router_logit_recorders(root)
    ref = next((p for p in block.parameters()), None)
    dtype = ref.dtype if ref is not None else torch.float32
    device = ref.device if ref is not None else torch.device("cpu")
    tol = tolerance_for(dtype)
    hidden = block_info.layout.hidden_size if block_info.layout else None
    # AutoEP gathers a ZeRO-3 block's parameters itself while it builds the layer, so the block is
    # gathered for the forward passes only (nested gathers of one parameter are refused).
    with _attributes_kept(block), torch.no_grad():
        try:
            config = parse_autoep_config(_section_for_probe(found))
            specs = AutoEP(_Holder(block, found.root_config), config).ep_parser()
            if len(specs) != 1:
                return BlockCheck(block_info.path, False, None, None, tol, f"AutoEP detected {len(specs)} blocks")
            spec = specs[0]
            layer = AutoEPMoELayer(spec=spec, source_module=block, ep_size=1, ep_rank=0, config=config)
            layer.to(device=device, dtype=dtype)
            _raw_router_logits(layer)
        except Exception as exc:  # noqa: BLE001 - AutoEP refusing the block is a verdict, not a crash
            return BlockCheck(block_info.path, False, None, None, tol, f"AutoEP refused it: {exc}")
        with _gathered(block):
            hidden = hidden or spec.hidden_size
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(2, tokens // 2, hidden, generator=gen).to(device=device, dtype=dtype)
            want_logits, handles = _record(block, recorders)
            try:
                original = block(x)
                want = _first(original)
            except Exception as exc:  # noqa: BLE001
                return BlockCheck(block_info.path, False, None, None, tol, f"the original block cannot be probed: {exc}")
            finally:
                for h in handles:
                    h.remove()
            returns_tuple = isinstance(original, tuple)
            match_output_contract(layer, returns_tuple)
            try:
                converted = layer(x)
                got = _first(converted)
            except Exception as exc:  # noqa: BLE001
                return BlockCheck(block_info.path, False, None, None, tol, f"the AutoEP layer fails on it: {exc}")
            if not bool(want.abs().max() > 0):
                return BlockCheck(block_info.path, False, None, None, tol,
                                  "the original block outputs zeros on the probe, so the probe proves nothing")
            # A tuple where the caller unpacks one is fatal (Llama-4); the reverse is Qwen3.5's preset
            # contract, which its decoder layer unpacks.
            if returns_tuple and not isinstance(converted, tuple):
                return BlockCheck(block_info.path, False, None, None, tol, "the AutoEP layer returns "
                                  f"{type(converted).__name__} where the original returns {type(original).__name__}")
            out_err = _rel(want, got)
            logits_err = None
            if want_logits:
                logits_err = _rel(want_logits[0], layer.router.gate(x.reshape(-1, hidden)))
    problems = []
    if not out_err <= tol:
        problems.append(f"output differs by {out_err:.3g} (relative max-abs)")
    if logits_err is not None and not logits_err <= tol:
        problems.append(f"recorded router logits differ by {logits_err:.3g}, so the aux loss would change")
    return BlockCheck(block_info.path, not problems, out_err, logits_err, tol, "; ".join(problems), returns_tuple)


def match_output_contract(layer: nn.Module, returns_tuple: bool) -> None:
    """A block that returns ``(hidden, router_logits)`` (Llama-4) gets a layer that does the same,
    with the raw logits of its router (AutoEP detects this contract only from HF recorders)."""
    if returns_tuple and not getattr(layer, "return_router_logits", False):
        layer.return_router_logits = True
        layer.router_logits_capture_target = "router"
        layer.router_logits_capture_mode = "raw"


def _raw_router_logits(layer: nn.Module) -> None:
    """Qwen3.5's preset hands HF softmax probabilities, which HF's aux loss softmaxes again: hand raw logits."""
    if getattr(layer, "return_router_logits", False) and getattr(layer, "router_logits_capture_target", "") == "router":
        layer.router_logits_capture_mode = "raw"


def router_aliases(root: nn.Module, found: Discovery, install: bool) -> list[str]:
    """Show AutoEP a nested router projection (HunYuan's ``gate.wg``, AFMoE's ``router.gate``) as a
    direct child ``zeromoe_router`` of each block to convert, or take those aliases away again.

    The alias is the same module (no copy): AutoEP copies its weight into the new router and the
    block, alias included, leaves the model. Blocks that are not converted must not keep it (their
    state dict would name the weight twice): call with ``install=False`` for them.
    """
    from lightning_zeromoe.moe_structure import ROUTER_ALIAS

    done = []
    for block in found.blocks if install else [*found.blocks, *found.fallback]:
        layout = block.layout
        if layout is None or layout.autoep_router != ROUTER_ALIAS:
            continue
        module = root.get_submodule(block.path)
        if install:
            module.add_module(ROUTER_ALIAS, module.get_submodule(layout.router_linear))
        elif ROUTER_ALIAS in module._modules:
            del module._modules[ROUTER_ALIAS]
        done.append(block.path)
    return done


def bias_aliases(root: nn.Module, found: Discovery, install: bool) -> list[str]:
    """Show AutoEP a block's ``expert_bias`` as ``e_score_correction_bias`` (the same tensor, no
    copy; see :attr:`BlockLayout.score_bias`), so the converted router keeps it; or take the
    aliases away again (``install=False``) from blocks that will not be converted, whose state
    dict must not name the bias twice.

    Without the alias AutoEP drops the bias and routes differently; the probe then refuses the
    block (measured on AFMoE and LFM2-MoE with non-zero biases).
    """
    done = []
    for block in found.blocks if install else [*found.blocks, *found.fallback]:
        if block.layout is None or block.layout.score_bias != "expert_bias":
            continue
        module = root.get_submodule(block.path)
        if install:
            bias = module.expert_bias
            if isinstance(bias, nn.Parameter):
                module.register_parameter(SCORE_BIAS, bias)
            else:
                module.register_buffer(SCORE_BIAS, bias, persistent="expert_bias" not in module._non_persistent_buffers_set)
        else:
            module._parameters.pop(SCORE_BIAS, None)
            module._buffers.pop(SCORE_BIAS, None)
        done.append(block.path)
    return done


def check_conversion(root: nn.Module, found: Discovery, **probe: Any) -> tuple[Discovery, list[BlockCheck]]:
    """Probe every block ``found`` wants converted; return the discovery without the failed ones.

    Router aliases (:func:`router_aliases`) are installed for the blocks that pass and removed from
    the others, so the model is ready for ``deepspeed.initialize`` with the returned discovery.
    """
    router_aliases(root, found, install=True)
    bias_aliases(root, found, install=True)
    checks = []
    for block in found.blocks:
        checks.append(check_block(root, block, found, **probe))
        gc.collect()  # the probe layer (a whole block's experts) sits in reference cycles: free it now
    passed = _agree_over_ranks([c.passed for c in checks])
    checks = [c if ok == c.passed else BlockCheck(c.path, False, c.output_error, c.logits_error, c.tolerance,
                                                    "it failed the probe on another rank") for c, ok in zip(checks, passed)]
    failed = {c.path: f"the conversion probe failed ({c.detail})" for c in checks if not c.passed}
    tuples = {c.path for c in checks if c.passed and c.returns_tuple}
    found = dataclasses.replace(found, blocks=[dataclasses.replace(b, returns_tuple=b.path in tuples)
                                               for b in found.blocks]).without(failed)
    router_aliases(root, dataclasses.replace(found, blocks=[]), install=False)
    bias_aliases(root, dataclasses.replace(found, blocks=[]), install=False)
    return found, checks


def _agree_over_ranks(passed: list[bool]) -> list[bool]:
    import torch.distributed as dist

    if not passed or not collectives.is_initialized():
        return passed
    flags = torch.tensor([1 if p else 0 for p in passed], dtype=torch.int32)
    collectives.all_reduce(flags, op=dist.ReduceOp.MIN)  # on the backend's device: NCCL has no CPU one
    return [bool(v) for v in flags.tolist()]


def restore_router_logits(root: nn.Module, found: Discovery) -> int:
    """After ``deepspeed.initialize``: make every converted block hand HF's recorder raw router logits.

    AutoEP's Mixtral/Qwen3-MoE/MiniMax-M3 adapters retarget HF's recorder to the new router; the
    Qwen3.5 adapter hands softmax probabilities (switched to raw logits here); a block that returns
    ``(hidden, router_logits)`` itself (Llama-4) gets a layer that does; DeepSeek-V2/V3 and
    custom sections retarget nothing, so a hook on the new router's projection is installed. The
    logits recorded are exactly what :func:`check_block` compared. Returns the hooks installed.
    """
    recorders = router_logit_recorders(root)
    if not recorders or not found.blocks:
        return 0
    from transformers.utils.output_capturing import install_output_capuring_hook

    preset = found.autoep.get("preset_model")
    installed = 0
    for block in found.blocks:
        layer = root.get_submodule(block.path)
        if not hasattr(layer, "router"):
            continue
        _raw_router_logits(layer)
        match_output_contract(layer, block.returns_tuple)
        if preset in _RETARGETING_PRESETS or preset == "qwen3_5_moe":  # AutoEP's adapter feeds the recorder
            continue
        # A layer that returns (hidden, logits) computes its logits with a second call of its router
        # projection: record its output then, or each layer's logits would be recorded twice.
        target, index = (layer, 1) if getattr(layer, "return_router_logits", False) else (layer.router.gate, 0)
        if getattr(target, "_zeromoe_logits_hook", False):
            continue
        install_output_capuring_hook(target, "router_logits", index)
        target._zeromoe_logits_hook = True
        installed += 1
    return installed


def register_fallback_leaves(root: nn.Module, found: Discovery, ep_converts: bool) -> list[str]:
    """Mark every MoE block that trains without EP as a ZeRO-3 leaf module (DeepSpeed #4808, #7461).

    A leaf's parameters are gathered as one unit on entry, so ranks whose tokens pick different
    experts still issue the same all-gathers and cannot deadlock. ``ep_converts`` False (ep_size=1)
    means every block trains without EP. Uses ``deepspeed.utils.set_z3_leaf_module`` (0.19.8).
    """
    from deepspeed.utils import set_z3_leaf_module

    paths = [b.path for b in found.fallback] + ([] if ep_converts else [b.path for b in found.blocks])
    # A mixture-of-attention block (JetMoE's self_attention.experts) has its experts' methods called
    # from the attention module, outside the block's forward; as a leaf, ZeRO-3 leaves their
    # gradients unhandled ("RuntimeError: unknown parameter type" at the first step, measured). Such
    # blocks are used by every token, so they gather identically on every rank anyway.
    paths = [p for p in paths if not any("attn" in part or "attention" in part for part in p.split("."))]
    for path in paths:
        set_z3_leaf_module(root.get_submodule(path), True)
    return paths


def narrowed_config(config: dict[str, Any], found: Discovery) -> dict[str, Any]:
    """The DeepSpeed config with its AutoEP section pointed at exactly the blocks that passed."""
    section = config.get("expert_parallel")
    if not isinstance(section, dict):
        return config
    out = dict(config)
    if not found.blocks:
        out.pop("expert_parallel")
    elif "moe_layer_pattern" in found.autoep:
        out["expert_parallel"] = {**section, "moe_layer_pattern": found.autoep["moe_layer_pattern"]}
    return out
