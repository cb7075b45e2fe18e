"""[Note: the buffer pool]: the engine owns the unit buffers it churns on the CPU, reuses them
from one unit to the next, lets them go at the phase boundaries, and leaves the process's
allocator as it found it. World size 1 in this process (a real gloo group of one), like a
notebook."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hf_zero.engine.sharding.buffer_pool import BufferPool
from tests.distributed import scenarios as S

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _stage3_llama(gas: int = 1, **zero: object):
    import hf_zero

    sc = S.scenario("llama", 3, gas=gas, zero=dict(zero))
    engine, _, _, _ = hf_zero.initialize(model=S.build_model(sc), config=S.make_config(sc))
    return engine


def _ids() -> torch.Tensor:
    return torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))


def test_the_next_layer_reuses_the_last_layers_buffer_and_nothing_is_held_between_steps(no_launcher_env):
    # No prefetch and no reuse distance: each decoder layer is gathered when its forward starts
    # and freed when it ends, so layer 1 can take layer 0's buffer.
    engine = _stage3_llama(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
    pool = engine.protocol.buffers
    assert pool.idle_bytes == 0 and pool.mapped_bytes == 0  # initialize is a phase boundary
    layers = engine.module.model.layers
    seen: dict[str, tuple[int, int]] = {}

    def record(moment: str):
        def hook(*args: object) -> None:  # (mappings made so far, idle bytes)
            seen.setdefault(moment, (pool.mappings, pool.idle_bytes))
        return hook

    # Registered after the engine's hooks, so these run after its gather / release.
    for name, layer in (("layer 0", layers[0]), ("layer 1", layers[1])):
        layer.register_forward_pre_hook(record(f"{name} gathered"))
        layer.register_forward_hook(record(f"{name} freed"))
    engine.module.lm_head.register_forward_hook(record("head done"))  # the last unit of the forward order

    loss = S.model_loss(engine, "llama", _ids())
    layer_unit = next(unit for unit in engine.units if unit.module is layers[0])
    layer_bytes = layer_unit.sharded_numel * 4
    assert seen["layer 0 freed"][1] - seen["layer 0 gathered"][1] == layer_bytes > 0  # layer 0's buffer waits idle
    assert seen["layer 1 gathered"][0] == seen["layer 0 freed"][0]  # layer 1 mapped nothing new: it took that buffer
    assert seen["layer 1 gathered"][1] == seen["layer 0 gathered"][1]
    assert seen["head done"][1] == 0  # the forward passed its last unit: idle buffers let go before the loss
    engine.backward(loss)
    assert pool.acquisitions > pool.mappings  # the backward reused buffers too (parameters and gradients)
    assert pool.idle_bytes == 0  # the end of the backward is a phase boundary
    assert pool.mapped_bytes == 0  # every unit resharded, every gradient reduced: the pool holds nothing
    engine.step()
    acquired, mapped = pool.acquisitions, pool.mappings
    engine.backward(S.model_loss(engine, "llama", _ids()))
    engine.step()
    assert pool.acquisitions - acquired > pool.mappings - mapped  # the second step reuses as much
    assert pool.mapped_bytes == 0


def test_a_steps_first_fp32_reduction_of_a_group_writes_its_gradient_shard(no_launcher_env):
    # [Note: reducing into the gradient shard]: no result buffer while the shard holds zeros;
    # the second micro-step of an accumulation adds into it through a buffer of the pool.
    engine = _stage3_llama(gas=2)
    pool = engine.protocol.buffers
    reduced = [g for unit in engine.units for g in unit.trainable_groups]
    engine.backward(S.model_loss(engine, "llama", _ids()))
    assert pool.temporaries == 0 and all(not g.grads.shard_is_zero for g in reduced)
    engine.step()  # not the boundary yet
    engine.backward(S.model_loss(engine, "llama", _ids()))
    assert pool.temporaries == len(reduced)
    engine.step()  # the optimizer step zeroes the shards: the next window writes them again
    assert all(g.grads.shard_is_zero for g in reduced)
    engine.backward(S.model_loss(engine, "llama", _ids()))
    assert pool.temporaries == len(reduced)


def _freed(numel: int) -> torch.Tensor:
    """A flat fp32 buffer whose storage is freed, as a sharded group's full buffer is."""
    buffer = torch.empty(numel)
    buffer.untyped_storage().resize_(0)
    return buffer


def test_idle_buffers_stay_within_the_bound_and_sizes_used_once_are_not_kept() -> None:
    pool = BufferPool(torch.device("cpu"), prefetch_bytes=0, buffers_in_flight=0)  # 2 idle per size
    layer, unique = 4096 * 4, 7000 * 4
    groups = [object() for _ in range(5)]
    for group in groups:
        pool.register(layer, group)
    pool.register(unique, groups[0])
    pool.register(unique, groups[0])  # one group's parameters and gradients: still one user
    assert pool.idle_limit_bytes == 2 * layer
    buffers = [_freed(4096) for _ in range(5)]
    for buffer in buffers:
        assert pool.acquire(buffer)
        buffer.fill_(1.0)
    assert pool.mappings == 5 and pool.mapped_bytes == 5 * layer
    for buffer in buffers:
        pool.release(buffer)
        assert buffer.untyped_storage().nbytes() == 0
    assert pool.idle_bytes == 2 * layer and pool.mapped_bytes == 2 * layer  # three unmapped at once
    assert pool.acquire(buffers[0]) and pool.mappings == 5  # taken from the idle ones
    odd = _freed(7000)
    pool.acquire(odd)
    pool.release(odd)
    assert pool.idle_bytes == layer  # a size only one group has is unmapped, never kept
    pool.release_idle()
    assert pool.idle_bytes == 0 and pool.mapped_bytes == layer  # the one still in use stays
    pool.release(buffers[0])
    assert pool.idle_bytes == pool.mapped_bytes == layer
    pool.release_idle()
    assert pool.mapped_bytes == 0


def test_a_gpu_pool_leaves_the_memory_to_the_caching_allocator() -> None:
    pool = BufferPool(torch.device("cuda", 0))
    assert not pool.owns_memory  # on CPU tensors it then resizes, as the caching allocator would be asked
    pool.register(64, "one group")
    pool.register(64, "another")
    buffer = _freed(16)
    pool.acquire(buffer)
    pool.release(buffer)
    assert pool.mappings == 0 and pool.idle_bytes == 0 and buffer.untyped_storage().nbytes() == 0


# glibc's dynamic mmap threshold: once a mapped block is freed, blocks up to its size come from
# the heap. ``mallopt(M_MMAP_THRESHOLD)`` (what hf_zero used to call under stage 3) or the
# ``MALLOC_MMAP_THRESHOLD_`` variable fixes the threshold instead, and a 1 MiB block is then
# always mapped. The probe prints how many mappings a 1 MiB malloc made after a 4 MiB one was freed.
_PROBE = textwrap.dedent("""
    import ctypes, torch
    from tests.distributed import scenarios as S
    import hf_zero
    sc = S.scenario("llama", 3)
    engine, _, _, _ = hf_zero.initialize(model=S.build_model(sc), config=S.make_config(sc))
    for _ in range(2):
        engine.backward(S.model_loss(engine, "llama", torch.randint(0, 97, (2, 12))))
        engine.step()
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                      "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    libc.free(libc.malloc(4 << 20))
    before = libc.mallinfo2().hblks
    block = libc.malloc(1 << 20)
    print("MAPPED", libc.mallinfo2().hblks - before)
    libc.free(block)
""")


def _mapped_by_a_1mib_malloc(extra_env: dict[str, str]) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(extra_env, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return int(next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("MAPPED")))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_stage3_training_leaves_the_process_allocator_as_it_was() -> None:
    assert _mapped_by_a_1mib_malloc({}) == 0  # glibc's own behaviour: the threshold moved up
    # The documented opt-in (docs/loading.md) fixes the threshold, and the probe sees it.
    assert _mapped_by_a_1mib_malloc({"MALLOC_MMAP_THRESHOLD_": "131072"}) == 1
