"""The README's Trainer-less code blocks run as printed.

Each ``python`` block of "Using it without the Trainer" is taken from README.md unchanged and run
in a fresh process (no launcher environment: world size 1), after a prelude that defines only
the names the text leaves to the reader: ``model`` ("any nn.Module"), ``dataset`` (the training
data), ``path`` (a model folder) with ``AutoModelForCausalLM``, and ``config`` ("the config
above", for the block that reuses it). A block that stops running as printed fails here.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.integration.conftest import REPO, subprocess_env

SECTION = "## Using it without the Trainer"

# Only the names the README's text leaves to the reader. The data are learnable Markov-chain
# batches (hf_zero.demo's), 2 sequences of 16 tokens per row.
PRELUDE = """
import torch
from transformers import AutoModelForCausalLM
from tests.tiny_models import tiny_gpt2
from hf_zero.demo import markov_batch, markov_successors

model = tiny_gpt2(seed=0)
model.loss_type = "ForCausalLM"
successors = markov_successors(64, seed=0)
dataset = [{"input_ids": ids, "labels": ids} for ids in markov_batch(successors, 16, 16, seed=1)]
path = "{model_dir}"
"""

EPILOGUE = """
assert engine.optimizer is not None, "the block trains with no optimizer"
assert engine.global_steps >= 1, engine.global_steps
print("SNIPPET OK", type(engine).__name__, engine.global_steps)
"""


def _blocks() -> list[str]:
    section = (REPO / "README.md").read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def test_the_section_has_the_initialize_and_sharded_loading_blocks() -> None:
    blocks = _blocks()
    assert len(blocks) == 2, blocks
    assert "hf_zero.initialize(" in blocks[0] and "for batch in dataloader:" in blocks[0]
    assert "from_pretrained(path)" in blocks[1]


def _run(code: str, tmp_path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("index", [0, 1], ids=["initialize", "sharded-loading"])
def test_readme_block_runs_as_printed(index: int, tmp_path) -> None:
    blocks = _blocks()
    model_dir = tmp_path / "model"
    prelude = PRELUDE.replace("{model_dir}", str(model_dir))
    if index == 0:
        code = prelude + blocks[0] + EPILOGUE
    else:
        # "the config above": the first block's config; the block trains one step on the model it loads.
        config = blocks[0].split("engine, optimizer, dataloader, lr_scheduler =", 1)[0]
        train = ("\nids = dataset[0]['input_ids'][None]\nloss = engine(input_ids=ids, labels=ids).loss\n"
                 "engine.backward(loss)\nengine.step()\n")
        code = (prelude + "import hf_zero\nmodel.save_pretrained(path)\ndel model\n" + config + "\n"
                + blocks[1] + train + EPILOGUE)
    run = _run(code, tmp_path)
    assert run.returncode == 0 and "SNIPPET OK" in run.stdout, code + "\n" + run.stdout[-3000:] + run.stderr[-5000:]
