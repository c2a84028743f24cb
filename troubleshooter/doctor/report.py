"""How doctor results are shown: a rich table in a terminal, plain text in a pipe, or JSON.

Why three: people read the table; logs and CI capture plain text (no escape codes, and NO_COLOR
is honoured, see no-color.org); tools and the Jupyter extension read ``--json``.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, TextIO

from troubleshooter.doctor.base import STATUSES, CheckResult, exit_code

TAGS = {"ok": "[ OK ]", "warn": "[WARN]", "fail": "[FAIL]", "skip": "[SKIP]", "error": "[ERR ]"}


def summary(results: list[CheckResult]) -> dict[str, Any]:
    """Counts per status and the exit status the doctor returns for these results."""
    counts = Counter(r.status for r in results)
    return {"total": len(results), **{s: counts[s] for s in STATUSES}, "exit_code": exit_code(results)}


def to_json(results: list[CheckResult]) -> str:
    """``{"results": [...], "summary": {...}}``, stable field names for machines."""
    payload = {"results": [r.to_dict() for r in results], "summary": summary(results)}
    return json.dumps(payload, indent=2, default=str)


def use_color(stream: TextIO) -> bool:
    """Whether to colour: the shared policy of :func:`troubleshooter.render.use_color`."""
    from troubleshooter.render import use_color as policy  # imported on use, like rich below

    return policy(stream)


def render(results: list[CheckResult], stream: TextIO) -> None:
    """Print the results for a person: a table, then what to do about each warn/fail/error."""
    if use_color(stream):
        _render_rich(results, stream)
    else:
        stream.write(render_plain(results))


ACTION_ORDER = {"fail": 0, "error": 1, "warn": 2}


def actions(results: list[CheckResult]) -> list[CheckResult]:
    """The results that need something done, most serious first (stable within a status)."""
    return sorted((r for r in results if r.status in ACTION_ORDER), key=lambda r: ACTION_ORDER[r.status])


def _summary_line(results: list[CheckResult]) -> str:
    s = summary(results)
    return (f"{s['ok']} ok, {s['warn']} warn, {s['fail']} fail, {s['error']} error, "
            f"{s['skip']} skipped")


def render_plain(results: list[CheckResult]) -> str:
    """Plain text: one line per check, then the fixes; no escape codes."""
    width = max((len(r.title) for r in results), default=10)
    lines = [f"{TAGS[r.status]} {r.title:<{width}}  {r.found}" for r in results]
    todo = actions(results)
    if todo:
        lines += ["", "What to do:"]
        for r in todo:
            lines.append(f"{TAGS[r.status]} {r.title}")
            if r.why:
                lines.append(f"       why: {r.why}")
            if r.fix:
                lines.append(f"       fix: {r.fix}")
            if r.entry:
                lines.append(f"       more: troubleshooter knowledge entry '{r.entry}'")
    lines += ["", _summary_line(results)]
    return "\n".join(lines) + "\n"


def _render_rich(results: list[CheckResult], stream: TextIO) -> None:
    """The colour table; icons and colours are the ones lint and explain use (troubleshooter.render).

    rich is imported only here: plain and JSON output do not need it.
    """
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from troubleshooter.render import status_style

    icon = {s: status_style(s)[0] for s in STATUSES}
    style = {s: status_style(s)[1] for s in STATUSES}

    console = Console(file=stream, force_terminal=True)
    table = Table(title="troubleshooter doctor", show_lines=False, expand=True)
    table.add_column("", width=1, no_wrap=True)
    table.add_column("Check", no_wrap=True)
    table.add_column("Found", ratio=1)
    for r in results:
        table.add_row(Text(icon[r.status], style=style[r.status]),
                      Text(r.title, style=style[r.status] if r.status != "ok" else ""),
                      Text(r.found))
    console.print(table)
    for r in actions(results):
        console.print(Text.assemble((f"{icon[r.status]} {r.title}", style[r.status])))
        if r.why:
            console.print(Text(f"  why: {r.why}"))
        if r.fix:
            console.print(Text.assemble(("  fix: ", "bold"), r.fix))
        if r.entry:
            console.print(Text(f"  more: knowledge entry '{r.entry}'", style="dim"))
    console.print(Text(_summary_line(results), style="bold"))
