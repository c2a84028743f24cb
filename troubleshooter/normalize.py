"""Normalising a pasted report before it is matched: undo what the paste did to the text.

Why: people paste errors the way their tools and forums leave them. A traceback comes inside a
Markdown code fence or quote, bullets and backticks around the exception; each line carries a
rank, host or timestamp prefix (``[rank1]:``, ``0:``, ``node-3:``, ``[2024-05-01 10:00:00,123]``);
two ranks' tracebacks arrive interleaved line by line; a long message is wrapped onto two lines;
a rendered page turns underscores into spaces, straight quotes into curly ones and splits a file
path at a space; and the error itself may be quoted inside prose in any language. The knowledge
base's patterns are written against what the libraries print, so the same problem pasted this way
is missed. :func:`normalize` undoes each of these, one step each, and keeps a map from every
normalised line back to the line of the input it came from, so what is quoted back to the user
is always the original text.

The steps, in order (each is a function of its own, tested alone in ``tests/test_normalize.py``):

1. characters: curly quotes to straight, full-width punctuation (``：（），``) to ASCII, no-break
   and zero-width spaces, HTML entities (``&gt;``, ``&#39;``);
1b. a terminal's hard wrap: lines all cut at one width are joined back (:func:`unwrap_hard_wrapped`);
2. Markdown blocks: code fences dropped, block quotes (``> ``) and bullets (``- ``, ``* ``, ``1.``)
   stripped;
3. prefixes: a timestamp a log collector put first, a host name shared by many lines
   (``node-3: ``, its indentation kept), bracketed fields a job runner put before each line
   (``[177/train/578 (pid 28936)] [09c561ee-...]``), then ``[rankN]:``, ``[defaultN]:``, ``N:``, with two ranks'
   lines de-interleaved (each rank's lines together, in their order); then timestamps again (the
   library's own, after the rank prefix);
3b. progress bars: what was printed after a tqdm bar on its line (``...it/s]Killed``) gets a line
   of its own;
3c. notebook tracebacks: IPython's and Jupyter's frames (``File ~/x.py:12, in f(...)``, ``Cell
   In[4], line 7``) get Python's own form;
3d. rich tracebacks: the box rich draws goes, and its frames (``/x/m.py:12 in f``) get Python's form;
4. error lines inside prose: ``... `RuntimeError: x` ...`` gets a line of its own starting with
   the exception (in whatever language the prose is), then inline Markdown (backticks, ``**``)
   is removed;
5. identifiers: a known identifier with spaces for underscores (``ds numel``,
   ``partition parameters.py``) gets its underscores back; a path split at a space is rejoined
   (:mod:`troubleshooter.identifiers`);
5b. typos: a misspelt word of an error line, one slip from exactly one known word, gets it back
   (``still have inglight params``; :mod:`troubleshooter.typos`);
6. wrapped messages: the continuation lines of an error line are appended to it;
7. two or three spaces inside a line (after its indentation) become one: a path or word a paste
   (or a redaction) left two spaces before is still matched by a pattern written with one (wider
   runs align columns and stay; a paste only, not a log of megabytes);
8. a line printed twice in a row (two ranks printing the same line) is kept once.

Normalising never removes information a pattern needs: ``explain`` matches the input as it is
*and* its normalised form (:mod:`troubleshooter.decide`).
"""

from __future__ import annotations

import bisect
import html
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

from troubleshooter.identifiers import REPAIR_CHARS, identifier_vocabulary, line_starts, repair_identifiers
from troubleshooter.typos import repair_typos

__all__ = ["ERROR_LINE", "WINDOW_CHARS", "Normalized", "identifier_vocabulary", "normalize"]

#: One line of work: the input's line number (1-based) it came from, and its text now.
_Line = tuple[int, str]

_CHAR_MAP = str.maketrans({
    "\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "\u2032": "'",
    "\u201c": '"', "\u201d": '"', "\u201e": '"', "\u201f": '"', "\u2033": '"', "\u00ab": '"', "\u00bb": '"',
    "\uff1a": ":", "\uff08": "(", "\uff09": ")", "\uff0c": ", ", "\uff1b": ";", "\uff3b": "[", "\uff3d": "]",
    "\u3001": ", ", "\u3002": ". ", "\u00a0": " ", "\u2007": " ", "\u202f": " ", "\u3000": " ",
    "\u200b": None, "\u200c": None, "\u200d": None, "\ufeff": None, "\u2013": "-", "\u2014": "-",
    "\u2212": "-",
})
_ENTITY = re.compile(r"&(?:[a-zA-Z]{2,8}|#\d{1,6}|#x[0-9a-fA-F]{1,5});")
_FENCE = re.compile(r"^\s{0,3}(?:`{3,}|~{3,})[\w+.-]*\s*$")
_QUOTE = re.compile(r"^\s{0,3}(?:>\s?)+")
_BULLET = re.compile(r"^\s{0,6}(?:[-*+\u2022]|\d{1,2}[.)])\s+(?=\S)")
_BULLET_FIRST = frozenset("-*+\u20220123456789")
_HTML_TAG = re.compile(r"</?(?:details|summary|pre|code|br|p|b|i|em|strong|kbd|sub|sup)\b[^>\n]{0,80}>", re.I)
#: Rank prefixes torch, torchrun, srun -l and the DeepSpeed launcher put before a line.
_RANK = re.compile(r"^\s*(?:\[(?:rank|default)(?P<a>\d{1,4})\]:|(?P<b>\d{1,4}): |\[RANK (?P<c>\d{1,4})\] )")
_HOST = re.compile(r"^(?P<host>[A-Za-z][\w.-]{1,62}): (?=\S| +\S)")  # a traceback keeps its indent
_TIMESTAMP = re.compile(
    r"^\s*\[?(?:\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?"
    r"|\d{2}:\d{2}:\d{2}(?:[.,]\d+)?|[A-Z][a-z]{2} +\d{1,2} \d{2}:\d{2}:\d{2})\]?(?: *\|)?[ \t]")
_STAMP_FIRST = frozenset("[0123456789ADFJMNOS")  # a digit, '[' or a month's initial
#: An exception name: dotted, ending in Error/Exception/..., or one of the bare ones.
_EXC_NAME = (r"(?:[A-Za-z_][\w]*\.)*(?:[A-Z]\w*(?:Error|Exception|Failure|Interrupt)"
             r"|AssertionError|KeyboardInterrupt|StopIteration)")
#: A line that is an error line: the exception (after any prefix left) and its message.
ERROR_LINE = re.compile(r"^\W{0,4}(?P<type>" + _EXC_NAME + r")(?::[ \t]*(?P<message>[^\n]*))?$")
#: An exception named inside prose. Not after a letter, digit or dot of a longer name; Chinese or
#: Japanese text runs into it without a space (``报错RuntimeError: ...``), and counts as no letter here.
_IN_PROSE = re.compile(r"(?<![A-Za-z0-9_.])(?P<type>" + _EXC_NAME + r")(?P<rest>(?::|(?= *$))[^\n]*)")
_BACKTICKED = re.compile(r"`{1,3}([^`\n]+)`{1,3}")
#: ``**bold**`` (``__bold__`` is left alone: it is also Python's ``__init__``).
_EMPHASIS = re.compile(r"(\*\*)(?=\S)([^\n]+?)(?<=\S)\1")
#: A line that starts something new: not the continuation of a wrapped message.
_STRUCTURAL = re.compile(
    r"^\s*(?:Traceback \(|File \"|During handling|The above exception|\[|\d{4}-\d{2}-\d{2}|"
    r"[A-Z]\w*(?:Error|Exception|Warning)\b|(?:ERROR|WARNING|WARN|INFO|DEBUG|CRITICAL)\b|[$#>]|\w+ = |\w+: )")
#: A paste is short and a log's error is at its end: only the lines of this many characters at the
#: end of a text are normalised (explain matches the text as it is in full besides).
WINDOW_CHARS = 256 * 1024
_WRAP_MIN = 50  # a line shorter than this that does not end a sentence is not a wrapped one
_WRAP_LINES = 3  # at most this many continuation lines are appended


@dataclass(frozen=True)
class Normalized:
    """A report after :func:`normalize`: the text to match, and the way back to the input.

    ``lines[i]`` is the input's line number (1-based) that normalised line ``i + 1`` came from;
    ``steps`` names the steps that changed something (for ``explain --why``).
    """

    text: str
    original: str
    lines: tuple[int, ...]
    steps: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        """Whether normalising changed the text at all."""
        return self.text != self.original

    def input_line(self, line_no: int) -> int:
        """The input's line number (1-based) of normalised line ``line_no`` (1-based)."""
        if not self.lines:
            return 1
        return self.lines[min(max(line_no, 1), len(self.lines)) - 1]

    @cached_property
    def _starts(self) -> list[int]:
        return line_starts(self.text)

    @cached_property
    def _input_starts(self) -> list[int]:
        return line_starts(self.original)

    def line_of_offset(self, offset: int) -> int:
        """The input's line number of a character offset into the normalised text."""
        return self.input_line(bisect.bisect_right(self._starts, offset))

    def input_offset(self, offset: int) -> int:
        """The offset in the input of the start of the line a normalised offset falls on."""
        return self.offset_of_line(self.line_of_offset(offset))

    def offset_of_line(self, line_no: int) -> int:
        """The offset in the input where its line ``line_no`` (1-based) starts."""
        starts = self._input_starts
        return starts[min(max(line_no, 1), len(starts)) - 1]

    def quote(self, line_no: int) -> str:
        """The input's own text of its line ``line_no`` (to quote back to the user)."""
        starts = self._input_starts
        i = min(max(line_no, 1), len(starts)) - 1
        end = self.original.find("\n", starts[i])
        return self.original[starts[i]:end if end != -1 else len(self.original)].strip()


# -- 1. characters -----------------------------------------------------------------------------


def fix_characters(lines: list[_Line]) -> list[_Line]:
    """Curly quotes, full-width punctuation, odd spaces and HTML entities to their plain forms."""
    out = []
    for no, line in lines:
        if not line.isascii():
            line = line.translate(_CHAR_MAP)
        if "&" in line:
            line = _ENTITY.sub(lambda m: html.unescape(m.group()), line)
        out.append((no, line))
    return out


# -- 1b. a terminal's hard wrap ---------------------------------------------------------------

_WRAP_WIDTH_MIN = 60  # narrower than this is no terminal
_HARD_WRAPPED_LINES = 3  # this many lines cut at exactly one width make a hard wrap
_PROGRESS = re.compile(r"\d%\||it/s|s/it")
#: The first character of a row of a box rich draws (its rows share one width, and are no hard wrap).
_BOX_EDGES = frozenset("\u2502\u256d\u2570")
#: A line that starts a new record, whatever came before it: never the rest of a cut line.
_NEW_LINE = re.compile(r'^\s*(?:Traceback \(|File "|During handling|The above exception|\[?\d{4}-\d{2}-\d{2}'
                       r"|\[(?:rank|default)?\d+\]|[A-Z]\w*(?:Error|Exception): )")


def _hard_wrap_width(lines: list[_Line]) -> int | None:
    """The width a terminal or a mail client cut every long line at: the longest line's length,
    shared by at least three lines, two of them different (not rules of one repeated character, not progress
    bars, which a terminal also sizes to its width, nor the rows of a box rich draws)."""
    lengths = [len(line) for _, line in lines]
    width = max(lengths, default=0)
    if width < _WRAP_WIDTH_MIN:
        return None
    at_width = [line for _, line in lines if len(line) == width and len(set(line.strip())) > 2
                and not _PROGRESS.search(line) and line.lstrip()[:1] not in _BOX_EDGES]
    return width if len(at_width) >= _HARD_WRAPPED_LINES and len(set(at_width)) > 1 else None


def unwrap_hard_wrapped(lines: list[_Line]) -> list[_Line]:
    """A text whose long lines were all cut at one width (copied from a terminal, a mail) gets
    each cut line joined to the next one, without a space: the cut fell inside a word as often as
    not. A next line that starts something new (a frame, a timestamp, a prefix) is not joined."""
    width = _hard_wrap_width(lines)
    if width is None:
        return lines
    out: list[_Line] = []
    joining = False
    for no, line in lines:
        if joining and line.strip() and not _NEW_LINE.match(line) and not _RANK.match(line):
            out[-1] = (out[-1][0], out[-1][1] + line)
        else:
            out.append((no, line))
        joining = len(line) == width and len(out[-1][1]) < 8 * width
    return out


# -- 2. Markdown blocks ------------------------------------------------------------------------


def undo_markdown_blocks(lines: list[_Line]) -> list[_Line]:
    """Drop code fences and HTML wrappers; strip block quotes and bullets."""
    out = []
    for no, line in lines:
        first = line.lstrip()[:1]
        if first == ">":
            line = _QUOTE.sub("", line, count=1)
            first = line.lstrip()[:1]
        if first in ("`", "~") and _FENCE.match(line):
            continue
        line = _HTML_TAG.sub("", line) if "<" in line else line
        if first in _BULLET_FIRST:
            line = _BULLET.sub("", line, count=1)
        out.append((no, line))
    return out


# -- 3. prefixes -------------------------------------------------------------------------------


def _rank_of(line: str) -> tuple[str | None, int]:
    hit = _RANK.match(line)
    if hit is None:
        return None, 0
    return hit.group("a") or hit.group("b") or hit.group("c"), hit.end()


def strip_rank_prefixes(lines: list[_Line]) -> list[_Line]:
    """Strip rank prefixes; where two or more ranks' lines alternate, put each rank's together.

    A run of consecutive prefixed lines (blank lines inside it included) is reordered stably by
    rank, in the order the ranks first appear: rank 0's traceback, then rank 1's. A bare ``N: ``
    prefix counts only when it is on at least three lines (a single ``1: `` is a list item).
    """
    ranks = [_rank_of(line) for _, line in lines]
    bare = sum(1 for (_, line), (r, _e) in zip(lines, ranks) if r is not None and not line.lstrip().startswith("["))
    if bare < 3:
        ranks = [(r, e) if r is not None and lines[i][1].lstrip().startswith("[") else (None, 0)
                 for i, (r, e) in enumerate(ranks)]
    out: list[_Line] = []
    run: list[tuple[str, _Line]] = []

    def flush() -> None:
        order = list(dict.fromkeys(rank for rank, _ in run))
        out.extend(item for rank in order for r, item in run if r == rank)
        run.clear()

    for (no, line), (rank, end) in zip(lines, ranks):
        if rank is None:
            if not line.strip() and run:
                continue  # a blank line inside interleaved output belongs to no rank
            flush()
            out.append((no, line))
        else:
            run.append((rank, (no, line[end + 1:] if line[end:end + 1] == " " else line[end:])))
    flush()
    return out


_NOT_HOST = re.compile(r"\w*(?:Error|Exception|Warning)|File|Note|(?:INFO|WARN(?:ING)?|ERROR|DEBUG|CRITICAL|NOTE)",
                       re.I)


def strip_host_prefixes(lines: list[_Line]) -> list[_Line]:
    """Strip a ``host: `` prefix that starts at least three lines and a third of them (pdsh,
    the DeepSpeed launcher); a word before a colon on a line or two is prose, not a host."""
    counts: dict[str, int] = {}
    for _, line in lines:
        hit = _HOST.match(line)
        if hit:
            counts[hit.group("host")] = counts.get(hit.group("host"), 0) + 1
    nonblank = sum(1 for _, line in lines if line.strip()) or 1
    hosts = {h for h, n in counts.items()
             if n >= 3 and n * 3 >= nonblank and not _NOT_HOST.fullmatch(h)}
    if not hosts:
        return lines
    return [(no, line[len(hit.group()):] if (hit := _HOST.match(line)) and hit.group("host") in hosts else line)
            for no, line in lines]


#: Bracketed fields a log collector puts before every line of a job's output (Metaflow's
#: ``[177/train/578 (pid 28936)] [09c561ee-...]``), after its timestamp.
_BRACKETS = re.compile(r"^(?:\[[^\]\n]{1,80}\] ?){1,4}")
#: Not a collector's prefix: a library's own fields (DeepSpeed's ``[INFO] [engine.py:86:...]``, ranks).
_LIBRARY_FIELD = re.compile(r"\[(?:INFO|WARN(?:ING)?|ERROR|DEBUG|CRITICAL|[EWI]\d{4}\b|rank|default|\d+\])", re.I)


def strip_shared_brackets(lines: list[_Line]) -> list[_Line]:
    """Strip the same bracketed prefix from every line that starts with it, when at least three lines and
    a third of them do: what a job runner put before each line of the output it collected."""
    counts: dict[str, int] = {}
    for _, line in lines:
        hit = _BRACKETS.match(line)
        if hit:
            counts[hit.group()] = counts.get(hit.group(), 0) + 1
    nonblank = sum(1 for _, line in lines if line.strip()) or 1
    shared = {p for p, n in counts.items() if n >= 3 and n * 3 >= nonblank and not _LIBRARY_FIELD.search(p)}
    if not shared:
        return lines
    return [(no, line[len(hit.group()):] if (hit := _BRACKETS.match(line)) and hit.group() in shared else line)
            for no, line in lines]


def strip_timestamps(lines: list[_Line]) -> list[_Line]:
    """Strip a leading timestamp (ISO, ``HH:MM:SS``, syslog ``May  1 10:00:00``)."""
    return [(no, _TIMESTAMP.sub("", line, count=1) if line.lstrip()[:1] in _STAMP_FIRST else line)
            for no, line in lines]


# -- 3b. progress bars -------------------------------------------------------------------------

#: A tqdm bar: ``38%|██▊     | 3/8 [00:02<00:03,  1.28it/s]`` (its closing ``]`` ends it).
_PROGRESS_BAR = re.compile(r"\d{1,3}%\|[^|\n]{0,300}\|\s*[\d.]+[kMG]?/[\d.?]+[kMG]?\s*\[[^\]\n]{0,120}\]")


def split_progress_bars(lines: list[_Line]) -> list[_Line]:
    """What a program printed after a progress bar goes on a line of its own: tqdm redraws its bar
    with a carriage return and no newline, so the next output (the shell's ``Killed``, a
    ``Traceback``, a warning) is pasted on the bar's line: ``... 3/8 [00:02<00:03, 1.28it/s]Killed``."""
    out: list[_Line] = []
    for no, line in lines:
        if "%|" not in line:
            out.append((no, line))
            continue
        at = 0
        for bar in _PROGRESS_BAR.finditer(line):
            if line[bar.end():].strip():
                out.append((no, line[at:bar.end()]))
                at = bar.end()
        out.append((no, line[at:]))
    return out


# -- 3c. notebook tracebacks ------------------------------------------------------------------

#: A frame as IPython 8 prints it: ``File ~/x/module.py:1747, in Module._call_impl(self, ...)``,
#: in Jupyter with the location as a link: ``File [~/x/m.py:813](http://...), in Embedding.forward(...)``.
_IPYTHON_FRAME = re.compile(r"^(?P<indent>\s*)File \[?(?P<path>[^\s\[\]()\"]+?\.py):(?P<line>\d+)\]?(?:\([^)\s]*\))?,"
                            r" in (?P<func>[\w.<>]+)")
#: The notebook cell a traceback starts in (IPython 8): ``Cell In[4], line 7``.
_IPYTHON_CELL = re.compile(r"^(?P<indent>\s*)Cell (?P<cell>In ?\[\d*\]), line (?P<line>\d+)")
#: A frame as IPython 7 and older print it, with the frame's line on a later ``---> 1673`` row:
#: ``~/.local/lib/python3.6/site-packages/torch/utils/cpp_extension.py in _run_ninja_build(build_directory, ...)``,
#: ``<ipython-input-2-0e47f5b4e6b6> in <module>``.
_IPYTHON7_FRAME = re.compile(r"^(?P<indent>\s*)(?P<path>(?:[~/]|[A-Za-z]:[\\/])\S*\.py|<ipython-input-[\w-]+>)"
                             r" in (?P<func>[\w.<>]+)(?:\(|\s*$)")
#: The row of such a frame that marks its line: ``-> 1673`` / ``---> 438``.
_IPYTHON7_ARROW = re.compile(r"^\s*-+> ?(?P<line>\d+)\b")
#: How many rows after an IPython 7 frame its arrow row may come.
IPYTHON7_ROWS = 12


def _py_frame(path: str, line: str, func: str, indent: str = "  ") -> str:
    """A frame line in Python's own form; a qualified name (``Module._call_impl``) is cut to the
    function's own name, as Python prints it."""
    return f'{indent}File "{path}", line {line}, in {func if func.startswith("<") else func.rsplit(".", 1)[-1]}'


def python_frames_from_notebooks(lines: list[_Line]) -> list[_Line]:
    """Frames of a traceback copied from Jupyter or IPython get Python's own form, so they are read
    as frames: ``File ~/x/module.py:1747, in Module._call_impl(self)`` becomes ``File
    "~/x/module.py", line 1747, in _call_impl``; the cell it starts in (``Cell In[4], line 7``)
    becomes the ``<module>`` frame it is. IPython 7's frames (``~/x/cpp_extension.py in
    _run_ninja_build(build_directory, ...)``, the line on a later ``---> 1673`` row; ``<ipython-input-2-0e4>
    in <module>``) get the same form."""
    out = []
    for i, (no, line) in enumerate(lines):
        stripped = line.lstrip()
        if stripped.startswith("File ") and ".py:" in line and (hit := _IPYTHON_FRAME.match(line)):
            line = _py_frame(hit.group("path"), hit.group("line"), hit.group("func"), hit.group("indent"))
        elif stripped.startswith("Cell In") and (hit := _IPYTHON_CELL.match(line)):
            line = _py_frame(f"<cell {hit.group('cell')}>", hit.group("line"), "<module>", hit.group("indent"))
        elif " in " in line and (hit := _IPYTHON7_FRAME.match(line)):
            line = _py_frame(hit.group("path"), _arrow_line(lines, i), hit.group("func"), hit.group("indent") or "  ")
        out.append((no, line))
    return out


def _arrow_line(lines: list[_Line], at: int) -> str:
    """The line number an IPython 7 frame marks with its arrow row (``---> 1673``), "0" if none."""
    for _no, row in lines[at + 1:at + 1 + IPYTHON7_ROWS]:
        if (hit := _IPYTHON7_ARROW.match(row)) is not None:
            return hit.group("line")
        if _IPYTHON7_FRAME.match(row):
            break
    return "0"


# -- 3d. rich tracebacks -----------------------------------------------------------------------

#: A line inside a box rich draws around a traceback: ``│ <content> │``.
_RICH_ROW = re.compile(r"^\s*\u2502 ?(?P<content>.*?)\s*\u2502?\s*$")
#: rich's frame line: ``/x/module.py:1541 in _call_impl`` (the name may be wrapped onto the next row).
_RICH_FRAME = re.compile(r"^(?P<path>(?:[~/.]|[A-Za-z]:[\\/])\S*\.py):(?P<line>\d+) in(?: (?P<func>[\w.<>]+))?$")
#: A row that ends where rich wrapped a frame before its line number: ``/x/deepspeed/runtime/config.py:``.
_RICH_PATH_END = re.compile(r"^(?:[~/.]|[A-Za-z]:[\\/])\S*\.py:$")


def python_frames_from_rich_boxes(lines: list[_Line]) -> list[_Line]:
    """A traceback rich drew in a box (``╭── Traceback (most recent call last) ──╮``, ``│ ... │``
    rows, frames as ``/x/module.py:1541 in _call_impl``) loses its box, and its frames get
    Python's form (``File "/x/module.py", line 1541, in _call_impl``); where rich wrapped a frame
    onto the next row (before its line number, or before its function's name) the two are joined."""
    if not any("\u2502" in line for _, line in lines):
        return lines
    out: list[_Line] = []
    held: tuple[int, str] | None = None  # a row that may be the first half of a wrapped frame
    for no, line in lines:
        stripped = line.strip()
        if stripped[:1] in ("\u256d", "\u2570"):  # the box's top and bottom
            if "Traceback (most recent call last)" in stripped:
                out.append((no, "Traceback (most recent call last):"))
            continue
        row = _RICH_ROW.match(line) if stripped[:1] == "\u2502" else None
        content = row.group("content").strip() if row else None
        if held is not None:
            hno, first = held
            held = None
            if content:  # "<path>.py:" + "891 in name", or "<path>.py:891 in" + "name ..."
                rest = content if first.endswith(":") else " " + content.split(" ", 1)[0]
                joined = _RICH_FRAME.match(first + rest)
                if joined and joined.group("func"):
                    out.append((hno, _py_frame(joined.group("path"), joined.group("line"), joined.group("func"))))
                    continue
            out.append((hno, "    " + first))
        if content is None:
            out.append((no, line))
            continue
        frame = _RICH_FRAME.match(content)
        if frame and frame.group("func"):
            out.append((no, _py_frame(frame.group("path"), frame.group("line"), frame.group("func"))))
        elif frame or _RICH_PATH_END.match(content):
            held = (no, content)
        elif content:
            out.append((no, "    " + content))
    if held is not None:
        out.append((held[0], "    " + held[1]))
    return out


# -- 4. error lines in prose, inline Markdown --------------------------------------------------


def _error_in(span: str) -> str | None:
    hit = _IN_PROSE.search(span)
    if hit is None or hit.start() == len(span) - len(span.lstrip()):
        return None
    return (hit.group("type") + hit.group("rest")).strip()


def lift_errors_from_prose(lines: list[_Line]) -> list[_Line]:
    """A line that mentions an exception after other words gets the exception on a line of its
    own below it: ``我运行时报错 `RuntimeError: x` 怎么办`` -> ``RuntimeError: x``. A quoted
    (backticked or bold) span is cut where it closes; otherwise the rest of the line is taken."""
    out = []
    for no, line in lines:
        out.append((no, line))
        if "Error" not in line and "Exception" not in line and "Interrupt" not in line:
            continue
        if ERROR_LINE.match(line.strip()):
            continue
        spans = [m.group(1) for m in _BACKTICKED.finditer(line)] + [m.group(2) for m in _EMPHASIS.finditer(line)]
        lifted = [e for s in spans if (e := (s.strip() if ERROR_LINE.match(s.strip()) else _error_in(" " + s)))]
        if not lifted:
            found = _error_in(_EMPHASIS.sub(r"\2", line.replace("`", "")))
            lifted = [found] if found else []
        out += [(no, e) for e in dict.fromkeys(lifted)]
    return out


def undo_inline_markdown(lines: list[_Line]) -> list[_Line]:
    """Backticks and ``**bold**`` around words are removed (the words stay)."""
    out = []
    for no, line in lines:
        if "`" in line:
            line = _BACKTICKED.sub(r"\1", line)
        if "**" in line:
            line = _EMPHASIS.sub(r"\2", line)
        out.append((no, line))
    return out


# -- 6. wrapped messages, 7. spaces, 8. lines printed twice ---------------------------------


def _continues(prev: str, line: str) -> bool:
    stripped = line.strip()
    if not stripped or len(stripped) > 200 or _STRUCTURAL.match(line) or line.startswith("  "):
        return False
    if _IN_PROSE.search(line):  # another exception: a line of its own
        return False
    starts_low = stripped[0].islower() or stripped[0].isdigit() or stripped[0] in "([{'\"-,;"
    return starts_low or (len(prev) >= _WRAP_MIN and prev.rstrip()[-1:] not in ".!?:")


def rejoin_wrapped(lines: list[_Line]) -> list[_Line]:
    """An error line whose message goes on over the next lines (wrapped by a terminal, a mail
    client or a forum) gets them appended, up to three."""
    out: list[_Line] = []
    i = 0
    while i < len(lines):
        no, line = lines[i]
        i += 1
        if ERROR_LINE.match(line.strip()) and ":" in line:
            joined = line.rstrip()
            taken = 0
            while i < len(lines) and taken < _WRAP_LINES and _continues(joined, lines[i][1]):
                joined = joined + " " + lines[i][1].strip()
                i += 1
                taken += 1
            line = joined
        out.append((no, line))
    return out


def drop_repeats(lines: list[_Line]) -> list[_Line]:
    """A non-blank line equal to the one before it (after prefixes went) is kept once."""
    out: list[_Line] = []
    for no, line in lines:
        if out and line.strip() and line.strip() == out[-1][1].strip():
            continue
        out.append((no, line))
    return out


_INNER_SPACES = re.compile(r"(?<=\S)(?: {2,3}|\t)(?=\S)")


def squeeze_spaces(lines: list[_Line]) -> list[_Line]:
    """Two or three spaces, or a tab, between two words of a line become one space (a paste's or
    a redaction's slip). The indentation (which tells a traceback's code line from its frame line)
    stays, and so do wider runs: they align columns (bash's ``12345 Killed      python ...``).
    Only in a paste (at most REPAIR_CHARS characters): a log of megabytes was written by programs."""
    if sum(len(line) + 1 for _, line in lines) > REPAIR_CHARS:
        return lines
    return [(no, _INNER_SPACES.sub(" ", line) if "  " in line or "\t" in line else line) for no, line in lines]


_STEPS = (
    ("characters", fix_characters), ("hard-wrap", unwrap_hard_wrapped), ("markdown", undo_markdown_blocks),
    ("timestamps", strip_timestamps),  # a collector's stamp before the host or rank (kubectl --timestamps)
    ("hosts", strip_host_prefixes), ("collector-fields", strip_shared_brackets),
    ("ranks", strip_rank_prefixes), ("timestamps", strip_timestamps), ("progress", split_progress_bars),
    ("notebook-frames", python_frames_from_notebooks), ("rich-frames", python_frames_from_rich_boxes),
    ("prose", lift_errors_from_prose),
    ("inline-markdown", undo_inline_markdown), ("identifiers", None), ("typos", None), ("wrapped", rejoin_wrapped),
    ("spaces", squeeze_spaces), ("repeats", drop_repeats),
)


def _is_error_line(line: str) -> bool:
    return ("Error" in line or "Exception" in line) and ERROR_LINE.match(line.strip()) is not None


def normalize(text: str, vocabulary: Iterable[str] = (), window: int | None = WINDOW_CHARS,
              words: frozenset[str] = frozenset()) -> Normalized:
    """The normalised form of ``text`` (see the module docstring); ``vocabulary`` holds the
    identifiers with underscores to repair (``explain`` passes the knowledge base's), ``words`` the
    words whose misspellings in error lines are repaired (:mod:`troubleshooter.typos`). Only the
    lines of the last ``window`` characters are normalised (None: all); the lines before them are
    kept as they are, so offsets and line numbers still cover the whole text."""
    lines: list[_Line] = list(enumerate(text.split("\n"), 1))
    kept: list[_Line] = []
    if window is not None and len(text) > window:
        cut = text.count("\n", 0, len(text) - window) + 1  # whole lines before the window
        kept, lines = lines[:cut], lines[cut:]
    vocab = tuple(vocabulary)
    steps = []
    for name, step in _STEPS:
        if step is not None:
            after = step(lines)
        elif name == "typos":
            after = repair_typos(lines, words, _is_error_line)
        else:
            after = repair_identifiers(lines, vocab)
        if after != lines and name not in steps:
            steps.append(name)
        lines = after
    lines = kept + lines
    return Normalized("\n".join(line for _, line in lines), text, tuple(no for no, _ in lines), tuple(steps))
