"""Loadable checkpoints from ZeRO-3 + AutoEP training: one safetensors file with the model's own names.

Why this exists (measured with deepspeed 0.19.8, see the field notes, item 6):

* ``deepspeed.utils.zero_to_fp32`` refuses AutoEP ZeRO-3 checkpoints ("partition-native"): the
  experts are partitioned over expert-data-parallel groups, not over the whole world.
* ``ds_to_universal`` converts them, but keeps AutoEP's names and layouts
  (``mlp.router.gate.weight``, ``mlp.experts.w1/w2/w3`` of ``[E, ffn, hidden]``) and drops a tied
  ``lm_head``. Neither ``from_pretrained`` nor ``load_state_dict(strict=True)`` accepts that.

Two halves:

* **At save time** (:meth:`ZeroMoEStrategy.save_checkpoint`, rank 0) :func:`build_meta` describes
  the trained model while it is still in memory: for every tensor DeepSpeed stores, the name the
  *user's* model gives it (router ``<block>.router.gate.weight`` -> ``<block>.gate.weight``; AutoEP
  experts ``w1``/``w3``/``w2`` -> the fused ``gate_up_proj``/``down_proj`` or separate tensors they
  were repacked from), the LightningModule prefix to strip (``model.``/``net.``), tied groups,
  persistent buffers, the training dtype and the model's config. It is written as
  ``zeromoe_meta.json`` next to DeepSpeed's ``latest``.
* **At export time** (:func:`export`, no model code, no process group) the per-rank shard files
  are read directly: ZeRO-3 keeps the fp32 master weights as one flat partition per optimizer
  sub-group per rank (``fp32_flat_groups``); each parameter contributes ``ceil(numel / n)``
  elements to each of the ``n`` ranks of its sub-group's partition group, in ``param_shapes``
  order. Dense sub-groups are partitioned over all ranks; AutoEP expert sub-groups over the
  expert-data-parallel group of one expert-parallel rank, whose global expert ids are in that
  rank's ``ds_autoep_layers`` entry. The experts are put back in global order, re-fused to the
  model's layout, renamed, tied copies restored, and everything is cast and written with
  safetensors. The source directory is only ever read.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

META_FILE = "zeromoe_meta.json"
META_FORMAT = "lightning_zeromoe/export-meta"
META_VERSION = 1
_DTYPES = ("float32", "bfloat16", "float16")


class ExportError(ValueError):
    """A checkpoint cannot be exported; the message names the problem and the fix. It starts with
    ``[<entry-id>] `` (export-checkpoint-dir, export-output or export-shards), the troubleshooter
    knowledge-base entry that explains it; ``entry_id`` holds that id."""

    entry_id: str | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        if message.startswith("[") and "] " in message:
            self.entry_id = message[1:message.index("] ")]


# =====================================================================================
# Save time: describe the trained model (called by ZeroMoEStrategy on rank 0)
# =====================================================================================


def build_meta(module: Any, ds_config: dict[str, Any], *, world_size: int, tag: str = "checkpoint") -> dict[str, Any]:
    """Describe ``module`` (the LightningModule, after AutoEP conversion) for :func:`export`.

    Names are those DeepSpeed uses in its shard files: ``module.named_parameters()`` of the
    engine's module, i.e. relative to the LightningModule.
    """
    ep_section = ds_config.get("expert_parallel") or {}
    prefix = _export_root(module)
    layers = {name: m for name, m in module.named_modules() if getattr(type(m), "_is_autoep_layer", False)}
    src = _source_names(ep_section) if layers else {}

    param_map: dict[str, str] = {}  # DeepSpeed name -> own name (1:1 tensors)
    experts: list[dict[str, Any]] = []
    unsupported: list[str] = []
    alias_ids: set[int] = set()
    for path, layer in layers.items():
        canonical = dict(layer.named_parameters(remove_duplicate=True))
        seen = {id(p) for p in canonical.values()}
        for local_name, p in layer.named_parameters(remove_duplicate=False):
            if local_name not in canonical and id(p) in seen:
                alias_ids.add(id(p))  # AutoEP aliases the router (e.g. as "gate") for HF's recorders
        entry = _expert_entry(path, layer, src)
        if isinstance(entry, str):
            unsupported.append(entry)
        else:
            experts.append(entry)
        for local_name in canonical:
            full = f"{path}.{local_name}"
            if local_name.startswith("experts."):
                continue
            own = _map_layer_tensor(local_name, src)
            if own is None:
                unsupported.append(f"{full}: AutoEP parameter with no known source in the original block")
            else:
                param_map[full] = f"{path}.{own}"

    inside = lambda n: any(n == p or n.startswith(p + ".") for p in layers)  # noqa: E731
    shapes: dict[str, list[int]] = {}
    ids: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if inside(name) and id(p) in alias_ids and name not in param_map and ".experts." not in name:
            continue
        ids.setdefault(id(p), []).append(name)
        if not inside(name):
            param_map[name] = name
        if name in param_map:
            shapes[param_map[name]] = list(getattr(p, "ds_shape", p.shape))
    for entry in experts:
        shapes.update({k: v for k, v in entry["targets_shapes"].items()})

    buffers: dict[str, str] = {}
    for name, b in _persistent_buffers(module):
        if inside(name):
            unsupported.append(f"{name}: persistent buffer inside an AutoEP layer (not in the original block)")
            continue
        buffers[name] = name
        shapes[name] = list(b.shape)

    def own(name: str) -> str | None:
        if prefix and not name.startswith(prefix):
            return None
        return name[len(prefix):]

    tied = []
    for names in ids.values():
        mapped = [own(param_map[n]) for n in names if n in param_map]
        mapped = [m for m in mapped if m is not None]
        if len(mapped) > 1:
            tied.append(mapped)
    outside = sorted(n for n in list(param_map.values()) + list(buffers) if own(n) is None)

    float_dtypes = [p.dtype for p in module.parameters() if p.is_floating_point()]
    dtype = str(float_dtypes[0]).replace("torch.", "") if float_dtypes else "float32"
    return {
        "format": META_FORMAT,
        "version": META_VERSION,
        "tag": tag,
        "world_size": int(world_size),
        "ep_size": int(ep_section.get("autoep_size", 1)) if ep_section.get("enabled") else 1,
        "prefix": prefix,
        "dtype": dtype,
        "params": {ds: own(o) for ds, o in param_map.items() if own(o) is not None},
        "buffers": {ds: own(o) for ds, o in buffers.items() if own(o) is not None},
        "experts": [{k: v for k, v in e.items() if k != "targets_shapes"} | {
            "targets": {part: own(n) for part, n in e["targets"].items()}} for e in experts],
        "tied": tied,
        "shapes": {own(n): s for n, s in shapes.items() if own(n) is not None},
        "outside_prefix": outside,
        "unsupported": unsupported,
        "model": _model_description(module, prefix),
        "versions": _versions(),
    }


def _export_root(module: Any) -> str:
    """The LightningModule path of the model users load: an HF model, or a self-described model.

    Returned with a trailing dot (``"model."``), or ``""`` to export the whole LightningModule.
    """
    for name, m in module.named_modules():
        config = getattr(m, "config", None)
        if name and (hasattr(config, "model_type") and hasattr(config, "to_dict")
                     or isinstance(getattr(type(m), "autoep_pattern", None), dict)):
            return name + "."
    return ""


def _source_names(ep_section: dict[str, Any]) -> dict[str, Any]:
    """Router / experts / weight names of the original blocks, as AutoEP resolved them."""
    names: dict[str, Any] = {"router": "gate", "experts": "experts", "w1": "gate_up_proj", "w2": "down_proj",
                             "w3": None, "storage": "fused_3d", "shared": "", "shared_gate": ""}
    preset_name = ep_section.get("preset_model")
    if preset_name:
        from deepspeed.module_inject.auto_ep_presets.registry import get_preset

        preset = get_preset(preset_name)
        names.update(router=preset.router_pattern, experts=preset.experts_pattern, w1=preset.expert_w1,
                     w2=preset.expert_w2, w3=preset.expert_w3, storage=preset.expert_storage,
                     shared=preset.shared_experts_pattern if preset.has_shared_experts else "",
                     shared_gate=preset.shared_experts_gate_pattern if preset.has_shared_experts else "")
        names["preset"] = preset_name
    for key, ours in (("router_pattern", "router"), ("expert_pattern", "experts"), ("expert_w1", "w1"),
                      ("expert_w2", "w2"), ("expert_w3", "w3")):
        if key in ep_section:
            names[ours] = ep_section[key]
    return names


def _map_layer_tensor(local_name: str, src: dict[str, Any]) -> str | None:
    """AutoEP layer tensor name (``router.gate.weight``) -> the original block's (``gate.weight``)."""
    if local_name in ("router.gate.weight", "router.gate.bias"):
        return f"{src['router']}.{local_name.rsplit('.', 1)[1]}"
    for ours, theirs in (("shared_experts_gate.", src.get("shared_gate")), ("shared_experts.", src.get("shared"))):
        if local_name.startswith(ours) and theirs:
            return theirs + "." + local_name[len(ours):]
    return None


def _expert_entry(path: str, layer: Any, src: dict[str, Any]) -> dict[str, Any] | str:
    if src.get("storage") != "fused_3d":
        return (f"{path}: experts stored as {src.get('storage')!r} (one module per expert); export supports "
                "fused 3-D expert tensors (transformers >= 5 layout)")
    w1 = layer.experts.w1
    w2 = layer.experts.w2
    local = list(getattr(w1, "ds_shape", w1.shape))
    down = list(getattr(w2, "ds_shape", w2.shape))
    num_experts = int(layer.num_experts)
    ffn, hidden = local[1], local[2]
    exp = f"{path}.{src['experts']}"
    if src["w3"] is None:
        # AutoEP splits a fused gate_up_proj [E, 2*ffn, hidden] into w1 = gate half, w3 = up half
        # (ep_repack._repack_fused_3d, layout "gate_up_first"). The "hidden_first" layout
        # ([E, hidden, 2*ffn]) cannot be told apart once repacked; it is not produced by the
        # presets this DeepSpeed ships (mixtral, qwen3_moe, qwen3_5_moe, deepseek, minimax).
        targets = {"gate_up": f"{exp}.{src['w1']}", "down": f"{exp}.{src['w2']}"}
        shapes = {targets["gate_up"]: [num_experts, 2 * ffn, hidden], targets["down"]: [num_experts, *down[1:]]}
        layout = "gate_up_first"
    else:
        targets = {"gate": f"{exp}.{src['w1']}", "up": f"{exp}.{src['w3']}", "down": f"{exp}.{src['w2']}"}
        shapes = {targets["gate"]: [num_experts, ffn, hidden], targets["up"]: [num_experts, ffn, hidden],
                  targets["down"]: [num_experts, *down[1:]]}
        layout = "separate"
    return {"module_path": path, "num_experts": num_experts, "num_local_experts": int(layer.num_local_experts),
            "ep_size": int(layer.ep_size), "layout": layout,
            "sources": {w: f"{path}.experts.{w}" for w in ("w1", "w2", "w3")},
            "targets": targets, "targets_shapes": shapes}


def _persistent_buffers(module: Any) -> Iterable[tuple[str, Any]]:
    for mod_name, mod in module.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf


def _model_description(module: Any, prefix: str) -> dict[str, Any]:
    root = module.get_submodule(prefix[:-1]) if prefix else module
    cls = type(root)
    info: dict[str, Any] = {"class": f"{cls.__module__}.{cls.__qualname__}", "config": None, "config_kind": None}
    config = getattr(root, "config", None)
    try:
        if hasattr(config, "to_json_string"):
            info["config"], info["config_kind"] = json.loads(config.to_json_string()), "transformers"
        elif is_dataclass(config) and not isinstance(config, type):
            info["config"], info["config_kind"] = json.loads(json.dumps(asdict(config), default=str)), "dataclass"
    except (TypeError, ValueError):  # an unserialisable config is only informational
        pass
    return info


def _versions() -> dict[str, str]:
    out = {}
    for dist_name in ("deepspeed", "torch", "lightning", "transformers", "lightning-zeromoe"):
        try:
            from importlib.metadata import version

            out[dist_name] = version(dist_name)
        except Exception:  # noqa: BLE001 - informational
            pass
    return out


def write_meta(meta: dict[str, Any], ckpt_dir: str | os.PathLike) -> Path:
    """Write ``zeromoe_meta.json`` into the checkpoint directory (atomically)."""
    path = Path(ckpt_dir) / META_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1, sort_keys=False))
    os.replace(tmp, path)
    return path


# =====================================================================================
# Export time: read the shards, reassemble, rename, write safetensors
# =====================================================================================

_MODEL_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")


def export(ckpt_dir: str | os.PathLike, out_path: str | os.PathLike, *, dtype: str = "auto", overwrite: bool = False,
           progress: bool | Callable[[str], None] = True) -> Path:
    """Write the model in a ZeRO-3 + AutoEP checkpoint as one safetensors file, with its own names.

    Args:
        ckpt_dir: What ``trainer.save_checkpoint(path)`` / ``ModelCheckpoint`` wrote under
            :class:`~lightning_zeromoe.ZeroMoEStrategy`: a directory with ``latest``,
            ``checkpoint/`` (DeepSpeed's per-rank shards) and ``zeromoe_meta.json``.
        out_path: The ``.safetensors`` file to write. Never inside ``ckpt_dir``.
        dtype: ``"auto"`` (the dtype the model trained in, what the engine computed with),
            ``"float32"`` (the fp32 master weights as they are), ``"bfloat16"`` or ``"float16"``.
        overwrite: Replace an existing ``out_path``. Off by default: nothing you had is replaced.
        progress: Print progress lines to stderr (True), stay quiet (False), or a callable.

    Returns the path written. Raises :class:`ExportError` for anything wrong with the input.
    """
    say = _progress(progress)
    t0 = time.perf_counter()
    ckpt_dir, meta = _locate(Path(ckpt_dir))
    out_path = Path(out_path)
    _check_output(out_path, ckpt_dir, overwrite)
    target_dtype = _target_dtype(dtype, meta)
    shards = _shard_files(ckpt_dir, meta)
    say(f"reading {len(shards)} ranks' shards from {ckpt_dir / meta['tag']}")

    ranks = []
    for rank, (model_file, optim_file) in enumerate(shards):
        model_states = _load(model_file, optimizer=False)
        optim_states = _load(optim_file, optimizer=True)
        ranks.append(_rank_view(rank, model_file, optim_file, model_states, optim_states))
        size = (model_file.stat().st_size + optim_file.stat().st_size) / 2**20
        say(f"  rank {rank}: {size:.1f} MiB read ({time.perf_counter() - t0:.1f} s)")

    dense, expert_parts = _reassemble(ranks)
    say(f"reassembled {len(dense)} dense and {len(expert_parts)} expert tensors ({time.perf_counter() - t0:.1f} s)")
    state = _rename(dense, expert_parts, ranks[0]["buffers"], meta)
    if meta.get("outside_prefix"):
        say(f"not exported, outside the model at '{meta['prefix'][:-1]}': {_short_list(meta['outside_prefix'])}")
    state = {k: v.to(target_dtype).contiguous() for k, v in state.items()}
    _write(state, out_path, meta, ckpt_dir, target_dtype)
    total = sum(v.numel() for v in state.values())
    say(f"wrote {len(state)} tensors ({total:,} values, {str(target_dtype).replace('torch.', '')}) to {out_path} "
        f"in {time.perf_counter() - t0:.1f} s")
    return out_path


def _progress(progress: bool | Callable[[str], None]) -> Callable[[str], None]:
    if callable(progress):
        return progress
    if progress:
        return lambda line: print(f"[zeromoe-export] {line}", file=sys.stderr, flush=True)
    return lambda line: None


def _locate(path: Path) -> tuple[Path, dict[str, Any]]:
    if not path.exists():
        raise ExportError(f"[export-checkpoint-dir] checkpoint directory not found: {path}. Pass the directory that "
                          "trainer.save_checkpoint(...) or ModelCheckpoint wrote (it holds 'latest' and 'checkpoint/').")
    if not path.is_dir():
        raise ExportError(f"[export-checkpoint-dir] {path} is a file, not a checkpoint directory. Under DeepSpeed, "
                          "trainer.save_checkpoint(...) writes a directory; pass that directory.")
    if not (path / META_FILE).is_file() and (path.parent / META_FILE).is_file():
        path = path.parent  # the user pointed at checkpoint/ inside it
    meta_path = path / META_FILE
    if not meta_path.is_file():
        deepspeed_like = (path / "latest").is_file() or any(path.glob("*/zero_pp_rank_*_model_states.pt"))
        if deepspeed_like:
            raise ExportError(f"[export-checkpoint-dir] {path} has no {META_FILE}: it was not written by ZeroMoEStrategy (or by an older "
                              "version), so the names of the model's own parameters are unknown. Load it with "
                              "Trainer(strategy=ZeroMoEStrategy(...)) and call trainer.save_checkpoint(...) again; "
                              "without expert parallelism, DeepSpeed's zero_to_fp32 also works.")
        raise ExportError(f"[export-checkpoint-dir] {path} is not a DeepSpeed checkpoint directory (no 'latest', no "
                          f"zero_pp_rank_*_model_states.pt, no {META_FILE}). Pass the directory that "
                          "trainer.save_checkpoint(...) wrote.")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ExportError(f"[export-checkpoint-dir] {meta_path} is unreadable ({err}). It is rewritten by every "
                          "trainer.save_checkpoint(...) under ZeroMoEStrategy; save the checkpoint again.") from None
    if meta.get("format") != META_FORMAT or meta.get("version") != META_VERSION:
        raise ExportError(f"[export-checkpoint-dir] {meta_path} has format {meta.get('format')!r} version {meta.get('version')!r}; this "
                          f"exporter reads {META_FORMAT!r} version {META_VERSION}. Use the lightning_zeromoe "
                          "version that trained the model.")
    if meta.get("unsupported"):
        raise ExportError("[export-shards] this checkpoint's model has parts the exporter cannot map back to the model's own names: "
                          + "; ".join(meta["unsupported"]) + ". Convert it with DeepSpeed's ds_to_universal instead "
                          "(AutoEP names), or report the model to lightning_zeromoe.")
    latest = path / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        if tag != meta["tag"]:
            raise ExportError(f"[export-checkpoint-dir] {latest} names tag {tag!r} but {META_FILE} describes {meta['tag']!r}: the directory "
                              "mixes two saves. Export a directory written by one trainer.save_checkpoint(...).")
    return path, meta


def _check_output(out_path: Path, ckpt_dir: Path, overwrite: bool) -> None:
    resolved = out_path.resolve()
    if resolved == ckpt_dir.resolve() or ckpt_dir.resolve() in resolved.parents:
        raise ExportError(f"[export-output] refusing to write {out_path} inside the checkpoint directory {ckpt_dir}: the source "
                          "checkpoint is never modified. Choose a path outside it.")
    if out_path.exists() and not overwrite:
        raise ExportError(f"[export-output] {out_path} already exists. Choose another path, or pass --overwrite "
                          "(overwrite=True) to replace it.")
    if not out_path.parent.is_dir():
        raise ExportError(f"[export-output] output directory {out_path.parent} does not exist. Create it first.")


def _target_dtype(dtype: str, meta: dict[str, Any]) -> Any:
    import torch

    name = meta.get("dtype", "float32") if dtype == "auto" else dtype
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(name, name)
    if name not in _DTYPES:
        raise ExportError(f"[export-output] unsupported dtype {dtype!r}; choose auto, float32, bfloat16 or float16.")
    return getattr(torch, name)


def _shard_files(ckpt_dir: Path, meta: dict[str, Any]) -> list[tuple[Path, Path]]:
    tag_dir = ckpt_dir / meta["tag"]
    if not tag_dir.is_dir():
        raise ExportError(f"[export-checkpoint-dir] {tag_dir} is missing: the DeepSpeed shards of this checkpoint are gone. Copy the whole "
                          "directory that trainer.save_checkpoint(...) wrote, including its 'checkpoint/' folder.")
    found: dict[int, Path] = {}
    for f in tag_dir.iterdir():
        m = _MODEL_FILE.fullmatch(f.name)
        if m:
            if int(m.group(2)) != 0:
                raise ExportError(f"[export-shards] {f.name}: tensor/pipeline-parallel shards (mp_rank > 0) are not supported.")
            found[int(m.group(1))] = f
    world = int(meta["world_size"])
    missing = [r for r in range(world) if r not in found]
    if missing or len(found) != world:
        raise ExportError(f"[export-checkpoint-dir] {tag_dir} holds model shards for ranks {sorted(found)} but the run had {world} ranks "
                          f"(missing: {missing or 'none'}; extra: {sorted(set(found) - set(range(world))) or 'none'}). "
                          "Copy every rank's files: each holds a different part of the model.")
    pairs = []
    for r in range(world):
        optim = tag_dir / found[r].name.replace("_model_states.pt", "_optim_states.pt")
        if not optim.is_file():
            raise ExportError(f"[export-checkpoint-dir] {optim} is missing: under ZeRO-3 the weights live in the optimizer shards "
                              "(fp32 master copies). Copy every rank's *_optim_states.pt file.")
        pairs.append((found[r], optim))
    return pairs


class _DeepSpeedObject:
    """Stand-in for a DeepSpeed object in a shard that export does not read (the loss scaler)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _enum_value(value: Any = None) -> Any:
    return value


#: The only non-tensor globals DeepSpeed 0.19 puts in a ZeRO-3 optimizer shard. Mapping them to
#: stand-ins keeps ``weights_only=True`` and means export needs neither DeepSpeed nor its import time.
_SHARD_GLOBALS = [
    (_enum_value, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_DeepSpeedObject, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_DeepSpeedObject, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
]


def _load(path: Path, *, optimizer: bool) -> dict[str, Any]:
    """``torch.load`` with ``weights_only=True``. A model shard whose client state (Lightning
    hyper-parameters) holds arbitrary objects is read with a full unpickle instead: the file is
    the user's own checkpoint, which Lightning itself loads that way."""
    import pickle

    import torch

    try:
        try:
            with torch.serialization.safe_globals(_SHARD_GLOBALS):
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as err:
            if optimizer and "global" in str(err).lower():
                raise ExportError(f"[export-shards] shard {path} holds objects this exporter does not know ({_unsupported_global(err)}); "
                                  "it was probably written by a newer DeepSpeed. Report it with your DeepSpeed "
                                  "version.") from None
            if optimizer:
                raise
            return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, ValueError) as err:
        reason = (str(err).splitlines() or [type(err).__name__])[0].split(". ")[0][:200]
        raise ExportError(f"[export-shards] shard {path} is unreadable ({reason}): it is truncated or corrupt, e.g. an interrupted "
                          "copy or a full disk at save time. Copy it again from the training machine, or export "
                          "an earlier checkpoint.") from None


def _unsupported_global(err: Exception) -> str:
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    return found.group(1) if found else str(err).splitlines()[0][:120]


def _rank_view(rank: int, model_file: Path, optim_file: Path, model_states: dict[str, Any],
               optim_states: dict[str, Any]) -> dict[str, Any]:
    """The parts of one rank's shards the export reads, checked for shape."""
    osd = optim_states.get("optimizer_state_dict") if isinstance(optim_states, dict) else None
    if not isinstance(osd, dict) or "fp32_flat_groups" not in osd or "param_shapes" not in model_states:
        raise ExportError(f"[export-shards] {optim_file} / {model_file} are not ZeRO stage-3 shards (no fp32_flat_groups / "
                          "param_shapes). Export reads checkpoints of ZeroMoEStrategy(stage=3).")
    flats = osd["fp32_flat_groups"]
    shapes = model_states["param_shapes"]
    groups = osd.get("ds_zero_partition_groups")
    if groups is None:  # plain ZeRO-3: every sub-group partitioned over all ranks
        world = int(osd.get("partition_count", model_states.get("dp_world_size", 1)))
        groups = [{"sub_group": i, "partition_count": world, "partition_rank": rank,
                   "partition_ranks": list(range(world)), "families": ["replicated"]} for i in range(len(flats))]
    if not (len(flats) == len(shapes) == len(groups)):
        raise ExportError(f"[export-shards] {model_file}: {len(shapes)} parameter groups but {len(flats)} flat fp32 partitions in "
                          f"{optim_file.name}: the two files come from different saves. Copy both from one save.")
    layers = {e["expert_key_prefix"]: e for e in (model_states.get("ds_autoep_layers") or [])}
    buffers = {n: model_states["module"][n] for n in (model_states.get("buffer_names") or [])
               if n in model_states.get("module", {})}
    frozen = model_states.get("frozen_param_shapes") or {}
    if frozen:
        raise ExportError(f"[export-shards] {model_file}: frozen parameters ({', '.join(list(frozen)[:4])}...) are stored apart from "
                          "the optimizer; exporting them is not supported yet. Unfreeze them before saving "
                          "(requires_grad=True with lr 0 keeps them fixed).")
    return {"rank": rank, "file": model_file, "flats": flats, "groups": groups,
            "shapes": [dict(s) for s in shapes], "layers": layers, "buffers": buffers,
            "shared": dict(model_states.get("shared_params") or {})}


def _reassemble(ranks: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, dict[int, Any]]]:
    """Full fp32 tensors from the flat partitions.

    Returns dense ``{name: tensor}`` and experts ``{name: {global_expert_id: tensor[...]}}``.
    """
    import torch

    dense: dict[str, Any] = {}
    experts: dict[str, dict[int, Any]] = {}
    num_groups = len(ranks[0]["groups"])
    for r in ranks:
        if len(r["groups"]) != num_groups:
            raise ExportError(f"[export-shards] {r['file']} has {len(r['groups'])} parameter groups, rank 0 has {num_groups}: "
                              "the shards come from different runs. Copy all ranks' files from one save.")
    for g in range(num_groups):
        partitions: dict[tuple[int, ...], dict[int, dict[str, Any]]] = {}
        for r in ranks:
            info = r["groups"][g]
            key = tuple(info["partition_ranks"])
            partitions.setdefault(key, {})[int(info["partition_rank"])] = r
        for key, members in partitions.items():
            count = len(key)
            if sorted(members) != list(range(count)):
                raise ExportError(f"[export-shards] parameter group {g}: partition ranks {key} expected, found shards for "
                                  f"{sorted(members)}. Copy every rank's files from one save.")
            first = members[0]
            names = first["shapes"][g]
            for m in members.values():
                if list(m["shapes"][g]) != list(names):
                    raise ExportError(f"[export-shards] {m['file']}: parameter group {g} lists other parameters than rank "
                                      f"{first['rank']}'s: the shards come from different runs.")
            families = first["groups"][g].get("families") or ["replicated"]
            offset = 0
            for name, shape in names.items():
                shape = tuple(int(s) for s in shape)
                numel = math.prod(shape)
                part = math.ceil(numel / count)
                pieces = []
                for p in range(count):
                    flat = members[p]["flats"][g]
                    if flat.numel() < offset + part:
                        raise ExportError(f"[export-shards] {members[p]['file'].name.replace('model_states', 'optim_states')}: its "
                                          f"fp32 partition of group {g} ends at {flat.numel()} values, before "
                                          f"{name} ({offset + part} needed): the shard does not belong to this "
                                          "model. Copy every rank's files from one save.")
                    pieces.append(flat.narrow(0, offset, part))
                offset += part
                full = torch.cat(pieces)[:numel].view(shape).clone()
                if "autoep_expert" in families:
                    layer = first["layers"].get(name.rsplit(".", 1)[0])
                    if layer is None:
                        raise ExportError(f"[export-shards] {first['file']}: expert parameter {name} has no ds_autoep_layers entry.")
                    ids = _global_experts(layer)
                    if len(ids) != shape[0]:
                        raise ExportError(f"[export-shards] {name}: rank holds {shape[0]} experts but its placement lists {ids}.")
                    slot = experts.setdefault(name, {})
                    for i, e in enumerate(ids):
                        slot[e] = full[i]
                else:
                    if name in dense:
                        raise ExportError(f"[export-shards] {name} appears in two partition groups; the shards are inconsistent.")
                    dense[name] = full
    return dense, experts


def _global_experts(layer: dict[str, Any]) -> list[int]:
    placement = layer.get("expert_placement")
    if placement:
        for entry in placement["ranks"]:
            if int(entry["rank"]) == int(layer["ep_rank"]):
                return [int(e) for e in entry["experts"]]
    return list(range(int(layer["global_expert_start"]), int(layer["global_expert_end"])))


def _rename(dense: dict[str, Any], experts: dict[str, dict[int, Any]], buffers: dict[str, Any],
            meta: dict[str, Any]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    problems: list[str] = []
    params, buffer_map = meta["params"], meta.get("buffers", {})
    for ds_name, own in params.items():
        if ds_name in dense:
            out[own] = dense.pop(ds_name)
    for ds_name, own in buffer_map.items():
        if ds_name in buffers:
            out[own] = buffers[ds_name]
        else:
            problems.append(f"buffer {ds_name} is not in the model shard")
    for entry in meta["experts"]:
        src, tgt = entry["sources"], entry["targets"]
        full = {}
        for w, ds_name in src.items():
            parts = experts.pop(ds_name, None)
            if parts is None:
                problems.append(f"{ds_name} is not in the shards")
                continue
            if sorted(parts) != list(range(entry["num_experts"])):
                problems.append(f"{ds_name}: experts {sorted(parts)} found, expected 0..{entry['num_experts'] - 1}")
                continue
            full[w] = torch.stack([parts[e] for e in range(entry["num_experts"])])
        if len(full) != 3:
            continue
        if entry["layout"] == "gate_up_first":
            out[tgt["gate_up"]] = torch.cat([full["w1"], full["w3"]], dim=1)
            out[tgt["down"]] = full["w2"]
        elif entry["layout"] == "separate":
            out[tgt["gate"]], out[tgt["up"]], out[tgt["down"]] = full["w1"], full["w3"], full["w2"]
        else:
            problems.append(f"{entry['module_path']}: unknown expert layout {entry['layout']!r}")
    # Tied groups: DeepSpeed stores one member; every name the model has gets its own copy
    # (safetensors files cannot alias, and load_state_dict(strict=True) wants every name).
    for group in meta.get("tied", []):
        present = [n for n in group if n in out]
        if not present:
            problems.append(f"tied group {group}: no member is in the shards")
            continue
        for n in group:
            if n not in out:
                out[n] = out[present[0]].clone()
    outside = set(meta.get("outside_prefix", []))
    leftovers = [n for n in list(dense) + list(experts) if n not in outside and n not in params]
    if leftovers:
        problems.append(f"the shards hold parameters {_short_list(leftovers)} that {META_FILE} does not describe")
    shapes = meta.get("shapes", {})
    missing = [n for n in shapes if n not in out]
    if missing:
        problems.append(f"missing from the shards: {_short_list(missing)}")
    wrong = [f"{n} {list(out[n].shape)} != {s}" for n, s in shapes.items() if n in out and list(out[n].shape) != s]
    if wrong:
        problems.append("shapes differ: " + _short_list(wrong))
    if problems:
        raise ExportError(f"[export-shards] the checkpoint shards do not match the model described by {META_FILE} (a mismatched "
                          f"model or mixed files): {'; '.join(problems)}. Export the directory exactly as "
                          "trainer.save_checkpoint(...) wrote it; do not mix files from different runs.")
    return out


def _short_list(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _write(state: dict[str, Any], out_path: Path, meta: dict[str, Any], ckpt_dir: Path, dtype: Any) -> None:
    from safetensors.torch import save_file

    info = {"format": "pt", "producer": "lightning_zeromoe.export", "source": str(ckpt_dir),
            "model_class": str(meta.get("model", {}).get("class")), "dtype": str(dtype).replace("torch.", "")}
    tmp = out_path.with_name(f".{out_path.name}.partial")
    try:
        save_file(state, str(tmp), metadata=info)
        os.replace(tmp, out_path)
    finally:
        if tmp.exists():
            tmp.unlink()
