"""Explain a traceback or log: match it against the knowledge base and say what to do.

Why a bounded, tail-biased read: training logs grow to gigabytes, and the error that stopped the
run is at the end. We read at most ``MAX_BYTES`` from the end of a file (or keep only the last
``MAX_BYTES`` of standard input), decode with ``errors="replace"`` and strip terminal escapes, so
binary, huge or colourised input never crashes the command.

Exit codes of ``explain`` (see ``troubleshooter.cli``): 0 when at least one diagnosis was printed,
1 when nothing in the input matched a known problem, 2 when the input could not be read.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from troubleshooter import knowledge

__all__ = ["MAX_BYTES", "Diagnosis", "ExplainInputError", "Input", "clean", "explain_text", "read_input"]

#: How much of the input is read: the last 4 MiB (the end of a log is where the error is).
MAX_BYTES = 4 * 1024 * 1024
_CHUNK = 1024 * 1024

# CSI sequences (colours, cursor moves), OSC sequences (titles, hyperlinks), and 2-byte escapes.
_ANSI_RE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")


class ExplainInputError(OSError):
    """The input could not be read (missing file, a directory, no permission)."""


@dataclass(frozen=True)
class Input:
    """What was read: the cleaned text, and whether it was cut to the last ``MAX_BYTES``."""

    text: str
    total_bytes: int
    truncated: bool
    binary: bool  # many NUL bytes: probably not a text log


@dataclass(frozen=True)
class Diagnosis:
    """One known problem found in the input, with everything needed to act on it."""

    entry_id: str
    title: str
    severity: str
    family: str
    cause: str
    fix: tuple[str, ...]
    patch: str | None
    patch_kind: str | None
    sources: tuple[str, ...]
    checked_against: str
    line_no: int
    snippet: str
    count: int
    details: dict[str, str]

    def to_dict(self) -> dict:
        """A JSON-ready dict (for ``--json`` and the Jupyter extension)."""
        return {
            "id": self.entry_id, "title": self.title, "severity": self.severity,
            "family": self.family, "line": self.line_no, "snippet": self.snippet,
            "count": self.count, "details": self.details, "cause": self.cause,
            "fix": list(self.fix), "patch": self.patch, "patch_kind": self.patch_kind,
            "sources": list(self.sources), "checked_against": self.checked_against,
        }


def clean(text: str) -> str:
    """Strip ANSI escapes and NULs, and turn carriage-return progress bars into lines."""
    text = _ANSI_RE.sub("", text)
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")


def _tail_of_stream(stream: BinaryIO, limit: int) -> tuple[bytes, int]:
    """The last ``limit`` bytes of a stream of unknown length, and how many bytes it had."""
    kept = bytearray()
    total = 0
    while chunk := stream.read(_CHUNK):
        total += len(chunk)
        kept += chunk
        if len(kept) > 2 * limit:  # trim now and then, not on every chunk
            del kept[:-limit]
    return bytes(kept[-limit:]), total


def _tail_of_file(path: Path, limit: int) -> tuple[bytes, int]:
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            if size > limit:
                handle.seek(size - limit)
            data = handle.read(limit)
    except IsADirectoryError:
        raise ExplainInputError(f"{path}: is a directory, not a log file") from None
    except OSError as err:
        raise ExplainInputError(f"{path}: {err.strerror or err}") from None
    return data, max(size, len(data))


def read_input(source: str | os.PathLike | None, *, limit: int = MAX_BYTES) -> Input:
    """Read a log from a path, or from standard input when ``source`` is None or ``"-"``."""
    if source is None or str(source) == "-":
        data, total = _tail_of_stream(sys.stdin.buffer, limit)
    else:
        data, total = _tail_of_file(Path(source), limit)
    truncated = total > len(data)
    if truncated:  # the first line is probably cut in the middle
        newline = data.find(b"\n")
        data = data[newline + 1:] if newline != -1 else data
    binary = data.count(b"\x00") > len(data) // 10 if data else False
    return Input(clean(data.decode("utf-8", errors="replace")), total, truncated, binary)


def _diagnosis(m: knowledge.Match) -> Diagnosis:
    e = m.entry
    return Diagnosis(
        entry_id=e.id, title=e.title, severity=e.severity, family=e.family, cause=e.cause,
        fix=e.fix, patch=e.patch, patch_kind=e.patch_kind, sources=e.sources,
        checked_against=e.checked_against, line_no=m.line_no, snippet=m.snippet,
        count=m.count, details=m.details,
    )


def explain_text(text: str) -> list[Diagnosis]:
    """Diagnoses for a log or traceback, best first; an empty list when nothing is known."""
    return [_diagnosis(m) for m in knowledge.match(clean(text))]
