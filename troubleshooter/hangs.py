"""Where the ranks of a hung (or dead) run parted: the Flight Recorder dumps of every rank, aligned.

A run under ``ZeroMoEStrategy`` writes, per rank, ``rank<N>`` (torch's Flight Recorder dump: every
group's recent collectives with their per-group sequence ids) and ``process<N>.json`` (pid, the
groups' global ranks, the modules whose ZeRO-3 gathers ran last) into ``<default_root_dir>/flight_recorder``
(:mod:`lightning_zeromoe.engine.flight_recorder`).

:func:`analyse` reads them and, per group, walks the sequence ids every member rank recorded: the
first id at which the members' collectives differ (op, sizes, dtype), or at which some member issued
nothing, is that group's divergence; the earliest over the groups is the run's. Each side's
collective is described by what issued it (its recorded Python stack, and for a ZeRO-3 gather, the
module being fetched), and the pattern picks the knowledge-base entry.

The dump files are read with torch's own reader (``torch.distributed.flight_recorder``'s
``read_dump``). Its matcher (``fr_trace``'s ``build_db``) needs each group's members from the
dump's ``pg_config``, which gloo leaves empty (torch 2.13), so the alignment is done here, over the
members the strategy recorded in ``process<N>.json``. torch is imported only inside :func:`analyse`:
importing this module stays light (``tests/test_import_direction.py``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from lightning_zeromoe import hang_dumps
from lightning_zeromoe.hang_dumps import is_dump_dir

#: A log line the strategy prints when it writes a dump: ``... written to <dir> ...``.
LOG_POINTER = re.compile(r"Flight Recorder trace written to (?P<dir>\S+)")
#: Ops whose sizes legitimately differ between ranks (uneven splits).
UNEVEN_OPS = ("all_to_all", "alltoall", "all_gather_v", "reduce_scatter_v")

#: Stack frames that say who issued a collective.
ZERO3_FETCH = ("fetch_sub_module", "_pre_forward_module_hook", "pre_sub_module_forward_function",
               "pre_sub_module_backward_function", "all_gather_coalesced", "_all_gather_params")
SAVE_FRAMES = ("save_checkpoint", "_save_checkpoint", "save_16bit_model", "_zero3_consolidated_16bit_state_dict")
EVAL_FRAMES = ("validation_step", "test_step", "predict_step", "_evaluation_step", "_predict_step",
               "_run_evaluate", "_run_predict", "validate", "test", "predict")
STEP_FRAMES = ("training_step", "validation_step", "test_step", "predict_step")
#: Lightning's loop files and the step each runs (the evaluation loop runs validation, or test under ``_test_impl``).
LOOP_FILES = {"training_epoch_loop.py": "training_step", "automatic.py": "training_step", "manual.py": "training_step",
              "evaluation_loop.py": "validation_step", "prediction_loop.py": "predict_step"}
#: Packages whose frames sit between a user's call and the collective (``self.all_gather`` -> torch).
PLUMBING = ("torch", "lightning", "lightning_fabric", "lightning_utilities", "pytorch_lightning")
LIBRARY_PATHS = ("site-packages", "dist-packages", "/lib/python3")
#: Lightning's loops and trainer: a collective reached through them, before any user frame, is Lightning's own.
LIGHTNING_LOOPS = ("/pytorch/loops/", "/pytorch/trainer/", "/pytorch_lightning/loops/", "/pytorch_lightning/trainer/")


class HangInputError(ValueError):
    """The directory holds no Flight Recorder dump."""


@dataclasses.dataclass(frozen=True)
class Op:
    """One rank's collective at the divergence."""

    rank: int
    name: str
    seq: int
    input_sizes: list[Any]
    output_sizes: list[Any]
    dtypes: list[str]
    state: str
    origin: str  # zero3-gather, save, evaluation, user, library
    phase: str | None  # the Lightning step it ran in: training_step, validation_step, ... (None: outside one)
    module: str | None
    caller: str | None
    time_ns: int
    #: For a rank that died of a fatal error: what it died of (its side comes from its stacks, not a trace).
    died: str | None = None

    def describe(self) -> str:
        if self.died:
            where = (f" (from {self.caller})" if self.caller else "") + (f" in {self.phase}" if self.phase else "")
            return f"{self.name}{where} when it died: {self.died} (its Python stacks: stacks{self.rank}.txt)"
        text = f"{self.name} in {self.input_sizes} out {self.output_sizes} {'/'.join(self.dtypes) or '-'}"
        if self.module:
            text += f" (ZeRO-3 gather for {self.module})"
        elif self.caller:
            text += f" (from {self.caller})"
        if self.phase:
            text += f" in {self.phase}"
        return text


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first sequence id of one group where its members parted."""

    group: str
    desc: str
    members: list[int]
    seq: int
    issued: list[Op]
    silent: list[int]          # members with a dump that issued nothing at ``seq``
    last_of_silent: dict[int, Op | None]
    no_dump: list[int]         # members that wrote no trace (dead or unreachable)


@dataclasses.dataclass(frozen=True)
class HangReport:
    """What :func:`analyse` found: the ranks read, the divergence (None: the dumps agree), the entry."""

    directory: str
    ranks: list[int]
    missing: list[int]
    divergence: Divergence | None
    entry_id: str | None
    reasons: dict[int, str | None]

    def lines(self) -> list[str]:
        """The few lines ``explain`` prints."""
        out = [f"Flight Recorder dumps in {self.directory}: ranks {_ranks(self.ranks)}"
               + (f"; no trace from rank(s) {_ranks(self.missing)} (dead, or killed before it could write)"
                  if self.missing else "")]
        d = self.divergence
        if d is None:
            if self.missing:
                out.append("The ranks that wrote a trace agree on every collective they recorded.")
            else:
                out.append("No divergence: every group's ranks issued the same collectives, in the same order.")
            return out
        out.append(f"First divergence: group {d.group} ({d.desc}, ranks {_ranks(d.members)}), collective #{d.seq}")
        for op in d.issued:
            out.append(f"  rank {op.rank} was in {op.describe()}" if op.died
                       else f"  rank {op.rank} issued {op.describe()} [{op.state}]")
        for rank in d.silent:
            last = d.last_of_silent.get(rank)
            tail = f" (its last in this group: #{last.seq} {last.name} [{last.state}])" if last else ""
            out.append(f"  rank {rank} issued nothing{tail}")
        for rank in d.no_dump:
            out.append(f"  rank {rank}: no trace")
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks) or "none"


def dump_dir_in_log(text: str) -> Path | None:
    """The dump directory a log names (the strategy's "Flight Recorder trace written to ..." line)."""
    for match in LOG_POINTER.finditer(text):
        path = Path(match.group("dir").rstrip(".,;:"))
        if path.is_file():
            path = path.parent
        if is_dump_dir(path):
            return path
    return None


def _load(directory: Path) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    from torch.distributed.flight_recorder.components.loader import read_dump

    traces = {int(m.group(1)): read_dump(hang_dumps.TRACE_PREFIX, str(p)) for p in directory.iterdir()
              if (m := hang_dumps.TRACE.match(p.name))}
    return traces, hang_dumps.read_processes(directory)


def _short(name: str) -> str:
    return name.split(":", 1)[-1]


def _signature(op: Op) -> tuple[Any, ...]:
    """What must be equal on every rank at one sequence id: the op, sizes and dtypes, the Lightning step
    it ran in (gloo pairs a validation all-to-all with a training one without noticing), and for ZeRO-3
    gathers the module (same-shaped experts gather without an error, and gather the wrong weights)."""
    sizes = () if any(name in op.name for name in UNEVEN_OPS) else (op.input_sizes, op.output_sizes)
    return (op.name, *sizes, op.dtypes, op.phase, op.module)


def _phase(frames: list[dict[str, Any]]) -> str | None:
    """The outermost Lightning step on the stack (frames are innermost first); outside the user's step (the
    backward and optimizer step of the training closure, the loops' own collectives), the innermost Lightning
    loop that runs it."""
    steps = [f.get("name") for f in frames if f.get("name") in STEP_FRAMES]
    if steps:
        return steps[-1]
    for frame in frames:
        path = _frame_path(frame)
        loop = LOOP_FILES.get(Path(path).name) if "/loops/" in path and "lightning" in path else None
        if loop == "validation_step" and any(f.get("name") == "_test_impl" for f in frames):
            return "test_step"
        if loop is not None:
            return loop
    return None


def _origin(frames: list[dict[str, Any]]) -> tuple[str, str | None]:
    """(origin, caller): who issued a collective, from its recorded Python stack (innermost first)."""
    names = [f.get("name", "") for f in frames]
    if any(n in ZERO3_FETCH for n in names):
        return "zero3-gather", None
    if any(n in SAVE_FRAMES for n in names):
        return "save", next((n for n in names if n in SAVE_FRAMES), None)
    user = _direct_caller(frames)
    if any(n in EVAL_FRAMES for n in names) and not any(n == "training_step" for n in names):
        return "evaluation", next((n for n in names if n in EVAL_FRAMES), None)
    if user is not None:
        return "user", f"{user.get('name')} ({Path(user['filename']).name}:{user.get('line')})"
    return "library", next((n for n in names if n not in ("wrapper", "log_wrapper")), None)


def _frame_path(frame: dict[str, Any]) -> str:
    """A frame's file name with forward slashes (a Windows rank's too)."""
    return (frame.get("filename") or "").replace("\\", "/")


def _direct_caller(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The frame that called the collective, past torch's and Lightning's plumbing, if it is the user's own
    code (not a library's, ours included)."""
    for frame in frames:
        path = _frame_path(frame)
        if any(loop in path for loop in LIGHTNING_LOOPS):
            return None  # issued by Lightning's own loop (the user's frame below it only called fit)
        if any(f"/{lib}/" in path for lib in PLUMBING):
            continue
        return frame if not any(p in path for p in LIBRARY_PATHS) and "lightning_zeromoe" not in path else None
    return None


def _module_for(entry: dict[str, Any], gathers: list[list[Any]]) -> str | None:
    """The module whose fetch began last before this gather was issued (within 10 s)."""
    created = entry.get("time_created_ns") or 0
    best = None
    for t, name in gathers:
        if t <= created and created - t < 10_000_000_000:
            best = name
    return best


def _op(rank: int, entry: dict[str, Any], process: dict[str, Any]) -> Op:
    origin, caller = _origin(entry.get("frames") or [])
    module = _module_for(entry, process.get("gathers") or []) if origin == "zero3-gather" else None
    frames = entry.get("frames") or []
    return Op(rank=rank, name=_short(entry["profiling_name"]), seq=int(entry["collective_seq_id"]),
              input_sizes=entry.get("input_sizes") or [], output_sizes=entry.get("output_sizes") or [],
              dtypes=list(dict.fromkeys(entry.get("input_dtypes") or [])), state=str(entry.get("state")),
              origin=origin, phase=_phase(frames), module=module, caller=caller,
              time_ns=int(entry.get("time_created_ns") or 0))


#: faulthandler's output: the error, then per thread a header and its frames, most recent call first.
FATAL_ERROR = re.compile(r"^Fatal Python error: (?P<what>.+)$", re.MULTILINE)
THREAD_HEADER = re.compile(r"^(?:Current thread|Thread) (?P<ident>0x[0-9a-f]+) \(most recent call first\):$")
FRAME_LINE = re.compile(r'^\s+File "(?P<filename>[^"]+)", line (?P<line>\d+) in (?P<name>\S+)')


def _main_thread_frames(text: str, main_thread: int | None) -> list[dict[str, Any]]:
    """The main thread's frames (innermost first) in faulthandler's text; without its id, the thread that was
    in a Lightning step, else the last one listed (faulthandler lists the main thread last)."""
    threads: list[tuple[int, list[dict[str, Any]]]] = []
    for line in text.splitlines():
        if header := THREAD_HEADER.match(line):
            threads.append((int(header.group("ident"), 16), []))
        elif (frame := FRAME_LINE.match(line)) and threads:
            threads[-1][1].append({"name": frame.group("name"), "filename": frame.group("filename"),
                                   "line": int(frame.group("line"))})
    if not threads:
        return []
    by_id = dict(threads)
    if main_thread in by_id:
        return by_id[main_thread]
    return next((frames for _, frames in threads if _phase(frames)), threads[-1][1])


def _crash_op(rank: int, text: str, process: dict[str, Any]) -> Op | None:
    """A rank that died of a fatal error: the collective its main thread was in, from its stacks (None if it
    was in none)."""
    frames = _main_thread_frames(text, process.get("main_thread"))
    collective = next((f for f in frames if "/torch/distributed/" in _frame_path(f)
                       and f["name"] not in ("wrapper", "_fn", "inner")), None)
    if collective is None:
        return None
    fatal = FATAL_ERROR.search(text)
    origin, caller = _origin(frames)
    return Op(rank=rank, name=collective["name"], seq=-1, input_sizes=[], output_sizes=[], dtypes=[],
              state="died", origin=origin, phase=_phase(frames), module=None, caller=caller, time_ns=0,
              died=f"Fatal Python error: {fatal.group('what')}" if fatal else "a fatal error")


def _groups(processes: dict[int, dict[str, Any]], traces: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Group name -> {desc, members}: from the process files (gloo's dump has no members)."""
    groups: dict[str, dict[str, Any]] = {}
    for info in processes.values():
        for name, group in (info.get("groups") or {}).items():
            groups.setdefault(name, {"desc": group.get("desc", ""), "members": set()})["members"].update(group["ranks"])
    for trace in traces.values():  # NCCL fills pg_config: use it too
        for name, cfg in (trace.get("pg_config") or {}).items():
            try:
                ranks = json.loads(cfg.get("ranks", "[]"))
            except (json.JSONDecodeError, AttributeError):
                continue
            if name and ranks:
                groups.setdefault(name, {"desc": cfg.get("desc", ""), "members": set()})["members"].update(ranks)
    return groups


def _diverge(name: str, group: dict[str, Any], traces: dict[int, dict[str, Any]],
             processes: dict[int, dict[str, Any]], crashed: dict[int, Op]) -> Divergence | None:
    members = sorted(group["members"])
    if len(members) < 2:
        return None
    by_rank: dict[int, dict[int, dict[str, Any]]] = {}
    for rank in members:
        if rank in traces:
            by_rank[rank] = {int(e["collective_seq_id"]): e for e in traces[rank]["entries"]
                             if e["process_group"][0] == name and not e.get("is_p2p")}
    no_dump = [r for r in members if r not in traces]
    present = [r for r in members if r in by_rank]
    if not present or all(not seqs for seqs in by_rank.values()):
        return None
    start = max(min(seqs) for seqs in by_rank.values() if seqs)  # the ring buffers' common window
    end = max(max(seqs) for seqs in by_rank.values() if seqs)
    for seq in range(start, end + 1):
        entries = {r: by_rank[r].get(seq) for r in present}
        issued = {r: _op(r, e, processes.get(r, {})) for r, e in entries.items() if e is not None}
        silent = [r for r, e in entries.items() if e is None]
        agree = not silent and len({repr(_signature(op)) for op in issued.values()}) == 1
        # where the ranks with a dump agree throughout, a member without one is reported at the last op
        if agree and (not no_dump or seq < end):
            continue
        last = {r: (_op(r, by_rank[r][max(by_rank[r])], processes.get(r, {})) if by_rank[r] else None)
                for r in silent}
        issued.update({r: crashed[r] for r in no_dump if r in crashed})  # a dead rank's side, from its stacks
        return Divergence(group=name, desc=group["desc"], members=members, seq=seq,
                          issued=[op for _, op in sorted(issued.items())],
                          silent=silent, last_of_silent=last, no_dump=[r for r in no_dump if r not in crashed])
    return None


#: The entries :func:`_kind` can name, most specific first: a run with several divergent groups is
#: explained by the most specific one.
KINDS = ("zero3-moe-gather-mismatch", "hang-rank-conditional-collective", "hang-rank-subset-save-or-eval",
         "hang-uneven-batches")


def _kind(d: Divergence) -> str:
    """The knowledge-base entry for one group's divergence."""
    ops = d.issued
    origins = {op.origin for op in ops}
    phases = {op.phase for op in ops}
    modules = {op.module for op in ops if op.module}
    if not d.silent and origins == {"zero3-gather"} and len(modules) > 1:
        return "zero3-moe-gather-mismatch"
    if any(op.origin == "user" and op.phase is not None for op in ops):
        return "hang-rank-conditional-collective"
    if "save" in origins:
        return "hang-rank-subset-save-or-eval"
    evaluating = {"validation_step", "test_step", "predict_step"}
    if "training_step" in phases and phases & evaluating:
        return "hang-uneven-batches"  # one rank's epoch ended (it evaluates) while another still trains
    if phases & evaluating or "evaluation" in origins:
        if d.silent or any(op.phase is None and op.origin != "evaluation" for op in ops):
            return "hang-rank-subset-save-or-eval"
    if d.silent and phases == {"training_step"}:
        return "hang-uneven-batches"
    return "nccl-watchdog-timeout"


def _explain(found: list[Divergence], missing: list[int],
             crashed: dict[int, Op]) -> tuple[Divergence | None, str | None]:
    """The divergence to show and its entry: a dead rank first, unless every dead rank's stacks show the
    collective it died in and the sides name a more specific pattern; else the most specific kind, the one
    with fewest silent ranks, earliest."""
    def issued_at(d: Divergence) -> int:
        return min([op.time_ns for op in d.issued if op.died is None] or [1 << 62])

    if not found:
        return None, ("peer-rank-died" if missing else None)
    if missing:  # the survivors' latest collective is the one that waited for the dead rank
        shown = max(found, key=issued_at)
        kind = _kind(shown) if set(missing) <= set(crashed) else None
        return shown, (kind if kind in KINDS else "peer-rank-died")
    # the most specific kind; among its divergences, one where every rank issued something (it shows each side)
    kinds = sorted(((KINDS.index(k) if k in KINDS else len(KINDS), len(d.silent) + len(d.no_dump), issued_at(d), k, i)
                    for i, d in enumerate(found) for k in [_kind(d)]))
    *_, kind, index = kinds[0]
    return found[index], kind


def render(report: HangReport) -> list[str]:
    """The report's lines, then the knowledge-base entry: its title, cause and fixes."""
    from lightning_zeromoe import knowledge

    lines = report.lines()
    if report.entry_id is None:
        return lines
    entry = knowledge.get(report.entry_id)
    lines += ["", f"[{entry.id}] {entry.title}", *(f"  {line}" for line in entry.cause.splitlines()), "Fix:"]
    lines += [f"  {n}. {fix.text}" for n, fix in enumerate(entry.fixes, 1)]
    return lines


def recent_dump_dirs(candidates: list[Path], within_s: float = 900.0) -> list[Path]:
    """The candidates that hold a trace written in the last ``within_s`` seconds (the Jupyter assistant
    and ``doctor --report`` look in ``<default_root_dir>/flight_recorder``)."""
    import time

    found = []
    for directory in dict.fromkeys(Path(c) for c in candidates):
        if not is_dump_dir(directory):
            continue
        times = [p.stat().st_mtime for p in directory.iterdir() if hang_dumps.TRACE.match(p.name)]
        if times and time.time() - max(times) < within_s:
            found.append(directory)
    return found


def summary_lines(directory: Path) -> list[str]:
    """A dump directory's report and the entry's id and title, for the assistant and the bug report; a
    failed analysis is one line saying why."""
    try:
        report = analyse(directory)
    except Exception as error:  # noqa: BLE001 - a report of a report must not fail
        return [f"Flight Recorder dumps in {directory}: could not be read ({type(error).__name__}: {error})"]
    lines = report.lines()
    if report.entry_id:
        from lightning_zeromoe import knowledge

        lines.append(f"[{report.entry_id}] {knowledge.get(report.entry_id).title}")
    return lines


def analyse(directory: str | Path) -> HangReport:
    """Read a run's dumps and find where its ranks parted (see the module docstring)."""
    directory = Path(directory)
    if not is_dump_dir(directory):
        raise HangInputError(f"{directory}: no Flight Recorder dump here (files rank<N> / process<N>.json)")
    traces, processes = _load(directory)
    world = max([int(p.get("world_size", 0)) for p in processes.values()] + [max(traces, default=-1) + 1])
    missing = sorted(set(range(world)) - set(traces))
    crashed = {rank: op for rank, text in hang_dumps.read_fatal_stacks(directory).items()
               if rank in missing and (op := _crash_op(rank, text, processes.get(rank, {}))) is not None}
    groups = _groups(processes, traces)
    found = [d for name, g in groups.items() if (d := _diverge(name, g, traces, processes, crashed)) is not None]
    shown, entry_id = _explain(found, missing, crashed)
    return HangReport(directory=str(directory), ranks=sorted(traces), missing=missing, divergence=shown,
                      entry_id=entry_id,
                      reasons={r: p.get("dumped") for r, p in sorted(processes.items())})


__all__ = ["Divergence", "HangInputError", "HangReport", "Op", "analyse", "dump_dir_in_log", "is_dump_dir",
           "recent_dump_dirs", "render", "summary_lines"]
