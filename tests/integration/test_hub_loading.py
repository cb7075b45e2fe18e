"""Models named the ways users name them, under a live stage-3 config: hub ids resolved from a
local hub cache (offline), revisions, subfolders, sharded checkpoints with their index, the
keywords example scripts pass; what cannot load sharded says why on every rank; a model that no
engine takes materialises itself on first use; resize_token_embeddings before initialize.
(See hf_zero/integrations/zero3_loading.py and hf_zero/engine/sharding/deferred_load.py.)"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import pytest
import torch

from tests.distributed.launch import run_distributed

REPO_ID = "org/tiny-llama"
MAIN, OTHER = "a" * 40, "b" * 40
ZERO3 = {"train_micro_batch_size_per_gpu": 1,
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def small_llama(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=61, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def lay_out_hub_cache(cache: str, repo_id: str, snapshots: dict[str, str], main: str) -> str:
    """``models--org--name/snapshots/<hash>/`` (a copy of each folder) and ``refs/main``, as
    huggingface_hub leaves them after a download. Returns the repository folder."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    for commit, folder in snapshots.items():
        shutil.copytree(folder, os.path.join(repo, "snapshots", commit))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(main)
    return repo


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hub")
    main, other = str(root / "main"), str(root / "other")
    small_llama(seed=1).save_pretrained(main, max_shard_size="20KB")  # several shards + index
    small_llama(seed=2).save_pretrained(other)  # one model.safetensors
    nested = str(root / "nested")
    shutil.copytree(main, os.path.join(nested, "checkpoint"))
    bin_only = small_llama(seed=3)  # the format older checkpoints have (transformers 5 saves none)
    bin_only.config.save_pretrained(str(root / "bin_only"))
    torch.save(bin_only.state_dict(), str(root / "bin_only" / "pytorch_model.bin"))
    cache = str(root / "cache")
    lay_out_hub_cache(cache, REPO_ID, {MAIN: main, OTHER: other}, MAIN)
    return {"main": main, "other": other, "nested": nested, "cache": cache, "bin_only": str(root / "bin_only")}


class _Warnings(logging.Handler):
    """hf_zero's warnings while it is in a ``with`` block."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> "_Warnings":
        logging.getLogger("hf_zero").addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        logging.getLogger("hf_zero").removeHandler(self)


def _plain_logits(folder: str, ids: torch.Tensor, attn_implementation: str | None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn_implementation)
        return model(input_ids=ids).logits


# The ways a model is named, as (class, from_pretrained arguments, the folder a plain load reads).
# Auto classes resolve config attributes themselves; a model class leaves them to from_pretrained.
def _variants(hub: dict[str, str]) -> dict[str, tuple[str, str, dict[str, Any], str]]:
    from transformers import AutoConfig

    return {
        "hub id": ("AutoModelForCausalLM", REPO_ID, {}, hub["main"]),
        "hub id, revision": ("AutoModelForCausalLM", REPO_ID, {"revision": OTHER}, hub["other"]),
        "hub id, run_clm keywords": ("AutoModelForCausalLM", REPO_ID, dict(
            from_tf=False, config=AutoConfig.from_pretrained(hub["main"]), cache_dir=hub["cache"],
            revision="main", token=None, trust_remote_code=False, dtype="auto",
            low_cpu_mem_usage=True), hub["main"]),
        "hub id, TRL keywords": ("LlamaForCausalLM", REPO_ID, dict(
            torch_dtype=torch.float32, attn_implementation="eager", use_cache=False), hub["main"]),
        "folder, subfolder": ("AutoModelForCausalLM", hub["nested"], {"subfolder": "checkpoint"}, hub["main"]),
    }


def _load_every_way(hub: dict[str, str]) -> dict[str, Any]:
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    out: dict[str, Any] = {}
    with _Warnings() as warnings:
        for name, (cls, path, kwargs, plain_folder) in _variants(hub).items():
            out[name] = _load_one_way(cls, path, kwargs, plain_folder, ids)
    out["warnings"] = warnings.messages
    return out


def _load_one_way(cls: str, path: str, kwargs: dict[str, Any], plain_folder: str, ids: torch.Tensor) -> dict[str, Any]:
    import transformers

    import hf_zero

    live = hf_zero.HfZeroConfig(ZERO3)
    model = getattr(transformers, cls).from_pretrained(path, **kwargs)
    on_meta = all(p.is_meta for p in model.parameters())
    engine, *_ = hf_zero.initialize(model=model, config=live)
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    del live
    plain = _plain_logits(plain_folder, ids, kwargs.get("attn_implementation"))
    return {"on_meta": on_meta, "use_cache": model.config.use_cache,
            "attn": model.config._attn_implementation, "max_diff": float((logits - plain).abs().max())}


def _every_scenario(hub: dict[str, str], saved: str) -> dict[str, Any]:
    # One launch of two ranks for all of them: starting processes is most of the time.
    return {"every way": _load_every_way(hub), "fallbacks": _fallbacks(hub),
            "resize": _resize_then_initialize(hub), "rank0 reload": _train_then_load_on_rank0(hub, saved)}


@pytest.fixture(scope="module")
def ranks(hub: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], str]:
    saved = str(tmp_path_factory.mktemp("trained"))
    with pytest.MonkeyPatch.context() as patch:
        # The spawned ranks read these when they first import huggingface_hub.
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_HUB_CACHE", hub["cache"])
        return run_distributed(_every_scenario, 2, hub, saved), saved


def test_hub_ids_and_keywords_load_sharded(ranks):
    for rank_result in [r["every way"] for r in ranks[0]]:
        assert rank_result.pop("warnings") == []
        for name, r in rank_result.items():
            assert r["on_meta"], name
            assert r["max_diff"] == 0.0, name
        assert rank_result["hub id, TRL keywords"]["use_cache"] is False  # a config attribute
        assert rank_result["hub id, TRL keywords"]["attn"] == "eager"


def _fallbacks(hub: dict[str, str]) -> dict[str, Any]:
    import transformers

    import hf_zero

    live = hf_zero.HfZeroConfig(ZERO3)
    out = {}
    for name, (path, kwargs) in {"bin": (hub["bin_only"], {}), "device_map": (REPO_ID, {"device_map": "cpu"}),
                                 "from_tf": (REPO_ID, {"from_tf": True})}.items():
        with _Warnings() as warnings:
            model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
        out[name] = {"on_meta": any(p.is_meta for p in model.parameters()), "warnings": warnings.messages}
    del live
    return out


def test_what_cannot_load_sharded_warns_on_every_rank_naming_why(ranks):
    for rank_result in [r["fallbacks"] for r in ranks[0]]:
        for name, r in rank_result.items():
            assert not r["on_meta"], name  # a full, usable model
            assert len(r["warnings"]) == 1, (name, r["warnings"])
        assert ".bin" in rank_result["bin"]["warnings"][0]
        assert "device_map='cpu'" in rank_result["device_map"]["warnings"][0]
        assert "from_tf=True" in rank_result["from_tf"]["warnings"][0]


def _train_then_load_on_rank0(hub: dict[str, str], saved: str) -> dict[str, Any]:
    import transformers

    import hf_zero

    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    live = hf_zero.HfZeroConfig(dict(ZERO3, optimizer={"type": "AdamW", "params": {"lr": 1e-2}}))
    model = transformers.AutoModelForCausalLM.from_pretrained(REPO_ID)
    engine, *_ = hf_zero.initialize(model=model, config=live)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    from hf_zero.integrations._weights import gather_full_state_dict

    state_dict = gather_full_state_dict(engine)  # collective; rank 0 gets the full weights
    if engine.rank == 0:
        model.save_pretrained(saved, state_dict=state_dict)
    out: dict[str, Any] = {"live": hf_zero.config.live.live_zero3_config() is live}
    if engine.rank == 0:  # the other rank takes part in nothing from here on
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(saved)
        out["reloaded_on_meta"] = all(p.is_meta for p in reloaded.parameters())
        with torch.no_grad():
            out["loss"] = float(reloaded(input_ids=ids, labels=ids).loss)
    return out


def test_rank0_only_from_pretrained_after_training_gives_the_plain_loss(ranks, hub):
    from transformers import AutoModelForCausalLM

    results, saved = [r["rank0 reload"] for r in ranks[0]], ranks[1]
    assert results[0]["live"] and results[0]["reloaded_on_meta"]
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = float(AutoModelForCausalLM.from_pretrained(saved)(input_ids=ids, labels=ids).loss)
        untrained = float(AutoModelForCausalLM.from_pretrained(hub["main"])(input_ids=ids, labels=ids).loss)
    assert results[0]["loss"] == expected
    assert abs(expected - untrained) > 1e-3  # the trained weights were saved and read back


def _resize_then_initialize(hub: dict[str, str]) -> dict[str, Any]:
    import transformers

    import hf_zero

    ids = torch.tensor([[1, 5, 96, 97, 101]])  # old and new token ids
    live = hf_zero.HfZeroConfig(ZERO3)
    model = transformers.AutoModelForCausalLM.from_pretrained(REPO_ID)
    torch.manual_seed(100 + int(os.environ["RANK"]))  # different new rows per rank: rank 0's win
    model.resize_token_embeddings(102)
    engine, *_ = hf_zero.initialize(model=model, config=live)
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    return {"vocab": model.config.vocab_size, "logits": logits.tolist()}


def test_resize_token_embeddings_before_initialize(ranks, hub):
    from transformers import AutoModelForCausalLM

    results = [r["resize"] for r in ranks[0]]
    plain = AutoModelForCausalLM.from_pretrained(hub["main"])
    torch.manual_seed(100)
    plain.resize_token_embeddings(102)
    with torch.no_grad():
        expected = plain(input_ids=torch.tensor([[1, 5, 96, 97, 101]])).logits
    assert results[0]["logits"] == results[1]["logits"]  # rank 0's new rows on both
    for r in results:
        assert r["vocab"] == 102
        # New rows drawn with another seed differ by ~1e-2; summation order by ~1e-7.
        assert float((torch.tensor(r["logits"]) - expected).abs().max()) < 1e-5
