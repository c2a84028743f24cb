"""Repairing a retyped error message's misspelt words against the words the knowledge base quotes.

Why: an error copied by hand from a screenshot, or retyped in a question, carries typos
(``RuntimeError: still have inglight params``); a pattern written against the library's message
misses it, and so does every other reading of the line. Which word was meant cannot be told from the
text alone, so only words the caller knows (``explain`` passes the words of its knowledge base's
patterns and symptoms, which quote what the libraries print) are put back, and only where one is
unambiguous: a word of an error line (``Type: message``) that is no known word, but is one slip
away from exactly one known word of the same length (one letter typed for another, not the last
one, which is how ``reduces`` differs from ``reduced``; or two neighbours swapped), at least
MIN_LENGTH letters long. Used by :func:`troubleshooter.normalize.normalize`.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Callable, Iterable

__all__ = ["MIN_LENGTH", "repair_typos", "word_vocabulary"]

#: One line of work: the input's line number (1-based) it came from, and its text now.
_Line = tuple[int, str]
#: Shorter words are left alone: one slip turns too many short words into other real ones.
MIN_LENGTH = 7
_WORD = re.compile(r"[A-Za-z]{%d,}" % MIN_LENGTH)
_REGEX_ESCAPE = re.compile(r"\\[A-Za-z]")


def word_vocabulary(sources: Iterable[str]) -> frozenset[str]:
    """The words of MIN_LENGTH letters or more that ``sources`` (patterns, symptoms) contain, lower
    case; a regex escape (``\\d``) is no letter."""
    return frozenset(w.lower() for s in sources for w in _WORD.findall(_REGEX_ESCAPE.sub(" ", s)))


def _slips(word: str) -> set[str]:
    """The lower-case keys a word one slip away shares with it: each letter but the last replaced
    by a wildcard, and each pair of neighbours swapped."""
    w = word.lower()
    keys = {w[:i] + "?" + w[i + 1:] for i in range(len(w) - 1)}
    keys |= {w[:i] + w[i + 1] + w[i] + w[i + 2:] for i in range(len(w) - 1) if w[i] != w[i + 1]}
    return keys


class _Index:
    """The known words by their slip keys."""

    def __init__(self, vocabulary: frozenset[str]) -> None:
        self.words = vocabulary
        self.by_key: dict[str, set[str]] = {}
        for word in vocabulary:
            for key in _slips(word) | {word}:
                self.by_key.setdefault(key, set()).add(word)

    def meant(self, word: str) -> str | None:
        """The one known word ``word`` is a slip of, in its case, or None."""
        lowered = word.lower()
        if lowered in self.words:
            return None
        found = {w for key in _slips(word) for w in self.by_key.get(key, ()) if len(w) == len(word)}
        if len(found) != 1:
            return None
        (known,) = found
        return known.upper() if word.isupper() else known


@lru_cache(maxsize=4)
def _index(vocabulary: frozenset[str]) -> _Index:
    return _Index(vocabulary)


def repair_typos(lines: list[_Line], vocabulary: frozenset[str], is_error_line: Callable[[str], bool]) -> list[_Line]:
    """Each error line (``is_error_line``) gets its misspelt known words back."""
    if not vocabulary:
        return lines
    out = []
    for no, line in lines:
        if is_error_line(line):
            index = _index(vocabulary)
            line = _WORD.sub(lambda m: index.meant(m.group()) or m.group(), line)
        out.append((no, line))
    return out
