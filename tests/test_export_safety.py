"""``zeromoe-export`` never removes what it did not write, and never leaves a half export that
looks whole.

One real checkpoint (the tiny MoE LM, ZeRO-3 + EP=2 on 2 CPU ranks, saved by ``ModelCheckpoint``
in ``tests/jobs/export_job.py``; the ``export_runs`` launch, shared with ``test_checkpoint.py``),
copied where a test could damage it, never written to in place. Exports run through the
real CLI in a subprocess where the check is about what users run (exit status, the one error
line, the umask, a SIGKILL, a full disk), through the Python API for set-up. Every "intact" is a
digest of the whole tree (content, size, mtime, mode of every file and directory) before and
after.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support.jobs import REPO, job_env

#: Small enough that the tiny model (0.8 MB in float32) is written as several shards.
SHARD = "150KB"


@pytest.fixture(scope="module")
def run(export_runs) -> dict:
    out = export_runs / "tiny"
    ckpt = Path(json.loads((out / "rank0.json").read_text())["ckpt_path"])
    assert (ckpt / "zeromoe_meta.json").is_file() and ckpt.parent.parent == out
    return {"dir": out, "ckpt": ckpt}


def _runs(run: dict, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the job's directory (``runs/callback/step=5.ckpt`` beside the job's other files),
    and the checkpoint in it."""
    runs = tmp_path / "runs"
    shutil.copytree(run["dir"], runs, symlinks=True)
    return runs, runs / run["ckpt"].relative_to(run["dir"])


def _digest(root: Path) -> dict[str, tuple]:
    """Every entry under root (root included): sha256, size, mtime and mode of files; mode of
    directories; target of links."""
    out: dict[str, tuple] = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            out[rel] = ("dir", st.st_mode)
        else:
            out[rel] = (hashlib.sha256(path.read_bytes()).hexdigest(), st.st_size, st.st_mtime_ns, st.st_mode)
    return out


def _cli(*args: str, fsize: int | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    def limits() -> None:
        if fsize is not None:  # Python ignores SIGXFSZ, so a write past the limit fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run([sys.executable, "-m", "lightning_zeromoe.export", *args], capture_output=True, text=True,
                          timeout=timeout, env=job_env(), cwd=REPO, preexec_fn=limits)


def _assert_refused(proc: subprocess.CompletedProcess, entry: str, *phrases: str) -> str:
    """Exit 2, one error line that starts with the knowledge-base entry id, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("zeromoe-export: error:")]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"zeromoe-export: error: [{entry}] "), lines[0]
    assert "Traceback" not in proc.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    return lines[0]


def _refused(entry: str, *phrases: str, **call) -> None:
    """The Python API refuses with the entry's id."""
    from lightning_zeromoe.checkpoint import ExportError, export

    with pytest.raises(ExportError) as err:
        export(progress=False, max_shard_size=SHARD, **call)
    assert err.value.entry_id == entry and str(err.value).startswith(f"[{entry}] ")
    for phrase in phrases:
        assert phrase in str(err.value), str(err.value)


def _work_dirs(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".zeromoe-tmp-" in p.name)


def _check_export_dir(out: Path, ckpt: Path, dtype: str = "float32") -> dict:
    """A complete export: the marker lists exactly the files beside it, with their sizes."""
    from safetensors.torch import load_file

    marker = json.loads((out / "zeromoe_export.json").read_text())
    assert marker["format"] == "lightning_zeromoe/export" and marker["version"] == 1
    assert marker["source"] == str(ckpt.resolve()) and marker["tag"] == "checkpoint" and marker["dtype"] == dtype
    on_disk = {str(p.relative_to(out)): p.stat().st_size for p in out.rglob("*")
               if p.is_file() and p.name != "zeromoe_export.json"}
    assert marker["files"] == on_disk and len(on_disk) >= 4  # config, index, >= 2 shards
    tensors = {k: v for f in out.glob("model-*.safetensors") for k, v in load_file(str(f)).items()}
    assert len(tensors) == 18 and all(str(t.dtype) == f"torch.{dtype}" for t in tensors.values())
    return marker


# ------------------------------------------------------------------ what OUT may be


def test_overwrite_never_removes_a_directory_that_holds_the_checkpoint(run, tmp_path):
    """The issue: ``zeromoe-export runs/ckpt runs --overwrite`` deleted the checkpoint and
    everything beside it, printed "wrote 18 tensors" and exited 0."""
    runs, ckpt = _runs(run, tmp_path)
    (ckpt.parent / "notes.txt").write_text("the run's notes")
    before = _digest(runs)
    proc = _cli(str(ckpt), str(ckpt.parent), "--overwrite")
    _assert_refused(proc, "export-output-path", f"refusing to write {ckpt.parent}: it contains the checkpoint",
                    "never modified")
    assert _digest(runs) == before
    # The grandparent, and a symbolic link to the parent (compared after resolving), likewise.
    link = tmp_path / "latest-run"
    link.symlink_to(ckpt.parent, target_is_directory=True)
    for out in (runs, link):
        _refused("export-output-path", "it contains the checkpoint", ckpt_dir=ckpt, out=out, overwrite=True)
    assert _digest(runs) == before and link.is_symlink()
    # The checkpoint's own checkpoint/ passed as the source: its parent is still the checkpoint.
    _refused("export-output-path", "contains the checkpoint", ckpt_dir=ckpt / "checkpoint", out=ckpt.parent,
             overwrite=True)
    assert _digest(runs) == before


def test_checkpoint_itself_and_foreign_paths_are_refused_even_with_overwrite(run, tmp_path):
    from safetensors.torch import save_file

    runs, ckpt = _runs(run, tmp_path)
    before = _digest(runs)
    for out in (ckpt, ckpt / "checkpoint", ckpt / "hf"):
        _refused("export-output-path", "inside the checkpoint directory", ckpt_dir=ckpt, out=out, overwrite=True)
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "train.jsonl").write_text('{"text": "x"}\n')
    (data / "sub" / "config.json").write_text("{}")
    theirs = tmp_path / "theirs.safetensors"
    save_file({"w": torch.ones(3)}, str(theirs), metadata={"producer": "someone else"})
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    others = {p: _digest(p) for p in (data, theirs, notes)}
    proc = _cli(str(ckpt), str(data), "--overwrite")
    _assert_refused(proc, "export-output-path", "holds no readable zeromoe_export.json", "even with --overwrite")
    _refused("export-output-path", "zeromoe-export did not write it", ckpt_dir=ckpt, out=theirs, overwrite=True)
    _refused("export-output-path", "is not a directory", ckpt_dir=ckpt, out=notes, overwrite=True)
    assert {p: _digest(p) for p in others} == others
    assert _digest(runs) == before
    assert _work_dirs(tmp_path) == []


def test_overwrite_replaces_an_earlier_export_and_nothing_else(run, tmp_path):
    from lightning_zeromoe.checkpoint import export

    ckpt = run["ckpt"]
    out = tmp_path / "hf"
    out.mkdir()  # an empty directory is used as it is, without --overwrite
    export(ckpt, out, max_shard_size=SHARD, progress=False)
    first = _check_export_dir(out, ckpt)
    proc = _cli(str(ckpt), str(out), "--overwrite", "--dtype", "bfloat16", "--max-shard-size", SHARD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = _check_export_dir(out, ckpt, "bfloat16")
    assert sum(second["files"].values()) < sum(first["files"].values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no work directory, no old copy left
    # A file the user added to the export makes it no longer the exporter's to delete.
    (out / "tokenizer.json").write_text("{}")
    before = _digest(out)
    _refused("export-output-path", "1 file(s) zeromoe-export did not write (tokenizer.json)", "even with --overwrite",
             ckpt_dir=ckpt, out=out, overwrite=True)
    _refused("export-output-path", "tokenizer.json", ckpt_dir=ckpt, out=out, overwrite=False)
    assert _digest(out) == before
    # One file: replaced when this exporter wrote it.
    single = tmp_path / "m.safetensors"
    export(ckpt, single, progress=False)
    _refused("export-output-path", "already exists", "--overwrite", ckpt_dir=ckpt, out=single)
    export(ckpt, single, dtype="bfloat16", overwrite=True, progress=False)
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(str(single)).values()} == {torch.bfloat16}


# ------------------------------------------------------------------ file modes


def _modes(root: Path) -> dict[str, int]:
    paths = [root, *root.rglob("*")] if root.is_dir() else [root]
    return {str(p.relative_to(root.parent)): stat.S_IMODE(p.lstat().st_mode) for p in paths}


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_written_files_get_the_mode_the_umask_gives(run, tmp_path, umask):
    """safetensors' writer alone gives shards 0600 beside a 0644 config.json. The CLI's entry
    point runs twice in one subprocess (a directory, then one file) to pay its start-up once."""
    file_mode, dir_mode = 0o666 & ~umask, 0o777 & ~umask
    out, single = tmp_path / "hf", tmp_path / "m.safetensors"
    code = ("import sys; from lightning_zeromoe.export import main; "
            f"sys.exit(main([{str(run['ckpt'])!r}, {str(out)!r}, '--max-shard-size', {SHARD!r}, '--quiet']) or "
            f"main([{str(run['ckpt'])!r}, {str(single)!r}, '--quiet']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=job_env(),
                          cwd=REPO, preexec_fn=lambda: os.umask(umask))
    assert proc.returncode == 0, proc.stderr[-3000:]
    modes = {**_modes(out), **_modes(single)}
    assert len(modes) >= 7 and sum(name.endswith(".safetensors") for name in modes) >= 3
    want = {name: dir_mode if (tmp_path / name).is_dir() else file_mode for name in modes}
    assert {k: oct(v) for k, v in modes.items()} == {k: oct(v) for k, v in want.items()}


# ------------------------------------------------------------------ killed, full disk


def _start_and_kill(args: list[str], parent: Path, name: str) -> tuple[int, str]:
    """Start the CLI; SIGKILL it as soon as its work directory holds a finished shard. Returns the
    killed pid and the work directory's name."""
    proc = subprocess.Popen([sys.executable, "-m", "lightning_zeromoe.export", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=job_env(), cwd=REPO)
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            shards = list(parent.glob(f".{name}.zeromoe-tmp-*/new/model-*.safetensors"))
            if shards:
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.002)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    assert rc == -signal.SIGKILL, f"the export ended ({rc}) before a shard was seen: {stderr[-2000:]}"
    [work] = _work_dirs(parent)
    return proc.pid, work


@pytest.mark.parametrize("case", ["new", "replace"])
def test_sigkill_leaves_no_complete_looking_export_and_a_rerun_succeeds(run, tmp_path, case):
    from lightning_zeromoe.checkpoint import export

    ckpt, out = run["ckpt"], tmp_path / "hf"
    args = [str(ckpt), str(out), "--max-shard-size", "20KB", "--dtype", "float32"]
    if case == "replace":
        export(ckpt, out, dtype="float32", max_shard_size=SHARD, progress=False)
        args.append("--overwrite")
    before = _digest(out) if case == "replace" else None
    pid, work = _start_and_kill(args, tmp_path, "hf")
    if case == "new":
        assert not os.path.lexists(out), sorted(out.rglob("*"))
    else:
        assert _digest(out) == before  # the earlier export, untouched
    assert not (tmp_path / work / "new" / "zeromoe_export.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([work, *(["hf"] if case == "replace" else [])])
    again = subprocess.run([sys.executable, "-m", "lightning_zeromoe.export", *args], capture_output=True, text=True,
                           timeout=180, env=job_env(), cwd=REPO)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"removed {tmp_path.resolve() / work}" in again.stderr and f"pid {pid} on " in again.stderr, again.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    marker = _check_export_dir(out, ckpt)
    assert len([f for f in marker["files"] if f.startswith("model-")]) >= 10


def _tmpfs(path: Path, size: str) -> bool:
    """Mount a small tmpfs at path; False where this container may not mount."""
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return proc.returncode == 0


def test_full_disk_is_one_clear_error_and_leaves_everything_as_it_was(run, tmp_path):
    """A real full filesystem (a 1.2 MB tmpfs holding an earlier 0.8 MB export, when this
    container may mount), else a real file-size limit (RLIMIT_FSIZE: writes past 64 KiB fail with
    EFBIG). The new export does not fit; the checkpoint and the earlier export stay as they were."""
    from lightning_zeromoe.checkpoint import export

    runs, ckpt = _runs(run, tmp_path)
    disk = tmp_path / "disk"
    mounted = _tmpfs(disk, "1200k")
    try:
        out = disk / "hf"
        export(ckpt, out, max_shard_size=SHARD, progress=False)
        before, source = _digest(out), _digest(runs)
        proc = _cli(str(ckpt), str(out), "--overwrite", "--max-shard-size", SHARD,
                    fsize=None if mounted else 64 * 1024)
        why = "No space left on device (ENOSPC)" if mounted else "File too large (EFBIG)"
        line = _assert_refused(proc, "export-disk-full", why, "needs about 0.8 MB", "partial output was removed",
                               "run the same command again")
        print(f"{'tmpfs' if mounted else 'RLIMIT_FSIZE'}: {line}")
        assert _digest(out) == before and _digest(runs) == source
        assert sorted(p.name for p in disk.iterdir()) == ["hf"]
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)


def test_a_live_export_is_left_alone_and_one_killed_mid_replace_is_put_back(run, tmp_path):
    """The two states a SIGKILL cannot be aimed at: another export still writing the same OUT (its
    work directory's lock is held: here by this process, as a running export holds it), and an
    export killed between moving the earlier export aside and renaming the new one in."""
    import fcntl

    from lightning_zeromoe.checkpoint import export

    ckpt, out = run["ckpt"], tmp_path / "hf"
    export(ckpt, out, max_shard_size=SHARD, progress=False)
    before = _digest(out)
    live = tmp_path / ".hf.zeromoe-tmp-live0001"
    live.mkdir()
    (live / "lock").write_text(json.dumps({"pid": 4242, "host": "node7", "started": "2026-01-01T00:00:00+0000"}))
    with open(live / "lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        _refused("export-output-path", "another zeromoe-export (pid 4242 on node7", "is writing", ckpt_dir=ckpt,
                 out=out, overwrite=True)
        assert live.is_dir() and _digest(out) == before
    # Released (its process died): the same directory is now a leftover, with the earlier export
    # in it and no OUT, as a kill between the two renames leaves them.
    (live / "new").mkdir()
    out.rename(live / "old")
    lines: list[str] = []
    export(ckpt, out, max_shard_size=SHARD, overwrite=True, progress=lines.append)
    assert any(line.startswith("put back the earlier export") for line in lines), lines
    assert any(line.startswith(f"removed {live.resolve()}") and "pid 4242 on node7" in line for line in lines), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    _check_export_dir(out, ckpt)
