"""Models whose ranks take different paths through them, and the path each rank takes.

Every unit (a ``Block`` or an ``Expert``) has the same number of parameters on purpose: if two
ranks issued their collectives for different units, equal sizes would let the collectives pair
up with no error at all, so only the values can tell (as on NCCL).

- ``LayerdropTower``: a stack of blocks of which one is skipped per rank and step (layerdrop),
  and a two-block side tower that only ranks "with images" run (a vision tower on text-only
  batches). Some steps no rank has images, and some layers are skipped on every rank, so some
  units get no gradient anywhere in a step.
- ``OldStyleMoE``: a top-1 mixture of experts whose loop skips experts that got no tokens, as
  older MoE blocks do (``if idx.numel() == 0: continue``).
"""

from __future__ import annotations

import torch
from torch import nn

DIM = 12
VOCAB = 29
SEQ = 6


class Block(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h))


class LayerdropTower(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.tower = nn.ModuleList(Block() for _ in range(2))
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, images: torch.Tensor | None = None,
                skip: int | None = None) -> torch.Tensor:
        h = self.embed(ids)
        if images is not None:
            t = images
            for block in self.tower:
                t = block(t)
            h = h + t.unsqueeze(1)
        for i, layer in enumerate(self.layers):
            if i != skip:
                h = layer(h)
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.roll(-1, 1).reshape(-1))


class Expert(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.up = nn.Linear(dim, dim)
        self.down = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(h)))


class OldStyleMoE(nn.Module):
    _no_split_modules = ["Expert"]

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.router = nn.Linear(DIM, experts)
        self.experts = nn.ModuleList(Expert() for _ in range(experts))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, images: torch.Tensor | None = None,
                skip: int | None = None) -> torch.Tensor:
        h = self.embed(ids).reshape(-1, DIM)
        gates = torch.softmax(self.router(h), dim=-1)
        weight, choice = gates.max(dim=-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().squeeze(-1)
            if idx.numel() == 0:  # the older MoE loops: an expert with no tokens is not run
                continue
            out = out.index_add(0, idx, weight[idx, None] * expert(h[idx]))
        logits = self.head(h + out)
        return nn.functional.cross_entropy(logits, ids.roll(-1, 1).reshape(-1))


class RootTower(nn.Module):
    """Parameters that share a unit with used ones: a side tower and an adapter that are plain
    submodules of the root (so in the root unit, with the embedding and the head), used only by
    ranks "with images" and on "adapter" steps."""

    _no_split_modules = ["Block"]

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.side = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
        self.adapter = nn.Linear(DIM, DIM, bias=False)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, images: torch.Tensor | None = None, adapter: bool = False,
                skip: int | None = None) -> torch.Tensor:
        h = self.embed(ids)
        if images is not None:
            h = h + self.side(images).unsqueeze(1)
        if adapter:
            h = h + self.adapter(h)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.roll(-1, 1).reshape(-1))


class SparseMoeLayer(nn.Module):
    """A Mixtral-style block: router and experts in one unit; an expert that gets no token is not
    run, so its parameters get no gradient while the rest of the unit's do."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, experts, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(experts))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, DIM)
        weight, choice = torch.softmax(self.router(flat), dim=-1).max(dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().squeeze(-1)
            if idx.numel() == 0:
                continue
            out = out.index_add(0, idx, weight[idx, None] * expert(flat[idx]))
        return h + out.reshape(h.shape)


class MixtralStyle(nn.Module):
    _no_split_modules = ["SparseMoeLayer"]

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(SparseMoeLayer() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, images: torch.Tensor | None = None, adapter: bool = False,
                skip: int | None = None) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.roll(-1, 1).reshape(-1))


MODELS = {"layerdrop_tower": LayerdropTower, "moe": OldStyleMoE, "root_tower": RootTower,
          "mixtral_style": MixtralStyle}


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[kind]()


def rank_batch(kind: str, step: int, rank: int, rows: int = 2) -> dict:
    """What rank ``rank`` feeds the model at ``step``: its token ids and, for the tower model,
    whether it has images and which layer it drops. Deterministic, so every rank and the
    reference agree on every rank's path."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if kind == "root_tower":  # images on no rank at steps 1 and 4 (world 2 and 3); adapter: every third step
        ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
        images = torch.randn(rows, DIM, generator=g) if (step + rank) % 3 == 0 and step % 3 != 1 else None
        return {"ids": ids, "images": images, "adapter": step % 3 == 2}
    if kind == "mixtral_style":  # one token row per rank from a narrow vocabulary slice
        low = (rank * 3 + step * 5) % (VOCAB - 3)
        return {"ids": torch.randint(low, low + 3, (1, SEQ), generator=g)}
    if kind == "moe":
        # Few tokens per rank and a vocabulary slice per rank: experts go unused on some ranks.
        low = (rank * 7) % VOCAB
        ids = torch.randint(low, min(VOCAB, low + 6), (rows, SEQ), generator=g)
        return {"ids": ids}
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    has_images = (step + rank) % 3 == 0  # step 1 at world 2: no rank has images
    images = torch.randn(rows, DIM, generator=g) if has_images else None
    skip = (step + 2 * rank) % 5  # 4 means "no layer skipped"
    return {"ids": ids, "images": images, "skip": skip if skip < 4 else None}
