"""A model loaded sharded (a live stage-3 config, see hf_zero/integrations/zero3_loading.py) carries
everything a plain ``from_pretrained`` sets on it, not only the weights: scripts read these back.
TRL's published ``sft.py`` calls ``AutoProcessor.from_pretrained(model.config._name_or_path)``, the
Trainer writes ``name_or_path`` into the model card, ``generate`` reads ``generation_config``,
``save_pretrained`` reads the tied-weight keys.

Each test loads the same folder twice in one process, plainly and under a live stage-3
HfZeroConfig, and compares the attributes; the sharded load must really be the lazy one
(parameters on the meta device), or the comparison proves nothing."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.tiny_models import BUILDERS

ZERO3 = {"train_micro_batch_size_per_gpu": 2,
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
AUTO_CLASSES = {"gpt2": "AutoModelForCausalLM", "llama": "AutoModelForCausalLM",
                "bert": "AutoModelForSequenceClassification", "t5": "AutoModelForSeq2SeqLM"}
MODEL_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertForSequenceClassification",
                 "t5": "T5ForConditionalGeneration"}


def tiny_t5(seed: int = 0) -> torch.nn.Module:
    """T5 keeps its ``wo`` projections in fp32 under fp16 (``_keep_in_fp32_modules``)."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    return T5ForConditionalGeneration(T5Config(vocab_size=97, d_model=16, d_kv=8, d_ff=37, num_layers=1,
                                               num_heads=2, decoder_start_token_id=0)).float()


def attributes(model: Any) -> dict[str, Any]:
    """What a plain load sets on the model, besides the weights' values."""
    generation = getattr(model, "generation_config", None)
    ties: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        ties.setdefault(id(param), []).append(name)
    return {
        "config": model.config.to_dict(),
        "config._name_or_path": model.config._name_or_path,
        "name_or_path": model.name_or_path,
        "config._attn_implementation": model.config._attn_implementation,
        "generation_config": None if generation is None else generation.to_dict(),
        "_keep_in_fp32_modules": model._keep_in_fp32_modules,
        "_tied_weights_keys": model._tied_weights_keys,
        "all_tied_weights_keys": getattr(model, "all_tied_weights_keys", "absent"),
        "_weight_conversions": getattr(model, "_weight_conversions", "absent"),
        "dtype": model.dtype,
        "parameter dtypes": {name: p.dtype for name, p in model.named_parameters()},
        "tied parameters": sorted(names for names in ties.values() if len(names) > 1),
        "training": model.training,
        "modules training": sorted({m.training for m in model.modules()}),
    }


def plain_and_sharded(path: str, kind: str, entry: str = "class", **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``entry``: the model class itself, or the Auto class (which reads the config first and
    passes it in; TRL loads either way)."""
    import transformers

    import hf_zero

    cls = getattr(transformers, (AUTO_CLASSES if entry == "auto" else MODEL_CLASSES)[kind])
    plain = attributes(cls.from_pretrained(path, **kwargs))
    live = hf_zero.HfZeroConfig(ZERO3)  # alive while loading: the sharded path
    model = cls.from_pretrained(path, **kwargs)
    assert all(p.is_meta for p in model.parameters()), "the sharded path was not taken"
    sharded = attributes(model)
    del live
    return plain, sharded


def assert_same(plain: dict[str, Any], sharded: dict[str, Any]) -> None:
    differ = {key: (plain[key], sharded[key]) for key in plain if plain[key] != sharded[key]}
    assert not differ, f"(plain load, sharded load) differ on {sorted(differ)}: {differ}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """GPT-2 without generation_config.json (its generation config then comes from config.json),
    Llama with a generation_config.json of its own, BERT (no generation), T5."""
    from transformers import GenerationConfig

    dirs = {}
    for kind, build in {**BUILDERS, "t5": tiny_t5}.items():
        path = str(tmp_path_factory.mktemp(kind))
        build(seed=3).save_pretrained(path)
        if kind == "gpt2":
            os.remove(os.path.join(path, "generation_config.json"))
        if kind == "llama":
            GenerationConfig(do_sample=True, temperature=0.3, top_p=0.8, max_new_tokens=7, bos_token_id=1,
                             eos_token_id=2).save_pretrained(path)
        dirs[kind] = path
    return dirs


LOADS = {
    "plain": {},
    "bf16": {"dtype": torch.bfloat16},
    "config attributes": {"use_cache": False, "output_attentions": True},  # reach the generation config too
    "generation_config given": "generation_config",
}


@pytest.mark.parametrize("load", list(LOADS))
@pytest.mark.parametrize("entry", ["class", "auto"])
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_sharded_load_keeps_what_a_plain_load_sets(saved: dict[str, str], kind: str, entry: str, load: str) -> None:
    from transformers import GenerationConfig

    kwargs = LOADS[load]
    if kwargs == "generation_config":
        kwargs = {"generation_config": GenerationConfig(max_length=5, num_beams=2)}
    plain, sharded = plain_and_sharded(saved[kind], kind, entry, **kwargs)
    assert plain["config._name_or_path"] == plain["name_or_path"] == saved[kind]
    assert_same(plain, sharded)


def test_fp16_keeps_the_fp32_modules_in_fp32(saved: dict[str, str]) -> None:
    plain, sharded = plain_and_sharded(saved["t5"], "t5", dtype=torch.float16)
    kept = {name for name, dtype in plain["parameter dtypes"].items() if dtype == torch.float32}
    assert kept and all(".wo." in name for name in kept)
    assert_same(plain, sharded)


@pytest.mark.parametrize("stored", ["equal", "different"])
def test_tied_pair_stored_twice_is_tied_as_a_plain_load_ties_it(tmp_path, stored: str) -> None:
    """A checkpoint holding both names of a tied pair (other tools save them so): transformers
    ties them when the values are equal, and otherwise leaves them apart and drops the pair from
    ``all_tied_weights_keys``."""
    from safetensors.torch import load_file, save_file

    from tests.tiny_models import tiny_gpt2

    path = str(tmp_path / "gpt2")
    tiny_gpt2(seed=3).save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    weights["lm_head.weight"] = weights["transformer.wte.weight"] + (0.0 if stored == "equal" else 1.0)
    save_file(weights, file, metadata={"format": "pt"})
    plain, sharded = plain_and_sharded(path, "gpt2")
    assert bool(plain["tied parameters"]) == (stored == "equal")
    assert_same(plain, sharded)
