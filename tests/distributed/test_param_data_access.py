"""[Note: parameters read outside their unit]: reaching a sharded stage-3 parameter's freed
storage through ``.data`` (or ``detach()``, a view, ``copy.deepcopy``) gets hf_zero's clear error.
torch's CPU kernels read a freed storage without a check, so before the fix ``param.data.sum()``
killed the process with SIGSEGV: the reads run in a child process, and its exit status is
checked before anything it printed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.distributed.launch import run_process_tree

REPO = Path(__file__).resolve().parents[2]

_CHILD = r"""
import copy, json, torch
import hf_zero
from tests.distributed import scenarios as S

engine = S.stage3_llama_after_a_step()
ids = torch.randint(0, 97, (2, 12))
head = engine.module.lm_head.weight
kept = head.data  # held across the gather below
reads = {
    "data.sum": lambda: head.data.sum(),
    "data.row": lambda: head.data[0].clone(),
    "detach.sum": lambda: head.detach().sum(),
    "view.clone": lambda: head.view(-1).clone(),
    "torch.sum(data)": lambda: torch.sum(head.data),
    "deepcopy": lambda: copy.deepcopy(head),
}
errors = {}
for name, read in reads.items():
    try:
        read()
        errors[name] = None
    except RuntimeError as exc:
        errors[name] = str(exc)
with engine.gathered_parameters([head]):
    gathered = [float(head.detach().sum()), float(kept.sum())]
engine.backward(S.model_loss(engine, "llama", ids))  # training goes on unaffected
engine.step()
print("RESULT " + json.dumps({"errors": errors, "gathered": gathered, "shape": list(kept.shape)}))
"""


def test_data_of_a_sharded_parameter_gets_the_clear_error_not_a_crash():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = run_process_tree([sys.executable, "-c", _CHILD], cwd=REPO, env=env, timeout=300)
    assert proc.returncode >= 0, f"the child died of signal {-proc.returncode}:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    for name, error in result["errors"].items():
        assert error is not None, f"{name} read a freed parameter without an error"
        assert "'lm_head.weight' is sharded by ZeRO stage 3" in error and "gathered_parameters" in error, (name, error)
    # Metadata stays readable, and a view kept from before reads the values once gathered.
    assert result["shape"] == [97, 16]
    assert result["gathered"][0] == result["gathered"][1] != 0.0
