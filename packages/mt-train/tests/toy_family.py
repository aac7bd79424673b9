"""A third-party model family as a plugin module, for the tests: what a package adds to give
mt-train a new model (here registered directly; a package would name this module in its
``mt`` entry point).

The toy model: embedding → ``n_layers`` residual MLP blocks (pre-norm SwiGLU from mt_parallel's
layers, no attention) → RMSNorm → head. Its loss returns an extra value, ``toy_aux`` (the mean
squared logit, as a router's z-loss would be), to check that a family's extra losses reach the
logs without the trainer knowing them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import mt_parallel
from mt_core import Registry, hookimpl
from mt_train.config.schema import ModelConfig
from mt_train.models import ModelFamily


@dataclass
class ToyConfig(ModelConfig):
    """The toy family's config (the ``model`` group's schema for its sizes)."""

    name: str = "toy_tiny"
    width: int = 32
    n_layers: int = 2
    ffn_dim: int = 64
    aux_weight: float = 0.01

    def summary(self) -> str:
        return f"{self.n_layers} MLP blocks, width {self.width}, vocab {self.vocab_size}"


class ToyBlock(nn.Module):
    """``y = x + mlp(norm(x))``: the unit of recompute, compile and FSDP2 sharding."""

    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.norm = mt_parallel.RMSNorm(cfg.width)
        self.mlp = mt_parallel.MLP(cfg.width, cfg.ffn_dim, cfg.n_layers)

    def forward(self, x_BTD, positions_S=None, document_ids_BT=None):
        return x_BTD + self.mlp(self.norm(x_BTD))


class ToyLM(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = mt_parallel.VocabParallelEmbedding(cfg.vocab_size, cfg.width)
        self.layers = nn.ModuleList(ToyBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = mt_parallel.RMSNorm(cfg.width)
        self.head = mt_parallel.ColumnParallelLinear(cfg.width, cfg.vocab_size, bias=False)

    def forward(self, tokens_BT, positions_S=None, document_ids_BT=None):
        x_BTD = self.embed(tokens_BT)
        for layer in self.layers:
            x_BTD = layer(x_BTD, positions_S, document_ids_BT)
        return self.head(self.norm(x_BTD))

    def loss(self, logits_BTV_l, targets_BT):
        ce = mt_parallel.vocab_parallel_cross_entropy(logits_BTV_l, targets_BT, self.head.tp_group)
        aux = logits_BTV_l.float().square().mean()
        return ce + self.cfg.aux_weight * aux, {"toy_aux": aux}


def toy_family() -> ModelFamily:
    return ModelFamily(
        name="toy",
        label="Toy MLP LM",
        config=ToyConfig,
        build=ToyLM,
        plan=lambda cfg: mt_parallel.ParallelizePlan(block_types=(ToyBlock,), output_head="head"),
        flops_per_token=lambda cfg, seq_len: 6.0 * (3 * cfg.width * cfg.ffn_dim * cfg.n_layers),
        embedding_parameters=lambda model: model.embed.weight.numel(),
        sizes={"toy_tiny": ToyConfig()},
    )


@hookimpl
def mt_register_model_families(registry: Registry) -> None:
    registry.add("toy", toy_family)


def mean_squared_logit(model: ToyLM, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(tokens).float().square().mean())
