"""Command line: ``troubleshooter {doctor,lint,explain,hang-dump}`` (also ``python -m troubleshooter ...``).

Exit codes, the same for every subcommand:
  0  nothing fails (lint: no error-severity finding; explain: a diagnosis was printed),
  1  a failure was found (lint: at least one error finding; doctor: a failing check;
     explain: nothing in the input matched a known problem, so the tool could not help),
  2  bad arguments or unreadable input (missing file, malformed JSON, a wrong type).

Why explain exits 1 when nothing matched: scripts and notebooks can then tell "here is the
diagnosis" from "unknown problem, look elsewhere" without parsing text.

``doctor`` is delegated to ``troubleshooter.doctor`` (``add_arguments`` / ``main``), imported only
when that subcommand is used, so ``lint`` and ``explain`` start fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Sequence

from rich.console import Console

from lightning_zeromoe import invocation
from troubleshooter import __version__, examples, explain, lint, render
from troubleshooter.argtypes import positive_int

__all__ = ["build_parser", "main"]

EXIT_OK, EXIT_FOUND, EXIT_USAGE = 0, 1, 2


# ----------------------------------------------------------------------------------------------
# lint
# ----------------------------------------------------------------------------------------------


def _add_lint(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lint", help="check a DeepSpeed JSON config",
                       description="Check a DeepSpeed JSON config (Lightning-generated ones too) "
                                   "against the installed DeepSpeed and known pitfalls.")
    p.add_argument("config", help="path to the DeepSpeed JSON config")
    p.add_argument("--world-size", type=positive_int, default=None, metavar="N",
                   help="number of ranks, to check batch arithmetic and ep_size divisibility")
    p.add_argument("--for", dest="consumer", choices=lint.CONSUMERS, default="deepspeed",
                   help="who reads the config: deepspeed (deepspeed.initialize; accepts hjson), "
                        "lightning (DeepSpeedStrategy(config=...); json, no "
                        "gradient_accumulation_steps) or hf (the Hugging Face Trainer; json, "
                        "resolves \"auto\"). Default: deepspeed")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=_run_lint)


def _run_lint(args: argparse.Namespace) -> int:
    try:
        findings = lint.lint_path(args.config, world_size=args.world_size, consumer=args.consumer)
    except lint.LintInputError as err:
        return _input_error(str(err), args.json)
    errors = sum(f.severity == "error" for f in findings)
    if args.json:
        render.print_json({"source": args.config, "world_size": args.world_size,
                           "consumer": args.consumer, "errors": errors,
                           "findings": [f.to_dict() for f in findings]})
    else:
        _print_findings(render.console(), args.config, findings)
    return EXIT_FOUND if errors else EXIT_OK


def _print_findings(con: Console, source: str, findings: list[lint.Finding]) -> None:
    """A table in a terminal; one block per finding when plain (pipes, logs, NO_COLOR)."""
    if not findings:
        con.print(f"{source}: no findings.", markup=False)
        return
    if render.is_plain(con):
        for f in findings:
            con.print(render.label(f.severity, con), f"{_where(source, f)}: {f.path or '-'} "
                      f"[{f.rule}]: {f.message}", markup=False)
            for note in f.notes:
                con.print(f"    - {note}", markup=False)
            con.print(f"    fix [{f.fix_id}]: {f.fix}", markup=False)
    else:
        from rich.table import Table

        table = Table(title=f"lint {source}", show_lines=True)
        for column, ratio in (("severity", 1), ("where", 2), ("problem", 5), ("fix", 3), ("rule", 2)):
            table.add_column(column, overflow="fold", ratio=ratio)
        for f in findings:
            problem = "\n".join((f.message, *(f"- {n}" for n in f.notes)))
            table.add_row(render.label(f.severity, con), f"{_where(source, f)}\n{f.path or '-'}",
                          problem, f.fix, f"{f.rule}\n({f.fix_id})")
        con.print(table)
    counts = {s: sum(f.severity == s for f in findings) for s in ("error", "warning", "info")}
    con.print(", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items())
              + ". Each rule is a knowledge-base entry (lightning_zeromoe/knowledge/entries/RULE.toml).")


def _where(source: str, f: lint.Finding) -> str:
    """``file:line:col`` of a finding (``file`` alone when the position is unknown)."""
    return f"{source}:{f.line}:{f.col}" if f.line is not None else source


# ----------------------------------------------------------------------------------------------
# explain
# ----------------------------------------------------------------------------------------------


def _add_explain(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="diagnose a traceback or log",
                       description="Match a traceback or training log against the knowledge base "
                                   "and print the diagnosis and the fix.")
    p.add_argument("source", nargs="?", default="-",
                   help="a log or traceback file, the error message itself (quoted), or '-' "
                        "(default) to read standard input")
    p.add_argument("--example", choices=examples.names(), metavar="NAME",
                   help="diagnose a real log bundled with the troubleshooter instead of SOURCE, to see what "
                        f"explain prints ({', '.join(examples.names())})")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--why", action="store_true",
                   help="print the evidence each diagnosis was named on (patterns, facts, claims), and "
                        "the normalising steps applied to the input")
    p.set_defaults(handler=_run_explain)


def _explain_hang(directory: Path, as_json: bool, source: str | None = None) -> int:
    """``explain`` on a Flight Recorder dump directory (:mod:`troubleshooter.hangs`)."""
    from troubleshooter import hangs

    report = hangs.analyse(directory)
    if as_json:
        render.print_json({"source": source or str(directory), "kind": "flight-recorder", "hang": report.to_dict()})
    else:
        print("\n".join(hangs.render(report)))
    return EXIT_OK if report.entry_id else EXIT_FOUND


def _run_explain(args: argparse.Namespace) -> int:
    from troubleshooter import hangs

    if args.example:
        if args.source != "-":
            return _input_error(f"explain: give SOURCE or --example, not both (got {args.source!r} and "
                                f"--example {args.example})", args.json)
        args.source = examples.path(args.example)
    if args.source != "-" and hangs.is_dump_dir(Path(args.source)):
        return _explain_hang(Path(args.source), args.json)
    if args.source == "-" and sys.stdin.isatty():
        return _input_error("explain: give a file, or pipe a log into standard input "
                            f"(python train.py 2>&1 | {invocation.prog('troubleshooter')} explain -)", args.json)
    try:
        data = explain.read_source(args.source)
    except explain.ExplainInputError as err:
        return _input_error(str(err), args.json)
    diagnoses = explain.explain_input(data)
    pointed = hangs.dump_dir_in_log(data.text) if not data.problem() else None
    if pointed is not None:  # the log names the run's dumps: their analysis says more than the log
        return _explain_hang(pointed, args.json, source=data.name)
    if not diagnoses and data.problem():  # empty or binary: say so, as for an unreadable file
        return _input_error(data.problem(), args.json)
    name = data.name
    seen = explain.recognised(data) if not diagnoses or args.why else None
    if args.json:
        report = {"source": name, "kind": data.kind, "bytes": data.total_bytes,
                  "truncated": data.truncated, "binary": data.binary,
                  "diagnoses": [d.to_dict() for d in diagnoses]}
        if seen is not None:
            report["recognised"] = seen.to_dict()
        render.print_json(report)
    else:
        _print_diagnoses(render.console(), name, data, diagnoses, seen, args.why)
    return EXIT_OK if diagnoses else EXIT_FOUND


def _print_diagnoses(con: Console, name: str, data: explain.Input, diagnoses: list[explain.Diagnosis],
                     seen: explain.Recognised | None, why: bool) -> None:
    if data.note():
        con.print(data.note(), markup=False)
    if why and seen is not None and seen.normalised:
        con.print(f"(normalised before matching: {', '.join(seen.normalised)})", markup=False)
    if not diagnoses:
        con.print(f"No known problem found in {name} ({data.describe()} read). The knowledge base does not "
                  f"recognise this error.", markup=False)
        if seen is not None:
            con.print(f"Recognised: {seen.summary}; no known problem matches.", markup=False)
            if seen.facts:
                con.print("These facts may help:", markup=False)
                for fact in seen.facts:
                    con.print(f"  - {fact.describe()}", markup=False)
        con.print(f"Check the environment with `{_doctor_hint()}`.", markup=False)
        return
    for i, d in enumerate(diagnoses, 1):
        _print_diagnosis(con, i, d, why)
    con.print(f"If this does not solve it, check the environment with `{_doctor_hint()}`.")


def _print_diagnosis(con: Console, index: int, d: explain.Diagnosis, why: bool = False) -> None:
    con.print(render.label(d.severity, con), f"{index}. {d.title} [{d.entry_id}]", style="bold",
              markup=False)
    con.print(f"  line {d.line_no}" + (f" (and {d.count - 1} more)" if d.count > 1 else "")
              + f": {d.snippet}", markup=False)
    if d.details:
        con.print("  found: " + ", ".join(f"{k}={v}" for k, v in d.details.items()), markup=False)
    con.print("  why: " + " ".join(d.cause.split()), markup=False)
    if why:
        con.print("  evidence:", markup=False)
        for line in d.evidence:
            con.print(f"    - {line}", markup=False)
    if d.finding:
        con.print("  this log: " + d.finding, markup=False)
    for step, text in enumerate(d.fix, 1):
        con.print(f"  {step}) {text}", markup=False)
    if d.patch:
        from rich.syntax import Syntax  # pulls in pygments: only when a patch is shown

        con.print(f"  patch ({d.patch_kind}):", markup=False)
        lexer = "json" if d.patch_kind == "json" else "diff"
        con.print(Syntax(d.patch.strip(), lexer, theme="ansi_dark", background_color="default"))
    con.print(f"  checked against: {d.checked_against}", markup=False, style="dim")
    con.print(f"  sources: {'; '.join(d.sources)}", markup=False, style="dim")
    con.print()


# ----------------------------------------------------------------------------------------------
# doctor (delegated)
# ----------------------------------------------------------------------------------------------


def _add_hang_dump(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("hang-dump", help="make the ranks of a running job write their Flight Recorder traces",
                       description="Send SIGUSR1 to every rank (on this host) whose process file is in the "
                                   "run's dump directory, wait for their traces, then explain them.")
    p.add_argument("directory", type=Path, help="the run's dump directory (<default_root_dir>/flight_recorder)")
    p.add_argument("--wait", type=float, default=10.0, help="seconds to wait for the traces (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(handler=_run_hang_dump)


def _run_hang_dump(args: argparse.Namespace) -> int:
    from lightning_zeromoe import hang_dumps
    from troubleshooter import hangs

    if not hangs.is_dump_dir(args.directory):
        return _input_error(f"hang-dump: {args.directory} holds no process<N>.json of a running job", args.json)
    for rank, pid, outcome in hang_dumps.request_and_wait(args.directory, args.wait):
        print(f"rank {rank} (pid {pid}): {outcome}", file=sys.stderr)
    return _explain_hang(args.directory, args.json)


def _add_doctor(sub: argparse._SubParsersAction, with_options: bool) -> argparse.ArgumentParser:
    p = sub.add_parser("doctor", help="check the environment (versions, CUDA, build tools, NCCL, host)",
                       description="Check the installed stack and the host for known problems.")
    p.set_defaults(handler=_run_doctor)
    if with_options:  # only when doctor is the command: importing it costs time
        _doctor_module().add_arguments(p)
    return p


def _doctor_module():
    try:
        return importlib.import_module("troubleshooter.doctor")
    except ModuleNotFoundError as err:
        if err.name not in ("troubleshooter.doctor", "troubleshooter"):
            raise
        raise SystemExit(_input_error("doctor is not available in this installation "
                                      "(troubleshooter.doctor is missing)", False))


def _run_doctor(args: argparse.Namespace) -> int:
    return int(_doctor_module().main(args))


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------


def _input_error(message: str, as_json: bool) -> int:
    """Bad input: one line on stderr (and a JSON object on stdout with --json), exit 2."""
    if as_json:
        render.print_json({"error": message})
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _doctor_hint() -> str:
    """``troubleshooter doctor``, under the name this process was started by."""
    return f"{invocation.prog('troubleshooter')} doctor"


def build_parser(argv: Sequence[str] = (), prog: str | None = None) -> argparse.ArgumentParser:
    """The argument parser. Doctor's own options are added only when ``doctor`` is in ``argv``. ``prog``
    defaults to the name the tool was started by (``troubleshooter`` or ``python -m troubleshooter``)."""
    parser = argparse.ArgumentParser(
        prog=prog or invocation.prog("troubleshooter"),
        description="Diagnose DeepSpeed ZeRO-3 + MoE training: environment, config, tracebacks.",
        epilog="Exit codes: 0 nothing fails, 1 a problem found (explain: nothing recognised), "
               "2 bad arguments or unreadable input.")
    parser.add_argument("--version", action="version", version=f"troubleshooter {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{doctor,lint,explain,hang-dump}", required=True)
    command = next((a for a in argv if not a.startswith("-")), None)
    _add_doctor(sub, with_options=command == "doctor")
    _add_lint(sub)
    _add_explain(sub)
    _add_hang_dump(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    invocation.help_when_empty(parser, argv)
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `... | head`
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
