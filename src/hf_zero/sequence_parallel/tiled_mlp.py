"""A transformer block's MLP a tile of tokens at a time, each tile recomputed in the backward.

[Note: tiled MLP]
A gated MLP keeps four ``[tokens, intermediate]`` tensors for its backward (the gate's and the up
projection's outputs, the activation and the product), with the intermediate size about 2.7 to 3.5
times the hidden size: at long sequences, over ten hidden states' worth per token and layer, more
than attention under sequence parallelism. With ``tiled_mlp_tokens: T`` every block's ``mlp`` runs
T tokens at a time, each tile under activation checkpointing: the forward keeps the MLP's input
(which the block holds anyway) and no intermediate, the backward recomputes one tile's
intermediates at a time, so at most one tile of them exists. The MLP is token-wise, so the
output is the untiled one up to the matmul's rounding; dropout inside it draws its mask per tile
and the recomputation replays it (checkpoint keeps the RNG state). The cost is one more MLP
forward per step. It tiles the flat tokens of the batch (``[batch x sequence, hidden]``), as
``tiled_loss_tokens`` does, with or without sequence parallelism (there, over the rank's slice).

Only modules that map tokens to tokens one by one are tiled: a block attribute named ``mlp``
whose class is an ``...MLP``. Mixture-of-experts blocks are refused (their router returns its
logits over every token for the auxiliary loss, and their expert capacity depends on the tile).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _block_mlps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ``mlp`` child of every block, with its qualified name."""
    return [(f"{name}.mlp" if name else "mlp", module.mlp) for name, module in model.named_modules()
            if isinstance(getattr(module, "mlp", None), nn.Module)]


def tileable_mlps(model: nn.Module) -> list[nn.Module]:
    """Raise when ``model`` has no MLP to tile, or a block MLP that tiling would change;
    else return the MLPs ([Note: tiled MLP])."""
    found = _block_mlps(model)
    if not found:
        raise ValueError(f"tiled_mlp_tokens: {type(model).__name__} has no transformer block with an `mlp` "
                         "module to tile; set tiled_mlp_tokens to 0")
    refused = sorted({type(mlp).__name__ for _, mlp in found if not type(mlp).__name__.endswith("MLP")})
    if refused:
        raise ValueError(f"tiled_mlp_tokens: {', '.join(refused)} is not a token-wise MLP (a mixture-of-experts "
                         "block routes over every token and returns its router logits), so it cannot be "
                         "computed a tile of tokens at a time; set tiled_mlp_tokens to 0 for this model")
    return [mlp for _, mlp in found]


def _run_tile(forward: Callable[..., torch.Tensor], tile: torch.Tensor) -> torch.Tensor:
    return forward(tile)


class TiledMLPForward:
    """What an MLP's ``forward`` becomes with ``tiled_mlp_tokens`` ([Note: tiled MLP])."""

    def __init__(self, mlp: nn.Module, tile_tokens: int) -> None:
        self.tile_tokens = tile_tokens
        self.original: Callable[..., torch.Tensor] = mlp.forward

    def __call__(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        tokens = hidden.numel() // hidden.shape[-1] if hidden.dim() else 0
        if args or kwargs or tokens <= self.tile_tokens:
            return self.original(hidden, *args, **kwargs)
        flat = hidden.reshape(tokens, hidden.shape[-1])
        grad = torch.is_grad_enabled()
        tiles = []
        for start in range(0, tokens, self.tile_tokens):
            tile = flat[start:start + self.tile_tokens]
            tiles.append(checkpoint(_run_tile, self.original, tile, use_reentrant=False) if grad
                         else self.original(tile))
        out = torch.cat(tiles)
        return out.reshape(*hidden.shape[:-1], out.shape[-1])


def install_tiled_mlp(mlps: list[nn.Module], tile_tokens: int) -> None:
    for mlp in mlps:
        if not isinstance(getattr(mlp, "forward", None), TiledMLPForward):
            mlp.forward = TiledMLPForward(mlp, tile_tokens)
