"""Export time: a checkpoint directory -> a Hugging Face model directory (or one safetensors file).

Streaming: the output shards are planned from shapes alone (``huggingface_hub``'s
``split_torch_state_dict_into_shards`` on meta tensors), then each shard's tensors are rebuilt
one at a time from the memory-mapped rank files, cast, written, and dropped; the files are
unmapped after every shard. Peak host memory is about one output shard plus the largest tensor
(plus the pages of the fp32 sources read for that shard), whatever the model's size.

No model code, no DeepSpeed, no process group; the source directory is only ever read. Where the
output goes, what an existing OUT may be, and how a finished export is published (a work
directory beside OUT, the marker ``zeromoe_export.json`` last, one rename) is :mod:`.output`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable

from lightning_zeromoe.checkpoint.errors import BAD_DTYPE, NOT_A_CHECKPOINT, OUTPUT_PATH, UNSUPPORTED_MODEL, ExportError
from lightning_zeromoe.checkpoint.lora import adapter_config, split_lora
from lightning_zeromoe.checkpoint.meta import META_FILE, ExportMeta, read_meta
from lightning_zeromoe.checkpoint.output import (MARKER_FORMAT, MARKER_VERSION, PRODUCER, Staging, check_existing,
                                                 check_location, disk_full, real)
from lightning_zeromoe.checkpoint.plan import OutputTensor, check_shape, plan_outputs
from lightning_zeromoe.checkpoint.progress import Progress
from lightning_zeromoe.checkpoint.sources import Reader, catalog
from lightning_zeromoe.knowledge import say

DEFAULT_MAX_SHARD_SIZE = "5GB"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = ("float32", "bfloat16", "float16")
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def export(ckpt_dir: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "auto",
           max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, overwrite: bool = False,
           trust_checkpoint: bool = False, progress: bool | Callable[[str], None] = True) -> Path:
    """Write the model of a ``ZeroMoEStrategy`` checkpoint with its own parameter names.

    Args:
        ckpt_dir: What ``trainer.save_checkpoint(path)`` / ``ModelCheckpoint`` wrote (``latest``,
            ``checkpoint/`` with DeepSpeed's per-rank shards, ``zeromoe_meta.json``). ZeRO stage 1, 2
            or 3, with or without expert parallelism.
        out: A directory to create (Hugging Face layout: ``config.json``, ``model-0000k-of-0000n
            .safetensors``, ``model.safetensors.index.json``, ``zeromoe_export.json``; ``adapter/``
            for a LoRA run), an empty directory, or a path ending in ``.safetensors`` for one file.
            Never the checkpoint, inside it, or a directory that holds it.
        dtype: ``"auto"`` (the dtype the model trained in), ``"float32"`` (ZeRO-3: the fp32 master
            weights), ``"bfloat16"`` or ``"float16"``.
        max_shard_size: Largest output shard (``"5GB"``, ``"200MB"`` or bytes); a tensor larger
            than it gets a shard of its own.
        overwrite: Replace an earlier export at ``out`` (a directory holding ``zeromoe_export.json``
            and only the files it lists, or a ``.safetensors`` file this exporter wrote). Anything
            else at ``out`` is refused either way.
        trust_checkpoint: Allow a full unpickle of shards that hold objects other than tensors and
            known DeepSpeed/Lightning values. That can run code from the file: only for
            checkpoints you trust.
        progress: Progress bar and lines on stderr (True), quiet (False), or a callable for lines.

    Returns the path written. Raises :class:`ExportError` for anything wrong with the input or
    the output path, and for a full disk (then nothing is left behind and ``out`` is unchanged).
    """
    t0 = time.perf_counter()
    out = Path(out)
    single = out.suffix == ".safetensors"
    ckpt_dir, meta = locate(Path(ckpt_dir))
    check_location(out, ckpt_dir)
    target = target_dtype(dtype, meta)
    report = Progress(progress)
    staging = Staging(out, overwrite=overwrite, say=report.line)
    staging.sweep()
    check_existing(out, overwrite)
    cat = catalog(ckpt_dir, meta, trust_checkpoint=trust_checkpoint)
    report.line(f"reading {len(cat.files)} shard files of a ZeRO stage-{meta.zero_stage} checkpoint "
                f"({meta.world_size} ranks, ep_size={meta.ep_size}) from {ckpt_dir / meta.tag}")
    outputs = plan_outputs(cat, meta)
    adapter: list[OutputTensor] = []
    if meta.lora:
        outputs, adapter = split_lora(outputs, meta.lora)
    if meta.outside_prefix:
        report.line(f"not exported, outside the model at '{meta.prefix[:-1]}': {', '.join(meta.outside_prefix[:5])}")
    needed = sum(_numel(o.shape) for o in outputs + adapter) * target.itemsize
    reader = Reader(trust_checkpoint=trust_checkpoint)
    try:
        tmp = staging.open()
        if single:
            write_shards(outputs, tmp / out.name, target, reader, report, max_shard_size=None, source=ckpt_dir,
                         meta=meta)
        else:
            write_shards(outputs, tmp, target, reader, report, max_shard_size=max_shard_size, source=ckpt_dir,
                         meta=meta)
            write_model_files(tmp, meta, target)
            if adapter:
                (tmp / "adapter").mkdir()
                write_shards(adapter, tmp / "adapter" / "adapter_model.safetensors", target, reader, report,
                             max_shard_size=None, source=ckpt_dir, meta=meta)
                (tmp / "adapter" / "adapter_config.json").write_text(
                    json.dumps(adapter_config(meta.lora[0]), indent=2))
        staging.commit(None if single else export_marker(meta, target, ckpt_dir))
    except BaseException as err:
        staging.abort()
        full = disk_full(err, out, needed) if isinstance(err, Exception) and not isinstance(err, ExportError) else None
        if full is not None:
            raise full from None
        raise
    finally:
        reader.release()
    total = sum(_numel(o.shape) for o in outputs)
    report.line(f"wrote {len(outputs)} tensors ({total:,} values, {_name(target)}) to {out} in "
                f"{time.perf_counter() - t0:.1f} s" + (f"; LoRA adapter ({len(adapter)} tensors) in {out / 'adapter'}"
                                                      if adapter else ""))
    return out


def write_shards(outputs: list[OutputTensor], path: Path, dtype: Any, reader: Reader, report: Progress, *,
                 max_shard_size: int | str | None, source: Path, meta: ExportMeta) -> None:
    """Write ``outputs`` into ``path`` (a file when ``max_shard_size`` is None, else a directory
    of shards and their index), one shard in memory at a time."""
    import torch
    from safetensors.torch import save_file

    by_name = {o.name: o for o in outputs}
    info = {"format": "pt", "producer": PRODUCER, "source": str(source),
            "model_class": meta.model.class_name, "dtype": _name(dtype)}
    if max_shard_size is None:
        files = {path.name: [o.name for o in outputs]}
        index = None
    else:
        from huggingface_hub import split_torch_state_dict_into_shards

        shapes = {o.name: torch.empty(o.shape, dtype=dtype, device="meta") for o in outputs}
        try:
            split = split_torch_state_dict_into_shards(shapes, max_shard_size=max_shard_size)
        except ValueError as err:
            raise ExportError(say(OUTPUT_PATH, "max-shard-size", "size-format", max_shard_size=max_shard_size,
                                  err=err)) from None
        files = split.filename_to_tensors
        index = {"metadata": {**split.metadata}, "weight_map": split.tensor_to_filename}
        path = path / "_"  # shards sit next to each other in the directory
    total = sum(_numel(o.shape) for o in outputs) * dtype.itemsize
    bar = report.bar(total, f"{len(files)} shard(s)")
    try:
        for filename, names in files.items():
            state = {}
            for name in names:
                out = by_name[name]
                tensor = out.build(reader)
                check_shape(out, tensor)
                state[name] = tensor.to(dtype).contiguous()
                del tensor
                bar.advance(state[name].numel() * dtype.itemsize)
            save_file(state, str(path.with_name(filename)), metadata=info)
            del state
            reader.release()
    finally:
        bar.close()  # also when a write fails: the live display must not outlive the export
    if index is not None:
        (path.with_name("model.safetensors.index.json")).write_text(json.dumps(index, indent=2))


def write_model_files(out_dir: Path, meta: ExportMeta, dtype: Any) -> None:
    """``config.json`` and ``generation_config.json`` from the meta."""
    if meta.model.config is not None:
        config = dict(meta.model.config)
        if meta.model.config_kind == "transformers":
            config["dtype"] = _name(dtype)
            config.pop("torch_dtype", None)
        else:
            config["zeromoe_model_class"] = meta.model.class_name
        (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if meta.model.generation_config:
        (out_dir / "generation_config.json").write_text(json.dumps(meta.model.generation_config, indent=2))


def export_marker(meta: ExportMeta, dtype: Any, source: Path) -> dict[str, Any]:
    """What ``zeromoe_export.json`` records (:meth:`.Staging.commit` adds ``files``, name -> bytes,
    and writes it last): where the weights and the tokenizer come from, and when."""
    return {"format": MARKER_FORMAT, "version": MARKER_VERSION, "source": str(real(source)), "tag": meta.tag,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model_class": meta.model.class_name,
            "dtype": _name(dtype), "tokenizer": meta.model.name_or_path, "zero_stage": meta.zero_stage,
            "world_size": meta.world_size, "ep_size": meta.ep_size, "frozen": meta.frozen,
            "trained_with": meta.versions}


def locate(path: Path) -> tuple[Path, ExportMeta]:
    """The checkpoint directory and its meta, or an error saying what the path is instead."""
    if not path.exists():
        raise ExportError(say(NOT_A_CHECKPOINT, "not-found", "pass-checkpoint-dir", path=path))
    if not path.is_dir():
        raise ExportError(say(NOT_A_CHECKPOINT, "is-a-file", "pass-checkpoint-dir", path=path))
    if not (path / META_FILE).is_file() and (path.parent / META_FILE).is_file():
        path = path.parent  # the user pointed at checkpoint/ inside it
    meta_path = path / META_FILE
    if not meta_path.is_file():
        if (path / "latest").is_file() or any(path.glob("*/*mp_rank_*_model_states.pt")):
            raise ExportError(say(NOT_A_CHECKPOINT, "no-meta", "resave-with-strategy", path=path,
                                  meta_file=META_FILE))
        raise ExportError(say(NOT_A_CHECKPOINT, "not-deepspeed", "pass-checkpoint-dir", path=path,
                              meta_file=META_FILE))
    meta = read_meta(meta_path)
    if meta.unsupported:
        raise ExportError(say(UNSUPPORTED_MODEL, "unmapped-parts", "ds-to-universal",
                              parts="; ".join(meta.unsupported)))
    latest = path / "latest"
    if not latest.is_file():
        raise ExportError(say(NOT_A_CHECKPOINT, "no-latest", "earlier-or-save-again", path=path))
    if latest.read_text().strip() != meta.tag:
        raise ExportError(say(NOT_A_CHECKPOINT, "mixed-tags", "one-save", latest=latest,
                              found=latest.read_text().strip(), meta_file=META_FILE, tag=meta.tag))
    return path, meta


def check_output(out: Path, ckpt_dir: Path, overwrite: bool) -> None:
    """Refuse an output path export may not write (see :mod:`.output`); changes nothing."""
    check_location(out, ckpt_dir)
    check_existing(out, overwrite)


def target_dtype(dtype: str, meta: ExportMeta) -> Any:
    import torch

    name = meta.dtype if dtype == "auto" else _ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ExportError(say(BAD_DTYPE, "unknown", "known-dtypes", dtype=dtype))
    if meta.zero_stage != 3 and name == "float32" and meta.dtype != "float32":
        raise ExportError(say(BAD_DTYPE, "upcast", "dtype-auto", zero_stage=meta.zero_stage, dtype=meta.dtype))
    return getattr(torch, name)


def _name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
