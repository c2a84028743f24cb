"""``oom()``: a real out-of-memory error on the tiny MoE, then the fix ladder until it fits.

On CPU (this machine) the training step runs in a child process whose address space is limited
with ``resource.setrlimit(RLIMIT_AS)`` (field notes item 9): the kernel refuses the allocation,
and torch's ``DefaultCPUAllocator`` raises ``RuntimeError: ... can't allocate memory`` (or
``std::bad_alloc`` from a C++ container) exactly as on a machine that is really full. The limit is
``budget_mb`` above what the process holds once the model is built (see ``_oom_child``), and the
peak reported per rung is the address-space growth (``VmPeak``) that the limit is compared with.

The ladder is the order the knowledge base gives for OOM (entry ``cuda-oom``, fix steps in order):

1. measure - the same step without a limit, to know how much it needs;
2. micro-batch down, gradient accumulation up (same global batch);
3. activation checkpointing (keep layer inputs, recompute the rest in backward);
4. ZeRO stage up - needs several data-parallel ranks, so it is only *proposed* here;
5. offload - last, and also only proposed.

The walk stops at the first rung that fits. On CUDA, ``device="cuda"`` caps the process with
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

#: (rung name, what changes, knowledge-base fix step of entry cuda-oom it implements)
OOM_LADDER = (
    ("measure", "no change: measure the step without a limit", 0),
    ("micro-batch down, accumulation up", "micro-batch / 2, gradient accumulation x 2", 2),
    ("activation checkpointing", "recompute each layer in backward", 3),
    ("ZeRO stage up", "partition states over more ranks (needs >= 2 data-parallel ranks)", 4),
    ("offload", "optimizer states to host memory, last", 5),
)


@dataclass(frozen=True)
class Rung:
    """One rung of the ladder as it ran (or was only proposed: ``ran`` False)."""

    name: str
    change: str
    micro_batch: int
    accumulation: int
    checkpointing: bool
    limited: bool
    ran: bool
    ok: bool = False
    oom: bool = False
    error: str | None = None
    peak_vm_mb: float | None = None
    peak_rss_mb: float | None = None
    seconds: float | None = None
    loss: float | None = None


@dataclass
class OOMResult:
    """The rungs in order; ``raised`` says the baseline really hit the limit, ``fitted`` where it fit."""

    budget_mb: float
    device: str
    rungs: list[Rung] = field(default_factory=list)

    @property
    def baseline(self) -> Rung:
        return next(r for r in self.rungs if r.name == "measure")

    @property
    def raised(self) -> bool:
        """The unchanged step failed with a real allocation error under the limit."""
        return any(r.limited and r.name == "measure" and r.oom for r in self.rungs)

    @property
    def fitted(self) -> Rung | None:
        return next((r for r in self.rungs if r.limited and r.ok), None)

    def to_dict(self) -> dict[str, Any]:
        return {"budget_mb": self.budget_mb, "device": self.device, "rungs": [asdict(r) for r in self.rungs]}

    def rows(self) -> list[list[Any]]:
        rows = []
        for r in self.rungs:
            if not r.ran:
                outcome = "not needed" if self.fitted else "not run here"
            elif not r.limited:
                outcome = "measured (no limit)"
            else:
                outcome = "fits" if r.ok else ("OUT OF MEMORY" if r.oom else f"failed: {r.error}")
            peak = f"{r.peak_vm_mb:.1f}" if r.peak_vm_mb is not None else "-"
            rows.append([r.name, f"{r.micro_batch} x {r.accumulation}", "yes" if r.checkpointing else "no",
                         f"{self.budget_mb:g}" if r.limited else "none", peak, outcome])
        return rows

    HEADER = ["rung", "micro-batch x accumulation", "checkpointing", "limit MiB", "peak MiB", "outcome"]

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
        """Bar chart: measured peak per rung that ran, with the limit as a line."""
        fig = new_figure()
        ax = fig.add_subplot()
        ran = [r for r in self.rungs if r.ran and r.peak_vm_mb is not None]
        short = {"measure": "baseline", "micro-batch down, accumulation up": "micro-batch / 2",
                 "activation checkpointing": "+ checkpointing"}
        labels = [f"{short.get(r.name, r.name)}\n{'no limit' if not r.limited else ('fits' if r.ok else 'OOM')}"
                  for r in ran]
        colours = ["#9e9e9e" if not r.limited else ("#2e7d32" if r.ok else "#c62828") for r in ran]
        ax.bar(range(len(ran)), [r.peak_vm_mb for r in ran], color=colours)
        ax.axhline(self.budget_mb, color="black", linestyle="--", label=f"limit {self.budget_mb:g} MiB")
        ax.set_xticks(range(len(ran)), labels, fontsize=7)
        ax.set_ylabel("peak address-space growth (MiB)")
        ax.text(0.99, 0.6, "an OOM bar stops at the limit:\nthe allocation that failed", transform=ax.transAxes,
                ha="right", fontsize=7)
        ax.set_title("Fix ladder for the out-of-memory step")
        ax.legend()
        return fig


def _spec_rungs(micro_batch: int, budget_mb: float) -> list[dict[str, Any]]:
    half = max(1, micro_batch // 2)
    acc = micro_batch // half
    return [
        {"name": "measure", "micro_batch": micro_batch, "accumulation": 1, "checkpointing": False, "budget_mb": None},
        {"name": "measure", "micro_batch": micro_batch, "accumulation": 1, "checkpointing": False,
         "budget_mb": budget_mb},
        {"name": "micro-batch down, accumulation up", "micro_batch": half, "accumulation": acc,
         "checkpointing": False, "budget_mb": budget_mb},
        {"name": "activation checkpointing", "micro_batch": half, "accumulation": acc, "checkpointing": True,
         "budget_mb": budget_mb},
    ]


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
    """Provoke a real OOM in a training step, then walk the fix ladder until the step fits.

    ``budget_mb`` is what the step may add to the built model's process (CPU: ``RLIMIT_AS``;
    CUDA: a per-process memory fraction, untested here). Returns every rung with its measured peak.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    records = run_rungs(_spec_rungs(micro_batch, budget_mb), seed=seed, device=device, timeout=timeout)
    result = OOMResult(budget_mb=budget_mb, device=device)
    changes = {name: change for name, change, _ in OOM_LADDER}
    for rec in records:
        result.rungs.append(Rung(
            name=rec["name"], change=changes[rec["name"]], micro_batch=rec["micro_batch"],
            accumulation=rec["accumulation"], checkpointing=rec["checkpointing"],
            limited=rec["budget_mb"] is not None, ran=True, ok=rec["ok"], oom=rec["oom"], error=rec.get("error"),
            peak_vm_mb=rec.get("peak_vm_mb"), peak_rss_mb=rec.get("peak_rss_mb"), seconds=rec.get("seconds"),
            loss=rec.get("loss")))
    last = result.rungs[-1]
    for name, change, _ in OOM_LADDER[3:]:
        result.rungs.append(Rung(name=name, change=change, micro_batch=last.micro_batch,
                                 accumulation=last.accumulation, checkpointing=last.checkpointing,
                                 limited=True, ran=False))
    return result
