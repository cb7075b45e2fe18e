"""Typed views of a validated config, one frozen dataclass per section.

Defaults live in the key table (keys.py); these classes are built from a validated dict with
those defaults applied, so a default is written once. A value still "auto" is stored as an `Auto`
marker and reading it raises RuntimeError naming the key: the string "auto" never reaches engine
code, where it would be compared with numbers.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import MISSING
from .keys import IMPLEMENTED_SCHEDULERS, KEY_TABLE
from .validate import AUTO, canonical_optimizer

__all__ = [
    "Auto",
    "ZeroConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "Fp16Config",
    "Bf16Config",
    "OptimizerConfig",
    "SchedulerConfig",
    "build_zero",
    "build_fp16",
    "build_bf16",
    "build_optimizer",
    "build_scheduler",
    "auto_error",
]


@dataclass(frozen=True)
class Auto:
    """Marks a value that is still "auto"; `path` is its dotted key."""

    path: str

    def __repr__(self) -> str:
        return "'auto'"


def find_auto(value: Any) -> Auto | None:
    if isinstance(value, Auto):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for inner in value:
            found = find_auto(inner)
            if found is not None:
                return found
    return None


def auto_error(path: str) -> RuntimeError:
    return RuntimeError(
        f'{path} is still "auto". Call HfZeroConfig.resolve(...) first (the Trainer / Accelerate '
        "integrations do), or write a value in the config."
    )


class _Typed:
    """Base of the section dataclasses: reading a field that is still "auto" raises."""

    def __getattribute__(self, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if not name.startswith("_"):
            auto = find_auto(value) if isinstance(value, (Auto, dict, list, tuple)) else None
            if auto is not None:
                raise auto_error(auto.path)
        return value

    def __repr__(self) -> str:
        fields = dataclasses.fields(self)  # type: ignore[arg-type]
        shown = ", ".join(f"{f.name}={object.__getattribute__(self, f.name)!r}" for f in fields)
        return f"{type(self).__name__}({shown})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        names = [f.name for f in dataclasses.fields(self)]  # type: ignore[arg-type]
        return all(object.__getattribute__(self, n) == object.__getattribute__(other, n) for n in names)

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, repr=False, eq=False)
class OffloadParamConfig(_Typed):
    """``zero_optimization.offload_param`` (stage 3 only)."""

    device: str
    """Where stage-3 parameters live between uses: "none", "cpu" or "nvme". Default "none"."""
    nvme_path: str | None
    """Directory on the NVMe drive when device is "nvme". Default None."""
    pin_memory: bool
    """Page-locked host buffers. Default True."""
    buffer_count: int
    """Host buffers NVMe-offloaded shards are read into before their gather; at most this many
    shards are in host memory at once. Default 5."""
    buffer_size: int
    """Elements a swap buffer may hold: the largest NVMe-offloaded shard must fit. Default 1e8."""
    max_in_cpu: int
    """Elements of a rank's shards kept in host memory instead of files (the first units first)
    when offloading to NVMe. Default 1e9."""


@dataclass(frozen=True, repr=False, eq=False)
class OffloadOptimizerConfig(_Typed):
    """``zero_optimization.offload_optimizer`` (stages 1-3)."""

    device: str
    """Where the fp32 master and optimizer state live: "none", "cpu" or "nvme"; the step then
    runs on the CPU. Default "none"."""
    nvme_path: str | None
    """Directory on the NVMe drive when device is "nvme". Default None."""
    pin_memory: bool
    """Page-locked host buffers. Default True."""
    buffer_count: int
    """Buffers in DeepSpeed's NVMe swap pool; no effect in hf_zero. Default 4."""
    ratio: float
    """Fraction of the optimizer state offloaded with device "cpu" (Twin-Flow below 1.0; whole
    units in model order, see hf_zero.offload.placement). Default 1.0."""
    pipeline_read: bool
    """Overlap reading the next NVMe tile with the current step. Default False."""
    pipeline_write: bool
    """Overlap writing the previous NVMe tile with the current step. Default False."""
    fast_init: bool
    """Fast optimizer initialisation with NVMe. Default False."""
    super_offload: bool
    """SuperOffload for superchips. Default False."""
    cpuadam_cores_perc: float
    """Share of this rank's cores the host step runs on ([Note: host threads] in
    hf_zero.offload.threads). Default 0.8."""


@dataclass(frozen=True, repr=False, eq=False)
class ZeroConfig(_Typed):
    """``zero_optimization``."""

    stage: int
    """0: plain data parallel; 1: fp32 master + optimizer state sharded; 2: gradients sharded
    too; 3: parameters sharded too. Default 0."""
    contiguous_gradients: bool
    """DeepSpeed copies gradients into one buffer; hf_zero always does. Default True."""
    reduce_scatter: bool
    """Reduce-scatter rather than all-reduce gradients; same values either way. Default True."""
    reduce_bucket_size: int
    """Elements per gradient-reduction bucket. Default 5e8 ("auto": hidden_size**2)."""
    use_multi_rank_bucket_allreduce: bool
    """DeepSpeed speed hint, no effect in hf_zero. Default True."""
    allgather_partitions: bool
    """All-gather rather than broadcast updated shards; same values either way. Default True."""
    allgather_bucket_size: int
    """Elements per all-gather bucket (stages 1-2). Default 5e8."""
    overlap_comm: bool
    """Overlap gradient reduction with backward. Default: True for stage 3 only (DeepSpeed's
    rule when the key is absent or null)."""
    load_from_fp32_weights: bool
    """Load the fp32 master from checkpoints; hf_zero always does. Default True."""
    elastic_checkpoint: bool
    """Legacy elastic checkpoints; hf_zero checkpoints load at any world size. Default False."""
    offload_param: OffloadParamConfig | None
    """Parameter offload (stage 3), or None when the config has none. Default None."""
    offload_optimizer: OffloadOptimizerConfig | None
    """Optimizer state offload (stages 1-3), or None when the config has none. Default None."""
    sub_group_size: int
    """Optimizer-step tile size in elements. Default 1e9."""
    stage3_prefetch_bucket_size: int
    """Parameter elements prefetched ahead of use (stage 3). Default 5e7
    ("auto": int(0.9 * hidden_size**2))."""
    stage3_param_persistence_threshold: int
    """Parameters (units) smaller than this stay gathered (stage 3). Default 1e5
    ("auto": 10 * hidden_size)."""
    stage3_model_persistence_threshold: int
    """Cap on elements kept gathered by the threshold above; no effect in hf_zero. Default
    sys.maxsize."""
    stage3_max_live_parameters: int
    """Max gathered parameter elements per rank before releasing (stage 3). Default 1e9."""
    stage3_max_reuse_distance: int
    """Keep a gathered parameter if reused within this many elements (stage 3). Default 1e9."""
    stage3_gather_16bit_weights_on_model_save: bool
    """Gather full 16-bit weights when saving the model (stage 3). Default False."""
    stage3_module_granularity_threshold: int
    """Fine-grained module fetching; must stay 0 (not implemented). Default 0."""
    ignore_unused_parameters: bool
    """Parameters without gradients are ignored; must stay True (the error is not
    implemented). Default True."""
    round_robin_gradients: bool
    """DeepSpeed offload speed hint, no effect in hf_zero. Default False."""
    zero_hpz_partition_size: int
    """ZeRO++ hpZ: secondary shards over groups of this many ranks, which the backward's gathers
    stay within (stage 3). Default 1 (off)."""
    zero_quantized_weights: bool
    """ZeRO++ qwZ: stage-3 gathers send int8 blocks (stage 3 only). Default False."""
    zero_quantized_nontrainable_weights: bool
    """ZeRO++ MixZ++; must stay False (not implemented). Default False."""
    zero_quantized_gradients: bool
    """ZeRO++ qgZ: gradient reduce-scatters in int8 blocks, inside the node first (stages 1-3).
    Default False."""
    mics_shard_size: int
    """Hybrid sharding: model states are sharded over groups of this many consecutive ranks and
    replicated across groups (DeepSpeed's MiCS, FSDP2's HSDP). -1 (or <= 0): one group of all
    ranks. Default -1."""
    memory_efficient_linear: bool
    """DeepSpeed's stage-3 linear; no effect in hf_zero. Default True."""
    wrap_modules: list[str] | None
    """hf_zero only: class names (e.g. ["LlamaDecoderLayer"]) whose instances each form one
    unit: gathered, reduced and checkpointed together. Default None, which means the model's
    ``_no_split_modules``, then the children of its largest nn.ModuleList, then a size threshold."""

    @property
    def offloads_optimizer(self) -> bool:
        """True when the optimizer state lives off the accelerator."""
        return self.offload_optimizer is not None and self.offload_optimizer.device != "none"

    @property
    def offloads_params(self) -> bool:
        """True when stage-3 parameters live off the accelerator."""
        return self.offload_param is not None and self.offload_param.device != "none"


@dataclass(frozen=True, repr=False, eq=False)
class Fp16Config(_Typed):
    """``fp16``: fp16 compute with dynamic (or static) loss scaling."""

    enabled: bool
    """Compute in fp16 (master weights stay fp32). Default False."""
    loss_scale: float
    """Static loss scale; 0 means dynamic scaling. Default 0."""
    initial_scale_power: int
    """Dynamic scaling starts at 2**initial_scale_power. Default 16."""
    loss_scale_window: int
    """Overflow-free steps before the scale doubles. Default 1000."""
    hysteresis: int
    """Overflows tolerated before the scale halves. Default 2."""
    consecutive_hysteresis: bool
    """Refill hysteresis after every overflow-free step. Default False."""
    min_loss_scale: float
    """Lowest dynamic loss scale. Default 1."""

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0

    @property
    def initial_dynamic_scale(self) -> float:
        return float(2**self.initial_scale_power)


@dataclass(frozen=True, repr=False, eq=False)
class Bf16Config(_Typed):
    """``bf16``: bf16 compute, no loss scaling."""

    enabled: bool
    """Compute in bf16 (master weights stay fp32). Default False."""
    check_grad_overflow: bool
    """Skip a step whose gradients hold inf/nan instead of raising (also spelled
    ``check_overflow``). Default False."""


@dataclass(frozen=True, repr=False, eq=False)
class OptimizerConfig(_Typed):
    """``optimizer`` with an implemented type (Adam / AdamW / Muon / Adafactor)."""

    type: str
    """"Adam", "AdamW", "Muon" or "Adafactor", canonicalised from any casing (DeepSpeed lower-cases it)."""
    lr: float
    """Learning rate. Default 1e-3."""
    betas: tuple[float, float]
    """(beta1, beta2). Default (0.9, 0.999)."""
    eps: float
    """Denominator epsilon. Default 1e-8."""
    weight_decay: float
    """Weight decay. Default 0.0 (DeepSpeed's FusedAdam default)."""
    adam_w_mode: bool
    """For type "Adam": decoupled weight decay. DeepSpeed defaults it to True, so its "Adam" is
    AdamW unless this is false. Default True."""
    torch_adam: bool
    """DeepSpeed: use torch.optim instead of its fused kernel; same update. Default False."""
    momentum: float
    """Muon momentum. Default 0.95."""
    nesterov: bool
    """Muon: Nesterov momentum. Default True."""
    ns_steps: int
    """Muon: Newton-Schulz iterations. Default 5."""
    adam_lr: float | None
    """Muon: the auxiliary AdamW's learning rate; None means ``lr``. Default None."""
    beta2_decay: float
    """Adafactor: decay rate of the second moment. Default -0.8."""
    d: float
    """Adafactor: update clipping threshold. Default 1.0."""

    @property
    def decoupled_weight_decay(self) -> bool:
        """AdamW-style decay (p -= lr * wd * p) rather than L2 added to the gradient (DeepSpeed:
        type AdamW, or type Adam with adam_w_mode)."""
        return self.type == "AdamW" or self.adam_w_mode


@dataclass(frozen=True, repr=False, eq=False)
class SchedulerConfig(_Typed):
    """``scheduler`` with an implemented type."""

    type: str
    """"WarmupLR", "WarmupDecayLR" or "WarmupCosineLR" (DeepSpeed's definitions)."""
    params: dict[str, Any]
    """The type's arguments with DeepSpeed's defaults filled in (e.g. warmup_type "log")."""


# ---- builders -------------------------------------------------------------------------------

_T = TypeVar("_T", bound=_Typed)


def _field_value(section: dict[str, Any], path: str, name: str) -> Any:
    key_path = f"{path}.{name}"
    if name in section:
        value = section[name]
        return Auto(key_path) if isinstance(value, str) and value == AUTO else copy.deepcopy(value)
    return copy.deepcopy(KEY_TABLE[key_path].default)


def _build(cls: type[_T], section: dict[str, Any], path: str, **overrides: Any) -> _T:
    values = {
        f.name: overrides[f.name] if f.name in overrides else _field_value(section, path, f.name)
        for f in dataclasses.fields(cls)
    }
    return cls(**values)


def _offload(cls: type[_T], section: Any, path: str, legacy_on: Any) -> _T | None:
    if isinstance(section, dict):
        return _build(cls, section, path)
    if legacy_on is True:  # deprecated cpu_offload / cpu_offload_param: true means device "cpu"
        return _build(cls, {"device": "cpu"}, path)
    return None


def build_zero(section: dict[str, Any]) -> ZeroConfig:
    path = "zero_optimization"
    stage = section.get("stage", 0)
    overlap = section.get("overlap_comm")
    return _build(
        ZeroConfig,
        section,
        path,
        overlap_comm=(stage == 3) if overlap is None else overlap,
        offload_param=_offload(
            OffloadParamConfig, section.get("offload_param"), f"{path}.offload_param", section.get("cpu_offload_param")
        ),
        offload_optimizer=_offload(
            OffloadOptimizerConfig,
            section.get("offload_optimizer"),
            f"{path}.offload_optimizer",
            section.get("cpu_offload"),
        ),
    )


def build_fp16(section: dict[str, Any]) -> Fp16Config:
    return _build(Fp16Config, section, "fp16")


def build_bf16(section: dict[str, Any]) -> Bf16Config:
    skip = bool(_field_value(section, "bf16", "check_grad_overflow") or _field_value(section, "bf16", "check_overflow"))
    return _build(Bf16Config, section, "bf16", check_grad_overflow=skip)


def build_optimizer(section: dict[str, Any] | None) -> OptimizerConfig | None:
    if section is None:
        return None
    params = section.get("params", {})
    betas = _field_value(params, "optimizer.params", "betas")
    return _build(
        OptimizerConfig,
        params,
        "optimizer.params",
        type=canonical_optimizer(section["type"]),
        betas=betas if isinstance(betas, Auto) else tuple(betas),
    )


def build_scheduler(section: dict[str, Any] | None) -> SchedulerConfig | None:
    if section is None:
        return None
    kind = section["type"]
    given = section.get("params", {})
    defaults = {
        spec.name: spec.default
        for path, spec in KEY_TABLE.items()
        if path.startswith("scheduler.params.") and kind in spec.scheduler_types and kind in IMPLEMENTED_SCHEDULERS
        and spec.name not in given and spec.default is not None and spec.default is not MISSING
    }
    params = {name: _field_value(given, "scheduler.params", name) for name in given}
    return SchedulerConfig(type=kind, params={**defaults, **params})
