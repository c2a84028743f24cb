"""Tests for ``python -m troubleshooter doctor``: every check is driven by building its situation
for real (environment variables, files, processes, a tmpfs) and running the real CLI.

Two things cannot exist on this CPU-only machine and are faked, each in one place:

* a CUDA toolkit of a chosen version: ``fake_nvcc`` writes an ``nvcc`` shell script that prints
  what a real ``nvcc -V`` prints for that release (or hangs, to test the time limit);
* a CUDA build of torch and its GPUs: ``fake_torch`` writes a tiny ``torch`` package onto
  PYTHONPATH that answers ``torch.version.cuda`` and the few ``torch.cuda`` calls the doctor's
  probe makes. It is only used with ``--only cuda``, the one check family that asks those questions.

Everything else (deepspeed's op table, the gloo sub-group timeout, lock files, ulimits, package
versions) is the real installed stack.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from support import deepspeed_job
from troubleshooter import doctor, knowledge, render
from troubleshooter.doctor import report
from troubleshooter.doctor.base import DoctorOptions, run_probe

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "troubleshooter", "doctor"]
#: Variables the scenarios set; removed from the baseline environment so the baseline is clean.
SCENARIO_VARS = ("NCCL_TIMEOUT", "DEEPSPEED_TIMEOUT", "NCCL_P2P_DISABLE", "NCCL_IB_DISABLE",
                 "NCCL_SHM_DISABLE", "NCCL_DEBUG", "DS_SKIP_CUDA_CHECK", "TORCH_EXTENSIONS_DIR",
                 "CUDA_HOME", "CUDA_PATH", "NO_COLOR")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without the scenario variables (or any DS_BUILD_*, TORCH_NCCL_*)."""
    env = {k: v for k, v in os.environ.items()
           if k not in SCENARIO_VARS and not k.startswith(("DS_BUILD_", "TORCH_NCCL_"))}
    env.update(extra)
    return env


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, dict]:
    """Run the real CLI with --json; return the exit status and the parsed output."""
    proc = subprocess.run([*CLI, "--json", *args], capture_output=True, text=True, cwd=REPO,
                          env=env if env is not None else clean_env(), timeout=timeout)
    assert proc.stdout.strip(), f"no output (rc {proc.returncode}): {proc.stderr[-2000:]}"
    return proc.returncode, json.loads(proc.stdout)


def run_here(env: dict[str, str] | None = None, **options) -> tuple[int, dict]:
    """The same checks in this process (probes still run as subprocesses under ``env``).

    Used where the CLI's own start-up would only add time; each family is also run through the
    CLI at least once.
    """
    results = doctor.run_checks(DoctorOptions(env=env if env is not None else clean_env(), **options))
    return doctor.exit_code(results), json.loads(report.to_json(results))


def by_id(payload: dict) -> dict[str, dict]:
    """Results keyed by check id."""
    return {r["id"]: r for r in payload["results"]}


# --------------------------------------------------------------------------- fakes (see module doc)

NVCC_TEMPLATE = """#!/bin/sh
{body}
echo "nvcc: NVIDIA (R) Cuda compiler driver"
echo "Copyright (c) 2005-2025 NVIDIA Corporation"
echo "Cuda compilation tools, release {major}.{minor}, V{major}.{minor}.99"
echo "Build cuda_{major}.{minor}.r{major}.{minor}/compiler.0_0"
"""


def fake_nvcc(root: Path, release: str, hang: bool = False) -> Path:
    """A CUDA toolkit stand-in: ``<root>/bin/nvcc`` printing ``release`` (or sleeping first)."""
    major, minor = release.split(".")
    nvcc = root / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True, exist_ok=True)
    nvcc.write_text(NVCC_TEMPLATE.format(body="sleep 60" if hang else "", major=major, minor=minor))
    nvcc.chmod(0o755)
    return nvcc


def fake_torch(root: Path, cuda: str | None, gpus: int = 0, bf16: bool = True,
               hang: bool = False) -> Path:
    """A CUDA build of torch with ``gpus`` GPUs, which cannot be installed here (see module doc)."""
    package = root / "torch"
    package.mkdir(parents=True, exist_ok=True)
    package.joinpath("__init__.py").write_text(textwrap.dedent(f"""
        import os, time
        if {hang!r}:
            open({str(root / "pid")!r}, "w").write(str(os.getpid()))
            time.sleep(60)
        __version__ = "2.13.0+fake"
        class version:
            cuda = {cuda!r}
            hip = None
        class _Props:
            def __init__(self, index):
                self.name, self.total_memory, self.major, self.minor = "Fake H100", 80 * 2**30, 9, 0
        class cuda:
            is_available = staticmethod(lambda: {gpus} > 0)
            device_count = staticmethod(lambda: {gpus})
            get_device_properties = staticmethod(_Props)
            is_bf16_supported = staticmethod(lambda: {bf16!r})
        """))
    return root


def path_with(directory: Path) -> str:
    """PATH with ``directory`` first, so its nvcc shadows any real one."""
    return f"{directory}{os.pathsep}{os.environ.get('PATH', '')}"


# --------------------------------------------------------------------------- start-up cost

def test_doctor_start_path_imports_nothing_heavy():
    """Importing the doctor, its report and every check module loads no torch/deepspeed/lightning/transformers."""
    code = textwrap.dedent("""
        import sys, importlib
        import troubleshooter.doctor, troubleshooter.doctor.report
        from troubleshooter.doctor import FAMILIES
        for family in FAMILIES:
            importlib.import_module("troubleshooter.doctor." + family)
        heavy = ("torch", "deepspeed", "lightning", "lightning_fabric", "transformers")
        print(sorted(m for m in sys.modules if m.split(".")[0] in heavy))
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         check=True).stdout
    assert out.strip() == "[]"


# --------------------------------------------------------------------------- the whole doctor, here

@pytest.fixture(scope="module")
def here() -> tuple[int, dict]:
    """One full doctor run on this machine, with a clean environment."""
    return run_cli(env=clean_env())


def test_full_run_covers_every_family_and_a_healthy_machine_exits_0(here):
    """This CPU machine is healthy for CPU training: nothing fails, and the doctor exits 0."""
    code, payload = here
    ids = by_id(payload)
    assert len(ids) == len(payload["results"])  # ids are unique
    for family in doctor.FAMILIES:
        assert any(i.startswith(family + ".") for i in ids), family
    failed = [r["id"] for r in payload["results"] if r["status"] in ("fail", "error")]
    assert failed == [] and code == 0
    # every warning or failure says what to do, citing a knowledge-base fix
    for r in payload["results"]:
        if r["status"] in ("warn", "fail", "error"):
            assert r["fix"] and r["fix_id"] and r["entry"], r


def test_versions_match_installed_metadata(here):
    from importlib import metadata
    ids = by_id(here[1])
    assert ids["versions.deepspeed"]["details"]["version"] == metadata.version("deepspeed")
    assert ids["versions.torch"]["details"]["version"] == metadata.version("torch")
    assert ids["versions.native_moe"]["status"] == "ok"  # deepspeed 0.19.8 refuses it
    # transformers <= 5.22 here, or 5.23/5.24 which ZeroMoEStrategy handles (compat.KNOWN_BAD_COMBINATIONS)
    assert ids["versions.known_bad"]["status"] == "ok"


def test_cpu_machine_skips_gpu_checks_and_says_cpu_mode_works(here):
    """On this CPU build of torch: no GPU -> skip, and the doctor says CPU (gloo) works."""
    ids = by_id(here[1])
    if ids["cuda.match"]["details"].get("torch_cuda") is not None:
        pytest.skip("torch here is a CUDA build")
    assert ids["cuda.match"]["status"] == "skip"
    assert ids["cuda.gpus"]["status"] == "skip"
    assert "gloo" in ids["cuda.gpus"]["why"]
    assert ids["nccl.available"]["status"] == "skip"


def test_subgroup_timeout_is_measured_on_installed_torch(here):
    """The probe's measurement: new_group(ranks) gets the gloo default, not the world timeout."""
    sub = by_id(here[1])["timeouts.subgroup"]
    d = sub["details"]
    assert d["world_timeout_s"] == d["requested_world_timeout_s"] == 17 * 60
    assert d["subgroup_timeout_s"] == d["backend_default_s"] == 30 * 60  # torch 2.13: gloo default
    # without expert groups in the user's setup the probe's own 17 min is no reason to warn
    assert sub["status"] == "ok" and "17" not in sub["found"]


def test_subgroup_timeout_warns_only_with_expert_groups(tmp_path):
    """--ep-size 2, or a config with AutoEP size 2: the expert groups miss the timeout: warn."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 3},
                                  "expert_parallel": {"enabled": True, "autoep_size": 2}}))
    results = {r.id: r for r in doctor.run_checks(DoctorOptions(only=("timeouts",), env=clean_env(),
                                                               config=str(config)))}
    sub = results["timeouts.subgroup"]
    assert sub.status == "warn" and "ep_size 2" in sub.found
    assert sub.fix_id == "subgroup-timeout/use-strategy-timeout" and "apply_timeout_to_all_groups" in sub.fix
    assert sub.fix == knowledge.fix("subgroup-timeout", "use-strategy-timeout").text


def test_op_table_agrees_with_ds_report(here):
    """build.ops reports the same installed/compatible columns as the real ds_report."""
    ds_report = Path(sys.executable).with_name("ds_report")
    if not ds_report.exists():
        pytest.skip("ds_report is not installed next to this interpreter")
    text = subprocess.run([sys.executable, str(ds_report)], capture_output=True, text=True,
                          timeout=120, env=clean_env()).stdout
    plain = re.sub(r"\x1b\[[0-9;]*m", "", text)
    rows = dict((m[0], (m[1] == "YES", m[2] == "OKAY"))
                for m in re.findall(r"^(\w+) \.*\s*\[(YES|NO)\] \.*\s*\[(OKAY|NO)\]", plain, re.M))
    ops = by_id(here[1])["build.ops"]["details"]["ops"]
    assert rows and set(rows) == set(ops)
    assert {n: (o["installed"], o["compatible"]) for n, o in ops.items()} == rows
    # ... and the reasons ds_report prints for an op it cannot build (async_io without libaio)
    warnings = [re.sub(r"^\s*\[WARNING\]\s*", "", line).strip()
                for line in plain.splitlines() if "[WARNING]" in line]
    for name, op in ops.items():
        theirs = [w for w in warnings if w.startswith(name)]
        if not op["compatible"] and theirs:
            assert all(w in (op["reason"] or "") for w in theirs), (name, theirs, op["reason"])
            assert name in by_id(here[1])["build.ops"]["found"]


# --------------------------------------------------------------------------- CUDA (fakes, see module doc)

@pytest.mark.parametrize("torch_cuda, nvcc, skip_check, status, via_cli", [
    ("12.1", "12.1", False, "ok", False),
    ("12.1", "12.4", False, "warn", True),    # both in deepspeed's cuda_minor_mismatch_ok[12]
    ("12.1", "11.8", False, "fail", True),    # major mismatch: CUDAMismatchException
    ("13.0", "13.1", False, "fail", False),   # no tolerance listed for 13: deepspeed refuses
    ("13.0", "13.1", True, "warn", False),    # ... unless DS_SKIP_CUDA_CHECK=1
])
def test_cuda_version_rule(tmp_path, torch_cuda, nvcc, skip_check, status, via_cli):
    """A fake nvcc on PATH stands in for a CUDA toolkit, a fake torch for a CUDA build of torch."""
    fake_nvcc(tmp_path / "cuda", nvcc)
    env = clean_env(PATH=path_with(tmp_path / "cuda" / "bin"),
                    PYTHONPATH=str(fake_torch(tmp_path / "py", torch_cuda, gpus=2)))
    if skip_check:
        env["DS_SKIP_CUDA_CHECK"] = "1"
    code, payload = run_cli("--only", "cuda", env=env) if via_cli else run_here(env, only=("cuda",))
    ids = by_id(payload)
    assert ids["cuda.toolkit"]["details"]["release"] == [int(x) for x in nvcc.split(".")]
    assert ids["cuda.match"]["status"] == status, ids["cuda.match"]
    assert ids["cuda.gpus"]["status"] == "ok"
    assert code == (1 if status == "fail" else 0)


def test_cuda_mismatch_without_a_gpu_warns_since_deepspeed_uses_its_cpu_accelerator(tmp_path):
    """PyPI's CUDA wheel on a CPU machine (torch 2.15.0+cu132 against nvcc 13.0, measured here): no
    GPU, so DeepSpeed builds no CUDA op; the mismatch is a warning with its fix, not a failure."""
    fake_nvcc(tmp_path / "cuda", "13.0")
    env = clean_env(PATH=path_with(tmp_path / "cuda" / "bin"),
                    PYTHONPATH=str(fake_torch(tmp_path / "py", "13.2", gpus=0)))
    code, payload = run_here(env, only=("cuda",))
    match = by_id(payload)["cuda.match"]
    assert match["status"] == "warn" and "no GPU is visible" in match["found"] and match["fix_id"], match
    assert code == 0


def test_cuda_home_wins_over_path_like_torch(tmp_path):
    """torch's rule: $CUDA_HOME/bin/nvcc is used even when another nvcc is first on PATH."""
    fake_nvcc(tmp_path / "on_path", "11.8")
    fake_nvcc(tmp_path / "home", "12.1")
    env = clean_env(PATH=path_with(tmp_path / "on_path" / "bin"), CUDA_HOME=str(tmp_path / "home"),
                    PYTHONPATH=str(fake_torch(tmp_path / "py", "12.1", gpus=1)))
    code, payload = run_cli("--only", "cuda", env=env)
    assert by_id(payload)["cuda.match"]["status"] == "ok"
    assert code == 0


def test_gpu_without_bf16_warns(tmp_path):
    """Fake GPUs (none can exist here) that lack bf16: MoE prefers bf16, so warn."""
    fake_nvcc(tmp_path / "cuda", "12.1")
    env = clean_env(PATH=path_with(tmp_path / "cuda" / "bin"),
                    PYTHONPATH=str(fake_torch(tmp_path / "py", "12.1", gpus=4, bf16=False)))
    code, payload = run_here(env, only=("cuda",))
    gpus = by_id(payload)["cuda.gpus"]
    assert gpus["status"] == "warn" and gpus["details"]["count"] == 4
    assert code == 0


def test_cuda_torch_without_toolkit_warns(tmp_path):
    """A CUDA torch and no nvcc anywhere: DeepSpeed cannot JIT-build CUDA ops."""
    env = clean_env(PATH="/usr/bin:/bin", CUDA_HOME=str(tmp_path / "no-such-cuda"),
                    PYTHONPATH=str(fake_torch(tmp_path / "py", "12.1", gpus=1)))
    code, payload = run_here(env, only=("cuda",))
    ids = by_id(payload)
    assert ids["cuda.toolkit"]["status"] == "warn"
    assert ids["cuda.toolkit"]["entry"] == "cuda-home-missing"
    assert ids["cuda.match"]["status"] == "skip"


# --------------------------------------------------------------------------- probes never hang

def test_hanging_nvcc_is_an_error_within_the_limit(tmp_path):
    """nvcc on a dead mount hangs; the doctor kills it at --timeout and reports 'error'."""
    fake_nvcc(tmp_path / "cuda", "12.1", hang=True)
    env = clean_env(PATH=path_with(tmp_path / "cuda" / "bin"),
                    PYTHONPATH=str(fake_torch(tmp_path / "py", "12.1", gpus=1)))
    start = time.monotonic()
    code, payload = run_cli("--only", "cuda", "--timeout", "1", env=env)
    assert time.monotonic() - start < 15
    toolkit = by_id(payload)["cuda.toolkit"]
    assert toolkit["status"] == "error" and "did not finish" in toolkit["found"]
    assert code == 1


def test_hanging_torch_import_is_an_error_within_the_limit(tmp_path):
    """The torch probe (here: a torch whose import blocks, as CUDA init can) is killed and reported."""
    env = clean_env(PYTHONPATH=str(fake_torch(tmp_path / "py", "12.1", hang=True)))
    start = time.monotonic()
    code, payload = run_cli("--only", "cuda", "--timeout", "2", env=env)
    assert time.monotonic() - start < 15
    probe = by_id(payload)["cuda.torch"]
    assert probe["status"] == "error" and "did not finish within its limit of 2 s" in probe["found"]
    assert code == 1


def test_ctrl_c_kills_the_probe(tmp_path):
    """Ctrl-C while a probe hangs: the doctor stops at once and leaves no probe behind."""
    env = clean_env(PYTHONPATH=str(fake_torch(tmp_path / "py", "12.1", hang=True)))
    proc = subprocess.Popen([*CLI, "--only", "cuda", "--timeout", "60"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid_file = tmp_path / "py" / "pid"
    deadline = time.monotonic() + 20
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pid_file.exists(), "the probe never started"
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=15)
    assert time.monotonic() - start < 10 and proc.returncode != 0
    time.sleep(0.2)
    assert not alive(int(pid_file.read_text()))


def test_run_probe_kills_the_whole_process_group(tmp_path):
    """A probe that spawned a helper: on timeout both are gone, and the call returned in time."""
    pid_file = tmp_path / "grandchild.pid"
    script = f"sleep 60 & echo $! > {pid_file}; echo started; wait"
    start = time.monotonic()
    outcome = run_probe(["/bin/sh", "-c", script], timeout=1)
    assert time.monotonic() - start < 5
    assert outcome.timed_out and not outcome.ok and "started" in outcome.stdout
    grandchild = int(pid_file.read_text())
    time.sleep(0.2)
    assert not alive(grandchild)


def alive(pid: int) -> bool:
    """Running or sleeping; a killed orphan may linger as a zombie until init reaps it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_probe_that_cannot_start_is_reported():
    outcome = run_probe(["/nonexistent/nvcc", "-V"], timeout=5)
    assert outcome.launch_error and "could not run nvcc" in outcome.describe_failure()


# --------------------------------------------------------------------------- environment scenario

@pytest.fixture()
def locks(tmp_path):
    """A TORCH_EXTENSIONS_DIR with a stale, a fresh, and an old-but-held lock file."""
    root = tmp_path / "ext"
    stale, fresh, held = (root / op / "lock" for op in ("cpu_adam", "fused_adam", "shm_comm"))
    for lock in (stale, fresh, held):
        lock.parent.mkdir(parents=True)
        lock.touch()
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    os.utime(held, (hour_ago, hour_ago))
    holder = subprocess.Popen([sys.executable, "-c",
                               f"import time; f = open({str(held)!r}); print('open', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "open"
    yield root, stale, fresh, held, holder.pid
    holder.kill()
    holder.wait()


def test_environment_scenario(tmp_path, locks):
    """One real run with the usual copy-pasted variables set, a tiny /dev/shm and stale locks."""
    root, stale, fresh, held, holder_pid = locks
    env = clean_env(NCCL_TIMEOUT="1800", DEEPSPEED_TIMEOUT="ten", DS_BUILD_OPS="0",
                    NCCL_P2P_DISABLE="1", NCCL_IB_DISABLE="0", NCCL_DEBUG="TRACE",
                    TORCH_NCCL_ASYNC_ERROR_HANDLING="0", NCCL_BLOCKING_WAIT="1",
                    TORCH_EXTENSIONS_DIR=str(root))
    code, payload = run_cli("--only", "env,timeouts,nccl,host,build", "--shm-path",
                            str(tmp_path / "no-shm-here"), env=env)
    ids = by_id(payload)
    assert ids["timeouts.nccl_timeout"]["status"] == "warn"
    assert ids["timeouts.nccl_timeout"]["entry"] == "nccl-timeout-env-ignored"
    assert ids["timeouts.deepspeed_timeout"]["status"] == "fail"
    # deepspeed itself cannot be imported with that DEEPSPEED_TIMEOUT: the op probe says so,
    # and the torch-only stages before it still answered.
    assert ids["build.ops"]["status"] == "error" and "ValueError" in ids["build.ops"]["found"]
    assert ids["timeouts.subgroup"]["status"] == "ok"  # no expert groups in this setup
    knobs = ids["timeouts.torch_nccl"]
    assert knobs["status"] == "warn"
    assert "deprecated name of TORCH_NCCL_BLOCKING_WAIT" in knobs["found"]
    assert knobs["details"]["in_torch_libraries"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] is True
    assert ids["env.ds_build"]["status"] == "warn" and "does not skip" in ids["env.ds_build"]["found"]
    switches = ids["nccl.switches"]
    assert switches["status"] == "warn" and "NCCL_P2P_DISABLE" in switches["found"]
    assert "NCCL_IB_DISABLE" not in switches["found"]  # =0 leaves IB on
    assert ids["nccl.debug"]["status"] == "warn"
    assert ids["host.shm"]["status"] == "warn"
    lock_result = ids["env.extension_locks"]
    assert lock_result["status"] == "fail"
    rows = {r["path"]: r for r in lock_result["details"]["locks"]}
    assert str(stale) in lock_result["found"]
    assert str(fresh) not in lock_result["found"] and str(held) not in lock_result["found"]
    assert rows[str(held)]["held_by"] == [holder_pid]
    assert code == 1


def test_clean_environment_has_none_of_those_warnings(here):
    ids = by_id(here[1])
    for check in ("timeouts.nccl_timeout", "timeouts.deepspeed_timeout", "timeouts.torch_nccl",
                  "env.ds_build", "nccl.switches", "nccl.debug"):
        assert ids[check]["status"] == "ok", ids[check]


@pytest.mark.parametrize("variables, status", [
    ({}, "ok"),
    ({"DS_BUILD_OPS": "0"}, "warn"),
    ({"DS_BUILD_OPS": "1"}, "warn"),          # the installed deepspeed has no pre-built op
    ({"DS_BUILD_CPU_ADAM": "1"}, "ok"),       # a real op variable
    ({"DS_BUILD_CPU_ADMA": "1"}, "warn"),     # a typo deepspeed silently ignores
    ({"DS_BUILD_OPS": "yes"}, "warn"),        # setup.py would fail on int()
])
def test_ds_build_variables(variables, status):
    results = doctor.run_checks(DoctorOptions(only=("env",), env=clean_env(**variables)))
    assert {r.id: r for r in results}["env.ds_build"].status == status


def test_default_extensions_dir_is_torchs(tmp_path):
    """Without TORCH_EXTENSIONS_DIR the doctor looks where torch's _get_build_directory builds."""
    env = clean_env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    torch_dir = subprocess.run(
        [sys.executable, "-c", "from torch.utils.cpp_extension import _get_build_directory as g; "
                               "print(g('cpu_adam', False))"],
        capture_output=True, text=True, env=env, check=True).stdout.strip()
    lock = Path(torch_dir) / "lock"
    lock.touch()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    results = doctor.run_checks(DoctorOptions(only=("env",), env=env))
    found = {r.id: r for r in results}["env.extension_locks"]
    assert found.status == "fail" and str(lock) in found.found


def test_stale_lock_age_threshold_is_an_option(tmp_path):
    lock = tmp_path / "ext" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    old = time.time() - 5 * 60
    os.utime(lock, (old, old))
    env = clean_env(TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    status = {m: {r.id: r for r in doctor.run_checks(
        DoctorOptions(only=("env",), env=env, stale_lock_minutes=m))}["env.extension_locks"].status
        for m in (10, 2)}
    assert status == {10: "ok", 2: "fail"}


def test_deepspeed_buffers_left_in_dev_shm_are_listed_and_one_in_use_is_not():
    """A real one-process DeepSpeed CPU run (``LOCAL_SIZE=1``, as DeepSpeed's launcher sets it on one host) makes
    its 69 MB all-reduce buffer in /dev/shm. While the run lives the doctor finds it mapped by that process and
    leaves it out; once the run has exited, the doctor lists it with the command that removes it."""
    from support.jobs import free_port

    port = str(free_port())
    buffer = Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_0")
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, deepspeed; deepspeed.init_distributed(dist_backend='gloo'); "
         "print('ready', flush=True); sys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
        env=clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      LOCAL_SIZE="1", DS_ACCELERATOR="cpu"))
    try:
        said = []
        while "ready" not in said and (line := child.stdout.readline()):  # DeepSpeed prints its op's build first
            said.append(line.strip())
        assert "ready" in said, said
        assert buffer.is_file(), "DeepSpeed made no shared-memory buffer: nothing to test"
        _, payload = run_cli("--only", "host")
        running = by_id(payload)["host.shm_leftovers"]
        rows = {r["path"]: r for r in running["details"]["buffers"]}
        assert rows[str(buffer)]["mapped_by"] == [child.pid] and rows[str(buffer)]["bytes"] > 60 * 2**20
        assert str(buffer) not in running["found"] + running.get("fix", "")
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=60) == 0
        assert buffer.is_file()  # DeepSpeed did not remove it
        _, payload = run_cli("--only", "host")
        left = by_id(payload)["host.shm_leftovers"]
        assert left["status"] == "warn" and left["entry"] == "deepspeed-shm-buffers-left"
        assert left["fix_id"] == "deepspeed-shm-buffers-left/remove-left-buffers" and str(buffer) in left["fix"]
        assert "mapped by no process" in left["found"] and "never removes it" in left["why"]
    finally:
        child.kill()
        child.wait()
        buffer.unlink(missing_ok=True)


def test_tiny_shm_tmpfs_warns(tmp_path):
    """A real 16 MiB tmpfs, mounted in a private mount namespace, stands in for Docker's /dev/shm."""
    mount = tmp_path / "shm"
    mount.mkdir()
    inner = " ".join([*CLI, "--json", "--only", "host", "--shm-path", str(mount)])
    proc = subprocess.run(["unshare", "-rm", "sh", "-c",
                           f"mount -t tmpfs -o size=16m tmpfs {mount} && exec {inner}"],
                          capture_output=True, text=True, cwd=REPO, env=clean_env())
    if proc.returncode != 0 and not proc.stdout.strip():
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {proc.stderr.strip()}")
    shm = by_id(json.loads(proc.stdout))["host.shm"]
    assert shm["status"] == "warn" and shm["details"]["bytes"] == 16 * 2**20
    assert shm["entry"] == "shm-too-small"


def _host_under_ulimit(limit: str) -> dict | None:
    """The host checks of a real CLI run under `ulimit -l LIMIT` (None: the shell may not set it)."""
    inner = " ".join([*CLI, "--json", "--only", "host"])
    proc = subprocess.run(["sh", "-c", f"ulimit -l {limit} && exec {inner}"], capture_output=True,
                          text=True, cwd=REPO, env=clean_env(), timeout=120)
    return by_id(json.loads(proc.stdout)) if proc.stdout.strip() else None


def test_memlock_limit_is_read_from_the_process():
    """A 64 KiB limit (Docker's old default) warns; unlimited (what NVIDIA asks for) is ok."""
    low = _host_under_ulimit("64")
    assert low is not None
    memlock = low["host.memlock"]
    assert memlock["status"] == "warn" and memlock["details"]["soft"] == 64 * 1024
    assert memlock["fix_id"] == "memlock-limit/raise-memlock" and "memlock" in memlock["fix"]
    high = _host_under_ulimit("unlimited")
    if high is None:
        pytest.skip("this shell may not raise the locked-memory limit (not root)")
    assert high["host.memlock"]["status"] == "ok" and high["host.memlock"]["found"] == "unlimited"


def test_host_ram_advice_is_deepspeeds_estimator():
    """The bytes per offloaded parameter are those of DeepSpeed's own estimator, called for real."""
    from troubleshooter.doctor import host

    real = deepspeed_job.records()["offload_estimates"]["cpu_bytes"]  # the estimator, called for real
    for key, cpu_bytes in real.items():
        params, nodes, offload_params = key.split("-")
        ours = host.offload_host_bytes(int(params), offload_params=offload_params == "True", nodes=int(nodes))
        assert ours == cpu_bytes, key
    assert host.params_that_fit(24 * 10**9, offload_params=False) == 10**9  # 16 B x 1.5 per param


def test_host_checks_read_the_real_machine():
    results = {r.id: r for r in doctor.run_checks(DoctorOptions(only=("host",)))}
    assert "16 bytes per parameter" in results["host.ram"].why and "12 bytes" not in results["host.ram"].why
    shm = os.statvfs("/dev/shm")
    assert results["host.shm"].details["bytes"] == shm.f_blocks * shm.f_frsize
    total_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                    if line.startswith("MemTotal:"))
    assert results["host.ram"].details["total"] == total_kb * 1024


def memory_cgroup_dir() -> Path | None:
    """A directory where a child memory cgroup can be made (v1 or v2), or None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            return base if os.access(base, os.W_OK) else None
    base = Path("/sys/fs/cgroup") / next(
        (l.split(":", 2)[2] for l in Path("/proc/self/cgroup").read_text().splitlines()
         if l.startswith("0::")), "/").lstrip("/")
    controllers = base / "cgroup.subtree_control"
    ok = controllers.exists() and "memory" in controllers.read_text() and os.access(base, os.W_OK)
    return base if ok else None


def test_container_memory_limit_warns(tmp_path):
    """A real 1 GiB memory cgroup (a container's limit): /proc/meminfo shows the host, so warn."""
    parent = memory_cgroup_dir()
    if parent is None:
        pytest.skip("cannot create a memory cgroup here (needs root and a memory controller)")
    group = parent / f"doctor-test-{os.getpid()}"
    group.mkdir()
    try:
        limit_file = "memory.limit_in_bytes" if (group / "memory.limit_in_bytes").exists() else "memory.max"
        (group / limit_file).write_text(str(2**30))
        inner = " ".join([*CLI, "--json", "--only", "host"])
        proc = subprocess.run(["sh", "-c", f"echo $$ > {group / 'cgroup.procs'} && exec {inner}"],
                              capture_output=True, text=True, cwd=REPO, env=clean_env())
    finally:
        group.rmdir()
    ram = by_id(json.loads(proc.stdout))["host.ram"]
    assert ram["details"]["cgroup_limit"] == 2**30
    assert ram["status"] == "warn" and "limited to 1.0 GiB" in ram["found"]


# --------------------------------------------------------------------------- layout

@pytest.mark.parametrize("args, statuses, code", [
    (["--ep-size", "4", "--num-experts", "8", "--world-size", "16", "--gpus-per-node", "8"],
     {"layout.experts": "ok", "layout.world": "ok", "layout.node": "ok"}, 0),
    (["--ep-size", "3", "--num-experts", "8"], {"layout.experts": "fail"}, 1),
    (["--ep-size", "16", "--num-experts", "8"], {"layout.experts": "fail"}, 1),
    (["--ep-size", "4", "--world-size", "6"], {"layout.world": "fail"}, 1),
    (["--ep-size", "16", "--num-experts", "64", "--world-size", "32", "--gpus-per-node", "8"],
     {"layout.node": "warn", "layout.experts": "ok"}, 0),
    (["--ep-size", "3", "--num-experts", "6", "--world-size", "24", "--gpus-per-node", "8"],
     {"layout.node": "warn"}, 0),     # groups of 3 consecutive ranks straddle 8-GPU nodes
    (["--num-experts", "8"], {"layout.ep_size": "skip"}, 0),
])
def test_layout(args, statuses, code):
    if len(args) == 8:  # the full argument set goes through the CLI
        rc, payload = run_cli("--only", "layout", *args)
    else:
        names = {"--ep-size": "ep_size", "--num-experts": "num_experts", "--world-size": "world_size",
                 "--gpus-per-node": "gpus_per_node"}
        rc, payload = run_here(only=("layout",), **{names[k]: int(v) for k, v in zip(args[::2], args[1::2])})
    ids = by_id(payload)
    assert {k: ids[k]["status"] for k in statuses} == statuses
    assert rc == code


# --------------------------------------------------------------------------- config (--config)

def test_config_with_errors_fails(tmp_path):
    """A config DeepSpeed cannot use: the lint's errors become failed checks, exit 1."""
    config = tmp_path / "ds_config.json"
    config.write_text('{"train_batch_size": 32, "zero_optimization": {"stage": 3,}')
    code, payload = run_cli("--only", "config", "--config", str(config))
    lint = by_id(payload)["config.lint"]
    assert lint["status"] == "fail" and str(config) in lint["found"]
    assert "Traceback" not in lint["found"]
    assert code == 1


def test_config_lint_findings_become_results(tmp_path):
    """Batch arithmetic that DeepSpeed refuses (32 != 1 x 4 x 3) must fail with --world-size 3."""
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}}))
    code, payload = run_cli("--only", "config", "--config", str(config), "--world-size", "3")
    results = payload["results"]
    assert all(r["id"].startswith("config.") for r in results)
    batch = [r for r in results if r["details"].get("rule") == "batch-arithmetic"]
    assert [r["status"] for r in batch] == ["fail"] and batch[0]["entry"] == "batch-arithmetic"
    assert code == 1
    # the same config on 8 ranks is consistent (32 == 1 x 4 x 8): no batch finding, no failure
    code, payload = run_cli("--only", "config", "--config", str(config), "--world-size", "8")
    assert not [r for r in payload["results"] if r["details"].get("rule") == "batch-arithmetic"]
    assert code == 0, payload["results"]


def test_no_config_is_skipped():
    code, payload = run_cli("--only", "config")
    assert by_id(payload)["config.lint"]["status"] == "skip" and code == 0


# --------------------------------------------------------------------------- arguments and output

@pytest.mark.parametrize("args", [
    ["--ep-size", "0"], ["--ep-size", "two"], ["--only", "gpu"], ["--timeout", "-1"],
    ["--no-such-flag"],
])
def test_bad_arguments_exit_2(args):
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=REPO, env=clean_env())
    assert proc.returncode == 2, proc.stderr
    assert "usage" in proc.stderr and "Traceback" not in proc.stderr


def test_terminal_output_plain_when_piped_and_no_color():
    """Piped (not a TTY): plain text with tags and the fix of each warn/fail, no escape codes."""
    proc = subprocess.run([*CLI, "--only", "layout,env", "--ep-size", "3", "--num-experts", "8"],
                          capture_output=True, text=True, cwd=REPO, env=clean_env(DS_BUILD_OPS="0"))
    assert proc.returncode == 1
    assert "\x1b[" not in proc.stdout
    assert "[FAIL] ep_size vs experts" in proc.stdout and "[WARN] DS_BUILD_OPS" in proc.stdout
    assert "fix: Use an ep_size from [1, 2, 4, 8]" in proc.stdout


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_output_colored_in_a_tty_unless_no_color(monkeypatch):
    results = doctor.run_checks(DoctorOptions(only=("layout",), ep_size=3, num_experts=8))
    monkeypatch.delenv("NO_COLOR", raising=False)
    tty = _Tty()
    report.render(results, tty)
    fail_icon = render.status_style("fail")[0]
    assert "\x1b[" in tty.getvalue() and fail_icon in tty.getvalue() and "fix:" in tty.getvalue()
    monkeypatch.setenv("NO_COLOR", "1")
    tty = _Tty()
    report.render(results, tty)
    assert "\x1b[" not in tty.getvalue() and "[FAIL]" in tty.getvalue()


def test_json_summary_counts():
    code, payload = run_cli("--only", "layout", "--ep-size", "3", "--num-experts", "8",
                            "--world-size", "6", "--gpus-per-node", "4")
    summary = payload["summary"]
    assert summary["total"] == len(payload["results"]) == 3
    assert (summary["fail"], summary["warn"], summary["ok"]) == (1, 1, 1)
    assert summary["exit_code"] == code == 1
    assert set(payload["results"][0]) == {"id", "title", "status", "found", "why", "fix", "entry",
                                          "details", "fix_id"}


def test_cited_entries_exist_in_the_knowledge_base():
    """Every knowledge-base id a doctor check cites must be a real entry."""
    from troubleshooter import knowledge
    source = "\n".join(p.read_text() for p in (REPO / "troubleshooter" / "doctor").glob("*.py"))
    cited = set(re.findall(r'entry\s*=\s*"([a-z0-9.\-]+)"', source))
    assert cited
    missing = []
    for entry_id in sorted(cited):
        try:
            knowledge.get(entry_id)
        except KeyError:
            missing.append(entry_id)
    assert not missing, f"entries cited by the doctor but absent: {missing}"


# --------------------------------------------------------------------------- did-you-mean, keys, report

def test_misspelt_knobs_get_a_did_you_mean():
    """Real names come from the installed deepspeed builders and torch's libc10; NCCL's from its docs."""
    env = clean_env(DS_BUILD_CPU_ADMA="1", PYTORCH_CUDA_ALOC_CONF="expandable_segments:True",
                    NCCL_IB_DISABEL="1", NCCL_SOCKET_IFNAME="eth0", TORCH_NCCL_BLOCKNG_WAIT="1",
                    PYTORCH_ALLOC_CONF="expandable_segments:True")
    result = {r.id: r for r in doctor.run_checks(DoctorOptions(only=("env",), env=env))}["env.knob_names"]
    typos = {t["name"]: t["suggestion"] for t in result.details["typos"]}
    assert typos == {"DS_BUILD_CPU_ADMA": "DS_BUILD_CPU_ADAM",
                     "PYTORCH_CUDA_ALOC_CONF": "PYTORCH_CUDA_ALLOC_CONF",
                     "NCCL_IB_DISABEL": "NCCL_IB_DISABLE",
                     "TORCH_NCCL_BLOCKNG_WAIT": "TORCH_NCCL_BLOCKING_WAIT"}
    assert result.status == "warn" and "Rename DS_BUILD_CPU_ADMA to DS_BUILD_CPU_ADAM" in result.fix
    clean = {r.id: r for r in doctor.run_checks(DoctorOptions(only=("env",), env=clean_env(
        PYTORCH_ALLOC_CONF="expandable_segments:True", NCCL_SOCKET_IFNAME="eth0")))}
    assert clean["env.knob_names"].status == "ok"


def test_what_to_do_names_the_key(tmp_path):
    """Lint findings become doctor results whose fix says which key it is about."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 8, "bf16": {"enable": True},
                                  "zero_optimization": {"stage": 3, "overlap_com": True}}))
    proc = subprocess.run([*CLI, "--only", "config", "--config", str(config)], capture_output=True,
                          text=True, cwd=REPO, env=clean_env(), timeout=120)
    todo = proc.stdout.split("What to do:")[1]
    fixes = [line for line in todo.splitlines() if line.strip().startswith("fix:")]
    assert fixes
    assert any("bf16.enable" in f for f in fixes) and any("overlap_com" in f for f in fixes), fixes


def test_report_is_one_markdown_block_with_the_facts_and_no_secret(tmp_path):
    env = clean_env(HF_TOKEN="hf_" + "a" * 34, WANDB_API_KEY="0123456789abcdef0123",
                    NCCL_SOCKET_IFNAME="eth0", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
                    MASTER_ADDR="10.1.2.3", HF_ENDPOINT="https://user:hunter2@hub.example.com",
                    TORCH_NCCL_TOKEN_LIKE="ghp_" + "b" * 36)
    proc = subprocess.run([*CLI, "--report", "--only", "versions,cuda,env,nccl,host"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=240)
    out = proc.stdout
    from importlib import metadata
    assert out.startswith("<!--") and out.count("<details") == 1 and out.rstrip().endswith("</details>")
    for needle in ("glibc", "kernel", "gcc", "numa", "cpu", "driver (nvidia-smi)", "torch CUDA",
                   "deepspeed: 0.19.8 (", f"torch: {metadata.version('torch')}", "compiled with: torch", "lightning-zeromoe",
                   "PYTORCH_CUDA_ALLOC_CONF: expandable_segments:True", "PYTORCH_ALLOC_CONF: (not set)",
                   "NCCL_SOCKET_IFNAME: eth0", "| OK | Python |", "| OK | deepspeed version |"):
        assert needle in out, needle
    for secret in ("hf_aaaa", "0123456789abcdef0123", "hunter2", "ghp_bbbb"):
        assert secret not in out, secret
    assert "HF_TOKEN: ***" in out and "WANDB_API_KEY: ***" in out and "user:***@hub.example.com" in out
    assert proc.returncode == 0
