"""Writing a directory beside the one it replaces, then swapping: the old one survives a failure.

[Note: staged export]
``export`` writes the new model folder into a hidden sibling ``.<name>.staging-<pid>-<id>/`` on
the same filesystem, copying in (hard links where possible) the files of the previous folder it
does not produce itself (a tokenizer, a README), and only when every file is written and synced
renames the previous folder aside, the new one into place, and removes the old one. A failure
before the swap (a full disk, an error in a rank file) removes the staging folder and leaves the
previous export as it was; the two renames are the only window, and a crash inside it leaves the
previous folder as ``.<name>.previous-<pid>-<id>/`` beside the name. Staging and previous
folders of processes that no longer run are removed the next time that folder is exported.
Needs room for both exports at once.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from typing import Callable, Iterator

from hf_zero.checkpoint.safetensors_io import fsync_dir
from hf_zero.processes import pid_alive

_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(staging|previous)-(?P<pid>\d+)-[0-9a-f]+$")


def remove_dead_leftovers(parent: str, name: str) -> list[str]:
    """Staging/previous folders of ``name`` left by processes that no longer run."""
    removed = []
    for entry in os.listdir(parent) if os.path.isdir(parent) else []:
        match = _LEFTOVER.match(entry)
        if match and match["name"] == name and not pid_alive(int(match["pid"])):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
            removed.append(entry)
    return removed


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _carry_over(previous: str, staging: str, produced: Callable[[str], bool]) -> None:
    """The previous folder's entries the new one does not produce (hard links where possible)."""
    for entry in os.listdir(previous):
        if produced(entry):
            continue
        src, dst = os.path.join(previous, entry), os.path.join(staging, entry)
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst) if not os.path.islink(src) else os.symlink(os.readlink(src), dst)


@contextlib.contextmanager
def staged_directory(final: str, produced: Callable[[str], bool]) -> Iterator[str]:
    """Yield a staging folder to write ``final``'s new content into; on a clean exit swap it in
    (see [Note: staged export]); on an error remove it and re-raise, ``final`` untouched.
    ``produced(name)`` says which entries of the previous folder the new content replaces."""
    parent, name = os.path.split(final)
    if os.path.exists(final) and not os.path.isdir(final):
        raise NotADirectoryError(f"{final} exists and is not a directory")
    os.makedirs(parent, exist_ok=True)
    remove_dead_leftovers(parent, name)
    token = f"{os.getpid()}-{secrets.token_hex(4)}"
    staging = os.path.join(parent, f".{name}.staging-{token}")
    os.mkdir(staging)
    try:
        if os.path.isdir(final):
            _carry_over(final, staging, produced)
        yield staging
        fsync_dir(staging)
        _swap(final, staging, os.path.join(parent, f".{name}.previous-{token}"))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _swap(final: str, staging: str, previous: str) -> None:
    had_previous = os.path.isdir(final)
    if had_previous:
        os.rename(final, previous)
    try:
        os.rename(staging, final)
    except OSError:
        if had_previous:
            os.rename(previous, final)
        raise
    fsync_dir(os.path.dirname(final))
    if had_previous:
        shutil.rmtree(previous, ignore_errors=True)
