"""Rules about what the consumer can read at all: the file format, value types, "auto" values,
keys the installed DeepSpeed does not know (checked against its own config models, harvested in a
subprocess by ``troubleshooter.ds_schema``) and keys Lightning refuses.

A key that starts with ``_`` is a comment (``"_comment": "..."``): information where DeepSpeed
ignores unknown keys, an error inside a pydantic-validated section (which refuses it). A "did you
mean" rename is proposed only when the renamed config validates (``troubleshooter.lint.rename``).
"""

from __future__ import annotations

import difflib
from typing import Any

from troubleshooter import knowledge
from troubleshooter.lint import rename
from troubleshooter.lint.context import Context, get, is_int, nested, type_name

__all__ = ["auto_values", "file_format", "lightning_keys", "unknown_keys", "value_types"]

#: Keys Lightning 2.6.6's DeepSpeedStrategy._create_default_config writes that deepspeed 0.19.8
#: does not read (it reads aio.intra_op_parallelism instead of aio.thread_count).
LIGHTNING_ONLY_KEYS = {"aio.thread_count": "aio.intra_op_parallelism"}
#: Sections that must be JSON objects when present.
OBJECT_SECTIONS = ("zero_optimization", "fp16", "bf16", "expert_parallel", "optimizer",
                   "scheduler", "zero_optimization.offload_optimizer", "zero_optimization.offload_param")
#: Settings the rules read as integers.
INT_SETTINGS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "zero_optimization.stage", "expert_parallel.autoep_size")
#: The batch keys DeepSpeedConfig compares with ints itself: "auto" there raises TypeError.
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def file_format(ctx: Context, json_error: tuple[str, int, int] | None) -> None:
    """Only hjson parsed the file: fine for DeepSpeed, an error for the json readers."""
    if json_error is None:
        return
    error, line, col = json_error
    if ctx.consumer == "deepspeed":
        ctx.add("info", "", knowledge.message("config-file-format", "hjson-accepted"),
                knowledge.fix("config-file-format", "strict-json"), at=(line, col), error=error,
                line=line, col=col)
    else:
        ctx.add("error", "", knowledge.message("config-file-format", "json-required"),
                knowledge.fix("config-file-format", "strict-json"), at=(line, col), error=error,
                line=line, col=col)


def value_types(ctx: Context) -> None:
    """Sections must be objects and the integers the rules use integers: one finding per wrong
    value, which the other rules then skip (so one bad value hides nothing else)."""
    for path in OBJECT_SECTIONS:
        value = get(ctx.config, path)
        if value is not None and not isinstance(value, dict):
            ctx.bad_types.add(path)
            ctx.add("error", path, knowledge.message("config-value-type", "not-object"),
                    knowledge.fix("config-value-type", "give-expected-type"),
                    expected="an object", found=type_name(value))
    for path in INT_SETTINGS:
        value = get(ctx.config, path)
        if value is not None and value != "auto" and not is_int(value):
            ctx.bad_types.add(path)
            ctx.add("error", path, knowledge.message("config-value-type", "not-integer"),
                    knowledge.fix("config-value-type", "give-expected-type"),
                    expected="an integer", found=type_name(value))


def _auto_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _auto_paths(v, f"{prefix}{k}" if not prefix
                                                                 else f"{prefix}.{k}")]
    return [prefix] if node == "auto" else []


def auto_values(ctx: Context, schema) -> None:
    """"auto" is resolved only by the HF Trainer (HfTrainerDeepSpeedConfig.trainer_config_process).
    DeepSpeed itself compares the batch keys with ints (TypeError), drops "auto" from its pydantic
    sections (the default is used silently: DeepSpeedConfigModel.__init__) and passes it on
    elsewhere (optimizer params, gradient_clipping)."""
    if ctx.consumer == "hf":
        return
    dropped = set(schema.strict_sections) if schema is not None else set()
    for path in _auto_paths(ctx.config):
        if path == "moe" or path.startswith("moe."):
            continue  # not live config: the moe rule explains the block
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        if path in BATCH_KEYS:
            message = knowledge.message("hf-auto-value", "batch-key")
        elif parent in dropped:
            message = knowledge.message("hf-auto-value", "dropped")
        else:
            message = knowledge.message("hf-auto-value", "passed-on")
        ctx.add("error", path, message, knowledge.fix("hf-auto-value", "give-a-value"))


def lightning_keys(ctx: Context) -> None:
    """Lightning's DeepSpeedStrategy refuses gradient_accumulation_steps in the config."""
    if ctx.consumer == "lightning" and "gradient_accumulation_steps" in ctx.config:
        ctx.add("error", "gradient_accumulation_steps",
                knowledge.message("lightning-gradient-accumulation", "refused"),
                knowledge.fix("lightning-gradient-accumulation", "use-accumulate-grad-batches"),
                patch={"gradient_accumulation_steps": None})


def unknown_keys(ctx: Context, schema, schema_error: str | None) -> None:
    """Keys the installed DeepSpeed does not know, checked against its own models."""
    if schema is None:
        ctx.add("info", "", knowledge.message("unknown-config-key", "schema-unavailable"),
                knowledge.fix("unknown-config-key", "install-deepspeed"), reason=schema_error)
        return
    for key, value in ctx.config.items():
        if key == "moe":
            continue  # the moe rule explains it
        _check_key(ctx, schema, key, value, schema.top_level, strict=False)


def _check_key(ctx: Context, schema, path: str, value: Any, allowed, *, strict: bool) -> None:
    path = str(path)  # a Python dict or YAML file may hold non-string keys; DeepSpeed knows none of them
    key = path.rsplit(".", 1)[-1]
    version = schema.deepspeed_version
    if path in schema.removed:
        ctx.add("error", path, knowledge.message("unknown-config-key", "removed"),
                knowledge.fix("unknown-config-key", "delete-key"), patch=nested({path: None}),
                version=version, reason=schema.removed[path])
        return
    if path in LIGHTNING_ONLY_KEYS:
        ctx.add("info", path, knowledge.message("unknown-config-key", "lightning-only"),
                knowledge.fix("unknown-config-key", "nothing-to-do"), version=version,
                reads=LIGHTNING_ONLY_KEYS[path])
        return
    if key.startswith("_") and key not in allowed:
        _report_comment(ctx, path, strict=strict, version=version)
        return
    if key not in allowed:
        _report_unknown(ctx, schema, path, value, allowed, strict=strict, version=version)
        return
    if path in schema.deprecated:
        new = schema.deprecated[path]
        if new:
            ctx.add("info", path, knowledge.message("unknown-config-key", "deprecated-renamed"),
                    knowledge.fix("unknown-config-key", "replace-key"), version=version, new=new)
        else:
            ctx.add("info", path, knowledge.message("unknown-config-key", "deprecated"),
                    knowledge.fix("unknown-config-key", "delete-key"), version=version)
    _check_section(ctx, schema, path, value)


def _check_section(ctx: Context, schema, path: str, value: Any) -> None:
    if not isinstance(value, dict):
        return
    if path in schema.strict_sections:
        allowed, strict = schema.strict_sections[path], True
    elif path in schema.loose_sections:
        allowed, strict = schema.loose_sections[path], False
    else:
        return  # a free-form section (optimizer params, ...): nothing to check against
    if path in ("optimizer", "scheduler"):
        allowed = allowed | {"params"}
    for key, sub in value.items():
        _check_key(ctx, schema, f"{path}.{key}", sub, allowed, strict=strict)


def _rename_patch(path: str, new: str, value: Any) -> dict:
    """A merge patch that moves ``path``'s value to the sibling key ``new``."""
    *parents, old = path.split(".")
    patch: dict = {old: None, new: value}
    for parent in reversed(parents):
        patch = {parent: patch}
    return patch


def _report_comment(ctx: Context, path: str, *, strict: bool, version: str) -> None:
    """A "_..." key: a comment. DeepSpeed ignores it, except where a pydantic model forbids it."""
    if strict:
        ctx.add("error", path, knowledge.message("unknown-config-key", "comment-refused"),
                knowledge.fix("unknown-config-key", "move-comment"), patch=nested({path: None}),
                version=version)
    else:
        ctx.add("info", path, knowledge.message("unknown-config-key", "comment"),
                knowledge.fix("unknown-config-key", "nothing-to-do"), version=version)


def _report_unknown(ctx: Context, schema, path: str, value: Any, allowed, *, strict: bool,
                    version: str) -> None:
    key = path.rsplit(".", 1)[-1]
    # the closest key only, and only when DeepSpeed would accept the renamed config: a farther
    # key that happens to take the value would be a guess about what the user meant
    close = [g for g in difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.6)
             if rename.rename_ok(schema, path, g, value, consumer=ctx.consumer)]
    severity = "error" if strict else "warning"
    if close:
        guess = close[0]
        message = (knowledge.message("unknown-config-key", "unknown-strict-close") if strict
                   else knowledge.message("unknown-config-key", "unknown-loose-close"))
        ctx.add(severity, path, message, knowledge.fix("unknown-config-key", "rename-key"),
                patch=_rename_patch(path, guess, value), version=version, guess=guess)
    else:
        message = (knowledge.message("unknown-config-key", "unknown-strict") if strict
                   else knowledge.message("unknown-config-key", "unknown-loose"))
        ctx.add(severity, path, message, knowledge.fix("unknown-config-key", "delete-key"),
                patch=nested({path: None}), version=version)
