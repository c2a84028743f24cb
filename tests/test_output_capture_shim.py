"""AutoEP's round trip through transformers' output-capture registry, on the installed versions.

DeepSpeed 0.19.8's AutoEP, while it converts a block, saves each model class's registry entry
with ``registry.get(key, default)``, installs the output-capture hooks from a retargeted entry, and
writes the saved entry back with ``registry[key] = entry``. transformers 5.23 made the registry a
class whose ``get`` and ``[...] =`` take a model, not a key (TypeError; a restore under the key
``"<class 'str'>"``). ``ZeroMoEStrategy`` runs ``deepspeed.initialize`` inside
``autoep_output_capture_shim()``. Here DeepSpeed's own function runs on transformers' own registry
and a real tiny Mixtral, under the shim: the hooks record what the retargeted entry says, and
afterwards the registry holds exactly what it held before. The 2-rank training run at parity is
``tests/test_hf_coverage.py`` (every family, AutoEP + ZeRO-3, on whichever transformers is installed).
"""

from __future__ import annotations

import pytest
import torch

from lightning_zeromoe._private import deepspeed as ds_private
from lightning_zeromoe._private import transformers as hf_private


@pytest.fixture(scope="module")
def mixtral() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=32, use_cache=False)
    return MixtralForCausalLM(config).eval()


def _autoep_round_trip(model: torch.nn.Module, entry: dict) -> None:
    """What AutoEP does for one retargeted model class (deepspeed's own function, real registry and hooks)."""
    from deepspeed.module_inject.auto_ep_presets import base
    from transformers.utils import output_capturing

    from lightning_zeromoe._private.torch import remove_hooks_defined_in

    install = getattr(base, "_install_instance_transformers_output_recorders")
    install(model, {str(type(model)): entry}, output_capturing,
            lambda m: remove_hooks_defined_in(m, "transformers"))


def _snapshot(registry: dict) -> dict:
    return {key: value for key, value in dict.items(registry)}


def test_the_probe_predicts_what_autoep_does_to_the_real_registry(mixtral):
    """Without the shim: the probe on a scratch registry says AutoEP fails exactly when DeepSpeed's
    round trip on transformers' registry raises or leaves it changed."""
    registry = hf_private.output_capture_registry()
    assert registry is not None
    before = _snapshot(registry)
    entry = dict(hf_private.recorded_outputs(mixtral.model))
    try:
        _autoep_round_trip(mixtral.model, entry)
        broken = _snapshot(registry) != before
    except TypeError:
        broken = True
    finally:
        registry.clear()
        registry.update(before)
    assert ds_private.autoep_mishandles_registry(type(registry)) == broken
    # transformers <= 5.22 keys a plain dict by str(cls): nothing to fix there
    assert hf_private.registry_is_key_addressed(registry) == (type(registry) is dict)


def test_under_the_shim_autoep_retargets_the_hooks_and_restores_the_registry(mixtral):
    from transformers.utils.output_capturing import OutputRecorder

    registry = hf_private.output_capture_registry()
    before = _snapshot(registry)
    inner = mixtral.model
    key = str(type(inner))
    assert isinstance(before.get(key), dict) and "router_logits" in before[key]
    # Retarget router_logits to the decoder layers' input norm: [batch, seq, hidden], not [tokens, experts].
    norm_class = type(inner.layers[0].input_layernorm)
    retargeted = dict(before[key], router_logits=OutputRecorder(target_class=norm_class, index=0))
    original_class = type(registry)
    with ds_private.autoep_output_capture_shim():
        _autoep_round_trip(inner, retargeted)
    assert type(registry) is original_class
    after = _snapshot(registry)
    assert after == before and after[key] is before[key], sorted(set(after) ^ set(before))
    assert "<class 'str'>" not in after
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        out = inner(input_ids=ids, output_router_logits=True)
    norms = sum(isinstance(m, norm_class) for m in inner.modules())  # 2 per layer and the final one
    shapes = {tuple(t.shape) for t in out.router_logits}
    assert len(out.router_logits) == norms == 5 and shapes == {(2, 5, 32)}, shapes


def test_the_shim_reads_and_writes_by_key_and_keeps_transformers_meaning(mixtral):
    registry = hf_private.output_capture_registry()
    before = _snapshot(registry)
    key, missing = str(type(mixtral)), object()
    by_model = not hf_private.registry_is_key_addressed(registry)  # transformers >= 5.23
    with hf_private.key_tolerant_registry(registry):
        assert registry.get(key, missing) is before[key]
        assert registry.get("<class 'nowhere.Model'>", missing) is missing
        assert registry.get("<class 'nowhere.Model'>") is None
        registry[key] = {"router_logits": "mine"}
        assert dict.get(registry, key) == {"router_logits": "mine"} and "<class 'str'>" not in registry
        if by_model:  # a model still means its class's entry, as transformers reads and writes it
            assert registry.get(mixtral) == {"router_logits": "mine"}
            registry[mixtral] = before[key]
            assert dict.get(registry, key) is before[key]
        registry[key] = before[key]
    assert _snapshot(registry) == before
    assert hf_private.registry_is_key_addressed(registry) == (type(registry) is dict)
