"""Every path a checkpoint names, resolved inside the checkpoint folder.

[Note: confined paths]
A checkpoint folder is untrusted input: whoever wrote ``latest`` or ``manifest.json`` chooses
the names in them, and a folder copied from elsewhere can hold symlinks. Loading and export open
only paths that stay inside it: the save folder for ``latest`` and the tag folders, the tag
folder for the manifest and the rank files. ``latest`` must hold a tag name and the manifest's
file names must be plain names (:func:`is_plain_name`: no ``/``, no ``..``, not absolute), so
they are refused before any lookup. A symlink is followed only when it resolves inside, and it
is resolved here one component at a time (``lstat`` and ``readlink`` of paths already known to
be inside), so that nothing outside the folder is opened or even stat'ed to decide that it is
outside. Links are checked when the load looks at a path, not held open: a folder changed
while a load reads it is outside what this guards against.
"""

from __future__ import annotations

import os
import re

from hf_zero.checkpoint.errors import CheckpointError

_PLAIN_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=@-]*$")
_MAX_LINKS = 40  # as the kernel's ELOOP limit: a cycle of links is refused, not followed forever


def is_plain_name(name: object) -> bool:
    """A single path component made of letters, digits and ``_ . + = @ -`` that does not start
    with ``.`` or ``-``: never ``..``, a separator or an absolute path (the tag rule of saving)."""
    return isinstance(name, str) and bool(_PLAIN_NAME_RE.match(name))


def _parts(path: str) -> list[str]:
    return [part for part in path.split(os.sep) if part not in ("", ".")]


def _outside(what: str, root: str, detail: str) -> CheckpointError:
    return CheckpointError(
        f"{what}: {detail}, which is outside {root}: a checkpoint reads only files inside its own "
        "folder; copy the files into it instead of linking them"
    )


def _target_parts(target: str, current: str, root: str, what: str) -> tuple[str, list[str]]:
    """Where a link's target continues the walk from: (directory, components), refused when
    it names a place outside ``root`` (checked on the text of the link alone)."""
    if not os.path.isabs(target):
        return current, _parts(target)
    root_parts, parts = _parts(root), _parts(target)
    if parts[:len(root_parts)] != root_parts:
        raise _outside(what, root, f"a symlink to {target}")
    return root, parts[len(root_parts):]


def resolve_inside(root: str, relative: str, what: str) -> str:
    """The physical path of ``root/relative``, following symlinks that stay inside ``root``
    (see [Note: confined paths]); a :class:`CheckpointError` naming ``what`` when it leaves.
    ``root`` is a real path (the caller's ``os.path.realpath``). A missing path resolves to
    itself: the caller reports it as missing."""
    pending, current, links = _parts(relative), root, 0
    while pending:
        part = pending.pop(0)
        if part == "..":
            if current == root:
                raise _outside(what, root, "a path through '..'")
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, part)
        if not os.path.islink(candidate):  # an lstat of a path inside root
            current = candidate
            continue
        links += 1
        if links > _MAX_LINKS:
            raise CheckpointError(f"{what}: more than {_MAX_LINKS} symlinks to follow (a cycle of links)")
        current, parts = _target_parts(os.readlink(candidate), current, root, what)
        pending = parts + pending
    return current
