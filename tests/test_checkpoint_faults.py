"""Faults during checkpoint writes leave nothing that looks complete, and the same command works again.

Real 2-rank ``torchrun`` launches of ``tests/jobs/checkpoint_faults.py`` (tiny MoE, ZeRO-3, EP 2,
gloo); the faults are real: SIGKILL sent by the process to itself at a chosen write, and a
file-size limit that makes one rank's writes fail with EFBIG as a full disk would. In order:

1. a rank killed while the checkpoint is saved again over a complete one: no ``latest`` remains,
   resume and export refuse the directory and say why; saving again succeeds;
2. one rank's disk is full: a one-line ``[checkpoint-disk-full]`` error, no ``latest`` in that
   directory, the earlier checkpoint byte-for-byte intact;
3. rank 0 killed in the middle of the universal conversion (resume on ``ep_size=1``): no
   ``.universal`` directory that looks complete; the rerun reclaims the dead job's lock at once,
   removes its leftovers, converts, and resumes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.jobs import JOBS, REPO, fatal_stacks, free_port, job_env
from lightning_zeromoe.checkpoint.resume import reshape as resume
from lightning_zeromoe.checkpoint.autoep_names import ResumeShapeError


def _launch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(JOBS / "checkpoint_faults.py"), *args]
    return subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=timeout)


def _digest(root: Path) -> dict[str, str]:
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(root.rglob("*")) if f.is_file()}


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}\n{fatal_stacks()}"
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults")


def test_a_rank_killed_during_save_leaves_no_latest_and_the_rerun_saves(work):
    ckpt = work / "last.ckpt"
    killed = _launch("--mode", "save-killed", "--ckpt", str(ckpt))
    assert killed.returncode != 0
    assert "[fault] rank 1: SIGKILL in save" in killed.stdout + killed.stderr, killed.stdout[-2000:]
    assert (ckpt / "checkpoint").is_dir()  # the second save had started writing
    assert not (ckpt / "latest").exists(), "a partial save must not look complete"
    with pytest.raises(ResumeShapeError, match="no 'latest' file.*interrupted"):
        resume.read_saved(ckpt)
    export = subprocess.run([sys.executable, "-m", "lightning_zeromoe.export", str(ckpt), str(work / "out")],
                            cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=120)
    assert export.returncode != 0 and "latest" in export.stderr, export.stderr[-2000:]
    assert not (work / "out" / "zeromoe_export.json").exists()

    _ok(_launch("--mode", "save", "--ckpt", str(ckpt)))  # the same command again, without the fault
    assert (ckpt / "latest").read_text() == "checkpoint"


def test_a_full_disk_on_one_rank_is_a_clear_error_and_the_earlier_checkpoint_survives(work):
    ckpt, full = work / "last.ckpt", work / "full.ckpt"
    before = _digest(ckpt)
    proc = _launch("--mode", "save", "--ckpt", str(ckpt), "--disk-full", str(full))
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "[checkpoint-disk-full] rank 1 could not write the checkpoint" in log, log[-4000:]
    assert not (full / "latest").exists()
    # This launch saved last.ckpt again (same seed, same steps) before the failing save: still complete.
    assert (ckpt / "latest").read_text() == "checkpoint"
    assert set(_digest(ckpt)) == set(before)
    assert resume.read_saved(ckpt).shape.ep_size == 2


def test_rank_0_killed_during_the_universal_conversion_then_the_rerun_resumes(work):
    ckpt = work / "last.ckpt"
    source = _digest(ckpt)
    killed = _launch("--mode", "resume-killed", "--ckpt", str(ckpt))
    assert killed.returncode != 0
    assert "[fault] rank 0: SIGKILL in _copytree_atomic" in killed.stdout + killed.stderr, killed.stderr[-3000:]
    universal = ckpt.with_name(ckpt.name + ".universal")
    assert not (universal / resume.MARKER).exists(), "an unfinished conversion must not look complete"
    assert list(work.glob("last.ckpt.universal.tmp-*")), "the fault should strike inside the temporary directory"

    # The killed job's lock file is still there, but the kernel dropped its flock with the process:
    # the rerun takes it at once instead of waiting (a blocking flock on a held lock never returns).
    lock = universal.with_name(universal.name + ".lock")
    assert lock.is_file(), "the killed conversion should have left its lock file"
    with open(lock) as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError if anyone holds it
        fcntl.flock(handle, fcntl.LOCK_UN)
    log = _ok(_launch("--mode", "resume", "--ckpt", str(ckpt)))
    assert "left by a conversion that did not finish" in log
    assert not list(work.glob("last.ckpt.universal.tmp-*")) and not list(work.glob("last.ckpt.universal.old-*"))
    assert (universal / resume.MARKER).is_file()
    assert json.loads((work / "resumed.json").read_text())["step"] == 3
    assert _digest(ckpt) == source, "the source checkpoint is only read"
