"""Reading a config file the way its consumer does, and finding where a key is in the text.

DeepSpeed reads config files with ``hjson`` (``runtime/config.py::DeepSpeedConfig.__init__``,
deepspeed 0.19.8), which accepts comments, trailing commas and unquoted keys; Lightning
(``strategies/deepspeed.py::DeepSpeedStrategy._load_config``, 2.6.6) and the HF Trainer
(``accelerate/utils/deepspeed.py::HfDeepSpeedConfig``) read them with ``json``. So the file is
parsed as strict JSON first and, when that fails, as hjson: what only hjson accepts becomes a
finding whose severity depends on the consumer (see ``troubleshooter.lint``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["LintInputError", "Parsed", "locate", "parse_text", "read_text"]


class LintInputError(ValueError):
    """The config cannot be linted: unreadable file, text no consumer can parse, not an object.

    The message is one line and includes the position (``file:line:col``) when known.
    """


@dataclass(frozen=True)
class Parsed:
    """A parsed config. ``json_error`` is set when only hjson could read it: (message, line, col)."""

    config: Any
    text: str
    json_error: tuple[str, int, int] | None = None


class _Duplicate(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    """DeepSpeed refuses duplicate keys when it reads a config file; so does the lint."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(key)
        out[key] = value
    return out


def read_text(path: Path) -> str:
    """The file's text; LintInputError (one line) when it cannot be read as UTF-8 text."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LintInputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise LintInputError(f"{path}: is a directory, not a JSON file") from None
    except UnicodeDecodeError as err:
        raise LintInputError(f"{path}: not UTF-8 text (byte {err.start})") from None
    except OSError as err:
        raise LintInputError(f"{path}: {err.strerror or err}") from None


def _line_col(text: str, pos: int) -> tuple[int, int]:
    return text.count("\n", 0, pos) + 1, pos - (text.rfind("\n", 0, pos) + 1) + 1


def _duplicate_error(source: str, text: str, key: str) -> LintInputError:
    pos = max(text.rfind(f'"{key}"'), 0)
    line, col = _line_col(text, pos)
    return LintInputError(f"{source}:{line}:{col}: duplicate key {key!r}")


def parse_text(text: str, source: str) -> Parsed:
    """Strict JSON, else hjson (what DeepSpeed accepts); LintInputError when neither parses."""
    try:
        return Parsed(json.loads(text, object_pairs_hook=_reject_duplicates), text)
    except _Duplicate as dup:
        raise _duplicate_error(source, text, dup.key) from None
    except json.JSONDecodeError as err:
        json_error = (err.msg, err.lineno, err.colno)
    import hjson  # a small pure-Python package (a DeepSpeed dependency); only for non-JSON files

    try:
        config = hjson.loads(text, object_pairs_hook=_reject_duplicates)
    except _Duplicate as dup:
        raise _duplicate_error(source, text, dup.key) from None
    except hjson.HjsonDecodeError:
        msg, line, col = json_error
        raise LintInputError(f"{source}:{line}:{col}: invalid JSON (and not hjson either, which "
                             f"DeepSpeed also reads): {msg}") from None
    return Parsed(_plain(config), text, json_error)


def _plain(value: Any) -> Any:
    """hjson returns OrderedDicts; the rules expect plain dicts and lists."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def locate(text: str, parts: list[str]) -> tuple[int, int]:
    """(line, col) of the last key of ``parts`` in the text: each key is searched after the
    previous one, quoted or (hjson) bare. A best effort: the path's deepest key that is found."""
    pos = 0
    for part in parts:
        hit = re.compile(r'(?:"' + re.escape(part) + r'"|(?<![\w"])' + re.escape(part)
                         + r'(?![\w"]))\s*:').search(text, pos)
        if hit is None:
            break
        pos = hit.start()
    return _line_col(text, pos)
