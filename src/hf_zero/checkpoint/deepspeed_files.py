"""The files of a DeepSpeed checkpoint folder, found and unpickled without running them.

[Note: DeepSpeed's pickles]
DeepSpeed writes its checkpoints with ``torch.save``: pickles, and unpickling calls whatever a
file names. A DeepSpeed folder is untrusted input like an hf_zero one, so each file is read in
two checks with one allow-list, :data:`ALLOWED_GLOBALS`: exactly the globals that DeepSpeed
0.19's ZeRO-1/2/3 checkpoints hold (found by loading checkpoints it wrote in fp32 and bf16,
with ZeRO's optimizer, BF16_Optimizer and the stage-3 optimizer):

- torch's tensor rebuild functions (``_rebuild_tensor_v2``; ``_rebuild_from_type_v2`` with
  ``torch.Tensor`` for stage 3's flat groups), the storage types of the dtypes a safetensors file
  holds, ``torch.Size``, those dtypes themselves (a dynamic loss scaler records its dtype) and
  ``collections.OrderedDict``;
- four DeepSpeed classes: ``ZeroStageEnum``, ``LossScaler``, ``DynamicLossScaler`` and
  ``fragment_address``.

First the pickle inside the file (``<archive>/data.pkl``) is scanned with ``pickletools``,
which parses opcodes and executes nothing: a global outside the list (``collections.Counter``,
a class of the training script written into ``client_state``, ``os.system``) is refused with
one :class:`CheckpointError` naming every such global and the file. torch's own default list
is wider (it admits ``collections.Counter``, ``builtins.set``, ``_codecs.encode``...), so this
scan is the check that holds the line. Then ``torch.load(weights_only=True)`` reads the file
with the DeepSpeed names mapped to inert stand-ins defined here (torch's ``safe_globals``
accepts ``(object, "module.name")`` pairs), so a second, independent unpickler enforces the
same list, and DeepSpeed itself is never imported: it need not be installed. A stand-in holds
the plain state its pickle carried and runs no code of the class it stands for.

The scan is bounded, as reading a hostile file must be: the pickle is read from the zip in
chunks and refused past :data:`_MAX_PICKLE_BYTES` (checked on the zip header first, then while
reading, as a header can lie), and ``genops`` is stopped past :data:`_MAX_PICKLE_OPCODES`
opcodes or :data:`_MAX_SCAN_SECONDS` seconds. Unbounded, 400 MB of no-op opcodes (which
deflate to a file of 0.4 MB) kept the scan busy for minutes. DeepSpeed's own pickles are a few
KB to a few MB (about 4 bytes an opcode), far below every limit.

``torch.load(mmap=True)`` maps the tensor data straight from the file and checks none of the
zip's CRC-32s, so before it runs every member is read once to its end through ``zipfile``,
which checks each member's CRC-32 there: flipped bytes are refused naming the file and the
member. A compressed member other than the pickle is refused too: ``torch.save`` stores every
member, and a mapped one would be read as its compressed bytes, which the CRC does not cover.

Paths follow [Note: confined paths]: ``latest`` must hold a plain tag name, and every file is
resolved inside the folder before it is opened.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import re
import time
import zipfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from hf_zero.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from hf_zero.checkpoint.manifest import LATEST_NAME, read_latest
from hf_zero.checkpoint.paths import is_plain_name, resolve_inside
from hf_zero.checkpoint.safetensors_io import DTYPE_TAGS

MODEL_STATES = "mp_rank_00_model_states.pt"  # stages 0-2: one file for every rank
STAGE3_MODEL_STATES = "zero_pp_rank_{rank}_mp_rank_00_model_states.pt"  # stage 3: one per rank
OPTIM_STATES = "{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"  # prefix "" or "bf16_"
# The bounds of [Note: DeepSpeed's pickles]. A pickle holds structure, not tensor data: DeepSpeed's
# are 2-8 KB (~1,600 opcodes) for a tiny model and well under a few MB for the largest (names and
# shapes of every parameter), at about 4 bytes an opcode. 64 MiB and 8M opcodes (32 MiB of such a
# pickle) leave a margin of 10x over that; a scan stopped at the opcode limit takes 5-10 s on one core.
# The time limit is for a slow or loaded machine, where even that could take minutes; the clock is
# read every 64K opcodes (~50 ms of scanning).
_MAX_PICKLE_BYTES = 64 << 20
_MAX_PICKLE_OPCODES = 1 << 23
_MAX_SCAN_SECONDS = 20.0
_SCAN_CLOCK_EVERY = 1 << 16
_READ_CHUNK_BYTES = 1 << 20  # a member is read (and its CRC-32 checked) this much at a time


class DeepSpeedRecord:
    """An object of a DeepSpeed class read from a checkpoint (a loss scaler, a fragment address):
    its class name and the plain attributes its pickle held, in :attr:`state`. Unpickling it
    runs nothing but this ``__setstate__`` (see [Note: DeepSpeed's pickles])."""

    deepspeed_class = "?"

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise pickle.UnpicklingError(f"{self.deepspeed_class}: its pickled state is not a dict of attributes")
        self.state = dict(state)


class LossScalerRecord(DeepSpeedRecord):
    deepspeed_class = "deepspeed.runtime.fp16.loss_scaler.LossScaler"


class DynamicLossScalerRecord(DeepSpeedRecord):
    deepspeed_class = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"


class FragmentAddressRecord(DeepSpeedRecord):
    deepspeed_class = "deepspeed.utils.tensor_fragment.fragment_address"


class ZeroStage(int):
    """DeepSpeed's ``ZeroStageEnum`` (an ``int`` enum: pickled as a call with its value)."""

    def __new__(cls, value: Any) -> "ZeroStage":
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 3:
            raise pickle.UnpicklingError(f"ZeroStageEnum({value!r:.40}) is not a ZeRO stage (0 to 3)")
        return super().__new__(cls, value)


_DEEPSPEED_STAND_INS: dict[str, Any] = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStage,
    LossScalerRecord.deepspeed_class: LossScalerRecord,
    DynamicLossScalerRecord.deepspeed_class: DynamicLossScalerRecord,
    FragmentAddressRecord.deepspeed_class: FragmentAddressRecord,
}
_TORCH_GLOBALS = (
    ["collections.OrderedDict", "torch.Size", "torch.Tensor", "torch._utils._rebuild_tensor_v2",
     "torch._tensor._rebuild_from_type_v2"]
    + [f"torch.{str(dtype).removeprefix('torch.')}" for dtype in DTYPE_TAGS]
    + [f"torch.{kind}Storage" for kind in ("Double", "Float", "Half", "BFloat16", "Long", "Int", "Short",
                                          "Char", "Byte", "Bool")]
)
# Every global a DeepSpeed checkpoint file may name (see [Note: DeepSpeed's pickles]).
ALLOWED_GLOBALS: frozenset[str] = frozenset(_TORCH_GLOBALS) | frozenset(_DEEPSPEED_STAND_INS)


def _not_deepspeeds(path: str, found: str) -> CheckpointError:
    return CheckpointError(f"{path}: {found}; this file is not a DeepSpeed checkpoint file as DeepSpeed writes it "
                           "(with torch.save), so it is refused unread. If it is one, re-save it with DeepSpeed")


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: str, max_bytes: int | None = None,
                 keep: bool = False) -> bytes:
    """Member ``info`` read to its end a chunk at a time, so that zipfile checks its CRC-32
    without the member in memory; its bytes when ``keep``. Refused past ``max_bytes`` read
    (the header's size is checked by the caller, but a header can lie)."""
    chunks, read_bytes = [], 0
    try:
        with archive.open(info) as member:
            while chunk := member.read(_READ_CHUNK_BYTES):
                read_bytes += len(chunk)
                if max_bytes is not None and read_bytes > max_bytes:
                    raise _not_deepspeeds(path, f"its pickle {info.filename} decompresses to more than {max_bytes} "
                                                "bytes (the limit; DeepSpeed's are a few KB to a few MB)")
                if keep:
                    chunks.append(chunk)
    except zipfile.BadZipFile as exc:
        if "CRC" not in str(exc):
            raise
        raise CheckpointError(f"{path}: the file is damaged: member {info.filename} fails its CRC-32; copy the "
                              "checkpoint again from where DeepSpeed saved it") from exc
    return b"".join(chunks)


_ZIP_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, OSError, RuntimeError, ValueError)  # RuntimeError: encrypted


def _not_a_zip(path: str, exc: BaseException) -> CheckpointError:
    return CheckpointError(f"{path}: not a torch.save zip file ({type(exc).__name__}: {exc}); only checkpoints "
                           "written by torch >= 1.6 (DeepSpeed's format) are read")


def _pickle_bytes(path: str) -> bytes:
    """The pickle of a ``torch.save`` zip file (``<archive>/data.pkl``), bounded and CRC-checked
    (see [Note: DeepSpeed's pickles])."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = [info for info in archive.infolist() if info.filename.endswith("/data.pkl")]
            if len(members) != 1:
                raise CheckpointError(f"{path}: holds {len(members)} pickles (data.pkl), not the one torch.save writes")
            if members[0].file_size > _MAX_PICKLE_BYTES:
                raise _not_deepspeeds(path, f"its pickle {members[0].filename} is {members[0].file_size} bytes, "
                                            f"more than the limit of {_MAX_PICKLE_BYTES} (DeepSpeed's are a few KB "
                                            "to a few MB)")
            return _read_member(archive, members[0], path, max_bytes=_MAX_PICKLE_BYTES, keep=True)
    except CheckpointError:  # a RuntimeError too: not to be taken for zipfile's (an encrypted member)
        raise
    except _ZIP_ERRORS as exc:
        raise _not_a_zip(path, exc) from exc


def verify_members(path: str) -> None:
    """Read every member of a ``torch.save`` zip file once, so zipfile checks each CRC-32, and
    refuse a compressed member but the pickle (see [Note: DeepSpeed's pickles]). Costs one read
    of the whole file, a chunk at a time."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                is_pickle = info.filename.endswith("/data.pkl")
                if info.compress_type != zipfile.ZIP_STORED and not is_pickle:
                    raise _not_deepspeeds(path, f"its member {info.filename} is compressed (torch.save stores every "
                                                "member; torch.load(mmap=True) would read its compressed bytes as "
                                                "tensor values)")
                _read_member(archive, info, path, max_bytes=_MAX_PICKLE_BYTES if is_pickle else None)
    except CheckpointError:  # a RuntimeError too: not to be taken for zipfile's (an encrypted member)
        raise
    except _ZIP_ERRORS as exc:
        raise _not_a_zip(path, exc) from exc


def pickled_globals(data: bytes, path: str) -> list[str]:
    """Every global the pickle ``data`` names, in order (parsed, never executed). An opcode that
    names a global from the stack (``STACK_GLOBAL``, ``INST``...) is refused: torch.save never
    writes one and the weights-only unpickler does not read one. The scan stops past
    :data:`_MAX_PICKLE_OPCODES` opcodes or :data:`_MAX_SCAN_SECONDS` (see [Note: DeepSpeed's pickles])."""
    found: list[str] = []
    deadline = time.monotonic() + _MAX_SCAN_SECONDS
    try:
        for count, (opcode, arg, _pos) in enumerate(pickletools.genops(io.BytesIO(data)), 1):
            if count > _MAX_PICKLE_OPCODES:
                raise _not_deepspeeds(path, f"its pickle holds more than {_MAX_PICKLE_OPCODES} opcodes (the limit; "
                                            "DeepSpeed's hold thousands)")
            if count % _SCAN_CLOCK_EVERY == 0 and time.monotonic() > deadline:
                raise _not_deepspeeds(path, f"scanning its pickle took more than {_MAX_SCAN_SECONDS:g} s (the limit; "
                                            f"{count} opcodes read)")
            if opcode.name == "GLOBAL":
                found.append(str(arg).replace(" ", "."))
            elif opcode.name in ("STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4"):
                raise CheckpointError(f"{path}: its pickle names an object through {opcode.name}, which "
                                      "torch.save never writes; refusing it")
    except (ValueError, EOFError, pickle.UnpicklingError) as exc:
        raise CheckpointError(f"{path}: its pickle is malformed ({exc})") from exc
    return found


def check_globals(path: str) -> None:
    """Refuse a file naming any global outside :data:`ALLOWED_GLOBALS`, naming each."""
    names = pickled_globals(_pickle_bytes(path), path)
    refused = sorted(set(names) - ALLOWED_GLOBALS)
    if refused:
        raise CheckpointError(
            f"{path}: holds {', '.join(refused)}, not among the classes a DeepSpeed checkpoint is read with "
            "(tensors, torch.Size, OrderedDict, DeepSpeed's ZeroStageEnum, LossScaler, DynamicLossScaler, "
            "fragment_address); unpickling it could run code, so it is refused. If it is your own client_state, "
            "re-save it from DeepSpeed as plain values (numbers, strings, lists, dicts)"
        )


def load_deepspeed_file(path: str) -> Any:
    """One DeepSpeed checkpoint file, read as [Note: DeepSpeed's pickles] says; tensors are
    memory-mapped from the file, not copied, after every member's CRC-32 is checked (one more
    read of the whole file)."""
    check_globals(path)
    verify_members(path)
    stand_ins = [(obj, name) for name, obj in _DEEPSPEED_STAND_INS.items()]
    try:
        with torch.serialization.safe_globals(stand_ins):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, TypeError, EOFError, OSError) as exc:
        refused = re.search(r"GLOBAL (\S+)", str(exc))  # torch's unpickler names a global outside its list
        detail = f"holds {refused.group(1)}, which it refuses" if refused else str(exc)[:300]
        raise CheckpointError(f"{path}: not a readable DeepSpeed checkpoint file (torch.load(weights_only=True) "
                              f"{detail})") from exc


# --------------------------------------------------------------------------- the folder
@dataclass(frozen=True)
class DeepSpeedFolder:
    """The files of one DeepSpeed checkpoint (one tag), every path resolved inside its folder."""

    tag_dir: str
    tag: str
    model_files: list[str]  # rank 0's first; stage 3 has one per rank
    optim_files: list[str]  # one per data-parallel rank, in rank order
    stage3: bool


def _holds_model_states(folder: str, root: str) -> bool:
    return any(os.path.isfile(resolve_inside(root, name, os.path.join(folder, name)))
               for name in (MODEL_STATES, STAGE3_MODEL_STATES.format(rank=0)))


def deepspeed_tag_dir(ds_dir: str | os.PathLike[str], tag: str | None) -> tuple[str, str]:
    """``(tag folder, tag)`` of a DeepSpeed checkpoint: ``ds_dir/tag``, ``ds_dir/<latest>``, or
    ``ds_dir`` itself when it holds the model states. Raises CheckpointNotFoundError when there
    is none."""
    ds_dir = os.path.abspath(os.fspath(ds_dir))
    if not os.path.isdir(ds_dir):
        raise CheckpointNotFoundError(f"{ds_dir}: no such DeepSpeed checkpoint directory")
    root = os.path.realpath(ds_dir)
    if tag is None:
        tag = read_latest(ds_dir, root)  # the rule of hf_zero's own 'latest'
        if tag is None:
            if _holds_model_states(ds_dir, root):
                return ds_dir, os.path.basename(ds_dir)
            raise CheckpointNotFoundError(f"{ds_dir}: no 'latest' file and no {MODEL_STATES}; pass tag=... "
                                          "naming the folder DeepSpeed saved (e.g. 'global_step100')")
    if not is_plain_name(tag) or tag == LATEST_NAME:
        raise CheckpointError(f"tag {tag!r:.80} is not a folder name inside {ds_dir}")
    tag_dir = resolve_inside(root, tag, os.path.join(ds_dir, tag))
    if not os.path.isdir(tag_dir) or not _holds_model_states(tag_dir, tag_dir):
        raise CheckpointNotFoundError(f"{os.path.join(ds_dir, tag)}: no DeepSpeed checkpoint ({MODEL_STATES} or "
                                      f"{STAGE3_MODEL_STATES.format(rank=0)} is missing)")
    return tag_dir, tag


def is_deepspeed_checkpoint(load_dir: str | os.PathLike[str], tag: str | None) -> bool:
    """Whether ``load_dir`` (with ``tag``) names a DeepSpeed checkpoint rather than an hf_zero one:
    its tag folder holds DeepSpeed's model states and no hf_zero manifest. Never raises."""
    try:
        tag_dir, _ = deepspeed_tag_dir(load_dir, tag)
        return not os.path.lexists(resolve_inside(tag_dir, "manifest.json", os.path.join(tag_dir, "manifest.json")))
    except (CheckpointError, OSError):
        return False


_RANK_FILE_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_UNSUPPORTED_RE = re.compile(r"^(layer_\d+|expert_\d+|.*mp_rank_(?!00_)\d+).*\.pt$")


def find_files(ds_dir: str | os.PathLike[str], tag: str | None) -> DeepSpeedFolder:
    """The model-states and optimizer files of a DeepSpeed ZeRO checkpoint, refusing layouts
    this import does not read (tensor or pipeline parallel, MoE experts)."""
    tag_dir, tag = deepspeed_tag_dir(ds_dir, tag)
    names = sorted(os.listdir(tag_dir))
    other = [n for n in names if _UNSUPPORTED_RE.match(n)]
    if other:
        raise NotImplementedError(
            f"{tag_dir}: holds {', '.join(other[:3])}: a checkpoint with tensor or pipeline parallelism or MoE "
            "experts; importing one is not supported (only data-parallel ZeRO-1/2/3 checkpoints)"
        )
    ranks: dict[int, str] = {}
    for name in names:
        match = _RANK_FILE_RE.match(name)
        if match:
            ranks[int(match.group(2))] = name
    if not ranks:
        raise CheckpointError(f"{tag_dir}: no zero_pp_rank_*_optim_states.pt files: not a ZeRO checkpoint (stage 0 "
                              "checkpoints keep a torch optimizer state, which this import does not read)")
    if sorted(ranks) != list(range(len(ranks))):
        raise CheckpointNotFoundError(f"{tag_dir}: optimizer files of ranks {sorted(ranks)}; ranks "
                                      f"{sorted(set(range(max(ranks) + 1)) - set(ranks))} are missing")
    first = STAGE3_MODEL_STATES.format(rank=0)
    stage3 = os.path.isfile(resolve_inside(tag_dir, first, os.path.join(tag_dir, first)))
    model_names = [STAGE3_MODEL_STATES.format(rank=r) for r in range(len(ranks))] if stage3 else [MODEL_STATES]
    model_files = [resolve_inside(tag_dir, n, os.path.join(tag_dir, n)) for n in model_names]
    missing = [p for p in model_files if not os.path.isfile(p)]
    if missing:
        raise CheckpointNotFoundError(f"{missing[0]}: missing ({len(missing)} model-states files are)")
    optim_files = [resolve_inside(tag_dir, ranks[r], os.path.join(tag_dir, ranks[r])) for r in range(len(ranks))]
    return DeepSpeedFolder(tag_dir, tag, model_files, optim_files, stage3)


def plain_ordered(value: Any) -> Any:
    """``OrderedDict`` as ``dict`` throughout (what JSON keeps)."""
    if isinstance(value, OrderedDict):
        value = dict(value)
    if isinstance(value, dict):
        return {k: plain_ordered(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_ordered(v) for v in value]
    return value
