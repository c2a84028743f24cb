"""``--config``: the DeepSpeed config lint, turned into doctor results.

Why here too: a config that DeepSpeed rejects or silently ignores (the seeds' ``"moe"`` block,
batch arithmetic that does not add up) fails as surely as a missing compiler, and the doctor is
where people look first. The rules live in :mod:`troubleshooter.lint`; this module only maps
severities (error -> fail, warning -> warn, info -> ok).
"""

from __future__ import annotations

from typing import Any

from troubleshooter.doctor.base import CheckResult, DoctorOptions, error_result
from troubleshooter.doctor.probes import ProbeSet

SEVERITY_STATUS = {"error": "fail", "warning": "warn", "info": "ok"}


def check(options: DoctorOptions, probes: ProbeSet) -> list[CheckResult]:
    """Lint ``options.config`` (skip without one)."""
    if options.config is None:
        return [CheckResult("config.lint", "DeepSpeed config", "skip", "no --config given",
                            fix="Pass --config ds_config.json to lint it as part of the checks.")]
    try:
        from troubleshooter.lint import lint_path
    except ImportError as err:
        return [error_result("config.lint", "DeepSpeed config", f"the lint is not available: {err}")]
    try:
        findings = lint_path(options.config, world_size=options.world_size)
    except Exception as err:  # the lint reports unreadable input as a one-line error
        message = str(err) if options.config in str(err) else f"{options.config}: {err}"
        return [CheckResult("config.lint", "DeepSpeed config", "fail", message,
                            fix="Fix the file so that it is a JSON object DeepSpeed can read.",
                            details={"path": options.config, "error": str(err)})]
    if not findings:
        return [CheckResult("config.lint", "DeepSpeed config", "ok",
                            f"{options.config}: no findings", details={"path": options.config})]
    return [finding_result(options.config, f) for f in findings]


def entry_for(rule: str) -> str | None:
    """The rule id when the knowledge base has an entry of that name (rules cite entries)."""
    try:
        from troubleshooter import knowledge
        return knowledge.get(rule).id
    except Exception:
        return None


def finding_result(path: str, finding: Any) -> CheckResult:
    """One lint finding as one result."""
    details = {"rule": finding.rule, "severity": finding.severity, "path": finding.path,
               "patch": getattr(finding, "patch", None), "file": path}
    where = f" at {finding.path}" if finding.path else ""
    # A rule can fire at several places in one file: the JSON path keeps the ids unique.
    check_id = f"config.{finding.rule}" + (f"@{finding.path}" if finding.path else "")
    return CheckResult(check_id, f"Config: {finding.rule}",
                       SEVERITY_STATUS.get(finding.severity, "warn"),
                       f"{path}{where}: {finding.message}", fix=finding.fix or "",
                       entry=getattr(finding, "entry", None) or entry_for(finding.rule),
                       details=details)
