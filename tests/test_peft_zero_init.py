"""PEFT's LoRA initialisation inside ``configure_model`` under ZeRO-3 ``zero.Init``
(``lightning_zeromoe/loading/peft_zero3.py``), on a real ``zero.Init`` in a one-process world.

``tests/jobs/peft_zero_init_job.py`` wraps a tiny Mixtral with ``get_peft_model`` plainly and under
``zero.Init`` from the same seeds and compares the adapter tensors. Without the strategy's wrapper
PEFT's in-place initialisation is a no-op on the partitioned ``lora_A``/``lora_B`` (they keep
``nn.Linear``'s draws: ``lora_B`` is not zero); with it they are PEFT's own values bit for bit. The
2-rank path (``from_pretrained`` + ``get_peft_model`` in ``configure_model``, trained, saved and
exported) is run ``P`` of ``tests/test_lora_ep.py``.
"""

from __future__ import annotations

import json

import pytest

from support.jobs import free_port, run_job

pytest.importorskip("peft")


def _results(cases: str, *extra: str, gathered: str = "1,0") -> dict:
    """One process: every case with the strategy's wrapper ("1") and without it ("0")."""
    proc = run_job("peft_zero_init_job.py", "--gathered", gathered, "--port", str(free_port()), "--cases", cases,
                   *extra, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_lora_init_under_zero_init_is_peft_own_and_variants_are_refused():
    results = _results("linear,embedding,modules_to_save,fused_experts,dora")
    # PEFT alone raises IndexError on DoRA (seen by hand, not run without the wrapper); the refusal is the strategy's.
    fixed, raw = results["1"], results["0"]
    for case in ("linear", "embedding", "modules_to_save", "fused_experts"):
        assert fixed[case]["partitioned_adapters"] >= 2, fixed[case]  # zero.Init did partition them
        assert fixed[case]["differ"] == [], (case, fixed[case])
        # Without the wrapper the partitioned adapters kept other values: the check above can fail.
        assert len(raw[case]["differ"]) == fixed[case]["partitioned_adapters"], (case, raw[case])
    assert fixed["modules_to_save"]["copies"] == 1  # the trained copy starts as the original module
    assert fixed["dora"]["error"].startswith("[peft-variant-zero-init] PEFT adapter 'default' on a "
                                             "peft.tuners.lora.layer.Linear layer is a LoRA variant (DoraLinearVariant)")


def test_lora_init_is_gathered_when_peft_is_first_imported_inside_configure_model():
    """The wrapper does not import peft; a ``configure_model`` that imports it itself (here: the
    first ``get_peft_model`` of the process runs under ``zero.Init``) is covered by the import hook."""
    results = _results("linear", "--zero-first")
    fixed, raw = results["1"]["linear"], results["0"]["linear"]
    assert fixed["peft_imported_before"] is False, fixed  # peft was first imported inside the wrapper
    assert fixed["partitioned_adapters"] >= 2 and fixed["differ"] == [], fixed
    assert len(raw["differ"]) == fixed["partitioned_adapters"], raw  # without the wrapper: PEFT's init lost
