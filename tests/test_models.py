"""The reference model's invariants that the distributed tests rely on."""

from __future__ import annotations

import torch

from lightning_zeromoe.reference.models import TinyMoEConfig, TinyMoELM, lm_losses


def test_experts_module_runs_once_per_forward_whatever_the_routing():
    """ZeRO-3 gathers a module's parameters on each call: a call per expert that got tokens would
    give ranks with different routing different numbers of all-gathers, and hang them."""
    torch.manual_seed(0)
    model = TinyMoELM(TinyMoEConfig(num_layers=1, num_experts=4, top_k=1))
    gate = model.layers[0].mlp.gate.weight
    with torch.no_grad():  # logits (a, -a, 0, 0): every token picks expert 0 or 1, never 2 or 3
        gate[1] = -gate[0]
        gate[2:] = 0.0
    calls = []
    model.layers[0].mlp.experts.register_forward_hook(lambda *_: calls.append(1))
    model(torch.randint(0, 128, (2, 16)))
    assert model.layers[0].mlp.tokens_per_expert[2:].sum() == 0, "the routing did not leave experts idle"
    assert len(calls) == 1


def test_losses_of_a_batch_are_the_mean_of_its_halves():
    """Per-sequence task and aux losses: what makes data-parallel ranks' mean equal the global loss."""
    torch.manual_seed(0)
    model = TinyMoELM(TinyMoEConfig())
    ids = torch.randint(0, 128, (8, 17))
    task, aux = lm_losses(model, ids)
    halves = [lm_losses(model, ids[:4]), lm_losses(model, ids[4:])]
    assert torch.allclose(task.mean(), torch.stack([h[0].mean() for h in halves]).mean(), rtol=1e-6)
    assert torch.allclose(aux.mean(), torch.stack([h[1].mean() for h in halves]).mean(), rtol=1e-6)


def test_tied_embeddings_share_one_parameter():
    model = TinyMoELM(TinyMoEConfig(tie_embeddings=True))
    assert model.lm_head.weight is model.embed.weight
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})
