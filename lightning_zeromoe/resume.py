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
* Between expert parallelism and none the parameter names differ; the universal tensors are
  written again under the names the target model uses (:mod:`lightning_zeromoe.universal_names`).
* :func:`repair_optimizer_after_universal_load`: two DeepSpeed 0.19.8 slips in that load, undone.
* :func:`load_on_new_shape`: all of it, on every rank, as ``ZeroMoEStrategy.load_checkpoint`` runs it.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from lightning_zeromoe.autoep_names import ENTRY_ID, ResumeShapeError
from lightning_zeromoe.universal_names import add_target_names, saved_shapes

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


def load_on_new_shape(engine: Any, saved: SavedCheckpoint, target: Shape, *, ep_section: Mapping[str, Any] | None,
                      layouts: Mapping[str, Any], is_global_zero: bool, broadcast: Callable[[Any], Any],
                      fitting: bool, strict: bool, info: Callable[[str], None],
                      warn: Callable[[str], None]) -> dict[str, Any]:
    """Load ``saved`` into ``engine`` on the shape now running, on every rank; returns the client state.

    Rank 0 converts it once (:func:`ensure_universal`, reused later) while the other ranks wait at
    ``broadcast``; a failure there is raised on every rank, so none is left waiting. Then every rank
    re-partitions weights (and, when ``fitting``, the optimizer state, repaired with
    :func:`repair_optimizer_after_universal_load`) for itself, and frozen parameters, which the
    universal checkpoint leaves out, are restored from the saved partitions
    (:mod:`lightning_zeromoe.frozen_state`).
    """
    from lightning_zeromoe.frozen_state import restore_frozen

    start = time.monotonic()
    outcome: list[Any] = [None, None, ""]  # universal dir, converted now, error message
    failure: BaseException | None = None
    if is_global_zero:
        try:
            trainable = {name: tuple(getattr(p, "ds_shape", p.shape))
                         for name, p in engine.module.named_parameters() if p.requires_grad}
            outcome[0], outcome[1] = ensure_universal(saved, trainable, ep_section, log=info, layouts=layouts)
        except Exception as err:  # noqa: BLE001 - every rank must hear of it, or they wait at the broadcast
            failure, outcome[2] = err, f"converting {saved.path} on rank 0 failed: {type(err).__name__}: {err}"
    outcome = broadcast(outcome)  # the other ranks wait here for the conversion
    if failure is not None:
        raise failure
    if outcome[2]:
        raise ResumeShapeError(outcome[2])
    with universal_loading(engine):
        _, client_state = engine.load_checkpoint(str(outcome[0]), load_optimizer_states=fitting,
                                                 load_lr_scheduler_states=False, load_module_strict=strict)
    if fitting:
        repair_optimizer_after_universal_load(engine, outcome[0], saved.tag)
    frozen, unfound = restore_frozen(engine.module, saved, ep_section, layouts)
    if unfound:
        warn(f"ZeroMoEStrategy: the checkpoint holds no value for {len(unfound)} frozen parameter(s) "
             f"({', '.join(unfound[:4])}{' ...' if len(unfound) > 4 else ''}); they keep the values "
             "the model was built with.")
    info(f"ZeroMoEStrategy: resumed {saved.path} ({saved.shape}) on {target} through DeepSpeed's "
         f"universal checkpoint {outcome[0]} ({'converted' if outcome[1] else 'reused'}"
         f"{f', {len(frozen)} frozen parameter(s) restored' if frozen else ''}, "
         f"{time.monotonic() - start:.1f} s)")
    return client_state


def saved_parameter_order(checkpoint_dir: str | os.PathLike) -> list[str]:
    """Parameter names in the order a DeepSpeed checkpoint's flat optimizer groups hold them."""
    root = Path(checkpoint_dir)
    latest = root / "latest"
    tag = latest.read_text().strip() if latest.is_file() else "checkpoint"
    return list(saved_shapes(root / tag))


__all__ = ["ENTRY_ID", "ResumeShapeError", "SavedCheckpoint", "Shape", "add_target_names", "ensure_universal",
           "load_on_new_shape", "plan_resume", "read_saved", "repair_optimizer_after_universal_load",
           "saved_parameter_order", "universal_dir", "universal_loading"]
