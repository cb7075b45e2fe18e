"""The one workload every engine runs: model, optimizer hyperparameters and data.

Every engine builds the model the same way (``torch.manual_seed(seed)`` just before
``GPT2LMHeadModel(config)``, so all start from the same weights) and trains on the same batches
(a synthetic sparse Markov chain, one batch per (seed, rank, step), generated before the timed
loop). Only the wrapping differs, which is what the benchmark compares.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

# The same learnable data as the README's main job (hf-zero demo): one definition.
from hf_zero.demo import markov_batch, markov_successors


@dataclass(frozen=True)
class Workload:
    """What is trained, identically under every engine."""

    n_layer: int = 4
    """Transformer blocks."""
    n_embd: int = 256
    """Hidden size; heads = n_embd // 64."""
    vocab: int = 8192
    """Vocabulary size (tied input/output embedding)."""
    seq: int = 128
    """Tokens per sequence (also n_positions)."""
    micro_batch: int = 4
    """Sequences per rank per step."""
    steps: int = 20
    """Optimizer steps in all, warm-up included."""
    warmup: int = 3
    """Leading steps left out of every timing and communication figure."""
    dtype: str = "fp32"
    """"fp32" (CPU default) or "bf16" (GPU mode: bf16 compute, fp32 master/optimizer state)."""
    device: str = "cpu"
    """"cpu" (gloo) or "cuda" (NCCL)."""
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled (AdamW) weight decay, applied to every parameter."""
    clip: float = 1.0
    """Global gradient-norm clipping."""
    seed: int = 1234
    """Seed for the initial weights, the Markov chain and the batches."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Workload":
        values = dict(values)
        values["betas"] = tuple(values["betas"])
        return cls(**values)

    @property
    def n_head(self) -> int:
        return max(1, self.n_embd // 64)

    def flops_per_token(self, params: int) -> int:
        """Training FLOPs per token as the PaLM paper counts them for MFU: 6 per parameter
        (forward 2, backward 4; the tied embedding counted once, as the lm_head's matmul) plus
        the attention scores and their use, 12 x layers x hidden x seq."""
        return 6 * params + 12 * self.n_layer * self.n_embd * self.seq

    def tokens_per_step(self, world_size: int) -> int:
        return self.micro_batch * self.seq * world_size

    def adamw_kwargs(self) -> dict[str, Any]:
        return dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


def build_model(workload: Workload) -> torch.nn.Module:
    """GPT-2 causal LM from a config, on the CPU, seeded so every engine gets the same weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=workload.vocab, n_positions=workload.seq, n_embd=workload.n_embd,
        n_layer=workload.n_layer, n_head=workload.n_head,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
        # In-vocabulary special ids and a named loss: silences transformers' notices; no effect
        # on training (nothing here generates text).
        bos_token_id=workload.vocab - 1, eos_token_id=workload.vocab - 1,
    )
    torch.manual_seed(workload.seed)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # what transformers falls back to anyway, minus the notice
    model.train()
    return model


def count_params(model: torch.nn.Module) -> int:
    """Ψ: parameters counted once (the tied embedding once)."""
    return sum(p.numel() for p in model.parameters())


def batch_seed(seed: int, rank: int, step: int) -> int:
    return seed * 1_000_003 + step * 7919 + rank


def make_batches(workload: Workload, rank: int, count: int, device: torch.device) -> list[torch.Tensor]:
    """This rank's batches for steps 0..count-1, already on ``device`` (outside any timing)."""
    successors = markov_successors(workload.vocab, workload.seed)
    return [
        markov_batch(successors, workload.micro_batch, workload.seq, batch_seed(workload.seed, rank, step)).to(device)
        for step in range(count)
    ]
