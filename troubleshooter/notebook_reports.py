"""What ``%doctor`` and ``%ds_lint`` display: HTML in a notebook, the plain text in a terminal.

The HTML is wrapped in the troubleshooter's own scoped style (:mod:`troubleshooter.notebook_css`):
left-aligned cells and diffs, headers that do not run together. The doctor's table puts its
summary first and the problems on top, and folds the checks that passed under one line.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

__all__ = ["Report", "doctor_report", "lint_report"]

#: Doctor status -> (icon, colour) for the HTML table.
_STATUS_LOOK = {"ok": ("✔", "#2e7d32"), "warn": ("⚠", "#b26a00"), "fail": ("✖", "#c62828"),
                "skip": ("–", "#757575"), "error": ("✖", "#c62828")}
_SEVERITY_LOOK = {"error": ("✖", "#c62828"), "warning": ("⚠", "#b26a00"), "info": ("ℹ", "#1565c0")}


# ---------------------------------------------------------------------------------------------
# Rich display objects: HTML for notebooks, plain text for terminals and logs
# ---------------------------------------------------------------------------------------------


class Report:
    """Something to ``display``: HTML in a notebook, the plain text in a terminal (and in tests)."""

    def __init__(self, plain: str, html_text: str, data: Any = None) -> None:
        self.plain, self.html, self.data = plain, html_text, data

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:
        return self.plain


def _esc(text: Any) -> str:
    return html.escape(str(text))


def _doctor_row(r: Any) -> str:
    from troubleshooter import knowledge

    icon, colour = _STATUS_LOOK.get(r.status, ("?", "#000"))
    todo = []
    if r.status in ("warn", "fail", "error"):
        if r.why:
            todo.append(f"<div><b>Why</b>: {_esc(r.why)}</div>")
        if r.fix:
            todo.append(f"<div><b>Fix</b>: {_esc(r.fix)}</div>")
        if r.entry:
            try:
                title = knowledge.get(r.entry).title
            except KeyError:
                title = r.entry
            todo.append(f"<div class='tsh-muted'>Knowledge base: {_esc(title)} <code>{_esc(r.entry)}</code></div>")
    found = f"<div>{_esc(r.found)}</div>" + "".join(todo)
    return (f"<tr><td style='color:{colour};font-weight:bold;white-space:nowrap'>{icon} {_esc(r.status)}</td>"
            f"<td>{_esc(r.title)}</td><td>{found}</td></tr>")


def doctor_report(results: list) -> Report:
    """The doctor's results: the summary first, then the problems (fail, error, warn) with their fix
    and entry, and the checks that passed or were skipped folded away under one line."""
    from troubleshooter.notebook_css import scoped
    from troubleshooter.doctor import report

    order = {"fail": 0, "error": 1, "warn": 2}
    problems = sorted((r for r in results if r.status in order), key=lambda r: order[r.status])
    rest = [r for r in results if r.status not in order]
    s = report.summary(results)
    summary = (f"{s['ok']} ok, {s['warn']} warn, {s['fail']} fail, {s['error']} error, "
               f"{s['skip']} skipped")
    head = "<thead><tr><th>status</th><th>check</th><th>found, and what to do</th></tr></thead>"
    parts = [f"<div class='troubleshooter-doctor'><b>troubleshooter doctor: {_esc(summary)}</b>"]
    if problems:
        parts.append(f"<table class='tsh-problems'>{head}<tbody>{''.join(map(_doctor_row, problems))}</tbody></table>")
    else:
        parts.append("<div>✔ no problems found</div>")
    if rest:
        parts.append(f"<details class='tsh-passed'><summary>{len(rest)} checks passed or skipped (show)</summary>"
                     f"<table>{head}<tbody>{''.join(map(_doctor_row, rest))}</tbody></table></details>")
    return Report(report.render_plain(results), scoped("".join(parts) + "</div>"), results)


def lint_report(findings: list, config: Mapping | None, source: str) -> Report:
    """Lint findings as a table; a finding with a JSON merge patch shows the config diff it makes."""
    from troubleshooter.notebook_css import scoped
    from troubleshooter.walkthroughs.diffs import config_diff, diff_html

    if not findings:
        plain = f"{source}: no problems found"
        return Report(plain, scoped(f"<div class='troubleshooter-lint'>✔ {_esc(plain)}</div>"), findings)
    lines, rows = [], []
    for f in findings:
        icon, colour = _SEVERITY_LOOK.get(f.severity, ("?", "#000"))
        lines.append(f"[{f.severity}] {f.path or '<config>'}: {f.message}\n    fix: {f.fix}  ({f.rule})")
        diff = ""
        if f.patch and config is not None:
            text = config_diff(dict(config), f.patch, name=source)
            lines.append("\n".join("    " + line for line in text.splitlines()))
            diff = diff_html(text)
        rows.append(f"<tr><td style='color:{colour};font-weight:bold'>{icon} {_esc(f.severity)}</td>"
                    f"<td><code>{_esc(f.path or '<config>')}</code></td><td>{_esc(f.message)}"
                    f"<div><b>Fix</b>: {_esc(f.fix)}</div>{diff}</td><td><code>{_esc(f.rule)}</code></td></tr>")
    errors = sum(f.severity == "error" for f in findings)
    head = f"{source}: {len(findings)} finding(s), {errors} error(s)"
    table = scoped(f"<div class='troubleshooter-lint'><b>{_esc(head)}</b><table><thead><tr><th>severity</th>"
                   "<th>key</th><th>problem and fix</th><th>entry</th></tr></thead>"
                   f"<tbody>{''.join(rows)}</tbody></table></div>")
    return Report(head + "\n" + "\n".join(lines), table, findings)


# ---------------------------------------------------------------------------------------------
# Diagnosing an exception
