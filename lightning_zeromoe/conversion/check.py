"""Prove each AutoEP conversion before training: the converted block computes what the original did.

Before ``deepspeed.initialize`` (which replaces the blocks), every rank builds, for each block
the discovery wants converted, the very ``AutoEPMoELayer`` AutoEP would build, from the section
DeepSpeed will get, but with ``ep_size=1`` so it holds every expert and needs no communication.
:func:`lightning_zeromoe.conversion.probe.probe` runs the original block and that layer on the
same seeded tokens, in fp32 copies whatever the training dtype, in training mode, forward and
backward, with enough tokens that every expert receives some, and compares the output, the
router logits the model records for its aux loss (what the converted layer will hand Hugging
Face's recorder after :func:`restore_router_logits`), and the gradients of the block's input, of
the router weight (and of the experts, where the grouped-GEMM expert path is compared too: where
the section turns it on). A block that differs by more than 1e-4 (relative) is not converted: it falls
back to ZeRO-3 without EP, and the message says which block, by how much, and what the mapping
was. :func:`probe_summary` is the log line: the worst errors, the bf16 gap, the grouped path,
and what the probe cannot see.

Under ZeRO-3 the block's parameters may already be partitioned (``zero.Init``): they are
gathered one block at a time for the probe and released. The verdicts are all-reduced (a block
converts only if it passed on every rank), so the ranks cannot disagree on the module tree.

DeepSpeed internals used here and only here: ``AutoEP.ep_parser``, ``AutoEPMoELayer``,
``parse_autoep_config`` (``deepspeed.module_inject``, 0.19.8).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from lightning_zeromoe.config.schema import DeepSpeedConfig
from lightning_zeromoe.engine import collectives
from lightning_zeromoe.discovery.block_probe import gathered
from lightning_zeromoe.conversion.diagnose import diagnose
from lightning_zeromoe.conversion.probe import (ProbeError, Side, expert_weight_names, output_of, parameter_name,
                                                probe, probe_input, recorded_by)
from lightning_zeromoe.discovery.find import Discovery, MoEBlock
from lightning_zeromoe.discovery.structure import SCORE_BIAS
from lightning_zeromoe.conversion import flat_repack
from lightning_zeromoe.conversion.score_bias import flatten_score_biases, restore_score_biases
from lightning_zeromoe.conversion.report import COMPARE_TOLERANCE, ProbeReport, summary_line
from lightning_zeromoe.conversion.router_logits import (match_output_contract, raw_router_logits, restore_router_logits,
                                             router_logit_recorders)
from lightning_zeromoe._private import deepspeed as ds_private
from lightning_zeromoe._private import torch as torch_private
from lightning_zeromoe.knowledge import say

ENTRY_ID = "moe-conversion-mismatch"
__all__ = ["BlockCheck", "check_block", "check_conversion", "match_output_contract", "narrowed_config",
           "probe_summary", "register_fallback_leaves", "restore_router_logits", "router_logit_recorders",
           "tolerance_for"]


@dataclass(frozen=True)
class BlockCheck:
    """The verdict for one block: relative errors of the output and of the recorded router logits,
    and everything else the probe measured (``report``; None when the probe could not run)."""

    path: str
    passed: bool
    output_error: float | None
    logits_error: float | None
    tolerance: float
    detail: str = ""
    returns_tuple: bool = False
    report: ProbeReport | None = None

    def message(self, section: dict[str, Any]) -> str:
        """The user-facing warning; ``section`` is the ``expert_parallel`` section that was probed."""
        keys = ("preset_model", "score_func", "route_norm", "routed_scaling_factor", "top_k", "score_apply",
                "num_expert_groups", "shared_experts_pattern", "shared_experts_gate_pattern", "expert_activation")
        mapping = ", ".join(f"{k}={section[k]!r}" for k in keys if k in section) or "AutoEP defaults"
        how = ""
        if self.report is not None:
            how = (f"; compared in {self.report.compute_dtype.replace('torch.', '')}, training mode, "
                   f"{self.report.tokens} tokens")
        return say(ENTRY_ID, "mismatch", "set-mapping", path=self.path, detail=self.detail, tolerance=self.tolerance,
                   how=how, mapping=mapping)


def tolerance_for(dtype: torch.dtype) -> float:
    """Relative max-abs error two implementations of one block show in ``dtype`` (rounding alone).

    The probe compares in fp32 (:data:`COMPARE_TOLERANCE`), whatever the training dtype; the
    larger values are what a comparison in that dtype would have to accept.
    """
    return {torch.float64: 1e-9, torch.float32: COMPARE_TOLERANCE, torch.bfloat16: 4e-2,
            torch.float16: 1e-2}.get(dtype, COMPARE_TOLERANCE)


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


def _section_for_probe(found: Discovery, section: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The section AutoEP will use (``section``, else discovery's), for this one block, every expert local."""
    base = dict(section) if section else {**found.autoep, "use_grouped_mm": False}
    base = {k: v for k, v in base.items() if k not in ("enabled", "autoep_size")}
    base.update(enabled=True, autoep_size=1, moe_layer_pattern="block")
    return base


def _release(layer: nn.Module) -> None:
    """Free the probe layer's own tensors now (its router and experts; the shared experts are the
    block's): the module sits in reference cycles that only a full garbage collection would free."""
    for part in (getattr(layer, "router", None), getattr(layer, "experts", None)):
        for p in part.parameters() if part is not None else ():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            p.grad = None


def check_block(root: nn.Module, block_info: MoEBlock, found: Discovery, *, section: Mapping[str, Any] | None = None,
                tokens: int | None = None, seed: int = 1234, expert_grads: bool | None = None) -> BlockCheck:
    """Probe one block against the AutoEP layer its section would build (see the module docstring).

    ``section``: the ``expert_parallel`` section DeepSpeed will get (its ``use_grouped_mm`` selects
    whether the grouped-GEMM path is compared too); without it, discovery's with the loop path.
    ``tokens``: a fixed probe size instead of :func:`lightning_zeromoe.conversion.probe.probe_tokens`.
    ``expert_grads``: compare the expert weights' gradients too (None: when the grouped path is compared).
    """
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    block = root.get_submodule(block_info.path)
    ref = next((p for p in block.parameters()), None)
    dtype = ref.dtype if ref is not None else torch.float32
    device = ref.device if ref is not None else torch.device("cpu")
    tol = COMPARE_TOLERANCE  # the probe compares in fp32 copies, whatever the model's dtype

    def refused(detail: str, report: ProbeReport | None = None) -> BlockCheck:
        return BlockCheck(block_info.path, False, None, None, tol, detail, report=report)

    probe_section = _section_for_probe(found, section)
    # AutoEP gathers a ZeRO-3 block's parameters itself while it builds the layer, so the block is
    # gathered for the probe runs only (nested gathers of one parameter are refused). Building the
    # layer initialises its router: under a forked RNG, so the model's random stream stays as it was.
    cuda = [device.index or 0] if device.type == "cuda" else []
    ds_private.check_autoep_api()  # an API change is an error with the version in it, not a refusal
    with _attributes_kept(block), torch.no_grad(), torch.random.fork_rng(devices=cuda), \
            flat_repack.for_autoep(root, block_info):  # DBRX: its 2-D experts as AutoEP's 3-D views, for the build
        try:
            config = parse_autoep_config(probe_section)
            specs = AutoEP(_Holder(block, found.root_config), config).ep_parser()
            if len(specs) != 1:
                return refused(f"AutoEP detected {len(specs)} blocks")
            spec = specs[0]
            layer = AutoEPMoELayer(spec=spec, source_module=block, ep_size=1, ep_rank=0, config=config)
            layer.to(device=device, dtype=dtype)
            raw_router_logits(layer)
        except Exception as exc:  # noqa: BLE001 - AutoEP refusing the block is a verdict, not a crash
            return refused(f"AutoEP refused it: {exc}")
    try:
        with gathered(block):
            hidden = (block_info.layout.hidden_size if block_info.layout else None) or spec.hidden_size
            num_experts = int(spec.num_experts)
            router = getattr(getattr(block, spec.router_name, None), "weight", None)
            grouped = bool(probe_section.get("use_grouped_mm"))
            experts = grouped if expert_grads is None else expert_grads
            original = Side(block, parameter_name(block, router),
                            _own_expert_weights(block, block_info, spec.experts_name, num_experts) if experts else (),
                            recorded_by(router_logit_recorders(root)))
            converted = Side(layer, "router.gate.weight",
                             expert_weight_names(layer, "experts", num_experts) if experts else (),
                             output_of("router.gate"))
            # A tuple where the caller unpacks one is fatal (Llama-4): the layer must return what the block does.
            try:
                report = probe(original, converted, hidden=hidden, num_experts=num_experts, top_k=int(spec.top_k),
                               model_dtype=dtype, device=device, grouped=grouped,
                               tokens=tokens, seed=seed, tokens_per_expert=lambda: _counts(layer),
                               before_converted=lambda returns_tuple: match_output_contract(layer, returns_tuple))
            except ProbeError as err:
                what = "cannot be probed" if err.side == "the original block" else "fails on it"
                return refused(f"{err.side} {what}: {err.error}")
            where = ""
            if any(not e <= tol for e in report.errors.values()) and report.output_scale > 0:
                where = _first_difference(original, converted, report, block_info, spec, hidden, seed, device)
    finally:
        _release(layer)
    return _verdict(block_info.path, report, tol, where)


def _first_difference(original: Side, converted: Side, report: ProbeReport, block_info: MoEBlock, spec: Any,
                      hidden: int, seed: int, device: torch.device) -> str:
    """Which part differs (:mod:`lightning_zeromoe.conversion.diagnose`), or why that could not be told."""
    router = block_info.layout.router if block_info.layout is not None else spec.router_name
    try:
        return diagnose(original, converted, probe_input(report.tokens, hidden, seed, device), original_router=router,
                        num_experts=report.num_experts, seed=seed)
    except Exception as err:  # noqa: BLE001 - the verdict stands without it
        return f"the differing part could not be told ({type(err).__name__}: {err})"


def _own_expert_weights(block: nn.Module, block_info: MoEBlock, experts: str, num_experts: int) -> tuple[str, ...]:
    """The original block's expert weights: ``[E, ...]`` tensors, or DBRX's ``[E * ffn, hidden]`` ones (their
    rows are expert-major, so per-expert gradient norms compare with AutoEP's)."""
    layout = block_info.layout
    if layout is not None and layout.storage == flat_repack.FLAT:
        return tuple(f"{layout.experts}.{w}" for w in (layout.w1, layout.w3, layout.w2))
    return expert_weight_names(block, experts, num_experts)


def _counts(layer: nn.Module) -> torch.Tensor | None:
    counts = getattr(layer, "tokens_per_expert", None)
    return None if counts is None else counts.detach().clone()


def _verdict(path: str, report: ProbeReport, tol: float, where: str = "") -> BlockCheck:
    """Pass or fail from what the probe measured, with one clause per problem; ``where``: which part
    differs (:func:`lightning_zeromoe.conversion.diagnose.first_difference`), said first."""
    if not report.output_scale > 0:
        return BlockCheck(path, False, None, None, tol, "the original block outputs zeros on the probe, so the "
                          "probe proves nothing", report=report)
    problems = []
    if report.original_is_tuple and not report.converted_is_tuple:
        problems.append("the AutoEP layer returns a tensor where the original returns a tuple")
    what = {"output": "output differs by {:.3g} (relative max-abs)",
            "logits": "recorded router logits differ by {:.3g}, so the aux loss would change",
            "input_grad": "the gradient of the block's input differs by {:.3g}",
            "router_grad": "the router weight's gradient differs by {:.3g}",
            "expert_grads": "the expert weights' gradients (per-expert norms) differ by {:.3g}"}
    for key, error in report.errors.items():
        if not error <= tol:
            problems.append(what[key].format(error))
    if report.random_in_training and problems:
        problems.append("the original block is random in training mode (dropout or noise), which AutoEP's layer "
                        "does not reproduce")
    if report.grouped == "failed":
        worst = ", ".join(f"{k} {e:.3g} > {b:.3g}" for k, (e, b) in report.grouped_errors.items() if e > b)
        problems.append(f"the grouped-GEMM expert path training uses differs ({worst})")
    if problems and where:
        problems.insert(0, where)
    return BlockCheck(path, not problems, report.errors.get("output"), report.errors.get("logits"), tol,
                      "; ".join(problems), report.original_is_tuple, report)


def router_aliases(root: nn.Module, found: Discovery, install: bool) -> list[str]:
    """Show AutoEP a nested router projection (HunYuan's ``gate.wg``, AFMoE's ``router.gate``) as a
    direct child ``zeromoe_router`` of each block to convert, or take those aliases away again.

    The alias is the same module (no copy): AutoEP copies its weight into the new router and the
    block, alias included, leaves the model. Blocks that are not converted must not keep it (their
    state dict would name the weight twice): call with ``install=False`` for them.
    """
    from lightning_zeromoe.discovery.structure import ROUTER_ALIAS

    done = []
    for block in found.blocks if install else [*found.blocks, *found.fallback]:
        layout = block.layout
        if layout is None or layout.autoep_router != ROUTER_ALIAS:
            continue
        module = root.get_submodule(block.path)
        if install:
            module.add_module(ROUTER_ALIAS, module.get_submodule(layout.router_linear))
        elif ROUTER_ALIAS in torch_private.child_table(module):
            del torch_private.child_table(module)[ROUTER_ALIAS]
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
                module.register_buffer(SCORE_BIAS, bias, persistent="expert_bias" not in torch_private.non_persistent_buffers(module))
        else:
            torch_private.own_parameters(module).pop(SCORE_BIAS, None)
            torch_private.own_buffers(module).pop(SCORE_BIAS, None)
        done.append(block.path)
    return done


def check_conversion(root: nn.Module, found: Discovery, *, section: Mapping[str, Any] | None = None,
                     tokens: int | None = None, seed: int = 1234,
                     expert_grads: bool | None = None) -> tuple[Discovery, list[BlockCheck]]:
    """Probe every block ``found`` wants converted; return the discovery without the failed ones.

    ``section``: the ``expert_parallel`` section DeepSpeed will get (see :func:`check_block`).
    Router aliases (:func:`router_aliases`) are installed for the blocks that pass and removed from
    the others, so the model is ready for ``deepspeed.initialize`` with the returned discovery.
    """
    router_aliases(root, found, install=True)
    bias_aliases(root, found, install=True)
    flattened = flatten_score_biases(root, found.blocks)  # ERNIE's [1, E] bias shown as [E] (exact reshape)
    found = found.without(flat_repack.unviewable(root, found.blocks))
    flat_blocks = list(found.blocks)
    flat_repack.install(root, flat_blocks)  # DBRX's experts.mlp shown to AutoEP as a direct child
    checks = [check_block(root, block, found, section=section, tokens=tokens, seed=seed, expert_grads=expert_grads)
              for block in found.blocks]
    gc.collect()  # the probe layers' tensors are freed already (_release); their modules sit in cycles
    passed = _agree_over_ranks([c.passed for c in checks])
    checks = [c if ok == c.passed else dataclasses.replace(c, passed=False, detail="it failed the probe on another "
                                                           "rank") for c, ok in zip(checks, passed)]
    failed = {c.path: f"the conversion probe failed ({c.detail})" for c in checks if not c.passed}
    tuples = {c.path for c in checks if c.passed and c.returns_tuple}
    found = dataclasses.replace(found, blocks=[dataclasses.replace(b, returns_tuple=b.path in tuples)
                                               for b in found.blocks]).without(failed)
    router_aliases(root, dataclasses.replace(found, blocks=[]), install=False)
    bias_aliases(root, dataclasses.replace(found, blocks=[]), install=False)
    restore_score_biases(flattened, {b.path for b in found.blocks})
    flat_repack.settle(root, flat_blocks, {b.path for b in found.blocks})
    return found, checks


def probe_summary(checks: list[BlockCheck], *, grouped_configured: bool, on_cpu: bool) -> str:
    """One log line: what the probe compared, how closely, and what it could not see."""
    return summary_line([c.report for c in checks if c.report is not None], passed=sum(c.passed for c in checks),
                        total=len(checks), grouped_configured=grouped_configured, on_cpu=on_cpu)


def _agree_over_ranks(passed: list[bool]) -> list[bool]:
    import torch.distributed as dist

    if not passed or not collectives.is_initialized():
        return passed
    flags = torch.tensor([1 if p else 0 for p in passed], dtype=torch.int32)
    collectives.all_reduce(flags, op=dist.ReduceOp.MIN)  # on the backend's device: NCCL has no CPU one
    return [bool(v) for v in flags.tolist()]


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


def narrowed_config(config: DeepSpeedConfig, found: Discovery) -> DeepSpeedConfig:
    """The DeepSpeed config with its AutoEP section pointed at exactly the blocks that passed."""
    section = config.expert_parallel
    if section is None:
        return config
    if not found.blocks:
        return config.replace(expert_parallel=None)
    if "moe_layer_pattern" in found.autoep:
        return config.replace(expert_parallel=dataclasses.replace(section,
                                                                  moe_layer_pattern=found.autoep["moe_layer_pattern"]))
    return config
