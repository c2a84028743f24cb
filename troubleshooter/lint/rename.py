"""Whether a "did you mean" rename gives a config DeepSpeed accepts.

A close spelling is not enough: ``"comment": "..."`` is close to a section that takes an object,
and ``"sequence_parallel": {...}`` to ``sequence_parallel_size``, by which DeepSpeed divides the
world size. Before lint proposes renaming a key, the value is checked against the new key's JSON
types (harvested from DeepSpeed by ``troubleshooter.ds_schema``), then by DeepSpeed itself: the
pydantic model that validates the new key (``Model(**section)``, as ``DeepSpeedConfig`` builds
it), or, for a top-level key read with ``dict.get``, ``DeepSpeedConfig`` with that key added to a
minimal config it accepts. DeepSpeed is imported here, lazily and once, only when a rename is to
be checked; when it cannot be imported, the type check alone decides.
"""

from __future__ import annotations

import contextlib
import sys
from functools import lru_cache
from typing import Any

from troubleshooter.ds_schema import Schema, json_type

__all__ = ["fits", "rename_ok"]

_TRUE_FALSE = {"true", "false", "yes", "no", "on", "off", "1", "0"}


def fits(value: Any, types: frozenset[str] | None, *, consumer: str = "deepspeed") -> bool:
    """Whether ``value`` can stand where DeepSpeed expects ``types`` (pydantic's lax coercions:
    0/1 for a boolean, a numeric string for a number; "auto" for the HF Trainer)."""
    if types is None or (value == "auto" and consumer == "hf"):
        return True
    kind = json_type(value)
    if kind in types:
        return True
    if kind == "number" and "boolean" in types:
        return value in (0, 1)
    if kind == "string" and "number" in types:
        try:
            float(value)
        except ValueError:
            return False
        return True
    if kind == "string" and "boolean" in types:
        return value.lower() in _TRUE_FALSE
    return False


@lru_cache(maxsize=1)
def _models() -> dict[str, type] | None:
    """DeepSpeed's config models by class name; None when DeepSpeed cannot be imported."""
    try:
        if "deepspeed.runtime.config" not in sys.modules:
            # DeepSpeed's logger prints to stdout at import: keep it off lint's output (--json)
            with contextlib.redirect_stdout(sys.stderr):
                import deepspeed.runtime.config  # noqa: F401
                import deepspeed.runtime.swap_tensor.aio_config  # noqa: F401
        from troubleshooter.ds_schema import _model_classes

        return _model_classes()
    except Exception:  # noqa: BLE001 - any import failure: the type check alone decides
        return None


def _model_accepts(schema: Schema, parent: str, key: str, value: Any) -> bool | None:
    """Whether the pydantic model that validates the renamed key accepts the value; None when
    no model validates it or DeepSpeed cannot be imported."""
    path = f"{parent}.{key}" if parent else key
    if path in schema.section_models:  # the new key is itself a validated section
        name, payload, field = schema.section_models[path], value, None
        if not isinstance(value, dict):
            return False
    elif parent in schema.section_models:  # a field of a validated section
        name, payload, field = schema.section_models[parent], {key: value}, key
    else:
        return None
    models = _models()
    model = models.get(name) if models is not None else None
    if model is None:
        return None
    try:
        model(**payload)
    except Exception as err:  # noqa: BLE001 - pydantic's ValidationError, or a validator's TypeError
        errors = getattr(err, "errors", None)
        if field is None or not callable(errors):
            return False
        # only errors about the renamed key count (a partial section may lack other fields)
        return not any(tuple(e.get("loc", ()))[:1] == (field,) for e in errors())
    return True


def _config_accepts(key: str, value: Any) -> bool | None:
    """Whether ``DeepSpeedConfig`` accepts a top-level key with this value (next to a minimal
    config it accepts alone); None when that cannot be told (DeepSpeed not importable)."""
    if _models() is None:
        return None
    from deepspeed.runtime.config import DeepSpeedConfig

    from troubleshooter.ds_schema import _PROBE_BASES

    base = _PROBE_BASES.get(key, {"train_batch_size": 1})
    try:
        DeepSpeedConfig(dict(base))
    except Exception:  # noqa: BLE001 - the base itself is refused: no verdict
        return None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            DeepSpeedConfig({**base, key: value})
    except Exception:  # noqa: BLE001 - any refusal: DeepSpeed rejects the renamed key's value
        return False
    return True


def rename_ok(schema: Schema, path: str, new_key: str, value: Any, *, consumer: str = "deepspeed") -> bool:
    """Whether moving ``path``'s value to the sibling key ``new_key`` gives a value DeepSpeed
    accepts: the JSON type fits, and the validating model (if any) takes it."""
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    new_path = f"{parent}.{new_key}" if parent else new_key
    if not fits(value, schema.types.get(new_path), consumer=consumer):
        return False
    if value == "auto" and consumer == "hf":
        return True  # the HF Trainer resolves it before DeepSpeed sees it
    loose = schema.loose_sections.get(new_path)
    if loose is not None and (not isinstance(value, dict) or not set(map(str, value)) <= loose):
        return False  # a section read with dict.get: an object of keys it reads, or nothing
    verdict = _model_accepts(schema, parent, new_key, value)
    if verdict is None and not parent:
        verdict = _config_accepts(new_key, value)
    return verdict is not False
