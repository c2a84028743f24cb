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
  (The mapping itself is :mod:`lightning_zeromoe.autoep_names`; ``load_full_weights=True`` uses
  it too, in :mod:`lightning_zeromoe.full_weights`.)
* :func:`repair_optimizer_after_universal_load`: two DeepSpeed 0.19.8 slips in that load, undone.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from lightning_zeromoe.autoep_names import (ENTRY_ID, EXPERT_WEIGHTS as _EXPERT_WEIGHTS, BlockNames, ResumeShapeError,
                                            block_names, fuse_experts, names_for, own_name, split_experts)

SUFFIX = ".universal"
MARKER = "zeromoe_universal.json"


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
                     target_ep_section: Mapping[str, Any] | None = None,
                     log: Callable[[str], None] = print,
                     layouts: Mapping[str, Any] | None = None) -> tuple[Path, bool]:
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
                add_target_names(out, saved, target_params, target_ep_section, layouts)
                return out, False
            tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
            try:
                log(f"converting {saved.path} ({saved.shape}) with deepspeed's ds_to_universal into {out}")
                _run_ds_to_universal(saved.tag_dir, tmp / saved.tag)
                (tmp / MARKER).write_text(json.dumps({"source": _fingerprint(saved), "tag": saved.tag,
                                                      "saved_shape": str(saved.shape)}))
                add_target_names(tmp, saved, target_params, target_ep_section, layouts)
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



def add_target_names(uc_dir: Path, saved: SavedCheckpoint, target_params: Mapping[str, tuple[int, ...]],
                     target_ep_section: Mapping[str, Any] | None = None,
                     layouts: Mapping[str, Any] | None = None) -> list[str]:
    """Make every parameter the target engine will look up exist in the universal checkpoint.

    ``target_params``: the trainable parameters of the engine's module, name -> shape as DeepSpeed
    records it (``ds_shape``). With expert parallelism on both sides the names already match.
    From AutoEP to none, the AutoEP tensors are written again under the model's own names; from
    none to AutoEP (``target_ep_section`` names the blocks' tensors), the other way round.
    ``layouts`` (discovery's ``BlockLayout`` per block path) give each block's own names where the
    sections have aliases (a nested router such as HunYuan's ``gate.wg``). Idempotent. Returns the
    names written. Raises listing what is still missing.
    """
    zero = uc_dir / saved.tag / "zero"
    written = []
    target_blocks = sorted({n[:-len(".experts.w1")] for n in target_params if n.endswith(".experts.w1")})
    if saved.experts and not target_blocks:
        section = block_names(saved.ep_section)
        for block in saved.experts:
            written += _write_own_names(zero, block, names_for(block, section, layouts), target_params)
    elif target_blocks and not saved.experts:
        section = block_names(target_ep_section or {})
        for block in target_blocks:
            written += _write_autoep_names(zero, block, names_for(block, section, layouts), target_params)
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
            parts[w] = _load_state(zero / f"{block}.experts.{w}" / f"{key}.pt")
        for target, tensor in fuse_experts(parts["w1"], parts["w2"], parts["w3"], names, shapes).items():
            dest = zero / (experts_prefix + target)
            dest.mkdir(exist_ok=True)
            torch.save({"param": tensor.contiguous()}, dest / f"{key}.pt")
    written += [experts_prefix + t for t in targets]
    return written


def _load_state(path: Path) -> torch.Tensor:
    """One universal state file: DeepSpeed writes a bare tensor or ``{"param": tensor, ...}``."""
    if not path.is_file():
        raise ResumeShapeError(f"{path} is missing from the converted checkpoint.")
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state["param"] if isinstance(state, dict) else state


def _saved_shapes(tag_dir: Path) -> dict[str, tuple[int, ...]]:
    """Full parameter shapes as the source run's model states list them (``param_shapes``)."""
    files = sorted(tag_dir.glob("*_model_states.pt"))
    state = torch.load(files[0], map_location="cpu", weights_only=False) if files else {}
    return {name: tuple(shape) for group in state.get("param_shapes", []) for name, shape in group.items()}


def _write_autoep_names(zero: Path, block: str, names: BlockNames,
                        target_params: Mapping[str, tuple[int, ...]]) -> list[str]:
    """No expert parallelism -> AutoEP: the inverse of :func:`_write_own_names`."""
    from deepspeed.checkpoint.constants import CAT_DIM, EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS, PARAM

    written = []
    for name in target_params:
        local = name[len(block) + 1:] if name.startswith(block + ".") else None
        if local is None or local.startswith("experts."):
            continue
        own = own_name(local, names)
        src, dest = zero / f"{block}.{own}", zero / name
        if own is not None and src.is_dir() and not dest.exists():
            shutil.copytree(src, dest)
            written.append(name)
    if all((zero / f"{block}.experts.{w}" / "fp32.pt").is_file() for w in _EXPERT_WEIGHTS):
        return written
    prefix = f"{block}.{names.experts}."
    sources = [n for n in (names.w1, names.w2, names.w3) if n]
    shapes = _saved_shapes(zero.parent)  # ZeRO-3 universal files of dense tensors are flat
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        full = {}
        for n in sources:
            if prefix + n not in shapes:
                raise ResumeShapeError(f"{prefix + n}: the checkpoint has no such parameter, so its experts cannot "
                                       "be split for expert parallelism; resume with the model that was trained.")
            full[n] = _load_state(zero / (prefix + n) / f"{key}.pt").reshape(shapes[prefix + n])
        parts = split_experts(full, names)
        for w, tensor in parts.items():
            dest = zero / f"{block}.experts.{w}"
            dest.mkdir(exist_ok=True)
            torch.save({PARAM: tensor.contiguous(), CAT_DIM: 0, EP_IS_EXPERT_PARAM: True,
                        EP_NUM_EXPERTS: int(tensor.shape[0])}, dest / f"{key}.pt")
    return written + [f"{block}.experts.{w}" for w in _EXPERT_WEIGHTS]


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


__all__ = ["ENTRY_ID", "ResumeShapeError", "SavedCheckpoint", "Shape", "add_target_names", "ensure_universal",
           "plan_resume", "read_saved", "repair_optimizer_after_universal_load", "universal_dir", "universal_loading"]
