"""The numbers behind the conversion probe: its inputs, its forward/backward runs, what is compared.

:func:`probe` runs an original MoE block and the ``AutoEPMoELayer`` built from it (both already
built and gathered by :mod:`lightning_zeromoe.conversion.check`) on the same seeded tokens:

* **in fp32**, whatever the training dtype: each run gets fp32 copies of the module's parameters
  and floating buffers (aliases when already fp32), put in place of the originals for the run
  only (:func:`swapped_tensors`); the model's own tensors are never written, cast or given a
  ``.grad``. So the tolerance stays at
  :data:`COMPARE_TOLERANCE` (1e-4 relative) and a systematic error of a few percent cannot hide
  in bf16 rounding;
* **in training mode** (each submodule's mode is put back afterwards), under a forked RNG so
  the model's random stream is not consumed;
* **forward and backward**: the block's output, the router logits Hugging Face records for its
  aux loss, and the gradients, for one seeded upstream gradient, of the block's input and of the
  router weight; where the caller asks (the strategy does when the grouped-GEMM path is
  compared: a kernel's weight gradient can be wrong while its forward is right), also of the
  expert weights (per expert, as the norm over all of that expert's weights, which does not
  depend on how they are split, fused or transposed). They are not asked for by default: they
  cost a full-size gradient of every expert (memory) and time (on CPU, +70 % for the 344 M
  Mixtral of ``benchmarks/probe_cost.py --expert-grads``);
* **with every expert hit**: at least :func:`probe_tokens` tokens; which experts the original
  block used is read from its own expert-weight gradients when they are computed (an expert that
  received no token has none), else from AutoEP's router counts (its router is the one the
  comparison proves equal); if one got no token the batch grows once (x8, at most
  :data:`MAX_TOKENS`), and the report names the experts still not covered (a router whose biases
  never pick an expert on any input cannot be helped by more tokens).

Under bf16/fp16 both blocks also run in that dtype: their error against the fp32 reference is
reported beside it (informational). The grouped-GEMM expert path, when the section turns it on,
runs in the training dtype and must stay within twice the original block's own rounding error
in that dtype (plus one unit of its epsilon); in fp32 it gets the fp32 tolerance.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from lightning_zeromoe.discovery.block_probe import training_mode
from lightning_zeromoe.conversion.report import COMPARE_TOLERANCE, QUANTITIES, ProbeReport
from lightning_zeromoe._private import torch as torch_private

#: The dtype every comparison runs in (the error it allows: :data:`COMPARE_TOLERANCE`).
COMPUTE_DTYPE = torch.float32
#: Expected tokens per expert the probe aims for (uniform routing: P(an expert gets none) ~ e^-16).
TOKENS_PER_EXPERT = 16
#: Fewest and most tokens one probe runs: when an expert got none, the batch grows once, x8.
MIN_TOKENS, MAX_TOKENS, GROWTH = 64, 4096, 8


def probe_tokens(num_experts: int, top_k: int, *, per_expert: int = TOKENS_PER_EXPERT,
                 floor: int = MIN_TOKENS) -> int:
    """Tokens for ``per_expert`` expected tokens per expert (``tokens * top_k / num_experts``), at
    least ``floor``, at most :data:`MAX_TOKENS`, even (two sequences)."""
    want = max(floor, math.ceil(per_expert * num_experts / max(1, top_k)))
    return min(MAX_TOKENS, want + want % 2)


def relative_error(want: torch.Tensor | None, got: torch.Tensor | None) -> float:
    """``max|want - got| / max|want|`` in fp64; ``inf`` when one is missing or the sizes differ."""
    if want is None or got is None:
        return float("inf")
    a, b = want.detach().double().reshape(-1), got.detach().double().reshape(-1)
    if a.numel() != b.numel():
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))


@dataclass(frozen=True)
class Side:
    """One module to run and where its compared parameters are (names as in ``named_parameters``)."""

    module: nn.Module
    router_weight: str | None
    expert_weights: tuple[str, ...]
    #: Installs hooks that append the router logits this side records; returns their handles.
    record_logits: Callable[[nn.Module, list[torch.Tensor]], list[Any]]


@dataclass
class Run:
    """What one forward/backward of one side produced (detached)."""

    output: torch.Tensor
    is_tuple: bool
    logits: torch.Tensor | None
    grads: dict[str, torch.Tensor | None]
    #: Per-expert gradient norm over all of an expert's weights, ``[E]``; None if not found.
    expert_norms: torch.Tensor | None


class ProbeError(Exception):
    """A module could not be run by the probe; ``side`` says which."""

    def __init__(self, side: str, error: BaseException) -> None:
        super().__init__(f"{side}: {type(error).__name__}: {error}")
        self.side, self.error = side, error



@contextlib.contextmanager
def expert_path(layer: nn.Module, grouped: bool) -> Iterator[None]:
    """Run AutoEP's ``GroupedExperts`` with its grouped GEMM (as built) or its per-expert loop."""
    experts = getattr(layer, "experts", None)
    saved = {k: getattr(experts, k) for k in ("use_grouped_mm", "use_triton_grouped_mm") if hasattr(experts, k)}
    if not grouped:
        for key in saved:
            setattr(experts, key, False)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(experts, key, value)


@contextlib.contextmanager
def swapped_tensors(module: nn.Module, swap: Mapping[int, torch.Tensor]) -> Iterator[None]:
    """Every parameter or buffer of ``module`` whose ``id`` is in ``swap`` replaced for the block's
    duration, under every name it has, and the very same objects put back afterwards.

    Not ``torch.func.functional_call``: it swaps by name, so a module reachable under two names
    (the router alias AutoEP is shown) or one tensor under two names (a score-bias alias) came
    back as the copy, not the original (measured with torch 2.13: HunYuan, AFMoE), which breaks
    ZeRO-3's partitioned parameters.
    """
    saved: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for sub in module.modules():  # each module once, however many names it has
            for store in (torch_private.own_parameters(sub), torch_private.own_buffers(sub)):
                for key, tensor in list(store.items()):
                    if tensor is not None and id(tensor) in swap:
                        saved.append((store, key, tensor))
                        store[key] = swap[id(tensor)]
        yield
    finally:
        for store, key, tensor in reversed(saved):
            store[key] = tensor


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _expert_norms(grads: list[torch.Tensor | None], num_experts: int) -> torch.Tensor | None:
    parts = [g.detach().reshape(num_experts, -1).float().pow(2).sum(1) for g in grads if g is not None]
    return torch.stack(parts).sum(0).sqrt() if parts else None


def run_side(side: Side, x: torch.Tensor, upstream: torch.Tensor, logits_upstream: torch.Tensor | None, *,
             dtype: torch.dtype, seed: int, num_experts: int, backward: bool = True) -> Run:
    """Forward and backward of ``side.module`` in training mode on copies of its tensors in ``dtype``.

    The loss is ``<output, upstream> + <recorded logits, logits_upstream>``, so the router weight's
    gradient includes what the aux loss would send through the recorded logits. ``backward=False``:
    the forward only (no gradients in the run).
    """
    module = side.module
    # Same dtype: a detached alias (no memory; autograd.grad below never writes into it). Buffers
    # are always copied: a forward that counts tokens into one must not change the model's.
    swap: dict[int, torch.Tensor] = {}
    params: dict[str, torch.Tensor] = {}
    for n, p in module.named_parameters():
        params[n] = swap[id(p)] = (p.detach() if p.dtype == dtype else p.detach().to(dtype)).requires_grad_(True)
    for b in module.buffers():
        swap[id(b)] = b.detach().to(dtype=dtype if b.is_floating_point() else b.dtype, copy=True)
    inp = x.detach().to(dtype).requires_grad_(True)
    recorded: list[torch.Tensor] = []
    handles = side.record_logits(module, recorded)
    devices = [x.device.index or 0] if x.device.type == "cuda" else []
    try:
        with training_mode(module), torch.random.fork_rng(devices=devices), swapped_tensors(module, swap):
            torch.manual_seed(seed)
            out = module(inp)
    finally:
        for h in handles:
            h.remove()
    y = _first(out)
    logits = recorded[0] if recorded else None
    if not backward:
        return Run(output=y.detach(), is_tuple=isinstance(out, tuple),
                   logits=None if logits is None else logits.detach(), grads={"input": None, "router": None},
                   expert_norms=None)
    loss = (y * upstream.to(y.dtype).reshape(y.shape)).sum()
    if logits is not None and logits_upstream is not None and logits.numel() == logits_upstream.numel():
        loss = loss + (logits * logits_upstream.to(logits.dtype).reshape(logits.shape)).sum()
    names = [n for n in (side.router_weight, *side.expert_weights) if n is not None]
    wanted = [inp] + [params[n] for n in names]
    # A tensor the loss does not reach has a zero gradient (not "nothing to compare").
    grads = [torch.zeros_like(t) if g is None else g
             for g, t in zip(torch.autograd.grad(loss, wanted, allow_unused=True), wanted)]
    by_name = dict(zip(["input", *names], grads))
    experts = [by_name[n] for n in side.expert_weights]
    router = by_name.get(side.router_weight) if side.router_weight else None
    return Run(output=y.detach(), is_tuple=isinstance(out, tuple), logits=None if logits is None else logits.detach(),
               grads={"input": by_name["input"], "router": router},
               expert_norms=_expert_norms(experts, num_experts) if side.expert_weights else None)


def compare(want: Run, got: Run) -> dict[str, float]:
    """Relative errors of ``got`` against ``want``, for every quantity ``want`` has (``inf`` where
    ``got`` lacks it)."""
    errors = {"output": relative_error(want.output, got.output)}
    if want.grads["input"] is not None:
        errors["input_grad"] = relative_error(want.grads["input"], got.grads["input"])
    if want.logits is not None:
        errors["logits"] = relative_error(want.logits, got.logits)
    if want.grads["router"] is not None:
        errors["router_grad"] = relative_error(want.grads["router"], got.grads["router"])
    if want.expert_norms is not None and got.expert_norms is not None:
        errors["expert_grads"] = relative_error(want.expert_norms, got.expert_norms)
    return {k: errors[k] for k in QUANTITIES if k in errors}


def _randn(shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(device)


def probe_input(tokens: int, hidden: int, seed: int, device: torch.device) -> torch.Tensor:
    """The block input a probe of ``tokens`` tokens ran on (two sequences)."""
    return _randn((2, tokens // 2, hidden), seed, device)


def probe(original: Side, converted: Side, *, hidden: int, num_experts: int, top_k: int, model_dtype: torch.dtype,
          device: torch.device, grouped: bool, tokens: int | None = None, seed: int = 1234,
          tokens_per_expert: Callable[[], torch.Tensor | None] = lambda: None,
          before_converted: Callable[[bool], None] = lambda returns_tuple: None) -> ProbeReport:
    """Compare ``converted`` with ``original`` (see the module docstring). Raises :class:`ProbeError`
    when one of them cannot run; the caller turns that into a verdict.

    ``tokens_per_expert`` reads AutoEP's counter (coverage when the original's expert weights are
    not found); ``before_converted`` gets whether the original returned a tuple, before the
    converted layer first runs (to give it the same output contract).
    """
    cdtype = COMPUTE_DTYPE
    count, grown = tokens or probe_tokens(num_experts, top_k), False
    while True:
        x = probe_input(count, hidden, seed, device)
        upstream = _randn((2, count // 2, hidden), seed + 1, device)
        logits_up = _randn((count * num_experts,), seed + 2, device)  # used where the logits have that size
        try:
            reference = run_side(original, x, upstream, logits_up, dtype=cdtype, seed=seed, num_experts=num_experts)
        except Exception as err:  # noqa: BLE001 - reported as the verdict
            raise ProbeError("the original block", err) from err
        before_converted(reference.is_tuple)
        try:
            hits, source = _hits(reference, converted, x, dtype=cdtype, num_experts=num_experts,
                                 counts=tokens_per_expert)
        except Exception as err:  # noqa: BLE001 - it runs the AutoEP layer when the counts are the source
            raise ProbeError("the AutoEP layer", err) from err
        if tokens is not None or bool(hits.all()) or count >= MAX_TOKENS or grown:
            break
        count, grown = min(MAX_TOKENS, count * GROWTH), True
    if reference.logits is None:  # nothing recorded on the original: no logits term on either side
        logits_up = None
    try:
        with expert_path(converted.module, grouped=False):
            got = run_side(converted, x, upstream, logits_up, dtype=cdtype, seed=seed, num_experts=num_experts)
    except Exception as err:  # noqa: BLE001
        raise ProbeError("the AutoEP layer", err) from err
    report = ProbeReport(tokens=count, num_experts=num_experts, experts_hit=int(hits.sum()), compute_dtype=str(cdtype),
                         errors=compare(reference, got), dtype=str(model_dtype), hit_source=source,
                         uncovered=[int(i) for i in torch.nonzero(~hits).flatten()],
                         original_is_tuple=reference.is_tuple, converted_is_tuple=got.is_tuple,
                         output_scale=float(reference.output.abs().max()))
    if report.errors.get("output", 0.0) > COMPARE_TOLERANCE:
        again = run_side(original, x, upstream, logits_up, dtype=cdtype, seed=seed + 17, num_experts=num_experts)
        report.random_in_training = relative_error(reference.output, again.output) > COMPARE_TOLERANCE
    if model_dtype != cdtype:
        _in_training_dtype(report, original, converted, reference, x, upstream, logits_up, model_dtype, seed,
                           num_experts, grouped)
    elif grouped:
        try:
            with expert_path(converted.module, grouped=True):
                fast = run_side(converted, x, upstream, logits_up, dtype=cdtype, seed=seed, num_experts=num_experts)
        except Exception as err:  # noqa: BLE001
            raise ProbeError("the AutoEP layer's grouped-GEMM path", err) from err
        errs = compare(reference, fast)
        report.grouped_errors = {k: (v, COMPARE_TOLERANCE) for k, v in errs.items()}
        report.grouped = "compared" if all(v <= COMPARE_TOLERANCE for v in errs.values()) else "failed"
    return report


def _in_training_dtype(report: ProbeReport, original: Side, converted: Side, reference: Run, x: torch.Tensor,
                       upstream: torch.Tensor, logits_up: torch.Tensor | None, dtype: torch.dtype, seed: int,
                       num_experts: int, grouped: bool) -> None:
    """Both blocks in the training dtype against the fp32 reference; the grouped path's bound.

    The original runs forward only unless the grouped path needs its gradients' rounding for the
    bound (its backward is the probe's costliest run on CPU)."""
    own = run_side(original, x, upstream, logits_up, dtype=dtype, seed=seed, num_experts=num_experts,
                   backward=grouped)
    try:
        with expert_path(converted.module, grouped=grouped):
            low = run_side(converted, x, upstream, logits_up, dtype=dtype, seed=seed, num_experts=num_experts)
    except Exception as err:  # noqa: BLE001
        raise ProbeError("the AutoEP layer's grouped-GEMM path" if grouped else "the AutoEP layer", err) from err
    low_errors = compare(reference, low)
    # The original's gradients are absent from a forward-only run (compare gives inf): left out.
    own_errors = {k: v for k, v in compare(reference, own).items() if k == "output" or math.isfinite(v)}
    report.dtype_gap = {k: (own_errors.get(k), low_errors[k]) for k in low_errors}
    if grouped:
        eps = torch.finfo(dtype).eps
        report.grouped_errors = {k: (low, 2 * own + eps) for k, (own, low) in report.dtype_gap.items()
                                 if own is not None}
        report.grouped = "compared" if all(e <= b for e, b in report.grouped_errors.values()) else "failed"


def _hits(reference: Run, converted: Side, x: torch.Tensor, *, dtype: torch.dtype, num_experts: int,
          counts: Callable[[], torch.Tensor | None]) -> tuple[torch.Tensor, str]:
    """Which experts the original block used: non-zero expert-weight gradients, else AutoEP's counts."""
    if reference.expert_norms is not None:
        return reference.expert_norms > 0, "the original block's expert-weight gradients"
    before = counts()
    module = converted.module
    swap = {id(p): p.detach().to(dtype) for p in module.parameters()}  # the buffers stay: AutoEP counts into one
    with torch.no_grad(), expert_path(module, grouped=False), training_mode(module), swapped_tensors(module, swap):
        module(x.to(dtype))
    after = counts()
    if before is None or after is None:
        return torch.ones(num_experts, dtype=torch.bool), "not measured"
    return (after - before).reshape(-1) > 0, "AutoEP's router counts"


def recorded_by(recorders: list[tuple[type, int, str | None]]) -> Callable[[nn.Module, list[torch.Tensor]], list[Any]]:
    """Hooks that record what Hugging Face's ``router_logits`` recorders would (``(class, index, _)``)."""
    def install(module: nn.Module, got: list[torch.Tensor]) -> list[Any]:
        handles = []
        for sub in module.modules():
            for target, index, _ in recorders:
                if isinstance(sub, target):
                    def hook(_m: nn.Module, _a: Any, out: Any, index: int = index) -> None:
                        got.append(out[index] if isinstance(out, tuple) else out)
                    handles.append(sub.register_forward_hook(hook))
        return handles
    return install


def output_of(path: str) -> Callable[[nn.Module, list[torch.Tensor]], list[Any]]:
    """A hook that records the output of the submodule at ``path`` (AutoEP's ``router.gate``)."""
    def install(module: nn.Module, got: list[torch.Tensor]) -> list[Any]:
        return [module.get_submodule(path).register_forward_hook(lambda _m, _a, out: got.append(out))]
    return install


def expert_weight_names(module: nn.Module, prefix: str, num_experts: int) -> tuple[str, ...]:
    """Parameters under ``prefix`` whose first dimension is the expert dimension (gathered shapes)."""
    return tuple(n for n, p in module.named_parameters()
                 if n.startswith(prefix + ".") and p.dim() >= 2 and p.shape[0] == num_experts)


def parameter_name(module: nn.Module, param: torch.Tensor | None) -> str | None:
    """The name ``named_parameters`` gives ``param`` (the first one, for a tied parameter)."""
    return next((n for n, p in module.named_parameters() if p is param), None) if param is not None else None
