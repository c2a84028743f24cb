"""explain: real tracebacks in, the right diagnosis out; bounded, robust and fast reading."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from troubleshooter import explain

FIXTURES = Path(__file__).parent / "fixtures"
TRACEBACKS = FIXTURES / "tracebacks"
sys.path.insert(0, str(FIXTURES))
import make_tracebacks  # noqa: E402  (the generator's case code, reused for the live test)

#: fixture file -> the entry that must be the top diagnosis.
EXPECTED = {
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
    assert oom.details == {"requested": "3.39 GiB"}
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


def test_stream_tail_keeps_only_the_last_bytes():
    stream = io.BytesIO(b"a" * 5_000_000 + b"THE END")
    tail, total = explain._tail_of_stream(stream, 1000)
    assert total == 5_000_007 and len(tail) == 1000 and tail.endswith(b"THE END")


def test_binary_input_does_not_crash(tmp_path):
    blob = tmp_path / "core.bin"
    blob.write_bytes(os.urandom(200_000) + b"\x00" * 100_000)
    data = explain.read_input(blob)
    assert data.binary
    explain.explain_text(data.text)  # must not raise


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


def test_one_megabyte_log_is_explained_in_under_a_second(tmp_path):
    log = tmp_path / "big.log"
    log.write_text(_one_megabyte_log())
    explain.explain_text("warm-up")  # load the knowledge base once, as the CLI does at start
    start = time.perf_counter()
    diagnoses = explain.explain_text(explain.read_input(log).text)
    elapsed = time.perf_counter() - start
    assert diagnoses[0].entry_id == "zero3-param-not-available"
    assert elapsed < 1.0, f"explain took {elapsed:.2f} s on 1 MB"


def test_live_native_moe_zero3_error_is_explained_through_the_cli():
    """Trigger the real error (native MoE + ZeRO-3, 1-process gloo) and pipe its stderr to explain."""
    rc, output = make_tracebacks.run_case(make_tracebacks.NATIVE_MOE_ZERO3, timeout=240)
    assert rc != 0 and "Native DeepSpeed MoE is not supported" in output
    proc = subprocess.run([sys.executable, "-m", "troubleshooter", "explain", "-"], input=output,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "[native-moe-zero3]" in proc.stdout and "expert_parallel" in proc.stdout
