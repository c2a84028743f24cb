"""The strategy under each launcher we can run on CPU, and the README's demo command.

Real subprocesses: `python script.py` (Lightning starts rank 1 by re-running the script),
`torchrun --nproc_per_node 2`, and a failing launch that must exit on every rank, not hang.
"""

from __future__ import annotations

import re
import shlex
import sys

from support.jobs import JOBS, REPO, free_port, read_ranks, run, run_job


def test_torchrun_two_processes(tmp_path):
    """torchrun starts both ranks; Lightning picks up its environment (TorchElasticEnvironment)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port())]
    run_job("train_tiny.py", "--out", str(tmp_path), "--steps", "3", launcher=launcher)
    ranks = read_ranks(tmp_path, 2)
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert all(len(r["steps"]) == 3 for r in ranks)
    experts = ranks[0]["held"]["model.layers.0.mlp.experts.w1"]
    assert experts["ds_shape"][0] == 2


def test_bad_expert_count_fails_fast_on_every_rank(tmp_path):
    """3 experts with ep_size=2: every rank stops in setup (before any engine) with our message, no hang."""
    proc = run([sys.executable, str(JOBS / "train_tiny.py"), "--out", str(tmp_path), "--num-experts", "3"], timeout=180)
    assert proc.returncode != 0
    assert "ZeroMoEConfigError: [ep-size-divisibility] ep_size=2 does not divide num_experts=3" in proc.stderr
    assert "deepspeed/runtime" not in proc.stderr, "the error should come before any DeepSpeed engine code runs"
    assert not list(tmp_path.glob("rank*.json"))


def test_demo_bad_flag_is_one_line_and_exit_2(tmp_path):
    """``--ep-size 3`` on 2 ranks: the strategy's refusal as a CLI error (exit 2), not a traceback."""
    proc = run([sys.executable, "-m", "lightning_zeromoe.demo", "--ep-size", "3", "--devices", "2",
                "--accelerator", "cpu", "--out", str(tmp_path / "demo")], timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if "lightning_zeromoe.demo: error:" in line]
    assert len(ours) == 1 and "[ep-size-divisibility] ep_size=3 does not divide the world size 2" in ours[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "demo").exists()


def readme_demo_command() -> list[str]:
    """The python invocation in the README's first command (after its setup step)."""
    first = next(line for line in (REPO / "README.md").read_text().splitlines() if "lightning_zeromoe.demo" in line)
    match = re.search(r"python -m lightning_zeromoe\.demo[^`&;]*", first)
    assert match, f"no demo invocation in README line: {first}"
    return shlex.split(match.group(0).strip())[1:]


def test_readme_demo_command_runs(tmp_path):
    args = readme_demo_command()
    proc = run([sys.executable, *args, "--out", str(tmp_path / "demo")], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert re.search(r"throughput: [\d,]+ tokens/s", out), out[-2000:]
    assert re.search(r"model\.layers\.0\.mlp\s+e0:\s*\d+\.\d%", out)
    assert "rank 1:" in out and "checkpoint saved" in out
    assert f"zeromoe-export {tmp_path / 'demo' / 'checkpoint'}" in out, "the demo should say how to export"
    assert (tmp_path / "demo" / "checkpoint" / "checkpoint").is_dir()
    # A clean first run: none of the third-party notices lightning_zeromoe.engine.notices names.
    both = out + proc.stderr
    for noise in ("Failed to initialize NumPy", "litlogger", "LeafSpec", "`weights_only` was not set",
                  "deepspeed-zero-stage-3-single-file"):
        assert noise not in both, f"demo output still shows {noise!r}"


def test_a_one_process_cpu_run_leaves_no_allreduce_buffer_in_dev_shm(tmp_path):
    """DeepSpeed's CPU all-reduce maps a 69 MB buffer per rank in /dev/shm when every rank is on this host
    (one process, here: ``LOCAL_SIZE`` equals the world size) and never removes its name, so each such run
    left one behind (43 of them, 2.8 GB, on this project's machine). The strategy removes the name once every
    rank has mapped it. A real one-process run with its own MASTER_PORT, which names the buffer."""
    import os

    port = str(free_port())
    proc = run([sys.executable, str(JOBS / "train_tiny.py"), "--out", str(tmp_path), "--steps", "2",
                "--devices", "1", "--ep-size", "1"], cwd=tmp_path, env_extra={"MASTER_PORT": port})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rank,) = read_ranks(tmp_path, 1)
    assert len(rank["steps"]) == 2
    assert rank["shm_allreduce"], "DeepSpeed's shared-memory all-reduce was not in use: nothing to test"
    assert rank["shm_buffers_left"] == []
    assert not [p for p in os.listdir("/dev/shm") if p.endswith(f"_{port}_0")]


def test_deepspeeds_cpu_allreduce_buffer_is_still_named_as_the_strategy_removes_it():
    """The installed DeepSpeed's ``shm.cpp`` still names its buffers as ``shm_allreduce_buffer`` spells them:
    an upgrade that renames them fails here, by name, instead of leaving 69 MB per run in /dev/shm again."""
    from lightning_zeromoe.engine.processes import SHM_BUFFER_NAME, shm_buffer_name_changes
    from troubleshooter.doctor.host import DEEPSPEED_SHM_BUFFERS

    assert shm_buffer_name_changes() == []
    assert DEEPSPEED_SHM_BUFFERS == f"{SHM_BUFFER_NAME}_*"  # what the doctor looks for (kept import-light there)

