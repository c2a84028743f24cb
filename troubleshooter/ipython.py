"""The Jupyter / IPython face of the troubleshooter: ``%load_ext troubleshooter``.

What loading registers, and why each piece is built the way it is:

* ``%doctor [options]``: the doctor's checks (:func:`troubleshooter.doctor.run_checks`, the same
  options as ``python -m troubleshooter doctor``) as an HTML table, with the fix for every check
  that did not pass.
* ``%ds_lint CONFIG [--world-size N]``: lint a DeepSpeed config given as a path, or as the name of
  a dict in the user namespace; each finding's JSON merge patch is shown as a diff of the config.
* ``%%troubleshoot``: run the cell; on an exception, show the full knowledge-base diagnosis and
  open the matching walkthrough below the traceback. An input transformer blanks the magic line,
  so IPython itself runs the cell: the traceback is the one IPython prints without the magic
  (right ``Cell In[n]``, no frame of ours) and ``error_in_exec`` is the user's exception.
* The walkthrough works on the user's own config when the failing cell used one (a dict, a
  ``ZeroMoEStrategy``'s ``config``, a Trainer's ``strategy.config``) or ``%ds_lint`` linted one
  (:mod:`troubleshooter.walkthroughs.context`); otherwise it says it shows an example.
* Automatic diagnosis after any failing cell, through IPython's ``post_run_cell`` event. Not
  ``set_custom_exc``: that slot holds one handler per shell and other extensions (jupyter-ai)
  use it; an event callback only *reads* ``result.error_in_exec`` after IPython has already shown
  the traceback, so the exception can be neither swallowed nor altered.

Loading is cheap on purpose: this module imports IPython only. The knowledge base is plain TOML;
the doctor, lint, ipywidgets and the walkthroughs are imported when a command needs them, and
torch / deepspeed / lightning / transformers only by the checks and reproductions that use them.
``unload_ipython_extension`` removes exactly what loading added and puts back any magic of the
same name that was there before.
"""

from __future__ import annotations

import argparse
import ast
import shlex
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from troubleshooter.notebook_reports import Report, doctor_report, lint_report  # noqa: F401 - re-exported

__all__ = ["TroubleshooterMagics", "diagnose_exception", "exception_text", "load_ipython_extension",
           "unload_ipython_extension"]

# ---------------------------------------------------------------------------------------------


def exception_text(err: BaseException) -> str:
    """The text the knowledge base is matched against: the formatted traceback (with its chained
    causes) plus any output the exception carries (a failed subprocess's stderr: a training job
    launched from the notebook fails in another process, and its error is in that output)."""
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    for attr in ("stderr", "stdout", "output"):
        value = getattr(err, attr, None)
        if isinstance(value, bytes):
            value = value.decode("utf-8", errors="replace")
        if isinstance(value, str) and value.strip():
            text += "\n" + value
    return text


def diagnose_exception(err: BaseException) -> list:
    """Knowledge-base diagnoses for an exception, best first (``explain.Diagnosis`` objects)."""
    from troubleshooter.explain import explain_text

    return explain_text(exception_text(err))


@dataclass
class _State:
    """What one load added to one shell, so unload can take exactly that away again."""

    magics: "TroubleshooterMagics"
    callback: Any
    replaced: dict[str, dict[str, Any]] = field(default_factory=dict)  # kind -> name -> previous
    previous_registry: Any = None  # a Magics instance registered under our class name before us
    panels: list = field(default_factory=list)  # diagnosis panels shown (newest last)
    handled: set[int] = field(default_factory=set)  # id() of exceptions %%troubleshoot diagnosed
    auto: bool = True
    linted: tuple[str, Mapping] | None = None  # the last %ds_lint target: (label, config)
    transformer: Any = None  # the input transformer that hands %%troubleshoot cells to IPython


_STATES: dict[int, _State] = {}


def state_of(shell: Any) -> _State | None:
    """The extension's state in ``shell`` (None when not loaded); tests and widgets read it."""
    return _STATES.get(id(shell))


class _MagicArgumentError(Exception):
    pass


class _RaisingParser(argparse.ArgumentParser):
    """argparse that raises instead of calling sys.exit (SystemExit would end the cell oddly)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _MagicArgumentError(f"{self.prog}: {message}")

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        raise _MagicArgumentError(message or "")


def _doctor_parser() -> argparse.ArgumentParser:
    """The CLI's own doctor options (one definition), on a parser that does not exit."""
    from troubleshooter.doctor import add_arguments

    parser = _RaisingParser(prog="%doctor")
    add_arguments(parser)
    return parser


def _lint_parser() -> argparse.ArgumentParser:
    parser = _RaisingParser(prog="%ds_lint")
    parser.add_argument("config", help="a JSON file, or the name of a dict in the notebook")
    parser.add_argument("--world-size", type=int, default=None, help="total number of ranks")
    return parser


def _parse(parser_factory, line: str) -> argparse.Namespace:
    parser = parser_factory()
    try:
        return parser.parse_args(shlex.split(line))
    except _MagicArgumentError as err:
        text = str(err).strip()
        if not text:  # --help: argparse printed the help already
            text = parser.format_help()
        raise UsageError(text) from None


@magics_class
class TroubleshooterMagics(Magics):
    """``%doctor``, ``%ds_lint`` and ``%%troubleshoot``."""

    @line_magic
    def doctor(self, line: str = "") -> None:
        """Run the doctor's checks and show them as a table (same options as the CLI: --only, ...)."""
        from IPython.display import display

        from troubleshooter.doctor import run_checks

        args = _parse(_doctor_parser, line)
        results = run_checks(args)
        if args.json:
            from troubleshooter.doctor import report

            print(report.to_json(results))
            return
        display(doctor_report(results))

    @line_magic
    def ds_lint(self, line: str = "") -> None:
        """Lint a DeepSpeed config: ``%ds_lint ds_config.json`` or ``%ds_lint my_config_dict``."""
        from IPython.display import display

        from troubleshooter.lint import LintInputError, lint_config, load_config

        args = _parse(_lint_parser, line)
        value = self.shell.user_ns.get(args.config) if args.config.isidentifier() else None
        try:
            if isinstance(value, Mapping):
                config, source = dict(value), args.config
                findings = lint_config(config, world_size=args.world_size, source=source)
            else:
                if value is not None and not isinstance(value, str):
                    raise UsageError(f"%ds_lint: {args.config} is a {type(value).__name__}, not a dict or a path")
                path = value if isinstance(value, str) else args.config
                config, _text = load_config(path)
                source = str(path)
                findings = lint_config(config, world_size=args.world_size, source=source)
        except LintInputError as err:
            raise UsageError(f"%ds_lint: {err}") from None
        state = state_of(self.shell)
        if state is not None:  # a walkthrough after a later failure patches this config
            state.linted = (source, config)
        display(lint_report(findings, config, source))

    @cell_magic
    def troubleshoot(self, line: str, cell: str) -> Any:
        """Run the cell; on an exception show the full diagnosis and walkthrough below its traceback.

        In a notebook this body never runs: :func:`troubleshoot_transformer` blanks the
        ``%%troubleshoot`` line before IPython compiles the cell, so IPython runs the user's code
        itself (its traceback is exactly the one it prints without the magic: the right
        ``Cell In[n]``, no frame of ours) and ``post_run_cell`` shows the full panel after it.
        This body serves direct calls (``get_ipython().run_cell_magic("troubleshoot", "", code)``).
        """
        shell = self.shell
        cell = shell.transform_cell(cell)  # IPython syntax (%magics, !shell) inside the cell still works
        filename = shell.compile.cache(cell, shell.execution_count)
        tree = ast.parse(cell, filename=filename)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        try:
            exec(compile(tree, filename, "exec"), shell.user_global_ns, shell.user_ns)
            if last is not None:
                return eval(compile(ast.Expression(last.value), filename, "eval"), shell.user_global_ns,
                            shell.user_ns)
            return None
        except Exception as err:
            state = state_of(shell)
            if state is not None:
                state.handled.add(id(err))
            _show_diagnosis(shell, err, full=True, cell=cell)
            raise  # the same object, with its traceback


_MAGIC_LINE = "%%troubleshoot"


def troubleshoot_transformer(lines: list[str]) -> list[str]:
    """IPython input transformer: a cell whose first line is ``%%troubleshoot`` runs as itself.

    The magic line becomes an empty line, so line numbers stay those of the cell as the user sees
    it; ``post_run_cell`` recognises the cell by its raw text and shows the full diagnosis.
    """
    if lines and lines[0].strip() == _MAGIC_LINE:
        return ["\n", *lines[1:]]
    return lines


def _context(shell: Any, err: BaseException, cell: str, entry_id: str) -> Any:
    """The user's config (named in the failing cell, linted, or held by the notebook) and error."""
    from troubleshooter.walkthroughs.context import UserContext, config_in

    state = state_of(shell)
    found = config_in(shell.user_ns, cell, state.linted if state else None)
    return UserContext(config=found[0] if found else None, config_label=found[1] if found else "",
                       error_text=exception_text(err), entry_id=entry_id)


def _show_diagnosis(shell: Any, err: BaseException, *, full: bool, cell: str = "") -> Any:
    """Display a diagnosis panel for ``err``; return it (None when nothing is known about it).

    Any failure in here is reported as one line and never propagates: the user's exception is
    what matters, and a bug in the assistant must not hide it.
    """
    from IPython.display import display

    _show_hang_dumps(shell)
    try:
        diagnoses = diagnose_exception(err)
        if not diagnoses:
            if full:
                print("troubleshooter: no known problem matches this error "
                      "(python -m troubleshooter explain LOG also reads log files).")
            return None
        from troubleshooter.walkthroughs import DiagnosisPanel

        panel = DiagnosisPanel(diagnoses, full=full, context=_context(shell, err, cell, diagnoses[0].entry_id))
        state = state_of(shell)
        if state is not None:
            state.panels.append(panel)
        display(panel)
        if full:
            panel.open_walkthrough()
        return panel
    except Exception as bug:  # noqa: BLE001 - see docstring
        print(f"troubleshooter: could not diagnose this error ({type(bug).__name__}: {bug})")
        return None


def _show_hang_dumps(shell: Any) -> None:
    """After a failed cell: where the Flight Recorder dumps of a run that just failed are, and their summary
    (``<default_root_dir>/flight_recorder`` of every Trainer in the notebook, and ``./flight_recorder`` when
    this kernel was one of the run's ranks), when a trace there is from the last 15 minutes."""
    from pathlib import Path

    from troubleshooter import hangs

    try:
        import os

        from lightning_zeromoe import hang_dumps

        trainers = [Path(getattr(obj, "default_root_dir")) / "flight_recorder" for obj in list(shell.user_ns.values())
                    if hasattr(obj, "default_root_dir") and hasattr(obj, "strategy")]
        here = Path.cwd() / "flight_recorder"  # only when this kernel was one of its ranks (ddp_notebook's rank 0)
        if hang_dumps.is_dump_dir(here) and any(p.get("pid") == os.getpid()
                                                for p in hang_dumps.read_processes(here).values()):
            trainers.append(here)
        for directory in hangs.recent_dump_dirs(trainers):
            print("troubleshooter: " + "\n  ".join(hangs.summary_lines(directory)))
    except Exception as bug:  # noqa: BLE001 - never hide the user's error
        print(f"troubleshooter: could not read the Flight Recorder dumps ({type(bug).__name__}: {bug})")


def _post_run_cell(shell: Any):
    def post_run_cell(result: Any) -> None:
        """After a failed cell: append a short diagnosis panel (reads the exception, never touches it)."""
        state = state_of(shell)
        err = getattr(result, "error_in_exec", None)
        if state is None or not state.auto or err is None or not isinstance(err, Exception):
            return
        if id(err) in state.handled:  # a direct %%troubleshoot call has shown the full diagnosis
            state.handled.discard(id(err))
            return
        raw = getattr(getattr(result, "info", None), "raw_cell", None) or ""
        _show_diagnosis(shell, err, full=raw.lstrip().startswith(_MAGIC_LINE), cell=raw)

    return post_run_cell


def load_ipython_extension(ipython: Any) -> None:
    """Register the magics and the ``post_run_cell`` diagnosis (``%load_ext troubleshooter``)."""
    if id(ipython) in _STATES:
        return
    magics = TroubleshooterMagics(shell=ipython)
    manager = ipython.magics_manager
    replaced = {kind: {name: manager.magics[kind][name] for name in names if name in manager.magics[kind]}
                for kind, names in magics.magics.items()}
    previous_registry = manager.registry.get(type(magics).__name__)
    ipython.register_magics(magics)
    callback = _post_run_cell(ipython)
    ipython.events.register("post_run_cell", callback)
    transformers = getattr(ipython, "input_transformers_cleanup", None)
    if transformers is not None:
        transformers.append(troubleshoot_transformer)
    _STATES[id(ipython)] = _State(magics, callback, replaced, previous_registry,
                                  transformer=troubleshoot_transformer if transformers is not None else None)


def unload_ipython_extension(ipython: Any) -> None:
    """Remove the magics and the event callback again, restoring magics they had shadowed."""
    state = _STATES.pop(id(ipython), None)
    if state is None:
        return
    try:
        ipython.events.unregister("post_run_cell", state.callback)
    except ValueError:
        pass
    transformers = getattr(ipython, "input_transformers_cleanup", [])
    if state.transformer in transformers:
        transformers.remove(state.transformer)
    manager = ipython.magics_manager
    for kind, names in state.magics.magics.items():
        table, previous = manager.magics[kind], state.replaced.get(kind, {})
        for name in names:
            if getattr(table.get(name), "__self__", None) is not state.magics:
                continue  # registered by someone else after us: theirs now, leave it
            if name in previous:
                table[name] = previous[name]
            else:
                del table[name]
    name = type(state.magics).__name__
    if state.previous_registry is None:
        manager.registry.pop(name, None)
    else:
        manager.registry[name] = state.previous_registry

