"""Reading a DeepSpeed checkpoint file as untrusted input, without DeepSpeed and without an
engine (tests/integration/test_deepspeed_migration.py runs the same checks on files DeepSpeed
wrote): the pickle pre-scan bounded in bytes, opcodes and time, and every zip member's CRC-32
checked before torch.load maps the file ([Note: DeepSpeed's pickles]).
"""

from __future__ import annotations

import struct
import zipfile

import pytest
import torch

from hf_zero.checkpoint import CheckpointError
from hf_zero.checkpoint import deepspeed_files as F

NO_OP = b"N0"  # NONE then POP: two opcodes that leave the stack as it was


def _torch_file(path) -> str:
    """A file shaped as DeepSpeed's: torch.save of a dict of tensors and plain values."""
    torch.save({"optimizer_state_dict": {"fp32": torch.arange(256, dtype=torch.float32), "step": 3}}, str(path))
    return str(path)


def _pickle_file(path, pickle_bytes: bytes, compression: int = zipfile.ZIP_DEFLATED) -> str:
    """A zip holding ``archive/data.pkl`` as a hostile file would: deflated, so it is small on disk."""
    with zipfile.ZipFile(path, "w", compression=compression) as archive:
        archive.writestr("archive/data.pkl", pickle_bytes)
    return str(path)


def _member_data_offset(path: str, name: str) -> int:
    """Where the bytes of member ``name`` start in the file (after its local header)."""
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(name)
    with open(path, "rb") as handle:
        handle.seek(info.header_offset)
        header = handle.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _declare_size(path: str, name: str, declared: int) -> None:
    """Rewrite the uncompressed size that the local and central headers of ``name`` declare."""
    raw = bytearray(open(path, "rb").read())
    with zipfile.ZipFile(path) as archive:
        local = archive.getinfo(name).header_offset
    struct.pack_into("<I", raw, local + 22, declared)
    central = raw.rindex(b"PK\x01\x02")  # the directory entry of the only member, after its data
    assert raw[central + 46:central + 46 + len(name)] == name.encode()
    struct.pack_into("<I", raw, central + 24, declared)
    open(path, "wb").write(bytes(raw))


# ------------------------------------------------------------------ a file as torch.save writes it
def test_a_file_as_torch_save_writes_it_is_read(tmp_path):
    state = F.load_deepspeed_file(_torch_file(tmp_path / "ok.pt"))
    assert torch.equal(state["optimizer_state_dict"]["fp32"], torch.arange(256, dtype=torch.float32))


# ------------------------------------------------------------------ the pickle's size
def test_a_pickle_larger_than_its_header_says_is_refused(tmp_path):
    """The header declares 100 bytes, the deflated member holds 2 MB: zipfile stops at the
    declared size and the CRC-32 of the 100 bytes is not the member's, so it is refused."""
    path = _pickle_file(tmp_path / "lies.pt", NO_OP * (1 << 20) + b"N.")
    _declare_size(path, "archive/data.pkl", 100)
    with zipfile.ZipFile(path) as archive:
        assert archive.getinfo("archive/data.pkl").file_size == 100
    with pytest.raises(CheckpointError, match="member archive/data.pkl fails its CRC-32") as error:
        F.check_globals(path)
    assert path in str(error.value)


def test_a_pickle_over_the_limit_in_its_header_is_refused(tmp_path, monkeypatch):
    path = _pickle_file(tmp_path / "big.pt", NO_OP * 1000 + b"N.")
    monkeypatch.setattr(F, "_MAX_PICKLE_BYTES", 1000)
    with pytest.raises(CheckpointError, match="is 2002 bytes, more than the limit of 1000") as error:
        F.check_globals(path)
    assert path in str(error.value) and "not a DeepSpeed checkpoint file as DeepSpeed writes it" in str(error.value)


def test_reading_a_member_stops_past_the_limit(tmp_path):
    """The limit is enforced while reading, a chunk at a time, whatever the header said."""
    path = _pickle_file(tmp_path / "big.pt", NO_OP * (3 << 19) + b"N.")  # 3 MiB: more than 2 chunks
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo("archive/data.pkl")
        assert len(F._read_member(archive, info, path, max_bytes=4 << 20, keep=True)) == info.file_size
        with pytest.raises(CheckpointError, match=f"decompresses to more than {1 << 20} bytes") as error:
            F._read_member(archive, info, path, max_bytes=1 << 20, keep=True)
    assert path in str(error.value)


# ------------------------------------------------------------------ opcodes and time
def test_an_opcode_flood_is_refused_at_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(F, "_MAX_PICKLE_OPCODES", 10_000)
    assert F.pickled_globals(NO_OP * 4_999 + b"N.", "below.pt") == []  # 10,000 opcodes: at the limit
    path = _pickle_file(tmp_path / "flood.pt", NO_OP * 50_000 + b"N.")  # 100 KB, 7 KB on disk
    with pytest.raises(CheckpointError, match="more than 10000 opcodes") as error:
        F.load_deepspeed_file(path)
    assert path in str(error.value) and "re-save it with DeepSpeed" in str(error.value)


def test_a_scan_past_the_time_limit_is_refused(tmp_path, monkeypatch):
    """The clock is read every _SCAN_CLOCK_EVERY opcodes: a flood past that many, with no time
    allowed, stops at the first look."""
    monkeypatch.setattr(F, "_MAX_SCAN_SECONDS", 0.0)
    path = _pickle_file(tmp_path / "slow.pt", NO_OP * F._SCAN_CLOCK_EVERY + b"N.")
    with pytest.raises(CheckpointError, match="scanning its pickle took more than 0 s") as error:
        F.check_globals(path)
    assert path in str(error.value)


# ------------------------------------------------------------------ CRC-32 of every member
def test_a_flipped_byte_in_tensor_data_is_refused_naming_the_member(tmp_path):
    path = _torch_file(tmp_path / "flipped.pt")
    with zipfile.ZipFile(path) as archive:
        name = next(i.filename for i in archive.infolist() if i.filename.endswith("/data/0"))
    raw = bytearray(open(path, "rb").read())
    raw[_member_data_offset(path, name) + 100] ^= 0x01
    open(path, "wb").write(bytes(raw))
    with pytest.raises(CheckpointError, match=f"the file is damaged: member {name} fails its CRC-32") as error:
        F.load_deepspeed_file(path)
    assert path in str(error.value)


def test_a_compressed_tensor_member_is_refused(tmp_path):
    """torch.load(mmap=True) would map a deflated tensor's compressed bytes as its values."""
    stored = _torch_file(tmp_path / "stored.pt")
    path = str(tmp_path / "deflated.pt")
    with zipfile.ZipFile(stored) as source, zipfile.ZipFile(path, "w") as out:
        for info in source.infolist():
            deflated = info.filename.endswith("/data/0")
            out.writestr(info.filename, source.read(info), zipfile.ZIP_DEFLATED if deflated else zipfile.ZIP_STORED)
    mapped = torch.load(path, weights_only=True, mmap=True)["optimizer_state_dict"]["fp32"]
    assert not torch.equal(mapped, torch.arange(256, dtype=torch.float32))  # torch maps the deflated bytes
    with pytest.raises(CheckpointError, match=r"its member \S+/data/0 is compressed") as error:
        F.load_deepspeed_file(path)
    assert path in str(error.value)
