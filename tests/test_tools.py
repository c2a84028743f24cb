"""The command-line tools as a user starts them: each console script of ``pyproject.toml`` and its
``python -m`` twin, as real subprocesses; the name in the usage line; help with no arguments; the
generated reference page (``docs/reference/cli.md``) up to date.

The installed console scripts (``.venv/bin``) belong to the editable install of another checkout, so
each is written here the way pip writes it (import the ``[project.scripts]`` target, call it with
``sys.argv[0]`` the script's path) and run with this checkout on ``PYTHONPATH``. The wheel check
(``scripts/wheel_check.sh``, run by ``.ci/run``) runs the ones pip really installs.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lightning_zeromoe import invocation

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
#: Tools that need arguments: run bare, they print their help and exit 2 (the demo runs with its defaults).
NEED_ARGUMENTS = ("zeromoe-export", "zeromoe-plan", "troubleshooter")
#: pip's console-script launcher (pip/_vendor/distlib/scripts.py's template), minus the shebang.
LAUNCHER = """import re, sys
from {module} import {func}
if __name__ == "__main__":
    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
    sys.exit({func}())
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100", "NO_COLOR": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """Every command of this module, two at a time: (how, script, *args) -> its completed process."""
    bin_dir = tmp_path_factory.mktemp("bin")
    commands = {}
    for script, target in SCRIPTS.items():
        module, func = target.split(":")
        (bin_dir / script).write_text(LAUNCHER.format(module=module, func=func))
        commands[("script", script, "--help")] = [sys.executable, str(bin_dir / script), "--help"]
        commands[("-m", script, "--help")] = [sys.executable, "-m", invocation.TOOLS[script], "--help"]
        if script in NEED_ARGUMENTS:
            commands[("script", script)] = [sys.executable, str(bin_dir / script)]

    def go(cmd: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=bin_dir)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(commands, pool.map(go, commands.values())))


def test_every_console_script_is_a_module_too():
    assert sorted(SCRIPTS) == sorted(invocation.TOOLS)
    for script, target in SCRIPTS.items():
        module = target.split(":")[0]
        assert module == invocation.TOOLS[script] or module.startswith(invocation.TOOLS[script] + "."), script


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_names_the_command_the_user_typed(runs, script):
    by_script, by_module = runs[("script", script, "--help")], runs[("-m", script, "--help")]
    for proc in (by_script, by_module):
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "options:" in proc.stdout and "-h, --help" in proc.stdout
    assert by_script.stdout.startswith(f"usage: {script} [-h]"), by_script.stdout[:200]
    assert by_module.stdout.startswith(f"usage: python -m {invocation.TOOLS[script]} [-h]"), by_module.stdout[:200]
    # Past the usage lines (wrapped differently for the longer name) the two helps are the same text.
    assert by_script.stdout.split("\n\n", 1)[1] == by_module.stdout.split("\n\n", 1)[1]


@pytest.mark.parametrize("script", NEED_ARGUMENTS)
def test_no_arguments_prints_the_help(runs, script):
    proc = runs[("script", script)]
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-2000:])
    assert proc.stderr.startswith(f"usage: {script} ") and "options:" in proc.stderr, proc.stderr[:500]
    assert runs[("script", script, "--help")].stdout.split("\n\n", 1)[1] in proc.stderr


def test_the_cli_reference_page_is_generated(monkeypatch):
    """The committed page is what ``scripts/gen_cli_docs.py`` writes from the parsers today."""
    spec = importlib.util.spec_from_file_location("gen_cli_docs", ROOT / "scripts" / "gen_cli_docs.py")
    gen = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gen_cli_docs", gen)  # its dataclass looks its module up there
    spec.loader.exec_module(gen)
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert page == gen.render(), "docs/reference/cli.md is out of date: run python scripts/gen_cli_docs.py"
    for script in SCRIPTS:
        assert f"## {script}\n" in page and f"usage: {script} " in page
    for sub in ("doctor", "lint", "explain"):
        assert f"### troubleshooter {sub}\n" in page and f"usage: troubleshooter {sub} " in page
    assert "--report" in page  # doctor's own options are on the page, not only the subcommand's name


@pytest.mark.parametrize(("argv0", "expected"), [
    ("/venv/bin/zeromoe-plan", "zeromoe-plan"),
    ("C:\\venv\\Scripts\\zeromoe-plan.exe".replace("\\", "/"), "zeromoe-plan"),
    ("/repo/lightning_zeromoe/planner/__main__.py", "python -m lightning_zeromoe.planner"),
    ("/venv/bin/pytest", "python -m lightning_zeromoe.planner"),
])
def test_prog_from_argv0(argv0, expected):
    assert invocation.prog("zeromoe-plan", argv0) == expected


def test_planner_asks_what_to_plan(capsys):
    """Options but nothing to plan (no --config/--model-type/--dense/--mixtral-8x7b): an error naming the
    choices, not the Mixtral report it printed before."""
    from lightning_zeromoe.planner.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--gpus", "16"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "nothing to plan: give --config or --model-type" in err and "--mixtral-8x7b" in err
