"""PEFT's LoRA initialisation inside ``configure_model`` under ZeRO-3 ``zero.Init``.

``get_peft_model`` called in ``configure_model`` (after ``from_pretrained``) builds each LoRA
layer's ``lora_A``/``lora_B`` as ``nn.Linear`` modules while ``zero.Init`` is active, so their
parameters are partitioned as soon as they are constructed. PEFT then initialises them
(``LoraLayer.reset_lora_parameters``: ``lora_A`` Kaiming-uniform, ``lora_B`` zeros) in place, on
tensors that now hold zero elements: a no-op (torch warns "Initializing zero-element tensors is a
no-op"). ``lora_B`` keeps ``nn.Linear``'s random initialisation, so training starts from a model
that is *not* the pretrained one (measured on the tiny Mixtral of ``tests/jobs/lora_ep_job.py``,
run ``P``: ``|lora_B|`` up to 0.5 instead of 0, first loss off by 5e-4 relative, 7e-3 by step 4).

:func:`peft_init_gathered` wraps ``reset_lora_parameters`` for the time ``configure_model`` runs:
when the layer's adapter parameters are partitioned, PEFT's own initialisation runs on them
gathered (``deepspeed.zero.GatheredParameters``, rank 0 modifies, the result is broadcast), at the
same point of PEFT's code and so with the same random draws as without ZeRO-3. The base layer's
weight is gathered too only for initialisations that read it (PiSSA, OLoRA, LoftQ, ...).

LoRA variants (DoRA, ...) initialise from the base weights after that, in code not gathered for:
an adapter with a variant whose layer is partitioned is refused (``[peft-variant-zero-init]``).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import wraps
from typing import Any, Callable, Iterator

#: ``init_lora_weights`` values whose initialisation touches only the adapter's own tensors.
_ADAPTER_ONLY_INITS = (True, False, "gaussian")


@contextmanager
def peft_init_gathered(active: bool) -> Iterator[None]:
    """While active (ZeRO-3), PEFT's LoRA initialisation runs on gathered parameters. A no-op
    when ``active`` is false or peft is not installed; PEFT's method is put back afterwards."""
    layer_class = _lora_layer_class() if active else None
    if layer_class is None:
        yield
        return
    original = layer_class.__dict__["reset_lora_parameters"]
    layer_class.reset_lora_parameters = _gathered(original)
    try:
        yield
    finally:
        layer_class.reset_lora_parameters = original


def _lora_layer_class() -> type | None:
    try:
        from peft.tuners.lora.layer import LoraLayer
    except ImportError:
        return None
    return LoraLayer if "reset_lora_parameters" in LoraLayer.__dict__ else None


def _gathered(reset: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(reset)
    def reset_gathered(self: Any, adapter_name: str, init_lora_weights: Any, *args: Any, **kwargs: Any) -> Any:
        own = [(n, p) for n, p in self.named_parameters() if hasattr(p, "ds_id")]
        variant = getattr(self, "lora_variant", {}).get(adapter_name)
        if own and variant is not None:
            from lightning_zeromoe.knowledge import say

            raise ValueError(say("peft-variant-zero-init", "variant", "wrap-before-training", adapter=adapter_name,
                                 layer=f"{type(self).__module__}.{type(self).__qualname__}",
                                 variant=type(variant).__name__))
        if init_lora_weights in _ADAPTER_ONLY_INITS:
            own = [(n, p) for n, p in own if not n.startswith("base_layer.")]
        if not own:
            return reset(self, adapter_name, init_lora_weights, *args, **kwargs)
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=0):
            return reset(self, adapter_name, init_lora_weights, *args, **kwargs)

    return reset_gathered


__all__ = ["peft_init_gathered"]
