"""The NVMe optimizer store's I/O ([Note: NVMe I/O] in hf_zero.offload.nvme_io): tiles read and
written in blocks on I/O threads, and with ``pipeline_read`` / ``pipeline_write`` the next tile
read while the current one steps and the current one written while the next steps. The values
are those of the one-buffer, wait-for-each-request step, bit for bit; the order of reads, steps
and writes is what the overlap needs; an I/O error is raised by the step."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
import torch

from hf_zero.engine.sharding.param_usage import Segment
from hf_zero.offload.nvme import STATES, NvmeOptimizerStore
from hf_zero.offload.nvme_io import AioSettings

NUMELS = [3500, 700]  # group 0: four tiles of 1024, the last one short; group 1: one tile
TILE = 1024  # a whole number of 4 KiB blocks: [Note: direct I/O]
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def _store(root: Path, aio: AioSettings) -> NvmeOptimizerStore:
    root.mkdir()
    store = NvmeOptimizerStore(str(root), 0, NUMELS, TILE, aio)
    for index, numel in enumerate(NUMELS):
        store.store_master(index, torch.randn(numel, generator=torch.Generator().manual_seed(index)))
    return store


def _train(store: NvmeOptimizerStore, steps: int = 3) -> dict[str, torch.Tensor]:
    computed = {index: torch.zeros(numel) for index, numel in enumerate(NUMELS)}
    # group 0: the parameter in elements 1024-2048 was used by no rank: its tile is skipped
    usage = ([Segment(0, 0, 1024), Segment(1, 1024, 2048), Segment(2, 2048, 3500)], [True, False, True])
    for step in range(steps):
        for index, numel in enumerate(NUMELS):
            if step == 1 and index == 1:  # what a checkpoint load does between two groups' steps: the
                store.write(1, "master", 0, torch.full((NUMELS[1],), 0.25))  # read-ahead tile is stale
            grad = torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + index))
            store.step(index, grad, lambda tile, start, i=index: computed[i][start:start + tile.numel()].copy_(tile),
                       HYPER, grad_scale=1.0, clip_coef=0.5, usage=usage if index == 0 else None)
    states = {f"{index}.{state}": store.read(index, state, 0, numel) for index, numel in enumerate(NUMELS)
              for state in STATES}
    return {**states, **{f"{index}.computed": values for index, values in computed.items()}}


def test_overlapped_tiles_give_the_values_of_the_waiting_step(tmp_path: Path) -> None:
    waiting = _store(tmp_path / "waiting", AioSettings())
    overlapped = _store(tmp_path / "overlapped", AioSettings(block_size=512, threads=3, pipeline=True))
    plain, fast = _train(waiting), _train(overlapped)
    assert plain.keys() == fast.keys()
    for name in plain:
        assert torch.equal(plain[name], fast[name]), name
    assert not torch.equal(plain["0.master"][1024:2048], plain["0.master"][:1024])  # it trained
    waiting.close()
    overlapped.close()


def _order(store: NvmeOptimizerStore) -> list[tuple[str, int]]:
    """("read", start) per tile, ("step", start), ("write", start) per state, ("prefetch", group)
    for the next group's first tile; group 0's step, then group 1's (marked by ("group", 1))."""
    store.trace = []
    for index, numel in enumerate(NUMELS):
        store._note("group", index)
        store.step(index, torch.ones(numel), lambda tile, start: None, HYPER, grad_scale=1.0, clip_coef=1.0)
    return store.trace


def test_the_next_tile_is_read_before_this_one_steps(tmp_path: Path) -> None:
    overlapped = _store(tmp_path / "overlapped", AioSettings(pipeline=True))
    trace = _order(overlapped)
    group0 = trace[: trace.index(("group", 1))]
    steps = [start for event, start in group0 if event == "step"]
    assert steps == [0, 1024, 2048, 3072]
    for this, following in zip(steps, steps[1:]):
        assert group0.index(("read", following)) < group0.index(("step", this)), trace
    # group 1's only tile is read while group 0's last tile steps, and its step reads it no more
    assert group0.index(("prefetch", 1)) < group0.index(("step", 3072)), trace
    assert trace[trace.index(("group", 1)) + 1] == ("step", 0), trace
    waiting = _store(tmp_path / "waiting", AioSettings())
    trace = _order(waiting)
    group0 = trace[: trace.index(("group", 1))]
    for this, following in zip(steps, steps[1:]):  # one set of buffers: read after the writes
        assert group0.index(("read", following)) > group0.index(("write", this)), trace
    assert ("prefetch", 1) not in trace
    overlapped.close()
    waiting.close()


@pytest.mark.parametrize("pipeline", [False, True])
def test_an_io_error_is_raised_by_the_step(tmp_path: Path, pipeline: bool) -> None:
    store = _store(tmp_path / "store", AioSettings(block_size=1024, threads=2, pipeline=pipeline))
    os.truncate(store.path(0, "exp_avg"), 2500 * 4)  # the third and fourth tiles are gone
    with pytest.raises(OSError, match="short read from .*exp_avg"):
        store.step(0, torch.ones(NUMELS[0]), lambda tile, start: None, HYPER, grad_scale=1.0, clip_coef=1.0)
    store.close()


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_failed_write_is_raised_by_the_step(tmp_path: Path, pipeline: bool) -> None:
    store = _store(tmp_path / "store", AioSettings(block_size=1024, threads=2, pipeline=pipeline))
    fd = store._fds[(0, "exp_avg_sq")]
    read_only = os.open(store.path(0, "exp_avg_sq"), os.O_RDONLY)
    os.dup2(read_only, fd)  # reads still work, every write to this file fails
    os.close(read_only)
    with pytest.raises(OSError):
        store.step(0, torch.ones(NUMELS[0]), lambda tile, start: None, HYPER, grad_scale=1.0, clip_coef=1.0)
    store.close()


def test_groups_stepped_backwards_read_ahead_backwards(tmp_path: Path) -> None:
    """The overlapped step takes the groups in the backward's order: stepped 2, 1, 0, the
    read-ahead follows that direction once it is seen (after 2, group 3 does not exist; after 2
    then 1, group 0 is read ahead), instead of reading group 2 again."""
    root = tmp_path / "store"
    root.mkdir()
    store = NvmeOptimizerStore(str(root), 0, [500, 500, 500], TILE, AioSettings(pipeline=True))
    store.trace = []
    for index in (2, 1, 0):
        store.step(index, torch.ones(500), lambda tile, start: None, HYPER, grad_scale=1.0, clip_coef=1.0)
    prefetched = [group for event, group in store.trace if event == "prefetch"]
    assert prefetched == [0], store.trace
    assert [event for event, _ in store.trace].count("read") == 2, store.trace  # 2's, and 1's (not prefetched)
    store.close()


def _cached_pages(path: str) -> int:
    """Pages of ``path`` in the page cache (``mincore`` over a mapping that touches none)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), size) as mapped:
        vector = (ctypes.c_ubyte * pages)()
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        try:
            if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            return sum(v & 1 for v in vector)
        finally:
            del address  # the exported buffer must go before the mapping closes


def _step_all(store: NvmeOptimizerStore) -> None:
    for index, numel in enumerate(NUMELS):
        store.step(index, torch.ones(numel), lambda tile, start: None, HYPER, grad_scale=1.0, clip_coef=1.0)


@pytest.mark.parametrize("pipeline", [False, True])
def test_the_step_leaves_the_page_cache_alone(tmp_path: Path, pipeline: bool) -> None:
    """[Note: direct I/O]: after a step, no page of the state files is cached (the masters
    written through the buffered descriptor were dropped by the step's direct writes); with
    buffered I/O every page is."""
    direct = _store(tmp_path / "direct", AioSettings(pipeline=pipeline, block_size=5000))
    buffered = _store(tmp_path / "buffered", AioSettings(pipeline=pipeline, direct=False))
    assert direct.direct and not buffered.direct
    flags = fcntl.fcntl(direct._fds[(0, "master")], fcntl.F_GETFL)
    assert flags & os.O_DIRECT
    _step_all(direct)
    _step_all(buffered)
    paths = [(store, store.path(index, state)) for store in (direct, buffered)
             for index in range(len(NUMELS)) for state in STATES]
    cached = {store: sum(_cached_pages(path) for s, path in paths if s is store) for store in (direct, buffered)}
    assert cached[direct] == 0, cached
    assert cached[buffered] >= sum(4 * n // 4096 for n in NUMELS) * len(STATES), cached
    direct.close()
    buffered.close()


def test_direct_and_buffered_io_train_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """The same values through either descriptor, and a filesystem without O_DIRECT falls back
    to the page cache with one warning."""
    direct = _store(tmp_path / "direct", AioSettings(pipeline=True))
    buffered = _store(tmp_path / "buffered", AioSettings(pipeline=True, direct=False))
    monkeypatch.setattr("hf_zero.offload.nvme_io._O_DIRECT", 0)
    with caplog.at_level("WARNING", logger="hf_zero"):
        refused = _store(tmp_path / "refused", AioSettings(pipeline=True))
    assert not refused.direct and "goes through the page cache: this platform has no O_DIRECT" in caplog.text
    results = [_train(store) for store in (direct, buffered, refused)]
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]) and torch.equal(results[0][name], results[2][name]), name
    for store in (direct, buffered, refused):
        store.close()


def test_a_tile_is_a_whole_number_of_blocks(tmp_path: Path) -> None:
    """sub_group_size and aio.block_size are rounded up to whole 4 KiB blocks, the files padded:
    a step over a short last tile, in requests of an odd block size, moves only aligned blocks."""
    (tmp_path / "s").mkdir()
    store = NvmeOptimizerStore(str(tmp_path / "s"), 0, [5000], 1000, AioSettings(block_size=5000))
    assert store.tile_numel == 1024 and store._buffer_sets[0]["master"].data_ptr() % 4096 == 0
    assert os.path.getsize(store.path(0, "master")) == 20480  # 5000 x 4 bytes, padded to 5 blocks
    store.close()
    (tmp_path / "b").mkdir()
    store = NvmeOptimizerStore(str(tmp_path / "b"), 0, [5000], 3000, AioSettings(block_size=5000, threads=2))
    assert store.direct and store.tile_numel == 3072
    store.store_master(0, torch.arange(5000, dtype=torch.float32))
    store.step(0, torch.ones(5000), lambda tile, start: None, HYPER, grad_scale=1.0, clip_coef=1.0)
    assert torch.equal(store.read(0, "exp_avg", 0, 5000), torch.full((5000,), 0.1))  # (1 - beta1) x 1
    store.close()
