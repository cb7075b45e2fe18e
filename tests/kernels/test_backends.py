"""Which backend runs, and the fallback when triton cannot be imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hf_zero import kernels
from hf_zero.kernels import dispatch

CPU_BACKENDS = {
    "fused_adam_": "torch-fused-cpu",
    "pack_for_reduce_scatter": "reference",
    "unpack_after_all_gather": "reference",
    "nonfinite_and_sqnorm": "reference",
    "quantize_int8_blocks": "reference",
    "dequantize_int8_blocks": "reference",
    "quantize_int4_blocks": "reference",
    "dequantize_int4_blocks": "reference",
}


def test_cpu_tensors_run_the_backend_this_run_tests() -> None:
    # See [Note: two runs] in conftest: interpreter when asked for and available, else the CPU paths.
    interpreted = dispatch.INTERPRET and dispatch.TRITON_IMPORT_ERROR is None
    expected = {op: "triton-interpret" for op in kernels.OPS} if interpreted else CPU_BACKENDS
    assert {op: kernels.backend_for(torch.zeros(2), op) for op in kernels.OPS} == expected


def test_unknown_op_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown op 'adam'; expected one of"):
        kernels.backend_for(torch.zeros(1), "adam")


# Runs in a fresh interpreter: a meta-path finder refuses triton before anything imports it.
# It raises ModuleNotFoundError, what a missing triton raises: torch 2.15's CUDA build probes
# triton with importlib.util.find_spec while torch is imported, and tolerates only that error.
# TRITON_INTERPRET=1 is set too, to show that asking for the interpreter without triton is no error.
_FALLBACK_SCRIPT = textwrap.dedent(
    """
    import json, logging, os, sys

    class RefuseTriton:
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError("triton refused by the test")
            return None

    sys.meta_path.insert(0, RefuseTriton())
    os.environ["TRITON_INTERPRET"] = "1"
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hf_zero").addHandler(handler)
    logging.getLogger("hf_zero").setLevel(logging.INFO)

    import torch
    from hf_zero import kernels
    from hf_zero.kernels import reference

    torch.manual_seed(0)
    ok = []
    for _ in range(2):  # twice: the log must appear once
        p, m, v = torch.randn(33), torch.zeros(33), torch.zeros(33)
        g = torch.randn(33).bfloat16()
        expected = [t.clone() for t in (p, m, v)]
        hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=1)
        kernels.fused_adam_(p, g, m, v, **hp)
        reference.fused_adam_(*expected[:1], g, *expected[1:], **hp)
        ok.append(all(torch.allclose(a, b, rtol=1e-6, atol=1e-9) for a, b in zip((p, m, v), expected)))
        units = [torch.randn(6), torch.randn(4)]
        buffer, expected_buffer = torch.empty(10), torch.empty(10)
        kernels.pack_for_reduce_scatter(units, 2, buffer, 0.5)
        reference.pack_for_reduce_scatter(units, 2, expected_buffer, 0.5)
        ok.append(torch.equal(buffer, expected_buffer))
        outs = [torch.empty(6), torch.empty(4)]
        kernels.unpack_after_all_gather(expected_buffer, 2, outs)
        ok.append(all(torch.equal(o, u * 0.5) for o, u in zip(outs, units)))
        found, sqnorm = kernels.nonfinite_and_sqnorm(units)
        ok.append(found.item() is False and torch.allclose(sqnorm, sum(u.square().sum() for u in units)))
    x = torch.zeros(1)
    print(json.dumps({
        "triton_imported": "triton" in sys.modules,
        "backends": {op: kernels.backend_for(x, op) for op in kernels.OPS},
        "ok": ok,
        "logs": [(r.levelname, r.getMessage()) for r in records],
    }))
    """
)


def test_without_triton_everything_falls_back_with_one_info_log() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, f"the fallback raised:\n{run.stderr[-4000:]}"
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["triton_imported"] is False
    assert report["backends"] == CPU_BACKENDS, "without triton, CPU tensors take the torch paths"
    assert all(report["ok"]), f"results differ from the reference: {report['ok']}"
    assert len(report["logs"]) == 1, f"expected one log record, found {report['logs']}"
    level, message = report["logs"][0]
    assert level == "INFO" and "triton is not importable" in message and "refused by the test" in message
