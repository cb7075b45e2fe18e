"""Which parameters ``torch_autocast.lower_precision_safe_modules`` selects ([Note:
lower-precision-safe modules] in hf_zero.engine.lower_precision): DeepSpeed's rule (an exact
class match, a module's own parameters, null meaning Linear and Conv1d/2d/3d), a tied parameter
kept fp32 unless every module holding it is listed, and names looked up, never imported."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import hf_zero
from hf_zero.engine.lower_precision import lower_precision_params, resolve_module_classes, unmatched_classes
from tests.tiny_models import tiny_llama


def _safe_names(model: nn.Module, names: list[str] | None) -> set[str]:
    chosen = lower_precision_params(model, resolve_module_classes(names), torch.bfloat16)
    return {n for n, p in model.named_parameters() if id(p) in chosen}


def test_null_means_linear_and_conv_layers():
    model = tiny_llama()
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert _safe_names(model, None) == linears
    assert "lm_head.weight" in linears and "model.embed_tokens.weight" not in linears
    assert resolve_module_classes(None) == (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def test_an_empty_list_keeps_everything_fp32():
    assert _safe_names(tiny_llama(), []) == set()


def test_a_listed_class_marks_only_its_own_parameters():
    model = tiny_llama()
    got = _safe_names(model, ["transformers.models.llama.modeling_llama.LlamaRMSNorm"])
    assert got and all(name.endswith("norm.weight") for name in got)
    # The decoder layer holds no parameter of its own: listing it selects nothing below it.
    assert _safe_names(model, ["transformers.models.llama.modeling_llama.LlamaDecoderLayer"]) == set()


def test_a_subclass_is_not_matched():
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(3, 4), MyLinear(4, 2))
    assert _safe_names(model, None) == {"0.weight", "0.bias"}


def test_a_tied_embedding_stays_fp32():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=16, intermediate_size=37, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    got = lower_precision_params(model, resolve_module_classes(None), torch.bfloat16)
    assert id(model.lm_head.weight) not in got
    assert id(model.model.layers[0].mlp.up_proj.weight) in got


@pytest.mark.parametrize(("name", "says"), [
    ("Linear", "not a dotted class name"),
    ("torch.nn.Linearr", "names no class loaded"),
    ("torch.nn.functional.relu", "not an nn.Module class"),
    ("os.system", "not an nn.Module class"),
])
def test_a_name_that_is_no_module_class_is_refused(name, says):
    with pytest.raises(ValueError, match=says) as info:
        resolve_module_classes([name])
    assert "torch_autocast.lower_precision_safe_modules" in str(info.value)


def test_a_config_never_imports_a_module():
    assert "json.tool" not in sys.modules
    with pytest.raises(ValueError, match="names no class loaded"):
        resolve_module_classes(["json.tool.Anything"])
    assert "json.tool" not in sys.modules


def test_unmatched_classes_are_named():
    classes = resolve_module_classes(["torch.nn.Linear", "torch.nn.Conv2d"])
    assert unmatched_classes(tiny_llama(), classes) == ["torch.nn.modules.conv.Conv2d"]


def test_initialize_refuses_a_bad_name_before_sharding():
    model = tiny_llama()
    config = {"train_micro_batch_size_per_gpu": 1, "torch_autocast": {
        "enabled": True, "lower_precision_safe_modules": ["torch.nn.Linearr"]},
        "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(Exception, match="torch.nn.Linearr"):
        hf_zero.initialize(model=model, config=config)
    assert all(p.numel() > 0 for p in model.parameters())  # not sharded: nothing was lost
