"""Run a function on N real processes joined by a gloo process group (CPU)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_process_tree(cmd: list[str], *, timeout: float, **popen_kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` for a launcher and its workers: on a
    timeout every process of the launch is killed, so a rank that hangs fails the test with the
    output so far. (``subprocess.run`` kills only the launcher; a worker still holding the output
    pipes would then keep the test waiting forever.)"""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **popen_kwargs)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout:.0f} s; killed. Output:\n"
                             f"{(stdout + stderr)[-8000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


# [Note: ranks from a forkserver]
# Every rank is a fresh interpreter, as under torchrun, but importing torch in each one took about
# 3 s of the 2 CPUs per spawn, tens of times per suite. The ranks therefore fork from a server
# that has imported torch once (multiprocessing's forkserver), with the two torch subpackages
# that importing transformers' models pulls in anyway: torch._dynamo and torch.distributed.tensor
# (1.4 of the 3 CPU seconds each rank spent importing hf_zero and a model class; the 6 spawns of
# test_head_unit.py went from 29.4 s to 22.4 s). Nothing else is preloaded, so hf_zero,
# transformers and the test modules are imported fresh by each rank, after the environment below
# is in place. A forked rank inherits the server's environment, fixed when the server started,
# not the test's: the test's environment is passed and restored first thing, so a variable a
# test sets (HF_ZERO_CHECK_ASYNC, HF_HUB_CACHE...) reaches its ranks as with spawn. The one
# exception is TRITON_INTERPRET: torch._dynamo imports triton where it is installed, and triton
# fixes "interpreted or compiled" for its own library when it is imported ([Note: two runs] in
# tests/kernels/conftest.py), so run_distributed refuses a TRITON_INTERPRET other than the one the
# server started with. The working directory and sys.path are the test's too (multiprocessing
# sends both).
_PRELOADED = ["torch", "torch._dynamo", "torch.distributed.tensor"]
_server_triton_interpret: list[str | None] = []  # TRITON_INTERPRET when the server started
mp.set_forkserver_preload(_PRELOADED)


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str,
           skip_teardown: bool = False, environ: dict[str, str] | None = None) -> None:
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    import torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        **{_SPAWN_FOLDER_ENV: out_dir},
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
    if skip_teardown:  # the result is written: leave before the interpreter's teardown
        os._exit(0)


def run_distributed(fn: Callable, world_size: int, *args: Any, skip_teardown: bool = False) -> list[Any]:
    """``fn(*args)`` on every rank; returns each rank's JSON-serialisable result.
    ``skip_teardown``: each rank exits with ``os._exit`` once its result is written, for a library
    whose threads abort the interpreter's teardown (DeepSpeed's: "terminate called without an
    active exception"); hf_zero's own runs never use it, so their exits stay tested."""
    if not _server_triton_interpret:
        _server_triton_interpret.append(os.environ.get("TRITON_INTERPRET"))
    if os.environ.get("TRITON_INTERPRET") != _server_triton_interpret[0]:
        raise RuntimeError(f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}, but the ranks' forkserver imported "
                           f"triton with {_server_triton_interpret[0]!r}: run these ranks in a subprocess "
                           "([Note: ranks from a forkserver])")
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(
                _entry, args=(world_size, free_port(), fn, args, out_dir, skip_teardown, dict(os.environ)),
                nprocs=world_size, join=True, start_method="forkserver",
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


# [Note: a port when the group forms]
# A free port is free when it is asked for, not minutes later: ports from ``free_port`` are in the
# ephemeral range, where every gloo connection of the cases before also takes its local port, so a
# list of ports chosen before a spawn's first case had one taken by the time a later case listened
# on it (EADDRINUSE, 18 errors in one run). ``in_group`` therefore has rank 0 choose the port as
# each group forms and hand it to the other ranks through a file in the spawn's own folder; every
# rank counts the groups it has passed, those it skips included, so the k-th call on each rank
# reads the k-th port.
_SPAWN_FOLDER_ENV = "HF_ZERO_TEST_SPAWN_FOLDER"
_groups_formed: dict[str, int] = {}  # spawn folder -> in_group calls so far on this rank
PORT_WAIT_S = 600.0


def _port_for_next_group() -> int:
    folder = os.environ[_SPAWN_FOLDER_ENV]
    index = _groups_formed.get(folder, 0)
    _groups_formed[folder] = index + 1
    path = os.path.join(folder, f"group{index}.port")
    if int(os.environ["RANK"]) == 0:
        port = free_port()
        with open(path + ".partial", "w") as f:
            f.write(str(port))
        os.replace(path + ".partial", path)  # whole or absent to a reader
        return port
    deadline = time.monotonic() + PORT_WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 chose no port for group {index} in {PORT_WAIT_S:.0f} s")
        time.sleep(0.01)
    with open(path) as f:
        return int(f.read())


def in_group(world: int, phase: Callable[[str], Any], root: str) -> Any:
    """Run ``phase(root)`` in a fresh default process group of the first ``world`` processes (the
    others skip it and return None): one spawn serves several world sizes, so the interpreters
    and their imports are paid once. ``hf_zero.initialize`` joins the group from the environment,
    on a port chosen as the group forms ([Note: a port when the group forms])."""
    import torch.distributed as dist

    port = _port_for_next_group()
    if int(os.environ["RANK"]) >= world:
        return None
    os.environ.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_PORT=str(port))
    try:
        return phase(root)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
