"""The knowledge base: one TOML file per known problem, loaded and validated once.

Why data and not code: ``lightning_zeromoe``'s own errors and warnings, and the troubleshooter's
``explain``, ``lint``, ``doctor`` and Jupyter extension all cite the same entries, and a fact (a
message wording, a fix step) is corrected in one file. Entries live in
``lightning_zeromoe/knowledge/entries/<id>.toml`` (data inside the training library, so that it
never imports the troubleshooter; ``troubleshooter.knowledge`` re-exports this API and adds
``match``) and are parsed with the standard library's ``tomllib``: loading the knowledge base
imports nothing heavy (no torch, DeepSpeed or Lightning).

Entry schema (every key is required unless marked optional)::

    id = "native-moe-zero3"           # equals the file stem; lower-case words joined by "-"
    title = "One line that names the problem"
    family = "native-moe-zero3"       # one of FAMILIES below
    severity = "error"                # error | warning | info
    checked_against = "deepspeed 0.19.8 (engine.py read)"   # what was verified, and how
    symptoms = ["what the user sees", ...]                 # at least one
    patterns = ['regex', ...]         # Python regexes, matched case-insensitively and
                                      # (besides, every entry matches "[<its id>] ", the prefix of
                                      # the project's own error messages)
                                      # multi-line over log text; may be empty for entries that
                                      # only lint or doctor cite. Named groups become details.
                                      # A pattern that uses \Z ("the log ends here") is tried
                                      # on the last TAIL_CHARS characters only.
    contextual = ['regex', ...]       # optional: patterns that count only when one of `context`
    context = ['regex', ...]          # matches within context_chars characters of the hit (a
    context_chars = 50000             # message ambiguous alone, next to what makes it this
                                      # problem); context_chars is optional (default 50000).
    cause = '''why it happens'''
    patch = '''{"json": "merge patch"}'''   # optional: a DeepSpeed config patch or a code diff
    patch_kind = "json"               # json | diff; required when patch is present
    sources = ["file::function (version)", "https://..."]  # at least one

    [[fixes]]                         # at the end of the file, one table per fix, ordered:
    id = "lower-micro-batch"          # do the first one first. ``id``: a stable slug, unique in
    text = "Lower ... to {micro}."    # the entry; code cites fixes by id, never by position.
                                      # ``text`` may hold {placeholders} the caller fills in.
    skip_when = 'regex'               # optional: explain leaves the fix out when the log matches
    skip_on = ['kind:regex', ...]     # or when one of these evidence terms holds (as in [evidence]),
    skip_why = "what it cannot do"    # (required with either) and says this instead.

    [[messages]]                      # optional, after the fixes: what a tool reports when it
    id = "mismatch"                   # finds this problem (lint, doctor), as a template filled
    text = "{tbs} != {micro} * ..."   # with what was found: cite with knowledge.message(entry, id).

    [evidence]                        # optional: what explain needs besides a pattern hit, as
    requires = ['kind:regex', ...]    # terms on the facts troubleshooter/evidence.py reads from a
    excludes = ['kind:regex', ...]    # report (kinds: EVIDENCE_KINDS; "text:" searches the report).
    broad = false                     # requires: all must hold; excludes: any rules the entry out;
                                      # broad: its patterns name it only when nothing more specific
                                      # does and one of its fixes applies.
    [[evidence.claims]]               # optional: evidence that names the entry without a pattern
    why = "the evidence, in words"    # (printed by explain --why): every ``when`` term holds and
    when = ['kind:regex', ...]        # no ``unless`` term does; ``broad`` as above.
    unless = ['kind:regex', ...]
    broad = false

Citation API (the only way code outside this package may hold advice): ``fix(entry_id, fix_id)``
and ``message(entry_id, message_id)`` return a :class:`Fix` / :class:`Message` whose ``render(**values)``
fills the placeholders; both know their ``entry``. ``say(entry_id, message_id, *fix_ids, **values)``
is the text of one of the project's own errors or warnings: ``[<entry-id>] <message> <fix> ...``
(the prefix ``troubleshooter explain`` recognises; :func:`entry_of` reads it back; :func:`compose`
is the same text without the prefix, for a warning whose wording must start otherwise).
``tests/test_knowledge_citations.py`` finds every such call statically, in both packages, and
fails on an unknown entry or id, on placeholders that differ from the template's, and on advice
prose outside this package.

``load_entries()`` raises :class:`KnowledgeError` naming the file and the field for any
violation, so a broken entry fails the test suite instead of a user's session.
"""

from __future__ import annotations

import re

from lightning_zeromoe.knowledge.load import ENTRIES_DIR, anchor_of, fix, get, load_entries, load_entry, message
from lightning_zeromoe.knowledge.model import (
    CONTEXT_CHARS, FAMILIES, PATCH_KINDS, SEVERITIES, Entry, Fix, KnowledgeError, Message,
)

__all__ = [
    "CONTEXT_CHARS", "ENTRIES_DIR", "FAMILIES", "PATCH_KINDS", "SEVERITIES", "Entry", "Fix", "KnowledgeError",
    "Message", "anchor_of", "compose", "entry_of", "fix", "get", "load_entries", "load_entry", "message", "prefixed", "say",
]

_PREFIX = re.compile(r"^\[(?P<id>[a-z0-9]+(?:[.-][a-z0-9]+)*)\] ")


def prefixed(entry_id: str, text: str) -> str:
    """``[<entry-id>] <text>``: the one format of the project's own messages (``explain`` reads it)."""
    return f"[{entry_id}] {text}"


def entry_of(text: str) -> str | None:
    """The entry id a :func:`prefixed` text starts with, or None."""
    found = _PREFIX.match(text)
    return found.group("id") if found else None


def compose(entry_id: str, message_id: str, *fix_ids: str, **values: object) -> str:
    """``<message> <fix> <fix> ...``: the entry's message template ``message_id``, then each of
    ``fix_ids`` in order, each filled with the ``values`` it names, joined by single spaces.

    A template gets only the values it names (one without placeholders is used as written); a
    value it names that is not given raises KeyError. :func:`say` is this with the entry's prefix.
    """
    templates = (message(entry_id, message_id), *(fix(entry_id, f) for f in fix_ids))
    return " ".join(t.render(**{name: values[name] for name in t.placeholders()}) for t in templates)


def say(entry_id: str, message_id: str, *fix_ids: str, **values: object) -> str:
    """One of our own errors or warnings: ``[<entry-id>] <message> <fix> <fix> ...`` (:func:`compose`
    behind :func:`prefixed`). Every error and warning ``lightning_zeromoe`` raises is built this way."""
    return prefixed(entry_id, compose(entry_id, message_id, *fix_ids, **values))
