"""benchmarks/bench_host_landing.py end to end at a small size: every contender has a row per
thread count, and the rows say what ran (the figures themselves are docs/benchmarks.md's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_writes_a_row_per_contender(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_host_landing.py"), "--sizes", "1M",
                           "--threads", "1", "--repeats", "2", "--warmup", "1", "--jsonl", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["impl"] for r in rows] == ["torch add_ (bf16 into fp32)", "hf_zero add_scaled_",
                                         "hf_zero add_scaled_ into zeros", "torch add_ (fp32 into fp32)",
                                         "torch copy_ (bf16 to fp32)"]
    assert all(r["numel"] == 1 << 20 and r["threads"] == 1 and r["median_s"] > 0 for r in rows)
    assert rows[0]["vs_mixed_add"] == 1.0 and "| hf_zero add_scaled_ |" in proc.stdout
