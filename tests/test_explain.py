"""explain: real tracebacks in, the right diagnosis out; bounded, robust and fast reading."""

from __future__ import annotations

import io
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from troubleshooter import explain, log_input
from troubleshooter.oom_numbers import parse_oom

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
BENIGN = FIXTURES / "benign"
TRACEBACKS = FIXTURES / "tracebacks"
sys.path.insert(0, str(FIXTURES))
import make_tracebacks  # noqa: E402  (the generator's case code, reused for the live test)

from support import deepspeed_job  # noqa: E402  (tests/ is on sys.path: one deepspeed job per session)

#: fixture file -> the entry that must be the top diagnosis.
EXPECTED = {
    # our own errors, and a resume report (lightning #19585), from the branches that added them
    "issue_zero_dp_world_size_resume.txt": "resume-shape-unsupported",
    "moe_conversion_mismatch_olmoe.txt": "moe-conversion-mismatch",
    "real_resume_shape_unsupported.txt": "resume-shape-unsupported",
    "real_save_after_evaluation.txt": "save-after-evaluation",
    "real_checkpoint_disk_full.txt": "checkpoint-disk-full",
    "real_autoep_frozen_experts.txt": "autoep-frozen-experts",
    "real_peft_dora_zero_init.txt": "peft-variant-zero-init",
    "real_strategy_refusals.txt": "offload-needs-ds-cpu-optimizer",
    "zeromoe_export_errors.txt": "export-untrusted-object",
    "real_native_moe_zero3.txt": "native-moe-zero3",
    "real_moe_param_groups.txt": "moe-param-groups",
    "real_zero3_shape0_embedding.txt": "zero3-param-not-available",
    "real_zero3_shape0_linear.txt": "zero3-param-not-available",
    "real_device_mismatch_fake.txt": "device-mismatch",
    "real_device_mismatch_meta.txt": "device-mismatch",
    "real_cpu_oom.txt": "cpu-oom",
    "real_ep_size_divisibility.txt": "ep-size-divisibility",
    "real_batch_arithmetic.txt": "batch-arithmetic",
    "real_unknown_zero_key.txt": "unknown-config-key",
    "real_removed_config_key.txt": "unknown-config-key",
    "real_gloo_timeout.txt": "nccl-watchdog-timeout",
    "real_autoep_load_balance_coeff.txt": "autoep-load-balance-coeff",
    "real_ninja_missing.txt": "ninja-missing",
    "real_cuda_home_missing.txt": "cuda-home-missing",
    "real_extension_build_error.txt": "extension-build-error",
    "real_stale_extension_lock.txt": "stale-extension-lock",
    "real_autoep_no_moe_layers.txt": "autoep-no-moe-layers",
    "real_autoep_top_k.txt": "autoep-top-k-undetermined",
    "issue_cuda_oom_old_format.txt": "cuda-oom",
    "issue_cuda_oom_new_format.txt": "cuda-oom",
    "issue_cuda_oom_runtimeerror.txt": "cuda-oom",
    "issue_nccl_watchdog_new.txt": "nccl-watchdog-timeout",
    "issue_nccl_watchdog_old.txt": "nccl-watchdog-timeout",
    "issue_cuda_mismatch_deepspeed.txt": "cuda-version-mismatch",
    "issue_cuda_mismatch_exception_class.txt": "cuda-version-mismatch",
    "issue_cuda_home_assert.txt": "cuda-home-missing",
    "issue_native_moe_legacy.txt": "native-moe-zero3",
    "issue_moe_param_groups.txt": "moe-param-groups",
    "issue_zero3_not_available.txt": "zero3-param-not-available",
    "issue_zero3_ds_status_assert.txt": "zero3-param-not-available",
    "issue_inflight_params.txt": "zero3-inflight-params",
    "issue_ninja_old.txt": "ninja-missing",
    "issue_extension_build_cpu_adam.txt": "extension-build-error",
    "issue_weight_2d.txt": "zero3-param-not-available",
    "issue_memlock_ibv_reg_mr.txt": "memlock-limit",
    "issue_memlock_libibverbs.txt": "memlock-limit",
    "issue_ninja_filenotfound.txt": "ninja-missing",
    "issue_ninja_v_only.txt": "extension-build-error",
    "issue_undefined_symbol_torch.txt": "op-undefined-symbol",
    "issue_undefined_symbol_curand.txt": "op-undefined-symbol",
    "issue_zero3_size_mismatch_load.txt": "zero3-param-not-available",
    "real_peer_killed.txt": "peer-rank-died",
    "real_peer_own_error.txt": "cpu-oom",
    "real_peer_torchrun_killed.txt": "cpu-oom",
    "real_config_passed_twice.txt": "config-passed-twice",
    "real_load_checkpoint_no_optimizer.txt": "load-checkpoint-no-optimizer",
    "real_zero_to_fp32_leftover.txt": "zero-to-fp32-mismatch",
    "real_nccl_missing.txt": "nccl-unavailable",
}


def test_every_fixture_has_an_expectation():
    assert {p.name for p in TRACEBACKS.glob("*.txt")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_top_diagnosis(name):
    text = (TRACEBACKS / name).read_text(errors="replace")
    diagnoses = explain.explain_text(text)
    assert diagnoses, f"{name}: nothing matched"
    assert diagnoses[0].entry_id == EXPECTED[name]
    assert diagnoses[0].snippet.rstrip("…") in text.replace("\r", "")


def test_details_are_extracted_from_the_message():
    oom = explain.explain_text((TRACEBACKS / "issue_cuda_oom_new_format.txt").read_text())[0]
    assert oom.details["requested"] == "3.39 GiB" and oom.details["reserved_unallocated"] == "1.59 GiB"
    nccl = explain.explain_text((TRACEBACKS / "issue_nccl_watchdog_new.txt").read_text())[0]
    assert nccl.details == {"seq": "1580", "op": "ALLREDUCE", "ran_ms": "600060"}


def test_unknown_text_gives_no_diagnosis():
    assert explain.explain_text("Epoch 3: loss=1.234\nall good\n") == []


def test_ansi_colours_and_carriage_returns_are_removed():
    msg = "AssertionError: Native DeepSpeed MoE is not supported with ZeRO Stage 3."
    coloured = f"step 1\r step 2\r\x1b[1;31m{msg[:20]}\x1b[0m{msg[20:]}\x1b]8;;http://x\x07\r\n"
    diagnoses = explain.explain_text(coloured)
    assert [d.entry_id for d in diagnoses] == ["native-moe-zero3"]
    assert "\x1b" not in diagnoses[0].snippet


def test_huge_file_is_read_from_the_end(tmp_path):
    log = tmp_path / "train.log"
    error = (TRACEBACKS / "real_native_moe_zero3.txt").read_bytes()
    with log.open("wb") as out:
        out.write(b"[INFO] step 1 loss=2.0 " * 300_000)  # about 7 MB before the error
        out.write(b"\n" + error)
    data = explain.read_input(log)
    assert data.truncated and data.total_bytes == log.stat().st_size
    assert len(data.text.encode()) <= explain.MAX_BYTES
    assert explain.explain_text(data.text)[0].entry_id == "native-moe-zero3"


def test_stream_tail_keeps_only_the_last_bytes_and_counts_the_lines_it_drops():
    stream = io.BytesIO(b"line\n" * 1_000_000 + b"THE END")
    tail, total, newlines = log_input._tail_of_stream(stream, 1000)
    assert total == 5_000_007 and len(tail) == 1000 and tail.endswith(b"THE END")
    assert newlines == 1_000_000 - tail.count(b"\n")


def test_random_bytes_are_binary_and_a_log_with_a_few_bad_bytes_is_not(tmp_path):
    blob = tmp_path / "core.bin"
    blob.write_bytes(os.urandom(200_000))  # no NUL padding: random bytes alone
    data = explain.read_input(blob)
    assert data.binary and "binary data" in data.problem()
    log = tmp_path / "train.log"
    log.write_bytes((TRACEBACKS / "real_native_moe_zero3.txt").read_bytes() + b"\xff\xfe bad bytes\n")
    assert not explain.read_input(log).binary
    assert explain.explain_input(explain.read_input(log))[0].entry_id == "native-moe-zero3"


def test_empty_input_is_said_plainly(tmp_path):
    empty = tmp_path / "empty.log"
    empty.write_bytes(b"")
    data = explain.read_input(empty)
    assert data.empty and data.describe() == "empty input" and "empty" in data.problem()
    assert explain.from_text("   \n\n").empty


def test_unreadable_inputs_raise_one_clear_error(tmp_path):
    with pytest.raises(explain.ExplainInputError, match="directory"):
        explain.read_input(tmp_path)
    with pytest.raises(explain.ExplainInputError, match="missing.log"):
        explain.read_input(tmp_path / "missing.log")


def _one_megabyte_log() -> str:
    """A realistic 1 MB log: training chatter, warnings, a JIT build, then a real traceback."""
    chatter = [
        "[2026-11-29 10:00:00,000] [INFO] [logging.py:128:log_dist] [Rank 0] step={i}, skipped=0, "
        "lr=[0.0001], mom=[(0.9, 0.999)]\n",
        "Epoch 0:  42%|████▏     | {i}/1000 [00:{i2:02d}<01:00, loss=2.{i2}, v_num=1]\r",
        "[rank1]:[W1129 10:00:00.000000000 ProcessGroupGloo.cpp:516] Warning: step {i}\n",
    ]
    out, size, i = [], 0, 0
    while size < 1_000_000:
        out.append(chatter[i % 3].format(i=i, i2=i % 60))
        size += len(out[-1])
        i += 1
    return "".join(out) + (TRACEBACKS / "real_zero3_shape0_linear.txt").read_text()


def test_one_megabyte_log_is_explained(tmp_path):
    """Correctness on a realistic 1 MB log; its speed is measured in benchmarks/doctor_latency.py."""
    log = tmp_path / "big.log"
    log.write_text(_one_megabyte_log())
    diagnoses = explain.explain_input(explain.read_input(log))
    assert diagnoses[0].entry_id == "zero3-param-not-available"


def test_live_native_moe_zero3_error_is_explained_through_the_cli():
    """Trigger the real error (native MoE + ZeRO-3, 1-process gloo) and pipe its stderr to explain."""
    rc, output = make_tracebacks.run_case(make_tracebacks.NATIVE_MOE_ZERO3, timeout=240)
    assert rc != 0 and "Native DeepSpeed MoE is not supported" in output
    proc = subprocess.run([sys.executable, "-m", "troubleshooter", "explain", "-"], input=output,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "[native-moe-zero3]" in proc.stdout and "expert_parallel" in proc.stdout


# --------------------------------------------------------------------------- input forms (real CLI)

def _cli(*args: str, stdin: str | bytes = b"") -> subprocess.CompletedProcess:
    data = stdin.encode() if isinstance(stdin, str) else stdin
    return subprocess.run([sys.executable, "-m", "troubleshooter", "explain", *args], input=data,
                          capture_output=True, timeout=60, cwd=REPO)


def test_a_message_a_file_and_stdin_are_all_explained(tmp_path):
    message = (TRACEBACKS / "issue_cuda_oom_new_format.txt").read_text().splitlines()[-1]
    log = tmp_path / "train.log"
    log.write_text(message + "\n")
    for proc in (_cli(message), _cli(str(log)), _cli("-", stdin=message)):
        out = proc.stdout.decode()
        assert proc.returncode == 0, proc.stderr
        assert "[cuda-oom]" in out and "3.39 GiB" in out and "1.59 GiB reserved but unallocated" in out


def test_missing_empty_and_binary_inputs_exit_2_with_one_plain_line(tmp_path):
    (tmp_path / "empty.log").write_bytes(b"")
    (tmp_path / "core.bin").write_bytes(os.urandom(200_000))
    cases = {"no such file": _cli(str(tmp_path / "missing.log")),
             "the input is empty": _cli(str(tmp_path / "empty.log")),
             "binary data, not a text log": _cli(str(tmp_path / "core.bin"))}
    cases["the input is empty (0 bytes)"] = _cli("-", stdin=b"")
    for said, proc in cases.items():
        err = proc.stderr.decode()
        assert proc.returncode == 2 and said in err and "Traceback" not in err, (said, err)
        assert "1 lines" not in proc.stdout.decode()


def test_line_numbers_are_those_of_the_whole_file_after_a_tail_read(tmp_path):
    """A 6 MB log (tail-read) with carriage-return progress bars: the line is the file's line."""
    log = tmp_path / "train.log"
    with log.open("wb") as out:
        out.write(b"[INFO] step 123456 loss=2.000\n" * 200_000)
        out.write(b"Epoch 0:  10%\rEpoch 0:  20%\rEpoch 0:  30%\n" * 50)
        out.write((TRACEBACKS / "real_native_moe_zero3.txt").read_bytes())
    data = explain.read_input(log)
    assert data.truncated and data.first_line > 1
    diagnosis = explain.explain_input(data)[0]
    lines = log.read_bytes().split(b"\n")
    wanted = max(i for i, line in enumerate(lines, 1) if b"Native DeepSpeed MoE is not supported" in line)
    assert diagnosis.entry_id == "native-moe-zero3" and diagnosis.line_no == wanted
    assert "line numbers are those of the whole input" in data.note()


# --------------------------------------------------------------------------- OOM numbers

def test_oom_numbers_of_each_message_form():
    new = parse_oom((TRACEBACKS / "issue_cuda_oom_new_format.txt").read_text())
    assert (new.requested, new.total, new.free) == (round(3.39 * 2**30), round(79.32 * 2**30), round(2.40 * 2**30))
    assert new.allocated == round(73.28 * 2**30) and new.reserved_unallocated == round(1.59 * 2**30)
    assert not new.fragmentation  # 1.59 GiB spare < 3.39 GiB asked
    old = parse_oom((TRACEBACKS / "issue_cuda_oom_old_format.txt").read_text())
    assert (old.requested, old.free, old.reserved) == (978 * 2**20, 0, round(2.72 * 2**30))
    assert old.fragmentation  # 2.72 - 1.68 = 1.04 GiB spare >= 978 MiB asked
    oldest = parse_oom((TRACEBACKS / "issue_cuda_oom_runtimeerror.txt").read_text())
    assert oldest.reserved - oldest.allocated == round(14.59 * 2**20) and not oldest.fragmentation
    assert parse_oom("RuntimeError: CUDA error: out of memory") is None
    for numbers in (new, old, oldest):
        assert ("fragmentation" in numbers.summary()) == numbers.fragmentation


def test_oom_fixes_follow_the_numbers():
    def top(name):
        return explain.explain_text((TRACEBACKS / name).read_text())[0]
    short = top("issue_cuda_oom_new_format.txt")
    assert short.fix_ids[0] == "lower-micro-batch" and "expandable-segments" not in short.fix_ids
    assert "fragmentation" not in short.finding.lower()
    fragmented = top("issue_cuda_oom_old_format.txt")
    assert fragmented.fix_ids[0] == "expandable-segments" and "fragmentation" in fragmented.finding
    unknown = explain.explain_text("RuntimeError: CUDA error: out of memory")[0]
    assert unknown.fix_ids[0] == "measure-memory" and unknown.finding == ""


# --------------------------------------------------------------------------- anchored patterns

@pytest.mark.parametrize("line", [
    "DEBUG emb.weight torch.Size([0]) (partitioned; gathered in forward)",
    "AssertionError: 10 is not divisible by 3",
    "RLIMIT_MEMLOCK (65536, 65536)",
    "max locked memory           (kbytes, -l) 64",
])
def test_a_line_that_only_mentions_a_problem_is_not_diagnosed(line):
    assert explain.explain_text(line) == []


def test_libibverbs_memlock_warning_is_diagnosed():
    found = explain.explain_text((TRACEBACKS / "issue_memlock_libibverbs.txt").read_text())
    assert found[0].entry_id == "memlock-limit" and found[0].details["memlock_bytes"] == "32768"


# --------------------------------------------------------------------------- benign corpus

BENIGN_LOGS = sorted(p.name for p in BENIGN.glob("*.log"))


def test_benign_corpus_holds_real_runs_and_typical_logs():
    assert sum(n.startswith("real_") for n in BENIGN_LOGS) >= 3
    assert any(not n.startswith("real_") for n in BENIGN_LOGS)


@pytest.mark.parametrize("name", BENIGN_LOGS)
def test_healthy_logs_give_no_diagnosis(name):
    found = explain.explain_input(explain.read_input(BENIGN / name))
    assert found == [], [(d.entry_id, d.line_no, d.snippet) for d in found]


# --------------------------------------------------------------------------- a rank died

def test_first_failing_rank_is_the_diagnosis_and_the_others_only_followed():
    """Real 2-rank run: rank 1 fails an allocation, rank 0 then loses its gloo peer."""
    found = explain.explain_input(explain.read_input(TRACEBACKS / "real_peer_own_error.txt"))
    own, echo = found[0], next(d for d in found if d.entry_id == "peer-rank-died")
    assert own.entry_id == "cpu-oom" and own.line_no < echo.line_no
    assert "rank 1's own error" in own.finding and f"line {echo.line_no}" in own.finding
    assert f"line {own.line_no}" in echo.finding


def test_a_killed_rank_leaves_only_the_echo_and_that_is_said():
    found = explain.explain_input(explain.read_input(TRACEBACKS / "real_peer_killed.txt"))
    assert [d.entry_id for d in found] == ["peer-rank-died"]
    assert "No rank's own error is in this log" in found[0].finding


def test_torchrun_report_names_the_rank_that_failed_first():
    found = {d.entry_id: d for d in explain.explain_input(
        explain.read_input(TRACEBACKS / "real_peer_torchrun_killed.txt"))}
    peer = found["peer-rank-died"]
    assert peer.details["failed_rank"] == "1" and peer.details["exitcode"] == "-9"


# --------------------------------------------------------------------------- real errors, triggered

@pytest.fixture(scope="module")
def deepspeed_errors() -> dict[str, dict]:
    """tests/jobs/deepspeed_errors.py: real DeepSpeed errors on CPU, one process per session."""
    return deepspeed_job.records()


@pytest.mark.parametrize("case, entry", [
    ("config_twice", "config-passed-twice"),
    ("no_optimizer", "load-checkpoint-no-optimizer"),
    ("no_optimizer_module_only", "load-checkpoint-no-optimizer"),
    ("divisibility", "ep-size-divisibility"),
])
def test_real_deepspeed_errors_are_recognised(deepspeed_errors, case, entry):
    text = deepspeed_errors[case]["traceback"]
    assert text, f"{case}: deepspeed raised nothing"
    assert explain.explain_text(text)[0].entry_id == entry


def test_consolidation_fix_of_load_checkpoint_entry_works(deepspeed_errors):
    assert deepspeed_errors["consolidate"]["loaded"]


def test_oom_patch_lowers_deepspeeds_defaults_and_sets_nothing_a_consumer_refuses(deepspeed_errors):
    from troubleshooter import knowledge

    patch = knowledge.get("cuda-oom").patch_json()
    zero = patch.pop("zero_optimization")
    assert patch == {}  # no batch keys: Lightning takes those from the DataLoader and the Trainer
    defaults = deepspeed_errors["zero_defaults"]
    assert zero and all(zero[k] < defaults[k] for k in zero), (zero, defaults)
    lightning = Path(importlib.util.find_spec("lightning").origin).parent
    refusal = (lightning / "pytorch" / "strategies" / "deepspeed.py").read_text()
    assert "Do not set `gradient_accumulation_steps` in the DeepSpeed config" in refusal


def test_zero_to_fp32_messages_are_the_installed_ones():
    from troubleshooter import knowledge

    source = (Path(importlib.util.find_spec("deepspeed").origin).parent / "utils" / "zero_to_fp32.py").read_text()
    assert "numels out of {avail_numel} - something is wrong" in source
    assert "of '*_optim_states.pt' under '{ds_checkpoint_dir}' but found {total_files} files" in source
    text = ("ValueError: consumed 1234 numels out of 5678 - something is wrong\n")
    assert explain.explain_text(text)[0].entry_id == knowledge.get("zero-to-fp32-mismatch").id


def test_real_ninja_failures_are_recognised(tmp_path):
    """ninja missing from PATH, and a failing ninja build: the calls torch's builder makes."""
    import traceback

    with pytest.raises(FileNotFoundError) as missing:
        subprocess.run(["ninja", "-v"], env={"PATH": str(tmp_path)}, capture_output=True)
    text = "".join(traceback.format_exception(missing.value))
    assert explain.explain_text(text)[0].entry_id == "ninja-missing"
    ninja = shutil.which("ninja") or str(Path(sys.executable).with_name("ninja"))
    (tmp_path / "build.ninja").write_text("rule fail\n  command = false\nbuild out: fail\n")
    with pytest.raises(subprocess.CalledProcessError) as failed:
        subprocess.run([ninja, "-v"], cwd=tmp_path, capture_output=True, check=True)
    text = "".join(traceback.format_exception(failed.value)).replace(ninja, "ninja")
    assert explain.explain_text(text)[0].entry_id == "extension-build-error"


def test_real_undefined_symbol_is_recognised(tmp_path):
    """A real shared object that needs a torch symbol it cannot find, loaded like a JIT-built op."""
    op_dir = tmp_path / "torch_extensions" / "py311_cpu" / "fake_op"
    op_dir.mkdir(parents=True)
    (op_dir / "fake_op.c").write_text("extern int _ZN3c104cuda20CUDACachingAllocator9allocatorE;\n"
                                      "int use(void) { return _ZN3c104cuda20CUDACachingAllocator9allocatorE; }\n")
    subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", "-o", str(op_dir / "fake_op.so"),
                    str(op_dir / "fake_op.c")], check=True, capture_output=True)
    spec = importlib.util.spec_from_file_location("fake_op", op_dir / "fake_op.so")
    with pytest.raises(ImportError) as err:
        spec.loader.create_module(spec)
    found = explain.explain_text(f"ImportError: {err.value}")[0]
    assert found.entry_id == "op-undefined-symbol"
    assert found.details["symbol"] == "_ZN3c104cuda20CUDACachingAllocator9allocatorE"
