"""Reading what ``explain`` is given: a file, standard input, or the text itself.

Why a bounded, tail-biased read: training logs grow to gigabytes, and the error that stopped the
run is at the end. At most ``MAX_BYTES`` are kept from the end of a file or of standard input,
decoded with ``errors="replace"`` and stripped of terminal escapes, so binary, huge or colourised
input never crashes the command. Line numbers stay those of the whole input: the newlines of the
part that was skipped are counted (up to ``COUNT_LIMIT`` bytes of it), and a carriage return
(a progress bar redrawing itself) splits a line for matching but not for numbering, as ``grep -n``
and editors count lines.
"""

from __future__ import annotations

import bisect
import os
import re
import sys
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import BinaryIO

__all__ = ["COUNT_LIMIT", "MAX_BYTES", "ExplainInputError", "Input", "clean", "from_text",
           "read_input", "read_source"]

#: How much of the input is read: the last 4 MiB (the end of a log is where the error is).
MAX_BYTES = 4 * 1024 * 1024
#: Newlines are counted in at most this much of a file's skipped start, to give real line numbers.
COUNT_LIMIT = 1024 * 1024 * 1024
_CHUNK = 1024 * 1024
#: Input whose sampled characters are more than this share undecodable or control bytes is binary.
BINARY_SHARE = 0.10
_SAMPLE = 64 * 1024

# CSI sequences (colours, cursor moves), OSC sequences (titles, hyperlinks), and 2-byte escapes.
_ANSI_RE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
# Control characters that do not occur in text logs (tab, newline, CR, ESC, backspace, form feed do).
_CONTROL_RE = re.compile(r"[\x00-\x07\x0e-\x1a\x1c-\x1f\x7f\ufffd]")


class ExplainInputError(OSError):
    """The input could not be read (missing file, a directory, no permission)."""


@dataclass(frozen=True)
class Input:
    """What was read: the cleaned text, where it came from, and how its lines map to the input.

    ``first_line`` is the input's line number of the text's first line (1 unless the start was
    skipped), or None when the skipped part was too large to count. ``kind`` is file, stdin or
    text (the command-line argument itself).
    """

    text: str
    total_bytes: int
    truncated: bool
    binary: bool
    name: str = "<text>"
    kind: str = "text"
    first_line: int | None = 1
    #: For each line of the input (0-based, from the text's start), the text line it starts at;
    #: empty when the text has no carriage return, so both count the same.
    line_starts: tuple[int, ...] = field(default=(), repr=False)

    def input_line(self, text_line: int) -> int:
        """The input's line number of the text's line ``text_line`` (both 1-based)."""
        if self.line_starts:
            text_line = bisect.bisect_right(self.line_starts, text_line - 1)
        return text_line + (self.first_line or 1) - 1

    @property
    def empty(self) -> bool:
        """No text at all, or only white space."""
        return not self.text.strip()

    def problem(self) -> str | None:
        """Why this input cannot be a log (empty, binary), or None."""
        if self.empty:
            return f"{self.name}: the input is empty ({self.total_bytes} bytes); give a log or a traceback"
        if self.binary:
            return (f"{self.name}: this is binary data, not a text log ({self.total_bytes} bytes); "
                    "give the training log or the traceback as text")
        return None

    def describe(self) -> str:
        """How much was read, for the 'nothing found' line: '12 lines', 'binary data'."""
        if self.empty:
            return "empty input"
        if self.binary:
            return "binary data"
        lines = self.text.count("\n") + (not self.text.endswith("\n"))
        return f"{lines} line{'s' if lines != 1 else ''}"

    def note(self) -> str | None:
        """A line saying the input was cut, and what the line numbers count, or None."""
        if not self.truncated:
            return None
        numbers = ("line numbers are those of the whole input" if self.first_line is not None
                   else "line numbers count from the start of that part")
        return f"(read the last {MAX_BYTES // 2**20} MiB of {self.total_bytes} bytes; {numbers})"


def clean(text: str) -> str:
    """Strip ANSI escapes and NULs, and turn carriage-return progress bars into lines."""
    text = _ANSI_RE.sub("", text)
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")


def _clean_with_lines(text: str) -> tuple[str, tuple[int, ...]]:
    """:func:`clean`, and where each input line starts among the cleaned lines."""
    text = _ANSI_RE.sub("", text).replace("\r\n", "\n").replace("\x00", "")
    if "\r" not in text:
        return text, ()
    pieces = [line.count("\r") + 1 for line in text.split("\n")]
    return text.replace("\r", "\n"), tuple(accumulate(pieces[:-1], initial=0))


def looks_binary(data: bytes) -> bool:
    """More than ``BINARY_SHARE`` of a sample is undecodable or control bytes."""
    if not data:
        return False
    sample = data[:_SAMPLE] + (data[-_SAMPLE:] if len(data) > 2 * _SAMPLE else b"")
    decoded = sample.decode("utf-8", errors="replace")
    return len(_CONTROL_RE.findall(decoded)) > BINARY_SHARE * len(decoded)


def _tail_of_stream(stream: BinaryIO, limit: int) -> tuple[bytes, int, int]:
    """The last ``limit`` bytes of a stream, its length, and the newlines before what is kept."""
    kept = bytearray()
    total = newlines = 0
    while chunk := stream.read(_CHUNK):
        total += len(chunk)
        kept += chunk
        if len(kept) > 2 * limit:  # trim now and then, not on every chunk
            newlines += kept.count(b"\n", 0, len(kept) - limit)
            del kept[:-limit]
    if len(kept) > limit:
        newlines += kept.count(b"\n", 0, len(kept) - limit)
        del kept[:-limit]
    return bytes(kept), total, newlines


def _newlines_in(handle: BinaryIO, size: int) -> int:
    handle.seek(0)
    count, left = 0, size
    while left > 0 and (chunk := handle.read(min(8 * _CHUNK, left))):
        count += chunk.count(b"\n")
        left -= len(chunk)
    return count


def _tail_of_file(path: Path, limit: int) -> tuple[bytes, int, int | None]:
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            skipped = max(0, size - limit)
            newlines = _newlines_in(handle, skipped) if 0 < skipped <= COUNT_LIMIT else 0
            handle.seek(skipped)
            data = handle.read(limit)
    except IsADirectoryError:
        raise ExplainInputError(f"{path}: is a directory, not a log file") from None
    except FileNotFoundError:
        raise ExplainInputError(f"{path}: no such file (to explain a message itself, quote it: "
                                "explain \"<the error message>\")") from None
    except OSError as err:
        raise ExplainInputError(f"{path}: {err.strerror or err}") from None
    return data, max(size, len(data)), newlines if skipped <= COUNT_LIMIT else None


def _make_input(data: bytes, total: int, newlines: int | None, name: str, kind: str) -> Input:
    truncated = total > len(data)
    if truncated:  # the first line is probably cut in the middle
        newline = data.find(b"\n")
        if newline != -1:
            data = data[newline + 1:]
            newlines = None if newlines is None else newlines + 1
    text, starts = _clean_with_lines(data.decode("utf-8", errors="replace"))
    first = None if newlines is None else newlines + 1
    return Input(text, total, truncated, looks_binary(data), name=name, kind=kind,
                 first_line=first, line_starts=starts)


def from_text(text: str, name: str = "<text>") -> Input:
    """An Input for text given directly (an argument, a notebook cell's output)."""
    raw = text.encode("utf-8", errors="replace")
    return _make_input(raw, len(raw), 0, name, "text")


def read_input(source: str | os.PathLike | None, *, limit: int = MAX_BYTES) -> Input:
    """Read a log from a path, or from standard input when ``source`` is None or ``"-"``."""
    if source is None or str(source) == "-":
        data, total, newlines = _tail_of_stream(sys.stdin.buffer, limit)
        return _make_input(data, total, newlines, "<stdin>", "stdin")
    data, total, counted = _tail_of_file(Path(source), limit)
    return _make_input(data, total, counted, str(source), "file")


def is_message(argument: str) -> bool:
    """Whether a command-line argument is the text to explain rather than a file name.

    A name of an existing file is a file; a missing one with no white space is taken as a file
    name (so a typo in it says "no such file"); anything with a newline, or with white space and
    no such file, is a message.
    """
    if argument == "-":
        return False
    if "\n" in argument:
        return True
    try:
        if os.path.exists(argument):
            return False
    except (OSError, ValueError):  # a name too long or with a NUL: not a file name
        return True
    return any(c.isspace() for c in argument)


def read_source(argument: str | None, *, limit: int = MAX_BYTES) -> Input:
    """The CLI's argument: ``-``/None for standard input, a file, or the message itself."""
    if argument is not None and is_message(argument):
        return from_text(argument)
    return read_input(argument, limit=limit)
