"""Versions of the stack, read from package metadata (no imports: torch alone takes ~2 s).

Why: most "it does not start" reports come down to one package outside the range the others were
built or tested with. The ranges come from this project's own metadata (pyproject.toml) and the
known-bad combinations from :mod:`lightning_zeromoe.compat`, so nothing is restated here.
"""

from __future__ import annotations

import importlib.util
import platform
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from lightning_zeromoe import compat
from troubleshooter import knowledge
from troubleshooter.doctor.base import CheckResult, DoctorOptions, cite

PROJECT = "lightning-zeromoe"
#: Packages the training path needs (missing -> fail); transformers is optional (the hf extra).
REQUIRED = ("torch", "deepspeed", "lightning")
OPTIONAL = ("transformers",)


def check(options: DoctorOptions, probes: object = None) -> list[CheckResult]:
    """Python, the four packages, known-bad combinations, and the native-MoE refusal."""
    specs = declared_specs()
    results = [python_result()]
    results += [package_result(name, specs.get(name), required=name in REQUIRED)
                for name in (*REQUIRED, *OPTIONAL)]
    results.append(known_bad_result())
    results.append(native_moe_result())
    return results


def declared_specs() -> dict[str, SpecifierSet]:
    """Version ranges this project declares (base dependencies, then the ``hf`` extra)."""
    try:
        lines = metadata.requires(PROJECT) or []
    except metadata.PackageNotFoundError:
        return {}
    specs: dict[str, SpecifierSet] = {}
    for line in lines:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": "hf"}):
            specs.setdefault(req.name.lower(), req.specifier)
    return specs


def python_result() -> CheckResult:
    """The running interpreter against the project's Requires-Python."""
    current = platform.python_version()
    try:
        wanted = metadata.metadata(PROJECT).get("Requires-Python") or ""
    except metadata.PackageNotFoundError:
        wanted = ""
    good = not wanted or Version(current) in SpecifierSet(wanted)
    return CheckResult(
        "versions.python", "Python", "ok" if good else "fail",
        f"Python {current} at {sys.executable}" + (f" (project requires {wanted})" if wanted else ""),
        why=knowledge.message("stack-versions", "python-range").render(),
        **({} if good else cite(knowledge.fix("stack-versions", "python-in-range"), spec=wanted)),
        entry=None if good else "stack-versions",
        details={"version": current, "executable": sys.executable, "requires": wanted})


def _satisfies(version: str, spec: SpecifierSet) -> bool:
    """Whether ``version`` (local labels such as +cpu ignored) is inside ``spec``."""
    try:
        return Version(Version(version).public) in spec
    except InvalidVersion:
        return True


def package_result(name: str, spec: SpecifierSet | None, required: bool) -> CheckResult:
    """One package: missing, below the hard minimum, outside the declared range, or fine."""
    version = compat.installed_version(name)
    title = f"{name} version"
    wanted = str(spec) if spec else ""
    details = {"package": name, "version": version, "declared": wanted}
    if version is None:
        return CheckResult(
            f"versions.{name}", title, "fail" if required else "skip",
            f"{name} is not installed",
            why=knowledge.message("stack-versions", "required" if required else "optional").render(),
            **(cite(knowledge.fix("stack-versions", "install-declared"), package=name, spec=wanted)
               if required else {}),
            entry="stack-versions" if required else None, details=details)
    if name == "deepspeed" and compat.version_tuple(version) < compat.version_tuple(compat.MIN_DEEPSPEED):
        return CheckResult(
            "versions.deepspeed", title, "fail", f"deepspeed {version}",
            why=knowledge.message("stack-versions", "too-old").render(minimum=compat.MIN_DEEPSPEED),
            **cite(knowledge.fix("stack-versions", "upgrade-deepspeed"), minimum=compat.MIN_DEEPSPEED),
            entry="stack-versions", details=details)
    if spec and not _satisfies(version, spec):
        return CheckResult(
            f"versions.{name}", title, "warn", f"{name} {version}, outside the declared {wanted}",
            why=knowledge.message("stack-versions", "untested").render(spec=wanted),
            **cite(knowledge.fix("stack-versions", "install-declared"), package=name, spec=wanted),
            entry="stack-versions", details=details)
    return CheckResult(f"versions.{name}", title, "ok",
                       f"{name} {version}" + (f" (declared {wanted})" if wanted else ""),
                       details=details)


def known_bad_result() -> CheckResult:
    """Combinations measured to fail together (lightning_zeromoe.compat.KNOWN_BAD_COMBINATIONS)."""
    bad = compat.known_bad_installed()
    checked = [f"{c.package}>={c.bad_from} with {c.with_package}<={c.with_version}"
               for c in compat.KNOWN_BAD_COMBINATIONS]
    if not bad:
        return CheckResult("versions.known_bad", "Known-bad combinations", "ok",
                           "none of the known-bad combinations is installed",
                           details={"checked": checked})
    if all(c.handled_by for c in bad):
        found = "; ".join(f"{c.package} {compat.installed_version(c.package)} with {c.with_package} "
                          f"{compat.installed_version(c.with_package)}" for c in bad)
        # lightning_zeromoe avoids these itself: they fail only in a deepspeed.initialize of your own
        return CheckResult("versions.known_bad", "Known-bad combinations", "ok",
                           f"{found}: fails in a bare deepspeed.initialize, handled by ZeroMoEStrategy",
                           why=" ".join(c.handled_by for c in bad), entry="autoep-transformers-5.23",
                           **cite(knowledge.fix("autoep-transformers-5.23", "use-the-shim")),
                           details={"checked": checked, "matched": [c.id for c in bad], "handled": True})
    combo = bad[0]
    found = "; ".join(f"{c.package} {compat.installed_version(c.package)} with {c.with_package} "
                      f"{compat.installed_version(c.with_package)}" for c in bad)
    # compat's record names the entry and fix (tests/test_compat.py checks that they exist)
    advice = {"entry": combo.entry, **cite(knowledge.get(combo.entry).get_fix(combo.fix_id))}
    return CheckResult("versions.known_bad", "Known-bad combinations", "fail", found,
                       why=combo.symptom, **advice,
                       details={"checked": checked, "matched": [c.id for c in bad]})


def package_dir(name: str) -> Path | None:
    """Where a top-level package lives, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def native_moe_result() -> CheckResult:
    """Does the installed deepspeed refuse native MoE under ZeRO-3? (read from its engine.py)."""
    title = "Native MoE under ZeRO-3"
    root = package_dir("deepspeed")
    if root is None:
        return CheckResult("versions.native_moe", title, "skip", "deepspeed is not installed")
    engine = root / "runtime" / "engine.py"
    text = engine.read_text(errors="replace") if engine.is_file() else ""
    refuses = compat.NATIVE_MOE_ZERO3_MESSAGE.split(". ")[0] in text
    has_autoep = (root / "module_inject" / "auto_ep.py").is_file()
    details = {"engine": str(engine), "refusal_found": refuses, "autoep_present": has_autoep}
    if refuses and has_autoep:
        return CheckResult(
            "versions.native_moe", title, "ok",
            "deepspeed refuses deepspeed.moe.layer.MoE with ZeRO stage 3; AutoEP is present",
            why=knowledge.message("stack-versions", "native-moe-refused").render(),
            entry="native-moe-zero3", details=details)
    return CheckResult(
        "versions.native_moe", title, "warn",
        f"could not confirm in {engine}: refusal found={refuses}, AutoEP present={has_autoep}",
        why=knowledge.message("stack-versions", "native-moe-unconfirmed").render(
            checked=compat.CHECKED_AGAINST["deepspeed"]),
        **cite(knowledge.fix("stack-versions", "upgrade-deepspeed"), minimum=compat.MIN_DEEPSPEED),
        entry="native-moe-zero3", details=details)
