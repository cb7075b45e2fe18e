"""The key table: every DeepSpeed config key hf_zero knows, its default, and its status.

[Note: key statuses]
Every key DeepSpeed accepts is in this table, so a valid DeepSpeed key is never reported as
unknown. Each has one of three statuses:

- ``implemented``: hf_zero honours it.
- ``accepted_no_effect``: a pure performance / logging hint whose value cannot change results in
  hf_zero (e.g. ``round_robin_gradients``). Accepted at any valid value; its reason is logged.
- ``not_implemented``: a DeepSpeed feature hf_zero does not have yet. It is an error only when the
  value would turn the feature ON (``KeySpec.is_off`` is False), so a config that lists such keys
  at their default / off values loads fine. Flipping a feature to implemented is one edit here.

Sources: DeepSpeed 0.19.x ``runtime/constants.py``, ``runtime/config.py``, ``runtime/zero/config.py``,
``runtime/zero/offload_config.py``, ``runtime/precision_config.py``, ``runtime/lr_schedules.py``,
``monitor/config.py``, ``comm/constants.py``, ``profiling/constants.py``,
``runtime/swap_tensor/constants.py``, ``runtime/activation_checkpointing/config.py``,
``runtime/model_checkpointing/constants.py`` (DeepSpeed 0.19), plus
the keys newer releases added, so a config written for a newer DeepSpeed still loads.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import MISSING
from .kinds import (
    Anything,
    Betas,
    Bool,
    Choice,
    Float,
    FloatOrList,
    Int,
    Kind,
    Opaque,
    Section,
    StepsPerPrint,
    Str,
    StrList,
)

__all__ = [
    "Status",
    "KeySpec",
    "KEY_TABLE",
    "OFFLOAD_DEVICES_NOT_IMPLEMENTED",
    "IMPLEMENTED_OPTIMIZERS",
    "IMPLEMENTED_SCHEDULERS",
    "DEEPSPEED_OPTIMIZERS",
    "DEEPSPEED_SCHEDULERS",
    "REJECTED_KEYS",
    "DTYPE_SPELLINGS",
    "children_of",
    "spec_for",
    "iter_specs",
]


class Status(str, enum.Enum):
    """See [Note: key statuses]."""

    IMPLEMENTED = "implemented"
    ACCEPTED_NO_EFFECT = "accepted_no_effect"
    NOT_IMPLEMENTED = "not_implemented"


IMPLEMENTED = Status.IMPLEMENTED
NO_EFFECT = Status.ACCEPTED_NO_EFFECT
NOT_IMPLEMENTED = Status.NOT_IMPLEMENTED

# ---- one-line flips -------------------------------------------------------------------------
# Remove "cpu" (then "nvme") when offload/ implements it; every offload check reads this tuple.
OFFLOAD_DEVICES_NOT_IMPLEMENTED: tuple[str, ...] = ()

# Optimizer / scheduler types hf_zero runs (DeepSpeed's spelling; optimizer types match
# case-insensitively, as DeepSpeed lower-cases them).
IMPLEMENTED_OPTIMIZERS: tuple[str, ...] = ("Adam", "AdamW", "Muon", "Adafactor")
IMPLEMENTED_SCHEDULERS: tuple[str, ...] = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")

# What DeepSpeed itself accepts (runtime/config.py DEEPSPEED_OPTIMIZERS, lr_schedules.py
# VALID_LR_SCHEDULES). DeepSpeed also accepts any torch.optim / torch.optim.lr_scheduler class name.
DEEPSPEED_OPTIMIZERS: tuple[str, ...] = (
    "Adam", "AdamW", "Adagrad", "Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb",
    "MuAdam", "MuAdamW", "MuSGD", "Lion", "Muon",
)  # fmt: skip
DEEPSPEED_SCHEDULERS: tuple[str, ...] = (
    "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
)  # fmt: skip

# Keys DeepSpeed itself refuses; reported with their own rule and fix rather than as unknown.
REJECTED_KEYS: dict[str, tuple[str, str]] = {
    "optimizer.params.max_grad_norm": (
        "is not an optimizer parameter (DeepSpeed raises on it too)",
        "remove it and set the top-level gradient_clipping instead",
    ),
}

# DeepSpeed's DtypeEnum spellings (runtime/config.py) -> the short name hf_zero uses.
DTYPE_SPELLINGS: dict[str, str] = {
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
}  # fmt: skip

RangeCheck = Callable[[Any], "tuple[str, str] | None"]

# Bucket sizes above this are larger than any model's parameter count (2**40 elements): a typo or
# a "1e30 means one bucket" guess; 0 already means one collective per group.
MAX_BUCKET_NUMEL = 2**40
# The batch triple counts samples (and micro-steps) per step. No device holds 2**31 samples in a
# micro-batch (int32 indexing ends there), and 2**31 micro-steps per optimizer step would never
# finish: a larger value is a typo or an "unbounded" placeholder (1e18), which DeepSpeed accepts
# and which would fail only later, as an out-of-memory deep in the data loader.
MAX_BATCH = 2**31
# fp16 starts at a loss scale of 2**initial_scale_power, a Python float multiplied into an fp32
# loss: far below fp32's 2**128 limit, and 2**4000 overflows Python floats outright.
MAX_SCALE_POWER = 64


@dataclass(frozen=True)
class KeySpec:
    """One config key.

    path: dotted path (``zero_optimization.offload_param.device``).
    kind: its type rule (kinds.py).
    default: DeepSpeed's default, what an absent key means (``MISSING`` when required).
    doc: what it means, one line.
    status / reason: see [Note: key statuses]; `reason` says why there is no effect, or what is
        missing.
    nullable: null is a valid value.
    check: a range rule, returning (rule, fix) when broken.
    off: for not_implemented keys, True when a value leaves the feature off (default: value equals
        `default`).
    gate: a boolean key that must be on for this key to matter (``fp16.enabled`` for
        ``fp16.auto_cast``); a not_implemented key under a gate that is off is not an error.
    aliases: other spellings DeepSpeed accepts at the same level; normalised to `path`'s name.
    auto_from: the ``resolve(...)`` argument that fills ``"auto"`` here (transformers' table);
        None means "auto" is not accepted for this key.
    scheduler_types: for ``scheduler.params.*``, the scheduler types that take this parameter.
    optimizer_types: for ``optimizer.params.*``, the optimizer types that take this parameter.
    when_on: for the docs, which values count as ON for a not_implemented key.
    """

    path: str
    kind: Kind
    default: Any
    doc: str
    status: Status = IMPLEMENTED
    reason: str = ""
    nullable: bool = False
    check: RangeCheck | None = None
    off: Callable[[Any], bool] | None = None
    gate: str | None = None
    aliases: tuple[str, ...] = ()
    auto_from: str | None = None
    scheduler_types: tuple[str, ...] = ()
    optimizer_types: tuple[str, ...] = ()
    when_on: str = ""

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    @property
    def parent(self) -> str:
        return self.path.rsplit(".", 1)[0] if "." in self.path else ""

    def is_off(self, value: Any) -> bool:
        """For a not_implemented key: does `value` leave the feature off?"""
        if self.off is not None:
            return bool(self.off(value))
        return value == self.default or (value is None and self.nullable)


# ---- range rules ----------------------------------------------------------------------------


def _each(value: Any) -> list[Any]:
    """Range rules apply to every entry of a per-group list."""
    return list(value) if isinstance(value, list) else [value]


def at_least(low: float) -> RangeCheck:
    def check(value: Any) -> tuple[str, str] | None:
        ok = all(v >= low for v in _each(value))
        return None if ok else (f"must be >= {low}", f"write {low} or more")

    return check


def at_most(high: float) -> RangeCheck:
    def check(value: Any) -> tuple[str, str] | None:
        ok = all(v <= high for v in _each(value))
        return None if ok else (f"must be <= {high}", f"write {high} or less")

    return check


def above(low: float) -> RangeCheck:
    def check(value: Any) -> tuple[str, str] | None:
        ok = all(v > low for v in _each(value))
        return None if ok else (f"must be > {low}", f"write a number above {low}")

    return check


def between(low: float, high: float) -> RangeCheck:
    def check(value: Any) -> tuple[str, str] | None:
        ok = all(low <= v <= high for v in _each(value))
        return None if ok else (f"must be in [{low}, {high}]", f"write a number from {low} to {high}")

    return check


def _batch_count(value: Any) -> tuple[str, str] | None:
    if value < 1:
        return "must be >= 1", "write 1 or more"
    if value > MAX_BATCH:
        rule = f"must be at most 2**31 = {MAX_BATCH} (no run takes that many samples or micro-steps per step)"
        return rule, 'write the real number, or "auto" to take it from the Trainer'
    return None


def _zero_stage(value: Any) -> tuple[str, str] | None:
    return None if 0 <= value <= 3 else ("must be 0, 1, 2 or 3", "write 0, 1, 2 or 3")




# ---- off predicates -------------------------------------------------------------------------


def _always_off(_: Any) -> bool:
    return True


def _false_or_none(value: Any) -> bool:
    return not value


def _not_positive(value: Any) -> bool:
    return value <= 0


def _offload_device_off(value: Any) -> bool:
    return value not in OFFLOAD_DEVICES_NOT_IMPLEMENTED


def _shard_group_size(value: Any) -> tuple[str, str] | None:
    """mics_shard_size: off (-1 or any value <= 0, DeepSpeed's reading) or a group of at least 2."""
    if value == 1:
        return ("1 would give every rank its own full copy of the optimizer state",
                "write -1 to shard over all ranks, a group size of 2 or more (the GPUs of one node), or use stage 0")
    return None


def _legacy_cpu_offload_off(value: Any) -> bool:
    # DeepSpeed's deprecated booleans; hf_zero asks for the offload_* sections instead.
    return not value


def _nothing_enabled(value: Any) -> bool:
    """True unless some nested ``enabled`` key is true (DeepSpeed's switch in most sections)."""
    if isinstance(value, Mapping):
        if value.get("enabled") is True:
            return False
        return all(_nothing_enabled(v) for v in value.values())
    if isinstance(value, list):
        return all(_nothing_enabled(v) for v in value)
    return True


def _empty(value: Any) -> bool:
    return not value


def _no_parallel_size_above_one(value: Any) -> bool:
    """tensor_parallel is off while every ``*size`` inside it is <= 1."""
    if isinstance(value, Mapping):
        for key, inner in value.items():
            is_size = key.endswith("size") and isinstance(inner, (int, float))
            if (is_size and not isinstance(inner, bool) and inner > 1) or not _no_parallel_size_above_one(inner):
                return False
    return True


# DeepSpeed's runtime/config.py get_pipeline_config defaults: these values mean "no pipeline".
_PIPELINE_DEFAULTS: dict[str, Any] = {
    "stages": "auto",
    "partition": "best",
    "seed_layers": False,
    "activation_checkpoint_interval": 0,
    "pipe_partitioned": True,
    "grad_partitioned": True,
}


def _pipeline_off(value: Any) -> bool:
    return all(_PIPELINE_DEFAULTS.get(k, MISSING) == v for k, v in value.items())


def _deepcompile_off(value: Any) -> bool:
    return not value.get("deepcompile", False)


# ---- the table ------------------------------------------------------------------------------

_NI_REASON_OFFLOAD = "the deprecated boolean; write zero_optimization.offload_optimizer / offload_param {\"device\": \"cpu\"} instead"
_NI_ZEROPP = "ZeRO++ quantized / hierarchical communication"
_ONLY_NVME = "libaio submission tuning; hf_zero's NVMe I/O runs on threads (aio.block_size, aio.intra_op_parallelism), which have no submission queue to tune"
_AIO_BACKEND = "hf_zero's NVMe I/O has one backend, its I/O threads through host memory (no libaio, no GPUDirect Storage)"
_MONITOR = "monitoring backends are not wired into hf_zero; use the Trainer's report_to"
_APEX = "apex AMP argument, only read when amp.enabled is true (not implemented)"
_FP16_ONLY = "fp16.enabled"
_BF16_ONLY = "bf16.enabled"

_W = ("WarmupLR", "WarmupDecayLR")
_WC = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
_DC = ("WarmupDecayLR", "WarmupCosineLR")
_OPT_ADAM = ("Adam", "AdamW")
_OPT_MUON = ("Muon",)
_OPT_ADAFACTOR = ("Adafactor",)
_OPT_ALL = _OPT_ADAM + _OPT_MUON + _OPT_ADAFACTOR
_ALL_SCHED = DEEPSPEED_SCHEDULERS


def _ni_type(name: str) -> str:
    return f"a parameter of the {name} scheduler, which hf_zero does not implement yet"


_SPECS: list[KeySpec] = [
    # -- batch size and steps (runtime/constants.py) --
    KeySpec("train_batch_size", Int(), None, "Global batch per optimizer step = micro batch x gradient accumulation x world size; derived from the other two when absent.", nullable=True, check=_batch_count, auto_from="train_batch_size"),
    KeySpec("train_micro_batch_size_per_gpu", Int(), None, "Samples per rank per forward/backward; derived when absent.", nullable=True, check=_batch_count, auto_from="train_micro_batch_size_per_gpu"),
    KeySpec("gradient_accumulation_steps", Int(), None, "Micro-steps accumulated per optimizer step; derived when absent.", nullable=True, check=_batch_count, auto_from="gradient_accumulation_steps"),
    KeySpec("gradient_clipping", Float(), 1.0, "Clip the global gradient L2 norm (over all shards) to this; 0 turns clipping off. DeepSpeed 0.19's default is 1.0.", check=at_least(0), auto_from="gradient_clipping"),
    KeySpec("steps_per_print", StepsPerPrint(), None, "Log progress every N optimizer steps; 0, null or Infinity mean never.", nullable=True),
    KeySpec("wall_clock_breakdown", Bool(), False, "Time forward, backward, gradient reduction, optimizer step and stage-3 gathers; engine.timers() returns them and the steps_per_print line adds them."),
    KeySpec("memory_breakdown", Bool(), False, "Log memory use.", NO_EFFECT, "memory logging only"),
    KeySpec("dump_state", Bool(), False, "Print DeepSpeed's engine state.", NO_EFFECT, "debug printing only"),
    KeySpec("disable_python_gc", Bool(), False, "Turn off Python's cyclic garbage collector during training.", NO_EFFECT, "a speed hint; the math is unchanged"),
    KeySpec("disable_allgather", Bool(), False, "Legacy: broadcast updated partitions instead of all-gather.", NO_EFFECT, "hf_zero always all-gathers; the result is identical"),
    KeySpec("communication_data_type", Choice(("fp16", "bf16", "fp32"), case_insensitive=True), None, "Dtype gradients are reduced in; null means fp16 if fp16 is on, bf16 if bf16 is on, else fp32 (DeepSpeed's rule).", nullable=True),
    KeySpec("seq_parallel_communication_data_type", Choice(("fp16", "bf16", "fp32"), case_insensitive=True), "fp32", "Reduce dtype for sequence parallelism.", NO_EFFECT, "the all-to-all moves activations in the compute dtype, as the model computes them", nullable=True),
    KeySpec("seq_parallel_comm_data_type", Choice(("fp16", "bf16", "fp32"), case_insensitive=True), "fp32", "Older spelling of seq_parallel_communication_data_type.", NO_EFFECT, "the all-to-all moves activations in the compute dtype, as the model computes them", nullable=True),
    KeySpec("prescale_gradients", Bool(), False, "Divide gradients by the world size before the reduction instead of after.", NO_EFFECT, "hf_zero decides where the division by the world size happens from the reduce dtype (before an fp32 or fp16 reduction, after a bf16 one, in fp32; NCCL's AVG for fp16); this key cannot change that"),
    KeySpec("gradient_predivide_factor", Float(), 1.0, "Split the 1/world_size division into a pre-divide by this factor and a post-divide.", NOT_IMPLEMENTED, "a split pre/post division of gradients", check=above(0), when_on="!= 1.0"),
    KeySpec("gradient_allreduce_op", Choice(("mean", "sum"), case_insensitive=True), "mean", "Average (mean) or sum gradients across ranks.", NOT_IMPLEMENTED, "summed rather than averaged gradients", off=lambda v: str(v).lower() == "mean", when_on='"sum"'),
    KeySpec("managed_gradient_accumulation", Bool(), True, "DeepSpeed tracks micro-steps; false lets the client own the boundary.", NOT_IMPLEMENTED, "client-owned accumulation boundaries", when_on="false"),
    KeySpec("sparse_gradients", Bool(), False, "CSR sparse gradients for embeddings.", NOT_IMPLEMENTED, "sparse gradient reduction", when_on="true"),
    KeySpec("zero_allow_untested_optimizer", Bool(), False, "Let a passed torch optimizer that is neither a known element-wise class nor declared one step over flat shards, with a warning, as in DeepSpeed (set by the Trainer when it builds the optimizer); known shape-aware optimizers (Muon, LAMB...) are refused regardless: see docs/optimizers.md."),
    KeySpec("zero_force_ds_cpu_optimizer", Bool(), True, "Require DeepSpeed's CPU Adam when offloading.", NO_EFFECT, "hf_zero has no DeepSpeed CPU optimizer to force"),
    KeySpec("dataloader_drop_last", Bool(), False, "Drop the last incomplete batch in the data loader hf_zero.initialize builds from training_data."),
    KeySpec("collective_timeout_s", Float(), None, "hf_zero only: seconds a collective waits for the other ranks before every waiting rank raises, naming the collective, its unit and the step (null: the HF_ZERO_TIMEOUT environment variable, else torch's 30 minutes). Applies to process groups hf_zero creates.", nullable=True, check=above(0)),
    KeySpec("vocabulary_size", Int(), None, "Only used by DeepSpeed to warn when not a multiple of 8.", NO_EFFECT, "DeepSpeed only prints a warning from it", nullable=True),
    KeySpec("log_level", Str(), None, "DeepSpeed's logger level.", NO_EFFECT, "hf_zero logs through logging.getLogger('hf_zero')", nullable=True),
    KeySpec("graph_harvesting", Bool(), False, "Capture short kernel sequences as CUDA graphs.", NO_EFFECT, "a speed hint; the math is unchanged"),
    KeySpec("use_data_before_expert_parallelism", Bool(), False, "Rank topology for expert parallelism.", NO_EFFECT, "hf_zero has no expert parallelism, so this is never read"),
    KeySpec("sequence_parallel_size", Int(), 1, "Ulysses sequence-parallel degree: groups of this many consecutive ranks share each sequence, 1/S each; the data-parallel degree is world / S.", IMPLEMENTED, "attention through all-to-all over the group, the loss over the group's tokens (docs/how-it-works.md \"Long sequences\")", check=at_least(1)),
    KeySpec("tiled_loss_tokens", Int(), 0, "hf_zero only: a causal LM's logits and loss computed this many tokens at a time in training, each tile recomputed in the backward, so the whole [batch, sequence, vocab] logits never exist (outputs.logits is then None in training); 0: off.", check=at_least(0)),
    KeySpec("tiled_mlp_tokens", Int(), 0, "hf_zero only: every transformer block's MLP computed this many tokens at a time in training, each tile recomputed in the backward, so its [tokens, intermediate] activations exist for one tile at a time (mixture-of-experts blocks are refused); 0: off.", check=at_least(0)),
    # -- zero_optimization (runtime/zero/config.py) --
    KeySpec("zero_optimization", Section(), {}, "ZeRO settings."),
    KeySpec("zero_optimization.stage", Int(), 0, "0: data parallel; 1: shard fp32 master + optimizer state; 2: also gradients; 3: also parameters.", check=_zero_stage),
    KeySpec("zero_optimization.contiguous_gradients", Bool(), True, "Copy gradients into a contiguous buffer as they are produced.", NO_EFFECT, "hf_zero's gradients are always views into one flat buffer per unit"),
    KeySpec("zero_optimization.reduce_scatter", Bool(), True, "Reduce-scatter (vs all-reduce) to average gradients.", NO_EFFECT, "hf_zero always reduce-scatters in stages 1-3; all-reduce gives the same values"),
    KeySpec("zero_optimization.reduce_bucket_size", Int(), 500_000_000, "Gradient elements per reduce-scatter: finished units share one collective until the bucket holds this many (0: one per unit group).", check=between(0, MAX_BUCKET_NUMEL), auto_from="hidden_size"),
    KeySpec("zero_optimization.use_multi_rank_bucket_allreduce", Bool(), True, "Combine the reduce buckets of several ranks into one all-reduce.", NO_EFFECT, "a speed hint; the math is unchanged"),
    KeySpec("zero_optimization.allgather_partitions", Bool(), True, "All-gather (vs broadcast) updated partitions after the step.", NO_EFFECT, "hf_zero always all-gathers; broadcasts give the same values"),
    KeySpec("zero_optimization.allgather_bucket_size", Int(), 500_000_000, "Updated-parameter elements per all-gather after the step (stages 1-2, persistent stage-3 groups; 0: one per unit group).", check=between(0, MAX_BUCKET_NUMEL)),
    KeySpec("zero_optimization.overlap_comm", Bool(), None, "Overlap each unit's gradient reduce-scatter with the backward of the units before it (stages 2-3); null means true for stage 3 only (DeepSpeed's rule).", nullable=True),
    KeySpec("zero_optimization.load_from_fp32_weights", Bool(), True, "Initialise the fp32 master from the checkpoint's fp32 copy.", NO_EFFECT, "hf_zero checkpoints always hold the fp32 master and always load it"),
    KeySpec("zero_optimization.elastic_checkpoint", Bool(), False, "Legacy elastic checkpoints.", NO_EFFECT, "hf_zero checkpoints load at any world size anyway"),
    KeySpec("zero_optimization.offload_param", Section(), None, "Parameter offload (stage 3 only).", nullable=True),
    KeySpec("zero_optimization.offload_optimizer", Section(), None, "Optimizer state offload (stages 1-3).", nullable=True),
    KeySpec("zero_optimization.zenflow", Opaque(), None, "ZenFlow (stall-free offload).", NOT_IMPLEMENTED, "ZenFlow", nullable=True, off=lambda v: v is None, when_on="present"),
    KeySpec("zero_optimization.sub_group_size", Int(), 1_000_000_000, "Optimizer-step tile size in elements: hf_zero's NVMe optimizer offload reads, steps and writes the state in tiles of this size (other steps run whole flat shards).", check=at_least(1)),
    KeySpec("zero_optimization.cpu_offload", Bool(), None, "Deprecated: true means offload_optimizer.device cpu.", NOT_IMPLEMENTED, _NI_REASON_OFFLOAD, nullable=True, off=_legacy_cpu_offload_off, when_on="true"),
    KeySpec("zero_optimization.cpu_offload_param", Bool(), None, "Deprecated: true means offload_param.device cpu.", NOT_IMPLEMENTED, _NI_REASON_OFFLOAD, nullable=True, off=_legacy_cpu_offload_off, when_on="true"),
    KeySpec("zero_optimization.cpu_offload_use_pin_memory", Bool(), None, "Deprecated pin_memory for the two keys above.", NO_EFFECT, "deprecated; only read with cpu_offload", nullable=True),
    KeySpec("zero_optimization.stage3_prefetch_bucket_size", Int(), 50_000_000, "Elements of parameters prefetched ahead of use (stage 3).", check=at_least(0), aliases=("prefetch_bucket_size",), auto_from="hidden_size"),
    KeySpec("zero_optimization.stage3_param_persistence_threshold", Int(), 100_000, "Parameters (units) smaller than this stay gathered (stage 3).", check=at_least(0), aliases=("param_persistence_threshold",), auto_from="hidden_size"),
    KeySpec("zero_optimization.stage3_model_persistence_threshold", Int(), sys.maxsize, "Cap on the total elements kept gathered by the persistence threshold.", NO_EFFECT, "a memory cap only; hf_zero persists by stage3_param_persistence_threshold", check=at_least(0), aliases=("model_persistence_threshold",)),
    KeySpec("zero_optimization.stage3_max_live_parameters", Int(), 1_000_000_000, "Max gathered parameter elements per rank before releasing (stage 3).", check=at_least(0), aliases=("max_live_parameters",)),
    KeySpec("zero_optimization.stage3_max_reuse_distance", Int(), 1_000_000_000, "Keep a unit gathered from its forward to its backward when fewer than this many elements are gathered in between (stage 3; 0: always re-gather).", check=at_least(0), aliases=("max_reuse_distance",)),
    KeySpec("zero_optimization.stage3_gather_16bit_weights_on_model_save", Bool(), False, "Gather the full 16-bit weights when the model is saved (stage 3).", IMPLEMENTED, "save_model (Trainer) and get_state_dict (Accelerate) save 16-bit weights instead of the fp32 master", aliases=("gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"), auto_from="stage3_gather_16bit_weights_on_model_save"),
    KeySpec("zero_optimization.stage3_module_granularity_threshold", Int(), 0, "Fetch fine-grained modules as one (stage 3).", NOT_IMPLEMENTED, "module-granularity fetching; hf_zero fetches whole units", aliases=("module_granularity_threshold",), off=_not_positive, when_on="> 0"),
    KeySpec("zero_optimization.stage3_use_all_reduce_for_fetch_params", Bool(), False, "All-reduce instead of all-gather to fetch parameters.", NO_EFFECT, "a speed hint; the values fetched are identical", aliases=("use_all_reduce_for_fetch_params",)),
    KeySpec("zero_optimization.stage3_allgather_sequential", Bool(), False, "All-gather parameters one by one instead of bucketed.", NO_EFFECT, "a memory/speed hint; the values fetched are identical", aliases=("allgather_sequential",)),
    KeySpec("zero_optimization.stage3_partition_stream_chunk_size", Int(), 0, "Stream large parameters through chunks while partitioning.", NO_EFFECT, "a memory hint for DeepSpeed's zero.Init; hf_zero loads unit by unit", check=at_least(0), aliases=("partition_stream_chunk_size",)),
    KeySpec("zero_optimization.ignore_unused_parameters", Bool(), True, "Ignore parameters that get no gradient; false makes them an error (stage 2).", NOT_IMPLEMENTED, "the unused-parameter error", when_on="false"),
    KeySpec("zero_optimization.legacy_stage1", Bool(), False, "DeepSpeed's old stage-1 implementation.", NO_EFFECT, "an implementation choice; the math is unchanged"),
    KeySpec("zero_optimization.round_robin_gradients", Bool(), False, "Interleave gradient partitions to parallelise offload copies.", NO_EFFECT, "a speed hint for offload copies; the math is unchanged"),
    KeySpec("zero_optimization.zero_hpz_partition_size", Int(), 1, "ZeRO++ hpZ: after a gather over all ranks each keeps 1/P of what it received (16-bit weights, or int8 blocks with qwZ), so later gathers (the backward's) stay within groups of P consecutive ranks (a node); 1: off (stage 3).", IMPLEMENTED, "secondary shards", check=at_least(0)),
    KeySpec("zero_optimization.zero_quantized_weights", Bool(), False, "ZeRO++ qwZ: stage-3 parameter gathers send int8 blocks with an fp32 scale per 512 elements; shards, masters and checkpoints stay exact (stage 3).", IMPLEMENTED, "quantized weight gathers"),
    KeySpec("zero_optimization.zero_quantized_nontrainable_weights", Bool(), False, "ZeRO++ MixZ++: frozen weights stored quantized.", NOT_IMPLEMENTED, _NI_ZEROPP, when_on="true"),
    KeySpec("zero_optimization.zero_quantized_gradients", Bool(), False, "ZeRO++ qgZ: gradient reduce-scatters send 4-bit blocks with an fp32 scale per 64 elements, reduced inside each node first, then across nodes, summed in fp32 (stages 1-3).", IMPLEMENTED, "quantized gradient reduction"),
    KeySpec("zero_optimization.zeropp_loco_param", Opaque(), None, "LoCo-ZeRO++ error feedback parameters.", NOT_IMPLEMENTED, _NI_ZEROPP, nullable=True, off=lambda v: v is None, when_on="present"),
    KeySpec("zero_optimization.mics_shard_size", Int(), -1, "Hybrid sharding (MiCS, FSDP2's HSDP): shard model states over groups of this many consecutive ranks (a node) and replicate them across the groups; -1 shards over all ranks.", IMPLEMENTED, "parameter gathers stay inside a group; gradients are reduce-scattered in the group, then all-reduced across groups", check=_shard_group_size),
    KeySpec("zero_optimization.mics_hierarchical_params_gather", Bool(), False, "MiCS hierarchical gather.", NOT_IMPLEMENTED, "MiCS sharding", when_on="true"),
    KeySpec("zero_optimization.memory_efficient_linear", Bool(), True, "DeepSpeed's memory-efficient linear for stage 3.", NO_EFFECT, "hf_zero does not replace nn.Linear; the math is unchanged"),
    KeySpec("zero_optimization.pipeline_loading_checkpoint", Bool(), False, "Load checkpoints in pipeline mode (stage 3).", NO_EFFECT, "a loading-order hint; the loaded values are identical"),
    KeySpec("zero_optimization.override_module_apply", Bool(), True, "Patch nn.Module.apply to gather parameters (stage 3).", NO_EFFECT, "hf_zero does not patch nn.Module.apply"),
    KeySpec("zero_optimization.log_trace_cache_warnings", Bool(), False, "Log prefetch trace invalidations.", NO_EFFECT, "logging only"),
    KeySpec("zero_optimization.enable_sanity_checks", Bool(), False, "DeepSpeed-internal sanity checks.", NO_EFFECT, "debug checks only"),
    KeySpec("zero_optimization.save_muon_momentum_buffer_in_memory", Bool(), False, "Keep Muon momentum in memory under NVMe offload.", NO_EFFECT, "only read with the Muon optimizer (not implemented)"),
    KeySpec("zero_optimization.compute_grad_norm", Bool(), True, "Compute the gradient norm every step.", NO_EFFECT, "hf_zero computes the global norm whenever clipping or loss scaling needs it"),
    KeySpec("zero_optimization.leaf_module", Section(), {}, "Modules fetched as one (stage 3, for MoE)."),
    KeySpec("zero_optimization.leaf_module.classes", StrList(), ["MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock"], "Leaf module classes.", NO_EFFECT, "hf_zero gathers every unit whole, so modules inside a unit are already fetched as one"),
    KeySpec("zero_optimization.leaf_module.names", StrList(), [], "Leaf module names.", NO_EFFECT, "hf_zero gathers every unit whole, so modules inside a unit are already fetched as one"),
    KeySpec("zero_optimization.leaf_module.name_suffixes", StrList(), [], "Leaf module name suffixes.", NO_EFFECT, "hf_zero gathers every unit whole, so modules inside a unit are already fetched as one"),
    KeySpec("zero_optimization.wrap_modules", StrList(), None, "hf_zero only: class names that each form one unit (default: model._no_split_modules).", nullable=True),
    # -- offload_param (runtime/zero/offload_config.py) --
    KeySpec("zero_optimization.offload_param.device", Choice(("none", "cpu", "nvme")), "none", "Where stage-3 parameters live between uses: host memory (cpu) or files under nvme_path (nvme)."),
    KeySpec("zero_optimization.offload_param.nvme_path", Str(), None, "Directory for nvme offload.", nullable=True),
    KeySpec("zero_optimization.offload_param.buffer_count", Int(), 5, "Host buffers NVMe-offloaded shards are read into; at most this many are in host memory at once (nvme only).", check=at_least(0)),
    KeySpec("zero_optimization.offload_param.buffer_size", Int(), 100_000_000, "Elements a swap buffer may hold: the largest NVMe-offloaded shard must fit (nvme only).", check=at_least(0)),
    KeySpec("zero_optimization.offload_param.max_in_cpu", Int(), 1_000_000_000, "Elements of a rank's shards kept in host memory instead of files, first units first (nvme only).", check=at_least(0)),
    KeySpec("zero_optimization.offload_param.pin_memory", Bool(), True, "Use page-locked host memory."),
    # -- offload_optimizer --
    KeySpec("zero_optimization.offload_optimizer.device", Choice(("none", "cpu", "nvme")), "none", "Where the fp32 master and optimizer state live; the step runs on the CPU."),
    KeySpec("zero_optimization.offload_optimizer.nvme_path", Str(), None, "Directory for nvme offload.", nullable=True),
    KeySpec("zero_optimization.offload_optimizer.buffer_count", Int(), 4, "Buffers in the nvme swap pool.", NO_EFFECT, "the NVMe optimizer step streams each state through one tile buffer of sub_group_size elements", check=at_least(1)),
    KeySpec("zero_optimization.offload_optimizer.pin_memory", Bool(), True, "Use page-locked host memory."),
    KeySpec("zero_optimization.offload_optimizer.pipeline_read", Bool(), False, "NVMe: read the next tile's state while the current tile steps (two sets of tile buffers instead of one; either pipeline key turns both overlaps on)."),
    KeySpec("zero_optimization.offload_optimizer.pipeline_write", Bool(), False, "NVMe: write the current tile's state while the next tile steps (two sets of tile buffers instead of one; either pipeline key turns both overlaps on)."),
    KeySpec("zero_optimization.offload_optimizer.pipeline", Bool(), False, "Older spelling of pipeline_read/pipeline_write: sets both."),
    KeySpec("zero_optimization.offload_optimizer.fast_init", Bool(), False, "Fast optimizer initialisation with nvme.", NO_EFFECT, "an nvme speed hint"),
    KeySpec("zero_optimization.offload_optimizer.ratio", Float(), 1.0, "Fraction of the optimizer state offloaded with device cpu (Twin-Flow below 1.0): whole units, in model order; the rest steps on the compute device.", check=between(0.0, 1.0)),
    KeySpec("zero_optimization.offload_optimizer.super_offload", Bool(), False, "SuperOffload for superchips (stage 3).", NOT_IMPLEMENTED, "SuperOffload", when_on="true"),
    KeySpec("zero_optimization.offload_optimizer.convert_grad_on_cpu", Bool(), True, "Convert gradients to fp32 on the CPU (vs the GPU).", NO_EFFECT, "a speed hint; the values are identical"),
    KeySpec("zero_optimization.offload_optimizer.cpuadam_cores_perc", Float(), 0.8, "Share of this rank's CPU cores the offloaded optimizer step runs on (its affinity divided among the node's ranks), whatever OMP_NUM_THREADS the launcher set; at least one thread. The rest of the process keeps torch's own count.", check=between(0.0, 1.0)),
    # -- fp16 (runtime/precision_config.py) --
    KeySpec("fp16", Section(), {}, "fp16 mixed precision with dynamic loss scaling."),
    KeySpec("fp16.enabled", Bool(), False, "Compute in fp16; the master weights stay fp32.", auto_from="fp16"),
    KeySpec("fp16.auto_cast", Bool(), False, "Cast module inputs to fp16 automatically.", NOT_IMPLEMENTED, "automatic input casting", gate=_FP16_ONLY, when_on="true"),
    KeySpec("fp16.loss_scale", Float(), 0, "Static loss scale; 0 means dynamic loss scaling.", check=at_least(0)),
    KeySpec("fp16.initial_scale_power", Int(), 16, "Dynamic scaling starts at 2**initial_scale_power.", check=between(0, MAX_SCALE_POWER)),
    KeySpec("fp16.loss_scale_window", Int(), 1000, "Overflow-free steps before the scale doubles.", check=at_least(1)),
    KeySpec("fp16.hysteresis", Int(), 2, "Overflows tolerated before the scale halves.", check=at_least(1)),
    KeySpec("fp16.consecutive_hysteresis", Bool(), False, "Refill hysteresis after every overflow-free step."),
    KeySpec("fp16.min_loss_scale", Float(), 1, "Lowest dynamic loss scale.", check=above(0)),
    KeySpec("fp16.fp16_master_weights_and_grads", Bool(), False, "Keep master weights and gradients in fp16.", NOT_IMPLEMENTED, "fp16 master weights; hf_zero's master is fp32", gate=_FP16_ONLY, when_on="true"),
    KeySpec("fp16.fused_mode", Bool(), True, "Older fused fp16 optimizer switch.", NO_EFFECT, "an implementation choice; the math is unchanged"),
    # -- bf16 --
    KeySpec("bf16", Section(), {}, "bf16 mixed precision.", aliases=("bfloat16",)),
    KeySpec("bf16.enabled", Bool(), False, "Compute in bf16; the master weights stay fp32.", auto_from="bf16"),
    KeySpec("bf16.immediate_grad_update", Bool(), False, "Apply gradients to the master immediately.", NOT_IMPLEMENTED, "immediate gradient updates", gate=_BF16_ONLY, when_on="true"),
    KeySpec("bf16.check_grad_overflow", Bool(), False, "Skip (instead of raising FloatingPointError on) steps whose bf16 gradients hold inf/nan; either way the step's gradients are dropped and nothing else changes.", gate=_BF16_ONLY),
    KeySpec("bf16.check_overflow", Bool(), False, "Older spelling of check_grad_overflow.", gate=_BF16_ONLY),
    KeySpec("bf16.bf16_master_weights_and_grads", Bool(), False, "Keep master weights and gradients in bf16.", NOT_IMPLEMENTED, "bf16 master weights; hf_zero's master is fp32", gate=_BF16_ONLY, when_on="true"),
    KeySpec("bf16.bf16_optimizer_states", Bool(), False, "Keep optimizer states in bf16.", NOT_IMPLEMENTED, "bf16 optimizer states; hf_zero's are fp32", gate=_BF16_ONLY, when_on="true"),
    # -- amp (apex) and torch_autocast --
    KeySpec("amp", Section(), {}, "apex AMP; its other keys are passed to amp.initialize."),
    KeySpec("amp.enabled", Bool(), False, "Use apex AMP.", NOT_IMPLEMENTED, "apex AMP; use fp16 or bf16", auto_from="false", when_on="true"),
    *[KeySpec(f"amp.{name}", Anything(), None, "apex amp.initialize argument.", NO_EFFECT, _APEX, nullable=True)
      for name in ("opt_level", "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32", "master_weights",
                   "loss_scale", "cast_model_outputs", "num_losses", "verbosity", "min_loss_scale", "max_loss_scale")],
    KeySpec("torch_autocast", Section(), {}, "torch.autocast mixed precision."),
    KeySpec("torch_autocast.enabled", Bool(), False, "Run the forward under torch.autocast, as DDP's --bf16: weights, gradients and masters fp32, each op autocast lists in the lower dtype; the Trainer's and Accelerate's bf16 then mean this."),
    KeySpec("torch_autocast.dtype", Choice(tuple(DTYPE_SPELLINGS), case_insensitive=True), None, "The autocast dtype; null means the Trainer's or Accelerate's (--fp16 float16, else bfloat16). float16 scales the loss as torch.amp.GradScaler's defaults do.", nullable=True),
    KeySpec("torch_autocast.lower_precision_safe_modules", StrList(), None, "Module classes (exact match, e.g. \"torch.nn.Linear\") whose own parameters are gathered (stage 3) and have their gradients reduced in the autocast dtype; null means Linear and Conv1d/2d/3d, [] none. A parameter tied to another module's stays fp32.", nullable=True),
    # -- optimizer (runtime/config.py, ops/adam/fused_adam.py) --
    KeySpec("optimizer", Section(), None, "The optimizer hf_zero builds; absent means the Trainer's / user's optimizer.", nullable=True),
    KeySpec("optimizer.type", Str(), MISSING, 'Optimizer class: "Adam", "AdamW", "Muon" or "Adafactor" (case-insensitive; Muon steps hidden 2-D weights, AdamW the rest).', when_on="types other than Adam / AdamW / Muon / Adafactor"),
    KeySpec("optimizer.params", Section(), {}, "Optimizer arguments."),
    KeySpec("optimizer.legacy_fusion", Bool(), False, "Older fp16 fused-optimizer switch.", NO_EFFECT, "an implementation choice; the math is unchanged"),
    KeySpec("optimizer.params.lr", Float(), 1e-3, "Learning rate (for Muon: of the hidden 2-D weights).", check=at_least(0), auto_from="lr", optimizer_types=_OPT_ALL),
    KeySpec("optimizer.params.betas", Betas(), [0.9, 0.999], "Adam betas (beta1, beta2), each in [0, 1) (for Muon: the auxiliary AdamW's).", auto_from="betas", optimizer_types=_OPT_ADAM + _OPT_MUON),
    KeySpec("optimizer.params.eps", Float(), 1e-8, "Adam epsilon (for Muon: the auxiliary AdamW's).", check=above(0), auto_from="eps", optimizer_types=_OPT_ADAM + _OPT_MUON),
    KeySpec("optimizer.params.weight_decay", Float(), 0.0, "Weight decay (decoupled for AdamW, for Adam with adam_w_mode, and for both parts of Muon).", check=at_least(0), auto_from="weight_decay", optimizer_types=_OPT_ALL),
    KeySpec("optimizer.params.adam_w_mode", Bool(), True, "Decoupled (AdamW) weight decay for type Adam (type AdamW is always decoupled); DeepSpeed defaults it to true, so its Adam is AdamW.", optimizer_types=_OPT_ADAM),
    KeySpec("optimizer.params.torch_adam", Bool(), False, "Use torch.optim.Adam/AdamW instead of the fused kernel.", NO_EFFECT, "hf_zero's fused Adam computes the same update as torch's", optimizer_types=_OPT_ADAM),
    KeySpec("optimizer.params.bias_correction", Bool(), True, "Adam bias correction.", NOT_IMPLEMENTED, "Adam without bias correction", when_on="false", optimizer_types=_OPT_ADAM),
    KeySpec("optimizer.params.amsgrad", Bool(), False, "AMSGrad variant.", NOT_IMPLEMENTED, "AMSGrad", when_on="true", optimizer_types=_OPT_ADAM),
    KeySpec("optimizer.params.maximize", Bool(), False, "Maximise instead of minimise (torch_adam).", NOT_IMPLEMENTED, "maximize", when_on="true", optimizer_types=_OPT_ADAM),
    KeySpec("optimizer.params.differentiable", Bool(), False, "Autograd through the step (torch_adam).", NOT_IMPLEMENTED, "a differentiable optimizer step", when_on="true", optimizer_types=_OPT_ADAM),
    KeySpec("optimizer.params.fp32_optimizer_states", Bool(), True, "DeepSpeed CPU Adam: keep states in fp32.", NOT_IMPLEMENTED, "16-bit optimizer states; hf_zero's are fp32", when_on="false", optimizer_types=_OPT_ADAM),
    KeySpec("optimizer.params.set_grad_none", Bool(), True, "FusedAdam: set gradients to None in zero_grad.", NO_EFFECT, "hf_zero owns the gradient buffers", optimizer_types=_OPT_ADAM),
    KeySpec("optimizer.params.foreach", Anything(), None, "torch_adam implementation switch.", NO_EFFECT, "an implementation choice; the math is unchanged", nullable=True, optimizer_types=_OPT_ADAM),
    KeySpec("optimizer.params.fused", Anything(), None, "torch_adam implementation switch.", NO_EFFECT, "an implementation choice; the math is unchanged", nullable=True, optimizer_types=_OPT_ADAM),
    KeySpec("optimizer.params.capturable", Bool(), False, "torch_adam CUDA-graph capturable step.", NO_EFFECT, "an implementation choice; the math is unchanged", optimizer_types=_OPT_ADAM),
    KeySpec("optimizer.params.momentum", Float(), 0.95, "Muon momentum.", check=at_least(0), optimizer_types=_OPT_MUON),
    KeySpec("optimizer.params.nesterov", Bool(), True, "Muon: Nesterov momentum.", optimizer_types=_OPT_MUON),
    KeySpec("optimizer.params.ns_steps", Int(), 5, "Muon: Newton-Schulz iterations.", check=at_least(1), optimizer_types=_OPT_MUON),
    KeySpec("optimizer.params.adam_lr", Float(), None, "Muon: learning rate of the auxiliary AdamW (embeddings, output projection, biases, norms); null means lr.", nullable=True, check=at_least(0), optimizer_types=_OPT_MUON),
    KeySpec("optimizer.params.beta2_decay", Float(), -0.8, "Adafactor: decay rate of the second moment (torch.optim.Adafactor's beta2_decay).", check=at_most(0), optimizer_types=_OPT_ADAFACTOR),
    KeySpec("optimizer.params.d", Float(), 1.0, "Adafactor: update clipping threshold.", check=above(0), optimizer_types=_OPT_ADAFACTOR),
    # -- scheduler (runtime/lr_schedules.py) --
    KeySpec("scheduler", Section(), None, "The LR scheduler hf_zero builds; absent means the Trainer's / user's scheduler.", nullable=True),
    KeySpec("scheduler.type", Str(), MISSING, '"WarmupLR", "WarmupDecayLR" or "WarmupCosineLR".', when_on="OneCycle, LRRangeTest, torch schedulers"),
    KeySpec("scheduler.params", Section(), {}, "Scheduler arguments."),
    KeySpec("scheduler.params.warmup_min_lr", FloatOrList(), 0.0, "LR at the start of warmup (one number, or one per parameter group).", check=at_least(0), auto_from="warmup_min_lr", scheduler_types=_W),
    KeySpec("scheduler.params.warmup_max_lr", FloatOrList(), 0.001, "LR at the end of warmup (one number, or one per parameter group).", check=at_least(0), auto_from="warmup_max_lr", scheduler_types=_W),
    KeySpec("scheduler.params.warmup_num_steps", Int(), 1000, "Warmup length in optimizer steps (> 0 since DeepSpeed 0.19.6).", check=at_least(1), auto_from="warmup_num_steps", scheduler_types=_WC),
    KeySpec("scheduler.params.warmup_type", Choice(("log", "linear")), "log", "Warmup curve.", scheduler_types=_WC),
    KeySpec("scheduler.params.total_num_steps", Int(), MISSING, "Total optimizer steps (required by WarmupDecayLR / WarmupCosineLR).", check=at_least(1), auto_from="total_num_steps", scheduler_types=_DC),
    KeySpec("scheduler.params.warmup_min_ratio", Float(), 0.0, "WarmupCosineLR: start LR as a ratio of the optimizer LR.", check=at_least(0), scheduler_types=("WarmupCosineLR",)),
    KeySpec("scheduler.params.cos_min_ratio", Float(), 0.0001, "WarmupCosineLR: final LR as a ratio of the optimizer LR.", check=at_least(0), scheduler_types=("WarmupCosineLR",)),
    KeySpec("scheduler.params.last_batch_iteration", Int(), -1, "Step index to resume the schedule from; -1 starts fresh.", check=at_least(-1), scheduler_types=_ALL_SCHED),
    *[KeySpec(f"scheduler.params.{name}", kind, default, "OneCycle parameter.", NOT_IMPLEMENTED, _ni_type("OneCycle"), nullable=default is None, off=_always_off, scheduler_types=("OneCycle",), when_on="the type is OneCycle")
      for name, kind, default in (
          ("cycle_min_lr", Float(), MISSING), ("cycle_max_lr", Float(), MISSING), ("decay_lr_rate", Float(), 0.0),
          ("cycle_first_step_size", Int(), 2000), ("cycle_second_step_size", Int(), None),
          ("cycle_first_stair_count", Int(), 0), ("cycle_second_stair_count", Int(), None),
          ("decay_step_size", Int(), 0), ("cycle_momentum", Bool(), True), ("cycle_min_mom", Float(), 0.8),
          ("cycle_max_mom", Float(), 0.9), ("decay_mom_rate", Float(), 0.0))],
    *[KeySpec(f"scheduler.params.{name}", kind, default, "LRRangeTest parameter.", NOT_IMPLEMENTED, _ni_type("LRRangeTest"), off=_always_off, scheduler_types=("LRRangeTest",), when_on="the type is LRRangeTest")
      for name, kind, default in (
          ("lr_range_test_min_lr", Float(), 1e-3), ("lr_range_test_step_size", Int(), 2000),
          ("lr_range_test_step_rate", Float(), 1.0), ("lr_range_test_staircase", Bool(), False))],
    # -- checkpoint (runtime/constants.py, runtime/model_checkpointing) --
    KeySpec("checkpoint", Section(), {}, "Checkpoint options."),
    KeySpec("checkpoint.tag_validation", Choice(("Warn", "Ignore", "Fail"), case_insensitive=True), "Warn", "Check that all ranks save under the same tag.", NO_EFFECT, "a consistency check on tags; it never changes what is saved"),
    KeySpec("checkpoint.load_universal", Bool(), False, "Load a DeepSpeed universal checkpoint.", NOT_IMPLEMENTED, "DeepSpeed universal checkpoints; hf_zero's own load at any world size", when_on="true"),
    KeySpec("checkpoint.use_node_local_storage", Bool(), False, "Each node writes to its own local storage.", NOT_IMPLEMENTED, "node-local checkpoint storage", when_on="true"),
    KeySpec("checkpoint.parallel_write", Section(), {}, "Parallel checkpoint writing."),
    KeySpec("checkpoint.parallel_write.pipeline_stage", Bool(), False, "Write per pipeline stage.", NO_EFFECT, "only read with pipeline parallelism"),
    KeySpec("checkpoint.checkpoint_serialization", Bool(), True, "torch.save's zipfile serialization.", NO_EFFECT, "hf_zero writes safetensors + JSON, never torch.save"),
    KeySpec("checkpoint.writer", Opaque(), None, "DeepSpeed's fast checkpoint writer options.", NO_EFFECT, "hf_zero has its own writer; the bytes saved are the same tensors", nullable=True),
    # -- data_types --
    KeySpec("data_types", Section(), {}, "Dtype overrides."),
    KeySpec("data_types.grad_accum_dtype", Choice(tuple(DTYPE_SPELLINGS)), None, "Gradient accumulation dtype: fp32 by default at every stage; stages 0-1 may set the compute dtype to save their fp32 accumulation buffer.", nullable=True),
    KeySpec("data_types.param_dtype", Choice(tuple(DTYPE_SPELLINGS)), None, "Cast parameters to this dtype.", NOT_IMPLEMENTED, "a parameter dtype override", nullable=True, when_on="set"),
    KeySpec("data_types.buffer_dtype", Choice(tuple(DTYPE_SPELLINGS)), None, "Cast buffers to this dtype.", NOT_IMPLEMENTED, "a buffer dtype override", nullable=True, when_on="set"),
    # -- aio (runtime/swap_tensor/constants.py) --
    KeySpec("aio", Section(), {}, "Async I/O for nvme offload."),
    KeySpec("aio.block_size", Int(), 1_048_576, "Bytes per block of an NVMe optimizer-state read or write; the blocks of one request move on the I/O threads side by side.", check=at_least(1)),
    KeySpec("aio.queue_depth", Int(), 8, "I/O queue depth.", NO_EFFECT, _ONLY_NVME, check=at_least(1)),
    KeySpec("aio.intra_op_parallelism", Int(), 1, "I/O threads that move the blocks of the NVMe optimizer state's reads and writes.", check=at_least(1)),
    KeySpec("aio.thread_count", Int(), 1, "Older spelling of intra_op_parallelism (read when that key is absent).", check=at_least(1)),
    KeySpec("aio.single_submit", Bool(), False, "Submit requests one by one.", NO_EFFECT, _ONLY_NVME),
    KeySpec("aio.overlap_events", Bool(), True, "Overlap submission and completion.", NO_EFFECT, _ONLY_NVME),
    KeySpec("aio.use_gds", Bool(), False, "GPUDirect Storage.", NO_EFFECT, _AIO_BACKEND),
    KeySpec("aio.io_backend", Str(), "async_io", "I/O backend.", NO_EFFECT, _AIO_BACKEND),
    # -- DeepSpeed's activation checkpointing API --
    KeySpec("activation_checkpointing", Section(), {}, "DeepSpeed's activation checkpointing (deepspeed.checkpointing); HF models use model.gradient_checkpointing_enable()."),
    *[KeySpec(f"activation_checkpointing.{name}", kind, default, doc, NOT_IMPLEMENTED, "DeepSpeed's activation checkpointing; use model.gradient_checkpointing_enable()", nullable=default is None, when_on=on)
      for name, kind, default, doc, on in (
          ("partition_activations", Bool(), False, "Partition checkpointed activations across ranks.", "true"),
          ("number_checkpoints", Int(), None, "Checkpoints per model.", "set"),
          ("contiguous_memory_optimization", Bool(), False, "Copy checkpoints into one buffer.", "true"),
          ("cpu_checkpointing", Bool(), False, "Offload checkpoints to the CPU.", "true"),
          ("synchronize_checkpoint_boundary", Bool(), False, "Synchronise at checkpoint boundaries.", "true"),
          ("profile", Bool(), False, "Profile checkpointing.", "true"))],
    # -- profiling and monitoring --
    KeySpec("flops_profiler", Section(), {}, "DeepSpeed's FLOPs profiler."),
    KeySpec("flops_profiler.enabled", Bool(), False, "Run the FLOPs profiler.", NOT_IMPLEMENTED, "the FLOPs profiler", when_on="true"),
    *[KeySpec(f"flops_profiler.{name}", kind, default, "FLOPs profiler option.", NO_EFFECT, "only read when flops_profiler.enabled is true", nullable=default is None)
      for name, kind, default in (("recompute_fwd_factor", Float(), 0.0), ("profile_step", Int(), 1), ("module_depth", Int(), -1),
                                  ("top_modules", Int(), 1), ("detailed", Bool(), True), ("output_file", Str(), None))],
    KeySpec("comms_logger", Section(), {}, "DeepSpeed's communication logger."),
    KeySpec("comms_logger.enabled", Bool(), False, "Log every collective.", NOT_IMPLEMENTED, "the comms logger; hf_zero counts bytes per collective in comm/", when_on="true"),
    *[KeySpec(f"comms_logger.{name}", kind, default, "Comms logger option.", NO_EFFECT, "only read when comms_logger.enabled is true")
      for name, kind, default in (("verbose", Bool(), False), ("prof_all", Bool(), True), ("debug", Bool(), False), ("prof_ops", StrList(), []))],
    *[spec for monitor, options in (
        ("tensorboard", (("output_path", Str(), ""), ("job_name", Str(), "DeepSpeedJobName"))),
        ("csv_monitor", (("output_path", Str(), ""), ("job_name", Str(), "DeepSpeedJobName"))),
        ("wandb", (("group", Str(), None), ("team", Str(), None), ("project", Str(), "deepspeed"))),
        ("comet", (("samples_log_interval", Int(), 100), ("project", Str(), None), ("workspace", Str(), None),
                   ("api_key", Str(), None), ("experiment_name", Str(), None), ("experiment_key", Str(), None),
                   ("online", Bool(), None), ("mode", Choice(("get_or_create", "create", "get")), None))),
        ("aim", (("repo", Str(), None), ("experiment_name", Str(), None), ("log_system_params", Bool(), None),
                 ("run_name", Str(), None), ("run_hash", Str(), None))),
      ) for spec in (
        KeySpec(monitor, Section(), {}, f"DeepSpeed's {monitor} monitor."),
        KeySpec(f"{monitor}.enabled", Bool(), False, f"Log to {monitor}.", NOT_IMPLEMENTED, _MONITOR, when_on="true"),
        *[KeySpec(f"{monitor}.{name}", kind, default, f"{monitor} option.", NO_EFFECT, f"only read when {monitor}.enabled is true", nullable=default is None)
          for name, kind, default in options],
      )],
    KeySpec("timers", Opaque(), {}, "DeepSpeed's throughput timers.", NO_EFFECT, "timing logs only"),
    # -- whole DeepSpeed features hf_zero does not have: off while their switches are off --
    KeySpec("pipeline", Opaque(), {}, "Pipeline parallelism.", NOT_IMPLEMENTED, "pipeline parallelism", off=_pipeline_off, when_on="any non-default value"),
    *[KeySpec(name, Opaque(), {}, doc, NOT_IMPLEMENTED, doc, off=_nothing_enabled, when_on='any nested "enabled": true')
      for name, doc in (
          ("elasticity", "Elastic training"), ("autotuning", "DeepSpeed autotuning"),
          ("compression_training", "Compression training"), ("data_efficiency", "Data efficiency (curriculum / routing)"),
          ("curriculum_learning", "Legacy curriculum learning"), ("quantize_training", "MoQ quantized training"),
          ("progressive_layer_drop", "Progressive layer drop"), ("eigenvalue", "Eigenvalue computation"),
          ("hybrid_engine", "DeepSpeed hybrid engine (RLHF)"), ("nebula", "Nebula checkpointing"),
          ("datastates", "DataStates checkpointing"))],
    *[KeySpec(name, Opaque(), {}, doc, NOT_IMPLEMENTED, doc, off=_empty, when_on="present (non-empty)")
      for name, doc in (("sparse_attention", "Sparse attention"), ("weight_quantization", "Weight quantization (inference)"),
                        ("expert_parallel", "Expert parallelism"))],
    KeySpec("compile", Opaque(), {}, "DeepCompile.", NOT_IMPLEMENTED, "DeepCompile", off=_deepcompile_off, when_on='"deepcompile": true'),
    KeySpec("tensor_parallel", Opaque(), {}, "Automatic tensor parallelism.", NOT_IMPLEMENTED, "tensor parallelism", off=_no_parallel_size_above_one, when_on="a size > 1"),
]  # fmt: skip

KEY_TABLE: dict[str, KeySpec] = {spec.path: spec for spec in _SPECS}

_CHILDREN: dict[str, dict[str, KeySpec]] = {}
for _spec in _SPECS:
    _CHILDREN.setdefault(_spec.parent, {})[_spec.name] = _spec


def children_of(section_path: str) -> dict[str, KeySpec]:
    """Known keys directly under a section ("" is the top level)."""
    return _CHILDREN.get(section_path, {})


def spec_for(path: str) -> KeySpec | None:
    return KEY_TABLE.get(path)


def iter_specs() -> Iterator[KeySpec]:
    return iter(_SPECS)
