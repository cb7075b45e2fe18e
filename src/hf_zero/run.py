"""Run an unmodified Trainer or Accelerate script on hf_zero.

    python -m hf_zero.run train.py --zero_config zero3.json [script arguments ...]
    torchrun --nproc_per_node 8 -m hf_zero.run train.py --zero_config zero3.json ...
    accelerate launch --multi_gpu --num_processes 8 -m hf_zero.run train.py --zero_config zero3.json ...
    python -m hf_zero.run -m my_package.train --zero_config zero3.json ...

``--zero_config PATH`` (or ``--zero_config=PATH``) is taken out of the script's arguments and put
in ``HF_ZERO_CONFIG`` (as an absolute path), so any argument parser in the script is unaffected.
DeepSpeed's own flags name the config too, so a job script keeps its command line: the
Trainer's ``--deepspeed PATH`` is read as ``--zero_config PATH`` and taken out (one INFO line
says so), DeepSpeed's ``--deepspeed_config PATH`` is read and left for the script, as is the bare
``--deepspeed`` switch (``deepspeed.add_config_arguments``); the runner never starts DeepSpeed;
then :func:`hf_zero.integrations.transformers.enable` patches ``TrainingArguments`` and
``Trainer`` in place, :func:`hf_zero.integrations.plain_accelerator.enable` makes a plain
``Accelerator(...)`` an hf_zero one ([Note: the runner's Accelerate door]), and the script runs
as ``__main__``. A run with a config whose script prepared no model with hf_zero ends in an
error, never as silent DDP. Without ``--zero_config`` and without ``HF_ZERO_CONFIG`` /
``HF_ZERO_STAGE`` the script runs exactly as it would on its own.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys

logger = logging.getLogger("hf_zero")

USAGE = "usage: python -m hf_zero.run (SCRIPT.py | -m MODULE) [--zero_config CONFIG.json] [script args ...]"
FLAG = "--zero_config"
# DeepSpeed's flags for the same file: the Trainer's --deepspeed PATH, deepspeed's --deepspeed_config.
DEEPSPEED_FLAGS = ("--deepspeed", "--deepspeed_config")
CONFIG_FLAGS = (FLAG, *DEEPSPEED_FLAGS)
# Set by hf-zero launch with DeepSpeed's flags (hf_zero.launcher): DeepSpeed's launcher gives the
# script --local_rank=N first unless --no_local_rank, where torchrun sets only LOCAL_RANK.
LOCAL_RANK_ARG_ENV = "HF_ZERO_RUN_LOCAL_RANK_ARG"


def _is_deepspeed_switch(argv: list[str], i: int) -> bool:
    """DeepSpeed's ``--deepspeed`` switch (store_true, from ``deepspeed.add_config_arguments``):
    nothing or another option after it, where the Trainer's ``--deepspeed`` takes a path."""
    return argv[i] == "--deepspeed" and (i + 1 >= len(argv) or argv[i + 1].startswith("-"))


# Flags whose value the runner reads and also leaves for the script: deepspeed.add_config_arguments
# scripts read --deepspeed_config themselves. --zero_config and the Trainer's --deepspeed PATH are
# taken out (TrainingArguments would start DeepSpeed on the latter).
LEFT_FOR_THE_SCRIPT = ("--deepspeed_config",)


def extract_config_flags(argv: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """([(flag, value)] for every config flag given, the script's arguments in order)."""
    found: list[tuple[str, str]] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if _is_deepspeed_switch(argv, i):  # the script's own switch: nothing to read
            rest.append(arg)
            i += 1
            continue
        if arg in CONFIG_FLAGS:
            if i + 1 >= len(argv):
                raise SystemExit(f"hf_zero.run: {arg} needs a value (a JSON file)\n{USAGE}")
            found.append((arg, argv[i + 1]))
            if arg in LEFT_FOR_THE_SCRIPT:
                rest += argv[i:i + 2]
            i += 2
            continue
        flag, equals, value = arg.partition("=")
        if flag in CONFIG_FLAGS and equals:
            if not value:
                raise SystemExit(f"hf_zero.run: {flag}= needs a value (a JSON file)\n{USAGE}")
            found.append((flag, value))
            if flag in LEFT_FOR_THE_SCRIPT:
                rest.append(arg)
        else:
            rest.append(arg)
        i += 1
    return found, rest


def extract_zero_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the config the arguments name or None, the other arguments in order): ``--zero_config``,
    or DeepSpeed's ``--deepspeed`` / ``--deepspeed_config`` in its place; two that name different
    configs are an error."""
    found, rest = extract_config_flags(argv)
    values = {value if _inline(value) else os.path.abspath(os.path.expanduser(value)) for _, value in found}
    if len(values) > 1:
        given = ", ".join(f"{flag} {value}" for flag, value in found)
        raise SystemExit(f"hf_zero.run: two configs were given ({given}); keep one {FLAG}\n{USAGE}")
    if not found:
        return None, rest
    flag, value = found[0]
    if flag != FLAG and os.environ.get("RANK", "0") == "0":
        logger.info("hf_zero.run: %s %s is read as %s %s: hf_zero runs the script's ZeRO, DeepSpeed is not "
                    "started", flag, value, FLAG, value)
    return value, rest


def _inline(value: str) -> bool:
    return value.lstrip().startswith("{")


def _config_value(value: str) -> str:
    """A path becomes absolute (the script may chdir); inline JSON is passed through."""
    if _inline(value):
        return value
    path = os.path.abspath(os.path.expanduser(value))
    if not os.path.isfile(path):
        raise SystemExit(f"hf_zero.run: {FLAG} {value}: no such file")
    return path


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") and len(argv) == 1:
        raise SystemExit(USAGE)
    as_module = argv[0] == "-m"
    if as_module and len(argv) < 2:
        raise SystemExit(USAGE)
    target, script_args = (argv[1], argv[2:]) if as_module else (argv[0], argv[1:])
    value, script_args = extract_zero_config(script_args)
    if os.environ.pop(LOCAL_RANK_ARG_ENV, None) == "1":  # started by hf-zero launch with DeepSpeed's flags
        script_args = [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}", *script_args]
    if value is not None:
        from hf_zero.integrations._accelerator import CONFIG_ENV

        os.environ[CONFIG_ENV] = _config_value(value)

    from hf_zero.integrations import plain_accelerator
    from hf_zero.integrations.transformers import enable

    enable()  # first: transformers.trainer keeps accelerate's own Accelerator (the Trainer's route)
    requested = plain_accelerator.config_requested()
    if requested:
        plain_accelerator.enable()  # see [Note: the runner's Accelerate door]
    if as_module:
        sys.argv = [target, *script_args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        if not os.path.isfile(target):
            raise SystemExit(f"hf_zero.run: {target}: no such script\n{USAGE}")
        sys.argv = [target, *script_args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")
    if requested and plain_accelerator.hf_zero_models_prepared() == 0 and _engines_made() == 0:
        raise SystemExit(
            f"hf_zero.run: {target} finished without preparing a model with hf_zero although a ZeRO config "
            "was given: it trained (if at all) without ZeRO. hf_zero.run runs scripts whose model goes "
            "through transformers' Trainer, accelerate's Accelerator.prepare, hf_zero.initialize or "
            "hf_zero.compat.deepspeed.initialize")


def _engines_made() -> int:
    initialize = sys.modules.get("hf_zero.engine.initialize")  # never imported: no engine was made
    return initialize.engines_made() if initialize is not None else 0


if __name__ == "__main__":
    main()
