"""``--config``: the DeepSpeed config lint, turned into doctor results.

Why here too: a config that DeepSpeed rejects or silently ignores (the seeds' ``"moe"`` block,
batch arithmetic that does not add up) fails as surely as a missing compiler, and the doctor is
where people look first. The rules live in :mod:`troubleshooter.lint`; this module only maps
severities (error -> fail, warning -> warn, info -> ok).
"""

from __future__ import annotations

from typing import Any

from troubleshooter import knowledge
from troubleshooter.doctor.base import CheckResult, DoctorOptions, cite, error_result
from troubleshooter.doctor.probes import ProbeSet

SEVERITY_STATUS = {"error": "fail", "warning": "warn", "info": "ok"}


def check(options: DoctorOptions, probes: ProbeSet) -> list[CheckResult]:
    """Lint ``options.config`` (skip without one)."""
    if options.config is None:
        return [CheckResult("config.lint", "DeepSpeed config", "skip", "no --config given",
                            entry="doctor-run", **cite(knowledge.fix("doctor-run", "pass-config")))]
    try:
        from troubleshooter.lint import lint_path
    except ImportError as err:
        return [error_result("config.lint", "DeepSpeed config", f"the lint is not available: {err}",
                             timeout=options.timeout)]
    try:
        findings = lint_path(options.config, world_size=options.world_size)
    except Exception as err:  # the lint reports unreadable input as a one-line error
        message = str(err) if options.config in str(err) else f"{options.config}: {err}"
        return [CheckResult("config.lint", "DeepSpeed config", "fail", message,
                            entry="config-file-format",
                            **cite(knowledge.fix("config-file-format", "strict-json")),
                            details={"path": options.config, "error": str(err)})]
    if not findings:
        return [CheckResult("config.lint", "DeepSpeed config", "ok",
                            f"{options.config}: no findings", details={"path": options.config})]
    return [finding_result(options.config, f) for f in findings]


def entry_for(rule: str) -> str | None:
    """The rule id when the knowledge base has an entry of that name (rules cite entries)."""
    try:
        return knowledge.get(rule).id
    except Exception:
        return None


def finding_result(path: str, finding: Any) -> CheckResult:
    """One lint finding as one result."""
    line = getattr(finding, "line", None)
    details = {"rule": finding.rule, "severity": finding.severity, "path": finding.path,
               "patch": getattr(finding, "patch", None), "file": path, "line": line,
               "col": getattr(finding, "col", None)}
    where = f":{line}" if line else ""
    where += f" at {finding.path}" if finding.path else ""
    fix = finding.fix or ""
    if fix and finding.path and finding.path not in fix:  # what to do names the key it is about
        fix = f"{finding.path}: {fix}"
    fix_id = (f"{getattr(finding, 'fix_entry', '') or finding.rule}/{finding.fix_id}"
              if getattr(finding, "fix_id", "") else None)
    # A rule can fire at several places in one file: the JSON path keeps the ids unique.
    check_id = f"config.{finding.rule}" + (f"@{finding.path}" if finding.path else "")
    return CheckResult(check_id, f"Config: {finding.rule}",
                       SEVERITY_STATUS.get(finding.severity, "warn"),
                       f"{path}{where}: {finding.message}", fix=fix, fix_id=fix_id,
                       entry=getattr(finding, "entry", None) or entry_for(finding.rule),
                       details=details)
