"""Runs that really hang (or lose a rank), and what ``troubleshooter explain`` says on their dumps.

Each scenario is its own 2-rank launch on CPU (gloo) with a 6 s collective timeout, bounded by a
subprocess timeout that kills the whole process group: ``tests/jobs/hang_job.py`` (ZeroMoEStrategy:
one rank with one batch more; ``self.all_gather`` on rank 0 only; a rank SIGKILLed mid-step;
``trainer.validate`` on rank 0 only, whose ``fit`` first ends healthily and dumps) and
``tests/jobs/hang_raw_moe.py`` (a hand-written non-leaf MoE block under raw DeepSpeed ZeRO-3 with
disjoint routing). The launches run two at a time. For each, the real ``python -m troubleshooter explain``
on the dump directory must name the first diverging collective, the ranks on each side and the entry.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from support.jobs import JOBS, REPO, free_port, job_env

TIMEOUT = 6  # the collective timeout of the hang, seconds
LIMIT = 240  # per launch: start-up of two ranks on two busy cores, the hang, the dumps, the exit


def _launch(name: str, cmd: list[str]) -> dict:
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    killed = False
    try:
        output, _ = proc.communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launched ranks too
        output, _ = proc.communicate()
        killed = True
    return {"name": name, "rc": proc.returncode, "killed": killed, "seconds": time.monotonic() - start,
            "output": output}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("hangs")
    cmds = {s: [sys.executable, str(JOBS / "hang_job.py"), "--scenario", s, "--root", str(root / s),
                "--timeout", str(TIMEOUT)] for s in ("uneven", "rank0_gather", "dies", "rank0_eval")}
    cmds["nonleaf"] = [sys.executable, str(JOBS / "hang_raw_moe.py"), "--dir", str(root / "nonleaf"),
                       "--timeout", str(TIMEOUT), "--port", str(free_port())]
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = {r["name"]: r for r in pool.map(lambda item: _launch(*item), cmds.items())}
    for name, result in done.items():
        result["dumps"] = root / name if name == "nonleaf" else root / name / "flight_recorder"
        print(f"hang scenario {name}: rc {result['rc']} in {result['seconds']:.0f} s")
    done["healthy"] = {"dumps": root / "rank0_eval" / "healthy", "rc": 0, "killed": False, "seconds": 0.0,
                       "output": ""}
    return done


def _explain(directory: Path) -> tuple[int, dict, str]:
    """The analysis ``explain`` runs on a dump directory, in this process: (the exit code ``explain`` gives,
    the report as ``--json`` prints it, the text). ``test_the_cli_explains_a_dump_directory`` runs the CLI."""
    from troubleshooter import hangs

    report = hangs.analyse(directory)
    return (0 if report.entry_id else 1), json.loads(json.dumps(report.to_dict())), "\n".join(hangs.render(report))


def test_the_cli_explains_a_dump_directory(runs):
    directory = runs["nonleaf"]["dumps"]
    env = dict(job_env(), PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "troubleshooter", "explain", str(directory), "--json"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["hang"] == _explain(directory)[1]


def _sides(hang: dict) -> dict[int, dict | None]:
    d = hang["divergence"]
    return {**{op["rank"]: op for op in d["issued"]}, **{r: None for r in d["silent"] + d["no_dump"]}}


@pytest.mark.parametrize("name", ["uneven", "rank0_gather", "dies", "rank0_eval", "nonleaf"])
def test_a_hang_ends_within_its_timeout_with_dumps(runs, name):
    run = runs[name]
    # failed by itself (Lightning's launcher may SIGKILL rank 0 once a child failed), not killed at LIMIT
    assert run["rc"] not in (0, None) and not run["killed"], run["output"][-3000:]
    assert run["seconds"] < LIMIT - 10, f"{name} took {run['seconds']:.0f} s"
    assert any(p.name.startswith("rank") for p in run["dumps"].iterdir()), run["output"][-3000:]


def test_uneven_batches(runs):
    rc, hang, text = _explain(runs["uneven"]["dumps"])
    assert rc == 0 and hang["entry_id"] == "hang-uneven-batches", text
    sides = _sides(hang)
    assert {op["phase"] for op in sides.values() if op} == {"training_step", "validation_step"}, text
    assert "First divergence: group" in text and "[hang-uneven-batches]" in text


def test_collective_on_rank_zero_only(runs):
    rc, hang, text = _explain(runs["rank0_gather"]["dumps"])
    assert rc == 0 and hang["entry_id"] == "hang-rank-conditional-collective", text
    sides = _sides(hang)
    assert sides[0]["name"] == "all_gather" and "hang_job.py" in sides[0]["caller"], text
    assert sides[1] is None or sides[1]["name"] != "all_gather", text
    assert "rank 0 issued all_gather" in text


def test_rank_dies_mid_step(runs):
    rc, hang, text = _explain(runs["dies"]["dumps"])
    assert rc == 0 and hang["entry_id"] == "peer-rank-died", text
    assert hang["ranks"] == [0] and hang["missing"] == [1], text
    assert hang["divergence"]["no_dump"] == [1] and hang["divergence"]["issued"][0]["rank"] == 0, text


def test_evaluation_on_rank_zero_only(runs):
    rc, hang, text = _explain(runs["rank0_eval"]["dumps"])
    assert rc == 0 and hang["entry_id"] == "hang-rank-subset-save-or-eval", text
    sides = _sides(hang)
    assert sides[0] is not None and sides[0]["origin"] == "evaluation", text


def test_non_leaf_moe_block_names_the_experts(runs):
    rc, hang, text = _explain(runs["nonleaf"]["dumps"])
    assert rc == 0 and hang["entry_id"] == "zero3-moe-gather-mismatch", text
    sides = _sides(hang)
    assert sides[0]["name"] == sides[1]["name"] == "all_gather", text
    assert (sides[0]["module"], sides[1]["module"]) == ("moe.experts.0", "moe.experts.1"), text
    assert "ZeRO-3 gather for moe.experts.0" in text


def test_healthy_run_has_no_divergence(runs):
    rc, hang, text = _explain(runs["healthy"]["dumps"])
    assert hang["ranks"] == [0, 1] and hang["divergence"] is None and hang["entry_id"] is None, text
    assert "No divergence" in text and rc == 1


def test_doctor_report_includes_the_dumps(runs):
    proc = subprocess.run([sys.executable, "-m", "troubleshooter", "doctor", "--report", "--only", "host", "--dumps",
                           str(runs["nonleaf"]["dumps"])], capture_output=True, text=True, timeout=180, cwd=REPO,
                          env=dict(job_env(), PYTHONPATH=str(REPO)))
    section = proc.stdout.split("**Flight Recorder dumps**", 1)[-1].split("**Checks**", 1)[0]
    assert f"Flight Recorder dumps in {runs['nonleaf']['dumps']}" in section, proc.stdout[-3000:]
    assert "ZeRO-3 gather for moe.experts.0" in section and "[zero3-moe-gather-mismatch]" in section


def test_jupyter_assistant_shows_fresh_dumps_after_a_failed_cell(runs):
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    import lightning as L

    shell = InteractiveShell.instance()
    # the notebook's Trainer, whose default_root_dir holds the dumps of the run that just failed
    shell.user_ns["trainer"] = L.Trainer(default_root_dir=str(runs["rank0_gather"]["dumps"].parent), logger=False,
                                         accelerator="cpu", devices=1, enable_progress_bar=False)
    with capture_output():
        shell.run_line_magic("load_ext", "troubleshooter")
    try:
        with capture_output() as out:
            shell.run_cell("raise RuntimeError('Timed out waiting 6000ms for send operation to complete')")
    finally:
        shell.user_ns.pop("trainer", None)
        with capture_output():
            shell.run_line_magic("unload_ext", "troubleshooter")
    assert f"Flight Recorder dumps in {runs['rank0_gather']['dumps']}" in out.stdout, out.stdout
    assert "[hang-rank-conditional-collective]" in out.stdout
