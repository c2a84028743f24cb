"""Shared terminal rendering: one console policy and one look for statuses and severities.

Why shared: doctor, lint and explain print side by side in the same terminal (and the doctor
helper imports this module), so colours, icons and the plain-output rule live here. Output is
plain (no colours, ASCII icons, no hard wrapping) when stdout is not a terminal or NO_COLOR is
set, so logs, pipes and tests get stable text. The API is deliberately small and stable:
``use_color()``, ``console()``, ``is_plain()``, ``status_style()``, ``label()`` and
``print_json()``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from rich.console import Console
from rich.text import Text

__all__ = ["console", "is_plain", "label", "print_json", "status_style", "use_color"]

# status or severity -> (terminal icon, plain icon, rich style)
_STYLES = {
    "ok": ("✔", "ok", "green"),
    "warn": ("⚠", "warn", "yellow"),
    "fail": ("✖", "FAIL", "bold red"),
    "skip": ("–", "skip", "dim"),
    "error": ("✖", "ERROR", "bold red"),
    "warning": ("⚠", "WARNING", "yellow"),
    "info": ("ℹ", "info", "cyan"),
}


def use_color(stream) -> bool:
    """The one colour policy: colour only for a terminal, never when NO_COLOR is set to anything
    non-empty (no-color.org). Every renderer (doctor, lint, explain, Jupyter) asks this."""
    return bool(getattr(stream, "isatty", lambda: False)()) and not os.environ.get("NO_COLOR")


def _plain_wanted(stream) -> bool:
    return not use_color(stream)


def console(*, stderr: bool = False) -> Console:
    """A rich Console for stdout (or stderr) that is plain when not a TTY or NO_COLOR is set."""
    stream = sys.stderr if stderr else sys.stdout
    plain = _plain_wanted(stream)
    return Console(file=stream, no_color=plain, highlight=False, soft_wrap=plain,
                   force_terminal=False if plain else None, emoji=False)


def is_plain(con: Console) -> bool:
    """Whether ``con`` prints plain text (no colour): use ASCII icons then."""
    return con.no_color or not con.is_terminal


def status_style(status: str) -> tuple[str, str]:
    """(icon, rich style) for a doctor status (ok/warn/fail/skip) or a severity."""
    icon, _plain, style = _STYLES.get(status, ("?", status, ""))
    return icon, style


def label(status: str, con: Console) -> Text:
    """The status as a styled icon + word in a terminal, or an upper/lower-case word when plain."""
    icon, plain_word, style = _STYLES.get(status, ("?", status, ""))
    if is_plain(con):
        return Text(f"[{plain_word}]")
    return Text(f"{icon} {status}", style=style)


def print_json(data: Any) -> None:
    """Machine output: indented JSON on stdout, never coloured."""
    sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()
