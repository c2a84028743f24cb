"""Matching log text against the knowledge base's entries (used through ``knowledge.match``).

Two kinds of pattern are tried. An entry's ``patterns`` count wherever they occur. Its
``contextual`` patterns count only when one of its ``context`` patterns occurs within
``context_chars`` characters of the hit: a message that is ambiguous alone (a shape error with a
0 where a real dimension belongs) is this entry's problem only next to what makes it so (a ZeRO-3
frame or config). Each pattern's anchor, a literal every match contains, is tested on the lowered
text first, so most patterns never run on most logs.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:  # pragma: no cover - typing only
    from lightning_zeromoe.knowledge import Entry

__all__ = ["SNIPPET_CHARS", "TAIL_CHARS", "Match", "is_own", "line_at", "match_entries", "rank_key"]

#: A snippet longer than this is cut: log lines can be megabytes long (progress bars, tensors).
SNIPPET_CHARS = 300
#: Patterns about the end of a log (they use \Z) only look at this many trailing characters,
#: which bounds their cost whatever the input.
TAIL_CHARS = 16 * 1024
SEVERITIES = ("error", "warning", "info")


@dataclass(frozen=True)
class Match:
    """Where one entry matched a text: the last hit, since the error that matters is at the end."""

    entry: "Entry"
    pattern: str
    line_no: int  # 1-based line of the last hit
    snippet: str  # that line, stripped and cut to SNIPPET_CHARS
    offset: int  # character offset of the last hit
    count: int  # how many hits over all of the entry's patterns
    details: dict[str, str]  # named groups of the last hit (versions, sizes, op names)


def line_at(text: str, offset: int) -> tuple[int, str]:
    """1-based line number and the (cut) line that contains ``offset``."""
    start = text.rfind("\n", 0, offset) + 1
    end = text.find("\n", offset)
    line = text[start:end if end != -1 else len(text)].strip()
    if len(line) > SNIPPET_CHARS:
        line = line[:SNIPPET_CHARS - 1] + "…"
    return text.count("\n", 0, offset) + 1, line


@lru_cache(maxsize=None)
def _own_prefix(entry_id: str) -> tuple[re.Pattern[str], str]:
    """Our own errors start with ``[<entry-id>] ``: every entry recognises its id in that form."""
    return re.compile(r"(?<![\w\[-])\[" + re.escape(entry_id) + r"\] "), f"[{entry_id}] "


def is_own(m: Match) -> bool:
    """Whether the last hit is the ``[<entry-id>] `` prefix of the project's own messages."""
    return m.pattern == _own_prefix(m.entry.id)[0].pattern


def _hits(pattern: re.Pattern[str], anchor: str, text: str, lowered: str) -> Iterable[re.Match[str]]:
    if anchor and anchor not in lowered:
        return ()
    start = max(0, len(text) - TAIL_CHARS) if r"\Z" in pattern.pattern else 0
    return pattern.finditer(text, start)


def _context_offsets(entry: "Entry", text: str, lowered: str, lo: int, hi: int) -> list[int]:
    """Sorted start offsets of the entry's context hits between ``lo`` and ``hi``."""
    found: list[int] = []
    for pattern, anchor in zip(entry.compiled_context, entry.context_anchors):
        if anchor and anchor not in lowered:
            continue
        found += [hit.start() for hit in pattern.finditer(text, max(0, lo), hi)]
    return sorted(found)


def _near(offsets: list[int], at: int, chars: int) -> bool:
    i = bisect.bisect_left(offsets, at - chars)
    return i < len(offsets) and offsets[i] <= at + chars


def _match_entry(entry: "Entry", text: str, lowered: str) -> Match | None:
    last: re.Match[str] | None = None
    last_pattern = ""
    count = 0
    plain = (*zip(entry.compiled, entry.anchors), _own_prefix(entry.id))
    for pattern, anchor in plain:
        for hit in _hits(pattern, anchor, text, lowered):
            count += 1
            if last is None or hit.start() > last.start():
                last, last_pattern = hit, pattern.pattern
    hits = [(hit, pattern.pattern) for pattern, anchor in
            zip(entry.compiled_contextual, entry.contextual_anchors)
            for hit in _hits(pattern, anchor, text, lowered)]
    if hits:  # the context is searched only around the hits, and only when there are some
        chars = entry.context_chars
        lo, hi = min(h.start() for h, _ in hits) - chars, max(h.end() for h, _ in hits) + chars
        context = _context_offsets(entry, text, lowered, lo, hi)
        for hit, source in hits:
            if _near(context, hit.start(), chars):
                count += 1
                if last is None or hit.start() > last.start():
                    last, last_pattern = hit, source
    if last is None:
        return None
    line_no, snippet = line_at(text, last.start())
    details = {k: v for k, v in last.groupdict().items() if v}
    return Match(entry, last_pattern, line_no, snippet, last.start(), count, details)


def rank_key(m: Match) -> tuple:
    """Sort key, best first.

    Errors before warnings before infos. A collective timeout ranks after any other error:
    when one rank dies (OOM, an assertion), the others time out waiting for it, so the timeout
    is usually the echo and the other error the cause. Then the later hit first, because the
    error that stopped the run is at the end of the log.
    """
    is_echo = m.entry.family == "timeout"
    return (SEVERITIES.index(m.entry.severity), is_echo, -m.offset, m.entry.id)


def match_entries(text: str, entries: Iterable["Entry"]) -> list[Match]:
    """The entries whose patterns occur in ``text``, best first (see ``rank_key``)."""
    lowered = text.lower()
    found = [m for entry in entries if (m := _match_entry(entry, text, lowered)) is not None]
    return sorted(found, key=rank_key)
