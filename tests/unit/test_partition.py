"""Units and flat layouts: pure arithmetic, checked against hand calculations."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_zero.partition import (
    PARAM_ALIGNMENT, ROOT_UNIT_NAME, SHARD_ALIGNMENT, build_flat_layout, padded_length, plan_units,
)
from tests.tiny_models import tiny_bert_classifier, tiny_gpt2, tiny_llama


def test_padded_length_hand_calculation():
    assert SHARD_ALIGNMENT == 8 and PARAM_ALIGNMENT == 8  # 16 bytes of bf16/fp16
    assert padded_length(10, 1) == 16  # chunk of 8
    assert padded_length(10, 2) == 16  # chunk of 16
    assert padded_length(10, 3) == 24  # chunk of 24
    assert padded_length(25, 3) == 48
    assert padded_length(10, 3, alignment=4) == 12  # the layout before alignment (old checkpoints)
    assert padded_length(0, 2) == 16  # an empty group still has one well-formed chunk


def test_flat_layout_offsets_and_shards():
    params = [("a", nn.Parameter(torch.zeros(3, 5))), ("b", nn.Parameter(torch.zeros(7)))]
    layout = build_flat_layout(params, world_size=3)
    # a: 15 elements at 0; b starts at 16 (15 rounded up to a multiple of 8) and ends at 23;
    # 23 rounded up to a multiple of 3 x 8 is 24: shards of 8.
    assert [(s.name, s.offset, s.numel, s.shape) for s in layout.slots] == [
        ("a", 0, 15, (3, 5)), ("b", 16, 7, (7,))]
    assert layout.numel == 22 and layout.padded_numel == 24 and layout.shard_numel == 8
    assert [layout.shard_range(r) for r in range(3)] == [(0, 8), (8, 16), (16, 24)]
    with pytest.raises(ValueError, match="rank 3"):
        layout.shard_range(3)


@pytest.mark.parametrize("builder, unit_classes", [
    # GPT-2 ties wte and lm_head: the one tensor stays in the root (see [Note: edge units]).
    (tiny_gpt2, ["GPT2Block"] * 2),
    # tiny_llama is untied: the embedding and lm_head are units of their own, first and last.
    (tiny_llama, ["Embedding", "LlamaDecoderLayer", "LlamaDecoderLayer", "Linear"])])
def test_units_from_no_split_modules(builder, unit_classes):
    model = builder()
    plan = plan_units(model)
    assert "_no_split_modules" in plan.rule
    assert [type(u.module).__name__ for u in plan.units[:-1]] == unit_classes
    assert plan.root.name == ROOT_UNIT_NAME and plan.root.module is model


def _meta_llama(**shape) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**shape))


def test_llama3_shape_embedding_and_head_are_units_of_their_own():
    """Llama-3-8B's shape (built on the meta device: no memory): a root holding the 525M-element
    embedding and lm_head would alone exceed stage3_max_live_parameters' default of 1e9, and hold
    the head's full gradient through the backward. Each is a unit; the root keeps the final norm
    ([Note: edge units]; a fused loss reading lm_head.weight gathers it on that read)."""
    vocab, hidden, layers = 128256, 4096, 32
    model = _meta_llama(vocab_size=vocab, hidden_size=hidden, intermediate_size=14336,
                        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                        tie_word_embeddings=False)
    plan = plan_units(model)
    names = [u.name for u in plan.units]
    assert names[0] == "model.embed_tokens" and names[-2:] == ["lm_head", "<root>"]
    assert names[1:-2] == [f"model.layers.{i}" for i in range(layers)]
    assert plan.units[0].numel == plan.units[-2].numel == vocab * hidden
    assert [n for n, _ in plan.root.params] == ["model.norm.weight"]
    assert plan.root.numel == hidden


def test_tied_embeddings_stay_in_the_root_once():
    model = _meta_llama(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    plan = plan_units(model)
    assert [u.name for u in plan.units] == ["model.layers.0", "model.layers.1", ROOT_UNIT_NAME]
    assert sorted(n for n, _ in plan.root.params) == ["model.embed_tokens.weight", "model.norm.weight"]


def test_bert_falls_back_to_the_layer_stack():
    model = tiny_bert_classifier()
    model._no_split_modules = None  # as BERT ships in some transformers versions
    plan = plan_units(model)
    assert "ModuleList" in plan.rule
    assert [u.name for u in plan.units[:-1]] == [
        "bert.embeddings.word_embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1"]


def test_every_parameter_in_exactly_one_unit_and_tied_weights_once():
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    plan = plan_units(model)
    owned = [id(p) for u in plan.units for _, p in u.params]
    assert len(owned) == len(set(owned))
    assert set(owned) == {id(p) for p in model.parameters()}
    assert sum(u.numel for u in plan.units) == sum(p.numel() for p in model.parameters())


def test_wrap_modules_override_and_error():
    model = tiny_llama()
    plan = plan_units(model, wrap_modules=["LlamaMLP"])
    assert [u.name for u in plan.units[:-1]] == [
        "model.embed_tokens", "model.layers.0.mlp", "model.layers.1.mlp", "lm_head"]
    with pytest.raises(ValueError, match="matches no module.*LlamaDecoderLayer"):
        plan_units(model, wrap_modules=["NoSuchBlock"])


def test_parameter_shared_by_two_units_moves_to_root():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(nn.ModuleList([nn.Sequential(shared, nn.ReLU()), nn.Sequential(shared)]))
    plan = plan_units(model)
    # Both blocks own nothing else, so they are no units at all: the root holds the shared layer.
    assert [u.name for u in plan.units] == ["<root>"] and plan.units[-1] is plan.root
    assert {id(p) for _, p in plan.root.params} == {id(shared.weight), id(shared.bias)}
    # Blocks with parameters of their own stay units, each without the shared layer.
    own = [nn.Linear(4, 4), nn.Linear(4, 4)]
    model = nn.Sequential(nn.ModuleList([nn.Sequential(shared, own[0]), nn.Sequential(shared, own[1])]))
    plan = plan_units(model)
    assert [u.name for u in plan.units] == ["0.0", "0.1", "<root>"]
    for unit, layer in zip(plan.units[:-1], own, strict=True):
        assert {id(p) for _, p in unit.params} == {id(layer.weight), id(layer.bias)}
    assert {id(p) for _, p in plan.root.params} == {id(shared.weight), id(shared.bias)}


def test_plain_module_is_one_unit():
    model = nn.Linear(3, 2)
    plan = plan_units(model)
    assert len(plan.units) == 1 and "whole model" in plan.rule
