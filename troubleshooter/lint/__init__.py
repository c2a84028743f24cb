"""Lint a DeepSpeed config before a run wastes GPU hours on it.

Each rule (``keys``, ``rules``) is a small function over the parsed config that records findings;
every finding cites a knowledge-base entry and one of its message templates and fixes, filled with
what was found, so the explanation and the fix live in one place. Key names are checked against
the installed DeepSpeed's own config models (``troubleshooter.ds_schema``, harvested in a cached
subprocess), so importing this package stays light.

The consumer (``consumer=``, the CLI's ``--for``) is who reads the config: ``deepspeed``
(``deepspeed.initialize``; the default), ``lightning`` (``DeepSpeedStrategy(config=...)``) or
``hf`` (the Hugging Face Trainer). It decides whether hjson syntax is accepted, whether ``"auto"``
values are valid (only for the HF Trainer) and whether ``gradient_accumulation_steps`` may be set
(Lightning refuses it). Every finding is reported, even when some value has the wrong type.

Exit code of ``lint`` (see ``troubleshooter.cli``): 1 when any finding has severity "error".
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from troubleshooter.lint import keys
from troubleshooter.lint.context import CONSUMERS, Context, Finding, type_name
from troubleshooter.lint.rules import RULES
from troubleshooter.lint.source import LintInputError, parse_text, read_text

__all__ = ["CONSUMERS", "Finding", "LintInputError", "lint_config", "lint_path", "load_config",
           "merge_patch"]

SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


def _schema():
    from troubleshooter import ds_schema

    try:
        return ds_schema.load_schema(), None
    except ds_schema.SchemaError as err:
        return None, str(err)


def _run(ctx: Context, json_error: tuple[str, int, int] | None = None) -> list[Finding]:
    if not isinstance(ctx.config, dict):
        where = f"{ctx.source}:1:1" if ctx.text is not None else ctx.source
        raise LintInputError(f"{where}: the config must be a JSON object, got {type_name(ctx.config)}")
    if ctx.consumer not in CONSUMERS:
        raise LintInputError(f"unknown consumer {ctx.consumer!r}; choose one of {', '.join(CONSUMERS)}")
    if ctx.world_size is not None and (isinstance(ctx.world_size, bool)
                                       or not isinstance(ctx.world_size, int) or ctx.world_size < 1):
        raise LintInputError(f"world size must be a positive integer, got {ctx.world_size!r}")
    schema, schema_error = _schema()
    keys.file_format(ctx, json_error)
    keys.value_types(ctx)
    keys.unknown_keys(ctx, schema, schema_error)
    keys.auto_values(ctx, schema)
    keys.lightning_keys(ctx)
    for rule in RULES:
        rule(ctx)
    return sorted(ctx.findings, key=lambda f: (SEVERITY_ORDER[f.severity], f.line or 0, f.path, f.rule))


def lint_config(config: dict, *, world_size: int | None = None, consumer: str = "deepspeed",
                source: str = "<dict>") -> list[Finding]:
    """Findings for a parsed config, errors first (no line:col: there is no file)."""
    return _run(Context(config, world_size, consumer, source))


def load_config(path: str | Path) -> tuple[Any, str]:
    """The parsed config (strict JSON, else hjson) and its text; LintInputError otherwise."""
    parsed = parse_text(read_text(Path(path)), str(path))
    return parsed.config, parsed.text


def lint_path(path: str | Path, *, world_size: int | None = None,
              consumer: str = "deepspeed") -> list[Finding]:
    """Findings for a config file, each with its line:col. LintInputError for a missing file or
    text that neither json nor hjson parses."""
    parsed = parse_text(read_text(Path(path)), str(path))
    return _run(Context(parsed.config, world_size, consumer, str(path), parsed.text), parsed.json_error)


def merge_patch(target: Any, patch: Any) -> Any:
    """Apply a JSON merge patch (RFC 7386), the form of ``Finding.patch``: objects merge
    recursively, ``null`` deletes a key."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result
