"""Resuming a checkpoint on another cluster shape (world size, ``ep_size``), and loading full weights.

A ZeRO-3 checkpoint is a set of per-rank partitions: DeepSpeed resumes it only on the shape that
wrote it ("The checkpoint being loaded used a DP world size of 2 but the current world size is
4 ..."). DeepSpeed 0.19.8 has the tool to change shape: its *universal checkpoint*
(``deepspeed/checkpoint/ds_to_universal.py``) rewrites the partitions as one folder per
parameter (``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt``), AutoEP experts consolidated in global
expert order, and an engine configured with ``checkpoint.load_universal`` re-partitions each
tensor for its own ranks and expert-parallel groups (``stage3.py``,
``load_hp_checkpoint_state`` / ``_slice_autoep_universal_expert_param``). So the optimizer state
comes along.

What this module adds around it:

* :func:`read_saved` / :func:`plan_resume`: the shape recorded in DeepSpeed's own files (``dp_world_size``,
  ``ds_config``, ``ds_autoep_layers``) against the shape now running; an impossible change is
  refused with a :class:`ResumeShapeError` before anything is converted.
* :func:`ensure_universal`: one conversion per checkpoint, into a sibling directory
  (``<ckpt>.universal``; never inside the user's checkpoint, which is only read), under a file
  lock, written to a temporary directory and renamed, reused while the source is unchanged.
* Between expert parallelism and none the parameter names differ: AutoEP calls them
  ``<block>.router.gate.weight`` and ``<block>.experts.w1/w2/w3`` (``[E, ffn, hidden]`` gate and
  up, ``[E, hidden, ffn]`` down); without it the model's own blocks hold ``<block>.gate.weight``
  and e.g. a fused ``gate_up_proj``. :func:`add_target_names` writes the universal tensors (weights
  *and* Adam moments, which are elementwise) under the names the target model uses.
* :func:`to_autoep_state_dict` is the same mapping for ``load_full_weights=True``: a full state
  dict (the model's own names, or AutoEP names with all experts) becomes what *this* rank's
  AutoEP layers hold.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

#: Knowledge-base entry for every refusal in this module.
ENTRY_ID = "resume-shape-unsupported"
SUFFIX = ".universal"
MARKER = "zeromoe_universal.json"
_EXPERT_WEIGHTS = ("w1", "w2", "w3")


class ResumeShapeError(RuntimeError):
    """A checkpoint cannot resume on the shape now running; the message says why and what to do."""

    entry_id = ENTRY_ID

    def __init__(self, message: str) -> None:
        super().__init__(f"[{ENTRY_ID}] {message}")


# ------------------------------------------------------------------ shapes


@dataclass(frozen=True)
class Shape:
    """The parallel layout of a run: what a ZeRO checkpoint's partitioning depends on."""

    world_size: int
    ep_size: int
    stage: int

    def __str__(self) -> str:
        return f"{self.world_size} ranks, ep_size={self.ep_size}, ZeRO stage {self.stage}"


@dataclass(frozen=True)
class SavedCheckpoint:
    """What a DeepSpeed checkpoint directory records about the run that wrote it."""

    path: Path
    tag: str
    shape: Shape
    #: AutoEP layers: module path -> number of experts (empty without expert parallelism).
    experts: dict[str, int] = field(default_factory=dict)
    #: The ``expert_parallel`` config section the run used (names of routers and expert weights).
    ep_section: dict[str, Any] = field(default_factory=dict)

    @property
    def tag_dir(self) -> Path:
        return self.path / self.tag


def read_saved(ckpt_dir: str | os.PathLike) -> SavedCheckpoint:
    """Read the shape from the ``latest`` tag's rank-0 model states (as DeepSpeed itself does on resume)."""
    path = Path(ckpt_dir)
    latest = path / "latest"
    if not latest.is_file():
        raise ResumeShapeError(f"{path} has no 'latest' file, so it is not a DeepSpeed checkpoint directory written by "
                               "trainer.save_checkpoint / ModelCheckpoint under ZeroMoEStrategy.")
    tag = latest.read_text().strip()
    files = sorted((path / tag).glob("*_model_states.pt"))
    files = [f for f in files if not f.name.startswith(("layer_", "expert_"))]
    if not files:
        raise ResumeShapeError(f"{path / tag} holds no *_model_states.pt file: the checkpoint is incomplete.")
    # DeepSpeed's model states pickle its own config objects; it loads them the same way on resume.
    state = torch.load(files[0], map_location="cpu", weights_only=False)
    config = state.get("ds_config") or {}
    stage = int((config.get("zero_optimization") or {}).get("stage", 0))
    layers = state.get("ds_autoep_layers") or []
    experts = {layer["module_path"]: int(layer["num_experts"]) for layer in layers}
    ep_sizes = {int(layer["ep_size"]) for layer in layers} or {1}
    if len(ep_sizes) > 1:
        raise ResumeShapeError(f"{path}: AutoEP layers with different ep_size {sorted(ep_sizes)}; ZeroMoEStrategy "
                               "writes one ep_size for all layers, so this checkpoint came from elsewhere.")
    world = int(state.get("dp_world_size", len(files))) * int(state.get("mp_world_size", 1))
    return SavedCheckpoint(path=path, tag=tag, shape=Shape(world, ep_sizes.pop(), stage), experts=experts,
                           ep_section=dict(config.get("expert_parallel") or {}))


def plan_resume(saved: SavedCheckpoint, target: Shape, model_experts: Mapping[str, int]) -> bool:
    """True when the checkpoint must go through a universal conversion; raises when it cannot resume.

    ``model_experts`` maps each MoE block of the model now running (module path, as in the
    checkpoint) to its number of experts.
    """
    problems = []
    if saved.shape.stage != target.stage:
        problems.append(f"it was written under ZeRO stage {saved.shape.stage} and this run uses stage {target.stage}; "
                        f"resume with stage={saved.shape.stage} (changing the stage on resume is not supported)")
    if saved.shape.stage not in (1, 2, 3) and saved.shape != target:
        problems.append("it holds no ZeRO partitions (stage 0), so DeepSpeed has no universal conversion for it")
    if saved.experts:
        differ = {p: (n, model_experts.get(p)) for p, n in saved.experts.items() if model_experts.get(p) != n}
        if differ:
            shown = ", ".join(f"{p}: {n} saved, {m if m is not None else 'no MoE block'} now" for p, (n, m)
                              in list(differ.items())[:4])
            problems.append(f"its MoE layers differ from the model's ({shown}); resume with the model that was "
                            "trained")
        bad = sorted({n for n in saved.experts.values() if n % target.ep_size})
        if bad:
            problems.append(f"ep_size={target.ep_size} does not divide the saved expert count(s) {bad}")
    if target.world_size % target.ep_size:
        problems.append(f"ep_size={target.ep_size} does not divide the world size {target.world_size}")
    if problems:
        raise ResumeShapeError(f"the checkpoint {saved.path} ({saved.shape}) cannot resume on {target}: "
                               + "; ".join(problems) + ".")
    return saved.shape != target


# ------------------------------------------------------------------ conversion


def universal_dir(saved: SavedCheckpoint) -> Path:
    """Where the converted checkpoint lives: next to the user's, never inside it."""
    return saved.path.with_name(saved.path.name + SUFFIX)


def _fingerprint(saved: SavedCheckpoint) -> list[list[Any]]:
    out = []
    for f in sorted(saved.tag_dir.iterdir()):
        if f.is_file():
            st = f.stat()
            out.append([f.name, st.st_size, st.st_mtime_ns])
    return out


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_universal(saved: SavedCheckpoint, target_params: Mapping[str, tuple[int, ...]],
                     log: Callable[[str], None] = print) -> tuple[Path, bool]:
    """Convert ``saved`` with ``ds_to_universal`` unless an up-to-date conversion exists, and make
    sure it holds every parameter of ``target_params`` (see :func:`add_target_names`).

    Returns the directory to pass to ``engine.load_checkpoint`` and whether it was converted now.
    Runs on one rank (the caller's rank 0) while the others wait; the lock also keeps two jobs
    from converting the same checkpoint at once. The source directory is only read.
    """
    out = universal_dir(saved)
    lock = out.with_name(out.name + ".lock")
    try:
        with _locked(lock):
            marker = out / MARKER
            if marker.is_file() and json.loads(marker.read_text()).get("source") == _fingerprint(saved):
                add_target_names(out, saved, target_params)
                return out, False
            tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
            try:
                log(f"converting {saved.path} ({saved.shape}) with deepspeed's ds_to_universal into {out}")
                _run_ds_to_universal(saved.tag_dir, tmp / saved.tag)
                (tmp / MARKER).write_text(json.dumps({"source": _fingerprint(saved), "tag": saved.tag,
                                                      "saved_shape": str(saved.shape)}))
                add_target_names(tmp, saved, target_params)
                if out.exists():
                    shutil.rmtree(out)
                os.replace(tmp, out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except PermissionError as err:
        raise ResumeShapeError(f"cannot write the converted checkpoint next to {saved.path} ({err}). Copy the "
                               "checkpoint directory somewhere writable and resume from the copy.") from err
    return out, True


def _run_ds_to_universal(input_folder: Path, output_folder: Path) -> None:
    """DeepSpeed's converter in this process, serially (no worker pool), its prints kept for errors."""
    import argparse

    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(input_folder), output_folder=str(output_folder), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            ds_to_universal.main(args)
    except Exception as err:
        tail = "\n".join(printed.getvalue().splitlines()[-10:])
        raise ResumeShapeError(f"deepspeed's ds_to_universal could not convert {input_folder}: "
                               f"{type(err).__name__}: {err}\n{tail}") from err


# ------------------------------------------------------------------ names: AutoEP <-> the model's own


@dataclass(frozen=True)
class BlockNames:
    """How the original MoE block names what AutoEP calls ``router.gate`` and ``experts.w1/w2/w3``."""

    router: str = "gate"
    experts: str = "experts"
    w1: str = "gate_up_proj"
    w2: str = "down_proj"
    w3: str | None = None
    shared: str = ""
    shared_gate: str = ""


def block_names(ep_section: Mapping[str, Any]) -> BlockNames:
    """The names AutoEP resolved from its preset and the config's overrides."""
    values: dict[str, Any] = {}
    preset_name = ep_section.get("preset_model")
    if preset_name:
        from deepspeed.module_inject.auto_ep_presets.registry import get_preset

        preset = get_preset(preset_name)
        values = dict(router=preset.router_pattern, experts=preset.experts_pattern, w1=preset.expert_w1,
                      w2=preset.expert_w2, w3=preset.expert_w3,
                      shared=preset.shared_experts_pattern if preset.has_shared_experts else "",
                      shared_gate=preset.shared_experts_gate_pattern if preset.has_shared_experts else "")
    for key, ours in (("router_pattern", "router"), ("expert_pattern", "experts"), ("expert_w1", "w1"),
                      ("expert_w2", "w2"), ("expert_w3", "w3"), ("shared_experts_pattern", "shared"),
                      ("shared_experts_gate_pattern", "shared_gate")):
        if key in ep_section:
            values[ours] = ep_section[key]
    return BlockNames(**values)


def own_name(autoep_local: str, names: BlockNames) -> str | None:
    """``router.gate.weight`` -> ``gate.weight`` (dense tensors of an AutoEP layer; experts excluded)."""
    if autoep_local.startswith("router.gate."):
        return f"{names.router}.{autoep_local[len('router.gate.'):]}"
    for ours, theirs in (("shared_experts_gate.", names.shared_gate), ("shared_experts.", names.shared)):
        if autoep_local.startswith(ours) and theirs:
            return theirs + "." + autoep_local[len(ours):]
    return None


def fuse_experts(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, names: BlockNames,
                 target_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """AutoEP's ``w1/w3 [E, ffn, hidden]``, ``w2 [E, hidden, ffn]`` -> the original block's tensors.

    The inverse of ``deepspeed/moe/ep_repack.py::_repack_fused_3d``: the target's own shapes tell
    the fused layout (``gate_up_first [E, 2*ffn, hidden]`` or ``hidden_first [E, hidden, 2*ffn]``).
    """
    if names.w3 is not None:
        return {names.w1: w1, names.w3: w3, names.w2: w2}
    num, ffn, hidden = w1.shape
    fused = tuple(target_shapes.get(names.w1, ()))
    if fused == (num, 2 * ffn, hidden):
        return {names.w1: torch.cat([w1, w3], dim=1), names.w2: w2}
    if fused == (num, hidden, 2 * ffn):
        return {names.w1: torch.cat([w1, w3], dim=1).transpose(1, 2).contiguous(),
                names.w2: w2.transpose(1, 2).contiguous()}
    raise ResumeShapeError(f"the model's {names.w1} has shape {list(fused)}, which fits neither fused layout of "
                           f"{num} experts x ffn {ffn} x hidden {hidden}; the checkpoint belongs to another model.")


def split_experts(tensors: Mapping[str, torch.Tensor], names: BlockNames) -> dict[str, torch.Tensor]:
    """The original block's expert tensors (all experts) -> AutoEP's ``w1, w2, w3``."""
    if names.w3 is not None:
        return {"w1": tensors[names.w1], "w2": tensors[names.w2], "w3": tensors[names.w3]}
    from deepspeed.moe.fused_expert_layout import classify_fused_gate_up_layout

    gate_up, down = tensors[names.w1], tensors[names.w2]
    layout = classify_fused_gate_up_layout(tuple(gate_up.shape), tuple(down.shape))
    if layout is None:
        raise ResumeShapeError(f"{names.w1} {list(gate_up.shape)} and {names.w2} {list(down.shape)} are no fused "
                               "expert layout AutoEP knows.")
    ffn = layout.ffn_hidden_size
    if layout.layout == "gate_up_first":
        return {"w1": gate_up[:, :ffn], "w3": gate_up[:, ffn:], "w2": down}
    return {"w1": gate_up[:, :, :ffn].transpose(1, 2), "w3": gate_up[:, :, ffn:].transpose(1, 2),
            "w2": down.transpose(1, 2)}


def add_target_names(uc_dir: Path, saved: SavedCheckpoint, target_params: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Make every parameter the target engine will look up exist in the universal checkpoint.

    ``target_params``: the trainable parameters of the engine's module, name -> full shape. With the
    same expert parallelism on both sides the names already match. From AutoEP to no expert
    parallelism the AutoEP tensors are written again under the model's own names. Idempotent.
    Returns the names written. Raises listing what is still missing.
    """
    zero = uc_dir / saved.tag / "zero"
    written = []
    if saved.experts and not any(".experts.w1" in n for n in target_params):
        names = block_names(saved.ep_section)
        for block in saved.experts:
            written += _write_own_names(zero, block, names, target_params)
    missing = sorted(n for n in target_params if not (zero / n / "fp32.pt").is_file())
    if missing:
        shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
        raise ResumeShapeError(f"the converted checkpoint {uc_dir} has no state for {len(missing)} parameter(s) of "
                               f"the model now running: {shown}. The checkpoint was written by another model or "
                               f"with other trainable parameters.")
    return written


def _write_own_names(zero: Path, block: str, names: BlockNames, target_params: Mapping[str, tuple[int, ...]]) -> list[str]:
    written = []
    for entry in sorted(p for p in zero.iterdir() if p.name.startswith(block + ".")):
        local = entry.name[len(block) + 1:]
        if local.startswith("experts."):
            continue
        own = own_name(local, names)
        if own is None:
            raise ResumeShapeError(f"{entry.name}: an AutoEP parameter with no counterpart in the original block; "
                                   "resume with expert parallelism (ep_size > 1).")
        dest = zero / f"{block}.{own}"
        if not dest.exists():
            shutil.copytree(entry, dest)
            written.append(dest.name)
    experts_prefix = f"{block}.{names.experts}."
    shapes = {n[len(experts_prefix):]: tuple(s) for n, s in target_params.items() if n.startswith(experts_prefix)}
    targets = [names.w1, names.w2] + ([names.w3] if names.w3 else [])
    if all((zero / (experts_prefix + t) / "fp32.pt").is_file() for t in targets):
        return written
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        parts = {}
        for w in _EXPERT_WEIGHTS:
            src = zero / f"{block}.experts.{w}" / f"{key}.pt"
            if not src.is_file():
                raise ResumeShapeError(f"{src} is missing from the converted checkpoint.")
            parts[w] = torch.load(src, map_location="cpu", weights_only=True)["param"]
        for target, tensor in fuse_experts(parts["w1"], parts["w2"], parts["w3"], names, shapes).items():
            dest = zero / (experts_prefix + target)
            dest.mkdir(exist_ok=True)
            torch.save({"param": tensor.contiguous()}, dest / f"{key}.pt")
    written += [experts_prefix + t for t in targets]
    return written


@contextlib.contextmanager
def universal_loading(engine: Any) -> Iterator[None]:
    """Let an engine built without ``checkpoint.load_universal`` load one universal checkpoint.

    DeepSpeed reads the flag from ``engine._config.load_universal_checkpoint`` (a private
    attribute, touched only here; ``tests/test_resume.py`` fails loudly if an upgrade removes it).
    """
    config = engine._config
    if not hasattr(config, "load_universal_checkpoint"):
        raise RuntimeError("This DeepSpeed has no DeepSpeedConfig.load_universal_checkpoint; resume on another shape "
                           "needs deepspeed with universal checkpoints (0.19.8 is tested).")
    previous = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = previous


def repair_optimizer_after_universal_load(engine: Any, uc_dir: Path, tag: str) -> list[str]:
    """Undo two things DeepSpeed 0.19.8's ZeRO-3 universal load gets wrong (``stage3.py``,
    ``load_hp_checkpoint_state_from_checkpoint_dir_stage3``); returns what was repaired.

    * It stores *one* ``step`` tensor object in the state of every sub-group. ZeRO-3 steps the
      torch optimizer once per sub-group and torch's Adam increments ``step`` in place, so the
      shared counter advanced once per sub-group per step and Adam's bias correction drifted
      (measured: resumed losses off by 1e-4 to 1e-3 relative within 4 steps). Each state gets
      its own copy.
    * It copies the hyperparameters of the saved *first* parameter group into every group. The
      saved groups are put back one by one when their number matches.
    """
    repaired = []
    base = engine.optimizer.optimizer
    shared = [s for s in base.state.values() if torch.is_tensor(s.get("step"))]
    if len({id(s["step"]) for s in shared}) < len(shared):
        for s in shared:
            s["step"] = s["step"].clone()
        repaired.append(f"separate Adam step counters for {len(shared)} sub-groups")
    saved = torch.load(uc_dir / tag / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=False)
    groups = saved.get("optimizer_state_dict", {}).get("param_groups", [])
    if len(groups) == len(base.param_groups) > 1:
        for live, stored in zip(base.param_groups, groups):
            live.update({k: v for k, v in stored.items() if k != "params"})
        repaired.append(f"hyperparameters of {len(groups)} parameter groups")
    return repaired


# ------------------------------------------------------------------ load_full_weights


def autoep_layers(module: torch.nn.Module) -> dict[str, Any]:
    """The AutoEP layers of a module, by path."""
    return {name: m for name, m in module.named_modules() if getattr(type(m), "_is_autoep_layer", False)}


def local_experts(layer: Any) -> list[int]:
    """Global ids of the experts this rank's AutoEP layer holds, in its packed order."""
    from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank

    return list(autoep_experts_for_rank(layer.expert_placement_descriptor, layer.ep_rank))


def to_autoep_state_dict(state_dict: Mapping[str, torch.Tensor], module: torch.nn.Module,
                         ep_section: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A full state dict -> the tensors this rank's (AutoEP-converted) module holds.

    Accepted for each AutoEP layer: the model's own names (``<block>.gate.weight``,
    ``<block>.experts.gate_up_proj`` with all experts: a plain single-process checkpoint) or
    AutoEP's names with all experts. Expert tensors are cut to this rank's experts. Other keys
    pass through unchanged.
    """
    out = dict(state_dict)
    layers = autoep_layers(module)
    if not layers:
        return out
    names = block_names(ep_section)
    for path, layer in layers.items():
        ids = local_experts(layer)
        for local_name, _ in layer.named_parameters(remove_duplicate=True):
            if local_name.startswith("experts."):
                continue
            own = own_name(local_name, names)
            if own is not None and f"{path}.{own}" in out and f"{path}.{local_name}" not in out:
                out[f"{path}.{local_name}"] = out.pop(f"{path}.{own}")
        experts_prefix = f"{path}.{names.experts}."
        own_keys = [experts_prefix + n for n in (names.w1, names.w2, names.w3) if n]
        if all(k in out for k in own_keys):
            full = split_experts({k[len(experts_prefix):]: out.pop(k) for k in own_keys}, names)
        else:
            full = {w: out.pop(f"{path}.experts.{w}") for w in _EXPERT_WEIGHTS if f"{path}.experts.{w}" in out}
        for w, tensor in full.items():
            if tensor.shape[0] != layer.num_experts:
                raise ResumeShapeError(f"{path}.experts.{w}: the state dict holds {tensor.shape[0]} experts, the "
                                       f"layer has {layer.num_experts}; load_full_weights needs every expert.")
            out[f"{path}.experts.{w}"] = tensor[ids].contiguous()
    return out


def load_gathered(module: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Load a state dict into a ZeRO-3 module, module by module, on *every* rank.

    Each module's own parameters are gathered, loaded, and broadcast from the first rank of their
    partition group (the world for dense parameters, the expert-data-parallel group for experts,
    whose members hold the same experts). Collective: every rank must call it.
    """
    import deepspeed

    metadata = getattr(state_dict, "_metadata", None)
    missing: list[str] = []
    unexpected: list[str] = []
    errors: list[str] = []

    def load(mod: torch.nn.Module, prefix: str) -> None:
        local_metadata = {} if metadata is None else metadata.get(prefix[:-1], {})
        with deepspeed.zero.GatheredParameters(list(mod.parameters(recurse=False)), modifier_rank=0):
            mod._load_from_state_dict(dict(state_dict), prefix, local_metadata, True, missing, unexpected, errors)
        for name, child in mod._modules.items():
            if child is not None:
                load(child, prefix + name + ".")

    load(module, "")
    known = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    unexpected = sorted(k for k in state_dict if k not in known)
    if strict and (missing or unexpected or errors):
        parts = [f"missing {missing[:6]}" if missing else "", f"unexpected {unexpected[:6]}" if unexpected else "",
                 "; ".join(errors[:3])]
        raise ResumeShapeError("load_full_weights: the state dict does not fit the model: "
                               + "; ".join(p for p in parts if p) + ". Load a checkpoint of this model (its own "
                               "names, or AutoEP names with every expert), or pass strict_loading=False.")
    if errors:
        raise ResumeShapeError("load_full_weights: " + "; ".join(errors[:3]))


__all__ = ["ENTRY_ID", "BlockNames", "ResumeShapeError", "SavedCheckpoint", "Shape", "add_target_names",
           "block_names", "ensure_universal", "fuse_experts", "plan_resume", "read_saved", "split_experts",
           "to_autoep_state_dict", "universal_dir", "universal_loading"]
