"""Facts about the installed stack, in one place.

The strategy's error messages, the troubleshooter's doctor, lint and explain, and the docs all
read these constants, so a fact is corrected once. Every entry records the version it was checked
against. This module imports nothing heavy (no torch, deepspeed, lightning or transformers):
interactive tools import it at start-up.
"""

from __future__ import annotations

from importlib import metadata
from typing import NamedTuple

#: Versions the facts below were checked against (site-packages source and measured runs).
CHECKED_AGAINST = {
    "deepspeed": "0.19.8",
    "lightning": "2.6.6",
    "torch": "2.13.0",
    "transformers": "5.25.0",
}



class TestedVersion(NamedTuple):
    """One release of a dependency and what was run on it (the docs' compatibility table reads these)."""

    package: str
    version: str
    #: "tested": what ``run`` says passed; "failing": ``evidence`` names the failing call; "partial":
    #: what ``run`` names passed, the whole suite was not completed on it (``evidence`` says how far).
    status: str
    run: str
    evidence: str


#: Releases measured with this project (deepspeed 0.19.8, lightning 2.6.6, Python 3.11, CPU, 2 ranks).
#: The ``hf`` extra's cap in pyproject.toml admits the newest tested transformers and nothing newer
#: (tests/test_compat.py holds the two together).
TESTED_VERSIONS = (
    TestedVersion("transformers", "5.17.0", "tested", "CI floor smoke run (.ci/run): mixtral and qwen3_moe in "
                  "tests/test_hf_coverage.py, tests/test_output_capture_shim.py", "the extras' floor"),
    TestedVersion("transformers", "5.22.2", "tested", "the whole suite", "README, issue 9"),
    TestedVersion("transformers", "5.23.0", "tested", "the whole suite", "compat.KNOWN_BAD_COMBINATIONS shim"),
    TestedVersion("transformers", "5.24.0", "tested", "the whole suite (1109 passed, 24 min 45 s, commit 066bf11)",
                  "README"),
    TestedVersion("transformers", "5.25.0", "tested", "tests/test_hf_coverage.py (every MoE type of 5.25 at 2-rank "
                  "parity, exported, from_pretrained) and the whole suite under torch 2.15.0 (below)",
                  "issue 34; transformers 5.25 requires the `kernels` package (0.19.x), which pip installs with it"),
    TestedVersion("torch", "2.13.0", "tested", "the whole suite (CPU build, the local wheel scripts/setup.sh "
                  "installs on CPU machines); tests/test_private_api.py", "README, issue 34"),
    TestedVersion("torch", "2.15.0", "tested", "the whole suite on PyPI's wheel (2.15.0+cu132, a CUDA build, run on "
                  "CPU with deepspeed 0.19.8, lightning 2.6.6, transformers 5.25.0) at commit cbd4c20: 1103 passed, "
                  "7 failed, 4 skipped, 1 xfailed in 52 min 10 s (niced, shared 2 cores); each failure fixed on the "
                  "issue-34 branch and rerun passing on 2.15.0; tests/test_private_api.py 4 passed",
                  "issue 34, 2026-12-05. The failures: a CUDA build without a GPU names cuda as "
                  "torch.accelerator.current_accelerator() (collectives._accelerator_type asked it; RuntimeError "
                  "'Found no NVIDIA driver' in torch.cuda.current_device()); the doctor failed cuda.match (torch CUDA "
                  "13.2 vs nvcc 13.0) on a machine without a GPU; tests expected torch 2.13's report line and the "
                  "CPU build's .cuda() message; torch 2.15 replaced FileBaton in cpp_extension._jit_compile by an OS "
                  "advisory lock (stale-extension-lock claim: 'baton.wait()' not in its source); hf_semantics.py "
                  "over 400 lines (the branch's own); test_doctor.py::test_ctrl_c_kills_the_probe timed out under "
                  "load and passes alone"),
)

#: The earliest DeepSpeed with AutoEP under ZeRO-3 that this project is tested against.
MIN_DEEPSPEED = "0.19.8"

#: AutoEP presets in deepspeed 0.19.8 (deepspeed/module_inject/auto_ep_presets/*.py ``hf_model_types``),
#: keyed by the Hugging Face ``config.model_type`` that selects each one. Composite models (Qwen3.5,
#: MiniMax-M3 vision-language) are matched through their text backbone's config. Discovery asks
#: DeepSpeed's own table at run time; this copy is for the docs and the troubleshooter.
AUTOEP_PRESETS_BY_MODEL_TYPE = {
    "mixtral": "mixtral",
    "qwen3_moe": "qwen3_moe",
    "qwen2_moe": "qwen3_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v3",
    "minimax_m3_vl_text": "minimax_m3",
}

#: The sentence that identifies DeepSpeed's refusal of native MoE under ZeRO-3, verbatim from
#: deepspeed/runtime/engine.py ``_validate_zero3_moe_compatibility`` (0.19.8). A fact quoted to
#: recognise and name the refusal; DeepSpeed's message goes on with its own advice, which is
#: quoted whole in the knowledge base entry native-moe-zero3 (its symptoms), not here.
NATIVE_MOE_ZERO3_MESSAGE = "Native DeepSpeed MoE is not supported with ZeRO Stage 3."
#: The older wording of the same refusal, raised when stage 3 sees MoE layers but no AutoEP layer.
LEGACY_MOE_ZERO3_MESSAGE = "MoE not supported with Stage 3"


class KnownBadCombination(NamedTuple):
    """Two package ranges that fail together, with the measured symptom."""

    id: str
    package: str
    bad_from: str  # first bad version (inclusive)
    with_package: str
    with_version: str  # the exact version the failure was measured with
    symptom: str
    #: The knowledge base entry (and its fix) that says what to install instead.
    entry: str
    fix_id: str
    #: How lightning_zeromoe itself avoids the failure ("" when it does not): the combination then
    #: fails only outside ZeroMoEStrategy.
    handled_by: str = ""


KNOWN_BAD_COMBINATIONS = (
    KnownBadCombination(
        id="transformers-5.23-autoep",
        package="transformers",
        bad_from="5.23.0",
        with_package="deepspeed",
        with_version="0.19.8",
        symptom="TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were given "
        "(raised by deepspeed.initialize when AutoEP converts a Hugging Face MoE model)",
        entry="autoep-transformers-5.23",
        fix_id="pin-transformers",
        handled_by="ZeroMoEStrategy runs deepspeed.initialize inside autoep_output_capture_shim "
        "(lightning_zeromoe/_private/deepspeed.py); 5.23.0, 5.24.0 and 5.25.0 were measured to train under it",
    ),
)

#: What each environment variable really does (checked in the installed sources).
ENV_FACTS = {
    "NCCL_TIMEOUT": (
        "Read by nothing: not torch, not NCCL, not deepspeed, not lightning. The collective timeout "
        "is an argument of init_process_group / new_group (knowledge base: nccl-timeout-env-ignored)."),
    "DEEPSPEED_TIMEOUT": (
        "Minutes; deepspeed's default_pg_timeout (deepspeed/constants.py, default 10). Lightning "
        "passes its own timeout (default 30 min) to deepspeed.init_distributed, which wins for "
        "the world group."),
    "DS_BUILD_OPS": (
        "DS_BUILD_OPS=1 pre-builds every compatible op while pip installs deepspeed. With it unset "
        "or 0, nothing is built at install time: ops are JIT-compiled on first use. It does not "
        "'skip compilation'."),
    "TORCH_EXTENSIONS_DIR": (
        "Where JIT-built ops are cached (default $XDG_CACHE_HOME or ~/.cache, then "
        "torch_extensions/py311_cpu or py311_cuXYZ, one folder per op: torch/utils/cpp_extension.py "
        "_get_build_directory). A 'lock' file left in an op's folder by a killed build makes the "
        "next build wait forever with torch <= 2.14 (FileBaton); torch 2.15 holds an OS advisory lock "
        "there instead, which the kernel releases when the holder dies."),
}


def installed_version(package: str) -> str | None:
    """The installed distribution version, without importing the package (fast)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def version_tuple(version: str) -> tuple[int, ...]:
    """``"5.23.0.dev0"`` -> ``(5, 23, 0)``: enough to compare release numbers."""
    parts: list[int] = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits or digits != piece:
            if digits and piece.startswith(digits):
                parts.append(int(digits))
            break
        parts.append(int(digits))
    return tuple(parts)


def known_bad_installed() -> list[KnownBadCombination]:
    """The known-bad combinations that the installed packages fall into."""
    found = []
    for combo in KNOWN_BAD_COMBINATIONS:
        have = installed_version(combo.package)
        other = installed_version(combo.with_package)
        if have is None or other is None:
            continue
        if (version_tuple(have) >= version_tuple(combo.bad_from)
                and version_tuple(other) <= version_tuple(combo.with_version)):
            found.append(combo)
    return found
