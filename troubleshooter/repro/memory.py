"""``oom()``: a real out-of-memory error on the tiny MoE, then the fix ladder until it fits.

On CPU (this machine) the training step runs in a child process whose address space is limited
with ``resource.setrlimit(RLIMIT_AS)`` (field notes item 9): the kernel refuses the allocation,
and torch's ``DefaultCPUAllocator`` raises ``RuntimeError: ... can't allocate memory`` (or
``std::bad_alloc`` from a C++ container) exactly as on a machine that is really full. The limit is
``budget_mb`` above what the process holds once the model is built (see ``_oom_child``).

Every rung is measured the same way, twice, in forks of one child: without the limit (``needs_mb``,
the address-space growth ``VmPeak`` the limit is compared with, and the step's loss) and under it
(fits, or the allocator's error). A peak taken under the limit alone says only where the process
died, so it is never compared with anything.

The ladder is the order the knowledge base gives for OOM (entry ``cuda-oom``, fix steps in order):

1. measure - the same step without a limit, to know how much it needs;
2. micro-batch down, gradient accumulation up (same global batch);
3. activation checkpointing (keep layer inputs, recompute the rest in backward);
4. ZeRO stage up - needs several data-parallel ranks, so it is only *proposed* here;
5. offload - last, and also only proposed.

A rung that does not fit says so and names the next rung. On CUDA, ``device="cuda"`` caps the process with
``torch.cuda.set_per_process_memory_fraction`` instead and reads ``torch.cuda.max_memory_allocated``;
that path cannot run on this CPU-only machine and is untested here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from troubleshooter.repro._common import child_env, html_table, new_figure, run_child

#: The model is sized so that activations dominate: 6 thin layers, long-ish sequences.
MODEL = {"vocab_size": 128, "hidden_size": 64, "num_layers": 6, "num_heads": 4, "num_experts": 4,
         "top_k": 2, "ffn_hidden_size": 128, "max_seq_len": 128}
SEQ_LEN = 128
MICRO_BATCH = 16
#: What the training step may add to the process's address space, in MiB.
BUDGET_MB = 32

#: (rung name, what changes, knowledge-base fix of entry cuda-oom it implements)
OOM_LADDER = (
    ("measure", "no change: the step as it is", "measure-memory"),
    ("micro-batch down, accumulation up", "micro-batch / 2, gradient accumulation x 2", "lower-micro-batch"),
    ("activation checkpointing", "recompute each layer in backward", "activation-checkpointing"),
    ("ZeRO stage up", "partition states over more ranks (needs >= 2 data-parallel ranks)", "raise-zero-stage"),
    ("offload", "optimizer states to host memory, last", "offload-last"),
)


@dataclass(frozen=True)
class Rung:
    """One rung of the ladder, measured twice the same way: without a limit (``needs_mb``: what
    the step really needs, and its loss) and under the limit (``fits``; ``stopped_mb``: the peak
    reached, which for an OOM is where the failed allocation stopped it). ``ran`` False: only
    proposed (ZeRO and offload need several ranks or a GPU)."""

    name: str
    change: str
    micro_batch: int
    accumulation: int
    checkpointing: bool
    ran: bool
    needs_mb: float | None = None
    loss: float | None = None
    fits: bool = False
    oom: bool = False
    error: str | None = None
    stopped_mb: float | None = None
    seconds: float | None = None

    @property
    def batch(self) -> str:
        return f"{self.micro_batch} x {self.accumulation}"


def rung_from_records(name: str, free: dict[str, Any], limited: dict[str, Any]) -> Rung:
    """A :class:`Rung` from the child's two records of the same settings (no limit, limited)."""
    changes = {n: change for n, change, _ in OOM_LADDER}
    if not free.get("ok"):
        raise RuntimeError(f"rung {name!r} failed without a memory limit: {free.get('error')}")
    return Rung(name=name, change=changes.get(name, ""), micro_batch=free["micro_batch"],
                accumulation=free["accumulation"], checkpointing=free["checkpointing"], ran=True,
                needs_mb=round(free["peak_vm_mb"], 1), loss=round(free["loss"], 4), fits=bool(limited["ok"]),
                oom=bool(limited["oom"]), error=limited.get("error"),
                stopped_mb=round(limited["peak_vm_mb"], 1) if limited.get("peak_vm_mb") is not None else None,
                seconds=round(free["seconds"], 2))


@dataclass
class OOMResult:
    """The rungs in order; ``raised``: the baseline really hit the limit; ``fitted``: the first that fits."""

    budget_mb: float
    device: str
    rungs: list[Rung] = field(default_factory=list)

    @property
    def baseline(self) -> Rung:
        return self.rungs[0]

    @property
    def raised(self) -> bool:
        """The unchanged step failed with a real allocation error under the limit."""
        return self.baseline.oom

    @property
    def fitted(self) -> Rung | None:
        return next((r for r in self.rungs if r.ran and r.fits), None)

    def to_dict(self) -> dict[str, Any]:
        return {"budget_mb": self.budget_mb, "device": self.device, "rungs": [asdict(r) for r in self.rungs]}

    def outcome(self, rung: Rung) -> str:
        """What happened to ``rung`` under the limit, pointing at the next rung when it did not fit."""
        fitted = self.fitted
        if not rung.ran:
            return "not needed" if fitted else "not run here"
        if rung.fits:
            return "fits"
        later = self.rungs[self.rungs.index(rung) + 1:]
        nxt = f"; next: {later[0].name}" if later else ""
        return ("out of memory" if rung.oom else f"failed: {rung.error}") + nxt

    HEADER = ["rung", "micro-batch x accumulation", "checkpointing", "needs MiB (no limit)",
              "limit MiB", "under the limit", "loss"]

    def rows(self) -> list[list[Any]]:
        return [[r.name, r.batch, "yes" if r.checkpointing else "no",
                 f"{r.needs_mb:.1f}" if r.needs_mb is not None else "-", f"{self.budget_mb:g}", self.outcome(r),
                 f"{r.loss:.4f}" if r.loss is not None else "-"] for r in self.rungs]

    def summary(self) -> str:
        lines = [f"OOM ladder on {self.device}, step budget {self.budget_mb:g} MiB above the built model:"]
        for row in self.rows():
            lines.append("  " + " | ".join(str(c) for c in row))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        head = f"<b>OOM ladder ({self.device}, budget {self.budget_mb:g} MiB)</b>"
        return head + html_table(self.HEADER, self.rows())

    def figure(self):
        """Bar chart: what each rung that ran needs (no limit), coloured by whether it fits the limit."""
        fig = new_figure()
        ax = fig.add_subplot()
        ran = [r for r in self.rungs if r.ran]
        short = {"measure": "as it is", "micro-batch down, accumulation up": "micro-batch / 2",
                 "activation checkpointing": "+ checkpointing"}
        labels = [f"{short.get(r.name, r.name)}\n{'fits' if r.fits else 'out of memory'}" for r in ran]
        colours = ["#2e7d32" if r.fits else "#c62828" for r in ran]
        bars = ax.bar(range(len(ran)), [r.needs_mb for r in ran], color=colours)
        ax.bar_label(bars, [f"{r.needs_mb:.1f}" for r in ran], fontsize=7)
        ax.axhline(self.budget_mb, color="black", linestyle="--", label=f"limit {self.budget_mb:g} MiB")
        ax.set_xticks(range(len(ran)), labels, fontsize=7)
        ax.set_ylabel("peak of the step, no limit (MiB)")
        ax.set_title("Fix ladder for the out-of-memory step")
        ax.legend()
        return fig


def ladder_settings(micro_batch: int) -> list[tuple[str, int, int, bool]]:
    """(name, micro-batch, accumulation, checkpointing) of the rungs that run here, same global batch."""
    half = max(1, micro_batch // 2)
    acc = micro_batch // half
    return [("measure", micro_batch, 1, False), ("micro-batch down, accumulation up", half, acc, False),
            ("activation checkpointing", half, acc, True)]


def measure_rungs(settings: list[tuple[str, int, int, bool]], *, budget_mb: float = BUDGET_MB, seed: int = 0,
                  device: str = "cpu", timeout: float = 240) -> list[Rung]:
    """Each setting measured twice in one child: without a limit and under ``budget_mb``."""
    specs = []
    for name, micro, acc, ckpt in settings:
        rung = {"name": name, "micro_batch": micro, "accumulation": acc, "checkpointing": ckpt}
        specs += [{**rung, "budget_mb": None}, {**rung, "budget_mb": budget_mb}]
    records = run_rungs(specs, seed=seed, device=device, stop_when_fits=False, timeout=timeout)
    return [rung_from_records(settings[i][0], records[2 * i], records[2 * i + 1]) for i in range(len(settings))]


#: Finished rungs by their full description: a rung is deterministic (same seed, same sizes, same
#: limit), so a notebook or a walkthrough that asks again gets the measured record back at once.
_CACHE: dict[str, dict[str, Any]] = {}


def _key(rung: dict[str, Any], seed: int, device: str, model: dict, seq_len: int) -> str:
    return json.dumps({**rung, "seed": seed, "device": device, "model": model, "seq_len": seq_len}, sort_keys=True)


def run_rungs(rungs: list[dict[str, Any]], *, seed: int = 0, device: str = "cpu", model: dict | None = None,
              seq_len: int = SEQ_LEN, stop_when_fits: bool = True, timeout: float = 240) -> list[dict[str, Any]]:
    """Run the given rungs in one child (one fork each) and return their records, in order.

    With ``stop_when_fits`` the child stops after the first limited rung that fits, and fewer
    records come back. Rungs measured before in this process are not run again.
    """
    model = model or MODEL
    keys = [_key(r, seed, device, model, seq_len) for r in rungs]
    todo = [r for r, k in zip(rungs, keys) if k not in _CACHE]
    if todo:
        spec = {"seed": seed, "device": device, "model": model, "seq_len": seq_len, "rungs": todo,
                "stop_when_fits": stop_when_fits}
        # Fixed malloc behaviour, so the address space used is the same from run to run: one arena,
        # and every allocation above 64 KiB its own mmap (returned to the OS when freed).
        env = child_env(MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536")
        records, _ = run_child(["-m", "troubleshooter.repro._oom_child", json.dumps(spec)], timeout=timeout, env=env)
        for rung, rec in zip(todo, records):
            _CACHE[_key(rung, seed, device, model, seq_len)] = rec
    out = []
    for rung, key in zip(rungs, keys):
        if key not in _CACHE:
            break  # the child stopped early: this rung was not needed
        out.append(_CACHE[key])
        if stop_when_fits and rung.get("budget_mb") is not None and _CACHE[key]["ok"]:
            break
    return out


def oom(*, budget_mb: float = BUDGET_MB, micro_batch: int = MICRO_BATCH, seed: int = 0, device: str = "cpu",
        timeout: float = 240) -> OOMResult:
    """Provoke a real OOM in a training step, then walk the fix ladder; every rung is measured
    without a limit and under it, the same way.

    ``budget_mb`` is what the step may add to the built model's process (CPU: ``RLIMIT_AS``;
    CUDA: a per-process memory fraction, untested here).
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    result = OOMResult(budget_mb=budget_mb, device=device)
    result.rungs = measure_rungs(ladder_settings(micro_batch), budget_mb=budget_mb, seed=seed, device=device,
                                 timeout=timeout)
    last = result.rungs[-1]
    changes = {name: change for name, change, _ in OOM_LADDER}
    for name in ("ZeRO stage up", "offload"):
        result.rungs.append(Rung(name=name, change=changes[name], micro_batch=last.micro_batch,
                                 accumulation=last.accumulation, checkpointing=last.checkpointing, ran=False))
    return result
