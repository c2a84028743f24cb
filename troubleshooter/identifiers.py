"""Repairing identifiers a paste mangled: underscores turned into spaces, a path split at a space.

Why a vocabulary: a rendered page or a chat client turns ``ds_numel`` into ``ds numel`` and
``partition_parameters.py`` into ``partition parameters.py``; which spaces were underscores cannot
be told from the text alone, so only identifiers the caller knows (``explain`` passes those its
knowledge base's patterns and symptoms name) get their underscores back. File names of frames
(``File "..."``) and warnings (``path.py:83:``) are the exception: a Python file name holds no
spaces, so spaces there are underscores. Used by :func:`troubleshooter.normalize.normalize`.
"""

from __future__ import annotations

import bisect
import re
from typing import Iterable

__all__ = ["REPAIR_CHARS", "identifier_vocabulary", "line_starts", "repair_identifiers"]

#: One line of work: the input's line number (1-based) it came from, and its text now.
_Line = tuple[int, str]
#: The file name of a path with spaces where underscores were (``zero/partition parameters.py``).
_SPACED_FILE = re.compile(r"(?<=[/\\])[\w-]+(?: +[\w-]+)+(?=\.py\b)")
_PATH_SPLIT = re.compile(r"(?<=[\w.-][/\\]) +(?=[\w.-]+(?: [\w.-]+){0,3}(?:[/\\]|\.py\b))|(?<=\w) +(?=\.py\b)")
#: Identifiers are repaired in this many characters at the end of the text (see _Repairer).
REPAIR_CHARS = 64 * 1024


def line_starts(text: str) -> list[int]:
    """The offset where each line of ``text`` starts."""
    starts = [0]
    find = text.find
    i = find("\n")
    while i != -1:
        starts.append(i + 1)
        i = find("\n", i + 1)
    return starts


_IDENT = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+(?:\.py)?")
_REGEX_ESCAPE = re.compile(r"\\[A-Za-z]")
#: First words too common in prose to start an identifier repair (``not found`` is no ``not_found``).
_COMMON = frozenset({"all", "not", "one", "set", "get", "file", "log", "bad", "ran", "base", "index", "load",
                     "save", "model", "module", "default", "failed", "active", "extra", "inline", "plan", "min",
                     "num", "the", "and", "for", "use", "has", "can", "per", "new", "old", "max"})


def identifier_vocabulary(sources: Iterable[str]) -> frozenset[str]:
    """The identifiers with underscores that ``sources`` (patterns, symptoms) contain; a regex
    escape (``partition_parameters\\.py``) is read as the character it escapes."""
    words: set[str] = set()
    for source in sources:
        plain = _REGEX_ESCAPE.sub(" ", source.replace("\\.", "."))
        words.update(w for w in _IDENT.findall(plain)
                     if len(w) >= 6 and (len(w.split("_")[0]) >= 3 or w.startswith("ds_"))
                     and w.split("_")[0].lower() not in _COMMON)
    return frozenset(words)


class _Repairer:
    """Puts underscores back into known identifiers: ``ds numel`` -> ``ds_numel``. Only in the
    identifier's own case: ``DeepSpeed config`` in a sentence is no ``deepspeed_config``."""

    def __init__(self, vocabulary: Iterable[str]) -> None:
        by_first: dict[str, list[tuple[re.Pattern[str], str]]] = {}
        for word in sorted(vocabulary, key=len, reverse=True):
            parts = word.split("_")
            if len(parts) < 2 or not all(parts):
                continue
            spaced = r"[ _]{1,2}".join(re.escape(p) for p in parts)
            by_first.setdefault(parts[0].lower(), []).append(
                (re.compile(spaced + r"(?![\w])"), word))  # in its own case: "DeepSpeed config" is prose
        self.by_first = by_first
        self.token = re.compile(r"(?<![\w])[A-Za-z][A-Za-z0-9]*")
        firsts = "|".join(re.escape(f) for f in sorted(by_first, key=len, reverse=True))
        #: a first part followed by a space: the only places a repair can happen
        self.candidate = re.compile(r"(?<![\w])(?:" + firsts + r") ", re.I) if by_first else None

    def lines_to_repair(self, text: str) -> set[int]:
        """The 0-based numbers of the lines of ``text`` where a repair may happen, in its last
        REPAIR_CHARS (a paste is short; a log of megabytes was written by programs, not mangled)."""
        if self.candidate is None:
            return set()
        starts = line_starts(text)
        return {bisect.bisect_right(starts, m.start()) - 1
                for m in self.candidate.finditer(text, max(0, len(text) - REPAIR_CHARS))}

    def repair(self, line: str) -> str:
        if not self.by_first or (" " not in line):
            return line
        pieces: list[str] = []
        at = 0
        for tok in self.token.finditer(line):
            if tok.start() < at:
                continue
            candidates = self.by_first.get(tok.group().lower())
            if candidates is None:
                continue
            for pattern, word in candidates:
                hit = pattern.match(line, tok.start())
                if hit and " " in hit.group():
                    pieces += [line[at:tok.start()], word]
                    at = hit.end()
                    break
        return "".join(pieces) + line[at:] if pieces else line


def repair_identifiers(lines: list[_Line], vocabulary: Iterable[str] = ()) -> list[_Line]:
    """Known identifiers get their underscores back; a path split at a space is rejoined."""
    repairer = _Repairer(vocabulary)
    todo = repairer.lines_to_repair("\n".join(line for _, line in lines))
    out = []
    for i, (no, line) in enumerate(lines):
        if i in todo:
            line = repairer.repair(line)
        if "/ " in line or "\\ " in line or " .py" in line:
            line = _PATH_SPLIT.sub("", line)
        if ".py" in line and ('File "' in line or ".py:" in line):  # a frame's or a warning's file name
            line = _SPACED_FILE.sub(lambda m: re.sub(r" +", "_", m.group()), line)
        out.append((no, line))
    return out
