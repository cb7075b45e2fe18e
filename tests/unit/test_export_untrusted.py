"""``export_hf_model`` on an edited manifest.json: nothing in it runs as a pattern or is looked up
by name, its types are checked, and its names, shapes and ties are compared with the model its
config describes; every refusal happens before the output folder is created or changed.

The checkpoints are written by world-size-1 engines in this process (no process group);
tests/distributed/test_untrusted_checkpoint.py runs the load side of the same idea.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import random
import re
import shutil
import signal
import time
from typing import Any, Callable, Iterator

import pytest

from hf_zero.checkpoint import CheckpointError, export_hf_model
from hf_zero.checkpoint.export import pattern_found_in, plain_pattern

Edit = Callable[[dict[str, Any]], None]
LLAMA_MLP = "model.layers.0.mlp.gate_proj.weight"  # [37, 16] in tests/tiny_models.tiny_llama


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A save directory per model, and the export of each unedited checkpoint."""
    import hf_zero
    from tests.distributed import scenarios as S

    root = tmp_path_factory.mktemp("saved")
    with pytest.MonkeyPatch.context() as mp:
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
            mp.delenv(name, raising=False)
        paths = {}
        for model in ("gpt2", "llama"):
            sc = S.scenario(model, 3)
            engine, *_ = hf_zero.initialize(model=S.build_model(sc), config=S.make_config(sc))
            paths[model] = str(root / model)
            engine.save_checkpoint(paths[model])
            paths[f"{model}_export"] = export_hf_model(paths[model], root / f"{model}_export")
    return paths


def _edited(saved: dict[str, str], model: str, edit: Edit, where: str) -> str:
    save_dir = os.path.join(where, "ckpt")
    shutil.copytree(saved[model], save_dir)
    with open(os.path.join(save_dir, "latest")) as handle:
        path = os.path.join(save_dir, handle.read().strip(), "manifest.json")
    with open(path) as handle:
        manifest = json.load(handle)
    edit(manifest)
    with open(path, "w") as handle:
        json.dump(manifest, handle)
    return save_dir


def _snapshot(folder: str | os.PathLike[str]) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(pathlib.Path(folder).iterdir())}


@contextlib.contextmanager
def _at_most(seconds: int) -> Iterator[None]:
    """A case that hangs fails instead (a backtracking pattern would run for minutes)."""
    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ------------------------------------------------------------------ the edits
def _old_style(patterns: list[Any]) -> Edit:
    """A manifest from before tied_weight_names: only the patterns."""
    def edit(manifest: dict[str, Any]) -> None:
        del manifest["model"]["tied_weight_names"]
        manifest["model"]["tied_weight_keys"] = patterns
    return edit


def _set_model(key: str, value: Any) -> Edit:
    return lambda manifest: manifest["model"].__setitem__(key, value)


def _slot(name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda manifest: next(s for g in manifest["groups"] for s in g["slots"] if s["name"] == name)


def _transpose(name: str) -> Edit:
    def edit(manifest: dict[str, Any]) -> None:
        slot = _slot(name)(manifest)
        slot["shape"] = slot["shape"][::-1]  # same elements: the data stays consistent
    return edit


def _rename(name: str, new: str) -> Edit:
    return lambda manifest: _slot(name)(manifest).__setitem__("name", new)


def _alias(alias: str, canonical: str) -> Edit:
    return lambda manifest: manifest["model"]["aliases"].__setitem__(alias, canonical)


def _tie_in(alias: str, canonical: str) -> Edit:
    """``alias`` made a second name of ``canonical``: its own weight is no longer exported."""
    def edit(manifest: dict[str, Any]) -> None:
        for group in manifest["groups"]:
            group["slots"] = [s for s in group["slots"] if s["name"] != alias]
        # the alias's group (its own unit) goes with it: a group without slots holds nothing
        manifest["groups"] = [group for group in manifest["groups"] if group["slots"]]
        manifest["model"]["aliases"][alias] = canonical
    return edit


def _config(key: str, value: Any) -> Edit:
    return lambda manifest: manifest["model"]["config"].__setitem__(key, value)


def _buffer(dtype: Any, shape: Any) -> Edit:
    return lambda manifest: manifest["model"]["buffers"].append({"name": "extra", "dtype": dtype, "shape": shape})


# case: (model, edit, phrases the error holds)
CASES: dict[str, tuple[str, Edit, list[str]]] = {
    "pattern_backtracks": ("gpt2", _old_style(["(.*.*)*Q"]),
                           ["model.tied_weight_keys[0] is '(.*.*)*Q', not a plain parameter name"]),
    "pattern_unbalanced": ("gpt2", _old_style(["("]), ["model.tied_weight_keys[0] is '(', not a plain parameter name"]),
    "pattern_too_long": ("gpt2", _old_style(["a" * 513]), ["model.tied_weight_keys[0]", "not a plain parameter name"]),
    "pattern_not_a_string": ("gpt2", _old_style([7]), ["model.tied_weight_keys is [7], not a list of strings"]),
    "tied_names_not_strings": ("gpt2", _set_model("tied_weight_names", "lm_head.weight"),
                               ["model.tied_weight_names is 'lm_head.weight', not a list of strings"]),
    "ignored_keys_not_strings": ("gpt2", _set_model("keys_to_ignore_on_save", [None]),
                                 ["model.keys_to_ignore_on_save is [None], not a list of strings"]),
    "aliases_not_names": ("gpt2", _set_model("aliases", ["lm_head.weight"]), ["not an object of parameter names"]),
    "alias_of_nothing": ("gpt2", _alias("lm_head.weight", "nowhere.weight"),
                         ["model.aliases['lm_head.weight'] is 'nowhere.weight', which is not a saved parameter"]),
    "buffer_dtype_load": ("llama", _buffer("load", [1]),
                          ["model.buffers[0].dtype is 'load', not a dtype a checkpoint holds"]),
    "buffer_shape_negative": ("llama", _buffer("float32", [-1]),
                              ["model.buffers[0].shape is [-1], not a list of sizes"]),
    "slot_shape_wrong_size": ("llama", lambda m: _slot(LLAMA_MLP)(m).__setitem__("shape", [16, 38]),
                              [f"({LLAMA_MLP!r}) has numel 592, its shape [16, 38] holds 608"]),
    "name_twice": ("llama", _alias("model.norm.weight", "lm_head.weight"),
                   ["'model.norm.weight' is recorded more than once"]),
    "transposed_weight": ("llama", _transpose(LLAMA_MLP),
                          ["do not match the LlamaForCausalLM",
                           f"{LLAMA_MLP}: the model has [37, 16], the checkpoint [16, 37]"]),
    "renamed_parameter": ("llama", _rename("model.norm.weight", "model.final_norm.weight"),
                          ["do not match the LlamaForCausalLM", "model.norm.weight: missing (the model has [16])",
                           "model.final_norm.weight [16]: not in the model"]),
    "extra_parameter": ("llama", _alias("model.extra.weight", "model.norm.weight"),
                        ["do not match the LlamaForCausalLM", "model.extra.weight [16]: not in the model"]),
    "untied_weight_tied_in": ("llama", _tie_in("lm_head.weight", "model.embed_tokens.weight"),
                              ["do not match the LlamaForCausalLM",
                               ("lm_head.weight: shares its weight with ['model.embed_tokens.weight'] in the "
                                "checkpoint, with [] in the model")]),
    "config_of_a_million_layers": ("llama", _config("num_hidden_layers", 10**6),
                                   ["model.config does not build a LlamaForCausalLM", "more than"]),
    "config_of_another_width": ("llama", _config("hidden_size", 32), ["do not match the LlamaForCausalLM"]),
    "model_type_of_another_model": ("gpt2", _config("model_type", "llama"),
                                    ["model_type 'llama', but its class GPT2LMHeadModel is a 'gpt2' model"]),
    "model_type_unknown": ("llama", _config("model_type", "nonsense"),
                           ["model_type 'nonsense', but its class LlamaForCausalLM is a 'llama' model"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_edited_manifest_is_refused_before_anything_is_written(saved, tmp_path, case):
    model, edit, phrases = CASES[case]
    save_dir = _edited(saved, model, edit, str(tmp_path))
    previous = str(tmp_path / "previous")
    shutil.copytree(saved[f"{model}_export"], previous)
    before = _snapshot(previous)
    for out in (str(tmp_path / "new"), previous):
        started = time.monotonic()
        with _at_most(20), pytest.raises(CheckpointError) as refused:
            export_hf_model(save_dir, out)
        assert time.monotonic() - started < 5.0, f"{case} took {time.monotonic() - started:.1f} s"
        message = str(refused.value)
        assert "manifest.json" in message and "nothing was written" in message, message
        for phrase in phrases:
            assert phrase in message, message
    assert not os.path.exists(tmp_path / "new")
    assert _snapshot(previous) == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "previous"]  # no staging folder left


def test_a_backtracking_pattern_is_refused_within_a_second(saved, tmp_path):
    save_dir = _edited(saved, "gpt2", _old_style(["(.*.*)*Q", "lm_head.weight"]), str(tmp_path))
    started = time.monotonic()
    with _at_most(20), pytest.raises(CheckpointError, match=re.escape("'(.*.*)*Q', not a plain parameter name")):
        export_hf_model(save_dir, tmp_path / "out")
    assert time.monotonic() - started < 1.0
    assert not (tmp_path / "out").exists()


def test_a_manifest_from_before_tied_weight_names_exports_as_before(saved, tmp_path):
    save_dir = _edited(saved, "gpt2", _old_style(["lm_head.weight"]), str(tmp_path))
    out = export_hf_model(save_dir, tmp_path / "out")
    assert _snapshot(out) == _snapshot(saved["gpt2_export"])  # lm_head.weight dropped, as save_pretrained does
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names


def test_the_tied_names_are_recorded_at_save_time(saved):
    from hf_zero.checkpoint import read_manifest, resolve_checkpoint_dir

    model = read_manifest(resolve_checkpoint_dir(saved["gpt2"], None))["model"]
    assert model["tied_weight_names"] == ["lm_head.weight"]
    assert model["aliases"] == {"lm_head.weight": "transformer.wte.weight"}


def test_a_model_changed_after_it_was_built_exports_when_the_caller_says_so(saved, tmp_path, caplog):
    save_dir = _edited(saved, "llama", _rename("model.norm.weight", "model.final_norm.weight"), str(tmp_path))
    with pytest.raises(CheckpointError, match="--skip-model-check"):
        export_hf_model(save_dir, tmp_path / "out")
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        export_hf_model(save_dir, tmp_path / "out", check_model=False)
    assert "without comparing them with a model (check_model=False)" in caplog.text
    from safetensors import safe_open

    with safe_open(os.path.join(tmp_path / "out", "model.safetensors"), framework="pt") as f:
        assert "model.final_norm.weight" in set(f.keys())


@pytest.mark.parametrize("model,model_type,phrase", [
    ("llama", "nonsense", "does not load with AutoConfig"),
    ("gpt2", "llama", "loads as a LlamaConfig, not the GPT2Config of GPT2LMHeadModel"),
])
def test_a_previous_export_stays_until_the_new_one_loads(saved, tmp_path, model, model_type, phrase):
    """Issue 46: with the model check skipped, a config that AutoConfig cannot load, or loads as
    another model's, is still refused before the swap: the previous export stays byte for byte,
    and no staging folder is left."""
    save_dir = _edited(saved, model, _config("model_type", model_type), str(tmp_path))
    previous = str(tmp_path / "previous")
    shutil.copytree(saved[f"{model}_export"], previous)
    before = _snapshot(previous)
    with pytest.raises(CheckpointError, match=phrase) as refused:
        export_hf_model(save_dir, previous, check_model=False)
    assert "the previous export there is untouched" in str(refused.value)
    assert _snapshot(previous) == before
    with pytest.raises(CheckpointError, match="nothing was written"):
        export_hf_model(save_dir, tmp_path / "new", check_model=False)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "previous"]


@pytest.mark.parametrize("name", ["MyLlama", "__import__", "os", "load_tf_weights_in_gpt2", "PretrainedConfig"])
def test_a_class_transformers_does_not_define_exports_with_one_warning(saved, tmp_path, caplog, name):
    save_dir = _edited(saved, "llama", _set_model("class", name), str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        export_hf_model(save_dir, tmp_path / "out")
    unchecked = [r for r in caplog.records if "cannot check the checkpoint's parameter names" in r.getMessage()]
    assert len(unchecked) == 1 and "not a transformers model class" in unchecked[0].getMessage()
    assert _snapshot(tmp_path / "out")["model.safetensors"] == _snapshot(saved["llama_export"])["model.safetensors"]


def test_config_values_that_name_things_are_not_looked_up(saved, tmp_path):
    """A dtype name or a kernel in the config changes no shape: the check builds without them."""
    def edit(manifest: dict[str, Any]) -> None:
        manifest["model"]["config"].update(dtype="load", torch_dtype="save", attn_implementation="kernels-community/x")

    out = export_hf_model(_edited(saved, "llama", edit, str(tmp_path)), tmp_path / "out")
    assert json.loads(pathlib.Path(out, "config.json").read_text())["dtype"] == "float32"


# ------------------------------------------------------------------ the matcher of old manifests
@pytest.mark.parametrize("pattern,name", [("lm_head.weight", "lm_head.weight"), ("lm_head.weight", "lm_headXweight"),
                                          ("head.weight", "lm_head.weight"), ("lm_head.weight", "lm_head.weights"),
                                          ("a.b", "a\nb"), ("decoder.weight", "cls.predictions.decoder.bias"),
                                          ("..", "a"), ("x", "")])
def test_plain_patterns_match_as_re_search_does(pattern, name):
    assert plain_pattern(pattern)
    assert pattern_found_in(pattern, name) == bool(re.search(pattern, name))


def test_plain_patterns_match_as_re_search_does_on_random_names():
    rng = random.Random(0)
    for _ in range(3000):
        pattern = "".join(rng.choice("ab.") for _ in range(rng.randint(1, 5)))
        name = "".join(rng.choice("ab.\n") for _ in range(rng.randint(0, 12)))
        assert pattern_found_in(pattern, name) == bool(re.search(pattern, name)), (pattern, name)


@pytest.mark.parametrize("pattern", ["(", "(.*.*)*Q", "a|b", "^lm_head", "x" * 513, "", 7, None])
def test_anything_but_a_plain_dotted_name_is_not_a_plain_pattern(pattern):
    assert not plain_pattern(pattern)


def test_the_matcher_is_linear_in_the_name():
    started = time.monotonic()
    assert not pattern_found_in("a" * 511 + "b", "a" * 200_000)
    assert time.monotonic() - started < 1.0


def test_an_export_into_its_own_checkpoint_is_refused_through_links(saved, tmp_path):
    """Issue 46: an output path that is a link to the checkpoint's tag folder, or a folder inside it,
    is refused before anything is written; the checkpoint stays byte for byte as it was."""
    save_dir = str(tmp_path / "ckpt")
    shutil.copytree(saved["gpt2"], save_dir)
    with open(os.path.join(save_dir, "latest")) as handle:
        tag_dir = os.path.join(save_dir, handle.read().strip())
    before = {name: pathlib.Path(tag_dir, name).read_bytes() for name in sorted(os.listdir(tag_dir))}
    link = tmp_path / "out-link"
    link.symlink_to(tag_dir)
    with pytest.raises(CheckpointError, match="contains the checkpoint"):
        export_hf_model(save_dir, link)
    with pytest.raises(CheckpointError, match="is inside the checkpoint"):
        export_hf_model(save_dir, os.path.join(tag_dir, "hf"))
    assert {name: pathlib.Path(tag_dir, name).read_bytes() for name in sorted(os.listdir(tag_dir))} == before
    assert link.is_symlink() and not any(n.startswith(".") for n in os.listdir(tmp_path) if n != "ckpt")
