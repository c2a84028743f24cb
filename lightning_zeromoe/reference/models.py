"""The reference MoE model: a tiny decoder-only LM whose MoE layers AutoEP can convert.

The demo, the tests and the troubleshooter's reproductions all train this model. It is small
enough to train in seconds on a CPU, and it is written so that DeepSpeed's AutoEP replacement
layer computes *the same function* as our own MoE block:

* each MoE block has a ``gate`` (``nn.Linear(hidden, num_experts, bias=False)``) and an
  ``experts`` module holding fused 3-D weights ``gate_up_proj [E, 2*ffn, hidden]`` and
  ``down_proj [E, hidden, ffn]`` (the Hugging Face Mixtral layout AutoEP knows);
* routing is softmax in fp32, top-k, renormalised over the chosen k, applied after the experts;
* each expert is a SwiGLU MLP: ``down(silu(gate) * up)``.

The load-balancing aux loss (and the optional router z-loss) is computed per *sequence* and
averaged, like the task loss. A global batch split over data-parallel ranks therefore gives exactly
the mean of the ranks' losses, which is what makes the single-process parity test exact.

Options for the load-balancing remedies (off by default, so the model is unchanged unless asked):
``score_bias=True`` gives each router a choice-only ``gate.e_score_correction_bias`` (DeepSeek-V3's
name and place: added to the softmax scores for the top-k choice only, the weights come from the
unbiased scores, as AutoEP's router does), which
:class:`lightning_zeromoe.balance.balancer.ExpertBiasBalancer` adjusts; ``z_loss_weight`` adds the router
z-loss (:func:`lightning_zeromoe.balance.rules.router_z_loss`) to the module's loss.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from lightning_zeromoe.balance.rules import router_z_loss


@dataclass
class TinyMoEConfig:
    """Sizes and training knobs of the tiny MoE LM.

    ``aux_loss_weight`` multiplies the load-balancing loss in ``TinyMoEModule``; 0.01 is the
    usual value (Switch Transformer, Mixtral). ``router_init_std`` and ``router_bias_expert``
    exist so the troubleshooter can provoke router collapse on purpose. ``score_bias`` and
    ``z_loss_weight``: see the module docstring.
    """

    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_experts: int = 4
    top_k: int = 2
    ffn_hidden_size: int = 96
    max_seq_len: int = 64
    tie_embeddings: bool = False
    aux_loss_weight: float = 0.01
    router_init_std: float = 0.02
    #: When set, that expert's gate row is initialised large so the router prefers it.
    router_bias_expert: int | None = None
    init_std: float = 0.02
    #: Give each router a choice-only ``e_score_correction_bias`` (zeros; see the module docstring).
    score_bias: bool = False
    #: Weight of the router z-loss in ``TinyMoEModule``'s loss (0: not computed into the loss).
    z_loss_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and num_experts={self.num_experts}")

    # AutoEP reads these two names from ``model.config`` (the Mixtral names).
    @property
    def num_local_experts(self) -> int:
        return self.num_experts

    @property
    def num_experts_per_tok(self) -> int:
        return self.top_k


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs stored as fused 3-D tensors (Mixtral layout).

    One call computes every expert's tokens. Under ZeRO-3 each module call gathers the module's
    parameters, so calling this once per forward (not once per expert that received tokens)
    keeps the number of all-gathers the same on every rank whatever the routing.
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))

    def forward(self, x: torch.Tensor, top_scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, routing weights and expert ids ``[T, k]`` -> weighted sum ``[T, H]``."""
        out = torch.zeros_like(x)
        for expert in range(self.num_experts):
            token, slot = torch.where(chosen == expert)
            if token.numel() == 0:
                continue
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, token, top_scores[token, slot].unsqueeze(-1).to(x.dtype) * y)
        return out


class MoEBlock(nn.Module):
    """Token-choice top-k MoE FFN. AutoEP swaps it for an expert-parallel layer."""

    def __init__(self, config: TinyMoEConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.num_experts = config.num_experts
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        if config.score_bias:
            # Where DeepSeek-V3 keeps it (``gate.e_score_correction_bias``): AutoEP copies it from there
            # into its router, and export names it so again. Model state: a persistent buffer.
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))
        self.experts = Experts(config.num_experts, config.hidden_size, config.ffn_hidden_size)
        # Same name and meaning as AutoEP's counter, so the monitor reads either.
        self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts), persistent=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        scores = torch.softmax(self.gate(x).float(), dim=-1)
        bias = getattr(self.gate, "e_score_correction_bias", None)
        if bias is None:
            top_scores, chosen = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        else:  # the bias picks the experts; the weights are the unbiased scores
            chosen = torch.topk(scores + bias.float(), k=self.top_k, dim=-1, sorted=False).indices
            top_scores = scores.gather(1, chosen)
        top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        with torch.no_grad():
            self.tokens_per_expert += torch.bincount(chosen.flatten(), minlength=self.num_experts).float()
        return self.experts(x, top_scores, chosen).reshape(shape)


class Attention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self, config: TinyMoEConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.out = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, h // self.num_heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


class DecoderLayer(nn.Module):
    def __init__(self, config: TinyMoEConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden_size)
        self.attn = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.hidden_size)
        self.mlp = MoEBlock(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyMoELM(nn.Module):
    """Embedding -> N x (attention, MoE FFN) -> norm -> lm_head, optionally tied.

    ``forward`` returns ``(logits, router_logits)``: one ``[tokens, num_experts]`` tensor per MoE
    layer, captured from whichever router module is installed (ours or AutoEP's), so the aux
    loss works before and after AutoEP's replacement.
    """

    #: Where AutoEP finds our MoE blocks, relative to this module. The strategy prefixes the
    #: module's own path inside the LightningModule.
    autoep_pattern = {
        "moe_layer_pattern": r"layers\.\d+\.mlp",
        "router_pattern": "gate",
        "expert_pattern": "experts",
        "expert_w1": "gate_up_proj",
        "expert_w2": "down_proj",
        "expert_w3": None,
    }

    def __init__(self, config: TinyMoEConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos = nn.Embedding(config.max_seq_len, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_parameters()
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def reset_parameters(self) -> None:
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, Experts):
                nn.init.normal_(module.gate_up_proj, std=std)
                nn.init.normal_(module.down_proj, std=std / math.sqrt(2 * self.config.num_layers))
        for layer in self.layers:
            nn.init.normal_(layer.mlp.gate.weight, std=self.config.router_init_std)
            if self.config.router_bias_expert is not None:
                # A large, input-aligned row: most tokens score highest on this expert.
                with torch.no_grad():
                    layer.mlp.gate.weight[self.config.router_bias_expert] += 1.0

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)
        with capture_router_logits(self) as router_logits:
            for layer in self.layers:
                x = layer(x)
        return self.lm_head(self.norm(x)), router_logits


def router_modules(model: nn.Module) -> list[nn.Linear]:
    """The router projection of every MoE layer: ours (``mlp.gate``) or AutoEP's
    (``mlp.router.gate``)."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and (name.endswith("mlp.gate") or name.endswith("mlp.router.gate")):
            found.append(module)
    return found


@contextmanager
def capture_router_logits(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect the output of every router projection that runs inside the block."""
    captured: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: captured.append(out)) for m in router_modules(model)]
    try:
        yield captured
    finally:
        for hook in hooks:
            hook.remove()


def load_balancing_loss(router_logits: list[torch.Tensor], top_k: int, batch_size: int) -> torch.Tensor:
    """Switch-style aux loss ``E * sum_e f_e * P_e``, per sequence, averaged over sequences and layers.

    ``f_e`` is the fraction of the sequence's top-k assignments that go to expert ``e`` and ``P_e``
    the mean router probability of ``e``. It is 1.0 when routing is perfectly uniform and grows
    towards ``E`` as one expert takes everything. Computing it per sequence (rather than over the
    whole micro-batch) makes the loss of a global batch equal the mean over data-parallel ranks.
    """
    if not router_logits:
        raise ValueError("no router logits were captured: the model has no MoE layer that ran")
    losses = []
    for logits in router_logits:
        num_experts = logits.shape[-1]
        probs = torch.softmax(logits.float(), dim=-1).view(batch_size, -1, num_experts)
        chosen = torch.topk(probs, k=top_k, dim=-1).indices
        assigned = F.one_hot(chosen, num_experts).sum(dim=2).float()  # [B, S, E]
        fraction = assigned.mean(dim=1) / top_k  # [B, E]
        mean_prob = probs.mean(dim=1)  # [B, E]
        losses.append(num_experts * (fraction * mean_prob).sum(dim=-1))  # [B]
    return torch.stack(losses).mean(dim=0)  # [B]


def lm_loss_terms(model: TinyMoELM, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence next-token cross-entropy, aux loss and router z-loss, each shaped ``[batch]``."""
    logits, router_logits = model(input_ids[:, :-1])
    targets = input_ids[:, 1:]
    task = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    task = task.view(targets.shape).mean(dim=1)
    aux = load_balancing_loss(router_logits, model.config.top_k, input_ids.shape[0])
    return task, aux, router_z_loss(router_logits, input_ids.shape[0])


def lm_losses(model: TinyMoELM, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence next-token cross-entropy and aux loss, both shaped ``[batch]``."""
    task, aux, _ = lm_loss_terms(model, input_ids)
    return task, aux


class SyntheticLMData(Dataset):
    """Deterministic token sequences from a fixed random Markov chain, so the loss can fall.

    Each item is ``{"input_ids": LongTensor[seq_len], "index": int}``: the index lets tests
    record which samples each rank actually received.
    """

    def __init__(self, num_samples: int = 512, seq_len: int = 33, vocab_size: int = 128, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        # Each token has 4 likely successors: learnable, but not trivial.
        successors = torch.randint(0, vocab_size, (vocab_size, 4), generator=gen)
        tokens = torch.empty(num_samples, seq_len, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab_size, (num_samples,), generator=gen)
        for t in range(1, seq_len):
            pick = torch.randint(0, 4, (num_samples,), generator=gen)
            tokens[:, t] = successors[tokens[:, t - 1], pick]
        self.tokens = tokens

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.tokens[index], "index": index}


def _lightning_module_base() -> type:
    # Lightning takes ~5 s to import; only pay for it when the wrapper is used.
    import lightning as L

    return L.LightningModule


def __getattr__(name: str) -> Any:
    if name == "TinyMoEModule":
        cls = _build_module_class()
        globals()["TinyMoEModule"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _build_module_class() -> type:
    from typing_extensions import override

    base = _lightning_module_base()

    class TinyMoEModule(base):  # type: ignore[misc, valid-type]
        """LightningModule around :class:`TinyMoELM`: loss = task + ``aux_loss_weight`` * aux
        (+ ``z_loss_weight`` * router z-loss when that weight is set).

        Logs ``train/loss``, ``train/task_loss`` and ``train/aux_loss`` separately (and
        ``train/z_loss`` with a z-loss weight): an aux loss that stays flat while the task loss
        moves is a routing signal of its own.
        """

        def __init__(self, config: TinyMoEConfig | None = None, lr: float = 3e-3, batch_size: int = 8,
                     num_samples: int = 512, seed: int = 0, **overrides: Any) -> None:
            super().__init__()
            config = config or TinyMoEConfig(**overrides)
            self.save_hyperparameters({"config": asdict(config), "lr": lr, "batch_size": batch_size,
                                       "num_samples": num_samples, "seed": seed})
            self.lr = lr
            self.batch_size = batch_size
            self.num_samples = num_samples
            self.seed = seed
            self.model = TinyMoELM(config)
            self._last_losses: dict[str, torch.Tensor] = {}

        @property
        def last_losses(self) -> dict[str, float]:
            """The last training step's ``loss``, ``task_loss`` and ``aux_loss`` as floats.

            Converted when read, not in every step: on a GPU each ``.item()`` blocks the host until
            the device has caught up, which would cost three synchronisations per step.
            """
            return {k: float(v) for k, v in self._last_losses.items()}

        @override
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids)[0]

        @override
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            config = self.model.config
            task, aux, z = lm_loss_terms(self.model, batch["input_ids"])
            task, aux = task.mean(), aux.mean()
            loss = task + config.aux_loss_weight * aux
            # Detached tensors, no .item(): Lightning logs tensors as they are, without a host sync.
            self._last_losses = {"task_loss": task.detach(), "aux_loss": aux.detach()}
            if config.z_loss_weight:
                z = z.mean()
                loss = loss + config.z_loss_weight * z
                self._last_losses["z_loss"] = z.detach()
            self._last_losses["loss"] = loss.detach()
            # One log call per metric costs ~2 ms of Lightning bookkeeping per step on CPU: log each once.
            self.log("train/loss", self._last_losses["loss"], prog_bar=True)
            self.log_dict({f"train/{k}": v for k, v in self._last_losses.items() if k != "loss"})
            return loss

        @override
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)

        @override
        def train_dataloader(self) -> torch.utils.data.DataLoader:
            data = SyntheticLMData(self.num_samples, self.model.config.max_seq_len // 2 + 1,
                                   self.model.config.vocab_size, seed=self.seed)
            return torch.utils.data.DataLoader(data, batch_size=self.batch_size, shuffle=False, drop_last=True)

    # Importable (and picklable) as lightning_zeromoe.reference.models.TinyMoEModule.
    TinyMoEModule.__module__ = __name__
    TinyMoEModule.__qualname__ = "TinyMoEModule"
    return TinyMoEModule
