"""How a command-line tool names itself: the console script it was started by, or ``python -m ...``.

Every tool of both packages is installed as a console script (``[project.scripts]`` in
``pyproject.toml``) and also runs as ``python -m <module>``. Its usage line and errors show the name
the user typed: ``sys.argv[0]`` is the script's path for a console script, and the module's file
(``.../__main__.py``, ``.../export.py``) for ``python -m``. Light: imports only the standard library.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

#: console script -> the module ``python -m`` runs; the same pairs as ``[project.scripts]`` (a test compares).
TOOLS = {
    "zeromoe-demo": "lightning_zeromoe.demo",
    "zeromoe-export": "lightning_zeromoe.export",
    "zeromoe-plan": "lightning_zeromoe.planner",
    "troubleshooter": "troubleshooter",
}


def prog(script: str, argv0: str | None = None) -> str:
    """``script`` when the process was started by that console script, else ``python -m <its module>``."""
    name = Path(sys.argv[0] if argv0 is None else argv0).name
    for suffix in (".exe", "-script.py"):  # the launchers pip writes on Windows
        name = name.removesuffix(suffix)
    return script if name == script else f"python -m {TOOLS[script]}"


def help_when_empty(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """No arguments where the tool needs some: print the whole help (not one usage line) and exit 2."""
    if not argv:
        parser.print_help(sys.stderr)
        raise SystemExit(2)


__all__ = ["TOOLS", "help_when_empty", "prog"]
