"""ZeRO-3 sharded loading: with a stage-3 HfZeroConfig alive, ``from_pretrained`` gives a model
whose parameters are on the meta device, and ``hf_zero.initialize`` reads each rank's shard
straight from the safetensors files (see hf_zero/integrations/zero3_loading.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

from tests.distributed.launch import run_distributed
from tests.tiny_models import BUILDERS

ZERO3 = {"train_micro_batch_size_per_gpu": 2,
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _load_and_compare(model_dirs: dict[str, str], stage: int) -> dict[str, Any]:
    import transformers

    import hf_zero

    out: dict[str, Any] = {}
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    for kind, path in model_dirs.items():
        config = dict(ZERO3, zero_optimization=dict(ZERO3["zero_optimization"], stage=stage))
        live = hf_zero.HfZeroConfig(config)  # kept alive while loading: sharded from_pretrained
        cls = getattr(transformers, open(os.path.join(path, "class.txt")).read())
        lazy = cls.from_pretrained(path)
        on_meta = all(p.is_meta for p in lazy.parameters())
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
        engine, _, _, _ = hf_zero.initialize(model=lazy, config=config)
        engine.eval()
        with torch.no_grad():
            logits = engine(input_ids=ids).logits
        engine.train()  # a training step too: backward re-gathers into the loaded parameters
        loss = (engine(input_ids=ids, labels=ids) if kind != "bert" else engine(input_ids=ids, labels=ids[:, 0] % 3)).loss
        engine.backward(loss)
        engine.step()
        del live
        plain = cls.from_pretrained(path).eval()  # no live config: the normal path
        with torch.no_grad():
            expected = plain(input_ids=ids).logits
        out[kind] = {"on_meta": on_meta, "trained": engine.global_steps == 1, "plain_on_meta": any(p.is_meta for p in plain.parameters()),
                     "max_diff": float((logits - expected).abs().max()),
                     "param_bytes": engine.memory_report()["compute_params"]}
    return out


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    dirs = {}
    for kind, build in BUILDERS.items():
        path = str(tmp_path_factory.mktemp(kind))
        model = build(seed=3)
        model.save_pretrained(path)
        with open(os.path.join(path, "class.txt"), "w") as f:
            f.write(type(model).__name__)
        dirs[kind] = path
    return dirs


@pytest.mark.parametrize("stage", [3, 2])
def test_sharded_from_pretrained_gives_the_same_outputs(saved_models, stage):
    """Stage 3 loads lazily; a stage-2 config is not a live stage-3 config, so it loads normally."""
    for rank_result in run_distributed(_load_and_compare, 2, saved_models, stage):
        for kind, r in rank_result.items():
            assert r["on_meta"] == (stage == 3), kind
            assert r["trained"], kind
            assert not r["plain_on_meta"]
            assert r["max_diff"] == 0.0, kind


def test_meta_model_without_a_source_is_a_clear_error():
    import hf_zero

    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="meta device"):
        hf_zero.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})


def _edited_checkpoint(root: str, edit: str) -> str:
    """A tiny Llama checkpoint with one extra tensor, or with one weight of another shape."""
    from safetensors.torch import load_file, save_file

    from tests.tiny_models import tiny_llama

    path = os.path.join(root, edit)
    tiny_llama(seed=1).save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    if edit == "extra":
        weights["model.extra_proj.weight"] = torch.ones(3, 3)
    elif edit == "shape":
        weights["model.norm.weight"] = torch.ones(weights["model.norm.weight"].numel() + 1)
    save_file(weights, file, metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("edit", ["none", "extra", "shape"])
def test_loading_info_is_what_a_plain_load_reports(tmp_path, edit):
    """output_loading_info under a live stage-3 config: the unexpected keys of a lazy load, and
    a weight of another shape handed to transformers' full load (which raises, or re-initialises
    it under ignore_mismatched_sizes=True and says so)."""
    import transformers

    import hf_zero

    path = _edited_checkpoint(str(tmp_path), edit)
    kwargs = {"output_loading_info": True, "ignore_mismatched_sizes": edit == "shape"}
    _, expected = transformers.LlamaForCausalLM.from_pretrained(path, **kwargs)
    live = hf_zero.HfZeroConfig(ZERO3)
    model, info = transformers.LlamaForCausalLM.from_pretrained(path, **kwargs)
    assert info == expected
    assert all(p.is_meta for p in model.parameters()) == (edit != "shape")  # the full load is not lazy
    assert info["unexpected_keys"] == ({"model.extra_proj.weight"} if edit == "extra" else set())
    if edit == "shape":
        assert info["mismatched_keys"], info
        with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
            transformers.LlamaForCausalLM.from_pretrained(path)
    del live


# ------------------------------------------------------------------ memory
BIG = dict(vocab_size=8192, n_positions=64, n_embd=1024, n_layer=8, n_head=16)  # 109M parameters
FIXED_OVERHEAD_MB = 96  # allocator slack, safetensors mmap bookkeeping, the transient per-param read

RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    import transformers, hf_zero

    def rss_mb(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) / 1024

    lazy = sys.argv[2] == "lazy"
    config = {"train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    live = hf_zero.HfZeroConfig(config) if lazy else None
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    before = rss_mb("VmRSS")
    model = transformers.GPT2LMHeadModel.from_pretrained(sys.argv[1])
    engine, *_ = hf_zero.initialize(model=model, config=live or config)
    peak = rss_mb("VmHWM")
    if engine.rank == 0:
        print(json.dumps({"peak_increase_mb": peak - before,
                          "params_bytes": engine.memory_report()["compute_params"]}))
""")


def _peak_increase_mb(model_dir: str, mode: str, tmp_path) -> float:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(script), model_dir, mode],
        capture_output=True, text=True, timeout=300,
        # A fixed glibc mmap threshold makes peak RSS independent of allocation history.
        env=dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536"))
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    line = [l for l in done.stdout.splitlines() if l.startswith("{")][-1]
    return json.loads(line)["peak_increase_mb"]


def test_sharded_load_peak_memory_is_shard_plus_one_unit(tmp_path):
    model_dir = str(tmp_path / "big")
    subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import torch, transformers
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(transformers.GPT2Config(**{BIG!r})).save_pretrained({model_dir!r})
    """)], check=True, timeout=300)
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        meta = GPT2LMHeadModel(GPT2Config(**BIG))
    numel = sum(p.numel() for p in meta.parameters())
    assert numel >= 100_000_000
    largest_unit = max(sum(p.numel() for p in block.parameters()) for block in meta.transformer.h)
    bound = (numel * 4 / 2 + largest_unit * 4) / 2**20 + FIXED_OVERHEAD_MB
    lazy = _peak_increase_mb(model_dir, "lazy", tmp_path)
    assert lazy < bound, f"sharded load peaked at +{lazy:.0f} MiB per rank, bound {bound:.0f} MiB"
    # The same load without the live config builds the whole model on every rank first: the
    # bound is tight enough to tell the two apart.
    plain = _peak_increase_mb(model_dir, "plain", tmp_path)
    assert plain > bound, f"plain load +{plain:.0f} MiB should exceed {bound:.0f} MiB"
