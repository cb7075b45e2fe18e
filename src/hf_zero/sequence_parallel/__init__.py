"""Ulysses sequence parallelism for Hugging Face causal LMs: ``sequence_parallel_size`` in the
config (docs/how-it-works.md "Long sequences")."""

from hf_zero.sequence_parallel.layout import SequenceParallelLayout, data_parallel_place, make_layout
from hf_zero.sequence_parallel.model import SequenceParallel, check_model

__all__ = ["SequenceParallel", "SequenceParallelLayout", "check_model", "data_parallel_place", "make_layout"]
