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

* :func:`plan_resume`: the shape recorded in DeepSpeed's own files
  (:func:`lightning_zeromoe.checkpoint.resume.saved.read_saved`) against the shape the engine really runs
  (:func:`engine_ep_size`); an impossible change is refused with a :class:`ResumeShapeError` before
  anything is converted.
* :func:`ensure_universal`: one conversion per checkpoint, into a sibling directory
  (``<ckpt>.universal``; never inside the user's checkpoint, which is only read), under a file
  lock, written to a temporary directory and renamed, reused while the source is unchanged; every
  rank checks the copy it reads (:func:`universal_problem`).
* Between expert parallelism and none the parameter names differ; the universal tensors are
  written again under the names the target model uses (:mod:`lightning_zeromoe.checkpoint.resume.universal_names`).
* :func:`repair_optimizer_after_universal_load`: two DeepSpeed 0.19.8 slips in that load, undone.
* The universal load restores only what the optimizer owns; buffers and frozen parameters are put
  back by :mod:`lightning_zeromoe.checkpoint.resume.module_state`.
* :func:`load_on_new_shape`: all of it, on every rank, as ``ZeroMoEStrategy.load_checkpoint`` runs it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from lightning_zeromoe._private import deepspeed as ds_private
from lightning_zeromoe.checkpoint.autoep_names import ENTRY_ID, ResumeShapeError, autoep_layers
from lightning_zeromoe.checkpoint.resume.saved import SavedCheckpoint, Shape, read_saved
from lightning_zeromoe.checkpoint.resume.universal_names import add_target_names, saved_shapes
from lightning_zeromoe import knowledge
from lightning_zeromoe.knowledge import say

try:  # POSIX only; elsewhere two jobs converting the same checkpoint at once are not kept apart
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

SUFFIX = ".universal"
MARKER = "zeromoe_universal.json"


# ------------------------------------------------------------------ shapes


def engine_ep_size(module: torch.nn.Module) -> int:
    """The ``ep_size`` the engine really runs with: its AutoEP layers' (1 when no block converted,
    whatever ``ZeroMoEStrategy(ep_size=...)`` asked for; a config's ``autoep_size`` shows here too)."""
    sizes = {int(getattr(layer, "ep_size", 1)) for layer in autoep_layers(module).values()}
    if len(sizes) > 1:
        raise ResumeShapeError(say(ENTRY_ID, "mixed-ep-size", sizes=sorted(sizes)))
    return sizes.pop() if sizes else 1


def plan_resume(saved: SavedCheckpoint, target: Shape, model_experts: Mapping[str, int],
                trainable: Iterable[str] | None = None) -> bool:
    """True when the checkpoint must go through a universal conversion; raises when it cannot resume.

    ``model_experts`` maps each MoE block of the model now running (module path, as in the
    checkpoint) to its number of experts. ``trainable``: the names of the parameters that train now.
    On the same shape, a parameter trained when saved and frozen now also takes the universal path:
    DeepSpeed's own load looks it up among the saved frozen parameters and fails with a bare
    ``KeyError`` (``runtime/engine.py``, ``load_module_state_dict``).
    """
    problems = []
    if saved.shape.stage != target.stage:
        problems.append(knowledge.message(ENTRY_ID, "stage-differs").render(saved=saved.shape.stage, target=target.stage))
    if saved.shape.stage not in (1, 2, 3) and saved.shape != target:
        problems.append("it holds no ZeRO partitions (stage 0), so DeepSpeed has no universal conversion for it")
    if saved.experts:
        differ = {p: (n, model_experts.get(p)) for p, n in saved.experts.items() if model_experts.get(p) != n}
        if differ:
            shown = ", ".join(f"{p}: {n} saved, {m if m is not None else 'no MoE block'} now" for p, (n, m)
                              in list(differ.items())[:4])
            problems.append(knowledge.message(ENTRY_ID, "experts-differ").render(shown=shown))
        bad = sorted({n for n in saved.experts.values() if n % target.ep_size})
        if bad:
            problems.append(f"ep_size={target.ep_size} does not divide the saved expert count(s) {bad}")
    if target.world_size % target.ep_size:
        problems.append(f"ep_size={target.ep_size} does not divide the world size {target.world_size}")
    if problems:
        raise ResumeShapeError(say(ENTRY_ID, "cannot-resume", path=saved.path, shape=saved.shape, target=target,
                                   problems="; ".join(problems)))
    frozen_since = trainable is not None and bool(saved.trainable) and bool(set(saved.trainable) - set(trainable))
    return saved.shape != target or frozen_since


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
    """An exclusive ``flock`` on ``path``. The kernel drops it when its holder dies, so a lock file
    left by a killed job is reclaimed at once, never waited on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_leftovers(out: Path, log: Callable[[str], None]) -> None:
    """Under the lock no conversion of this checkpoint runs: temporary and trash directories next
    to ``out`` were left by a job that died (SIGKILL, node failure) and are removed."""
    for stale in sorted(out.parent.glob(f"{out.name}.tmp-*")) + sorted(out.parent.glob(f"{out.name}.old-*")):
        log(f"removing {stale}, left by a conversion that did not finish")
        shutil.rmtree(stale, ignore_errors=True)


def universal_problem(out: Path, saved: SavedCheckpoint) -> str:
    """Why ``out`` is not a complete conversion of ``saved`` as this process sees both ("" when it is).

    Run by every rank before loading: with node-local disks, each node reads its own copy.
    """
    marker = out / MARKER
    if not marker.is_file():
        return f"{out} has no {MARKER}: the conversion is missing or incomplete on this node"
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError) as err:
        return f"{marker} cannot be read ({err})"
    if recorded.get("source") != _fingerprint(saved):
        return (f"{out} was converted from another state of {saved.path} (files, sizes or times differ), so it is "
                "stale")
    return ""


def ensure_universal(saved: SavedCheckpoint, target_params: Mapping[str, tuple[int, ...]],
                     target_ep_section: Mapping[str, Any] | None = None,
                     log: Callable[[str], None] = print,
                     layouts: Mapping[str, Any] | None = None,
                     optional_params: Mapping[str, tuple[int, ...]] | None = None) -> tuple[Path, bool]:
    """Convert ``saved`` with ``ds_to_universal`` unless an up-to-date conversion exists, and make
    sure it holds every parameter of ``target_params`` (see :func:`add_target_names`; the
    ``optional_params`` where the checkpoint has them).

    Returns the directory to pass to ``engine.load_checkpoint`` and whether it was converted now.
    Runs on one rank (the caller's rank 0) while the others wait; the lock also keeps two jobs
    from converting the same checkpoint at once. The source directory is only read. A kill at any
    point leaves either no ``<ckpt>.universal`` or a complete one: the conversion is written to a
    temporary directory, its marker last, and renamed into place; the leftovers of a killed run
    are removed by the next one.
    """
    out = universal_dir(saved)
    lock = out.with_name(out.name + ".lock")
    try:
        with _locked(lock):
            _remove_leftovers(out, log)
            if not universal_problem(out, saved):
                add_target_names(out, saved, target_params, target_ep_section, layouts, optional_params)
                return out, False
            tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
            try:
                log(f"converting {saved.path} ({saved.shape}) with deepspeed's ds_to_universal into {out}")
                from lightning_zeromoe.checkpoint.frozen_experts import source_frozen

                # Frozen AutoEP experts live beside the shards (checkpoint.frozen_experts), not in them.
                with ds_private.frozen_experts_left_out_of_conversion(source_frozen(saved)):
                    _run_ds_to_universal(saved.tag_dir, tmp / saved.tag)
                add_target_names(tmp, saved, target_params, target_ep_section, layouts, optional_params)
                (tmp / MARKER).write_text(json.dumps({"source": _fingerprint(saved), "tag": saved.tag,
                                                      "saved_shape": str(saved.shape)}))
                old = out.with_name(f"{out.name}.old-{os.getpid()}")
                if out.exists():
                    os.replace(out, old)  # atomic: never a half-deleted directory that still has its marker
                os.replace(tmp, out)
                shutil.rmtree(old, ignore_errors=True)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except PermissionError as err:
        raise ResumeShapeError(say(ENTRY_ID, "not-writable", "writable-copy", path=saved.path,
                                   err=err)) from err
    except OSError as err:
        raise ResumeShapeError(say(ENTRY_ID, "write-failed", "free-space-next-to-it", out=out,
                                   error_type=type(err).__name__, err=err, path=saved.path)) from err
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
        raise ResumeShapeError(say(ENTRY_ID, "ds-to-universal", input_folder=input_folder,
                                   error_type=type(err).__name__, err=err, tail=tail)) from err



#: Let an engine built without ``checkpoint.load_universal`` load one universal checkpoint (it sets
#: DeepSpeed's private ``engine._config.load_universal_checkpoint`` for the duration).
universal_loading = ds_private.universal_checkpoint_loading


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
                      agree: Callable[[bool], bool], fitting: bool, strict: bool, info: Callable[[str], None],
                      warn: Callable[[str], None]) -> dict[str, Any]:
    """Load ``saved`` into ``engine`` on the shape now running, on every rank; returns the client state.

    Rank 0 converts it once (:func:`ensure_universal`, reused later) while the other ranks wait at
    ``broadcast``; a failure there is raised on every rank, so none is left waiting. Every rank then
    checks the converted directory *it* will read (:func:`universal_problem`; ``agree`` is true when
    every rank's check passed), re-partitions weights (and, when ``fitting``, the optimizer state,
    repaired with :func:`repair_optimizer_after_universal_load`) for itself, and puts back the
    buffers and frozen parameters the universal load leaves out
    (:func:`lightning_zeromoe.checkpoint.resume.module_state.restore_module_state`).
    """
    from lightning_zeromoe.checkpoint.frozen_experts import plans as frozen_expert_plans
    from lightning_zeromoe.checkpoint.resume.module_state import frozen_parameter_shapes, restore_module_state

    start = time.monotonic()
    trainable = {name: tuple(getattr(p, "ds_shape", p.shape))
                 for name, p in engine.module.named_parameters() if p.requires_grad}
    # Frozen experts the checkpoint kept frozen come from their own files, not the universal tensors.
    experts = frozen_expert_plans(engine.module, saved, ep_section, layouts)
    optional = {n: s for n, s in frozen_parameter_shapes(engine.module).items() if n not in experts}
    outcome: list[Any] = [None, None, ""]  # universal dir, converted now, error message
    failure: BaseException | None = None
    if is_global_zero:
        try:
            outcome[0], outcome[1] = ensure_universal(saved, trainable, ep_section, log=info, layouts=layouts,
                                                      optional_params=optional)
        except Exception as err:  # noqa: BLE001 - every rank must hear of it, or they wait at the broadcast
            failure, outcome[2] = err, say(ENTRY_ID, "conversion-failed", path=saved.path,
                                           error_type=type(err).__name__, err=err)
    outcome = broadcast(outcome)  # the other ranks wait here for the conversion
    if failure is not None:
        raise failure
    if outcome[2]:
        raise ResumeShapeError(outcome[2])
    uc_dir = Path(outcome[0])
    problem = universal_problem(uc_dir, saved)
    if not agree(not problem):
        raise ResumeShapeError(
            say(ENTRY_ID, "universal-unreadable", "shared-filesystem", problem=problem, uc_dir=uc_dir) if problem
            else say(ENTRY_ID, "universal-unreadable-elsewhere", "shared-filesystem", uc_dir=uc_dir))
    with universal_loading(engine):
        _, client_state = engine.load_checkpoint(str(uc_dir), load_optimizer_states=fitting,
                                                 load_lr_scheduler_states=False, load_module_strict=strict)
    if fitting:
        repair_optimizer_after_universal_load(engine, uc_dir, saved.tag)
    restored = restore_module_state(engine.module, saved, ep_section, layouts, uc_dir=uc_dir)
    if restored.missing:
        shown = ", ".join(restored.missing[:6]) + (" ..." if len(restored.missing) > 6 else "")
        warn(f"ZeroMoEStrategy: the checkpoint {saved.path} holds no value for {len(restored.missing)} buffer(s) or "
             f"frozen parameter(s) of the model now running ({shown}); they keep the values the model was built "
             "with.")
    info(f"ZeroMoEStrategy: resumed {saved.path} ({saved.shape}) on {target} through DeepSpeed's universal "
         f"checkpoint {uc_dir} ({'converted' if outcome[1] else 'reused'}; {restored.summary(len(trainable))}; "
         f"{time.monotonic() - start:.1f} s)")
    return client_state


def saved_parameter_order(checkpoint_dir: str | os.PathLike) -> list[str]:
    """Parameter names in the order a DeepSpeed checkpoint's flat optimizer groups hold them."""
    root = Path(checkpoint_dir)
    latest = root / "latest"
    tag = latest.read_text().strip() if latest.is_file() else "checkpoint"
    return list(saved_shapes(root / tag))


__all__ = ["ENTRY_ID", "ResumeShapeError", "SavedCheckpoint", "Shape", "add_target_names", "engine_ep_size",
           "ensure_universal", "load_on_new_shape", "plan_resume", "read_saved",
           "repair_optimizer_after_universal_load", "saved_parameter_order", "universal_dir", "universal_loading",
           "universal_problem"]
