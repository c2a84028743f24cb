"""Facts a log states besides its errors: the environment it ran with, and C++ aborts.

Why: advice must not repeat what the log shows was already done. A fix that sets an environment
variable (``DS_SKIP_CUDA_CHECK=1``, ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) is
pointless when the log itself shows that variable set to that value; :func:`env_setting` finds
the last place the log sets a variable. Only real settings count: a shell line (``export X=1``,
``X=1 python train.py``, ``+ export X=1`` from ``bash -x``, ``env`` / ``printenv`` output), Python
(``os.environ["X"] = "1"``), a dumped environment (``'X': '1'``), YAML (``X: "1"``) and DeepSpeed's
own ``Detected `X=1```; a hint in a message ("try setting X=1") does not.

A rank that aborts in C++ (``terminate called after throwing an instance of '...'``) leaves no
Python traceback; :func:`first_abort` finds it, so explain can name it as the first error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["ALIASES", "Abort", "EnvSetting", "env_setting", "fix_assignments", "first_abort", "same_value"]

#: NAME=value in a fix text (the assignment the fix proposes).
_FIX_ASSIGN = re.compile(r"\b([A-Z][A-Z0-9_]{2,})=([^\s,;)'\"`]+)")
#: A shell prompt or trace prefix before a command: "$ ", "user@host:~# ", "+ ", ">>> ", "!".
_PROMPT = r"(?:[^\n]{0,80}?[$#>%]\s+|\+{1,3}\s+|!|\[rank\d+\]:\s*)?"
_KEYWORD = r"(?:(?:export|set|setenv|declare\s+-x|ENV|%env|env|sudo(?:\s+-E)?)\s+)?"
#: Variables read under another name too (torch 2.13 reads PYTORCH_CUDA_ALLOC_CONF as well as
#: PYTORCH_ALLOC_CONF; c10d reads the NCCL_ names of its TORCH_NCCL_ knobs).
ALIASES = {"PYTORCH_ALLOC_CONF": ("PYTORCH_CUDA_ALLOC_CONF",),
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("NCCL_ASYNC_ERROR_HANDLING",),
           "TORCH_NCCL_BLOCKING_WAIT": ("NCCL_BLOCKING_WAIT",)}


@dataclass(frozen=True)
class EnvSetting:
    """The last place a log sets an environment variable (value None: it was unset there)."""

    name: str
    value: str | None
    offset: int


@dataclass(frozen=True)
class Abort:
    """A C++ abort: what was thrown (and its what() line, when printed)."""

    offset: int
    thrown: str
    what: str


def _setting_patterns(name: str) -> list[re.Pattern[str]]:
    n = re.escape(name)
    value = r"""(?P<q>['"]?)(?P<value>[^\s'"`;&|()<>]*)(?P=q)"""
    return [
        # shell / env dump: at the start of a command, possibly after other assignments
        re.compile(r"^\s*" + _PROMPT + _KEYWORD + r"(?:[A-Za-z_]\w*=\S*\s+)*" + n + r"=" + value, re.M),
        re.compile(r"""os\.environ\[\s*['"]""" + n + r"""['"]\s*\]\s*=\s*""" + value),
        re.compile(r"""os\.environ\.setdefault\(\s*['"]""" + n + r"""['"]\s*,\s*""" + value),
        re.compile(r"""['"]""" + n + r"""['"]\s*:\s*""" + value),
        re.compile(r"^\s*-?\s*" + n + r"\s*:\s*" + value, re.M),
        re.compile(r"^\s*" + _PROMPT + r"setenv\s+" + n + r"\s+" + value, re.M),
        re.compile(r"Detected\s+`" + n + r"=(?P<q>)(?P<value>[^`\s]*)`"),
    ]


def env_setting(text: str, name: str) -> EnvSetting | None:
    """Where the log last sets (or unsets) ``name`` or one of its ALIASES, or None."""
    events: list[tuple[int, str, str | None]] = []
    for alias in (name, *ALIASES.get(name, ())):
        if alias not in text:
            continue
        for pattern in _setting_patterns(alias):  # an empty value is a report's "(not set)"
            events += [(hit.start(), alias, hit.group("value")) for hit in pattern.finditer(text)
                       if hit.group("value")]
        unset = re.compile(r"^\s*" + _PROMPT + r"unset\s+(?:\w+\s+)*" + re.escape(alias) + r"\b", re.M)
        events += [(hit.start(), alias, None) for hit in unset.finditer(text)]
    if not events:
        return None
    offset, alias, value = max(events, key=lambda e: e[0])
    return EnvSetting(alias, value, offset)


def same_value(wanted: str, found: str) -> bool:
    """Whether a setting ``found`` in the log already holds ``wanted``: equal (ignoring case), or,
    for comma-separated options (``expandable_segments:True,max_split_size_mb:128``), a superset."""
    want = {p.strip().lower() for p in wanted.split(",") if p.strip()}
    have = {p.strip().lower() for p in found.split(",") if p.strip()}
    return bool(want) and want <= have


def fix_assignments(fix_text: str) -> list[tuple[str, str]]:
    """The (NAME, value) assignments a fix text proposes."""
    return [(name, value.rstrip(".")) for name, value in _FIX_ASSIGN.findall(fix_text)]


_ABORT = re.compile(r"terminate called after throwing an instance of '(?P<thrown>[^'\n]+)'"
                    r"(?:[^\n]*\n\s*(?:\[rank\d+\]:\s*)?what\(\):\s*(?P<what>[^\n]*))?")


#: A what() that is itself the echo of another rank's failure (its peer went away, a timeout).
_ECHO_WHAT = re.compile(r"by peer|remote process exited|timed? ?out|Connection refused|Broken pipe", re.IGNORECASE)


def first_abort(text: str, before: int | None = None) -> Abort | None:
    """The first C++ abort in the log (before offset ``before`` when given) that is not itself
    an echo (an abort whose what() says the peer went away or a collective timed out)."""
    for hit in _ABORT.finditer(text, 0, len(text) if before is None else before):
        what = (hit.group("what") or "").strip()
        if not _ECHO_WHAT.search(what):
            return Abort(hit.start(), hit.group("thrown"), what)
    return None
