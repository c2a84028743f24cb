"""Checks several walkthroughs share: real calls into the doctor, lint and a source scan."""

from __future__ import annotations

from typing import Any, Mapping

from troubleshooter.walkthroughs.base import Outcome

__all__ = ["doctor_check", "lint_check", "scan_forward_sources"]


def doctor_check(*families: str, timeout: float = 60.0) -> Outcome:
    """Run the doctor's check families and summarise: which did not pass, with their fixes."""
    from troubleshooter.doctor import DoctorOptions, run_checks

    results = run_checks(DoctorOptions(only=families, timeout=timeout))
    bad = [r for r in results if r.status in ("warn", "fail", "error")]
    details = [f"[{r.status}] {r.title}: {r.found}" + (f" -> {r.fix}" if r.fix and r.status != "ok" else "")
               for r in sorted(results, key=lambda r: r.status == "ok")]
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "warn", "fail", "error", "skip")}
    return Outcome(f"doctor ({', '.join(families)}): {len(bad)} need attention", not any(
        r.status in ("fail", "error") for r in results), counts, details)


def lint_check(config: Mapping, world_size: int | None = None, label: str = "config") -> Outcome:
    """Lint a config dict; the headline counts the errors."""
    from troubleshooter.lint import lint_config

    findings = lint_config(dict(config), world_size=world_size, source=label)
    errors = [f for f in findings if f.severity == "error"]
    return Outcome(f"lint of {label}: {len(errors)} error(s), {len(findings) - len(errors)} other finding(s)",
                   not errors, {"errors": len(errors), "findings": len(findings)},
                   [f"[{f.severity}] {f.path}: {f.message} ({f.rule})" for f in findings])


def scan_forward_sources(model: Any = None) -> Outcome:
    """Read the source of every module class's ``forward`` and flag what breaks ZeRO-3: device or
    dtype moves (``.to(``, ``.cuda(``, ``.half(``...) and cached ``.data``. A static look, so it
    also finds code paths a short run would not take. Default model: the tiny MoE (an example)."""
    import inspect
    import re

    example = model is None
    if model is None:
        from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM

        model = TinyMoELM(TinyMoEConfig())
    pattern = re.compile(r"\.(to|cuda|cpu|half|float|bfloat16|double)\(|\.data\b")
    found, seen = [], set()
    for _name, module in model.named_modules():
        cls = type(module)
        if cls in seen or cls.__module__.startswith("torch."):
            continue
        seen.add(cls)
        try:
            lines, start = inspect.getsourcelines(cls.forward)
        except (OSError, TypeError):
            continue
        for offset, line in enumerate(lines):
            if pattern.search(line) and not line.strip().startswith("#"):
                found.append(f"{cls.__name__}.forward line {start + offset}: {line.strip()}")
    tied = []
    try:
        from lightning_zeromoe.engine.pitfalls import find_tied_parameters

        tied = [" = ".join(t.paths) for t in find_tied_parameters(model)]
    except ImportError:
        pass
    which = "the example tiny MoE" if example else type(model).__name__
    return Outcome(f"{which}: {len(found)} suspicious line(s) in forward, {len(tied)} tied parameter group(s)",
                   not found, {"module classes read": len(seen), "tied groups": len(tied)},
                   [*found, *(f"tied: {t}" for t in tied)])
