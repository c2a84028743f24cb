"""The knowledge base, as the troubleshooter sees it: ``lightning_zeromoe.knowledge`` plus ``match``.

The entries (``lightning_zeromoe/knowledge/entries/<id>.toml``), their model, the loader and the
citation API live in :mod:`lightning_zeromoe.knowledge`, so that the training library renders its
own errors from them without importing the troubleshooter; see that module for the entry schema.
This package re-exports that API under the names every ``from troubleshooter import knowledge``
caller uses, and adds :func:`match` (log text -> entries, :mod:`troubleshooter.knowledge.matching`).
Importing it loads no torch, DeepSpeed or Lightning.
"""

from __future__ import annotations

from lightning_zeromoe.knowledge import (
    CONTEXT_CHARS,
    ENTRIES_DIR,
    FAMILIES,
    PATCH_KINDS,
    SEVERITIES,
    Entry,
    Fix,
    KnowledgeError,
    Message,
    anchor_of,
    compose,
    entry_of,
    fix,
    get,
    load_entries,
    load_entry,
    message,
    prefixed,
    say,
)
from troubleshooter.knowledge.matching import SNIPPET_CHARS, TAIL_CHARS, Match, match_entries

__all__ = [
    "CONTEXT_CHARS",
    "ENTRIES_DIR",
    "FAMILIES",
    "PATCH_KINDS",
    "SEVERITIES",
    "SNIPPET_CHARS",
    "TAIL_CHARS",
    "Entry",
    "Fix",
    "KnowledgeError",
    "Match",
    "Message",
    "anchor_of",
    "compose",
    "entry_of",
    "fix",
    "get",
    "load_entries",
    "load_entry",
    "match",
    "message",
    "prefixed",
    "say",
]


def match(text: str) -> list[Match]:
    """The entries whose patterns occur in ``text``, best first (errors first; a collective
    timeout after any other error, since it is usually the echo; then the later hit)."""
    return match_entries(text, load_entries())
