"""Ulysses sequence parallelism for Hugging Face causal LMs: ``sequence_parallel_size`` in the
config (docs/how-it-works.md "Long sequences")."""

from hf_zero.sequence_parallel.layout import SequenceParallelLayout, data_parallel_place, make_layout
from hf_zero.sequence_parallel.model import SequenceParallel, causal_lm_heads, check_model
from hf_zero.sequence_parallel.tiled_loss import check_tiling, install_tiled_loss
from hf_zero.sequence_parallel.tiled_mlp import install_tiled_mlp, tileable_mlps

__all__ = ["SequenceParallel", "SequenceParallelLayout", "causal_lm_heads", "check_model", "check_tiling",
           "data_parallel_place", "install_tiled_loss", "install_tiled_mlp", "make_layout", "tileable_mlps"]
