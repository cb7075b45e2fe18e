"""Run the fake-world benchmarks and tests on a GPU image whose torch predates 2.13.

torch 2.11's fake process group leaves a reduce-scatter's output untouched, where 2.13 and later
copy this rank's chunk of the input into it; hf_zero's gradient shards are uninitialised memory
until that copy, so a fake-world step on 2.11 steps on garbage (non-finite gradients). Putting this
folder first on PYTHONPATH (benchmarks/gpu.sh does) gives 2.11 the 2.13 behaviour for the fake
backend only; on torch 2.13 and later, the supported range, it does nothing. Real backends
(NCCL, gloo) are never touched.
"""

from importlib import metadata


def _older_than_2_13() -> bool:
    try:
        major, minor = (int(part) for part in metadata.version("torch").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) < (2, 13)


if _older_than_2_13():
    import torch.distributed as dist

    _reduce_scatter_tensor = dist.reduce_scatter_tensor

    def _fake_fills_its_chunk(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        work = _reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
        if dist.get_backend(group) == "fake":
            numel = output.numel()
            rank = dist.get_rank(group)
            output.view(-1).copy_(input.view(-1)[rank * numel:(rank + 1) * numel])
        return work

    _fake_fills_its_chunk.__name__ = "reduce_scatter_tensor"
    _fake_fills_its_chunk.__qualname__ = "reduce_scatter_tensor"
    _fake_fills_its_chunk.__module__ = "torch.distributed.distributed_c10d"
    dist.reduce_scatter_tensor = _fake_fills_its_chunk
