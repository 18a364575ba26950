"""A readable NanoGPT: pre-LayerNorm blocks, causal self-attention, GELU MLP.

Parameter names are stable and say their layer and kind, so block groupings can read them:
``transformer.wte``/``wpe`` (embeddings), ``transformer.h.{i}.attn.c_q|c_k|c_v|c_proj``,
``transformer.h.{i}.mlp.c_fc|c_proj``, ``transformer.h.{i}.ln_1|ln_2``, ``transformer.ln_f`` and
``lm_head``. Queries, keys and values are separate matrices (nanoGPT fuses them in ``c_attn``) so
that Muon orthogonalizes each and the per-kind grouping can tell them apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from curvlab.errors import CurvlabError
from curvlab.util.codec import Record


@dataclass(frozen=True)
class GPTConfig(Record):
    vocab_size: int = 4416
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 80
    dropout: float = 0.0
    bias: bool = False
    tie_embeddings: bool = False


CONFIGS: dict[str, GPTConfig] = {
    # ~1M parameters: tests, benchmarks and the CPU main job (vocabulary of the Zipf-PCFG language).
    "tiny": GPTConfig(),
    # ~9M parameters: the paper's synthetic-data model.
    "pcfg-9m": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=288),
    # GPT-2 small, the paper's main model (vocabulary padded to 50304 as in nanoGPT).
    "gpt2-124m": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, tie_embeddings=True),
}
# `tiny` shrunk for the test suite's micro presets (reproduction and fine-tuning), seconds on a CPU
MICRO_OVERRIDES = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 320}


def get_config(name: str, **overrides) -> GPTConfig:
    """A named config with fields overridden, e.g. ``get_config("tiny", vocab_size=100)``.

    Args:
        name: ``"tiny"`` (~1M parameters), ``"pcfg-9m"`` (~9M) or ``"gpt2-124m"`` (GPT-2 small).
        **overrides (Any): :class:`GPTConfig` fields to replace (``n_layer=2``, ...); a ``None`` value keeps
            the named config's field, so a command's unset option can be passed straight through.

    Returns:
        The :class:`GPTConfig`.

    Raises:
        CurvlabError: an unknown config name.
    """
    if name not in CONFIGS:
        raise CurvlabError(f"unknown model config {name!r}; choose one of {', '.join(CONFIGS)}")
    fields = {**CONFIGS[name].to_dict(), **{k: v for k, v in overrides.items() if v is not None}}
    return GPTConfig(**fields)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise CurvlabError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_v = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = (
            lin(x).view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for lin in (self.c_q, self.c_k, self.c_v)
        )
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, c)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``GPT(cfg)(idx) -> logits`` of shape ``(batch, time, vocab)``.

    Args:
        cfg: the architecture (sizes, dropout, bias, tied embeddings), e.g. from :func:`get_config`.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(cfg.vocab_size, cfg.n_embd),
                "wpe": nn.Embedding(cfg.block_size, cfg.n_embd),
                "drop": nn.Dropout(cfg.dropout),
                "h": nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                "ln_f": nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            }
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.config.block_size:
            raise CurvlabError(f"sequence of length {t} exceeds the model's block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))
