"""``hf-zero launch`` with the ``deepspeed`` launcher's flags, on top of torchrun.

    deepspeed --num_gpus 8 train.py --deepspeed ds.json ...
    hf-zero launch --num_gpus 8 train.py --deepspeed ds.json ...        # the same job on hf_zero

A job script keeps its command line: the launcher's flags (``--num_gpus``, ``--num_nodes``,
``--hostfile``, ``--include`` / ``--exclude``, ``--master_addr`` / ``--master_port``, ``--no_ssh``
with ``--node_rank``) choose the nodes and the slots on each, as DeepSpeed's launcher does; each
node then runs ``torchrun ... -m hf_zero.run SCRIPT ARGS``, and the runner reads the script's
``--deepspeed ds.json`` as ``--zero_config ds.json`` ([hf_zero.run]). Nothing here starts
DeepSpeed, and nothing reaches another machine: the nodes of a hostfile that are this machine
(two "nodes" on loopback, say) are started here, one torchrun each; a job with another machine in
it is refused with the torchrun command to run there, or runs with ``--no_ssh --node_rank R`` on
every node as DeepSpeed's own ``--no_ssh`` does.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from hf_zero.run import LOCAL_RANK_ARG_ENV

# DeepSpeed's launcher defaults (deepspeed/launcher/runner.py, constants.py).
DEFAULT_HOSTFILE = "/job/hostfile"
DEFAULT_MASTER_PORT = 29500

# flag -> its value's name (None: a switch); the short forms DeepSpeed's argparse accepts.
VALUE_FLAGS = {"--num_gpus": "num_gpus", "--num_nodes": "num_nodes", "--hostfile": "hostfile", "-H": "hostfile",
               "--include": "include", "-i": "include", "--exclude": "exclude", "-e": "exclude",
               "--master_addr": "master_addr", "--master_port": "master_port", "--node_rank": "node_rank"}
SWITCHES = {"--no_ssh": "no_ssh", "--no_local_rank": "no_local_rank"}
FLAG_HELP = {
    "num_gpus": "processes per node: the first N slots of each (default: every GPU of this machine)",
    "num_nodes": "the first N hosts of the hostfile",
    "hostfile": f"HOST slots=N per line (default {DEFAULT_HOSTFILE}; without it, this machine alone)",
    "include": "hosts and slots to use, e.g. localhost:0,1@worker-1",
    "exclude": "hosts and slots to leave out, e.g. worker-1:2,3",
    "master_addr": "the rendezvous host (default: the first host, 127.0.0.1 when all are this machine)",
    "master_port": f"the rendezvous port (default {DEFAULT_MASTER_PORT})",
    "no_ssh": "start only this node's processes; run the same command on every node",
    "node_rank": "this node's rank, with --no_ssh",
    "no_local_rank": "do not give the script --local_rank=N",
}
# Flags of DeepSpeed's launcher this one cannot honour, and what to do instead.
REFUSED = {
    "--launcher": "hf-zero launch starts torchrun on this machine; for pdsh, OpenMPI, MPICH, IMPI, MVAPICH or "
                  "Slurm, run `torchrun ... -m hf_zero.run SCRIPT` under that launcher (srun torchrun ..., say)",
    "--launcher_args": "see --launcher",
    "--ssh_port": "hf-zero launch reaches no other machine: run it with --no_ssh --node_rank R on every node",
    "--force_multi": "hf-zero launch reaches no other machine: run it with --no_ssh --node_rank R on every node",
    "--elastic_training": "use torchrun's elastic options (--nnodes MIN:MAX, --rdzv_backend c10d) with "
                          "-m hf_zero.run",
    "--min_elastic_nodes": "see --elastic_training", "--max_elastic_nodes": "see --elastic_training",
    "--no_python": "run the program under torchrun --no-python yourself",
    "--save_pid": "torchrun keeps no pid file; read the launcher's pid from your job system",
    "--enable_each_rank_log": "use torchrun's --log-dir and --redirects",
    "--bind_cores_to_rank": "bind cores with numactl or taskset around torchrun",
    "--bind_core_list": "see --bind_cores_to_rank",
    "--autotuning": "hf_zero has no autotuner: hf-zero estimate sizes a run",
    "--comment": "hf-zero launch does not submit jobs",
    "--elastic_run_id": "see --elastic_training",
}
LAUNCHER_FLAGS = frozenset({*VALUE_FLAGS, *SWITCHES, *REFUSED})


class LaunchError(ValueError):
    """A launch this launcher cannot start; the message names the fix."""


@dataclass(frozen=True)
class Node:
    host: str
    slots: tuple[int, ...]  # the device indices this node's ranks use (CUDA_VISIBLE_DEVICES)


def uses_deepspeed_flags(argv: list[str]) -> bool:
    """Whether the launcher part of ``argv`` (before the script) has a flag of DeepSpeed's launcher."""
    for token in argv:
        if token.endswith(".py") or token in ("-m", "--module"):
            return False
        if token.partition("=")[0] in LAUNCHER_FLAGS:
            return True
    return False


def parse_args(argv: list[str]) -> tuple[dict[str, str | bool], list[str]]:
    """(the launcher's options, ``[-m] script args...``): options end at the script (the first
    ``*.py`` token, or ``-m`` / ``--module`` and the module after it)."""
    options: dict[str, str | bool] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in ("-m", "--module"):
            if i + 1 >= len(argv):
                raise LaunchError(f"{token} needs a module to run")
            return options, ["-m", *argv[i + 1:]]
        if token.endswith(".py") or not token.startswith("-"):
            return options, argv[i:]
        name, eq, value = token.partition("=")
        if name in REFUSED:
            raise LaunchError(f"{name} is not supported: {REFUSED[name]}")
        if name in SWITCHES:
            options[SWITCHES[name]] = True
        elif name in VALUE_FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise LaunchError(f"{name} needs a value")
                i += 1
                value = argv[i]
            options[VALUE_FLAGS[name]] = value
        else:
            raise LaunchError(f"{name}: not a flag of DeepSpeed's launcher (deepspeed --help lists them); with "
                              "DeepSpeed's flags, hf-zero launch takes only those before the script")
        i += 1
    raise LaunchError("no script: give SCRIPT.py or -m MODULE after the launcher's flags")


def _int_option(options: dict[str, str | bool], name: str, minimum: int = 1) -> int | None:
    """The integer value of ``--name``, at least ``minimum``; None when not given."""
    value = options.get(name)
    if value is None:
        return None
    try:
        number = int(str(value))
    except ValueError:
        number = minimum - 1
    if number < minimum:
        kind = "positive" if minimum == 1 else "non-negative"
        raise LaunchError(f"--{name} {value!r}: expected a {kind} integer")
    return number


def read_hostfile(path: str) -> dict[str, int] | None:
    """``host slots=N`` per line, as DeepSpeed reads it (``#`` comments and blank lines skipped);
    None when the file does not exist."""
    if not os.path.exists(path):
        return None
    if not os.path.isfile(path):
        raise LaunchError(f"hostfile {path}: not a regular file")
    hosts: dict[str, int] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            match = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\d+)", line)
            if match is None:
                raise LaunchError(f"hostfile {path}, line {number}: {line!r} is not `HOSTNAME slots=N`")
            host, slots = match.group(1), int(match.group(2))
            if host in hosts:
                raise LaunchError(f"hostfile {path}, line {number}: host {host} is listed twice")
            if slots < 1:
                raise LaunchError(f"hostfile {path}, line {number}: {host} has slots={slots}; give at least 1")
            hosts[host] = slots
    if not hosts:
        raise LaunchError(f"hostfile {path} lists no host")
    return hosts


def _parse_filter(text: str, flag: str) -> dict[str, list[int] | None]:
    """DeepSpeed's ``host1:0,1@host2``: host -> its slots (None: the whole host)."""
    parsed: dict[str, list[int] | None] = {}
    for part in text.split("@"):
        host, colon, slots = part.partition(":")
        if not host or (colon and not slots):
            raise LaunchError(f"{flag} {text!r}: expected HOST[:SLOT,SLOT...][@HOST...], e.g. localhost:0,1@worker-1")
        try:
            parsed[host] = [int(s) for s in slots.split(",")] if colon else None
        except ValueError:
            raise LaunchError(f"{flag} {text!r}: slots must be integers, e.g. localhost:0,1") from None
    return parsed


def _filtered(resources: dict[str, list[int]], include: str | None, exclude: str | None) -> dict[str, list[int]]:
    if include is not None:
        kept: dict[str, list[int]] = {}
        for host, slots in _parse_filter(include, "--include").items():
            if host not in resources:
                raise LaunchError(f"--include: host {host} is not in the hostfile ({', '.join(resources)})")
            missing = sorted(set(slots or []) - set(resources[host]))
            if missing:
                raise LaunchError(f"--include: {host} has no slot {missing[0]} (slots {resources[host]})")
            kept[host] = list(resources[host]) if slots is None else sorted(set(slots))
        return kept
    if exclude is not None:
        kept = {host: list(slots) for host, slots in resources.items()}
        for host, slots in _parse_filter(exclude, "--exclude").items():
            if host not in kept:
                raise LaunchError(f"--exclude: host {host} is not in the hostfile ({', '.join(resources)})")
            kept[host] = [] if slots is None else [s for s in kept[host] if s not in slots]
        return {host: slots for host, slots in kept.items() if slots}
    return resources


def _local_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def plan_nodes(options: dict[str, str | bool]) -> list[Node]:
    """The nodes and their slots, chosen as DeepSpeed's launcher chooses them."""
    num_gpus, num_nodes = _int_option(options, "num_gpus"), _int_option(options, "num_nodes")
    include, exclude = options.get("include"), options.get("exclude")
    if include is not None and exclude is not None:
        raise LaunchError("--include and --exclude are mutually exclusive: give one")
    if (include is not None or exclude is not None) and (num_gpus is not None or num_nodes is not None):
        raise LaunchError("--include/--exclude choose the slots themselves: drop --num_gpus and --num_nodes")
    hostfile = str(options.get("hostfile", DEFAULT_HOSTFILE))
    hosts = read_hostfile(hostfile)
    if hosts is None:
        if "hostfile" in options:
            raise LaunchError(f"hostfile {hostfile}: no such file")
        count = num_gpus if num_gpus is not None else _local_device_count()
        if count < 1:
            raise LaunchError("this machine has no GPU: give --num_gpus N for N processes (on CPUs the script's "
                              "processes join over gloo; a Trainer script also needs --use_cpu)")
        hosts = {"localhost": count}
    resources = {host: list(range(slots)) for host, slots in hosts.items()}
    resources = _filtered(resources, include, exclude)  # type: ignore[arg-type]
    if num_nodes is not None:
        if num_nodes > len(resources):
            raise LaunchError(f"--num_nodes {num_nodes}, but the hostfile lists {len(resources)} host(s)")
        resources = dict(list(resources.items())[:num_nodes])
    if num_gpus is not None:
        short = [host for host, slots in resources.items() if len(slots) < num_gpus]
        if short:
            raise LaunchError(f"--num_gpus {num_gpus}, but {short[0]} has {len(resources[short[0]])} slot(s)")
        resources = {host: slots[:num_gpus] for host, slots in resources.items()}
    if not resources:
        raise LaunchError("no slot is left to run on after --include/--exclude")
    counts = {len(slots) for slots in resources.values()}
    if len(counts) > 1:
        listed = ", ".join(f"{host}: {len(slots)}" for host, slots in resources.items())
        raise LaunchError(f"every node runs the same number of processes under torchrun; these differ ({listed}): "
                          "narrow them with --num_gpus or --include")
    return [Node(host, tuple(slots)) for host, slots in resources.items()]


def is_this_machine(host: str) -> bool:
    if host in ("localhost", "::1") or host.startswith("127."):
        return True
    names = {socket.gethostname(), socket.getfqdn()}
    return host in names or host.split(".")[0] == socket.gethostname().split(".")[0]


def torchrun_command(nodes: list[Node], rank: int, master_addr: str, master_port: int, program: list[str]) -> list[str]:
    """One node's torchrun, its script run by ``hf_zero.run``."""
    script = program[1:] if program[0] == "-m" else program
    runner = ["-m", "hf_zero.run", "-m", *script] if program[0] == "-m" else ["-m", "hf_zero.run", *script]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(nodes)), "--node_rank", str(rank),
            "--nproc_per_node", str(len(nodes[rank].slots)), "--master_addr", master_addr,
            "--master_port", str(master_port), *runner]


def _stop(procs: list[subprocess.Popen], sig: signal.Signals) -> None:
    """Send ``sig`` to every node still running (its whole process group) and wait for all."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, sig)
    for p in procs:
        p.wait()


def _wait_all(procs: list[subprocess.Popen]) -> int:
    """Every node's exit status; the first node to fail stops the others (as DeepSpeed's launcher)."""
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                _stop(procs, signal.SIGTERM)
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(procs, signal.SIGINT)
        return 130


def launch(argv: list[str], env: dict[str, str]) -> int:
    options, program = parse_args(argv)
    nodes = plan_nodes(options)
    port = _int_option(options, "master_port") or DEFAULT_MASTER_PORT
    node_rank = _int_option(options, "node_rank", minimum=0)
    if node_rank is not None and not options.get("no_ssh"):
        raise LaunchError("--node_rank goes with --no_ssh (the same command run on every node, each with its rank)")
    remote = [node.host for node in nodes if not is_this_machine(node.host)]
    if options.get("master_addr"):
        addr = str(options["master_addr"])
    elif not remote:
        addr = "127.0.0.1"
    elif is_this_machine(nodes[0].host):
        raise LaunchError("the first node is this machine and others are not: give --master_addr with an address "
                          "the other nodes reach this machine at")
    else:
        addr = nodes[0].host  # DeepSpeed's default: the first host of the hostfile
    if options.get("no_ssh"):
        if node_rank is None:
            raise LaunchError("--no_ssh needs --node_rank R: run the command on every node, each with its own rank")
        if node_rank >= len(nodes):
            raise LaunchError(f"--node_rank {node_rank}, but the job has {len(nodes)} node(s)")
        ranks = [node_rank]
    elif remote:
        commands = "\n".join(
            f"  on {node.host}: CUDA_VISIBLE_DEVICES={','.join(map(str, node.slots))} "
            f"{shlex.join(torchrun_command(nodes, rank, addr, port, program))}"
            for rank, node in enumerate(nodes))
        raise LaunchError(f"{', '.join(remote)} {'is' if len(remote) == 1 else 'are'} not this machine, and hf-zero "
                          "launch starts no process over ssh: add --no_ssh --node_rank R and run it on every node, "
                          f"or run torchrun there yourself:\n{commands}")
    else:
        ranks = list(range(len(nodes)))
    procs = []
    for rank in ranks:
        command = torchrun_command(nodes, rank, addr, port, program)
        node_env = {**env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, nodes[rank].slots))}
        if not options.get("no_local_rank"):
            node_env[LOCAL_RANK_ARG_ENV] = "1"  # the script gets --local_rank=N, as under DeepSpeed's launcher
        print(f"hf-zero launch: node {rank} of {len(nodes)} ({nodes[rank].host}): "
              f"CUDA_VISIBLE_DEVICES={node_env['CUDA_VISIBLE_DEVICES']} {shlex.join(command)}", flush=True)
        procs.append(subprocess.Popen(command, env=node_env, start_new_session=True))
    return _wait_all(procs)
