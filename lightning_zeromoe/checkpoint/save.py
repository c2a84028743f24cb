"""Save time: describe the trained model for export, while it is still in memory (rank 0).

For every tensor DeepSpeed stores, :func:`build_meta` records the name the *user's* model gives
it (AutoEP router ``<block>.router.gate.weight`` -> ``<block>.gate.weight``; AutoEP experts
``w1``/``w3``/``w2`` -> the fused ``gate_up_proj``/``down_proj`` or separate tensors they were
repacked from, or each expert's own Linear weights ``experts.{i}.gate_proj.weight`` for a block
whose experts are a module list), the fused layout those came in, the LightningModule prefix to strip, tied
groups, persistent buffers, frozen parameters, PEFT LoRA adapters, the training dtype and the
model's config. The block's own names and fused layout come from discovery when the strategy
passes its ``BlockLayout``s (``blocks``); otherwise the names come from the AutoEP section and
the layout from the user's architecture, rebuilt on the meta device (no memory, no data).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from lightning_zeromoe.config.schema import DeepSpeedConfig
from lightning_zeromoe.checkpoint.autoep_names import FLAT, BlockNames, block_names, names_for, own_name
from lightning_zeromoe.checkpoint.lora import param_wrappers
from lightning_zeromoe.checkpoint.meta import META_FILE, ExpertBlock, ExportMeta, LoraAdapter, ModelInfo, same_values
from lightning_zeromoe._private import deepspeed as ds_private
from lightning_zeromoe._private import torch as torch_private
from lightning_zeromoe._private import transformers as hf_private

__all__ = ["META_FILE", "build_meta", "write_meta", "expert_layout"]


def build_meta(module: Any, ds_config: DeepSpeedConfig, *, world_size: int, tag: str = "checkpoint",
               blocks: Mapping[str, Any] | None = None) -> ExportMeta:
    """Describe ``module`` (the LightningModule, after AutoEP conversion) for export.

    Names are those DeepSpeed uses in its shard files: ``module.named_parameters()`` of the
    engine's module, i.e. relative to the LightningModule. ``blocks`` maps an AutoEP layer's path
    (``model.layers.0.mlp``) to discovery's ``BlockLayout`` of the block it replaced, when the
    caller has it: the block's own names (a nested router, shared experts) and fused layout.
    Without it, the names come from the AutoEP section and the layout from the rebuilt model.
    """
    ep_section = ds_config.expert_parallel_dict()  # AutoEP's own key names, read by block_names
    prefix, root = _export_root(module)
    lora = _lora_adapters(root)
    if lora:  # export the base model inside PeftModel; adapters are written apart
        prefix, root = prefix + lora[0].peft_prefix, root.base_model.model
    layers = {name: m for name, m in module.named_modules() if ds_private.is_autoep_layer(m)}
    section = block_names(ep_section) if layers else BlockNames()
    names = {path: names_for(path, section, blocks) for path in layers}
    reference = _reference_shapes(root)

    def own(name: str) -> str | None:
        return name[len(prefix):] if name.startswith(prefix) else None

    param_map: dict[str, str] = {}  # DeepSpeed name -> DeepSpeed-rooted own name (1:1 tensors)
    experts: list[ExpertBlock] = []
    unsupported: list[str] = []
    alias_ids: set[int] = set()
    for path, layer in layers.items():
        canonical = dict(layer.named_parameters(remove_duplicate=True))
        seen = {id(p) for p in canonical.values()}
        for local_name, p in layer.named_parameters(remove_duplicate=False):
            if local_name not in canonical and id(p) in seen:
                alias_ids.add(id(p))  # AutoEP aliases the router (e.g. as "gate") for HF's recorders
        given = blocks[path].layout if blocks and path in blocks else None
        entry = _expert_block(path, layer, names[path], own, reference, given)
        (unsupported if isinstance(entry, str) else experts).append(entry)
        for local_name in canonical:
            if local_name.startswith("experts."):
                continue
            mapped = own_name(local_name, names[path])
            if mapped is None:
                unsupported.append(f"{path}.{local_name}: AutoEP parameter with no known source in the original block")
            else:
                param_map[f"{path}.{local_name}"] = f"{path}.{mapped}"

    inside = lambda n: any(n == p or n.startswith(p + ".") for p in layers)  # noqa: E731
    shapes: dict[str, list[int]] = {}
    ids: dict[int, list[str]] = {}
    frozen: list[str] = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if inside(name) and id(p) in alias_ids and name not in param_map and ".experts." not in name:
            continue
        ids.setdefault(id(p), []).append(name)
        if not inside(name):
            param_map[name] = name
        if name in param_map:
            shapes[param_map[name]] = list(getattr(p, "ds_shape", p.shape))
            if not p.requires_grad:
                frozen.append(param_map[name])
    buffers: dict[str, str] = {}
    for name, b in _persistent_buffers(module):
        target = name
        if inside(name):
            path = next(p for p in layers if name.startswith(p + "."))
            mapped = own_name(name[len(path) + 1:], names[path])
            if mapped is None:
                unsupported.append(f"{name}: persistent buffer inside an AutoEP layer (not in the original block)")
                continue
            target = f"{path}.{mapped}"
        buffers[name] = target
        shapes[target] = list(b.shape)
    for block in experts:
        targets = _target_shapes(block, layers[block.module_path])
        shapes.update(targets)
        if not any(getattr(layers[block.module_path].experts, w).requires_grad for w in ("w1", "w2", "w3")):
            frozen += list(targets)  # frozen experts (LoRA): saved beside the shards, checkpoint/frozen_experts.py

    tied = []
    for names in ids.values():
        mapped = [m for m in (own(param_map[n]) for n in names if n in param_map) if m is not None]
        if len(mapped) > 1:
            tied.append(mapped)
    own_shapes = {own(n): s for n, s in shapes.items() if own(n) is not None}
    if reference is not None:  # a tensor AutoEP holds without the model's singleton dims (ERNIE's [1, E] bias)
        own_shapes.update({n: reference[n] for n, s in own_shapes.items() if n in reference and same_values(s, reference[n])})
    if reference is not None and not lora:
        wrong = [f"{n} {s} (model has {reference[n]})" for n, s in own_shapes.items() if n in reference and reference[n] != s]
        unsupported += [f"recorded shape differs from the model's own: {w}" for w in wrong]
    float_dtypes = [p.dtype for p in module.parameters() if p.is_floating_point()]
    return ExportMeta(
        tag=tag, world_size=int(world_size),
        ep_size=ds_config.autoep_size,
        prefix=prefix, dtype=str(float_dtypes[0]).replace("torch.", "") if float_dtypes else "float32",
        params={ds: own(o) for ds, o in param_map.items() if own(o) is not None},
        buffers={ds: own(o) for ds, o in buffers.items() if own(o) is not None},
        experts=[_own_targets(b, own) for b in experts], tied=tied, shapes=own_shapes,
        frozen=sorted(o for o in (own(n) for n in frozen) if o is not None),
        outside_prefix=sorted(n for n in list(param_map.values()) + list(buffers.values()) if own(n) is None),
        unsupported=unsupported, model=_model_info(root), lora=lora,
        zero_stage=ds_config.stage, versions=_versions())


def write_meta(meta: ExportMeta, ckpt_dir: str | os.PathLike) -> Path:
    """Write ``zeromoe_meta.json`` into the checkpoint directory (atomically)."""
    path = Path(ckpt_dir) / META_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(meta.to_json())
    os.replace(tmp, path)
    return path


def expert_layout(w1_shape: Iterable[int], w2_shape: Iterable[int]) -> str | None:
    """``gate_up_first`` / ``hidden_first`` for a fused gate+up tensor and its down tensor, as
    AutoEP's repack decides it (``deepspeed.moe.fused_expert_layout``), or None if neither fits."""
    from deepspeed.moe.fused_expert_layout import classify_fused_gate_up_layout

    found = classify_fused_gate_up_layout(tuple(w1_shape), tuple(w2_shape))
    return found.layout if found is not None else None


def _export_root(module: Any) -> tuple[str, Any]:
    """The LightningModule path of the model users load (an HF model or a self-described one),
    with a trailing dot, and that module; ``("", module)`` exports the whole LightningModule."""
    for name, m in module.named_modules():
        config = getattr(m, "config", None)
        if name and (hasattr(config, "model_type") and hasattr(config, "to_dict")
                     or isinstance(getattr(type(m), "autoep_pattern", None), dict)):
            return name + ".", m
    return "", module


def _lora_adapters(root: Any) -> list[LoraAdapter]:
    """PEFT LoRA adapters of a ``PeftModel`` root (checked by attribute, no peft import)."""
    peft_config = getattr(root, "peft_config", None)
    if not isinstance(peft_config, dict) or not hasattr(root, "base_model"):
        return []
    out = []
    for name, cfg in peft_config.items():
        data = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
        out.append(LoraAdapter(name=name, config=json.loads(json.dumps(data, default=_jsonable)),
                               param_wrappers=param_wrappers(root.base_model.model)))
    return out


def _jsonable(value: Any) -> Any:
    return sorted(value) if isinstance(value, (set, frozenset)) else str(value)


def _reference_shapes(root: Any) -> dict[str, list[int]] | None:
    """Own name -> shape of every state-dict tensor of ``type(root)(root.config)``, built on the
    meta device: the user's architecture as it was before AutoEP replaced its blocks."""
    import torch

    config = getattr(root, "config", None)
    if config is None:
        return None
    try:
        with torch.device("meta"):
            fresh = type(root)(config)
        return {n: list(t.shape) for n, t in fresh.state_dict().items()}
    except Exception:  # noqa: BLE001 - an architecture we cannot rebuild: fall back to the pattern contract
        return None


def _expert_block(path: str, layer: Any, src: BlockNames, own: Any, reference: dict[str, list[int]] | None,
                  given: str | None) -> ExpertBlock | str:
    exp = f"{path}.{src.experts}"
    sources = {w: f"{path}.experts.{w}" for w in ("w1", "w2", "w3")}
    common = dict(module_path=path, num_experts=int(layer.num_experts), num_local_experts=int(layer.num_local_experts),
                  ep_size=int(layer.ep_size), sources=sources)
    if src.storage == "module_list":  # one module per expert: experts.{i}.gate_proj.weight (templates in {i})
        per = {"down": f"{exp}.{{i}}.{src.w2}.weight"}
        per.update({"gate": f"{exp}.{{i}}.{src.w1}.weight", "up": f"{exp}.{{i}}.{src.w3}.weight"} if src.w3 is not None
                   else {"gate_up": f"{exp}.{{i}}.{src.w1}.weight"})
        return ExpertBlock(**common, layout="per_expert", layout_source="model", targets=per)
    if src.storage == FLAT:  # DBRX: gate, up, down each [E * ffn, hidden] (down transposed per expert)
        return ExpertBlock(**common, layout="flattened", layout_source="model",
                           targets={"gate": f"{exp}.{src.w1}", "up": f"{exp}.{src.w3}", "down": f"{exp}.{src.w2}"})
    if src.storage != "fused_3d":
        return (f"{path}: experts stored as {src.storage!r}; export supports fused 3-D expert tensors, "
                "per-expert module lists and flattened 2-D ones")
    if src.w3 is not None:
        return ExpertBlock(**common, layout="separate", layout_source="pattern",
                           targets={"gate": f"{exp}.{src.w1}", "up": f"{exp}.{src.w3}", "down": f"{exp}.{src.w2}"})
    targets = {"gate_up": f"{exp}.{src.w1}", "down": f"{exp}.{src.w2}"}
    if given is not None:
        layout, source = given, "model"  # discovery read it from the model's own tensors
    else:
        gate_up, down = (own(targets["gate_up"]), own(targets["down"]))
        found = (expert_layout(reference[gate_up], reference[down])
                 if reference is not None and gate_up in reference and down in reference else None)
        # Without a rebuilt model, MoEPattern / autoep_pattern promise gate_up_first (discovery.py).
        layout, source = (found, "model") if found else ("gate_up_first", "pattern")
    return ExpertBlock(**common, layout=layout, layout_source=source, targets=targets)


def _target_shapes(block: ExpertBlock, layer: Any) -> dict[str, list[int]]:
    """Full shapes of the model's own expert tensors, from AutoEP's ``w1 [E_local, ffn, hidden]``."""
    w1 = list(getattr(layer.experts.w1, "ds_shape", layer.experts.w1.shape))
    e, ffn, hidden = block.num_experts, w1[1], w1[2]
    t = block.targets
    if block.layout == "gate_up_first":
        return {t["gate_up"]: [e, 2 * ffn, hidden], t["down"]: [e, hidden, ffn]}
    if block.layout == "hidden_first":
        return {t["gate_up"]: [e, hidden, 2 * ffn], t["down"]: [e, ffn, hidden]}
    if block.layout == "flattened":
        return {t[part]: [e * ffn, hidden] for part in ("gate", "up", "down")}
    if block.layout == "per_expert":
        per = {"gate": [ffn, hidden], "up": [ffn, hidden], "gate_up": [2 * ffn, hidden], "down": [hidden, ffn]}
        return {template.format(i=i): per[part] for part, template in t.items() for i in range(e)}
    return {t["gate"]: [e, ffn, hidden], t["up"]: [e, ffn, hidden], t["down"]: [e, hidden, ffn]}


def _own_targets(block: ExpertBlock, own: Any) -> ExpertBlock:
    return ExpertBlock(**{**asdict(block), "targets": {k: own(v) for k, v in block.targets.items()}})


def _persistent_buffers(module: Any) -> Iterable[tuple[str, Any]]:
    for mod_name, mod in module.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in torch_private.non_persistent_buffers(mod):
                yield (f"{mod_name}.{name}" if mod_name else name), buf


def _model_info(root: Any) -> ModelInfo:
    cls = type(root)
    info = ModelInfo(class_name=f"{cls.__module__}.{cls.__qualname__}")
    config = getattr(root, "config", None)
    try:
        if hasattr(config, "to_dict") and hasattr(config, "model_type"):
            data = json.loads(json.dumps(config.to_dict(), default=str))
            if not data.get("architectures"):
                data["architectures"] = [cls.__name__]
            info.config, info.config_kind = data, "transformers"
            info.name_or_path = hf_private.name_or_path(config) or None
            generation = getattr(root, "generation_config", None)
            if generation is not None and hasattr(generation, "to_diff_dict"):
                info.generation_config = json.loads(json.dumps(generation.to_diff_dict(), default=str))
        elif is_dataclass(config) and not isinstance(config, type):
            info.config, info.config_kind = json.loads(json.dumps(asdict(config), default=str)), "dataclass"
    except (TypeError, ValueError):  # an unserialisable config is only informational
        pass
    return info


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist_name in ("deepspeed", "torch", "lightning", "transformers", "peft", "lightning-zeromoe"):
        try:
            out[dist_name] = version(dist_name)
        except PackageNotFoundError:
            pass
    return out
