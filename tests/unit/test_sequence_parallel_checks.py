"""What stops sequence parallelism is refused before training, with the fix named."""

from __future__ import annotations

import pytest
import torch

from hf_zero.config import HfZeroConfig
from hf_zero.sequence_parallel import check_model
from hf_zero.sequence_parallel.batch import shift_labels


def _llama(heads: int = 4, kv_heads: int = 2, attn: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32, hidden_size=24 if heads in (3, 6) else 16, intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def test_a_model_that_splits_passes() -> None:
    check_model(_llama(4, 2), 2)
    check_model(_llama(4, 1), 4)  # one key/value head, repeated on every rank
    check_model(_llama(4, 2, attn="eager"), 4)


@pytest.mark.parametrize("heads,kv_heads,size,words", [
    (3, 3, 2, "3 attention heads are not divisible by sequence_parallel_size 2"),
    (6, 6, 4, "6 attention heads are not divisible"),
    (4, 4, 4, None),
])
def test_heads_that_do_not_split_are_refused(heads: int, kv_heads: int, size: int, words: str | None) -> None:
    model = _llama(heads, kv_heads)
    if words is None:
        check_model(model, size)
        return
    with pytest.raises(ValueError, match=words):
        check_model(model, size)


def test_kv_heads_that_neither_divide_nor_are_divided_are_refused() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32, hidden_size=24, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match="3 key/value heads and sequence_parallel_size 2: one must divide"):
        check_model(AutoModelForCausalLM.from_config(config), 2)


def test_a_model_without_a_causal_lm_head_is_refused() -> None:
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=16))
    with pytest.raises(ValueError, match="not a causal language model"):
        check_model(model, 2)


def test_flex_attention_and_sliding_windows_are_refused() -> None:
    from transformers import AutoModelForCausalLM, MistralConfig

    model = _llama()
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="'flex_attention' is not one sequence parallelism wraps"):
        check_model(model, 2)
    mistral = AutoModelForCausalLM.from_config(MistralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8))
    with pytest.raises(ValueError, match="sliding-window attention"):
        check_model(mistral, 2)


def test_the_size_must_divide_the_world_and_the_batch_counts_data_parallel_ranks() -> None:
    config = HfZeroConfig({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                           "sequence_parallel_size": 2})
    assert config.resolve(world_size=8).train_batch_size == 2 * 3 * 4
    with pytest.raises(Exception, match="sequence_parallel_size.*must divide the world size 6"):
        HfZeroConfig({"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 4}).resolve(world_size=6)


def test_labels_are_shifted_over_the_whole_sequence() -> None:
    labels = torch.tensor([[5, 6, 7, 8]])
    assert shift_labels(labels).tolist() == [[6, 7, 8, -100]]
