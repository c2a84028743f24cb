"""What the conversion probe reports: per block (:class:`ProbeReport`) and in one log line.

:mod:`lightning_zeromoe.conversion.probe` fills a :class:`ProbeReport` per block;
:func:`summary_line` is the line the strategy logs once per engine build: the blocks matched, the
worst errors, the tokens and expert coverage, the training-dtype gap, the grouped-GEMM path, and
what the probe cannot see (:data:`PROBE_BLIND_SPOTS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

#: Relative max-abs error the fp32 comparison allows (``max|want - got| / max|want|``).
COMPARE_TOLERANCE = 1e-4
#: What each comparison is called in reports, in order.
QUANTITIES = ("output", "logits", "input_grad", "router_grad", "expert_grads")


@dataclass
class ProbeReport:
    """Everything one probe measured for one block (see the module docstring)."""

    tokens: int
    num_experts: int
    experts_hit: int
    compute_dtype: str
    #: Relative errors of the converted layer against the original, in the compute dtype.
    errors: dict[str, float] = field(default_factory=dict)
    #: Training dtype runs (informational): quantity -> (original's error or None, converted's) vs fp32.
    #: The original's gradients in that dtype are computed only when the grouped path needs its bound.
    dtype_gap: dict[str, tuple[float | None, float]] = field(default_factory=dict)
    dtype: str = ""
    #: "compared" / "not used" / "failed"; with its errors and bounds when compared.
    grouped: str = "not used"
    grouped_errors: dict[str, tuple[float, float]] = field(default_factory=dict)
    hit_source: str = ""
    uncovered: list[int] = field(default_factory=list)
    random_in_training: bool = False
    original_is_tuple: bool = False
    converted_is_tuple: bool = False
    #: Largest absolute value of the original's output (0: the probe proves nothing).
    output_scale: float = 0.0


def summarize(errors: Mapping[str, float]) -> str:
    """``output 3.1e-07, input_grad 2e-07, ...`` in :data:`QUANTITIES` order."""
    return ", ".join(f"{k} {v:.2g}" for k, v in errors.items())


#: What the setup-time probe cannot see, said in its log line.
PROBE_BLIND_SPOTS = (
    "not seen by the probe: the all-to-all of expert parallelism (it holds every expert on one rank; the parity "
    "tests cover it), randomness that exists only in training (router jitter is refused at discovery; dropout "
    "in a block fails the probe), inputs other than its random tokens, and state that changes while training "
    "(counters, bias updates)")


def summary_line(reports: list[ProbeReport], *, passed: int, total: int, grouped_configured: bool,
                 on_cpu: bool) -> str:
    """One log line: what the probe compared, how closely, and what it could not see."""
    if not reports:
        return f"ZeroMoEStrategy conversion probe: {total} block(s), none could be run"
    worst = {k: max(r.errors.get(k, 0.0) for r in reports) for k in reports[0].errors}
    tokens = sorted({r.tokens for r in reports})
    uncovered = sum(len(r.uncovered) for r in reports)
    unmeasured = sum(r.hit_source == "not measured" for r in reports)
    line = (f"ZeroMoEStrategy conversion probe: {passed}/{total} block(s) match their AutoEP layer in "
            f"{reports[0].compute_dtype.replace('torch.', '')} (training mode, forward and backward, "
            f"{'/'.join(map(str, tokens))} tokens; worst relative error: {summarize(worst)}; tolerance "
            f"{COMPARE_TOLERANCE:g}); ")
    line += (f"{uncovered} expert(s) got no probe token and were not compared; " if uncovered
             else "every expert received tokens; ")
    if unmeasured:
        line += f"expert coverage not measured in {unmeasured} block(s); "
    gaps = [r.dtype_gap for r in reports if r.dtype_gap]
    if gaps:
        own, converted = (max(g["output"][i] for g in gaps) for i in (0, 1))
        line += (f"in {reports[0].dtype.replace('torch.', '')} against that reference (informational): original "
                 f"output {own:.2g}, AutoEP layer {converted:.2g}; ")
    if grouped_configured:
        failed = sum(r.grouped == "failed" for r in reports)
        line += f"grouped-GEMM expert path compared ({failed} block(s) outside its bound); "
    else:
        line += ("grouped-GEMM expert path not compared (training runs AutoEP's per-expert loop"
                 + (" on CPU" if on_cpu else ", use_grouped_mm is off") + "); ")
    return line + PROBE_BLIND_SPOTS + "."
