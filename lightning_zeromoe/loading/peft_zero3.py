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

peft is not imported for a run that does not use it (its import costs ~25 MB and 1-2 s per rank):
when ``configure_model`` starts and peft's LoRA layer module is not imported yet, the wrapper is
put in place the moment it is (an import hook, :class:`_WhenImported`), so a ``configure_model``
that imports peft itself is covered too.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from contextlib import contextmanager
from functools import wraps
from types import ModuleType
from typing import Any, Callable, Iterator, Sequence

from lightning_zeromoe.loading.import_hooks import spec_without

#: ``init_lora_weights`` values whose initialisation touches only the adapter's own tensors.
_ADAPTER_ONLY_INITS = (True, False, "gaussian")


#: The peft module that defines ``LoraLayer``.
_LORA_LAYER_MODULE = "peft.tuners.lora.layer"


@contextmanager
def peft_init_gathered(active: bool) -> Iterator[None]:
    """While active (ZeRO-3), PEFT's LoRA initialisation runs on gathered parameters. A no-op
    when ``active`` is false or peft is not installed; PEFT's method is put back afterwards.
    peft is not imported here: when it is first imported inside the block, the wrapper is put in
    place then."""
    if not active:
        yield
        return
    patched: list[tuple[type, Any]] = []  # (LoraLayer, PEFT's own reset_lora_parameters)

    def patch(module: ModuleType) -> None:
        layer_class = getattr(module, "LoraLayer", None)
        if layer_class is not None and "reset_lora_parameters" in layer_class.__dict__:
            original = layer_class.__dict__["reset_lora_parameters"]
            layer_class.reset_lora_parameters = _gathered(original)
            patched.append((layer_class, original))

    hook = None
    if _LORA_LAYER_MODULE in sys.modules:
        patch(sys.modules[_LORA_LAYER_MODULE])
    else:
        hook = _WhenImported(_LORA_LAYER_MODULE, patch)
        sys.meta_path.insert(0, hook)
    try:
        yield
    finally:
        if hook is not None:
            sys.meta_path.remove(hook)
        for layer_class, original in patched:
            layer_class.reset_lora_parameters = original


class _WhenImported(importlib.abc.MetaPathFinder):
    """An import hook: runs ``then(module)`` right after the module ``name`` has been executed
    (found by the finders after this one; nothing else about the import changes)."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        spec = spec_without(self, fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute, then = spec.loader.exec_module, self.then

        def execute_then(module: ModuleType) -> None:
            execute(module)
            then(module)

        spec.loader.exec_module = execute_then  # type: ignore[method-assign]  # this spec's own loader
        return spec


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
