"""Which config keys the installed DeepSpeed reads: harvested from DeepSpeed itself, then cached.

Why not a hand-written list: DeepSpeed adds, renames and removes keys between releases, and the
lint must judge a config by the DeepSpeed that will run it. So the key sets come from DeepSpeed's
own code: the top-level keys are those ``DeepSpeedConfig`` actually looks up (recorded with a dict
that notes every lookup), a section's keys are the fields and aliases of the pydantic model that
validates it (found by feeding the section an unknown key and reading the model's name from the
``ValidationError``), or, for sections parsed with ``dict.get`` such as ``expert_parallel``, the
keys that the parser looked up.

Each key's JSON value types are harvested too (``Schema.types``): a pydantic field's from its
annotation, a ``dict.get`` key's from the default DeepSpeed passes, so that lint proposes a rename
only to a key whose type the value fits (a string is no section, an object no world-size divisor).

Importing DeepSpeed costs seconds and loads torch, so the harvest runs in a subprocess
(``python -m troubleshooter.ds_schema`` prints JSON) and its result is cached per DeepSpeed
version under ``$TROUBLESHOOTER_CACHE_DIR`` (default ``~/.cache/troubleshooter``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from pathlib import Path

__all__ = ["Schema", "SchemaError", "cache_path", "harvest", "load_schema"]

#: Bump when the harvested JSON changes shape, so old caches are ignored.
SCHEMA_FORMAT = 3
_PROBE_KEY = "__troubleshooter_probe__"
#: Keys DeepSpeedConfig reads only when a process group exists (the harvest runs without one),
#: with their JSON types: runtime/config.py divides the world size by sequence_parallel_size.
_NEEDS_DIST = {"sequence_parallel_size": ["number"]}
_JSON_TYPES = ((bool, "boolean"), (int, "number"), (float, "number"), (str, "string"),
               (dict, "object"), (list, "array"), (tuple, "array"), (type(None), "null"))


class SchemaError(RuntimeError):
    """DeepSpeed's key sets could not be harvested (not installed, import failure, timeout)."""


@dataclass(frozen=True)
class Schema:
    """The config keys of one DeepSpeed version."""

    deepspeed_version: str
    top_level: frozenset[str]
    removed: dict[str, str]  # dotted path -> DeepSpeed's own refusal message
    strict_sections: dict[str, frozenset[str]]  # pydantic-validated: unknown keys are errors
    loose_sections: dict[str, frozenset[str]]  # read with dict.get: unknown keys are ignored
    section_models: dict[str, str] = field(default_factory=dict)  # path -> pydantic model name
    deprecated: dict[str, str] = field(default_factory=dict)  # dotted path -> replacement or ""
    #: dotted path -> the JSON types its value may have (absent: not known, anything goes)
    types: dict[str, frozenset[str]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> "Schema":
        return cls(
            deepspeed_version=data["deepspeed_version"],
            top_level=frozenset(data["top_level"]),
            removed=dict(data["removed"]),
            strict_sections={k: frozenset(v) for k, v in data["strict_sections"].items()},
            loose_sections={k: frozenset(v) for k, v in data["loose_sections"].items()},
            section_models=dict(data.get("section_models", {})),
            deprecated=dict(data.get("deprecated", {})),
            types={k: frozenset(v) for k, v in data.get("types", {}).items()},
        )


# --------------------------------------------------------------------------------------------
# Harvest (runs inside the subprocess: imports deepspeed)
# --------------------------------------------------------------------------------------------


def json_type(value: object) -> str:
    """The JSON type name of a Python value (object, array, string, number, boolean, null)."""
    for cls, name in _JSON_TYPES:
        if isinstance(value, cls):
            return name
    return type(value).__name__


def _recorder(seen: set[str], defaults: dict[str, set[str]] | None = None):
    """A dict class that adds every key looked up in it to ``seen`` (and, to ``defaults``, the
    JSON type of the default a ``get(key, default)`` passes)."""
    from collections.abc import KeysView

    class _Keys(KeysView):
        def __contains__(self, key: object) -> bool:
            seen.add(str(key))
            return super().__contains__(key)

    class Recorder(dict):
        def get(self, key, default=None):
            seen.add(str(key))
            if defaults is not None and default is not None:
                defaults.setdefault(str(key), set()).add(json_type(default))
            return super().get(key, default)

        def __getitem__(self, key):
            seen.add(str(key))
            return super().__getitem__(key)

        def __contains__(self, key: object) -> bool:
            seen.add(str(key))
            return super().__contains__(key)

        def keys(self):  # ``KEY in d.keys()`` is how some DeepSpeed readers test presence
            return _Keys(self)

    return Recorder


def _read_config(config: dict) -> Exception | None:
    """Build a DeepSpeedConfig (and the aio config the engine reads); return what it raised."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config

    try:
        DeepSpeedConfig(config)
        get_aio_config(config)
    except Exception as err:  # noqa: BLE001 - any refusal is information here
        return err
    return None


def _model_classes() -> dict[str, type]:
    """Every pydantic config model DeepSpeed defines, by class name."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    found: dict[str, type] = {}
    todo = [DeepSpeedConfigModel]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            found.setdefault(sub.__name__, sub)
            todo.append(sub)
    return found


def _submodel(annotation) -> type | None:
    """The DeepSpeedConfigModel inside an annotation such as ``Optional[OffloadConfig]``."""
    import typing

    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, DeepSpeedConfigModel):
            return candidate
    return None


def _annotation_types(annotation) -> list[str] | None:
    """The JSON types a pydantic annotation accepts, or None when any value may do."""
    import enum
    import types
    import typing

    from pydantic import BaseModel

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _annotation_types(args[0])
    if origin in (typing.Union, types.UnionType):
        parts = [_annotation_types(a) for a in args]
        return None if any(p is None for p in parts) else sorted({t for p in parts for t in p})
    if origin is typing.Literal:
        return sorted({json_type(v) for v in args})
    if origin is not None:
        annotation = origin
    if not isinstance(annotation, type):
        return None
    if issubclass(annotation, enum.Enum):
        return sorted({json_type(m.value) for m in annotation})
    if issubclass(annotation, BaseModel):
        return ["object"]
    for cls, name in _JSON_TYPES:
        if issubclass(annotation, cls):
            return [name]
    return ["object"] if issubclass(annotation, typing.Mapping) else None


def _model_keys(model: type, path: str, out: dict) -> None:
    """Record a pydantic model's accepted keys (names and aliases), recursing into sub-models."""
    keys = set()
    for name, info in model.model_fields.items():
        keys.add(name)
        if info.alias:
            keys.add(info.alias)
        types = _annotation_types(info.annotation)
        if types is not None:
            for key in {name, info.alias} - {None}:
                out["types"][f"{path}.{key}"] = types
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if extra.get("deprecated"):
            out["deprecated"][f"{path}.{info.alias or name}"] = str(extra.get("new_param", ""))
        sub = _submodel(info.annotation)
        if sub is not None:
            for key in {name, info.alias} - {None}:
                _model_keys(sub, f"{path}.{key}", out)
    out["strict_sections"][path] = sorted(keys)
    out["section_models"][path] = model.__name__
    out["types"][path] = ["object"]


def _model_at(err, models: dict[str, type]) -> type | None:
    """The pydantic model that refused the probe key: the error's model, walked along ``loc``.

    A section can be validated as part of a bigger model (the monitor sections 'tensorboard',
    'wandb', ... are fields of DeepSpeedMonitorConfig), so the error's own title is not enough.
    """
    model = models.get(err.title)
    loc = err.errors()[0].get("loc", ()) if err.errors() else ()
    for part in loc[:-1]:
        if model is None:
            return None
        fields = {**{f.alias: f for f in model.model_fields.values() if f.alias}, **model.model_fields}
        info = fields.get(part)
        model = _submodel(info.annotation) if info is not None else None
    return model


def _probe_section(key: str, models: dict[str, type], out: dict) -> None:
    """Classify one top-level section as pydantic-validated (strict) or dict-parsed (loose)."""
    from pydantic import ValidationError

    seen: set[str] = set()
    for probe in ({_PROBE_KEY: 1}, {"type": "Adam", "enabled": True, _PROBE_KEY: 1}):
        err = _read_config({"train_batch_size": 1, key: _recorder(seen)(probe)})
        if isinstance(err, ValidationError):
            model = _model_at(err, models)
            if model is not None:
                _model_keys(model, key, out)
                return
    seen.discard(_PROBE_KEY)
    if seen:
        out["loose_sections"][key] = sorted(seen)


#: One value of each JSON type, fed to DeepSpeedConfig to learn which types a key accepts.
_TYPE_PROBES = {"number": 1, "boolean": True, "string": "x", "object": {}, "array": []}
#: A base config DeepSpeedConfig accepts, per key (the batch keys must not contradict it).
_PROBE_BASES = {"train_batch_size": {}, "train_micro_batch_size_per_gpu": {},
                "gradient_accumulation_steps": {"train_micro_batch_size_per_gpu": 1}}


def _probe_types(key: str) -> list[str] | None:
    """The JSON types DeepSpeedConfig accepts for a top-level key that has no typed default,
    or None when the probes do not tell (all accepted, or none)."""
    base = _PROBE_BASES.get(key, {"train_batch_size": 1})
    accepted = [name for name, value in _TYPE_PROBES.items()
                if _read_config({**base, key: value}) is None]
    return accepted if 0 < len(accepted) < len(_TYPE_PROBES) else None


def _removed_keys() -> dict[str, str]:
    from lightning_zeromoe._private.deepspeed import removed_config_keys

    top_level, zero = removed_config_keys()
    removed = dict(top_level)
    for key, message in zero.items():
        removed[f"zero_optimization.{key}"] = message
    return removed


def _autoep_keys(out: dict) -> list[str]:
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    seen: set[str] = set()
    defaults: dict[str, set[str]] = {}
    parse_autoep_config(_recorder(seen, defaults)({"enabled": False}))
    out["types"].update({f"expert_parallel.{k}": sorted(v) for k, v in defaults.items()})
    return sorted(seen)


def harvest() -> dict:
    """Read the key sets out of the installed DeepSpeed (imports it: seconds)."""
    import deepspeed

    seen: set[str] = set()
    defaults: dict[str, set[str]] = {}
    _read_config(_recorder(seen, defaults)({"train_batch_size": 1}))
    removed = _removed_keys()
    top = (seen | set(_NEEDS_DIST)) - {k for k in removed if "." not in k}
    out: dict = {"deepspeed_version": deepspeed.__version__, "format": SCHEMA_FORMAT,
                 "top_level": sorted(top), "removed": removed, "strict_sections": {},
                 "loose_sections": {}, "section_models": {}, "deprecated": {},
                 "types": {k: sorted(v) for k, v in defaults.items() if k in top}}
    out["types"].update(_NEEDS_DIST)
    models = _model_classes()
    for key in sorted(top):
        _probe_section(key, models, out)
        if key not in out["types"] and (probed := _probe_types(key)) is not None:
            out["types"][key] = probed
    out["loose_sections"]["expert_parallel"] = _autoep_keys(out)
    return out


# --------------------------------------------------------------------------------------------
# Load (runs in the caller: no deepspeed import)
# --------------------------------------------------------------------------------------------


def cache_path(deepspeed_version: str) -> Path:
    """Where the harvest for this DeepSpeed version is cached."""
    root = os.environ.get("TROUBLESHOOTER_CACHE_DIR") or Path.home() / ".cache" / "troubleshooter"
    return Path(root) / f"ds_schema-{deepspeed_version}-f{SCHEMA_FORMAT}.json"


def _read_cache(path: Path) -> Schema | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != SCHEMA_FORMAT:
            return None
        return Schema.from_json(data)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_cache(path: Path, data: dict) -> None:
    """Write atomically; a read-only home directory only costs the cache, not the lint."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
            json.dump(data, tmp)
        os.replace(tmp.name, path)
    except OSError:
        pass


def _run_harvest(timeout: float) -> dict:
    # The child must import this package even when it is run from a checkout, not installed.
    package_root = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}
    try:
        proc = subprocess.run([sys.executable, "-m", "troubleshooter.ds_schema"], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise SchemaError(f"reading DeepSpeed's config models took more than {timeout:.0f} s") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SchemaError(f"could not read DeepSpeed's config models: {last}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@lru_cache(maxsize=1)
def load_schema(timeout: float = 180.0) -> Schema:
    """The installed DeepSpeed's key sets: from the cache, or harvested once in a subprocess."""
    try:
        version = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        raise SchemaError("deepspeed is not installed") from None
    path = cache_path(version)
    cached = _read_cache(path)
    if cached is not None and cached.deepspeed_version == version:
        return cached
    data = _run_harvest(timeout)
    _write_cache(path, data)
    return Schema.from_json(data)


if __name__ == "__main__":
    # The harvest prints DeepSpeed's log lines to stdout; the JSON is the last line.
    print(json.dumps(harvest()))
