"""Leftovers and disk space ([Note: atomic save], NVMe offload): real directories, a real
process that has exited, the real free space of the temporary directory's filesystem."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys

import pytest

from hf_zero.checkpoint.save import _exchange_dirs
from hf_zero.offload.nvme import check_nvme_path, report_stale_folders


def test_the_free_space_check_counts_every_rank_on_the_machine(tmp_path, monkeypatch):
    # Free space is read again right before each check, with wide margins: other tests write and
    # delete files on the same disk while this one runs.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    check_nvme_path(str(tmp_path), needed_bytes=int(shutil.disk_usage(tmp_path).free * 0.4))  # one rank fits
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(OSError, match="for the 2 ranks on this machine") as info:
        check_nvme_path(str(tmp_path), needed_bytes=int(shutil.disk_usage(tmp_path).free * 0.75))
    # No size printed as zero (a whole "0.00 GiB", not the end of "50.00 GiB")
    assert not re.search(r"(?<![\d.])0\.00 GiB", str(info.value)), str(info.value)


def test_a_small_free_space_is_printed_in_a_unit_that_shows_it(tmp_path):
    from hf_zero.offload.nvme import format_bytes

    assert format_bytes(3 * 2**20 + 2**19) == "3.50 MiB" and format_bytes(512) == "512 bytes"


def test_folders_of_dead_processes_are_reported_and_live_ones_are_not(tmp_path, caplog):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(done.stdout)
    (tmp_path / f"hf_zero-rank0-pid{dead}").mkdir()
    (tmp_path / f"hf_zero-rank0-pid{dead}" / "group0000.master.fp32").write_bytes(b"\0" * 4096)
    (tmp_path / f"hf_zero-rank1-pid{os.getpid()}").mkdir()
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        assert report_stale_folders(str(tmp_path)) == [f"hf_zero-rank0-pid{dead}"]
    assert "4.00 KiB" in caplog.text


def test_re_saving_a_tag_swaps_the_directories_in_one_step(tmp_path):
    old, new = tmp_path / "global_step3", tmp_path / ".global_step3.tmp-1"
    old.mkdir()
    new.mkdir()
    (old / "manifest.json").write_text("old")
    (new / "manifest.json").write_text("new")
    if not _exchange_dirs(str(new), str(old)):
        pytest.skip("no renameat2 on this system: the two-rename fallback is used")
    assert (old / "manifest.json").read_text() == "new" and (new / "manifest.json").read_text() == "old"


def test_the_engine_offers_every_member_of_the_checkpoint_interface(monkeypatch):
    import hf_zero
    from hf_zero.checkpoint.engine_state import EngineState, flat_groups
    from tests.tiny_models import BUILDERS

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    engine, *_ = hf_zero.initialize(model=BUILDERS["gpt2"](), config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert isinstance(engine, EngineState)
    assert [g.label for g in flat_groups(engine)] == [r["group"] for r in engine.layout()]


def test_leftover_save_folders_are_reported_with_their_sizes_and_links_not_followed(tmp_path, caplog):
    from hf_zero.checkpoint.save import _report_leftovers

    leftover = tmp_path / ".global_step1.tmp-0123abcd"
    leftover.mkdir()
    (leftover / "rank-00000-of-00002.safetensors").write_bytes(b"\0" * 3 * 1024)
    outside = tmp_path.parent / f"{tmp_path.name}-outside.bin"
    outside.write_bytes(b"\0" * 5 * 2**20)  # a link to it must not count its 5 MiB
    os.symlink(outside, leftover / "link")
    (tmp_path / "global_step1").mkdir()
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        _report_leftovers(str(tmp_path), "global_step2")
    assert ".global_step1.tmp-0123abcd (3." in caplog.text and "KiB)" in caplog.text, caplog.text
    assert "MiB" not in caplog.text and "global_step1 " not in caplog.text.replace(".global_step1", "")
