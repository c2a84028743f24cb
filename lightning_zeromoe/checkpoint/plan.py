"""The output tensors: the model's own names and shapes, and how each is built from sources.

:func:`plan_outputs` checks the catalog against the meta before anything is read or written:
every tensor the model has is found, nothing in the shards is left undescribed, and every shape
is the one recorded at save time (the expert shapes follow the fused layout recorded then).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from lightning_zeromoe.checkpoint.errors import SHARDS_MISMATCH, ExportError, short_list
from lightning_zeromoe.checkpoint.meta import META_FILE, ExpertBlock, ExportMeta, same_values
from lightning_zeromoe.checkpoint.sources import Catalog, ExpertSource, Reader, Source
from lightning_zeromoe.knowledge import say


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of the exported model: its name, shape, and how to build it (fp32 or the
    training dtype; the writer casts)."""

    name: str
    shape: tuple[int, ...]
    build: Callable[[Reader], Any]


def plan_outputs(catalog: Catalog, meta: ExportMeta) -> list[OutputTensor]:
    problems: list[str] = []
    built: dict[str, Callable[[Reader], Any]] = {}
    used: set[str] = set()
    for ds_name, own in {**meta.params, **meta.buffers}.items():
        if ds_name in catalog.tensors:
            built.setdefault(own, _read(catalog.tensors[ds_name], meta.shapes.get(own)))
            used.add(ds_name)
    for block in meta.experts:
        sources = {}
        for w, ds_name in block.sources.items():
            if ds_name in catalog.tensors:
                sources[w] = catalog.tensors[ds_name]
                used.add(ds_name)
            else:
                problems.append(f"{ds_name} is not in the shards")
        if len(sources) == 3:
            built.update(expert_outputs(block, sources, meta.shapes))
    # Tied groups: DeepSpeed stores one member; every name the model has gets its own copy
    # (safetensors files cannot alias, and load_state_dict(strict=True) wants every name).
    for group in meta.tied:
        present = [n for n in group if n in built]
        if not present:
            problems.append(f"tied group {group}: no member is in the shards")
        for n in group:
            built.setdefault(n, built[present[0]] if present else None)
    outside = set(meta.outside_prefix)
    described = set(meta.params) | set(meta.buffers)
    leftovers = [n for n in catalog.tensors if n not in used and n not in outside and n not in described]
    if leftovers:
        problems.append(f"the shards hold parameters {short_list(leftovers)} that {META_FILE} does not describe")
    missing = [n for n in meta.shapes if n not in built]
    if missing:
        problems.append(f"missing from the shards: {short_list(missing)}")
    if problems:
        raise ExportError(say(SHARDS_MISMATCH, "plan", "export-as-written", meta_file=META_FILE,
                              problems='; '.join(problems)))
    return [OutputTensor(name, tuple(meta.shapes[name]), build) for name, build in built.items()]


def check_shape(out: OutputTensor, tensor: Any) -> None:
    """The tensor read must have the shape recorded at save time."""
    if tuple(tensor.shape) != out.shape:
        raise ExportError(say(SHARDS_MISMATCH, "shape", "export-as-written", name=out.name,
                              read=list(tensor.shape), meta_file=META_FILE, recorded=list(out.shape)))


def expert_outputs(block: ExpertBlock, sources: dict[str, Source],
                   shapes: dict[str, list[int]] | None = None) -> dict[str, Callable[[Reader], Any]]:
    """The model's own expert tensors from AutoEP's ``w1``/``w3`` (``[E, ffn, hidden]``, gate and
    up) and ``w2`` (``[E, hidden, ffn]``), in the layout the model used. The fused tensor is
    allocated once and each half written into its place (no concatenation copy)."""
    import torch

    t = block.targets
    w1, w2, w3 = sources["w1"], sources["w2"], sources["w3"]
    if block.layout == "per_expert":
        return per_expert_outputs(block, sources)
    if block.layout == "separate":
        return {t["gate"]: _read(w1), t["up"]: _read(w3), t["down"]: _read(w2)}
    if block.layout == "flattened":  # DBRX's [E * ffn, hidden]: gate and up reshaped, down transposed per expert
        return {t["gate"]: _flattened(w1), t["up"]: _flattened(w3), t["down"]: _flattened(w2, down=True)}

    def fused(reader: Reader) -> Any:
        gate = reader.read(w1) if not isinstance(w1, ExpertSource) else None
        if gate is not None:  # not expert-parallel pieces: plain tensors
            up = reader.read(w3)
            halves = (gate, up) if block.layout == "gate_up_first" else (gate.transpose(1, 2), up.transpose(1, 2))
            return torch.cat(halves, dim=1 if block.layout == "gate_up_first" else 2)
        shape = (shapes or {}).get(t["gate_up"])
        if shape is None:
            raise ExportError(say(SHARDS_MISMATCH, "no-fused-shape", name=t['gate_up'], meta_file=META_FILE))
        out = torch.empty(tuple(shape), dtype=torch.float32)
        ffn = shape[1] // 2 if block.layout == "gate_up_first" else shape[2] // 2
        if block.layout == "gate_up_first":
            reader.fill(w1, out[:, :ffn])
            reader.fill(w3, out[:, ffn:])
        else:  # hidden_first: AutoEP transposed [E, hidden, 2*ffn] halves into [E, ffn, hidden]; undo it
            reader.fill(w1, out[:, :, :ffn].transpose(1, 2))
            reader.fill(w3, out[:, :, ffn:].transpose(1, 2))
        return out

    down = _read(w2) if block.layout == "gate_up_first" else (lambda r: r.read(w2).transpose(1, 2))
    return {t["gate_up"]: fused, t["down"]: down}


def _flattened(source: Source, down: bool = False) -> Callable[[Reader], Any]:
    """AutoEP's ``[E, ffn, hidden]`` (gate, up) or ``[E, hidden, ffn]`` (down) as the model's ``[E * ffn, hidden]``."""
    def build(reader: Reader) -> Any:
        tensor = reader.read(source)
        tensor = tensor.transpose(1, 2) if down else tensor
        return tensor.reshape(-1, tensor.shape[-1])
    return build


def per_expert_outputs(block: ExpertBlock, sources: dict[str, Source]) -> dict[str, Callable[[Reader], Any]]:
    """Each expert's own Linear weights (``experts.{i}.gate_proj.weight`` ...) from AutoEP's ``[E, ...]``
    tensors, one expert at a time; a Linear packing gate and up gets ``cat([gate_i, up_i])``."""
    import torch

    t = block.targets
    one = lambda src, i: (lambda reader: reader.read_expert(src, i))  # noqa: E731
    out: dict[str, Callable[[Reader], Any]] = {}
    for part, source in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
        if part in t:
            out.update({t[part].format(i=i): one(sources[source], i) for i in range(block.num_experts)})
    if "gate_up" in t:
        for i in range(block.num_experts):
            out[t["gate_up"].format(i=i)] = (lambda reader, i=i: torch.cat(
                [reader.read_expert(sources["w1"], i), reader.read_expert(sources["w3"], i)], dim=0))
    return out


def _read(source: Source, shape: list[int] | None = None) -> Callable[[Reader], Any]:
    """Read ``source``; with ``shape`` (the model's own, recorded at save), a tensor that differs from it
    only by size-1 dimensions (ERNIE's ``[1, E]`` bias, held as ``[E]`` by AutoEP) is reshaped to it."""
    def read(reader: Reader) -> Any:
        tensor = reader.read(source)
        if shape is not None and same_values(list(tensor.shape), list(shape)):
            return tensor.reshape(shape)
        return tensor
    return read
