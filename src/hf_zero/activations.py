"""Activation memory per rank of one training step, traced on fake tensors: what
``hf-zero estimate --seq`` adds to the model states and the engine's working set.

[Note: traced activations]
The model is built from its config under torch's ``FakeTensorMode`` (tensors with shapes, dtypes
and storages but no memory) with one and with two of its layers, and one forward and backward
runs on a batch of ``micro_batch x seq`` tokens (``seq / S`` under sequence parallelism), with
the settings that change what autograd keeps: the model's gradient checkpointing, the tiled MLP
and the tiled loss (installed as training installs them), and the sequence-parallel attention
(the wrapper training registers, its all-to-all replaced by a copy of the same shape; at S = 1 by
nothing, so that attention runs causal without a mask, as a real batch without padding does). A
dispatch mode counts the bytes of every storage an operation creates while a tensor still
refers to it: after the forward (what is kept for the backward, the logits included) and at
its peak over the forward and backward. Parameters and their gradients are the states' and the
working set's (``estimator.py``), so they are left out: a parameter's storage, and during the
backward every tensor of a parameter's shape. The figures for the model's L layers are the one-
layer figures plus L - 1 times the difference the second layer makes: layers of one kind each
add the same.

What it does not see: kernels that keep workspace beyond their outputs (a GPU's flash attention
keeps only q, k, v, the output and the log-sum-exp, as the CPU kernel traced here does), the
allocator's rounding and fragmentation, and the engine's own buffers (gathered parameters and
gradient buckets, which ``estimator.py`` replays). tests/unit/test_activation_trace.py checks the
trace against the resident peak of a real run.
"""

from __future__ import annotations

import weakref
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hf_zero.partition import ROOT_UNIT_NAME, plan_units
from hf_zero.sequence_parallel.attention import attach
from hf_zero.sequence_parallel.layout import SequenceParallelLayout
from hf_zero.sequence_parallel.model import causal_lm_heads
from hf_zero.sequence_parallel.tiled_loss import install_tiled_loss
from hf_zero.sequence_parallel.tiled_mlp import install_tiled_mlp, tileable_mlps

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ActivationSettings:
    """What decides a step's activations, besides the model."""

    seq_len: int
    micro_batch: int = 1
    dtype: str = "bf16"
    sequence_parallel_size: int = 1
    gradient_checkpointing: bool = False
    tiled_loss_tokens: int = 0
    tiled_mlp_tokens: int = 0

    @property
    def local_seq(self) -> int:
        """Tokens of a sequence on one rank: 1/S of it, padded to a multiple of S."""
        size = self.sequence_parallel_size
        return -(-self.seq_len // size)


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes of activations on one rank ([Note: traced activations])."""

    settings: ActivationSettings
    layers: int
    after_forward: int  # kept for the backward, with the logits
    peak: int  # over the forward and the backward
    per_layer_after_forward: int
    per_layer_peak: int
    # The most the output head and the loss add above what was live when the head began: the
    # logits, the loss's fp32 copy and what it keeps for the backward (with tiling, one tile's).
    logits_and_loss: int = 0
    # (unit name, "forward" or "backward") -> the most bytes live while that unit ran: [Note: activations by unit]
    by_unit: dict[tuple[str, str], int] = field(default_factory=dict)


class _LiveStorages(TorchDispatchMode):
    """The bytes of the storages operations made that some tensor still refers to, and their peak."""

    def __init__(self, skip: set[int], param_shapes: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.skip = skip
        self.param_shapes = param_shapes
        self.backward = False
        self.holders: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self.segment_peak = 0  # since the last unit boundary: [Note: activations by unit]
        self.mark_peak = 0  # since mark()
        self.marked = 0  # live at mark()

    def mark(self) -> None:
        self.marked = self.mark_peak = self.live

    def _release(self, key: int) -> None:
        self.holders[key] -= 1
        if not self.holders[key]:
            del self.holders[key]
            self.live -= self.sizes.pop(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            key = tensor.untyped_storage()._cdata
            if key in self.skip or (self.backward and tuple(tensor.shape) in self.param_shapes):
                continue
            if key not in self.holders:
                self.holders[key] = 0
                self.sizes[key] = tensor.untyped_storage().nbytes()
                self.live += self.sizes[key]
                self.peak = max(self.peak, self.live)
                self.segment_peak = max(self.segment_peak, self.live)
                self.mark_peak = max(self.mark_peak, self.live)
            self.holders[key] += 1
            weakref.finalize(tensor, self._release, key)
        return out


class _SameShape(torch.autograd.Function):
    """An all-to-all's memory without its collective: new storage of the same shape both ways."""

    @staticmethod
    def forward(ctx: Any, chunks: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(chunks.contiguous())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(grad.contiguous())


class _TracedLayout(SequenceParallelLayout):
    def all_to_all(self, chunks: torch.Tensor) -> torch.Tensor:
        return chunks if self.size == 1 else _SameShape.apply(chunks)


class _UnitSegments:
    """The most bytes live in each (unit, phase) stretch of the step ([Note: activations by unit])."""

    def __init__(self, counter: _LiveStorages) -> None:
        self.counter = counter
        self.current = (ROOT_UNIT_NAME, "forward")
        self.peaks: dict[tuple[str, str], int] = {}
        self.order: list[str] = []  # units in the order their forwards began

    def enter(self, key: tuple[str, str]) -> None:
        self.peaks[self.current] = max(self.peaks.get(self.current, 0), self.counter.segment_peak)
        self.counter.segment_peak = self.counter.live
        self.current = key

    def watch(self, name: str, module: nn.Module) -> None:
        def before_forward(*_: Any) -> None:
            if not self.counter.backward:  # a checkpointed layer's recompute is its backward's
                if name not in self.order:
                    self.order.append(name)
                self.enter((name, "forward"))

        def after_forward(_module: nn.Module, _inputs: Any, output: Any) -> None:
            if self.counter.backward:
                return
            self.enter((name, "forward"))  # until the next unit: the loss after the head is the head's
            # The unit's backward begins when the gradient of its output arrives.
            first = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if first is not None:
                first.register_hook(lambda grad: self.enter((name, "backward")))

        module.register_forward_pre_hook(before_forward)
        module.register_forward_hook(after_forward)


def _trace(config: Any, layers: int, settings: ActivationSettings) -> tuple[int, int, _UnitSegments, int]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    config = config.__class__.from_dict({**config.to_dict(), "num_hidden_layers": layers, "use_cache": False})
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = AutoModelForCausalLM.from_config(config, **_dtype_argument(DTYPES[settings.dtype]),
                                                 attn_implementation=getattr(config, "_attn_implementation", None)
                                                 or "sdpa")
        model.train()
        if settings.gradient_checkpointing:
            enable_checkpointing(model)
        if settings.tiled_mlp_tokens:
            install_tiled_mlp(tileable_mlps(model), settings.tiled_mlp_tokens)
        if settings.tiled_loss_tokens:
            install_tiled_loss(causal_lm_heads(model), settings.tiled_loss_tokens, None)
        _attach_traced_attention(model, settings.sequence_parallel_size)
        params = list(model.parameters())
        for param in params:
            param.register_post_accumulate_grad_hook(_drop_grad)
        counter = _LiveStorages({p.untyped_storage()._cdata for p in params}, {tuple(p.shape) for p in params})
        segments = _UnitSegments(counter)
        for spec in plan_units(model).units:
            if spec.name != ROOT_UNIT_NAME:
                segments.watch(spec.name, spec.module)
        head = model.get_output_embeddings()
        if head is not None:  # from the head's start to the forward's end: the logits and the loss
            head.register_forward_pre_hook(lambda *_: None if counter.backward else counter.mark())
        ids = torch.zeros(settings.micro_batch, settings.local_seq, dtype=torch.long)
        with counter:
            loss = model(input_ids=ids, labels=ids).loss
            after_forward = counter.live
            logits_and_loss = counter.mark_peak - counter.marked if head is not None else 0
            segments.enter((ROOT_UNIT_NAME, "forward"))
            counter.backward = True
            segments.enter((ROOT_UNIT_NAME, "backward"))
            loss.backward()
            segments.enter((ROOT_UNIT_NAME, "backward"))
    return after_forward, counter.peak, segments, logits_and_loss


def enable_checkpointing(model: nn.Module) -> None:
    """The model's own activation checkpointing (``activation_checkpointing_enable`` in transformers
    5, ``gradient_checkpointing_enable`` before)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _dtype_argument(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """``from_config``'s dtype keyword: ``dtype`` since transformers 4.56, ``torch_dtype`` before."""
    import transformers
    from packaging.version import Version

    return {"dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype": dtype}


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def _attach_traced_attention(model: nn.Module, size: int) -> None:
    """The sequence-parallel attention, at S = 1 too: under fake tensors transformers cannot see
    that a batch has no padding and would make a ``[seq, seq]`` mask that a real step does not."""
    attach(model, model.config._attn_implementation,
           _TracedLayout(size=size, rank=0, data_parallel_rank=0, data_parallel_size=1, group=None,
                         device=torch.device("cpu")))


def estimate_activations(config: Any, settings: ActivationSettings) -> ActivationEstimate:
    """Activation bytes per rank of one training step of the causal LM ``config`` (a transformers
    ``PretrainedConfig``) under ``settings`` ([Note: traced activations])."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(getattr(text, "num_hidden_layers", 1) or 1)
    forward_1, peak_1, one, logits_and_loss = _trace(config, 1, settings)
    forward_2, peak_2, two, _ = _trace(config, 2, settings)
    per_forward, per_peak = max(0, forward_2 - forward_1), max(0, peak_2 - peak_1)
    return ActivationEstimate(settings=settings, layers=layers,
                              after_forward=forward_1 + (layers - 1) * per_forward,
                              peak=peak_1 + (layers - 1) * per_peak,
                              per_layer_after_forward=per_forward, per_layer_peak=per_peak,
                              logits_and_loss=logits_and_loss,
                              by_unit=_by_unit(one, two, layers, per_forward)
                              or {(ROOT_UNIT_NAME, "forward"): peak_1 + (layers - 1) * per_peak})


# [Note: activations by unit]
# The peak of a step is not the states plus the working set's peak plus the activations' peak:
# the working set peaks at one unit (the head's backward, with its gradient whole) and the
# activations at another (the end of the forward). ``hf-zero estimate`` adds the two at each
# unit of the stage-3 replay instead (estimator.Stage3Replay) and takes the largest sum. The
# trace marks where each unit's forward begins and ends and where its backward begins (module
# hooks on the units ``plan_units`` chooses, as the engine's are); each stretch's most live bytes
# are the unit's: the forward's from its start to the next unit's (the loss after the head is the
# head's), the backward's from its start to the next unit's (the root's is the loss's backward,
# before the head's). For L layers, layer j's figures are layer 0's plus j times the difference
# layer 1 makes in the two-layer trace; the other units' are the one-layer trace's, plus L - 1
# layers' kept activations for those that run after the layers in the forward (and so before
# them in the backward), the root included.
def _by_unit(one: _UnitSegments, two: _UnitSegments, layers: int, per_layer_kept: int) -> dict[tuple[str, str], int]:
    new = [name for name in two.order if name not in one.order]
    if len(new) != 1 or not re.search(r"\.1$", new[0]):
        return {}  # no single numbered layer told apart: the caller falls back to the peaks' sum
    first, second = new[0][:-1] + "0", new[0]
    if first not in one.order:
        return {}
    after_layers = set(one.order[one.order.index(first) + 1:]) | {ROOT_UNIT_NAME}
    out: dict[tuple[str, str], int] = {}
    for (name, phase), value in one.peaks.items():
        if name != first:
            out[(name, phase)] = value + (layers - 1) * per_layer_kept * (name in after_layers)
    for phase in ("forward", "backward"):
        base = two.peaks.get((first, phase), 0)
        step = two.peaks.get((second, phase), 0) - base
        for j in range(layers):
            out[(first[:-1] + str(j), phase)] = max(0, base + j * step)
    return out

