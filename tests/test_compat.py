"""The facts in lightning_zeromoe.compat agree with the installed libraries."""

from __future__ import annotations

import subprocess
import sys

from lightning_zeromoe import compat


def test_preset_table_matches_deepspeeds_own():
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    theirs = {model_type: name for name, preset in PRESET_MODELS.items() for model_type in preset.hf_model_types}
    assert compat.AUTOEP_PRESETS_BY_MODEL_TYPE == theirs


def test_native_moe_message_is_deepspeeds():
    import inspect

    from deepspeed.runtime.engine import DeepSpeedEngine

    source = inspect.getsource(DeepSpeedEngine._validate_zero3_moe_compatibility)
    assert compat.NATIVE_MOE_ZERO3_MESSAGE in source  # verbatim, up to its full stop
    assert compat.LEGACY_MOE_ZERO3_MESSAGE in source


def test_known_bad_combinations_cite_existing_fixes():
    """Each combination's advice is a knowledge-base fix (the doctor shows it): both ids exist."""
    from lightning_zeromoe import knowledge

    for combo in compat.KNOWN_BAD_COMBINATIONS:
        assert knowledge.get(combo.entry).get_fix(combo.fix_id).text


def test_deepspeed_default_timeout_env_is_real():
    """DEEPSPEED_TIMEOUT (minutes) sets deepspeed's default process-group timeout."""
    code = "import deepspeed.constants as c; print(c.default_pg_timeout.total_seconds())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"DEEPSPEED_TIMEOUT": "3", "PATH": ""}, check=True).stdout
    assert float(out.strip().splitlines()[-1]) == 180.0


def test_version_tuple_orders_releases():
    assert compat.version_tuple("5.23.0.dev0") == (5, 23, 0)
    assert compat.version_tuple("2.13.0+cpu") == (2, 13, 0)
    assert compat.version_tuple("5.22.2") < compat.version_tuple("5.23.0")


def test_the_hf_cap_admits_the_newest_tested_transformers_and_nothing_newer():
    """pyproject's ``hf`` and ``test`` extras: ``transformers>=<floor>,<<next minor>>`` where the floor
    and the newest release are the oldest and newest in ``compat.TESTED_VERSIONS``."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    specs = re.findall(r'"transformers>=([\d.]+),<([\d.]+)"', text)
    tested = sorted(compat.version_tuple(v.version) for v in compat.TESTED_VERSIONS
                    if v.package == "transformers" and v.status == "tested")
    assert len(specs) == 2 and len(set(specs)) == 1, specs  # hf and test agree
    floor, cap = (compat.version_tuple(v) for v in specs[0])
    assert floor == tested[0][:len(floor)] and cap == (tested[-1][0], tested[-1][1] + 1), (specs, tested)
    assert compat.CHECKED_AGAINST["transformers"] == ".".join(map(str, tested[-1]))
