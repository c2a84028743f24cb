"""The real CLI, run as a subprocess: output, exit codes, plain vs terminal output, light imports."""

from __future__ import annotations

import argparse
import json
import os
import pty
import select
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
SEEDS = FIXTURES / "seed_configs"
TRACEBACKS = FIXTURES / "tracebacks"
HEAVY = ("torch", "deepspeed", "lightning", "transformers", "pytorch_lightning")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The CLI's environment: this session's schema cache (shared with test_lint.py), no colour."""
    cache = tmp_path_factory.getbasetemp() / "ds_cache"
    return {**os.environ, "TROUBLESHOOTER_CACHE_DIR": str(cache), "NO_COLOR": "1"}


def run(args, env, *, stdin: str | bytes | None = None, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "troubleshooter", *args], input=stdin,
                          capture_output=True, text=not isinstance(stdin, bytes), timeout=timeout,
                          env=env, cwd=ROOT)


def test_importing_the_cli_loads_no_heavy_library():
    code = ("import sys, troubleshooter.cli, troubleshooter.explain, troubleshooter.knowledge, "
            "troubleshooter.lint, troubleshooter.render, troubleshooter.ds_schema; "
            "troubleshooter.knowledge.load_entries(); "
            f"print([m for m in sys.modules if m.split('.')[0] in {HEAVY!r}])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_explain_file_prints_diagnosis_and_exits_0(env):
    proc = run(["explain", str(TRACEBACKS / "real_autoep_top_k.txt")], env)
    assert proc.returncode == 0, proc.stderr
    assert "[autoep-top-k-undetermined]" in proc.stdout and "expert_parallel" in proc.stdout
    assert "\x1b[" not in proc.stdout  # plain when not a terminal


def test_explain_stdin_json(env):
    text = (TRACEBACKS / "issue_nccl_watchdog_old.txt").read_text()
    proc = run(["explain", "-", "--json"], env, stdin=text)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["source"] == "<stdin>"
    assert data["diagnoses"][0]["id"] == "nccl-watchdog-timeout"
    assert data["diagnoses"][0]["details"]["ran_ms"] == "25624887"


def test_explain_unknown_input_says_so_and_exits_1(env):
    proc = run(["explain", "-"], env, stdin="Epoch 1: loss 0.5\nall fine\n")
    assert proc.returncode == 1
    assert "No known problem found" in proc.stdout and "python -m troubleshooter doctor" in proc.stdout


def test_explain_binary_huge_input_does_not_crash(env, tmp_path):
    blob = tmp_path / "blob.bin"
    blob.write_bytes(os.urandom(6 * 1024 * 1024))
    proc = run(["explain", str(blob)], env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr  # unreadable as a log: exit 2
    assert "binary data, not a text log" in proc.stderr and str(6 * 1024 * 1024) in proc.stderr


def test_explain_missing_file_exits_2_with_one_line(env, tmp_path):
    proc = run(["explain", str(tmp_path / "missing.log")], env)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "missing.log" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_lint_seed_config_json_exits_1(env):
    """The seed's batch size does not fit 5 ranks: one error, with its position and fix id."""
    proc = run(["lint", str(SEEDS / "seed002_zero3_moe.json"), "--world-size", "5", "--json"], env)
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert data["errors"] == 1 and data["consumer"] == "deepspeed"
    [error] = [f for f in data["findings"] if f["severity"] == "error"]
    assert (error["rule"], error["line"], error["col"], error["fix_id"]) == ("batch-arithmetic", 1, 3, "set-all-three")
    [moe] = [f for f in data["findings"] if f["rule"] == "moe-config-block-ignored"]
    assert moe["severity"] == "warning" and len(moe["notes"]) == 10  # a note per key, then fp16 and ep_size
    assert moe["note_ids"][-2:] == ["note-fp16", "note-ep-size-divides"]


def test_lint_json_stays_clean_when_a_rename_is_checked_against_deepspeed(env, tmp_path):
    """The rename check imports DeepSpeed (which logs to stdout at import): --json must stay JSON."""
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "wall_clock_breakdwn": true, "comms_log": "verbose"}')
    proc = run(["lint", str(path), "--json"], env)
    data = json.loads(proc.stdout)  # nothing but the JSON on stdout
    messages = {f["path"]: f["message"] for f in data["findings"]}
    assert "Did you mean 'wall_clock_breakdown'?" in messages["wall_clock_breakdwn"]
    assert "Did you mean" not in messages["comms_log"]


def test_lint_for_lightning_refuses_what_deepspeed_accepts(env, tmp_path):
    """hjson and gradient_accumulation_steps: fine for DeepSpeed (exit 0), errors for Lightning."""
    path = tmp_path / "ds.json"
    path.write_text('{\n  "train_micro_batch_size_per_gpu": 2,\n  "gradient_accumulation_steps": 2,\n}\n')
    assert run(["lint", str(path)], env).returncode == 0
    proc = run(["lint", str(path), "--for", "lightning"], env)
    assert proc.returncode == 1
    assert f"{path}:4:1: - [config-file-format]" in proc.stdout
    assert f"{path}:3:3: gradient_accumulation_steps [lightning-gradient-accumulation]" in proc.stdout
    assert "fix [use-accumulate-grad-batches]: Delete gradient_accumulation_steps" in proc.stdout


def test_lint_clean_config_exits_0(env):
    proc = run(["lint", str(SEEDS / "lightning_stage3_offload.json")], env)
    assert proc.returncode == 0, proc.stderr
    assert "aio.thread_count" in proc.stdout


def test_lint_malformed_json_exits_2_with_position(env, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 3,]\n}')
    proc = run(["lint", str(bad)], env)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: {bad}:1:35: invalid JSON (and not hjson either, which "
                                   "DeepSpeed also reads): Expecting property name enclosed in double quotes")


def test_lint_json_error_is_machine_readable(env, tmp_path):
    proc = run(["lint", str(tmp_path / "none.json"), "--json"], env)
    assert proc.returncode == 2 and json.loads(proc.stdout) == {"error": f"{tmp_path / 'none.json'}: no such file"}


@pytest.mark.parametrize("args", [["lint"], ["lint", "x.json", "--world-size", "0"], ["frobnicate"], []])
def test_bad_arguments_exit_2(env, args):
    assert run(args, env).returncode == 2


def _run_in_terminal(args, env, timeout=60.0) -> str:
    """Run the CLI with a pseudo-terminal as stdout, to see what a user's terminal gets."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "troubleshooter", *args], stdout=slave,
                            stderr=subprocess.PIPE, env=env, cwd=ROOT)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], timeout)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=timeout)
    os.close(master)
    return b"".join(chunks).decode("utf-8", "replace")


def test_terminal_output_has_colours_icons_and_a_table(env):
    tty_env = {k: v for k, v in env.items() if k != "NO_COLOR"}
    args = ["lint", str(SEEDS / "seed002_zero3_moe.json"), "--world-size", "5"]  # one error
    out = _run_in_terminal(args, tty_env)
    assert "\x1b[" in out and "✖" in out and "┃" in out  # colour, icon, table border
    plain = _run_in_terminal(args, env)
    assert "\x1b[3" not in plain and "[ERROR]" in plain  # NO_COLOR in a terminal: plain


def test_doctor_subcommand_is_delegated(env):
    """The CLI adds doctor's own options (add_arguments) and hands over to doctor.main."""
    proc = run(["doctor", "--help"], env)
    assert proc.returncode == 0, proc.stderr
    assert "--json" in proc.stdout
    import argparse

    import troubleshooter.doctor as doctor

    own = argparse.ArgumentParser()
    doctor.add_arguments(own)
    options = {s for action in own._actions for s in action.option_strings if s not in ("-h", "--help")}
    assert options and all(s in proc.stdout for s in options), sorted(s for s in options if s not in proc.stdout)


def test_one_colour_policy_for_every_renderer(monkeypatch):
    """doctor's report and lint/explain's console ask the same function (troubleshooter.render)."""
    import io

    from troubleshooter import render
    from troubleshooter.doctor import report

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    seen = []
    for no_color in ("", "1"):
        monkeypatch.setenv("NO_COLOR", no_color)
        for stream in (Terminal(), io.StringIO()):
            seen.append((render.use_color(stream), report.use_color(stream)))
    assert seen == [(True, True), (False, False), (False, False), (False, False)]


def test_doctor_and_cli_do_not_import_each_other():
    """The argparse types live in troubleshooter.argtypes: importing the doctor loads no cli."""
    code = ("import sys, troubleshooter.doctor as d, argparse; p = argparse.ArgumentParser(); d.add_arguments(p); "
            "print('troubleshooter.cli' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr
    from troubleshooter import argtypes, cli

    assert cli.positive_int is argtypes.positive_int
    with pytest.raises(argparse.ArgumentTypeError, match="must be >= 1"):
        argtypes.positive_int("0")
    with pytest.raises(argparse.ArgumentTypeError, match="finite number greater than 0"):
        argtypes.positive_float("inf")


def test_explain_bundled_example(env):
    """``explain --example cuda_oom``: the real log shipped as package data (the fixture's verbatim copy)."""
    from troubleshooter import examples

    assert examples.names() == ["cuda_oom"]
    bundled = Path(examples.path("cuda_oom")).read_bytes()
    assert bundled == (TRACEBACKS / "issue_cuda_oom_new_format.txt").read_bytes()
    proc = run(["explain", "--example", "cuda_oom", "--json"], env)
    assert proc.returncode == 0, proc.stderr
    assert [d["id"] for d in json.loads(proc.stdout)["diagnoses"]] == ["cuda-oom"]
    both = run(["explain", str(TRACEBACKS / "real_autoep_top_k.txt"), "--example", "cuda_oom"], env)
    assert both.returncode == 2 and "give SOURCE or --example, not both" in both.stderr
