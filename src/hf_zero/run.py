"""Run an unmodified Trainer or Accelerate script on hf_zero.

    python -m hf_zero.run train.py --zero_config zero3.json [script arguments ...]
    torchrun --nproc_per_node 8 -m hf_zero.run train.py --zero_config zero3.json ...
    accelerate launch --multi_gpu --num_processes 8 -m hf_zero.run train.py --zero_config zero3.json ...
    python -m hf_zero.run -m my_package.train --zero_config zero3.json ...

``--zero_config PATH`` (or ``--zero_config=PATH``) is taken out of the script's arguments and put
in ``HF_ZERO_CONFIG`` (as an absolute path), so any argument parser in the script is unaffected;
then :func:`hf_zero.integrations.transformers.enable` patches ``TrainingArguments`` and
``Trainer`` in place, :func:`hf_zero.integrations.plain_accelerator.enable` makes a plain
``Accelerator(...)`` an hf_zero one ([Note: the runner's Accelerate door]), and the script runs
as ``__main__``. A run with a config whose script prepared no model with hf_zero ends in an
error, never as silent DDP. Without ``--zero_config`` and without ``HF_ZERO_CONFIG`` /
``HF_ZERO_STAGE`` the script runs exactly as it would on its own.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m hf_zero.run (SCRIPT.py | -m MODULE) [--zero_config CONFIG.json] [script args ...]"
FLAG = "--zero_config"


def extract_zero_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the --zero_config value or None, the other arguments in order)."""
    value: str | None = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == FLAG:
            if i + 1 >= len(argv):
                raise SystemExit(f"hf_zero.run: {FLAG} needs a value (a JSON file)\n{USAGE}")
            value, i = argv[i + 1], i + 2
            continue
        if arg.startswith(FLAG + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return value, rest


def _config_value(value: str) -> str:
    """A path becomes absolute (the script may chdir); inline JSON is passed through."""
    if value.lstrip().startswith("{"):
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
    if requested and plain_accelerator.hf_zero_models_prepared() == 0:
        raise SystemExit(
            f"hf_zero.run: {target} finished without preparing a model with hf_zero although a ZeRO config "
            "was given: it trained (if at all) without ZeRO. hf_zero.run runs scripts whose model goes "
            "through transformers' Trainer or accelerate's Accelerator.prepare; a script that calls "
            "hf_zero.initialize itself needs no runner")


if __name__ == "__main__":
    main()
