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


def test_tiled_mlp_refuses_expert_blocks_and_models_without_block_mlps() -> None:
    from transformers import AutoModelForCausalLM, BertConfig, BertModel, Qwen2MoeConfig

    from hf_zero.sequence_parallel import tileable_mlps

    assert [type(m).__name__ for m in tileable_mlps(_llama())] == ["LlamaMLP"]
    moe = AutoModelForCausalLM.from_config(Qwen2MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, moe_intermediate_size=8, shared_expert_intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, num_experts=2, num_experts_per_tok=1))
    with pytest.raises(ValueError, match="Qwen2MoeSparseMoeBlock is not a token-wise MLP"):
        tileable_mlps(moe)
    bert = BertModel(BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=16))
    with pytest.raises(ValueError, match="no transformer block with an `mlp`"):
        tileable_mlps(bert)


def test_parallelism_config_sp_size_becomes_the_configs_and_the_rest_is_refused_by_name() -> None:
    from accelerate import ParallelismConfig

    from hf_zero.integrations.parallelism import with_sequence_parallel

    raw = {"zero_optimization": {"stage": 3}}
    assert with_sequence_parallel(raw, ParallelismConfig(sp_size=4, sp_backend="deepspeed"), 8) == {
        **raw, "sequence_parallel_size": 4}
    assert with_sequence_parallel(raw, None, 8) is raw
    assert with_sequence_parallel(raw, ParallelismConfig(sp_size=2, dp_shard_size=4), 8)["sequence_parallel_size"] == 2
    assert with_sequence_parallel({**raw, "sequence_parallel_size": 2}, ParallelismConfig(sp_size=2), 8)
    for parallelism, words in [
        (ParallelismConfig(tp_size=2), "tp_size 2: hf_zero has no tensor parallelism"),
        (ParallelismConfig(cp_size=2), "cp_size 2: context parallelism is FSDP2's"),
        (ParallelismConfig(dp_replicate_size=2, dp_shard_size=4), "mics_shard_size: 4"),
        (ParallelismConfig(sp_size=2, dp_shard_size=2), "data-parallel size 2 x sp_size 2 is not the world size 8"),
    ]:
        with pytest.raises(ValueError, match=words):
            with_sequence_parallel(raw, parallelism, 8)
    with pytest.raises(ValueError, match="sp_size 4 disagrees with sequence_parallel_size 2"):
        with_sequence_parallel({**raw, "sequence_parallel_size": 2}, ParallelismConfig(sp_size=4), 8)
