"""Loadable models from ZeRO-1/2/3 + AutoEP checkpoints, with the model's own names.

Why this exists (deepspeed 0.19.8, see the field notes, item 6): ``zero_to_fp32`` refuses AutoEP
ZeRO-3 checkpoints, and ``ds_to_universal`` keeps AutoEP's names and layouts (``mlp.router.gate
.weight``, ``mlp.experts.w1/w2/w3``) and drops a tied ``lm_head``.

Two halves:

* **Save time** (:mod:`.save`, called by ``ZeroMoEStrategy.save_checkpoint`` on rank 0):
  :func:`build_meta` describes the trained model as an :class:`ExportMeta`, written as
  ``zeromoe_meta.json`` next to DeepSpeed's ``latest``.
* **Export time** (:mod:`.export`, no model code, no DeepSpeed, no process group):
  :func:`export` streams the shards into a Hugging Face model directory or one file.
  :mod:`.sources` says where each tensor lives, :mod:`.partition` how ZeRO-3 split it,
  :mod:`.plan` what the model's own tensors are, :mod:`.lora` the PEFT adapter and merge.
"""

from lightning_zeromoe.checkpoint.errors import ExportError
from lightning_zeromoe.checkpoint.export import DEFAULT_MAX_SHARD_SIZE, export
from lightning_zeromoe.checkpoint.meta import META_FILE, META_FORMAT, META_VERSION, ExpertBlock, ExportMeta
from lightning_zeromoe.checkpoint.save import build_meta, write_meta

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "META_FILE", "META_FORMAT", "META_VERSION", "ExpertBlock", "ExportError",
           "ExportMeta", "build_meta", "export", "write_meta"]
