"""``troubleshooter doctor``: check this machine for what breaks DeepSpeed ZeRO-3 + MoE training.

Each family of checks lives in its own module (versions, cuda, build, env, timeouts, nccl, host,
layout, config) and returns :class:`~troubleshooter.doctor.base.CheckResult` objects. Anything
that needs torch or deepspeed runs in one time-limited subprocess (:mod:`.probes`), started before
the cheap checks so that they overlap with it; importing this package loads neither.

Exit status: 0 when no check fails, 1 when a check fails or a probe died (``error``: the doctor
could not tell), 2 for bad arguments (argparse).
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import import_module

from troubleshooter import knowledge
from troubleshooter.doctor.base import FAMILIES, CheckResult, DoctorOptions, cite, exit_code
from troubleshooter.doctor.probes import FAMILY_STAGES, ProbeSet

__all__ = ["CheckResult", "DoctorOptions", "FAMILIES", "add_arguments", "exit_code", "main",
           "run_checks"]


def _positive_float(text: str) -> float:
    """argparse type: a number of seconds or minutes > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def _families(text: str) -> tuple[str, ...]:
    """argparse type: a comma-separated subset of FAMILIES."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in FAMILIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown check famil{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown) or '(none)'}; "
            f"choose from {', '.join(FAMILIES)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The doctor's options, for the CLI's ``doctor`` sub-command."""
    from troubleshooter.argtypes import positive_int

    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--report", action="store_true",
                        help="print one Markdown block for a bug report: system, GPUs, CUDA, "
                             "packages, environment (secrets masked) and every check's verdict")
    parser.add_argument("--dumps", metavar="DIR", help="with --report: a run's Flight Recorder dump directory "
                        "to summarise (default: ./flight_recorder when it holds a trace from the last 15 min)")
    parser.add_argument("--config", metavar="PATH", help="also lint this DeepSpeed config")
    parser.add_argument("--ep-size", type=positive_int, metavar="N", help="planned expert-parallel size")
    parser.add_argument("--num-experts", type=positive_int, metavar="E", help="experts per MoE layer")
    parser.add_argument("--gpus-per-node", type=positive_int, metavar="G", help="GPUs in each node")
    parser.add_argument("--world-size", type=positive_int, metavar="N", help="total number of ranks")
    parser.add_argument("--timeout", type=_positive_float, default=60.0, metavar="SECONDS",
                        help="time limit of each probe (default: 60)")
    parser.add_argument("--only", type=_families, metavar="FAMILIES", default=FAMILIES,
                        help=f"comma-separated check families to run (default: all of {','.join(FAMILIES)})")
    parser.add_argument("--shm-path", default="/dev/shm", metavar="PATH",
                        help="shared-memory mount to measure (default: /dev/shm)")
    parser.add_argument("--stale-lock-minutes", type=_positive_float, default=10.0, metavar="M",
                        help="a JIT build lock older than this, held by no process, is stale (default: 10)")


def to_options(options: DoctorOptions | argparse.Namespace) -> DoctorOptions:
    """Accept the parsed CLI namespace or ready-made options."""
    if isinstance(options, DoctorOptions):
        return options
    get = vars(options).get
    return DoctorOptions(config=get("config"), ep_size=get("ep_size"), num_experts=get("num_experts"),
                         gpus_per_node=get("gpus_per_node"), world_size=get("world_size"),
                         timeout=get("timeout") or 60.0, shm_path=get("shm_path") or "/dev/shm",
                         stale_lock_minutes=get("stale_lock_minutes") or 10.0, dumps=get("dumps"),
                         only=tuple(get("only") or FAMILIES), env=dict(os.environ))


def _start_probes(opts: DoctorOptions) -> ProbeSet:
    """Launch the probe for the stages the selected families need, before anything else."""
    probes = ProbeSet(opts.timeout, opts.env)
    probes.start([s for f in FAMILIES if opts.selected(f) for s in FAMILY_STAGES.get(f, ())])
    return probes


def _run_family(family: str, opts: DoctorOptions, probes: ProbeSet) -> list[CheckResult]:
    """One family's results; a bug in a check becomes an ``error`` result, not a crash."""
    try:
        return list(import_module(f"troubleshooter.doctor.{family}").check(opts, probes))
    except Exception as err:  # noqa: BLE001 - the doctor must report, not die
        return [CheckResult(f"{family}.internal", f"{family} checks", "error",
                            f"the check itself failed: {type(err).__name__}: {err}",
                            entry="doctor-run", **cite(knowledge.fix("doctor-run", "report-bug")))]


def run_checks(options: DoctorOptions | argparse.Namespace) -> list[CheckResult]:
    """Run the selected check families and return every result, in family order."""
    opts = to_options(options)
    probes = _start_probes(opts)
    try:
        return [r for family in FAMILIES if opts.selected(family)
                for r in _run_family(family, opts, probes)]
    finally:
        probes.close()


def main(args: argparse.Namespace) -> int:
    """Run the doctor for the CLI and print the table (or JSON); return the exit status."""
    from troubleshooter.doctor import report

    opts = to_options(args)
    results = run_checks(opts)
    if getattr(args, "report", False):
        from troubleshooter import __version__
        from troubleshooter.doctor import bugreport

        sys.stdout.write(bugreport.render(results, opts, __version__))
    elif getattr(args, "json", False):
        sys.stdout.write(report.to_json(results) + "\n")
    else:
        report.render(results, sys.stdout)
    return exit_code(results)
