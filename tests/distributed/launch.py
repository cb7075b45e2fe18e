"""Run a function on N real processes joined by a gloo process group (CPU)."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str) -> None:
    import torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.json")
    try:
        result = fn(*args)
        with open(path, "w") as f:
            json.dump({"ok": True, "result": result}, f)
    except BaseException:
        with open(path, "w") as f:
            json.dump({"ok": False, "error": traceback.format_exc()}, f)
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """``fn(*args)`` on every rank; returns each rank's JSON-serialisable result."""
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(
                _entry, args=(world_size, free_port(), fn, args, out_dir),
                nprocs=world_size, join=True, start_method="spawn",
            )
        except Exception as exc:  # report the rank's own traceback, not the spawn wrapper's
            errors = []
            for rank in range(world_size):
                path = os.path.join(out_dir, f"rank{rank}.json")
                if os.path.exists(path):
                    with open(path) as f:
                        data = json.load(f)
                    if not data["ok"]:
                        errors.append(f"rank {rank}:\n{data['error']}")
            raise RuntimeError("\n".join(errors) or str(exc)) from exc
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                results.append(json.load(f)["result"])
        return results
