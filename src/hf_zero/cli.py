"""The ``hf-zero`` command: ``demo`` (the main job), ``doctor``, ``check-config``, ``export``,
``import-deepspeed``, ``export-dcp``, ``import-dcp``, ``estimate`` and ``launch`` (``accelerate
launch`` with an ``hf_zero:`` section in its yaml).

[Note: the command imports torch late]
Building the parser, ``--version`` and ``check-config``
import neither torch nor transformers (importing torch alone takes 1-20 s on a busy machine):
``hf_zero/__init__.py`` loads the engine on first use, hf_zero.config imports torch only where a
dtype or a torch class is asked for, and the demo's flags live here, not in hf_zero.demo.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any


# ---------------------------------------------------------------- the demo's flags
def at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer of at least ``low`` (argparse reports a bad one in one line)."""

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return integer


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


DEMO_DEVICE_HELP = ("where the ranks compute: cpu (over gloo; any GPU is hidden from the ranks) or cuda "
                    "(over NCCL, one GPU per rank)")


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's flags, shared by ``hf-zero demo`` (which checks them before starting any
    process, then passes them on) and ``python -m hf_zero.demo``."""
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help=DEMO_DEVICE_HELP)
    parser.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage")
    parser.add_argument("--steps", type=at_least(1), default=40, help="optimizer steps")
    parser.add_argument("--n-layer", type=at_least(1), default=4, help="GPT-2 layers")
    parser.add_argument("--n-embd", type=at_least(1), default=256,
                        help="GPT-2 hidden size (with n-embd // 64 heads, at least 1, which must divide it)")
    parser.add_argument("--vocab", type=at_least(2), default=8192, help="vocabulary size")
    parser.add_argument("--active-vocab", type=at_least(1), default=256,
                        help="tokens the data uses (its Markov chain's states; at most --vocab)")
    parser.add_argument("--seq", type=at_least(2), default=128, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=at_least(1), default=4, help="sequences per rank per micro-step")
    parser.add_argument("--grad-accum", type=at_least(1), default=1, help="gradient accumulation steps")
    parser.add_argument("--lr", type=positive_float, default=1e-3,
                        help="AdamW peak learning rate (a linear warmup from 0.2 of it over a quarter of the steps, then a cosine)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                        help="compute dtype (bf16 is slow on CPUs without native bf16 matmul)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the weights and the data")
    parser.add_argument("--json", type=str, default=None, help="also write the summary to this JSON file")


def n_head(n_embd: int) -> int:
    return max(1, n_embd // 64)


def check_demo_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace, nproc: int | None = None) -> None:
    """The rules between flags, and between flags and the machine; ``parser.error`` prints the
    usage and one line, and exits with 2. Imports torch only for ``--device cuda``."""
    if args.n_embd % n_head(args.n_embd):
        parser.error(f"argument --n-embd: {args.n_embd} is not divisible by its {n_head(args.n_embd)} heads "
                     "(n-embd // 64): use a multiple of 64, or a value under 128")
    if args.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        parser.error(f"argument --device: cuda, but torch {torch.__version__} sees no CUDA device on this machine "
                     f"({'a CPU-only build' if torch.version.cuda is None else f'built for CUDA {torch.version.cuda}'}): "
                     "use --device cpu, or run hf-zero doctor")
    if nproc is not None and nproc > torch.cuda.device_count():
        parser.error(f"argument --nproc: {nproc} processes with --device cuda, but {torch.cuda.device_count()} GPU(s) "
                     "(one process per GPU): lower --nproc, or use --device cpu")


def _demo(args: argparse.Namespace, rest: list[str]) -> int:
    check_demo_arguments(args.subparser, args, args.nproc)
    import tempfile

    # Every flag but --nproc belongs to hf_zero.demo: pass them on as they were given.
    passed = _without_option(args.argv, "--nproc")
    env = dict(os.environ)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # hf_zero.demo hides it too; torchrun's own checks then agree
    # torchrun sets 1 thread per rank when unset, and prints a banner saying so: set it first
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    # torchrun keeps its per-rank log folders in a fresh temporary folder unless given one
    with tempfile.TemporaryDirectory(prefix="hf_zero_demo_logs_") as logs:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--log-dir={logs}",
            f"--nproc_per_node={args.nproc}", "-m", "hf_zero.demo", *passed,
        ]
        return subprocess.call(command, env=env)  # quiet: the bar and the summary are the output


def _without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` less ``option VALUE`` / ``option=VALUE``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


def _check_config(args: argparse.Namespace, rest: list[str]) -> int:
    # no torch: [Note: the command imports torch late]
    from hf_zero.config import HfZeroConfig, HfZeroConfigError

    try:
        config = HfZeroConfig.checked(args.path)  # not the live stage-3 config: nothing is loaded here
    except HfZeroConfigError as error:
        print(error, file=sys.stderr)
        return 1
    from hf_zero.config.validate import config_warnings

    warnings = config_warnings(config.to_dict())
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    note = f" ({len(warnings)} warning{'s' if len(warnings) != 1 else ''} above)" if warnings else ""
    print(f"{args.path}: valid{note}. Still \"auto\": {config.auto_keys() or 'nothing'}")
    return 0


def _doctor(args: argparse.Namespace, rest: list[str]) -> int:
    from hf_zero.doctor import doctor

    return doctor(with_suite=not args.facts_only, repo=args.repo)


def _export(args: argparse.Namespace, rest: list[str]) -> int:
    from hf_zero.checkpoint import CheckpointError, export_hf_model

    try:
        out = export_hf_model(args.ckpt_dir, args.out_dir, tag=args.tag, dtype=args.dtype,
                              max_shard_size=args.max_shard_size, allow_unverified=args.allow_unverified,
                              check_model=not args.skip_model_check)
    except (CheckpointError, ValueError) as error:
        print(f"hf-zero export: {error}", file=sys.stderr)
        return 1
    print(f"exported {args.ckpt_dir} to {out} ({args.dtype}): load it with from_pretrained({out!r})")
    return 0


def _meta_model_or_report(command: str, path: str) -> Any:
    """The model at ``path`` on the meta device (names, shapes and config: all an import checks and
    records), or None once the reason it cannot be built is printed."""
    from hf_zero.estimator import meta_model

    try:
        return meta_model(path)
    except (OSError, ValueError) as error:
        print(f"hf-zero {command}: cannot build a model from {path!r}: {error}", file=sys.stderr)
        return None


def _import_deepspeed(args: argparse.Namespace, rest: list[str]) -> int:
    from hf_zero.checkpoint import CheckpointError, import_deepspeed_checkpoint

    model = None
    if args.model is not None:
        model = _meta_model_or_report("import-deepspeed", args.model)
        if model is None:
            return 1
    try:
        out = import_deepspeed_checkpoint(args.ds_dir, args.out_dir, model=model, tag=args.tag,
                                          optimizer_class=args.optimizer_class)
    except (CheckpointError, ValueError) as error:
        print(f"hf-zero import-deepspeed: {error}", file=sys.stderr)
        return 1
    print(f"converted {args.ds_dir} to {out}: resume it with engine.load_checkpoint({args.out_dir!r}) at any "
          "world size and stage")
    return 0


def _export_dcp(args: argparse.Namespace, rest: list[str]) -> int:
    from hf_zero.checkpoint import CheckpointError, export_dcp_checkpoint

    try:
        out = export_dcp_checkpoint(args.ckpt_dir, args.out_dir, tag=args.tag, allow_unverified=args.allow_unverified)
    except (CheckpointError, ValueError, NotImplementedError) as error:
        print(f"hf-zero export-dcp: {error}", file=sys.stderr)
        return 1
    print(f"exported {args.ckpt_dir} to {out}: load it in FSDP2 with dcp.load({{'model': model_sd, 'optim': "
          "optim_sd}, checkpoint_id=...) of get_state_dict(model, optimizer), then set_state_dict "
          "(docs/checkpoints.md, 'FSDP2 and DCP')")
    return 0


def _import_dcp(args: argparse.Namespace, rest: list[str]) -> int:
    from hf_zero.checkpoint import CheckpointError, import_dcp_checkpoint

    model = _meta_model_or_report("import-dcp", args.model)
    if model is None:
        return 1
    try:
        out = import_dcp_checkpoint(args.dcp_dir, args.out_dir, model=model, tag=args.tag,
                                    optimizer_class=args.optimizer_class)
    except (CheckpointError, ValueError, NotImplementedError) as error:
        print(f"hf-zero import-dcp: {error}", file=sys.stderr)
        return 1
    print(f"converted {args.dcp_dir} to {out}: resume it with engine.load_checkpoint({args.out_dir!r}) at any "
          "world size and stage")
    return 0


def _add_dcp(sub: argparse._SubParsersAction) -> None:
    exported = sub.add_parser("export-dcp", formatter_class=_FORMATTER,
                              help="write a checkpoint as a torch.distributed.checkpoint folder that FSDP2 loads",
                              description="Write an hf_zero checkpoint (any stage, any world size) as a DCP folder "
                              "{'model': ..., 'optim': ...} in the layout of get_state_dict(model, optimizer): FSDP2 "
                              "loads it with dcp.load and set_state_dict and continues with torch.optim.AdamW "
                              "(weights, exp_avg, exp_avg_sq, step counts, param-group hyperparameters).")
    exported.add_argument("ckpt_dir",
                          help="the save_checkpoint directory (uses its 'latest'), or one checkpoint directory")
    exported.add_argument("out_dir", help="the DCP folder to write (new or empty)")
    exported.add_argument("--tag", default=None, help="checkpoint tag (None: the one 'latest' names)")
    exported.add_argument("--allow-unverified", action="store_true",
                          help="export a checkpoint without per-tensor checksums (format 1)")
    exported.set_defaults(func=_export_dcp)
    imported = sub.add_parser("import-dcp", formatter_class=_FORMATTER,
                              help="convert a DCP folder saved by FSDP2 into a checkpoint engine.load_checkpoint "
                              "resumes",
                              description="Convert a torch.distributed.checkpoint folder that an FSDP2 run saved as "
                              "dcp.save({'model': model_sd, 'optim': optim_sd}) of get_state_dict(model, optimizer) "
                              "with torch.optim.AdamW, at any world size, once into an hf_zero checkpoint that "
                              "engine.load_checkpoint(OUT_DIR) resumes at any world size and stage. Nothing in the "
                              "folder is unpickled but DCP's metadata classes and tensors.")
    imported.add_argument("dcp_dir", help="the folder given to dcp.save as checkpoint_id")
    imported.add_argument("out_dir", help="where to write the hf_zero checkpoint (OUT_DIR/<tag> and OUT_DIR/latest); "
                          "it must not hold a checkpoint yet")
    imported.add_argument("--model", required=True, metavar="MODEL",
                          help="a model folder or hub id (its config.json): the names and shapes are checked against "
                          "it and it is recorded, so that hf-zero export works on the result")
    imported.add_argument("--tag", default=None, help="the tag to write (None: global_step<N>, N the step count)")
    imported.add_argument("--optimizer-class", choices=["ZeroAdam", "AdamW", "Adam"], default="ZeroAdam",
                          help="ZeroAdam for the config's Adam/AdamW; AdamW or Adam for a torch optimizer passed to "
                          "hf_zero.initialize (the Trainer's)")
    imported.set_defaults(func=_import_dcp)


def _estimate(args: argparse.Namespace, rest: list[str]) -> int:
    from hf_zero.estimator import WorkingSettings, describe, estimate_model_states, format_table, meta_model

    world = args.gpus_per_node * args.nodes
    for flag, given in (("--simulate-rank", args.simulate_rank is not None), ("--quantized-weights", args.quantized_weights),
                        ("--quantized-gradients", args.quantized_gradients)):
        if given and not args.simulate:
            print(f"hf-zero estimate: {flag} needs --simulate", file=sys.stderr)
            return 2
    if args.simulate_rank is not None and not 0 <= args.simulate_rank < world:
        print(f"hf-zero estimate: --simulate-rank {args.simulate_rank}: expected a rank from 0 to {world - 1} "
              f"(world {args.gpus_per_node} x {args.nodes} = {world}); leave it out for the last rank", file=sys.stderr)
        return 2
    try:
        model = meta_model(args.model)
    except (OSError, ValueError) as error:
        print(f"hf-zero estimate: cannot build a model from {args.model!r}: {error}", file=sys.stderr)
        return 1
    if args.hpz_partition_size > 1 and (args.shard_group_size is not None or world % args.hpz_partition_size):
        print(f"hf-zero estimate: --hpz-partition-size {args.hpz_partition_size}: expected a divisor of the world size "
              f"{world} (usually --gpus-per-node), without --shard-group-size (hpZ and hybrid sharding are "
              "alternatives: the README's multi-node section compares them)", file=sys.stderr)
        return 2
    if args.shard_group_size is not None and (args.shard_group_size < 2 or world % args.shard_group_size):
        print(f"hf-zero estimate: --shard-group-size {args.shard_group_size}: expected a divisor of the world size "
              f"{world} of at least 2 (usually --gpus-per-node)", file=sys.stderr)
        return 2
    found = None
    if args.seq is not None:
        found = _trace_activations(args, model, world)
        if isinstance(found, int):
            return found
    def states(stages: Any) -> list[Any]:
        return estimate_model_states(
            model, args.gpus_per_node, args.nodes, dtype=args.dtype, stages=stages,
            persistence_threshold=args.persistence_threshold,
            working=WorkingSettings(args.reduce_bucket_size, args.max_reuse_distance, args.max_live_parameters,
                                    args.prefetch_bucket_size), shard_group_size=args.shard_group_size,
            activations=None if found is None else found.by_unit, secondary_partition_size=args.hpz_partition_size,
            quantized_weights=args.quantized_weights,
        )

    estimates = states(args.stages)
    print(describe(model, world))
    if args.shard_group_size is not None:
        print(f"hybrid sharding: states sharded over groups of {args.shard_group_size} ranks, "
              f"{world // args.shard_group_size} replicas (mics_shard_size)")
    print(f"model states per rank ({args.dtype} compute, fp32 master and Adam state), and the engine's working set:")
    print(format_table(estimates, model))
    if found is not None:
        _print_activations(args, found, estimates)
    elif not args.simulate:
        print("will it fit: add --seq (and --micro-batch, --gradient-checkpointing) for the activations and the peak per rank")
    if not args.simulate:
        return 0
    stage3 = [e for e in estimates if (e.stage, e.offload_optimizer, e.offload_param) == (3, False, False)]
    return _simulate(args, model, stage3[0] if stage3 else states((3,))[0])


def _trace_activations(args: argparse.Namespace, model: Any, world: int) -> Any:
    """``estimate --seq``: the traced activations ([Note: traced activations]), or an exit code."""
    from hf_zero.activations import ActivationSettings, estimate_activations

    size = args.sequence_parallel_size
    if size < 1 or world % size:
        print(f"hf-zero estimate: --sequence-parallel-size {size}: expected a divisor of the world size {world}",
              file=sys.stderr)
        return 2
    settings = ActivationSettings(seq_len=args.seq, micro_batch=args.micro_batch, dtype=args.dtype,
                                  sequence_parallel_size=size, gradient_checkpointing=args.gradient_checkpointing,
                                  tiled_loss_tokens=args.tiled_loss_tokens, tiled_mlp_tokens=args.tiled_mlp_tokens)
    try:
        return estimate_activations(model.config, settings)
    except (ValueError, NotImplementedError, RuntimeError) as error:
        print(f"hf-zero estimate: cannot trace the activations of {args.model!r}: {error}", file=sys.stderr)
        return 1


def _print_activations(args: argparse.Namespace, found: Any, estimates: list[Any]) -> None:
    from hf_zero.estimator import format_peak_table, human_bytes

    settings = found.settings
    choices = [f"{args.seq} tokens x {args.micro_batch} sequence(s)", args.dtype]
    choices += [f"sequence_parallel_size {settings.sequence_parallel_size} ({settings.local_seq} tokens a rank)"
                ] if settings.sequence_parallel_size > 1 else []
    choices += ["gradient checkpointing"] if args.gradient_checkpointing else []
    choices += [f"tiled_loss_tokens {args.tiled_loss_tokens}"] if args.tiled_loss_tokens else []
    choices += [f"tiled_mlp_tokens {args.tiled_mlp_tokens}"] if args.tiled_mlp_tokens else []
    print(f"\nactivations per rank ({', '.join(choices)}), traced on fake tensors:")
    rows = [("kept after the forward", found.after_forward,
             f"{human_bytes(found.per_layer_after_forward)} per layer x {found.layers}, and the logits"),
            ("logits and loss", found.logits_and_loss,
             "the head's output, the loss's fp32 copy and what it keeps, above what was live at the head"),
            ("peak of forward and backward", found.peak, "the +activations column below")]
    for name, value, meaning in rows:
        shown = human_bytes(value)
        shown += "" if shown.endswith("GiB") else f" ({value / 2**30:.2f} GiB)"
        print(f"  {name:<29} {shown:>24}  {meaning}")
    print("peak per rank: the states, plus the working set and the activations where their sum is largest "
          "(stage 3: at each unit of the replayed step; stages 0-2: the two peaks added, an upper estimate):")
    print(format_peak_table(estimates, found.peak))


def _simulate(args: argparse.Namespace, model: Any, row: Any) -> int:
    """``estimate --simulate``: [Note: simulated rank] in hf_zero/simulate.py, printed beside the
    formula's stage-3 row."""
    from hf_zero import simulate
    from hf_zero.estimator import human_bytes

    world = args.gpus_per_node * args.nodes
    rank = world - 1 if args.simulate_rank is None else args.simulate_rank
    largest = simulate.largest_module_bytes(model, row.compute_bytes)
    need = simulate.INTERPRETER_BYTES + row.device_bytes + max(largest, row.working_and_activations or row.working_bytes)
    available = simulate.available_host_bytes()
    print(f"\nsimulating rank {rank} of {world} on this machine's CPU with torch's fake process group: "
          "collectives move nothing, so the values computed are meaningless; only memory and time are measured")
    print(f"host memory needed: about {human_bytes(need)} (this rank's states {human_bytes(row.device_bytes)} + the larger of "
          f"the largest module, materialised whole, {human_bytes(largest)} and "
          f"{'+working' if row.working_and_activations is None else 'the working set and activations'} "
          f"{human_bytes(row.working_and_activations or row.working_bytes)}, "
          f"+ {human_bytes(simulate.INTERPRETER_BYTES)} for Python, torch and transformers); available: "
          f"{'unknown' if available is None else human_bytes(available)}")
    if available is not None and need > available:
        print(f"hf-zero estimate: --simulate needs about {human_bytes(need)} of host memory and this machine has "
              f"{human_bytes(available)} available: simulate a copy of the config with fewer num_hidden_layers (the "
              "largest module and the per-layer figures stay the same), or run it on a machine with more memory",
              file=sys.stderr)
        return 1
    spec = {"model": os.path.abspath(args.model) if os.path.exists(args.model) else args.model,
            "rank": rank, "world": world, "dtype": args.dtype, "persistence_threshold": args.persistence_threshold,
            "reduce_bucket_size": args.reduce_bucket_size, "max_reuse_distance": args.max_reuse_distance,
            "max_live_parameters": args.max_live_parameters, "prefetch_bucket_size": args.prefetch_bucket_size,
            "seq": 16 if args.seq is None else args.seq, "micro_batch": args.micro_batch, "shard_group_size": args.shard_group_size,
            "gradient_checkpointing": args.gradient_checkpointing, "quantized_weights": args.quantized_weights,
            "gpus_per_node": args.gpus_per_node, "hpz_partition_size": args.hpz_partition_size,
            "quantized_gradients": args.quantized_gradients}
    try:
        result = simulate.run_rank_subprocess(spec, lambda line: print(f"  {line} ...", flush=True))
    except RuntimeError as error:
        print(f"hf-zero estimate: {error}", file=sys.stderr)
        return 1
    print(_simulated_table(result, row, simulate.state_bytes(result["memory"]),
                           simulate.state_padding(result["layout"], row.compute_bytes)))
    return 0


def _simulated_table(result: dict[str, Any], row: Any, states: int, padding: tuple[float, float]) -> str:
    from hf_zero.estimator import human_bytes, text_table

    measured_working = result["peak_above_states"]
    padded, unpadded = padding
    rows = [("stage 3, rank {} of {}".format(result["rank"], result["world_size"]), "measured", "formula",
             "formula / measured"),
            ("states", f"{human_bytes(states)} ({states} B)", f"{human_bytes(row.device_bytes)} ({row.device_bytes} B)",
             f"{row.device_bytes / states:.3f}"),
            ("+working", f"{human_bytes(measured_working)} ({measured_working} B)",
             f"{human_bytes(row.working_bytes)} ({row.working_bytes} B)",
             f"{row.working_bytes / measured_working:.3f}" if measured_working > 0 else "-")]
    if row.working_and_activations is not None:  # --seq: the measured growth holds the activations too
        both, measured_peak = row.working_and_activations, states + measured_working
        rows[-1] = ("+working, activations", f"{human_bytes(measured_working)} ({measured_working} B)",
                    f"{human_bytes(both)} ({both} B)", f"{both / measured_working:.3f}" if measured_working > 0 else "-")
        rows.append(("peak", f"{human_bytes(measured_peak)} ({measured_peak} B)",
                     f"{human_bytes(row.device_bytes + both)} ({row.device_bytes + both} B)",
                     f"{(row.device_bytes + both) / measured_peak:.3f}"))
    lines = text_table(rows).splitlines()
    lines += [f"padding in the states: {human_bytes(int(padded - unpadded))} "
              f"({100 * (padded - unpadded) / padded if padded else 0:.3f}%)",
              f"time: build {result['build_s']:.1f} s, initialize {result['init_s']:.1f} s (peak added "
              f"{human_bytes(result['init_peak'])}), forward+backward+step {result['fwd_bwd_step_s']:.1f} s on this CPU",
              _comm_line(result.get("comm", {})),
              "measured: the peak resident growth of the forward and backward over the states, activations "
              f"included ({result.get('seq', '?')} tokens{', gradient checkpointing' if result.get('gradient_checkpointing') else ''}); "
              "not measured: real network buffers, kernels' workspace on a GPU, CUDA allocator fragmentation"]
    return "\n".join(lines)


def _comm_line(comm: dict[str, dict[str, int]]) -> str:
    """The simulated step's collectives by where they run ([Note: counting] in hf_zero.comm.collectives:
    logical sizes, the full tensor of each collective)."""
    from hf_zero.estimator import human_bytes

    inside = sum(c["bytes"] for kind, c in comm.items() if kind != "replica_all_reduce")
    across = comm.get("replica_all_reduce", {}).get("bytes", 0)
    line = f"communication of the step: {human_bytes(inside)} in the rank's shard group"
    line += (f", {human_bytes(across)} between shard groups (the gradient shards' all-reduce across replicas)"
             if "replica_all_reduce" in comm else " (every rank)")
    # [Note: bytes between nodes] in hf_zero.comm.collectives, with --gpus-per-node ranks a node.
    between = sum(c.get("bytes_between_nodes", 0) for c in comm.values())
    total = sum(c["bytes"] for c in comm.values())
    return line + f"; by where the data lives: {human_bytes(total - between)} inside the node, {human_bytes(between)} between nodes"


def _add_export_and_estimate(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser("export", formatter_class=_FORMATTER,
                            help="write a checkpoint as a Hugging Face model folder (from_pretrained loads it)",
                            description="Write a sharded hf_zero checkpoint, saved at any world size, as a plain "
                            "Hugging Face model folder. Needs neither the model code nor a GPU.")
    export.add_argument("ckpt_dir", help="the save_checkpoint directory (uses its 'latest'), or one checkpoint directory")
    export.add_argument("out_dir", help="the model folder to write (config.json is copied when the checkpoint has it)")
    export.add_argument("--tag", default=None, help="checkpoint tag (None: the one 'latest' names)")
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="dtype of the saved weights")
    export.add_argument("--max-shard-size", default="5GB", help="largest weights file, e.g. 5GB, 500MB")
    export.add_argument("--allow-unverified", action="store_true",
                        help="export a checkpoint without per-tensor checksums (format 1): damaged or substituted "
                        "weights would not be detected")
    export.add_argument("--skip-model-check", action="store_true",
                        help="do not compare the checkpoint's parameter names and shapes with the transformers model "
                        "its config describes: for a model changed after it was built from its config (resized "
                        "embeddings, an added head), from a checkpoint you trust")
    export.set_defaults(func=_export)
    imported = sub.add_parser("import-deepspeed", formatter_class=_FORMATTER,
                              help="convert a DeepSpeed ZeRO-1/2/3 checkpoint into one engine.load_checkpoint resumes",
                              description="Convert a DeepSpeed ZeRO-1/2/3 checkpoint (fp32 masters, Adam moments, "
                              "steps, scheduler, client state) once into an hf_zero checkpoint that "
                              "engine.load_checkpoint(OUT_DIR) resumes at any world size and stage. The files are "
                              "read with torch.load(weights_only=True) and an allow-list of DeepSpeed's classes.")
    imported.add_argument("ds_dir", help="DeepSpeed's save directory (uses its 'latest') or one global_step folder")
    imported.add_argument("out_dir", help="where to write the hf_zero checkpoint (OUT_DIR/<tag> and OUT_DIR/latest)")
    imported.add_argument("--tag", default=None, help="the DeepSpeed tag (None: the one 'latest' names)")
    imported.add_argument("--optimizer-class", choices=["ZeroAdam", "AdamW", "Adam"], default="ZeroAdam",
                          help="ZeroAdam for the config's Adam/AdamW; AdamW or Adam for a torch optimizer passed to "
                          "hf_zero.initialize (the Trainer's)")
    imported.add_argument("--model", default=None, metavar="MODEL",
                          help="a model folder or hub id (its config.json): checks names and shapes and records the "
                          "model, so that hf-zero export can write a Hugging Face folder from the result")
    imported.set_defaults(func=_import_deepspeed)
    _add_dcp(sub)
    estimate = sub.add_parser("estimate", formatter_class=_FORMATTER,
                              help="per-rank memory for model states under ZeRO stages 1-3 and offload",
                              description="Per-rank bytes of parameters, gradients, fp32 master and Adam state "
                              "for each stage, laid out exactly as the engine lays them out (the model is "
                              "built on the meta device from its config), with CPU-offload rows.")
    estimate.add_argument("--model", required=True, help="a model folder or config.json path, or a Hub name")
    estimate.add_argument("--gpus-per-node", type=int, default=1, help="ranks per node")
    estimate.add_argument("--nodes", type=int, default=1, help="nodes")
    estimate.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16", help="compute dtype")
    estimate.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=[0, 1, 2, 3],
                          help="ZeRO stages to show")
    estimate.add_argument("--persistence-threshold", type=int, default=100_000,
                          help="stage3_param_persistence_threshold (DeepSpeed's default)")
    for flag, default, key in (("--reduce-bucket-size", 500_000_000, "reduce_bucket_size"),
                               ("--max-reuse-distance", 1_000_000_000, "stage3_max_reuse_distance"),
                               ("--max-live-parameters", 1_000_000_000, "stage3_max_live_parameters"),
                               ("--prefetch-bucket-size", 50_000_000, "stage3_prefetch_bucket_size")):
        estimate.add_argument(flag, type=int, default=default,
                              help=f"{key}, for the working-memory column (DeepSpeed's default)")
    estimate.add_argument("--shard-group-size", type=int, default=None,
                          help="mics_shard_size (hybrid sharding): shard the states over groups of this many ranks, "
                          "usually --gpus-per-node, and replicate across them (default: shard over all ranks)")
    estimate.add_argument("--hpz-partition-size", type=at_least(1), default=1,
                          help="zero_hpz_partition_size (ZeRO++ hpZ): stage-3 secondary shards over groups of this many "
                          "ranks, usually --gpus-per-node; their memory is in the stage-3 rows' +working")
    estimate.add_argument("--quantized-weights", action="store_true",
                          help="with --simulate: zero_quantized_weights (ZeRO++ qwZ), the stage-3 gathers in int8 blocks")
    estimate.add_argument("--quantized-gradients", action="store_true",
                          help="with --simulate: zero_quantized_gradients (ZeRO++ qgZ), the gradient reduce-scatters "
                          "in 4-bit blocks, inside each node first, then across")
    estimate.add_argument("--simulate", action="store_true",
                          help="also measure one rank of this world: build the model under a live stage-3 config, "
                          "initialize and run one forward+backward+step on this CPU with torch's fake process group "
                          "(values meaningless; memory and time measured), printed beside the stage-3 row")
    estimate.add_argument("--simulate-rank", type=int, default=None,
                          help="the rank --simulate plays, 0 to world - 1 (default: the last, whose shards hold the "
                          "padded tails)")
    estimate.add_argument("--seq", type=at_least(1), default=None,
                          help="tokens per sequence: adds the step's activations, traced on fake tensors, and a "
                          "peak-per-rank table (and is the --simulate step's length, 16 when left out)")
    estimate.add_argument("--micro-batch", type=at_least(1), default=1,
                          help="sequences per rank and step (train_micro_batch_size_per_gpu)")
    estimate.add_argument("--gradient-checkpointing", action="store_true",
                          help="with --seq: the model's activation checkpointing on")
    estimate.add_argument("--sequence-parallel-size", type=at_least(1), default=1,
                          help="with --seq: sequence_parallel_size, each rank holding 1/S of every sequence")
    estimate.add_argument("--tiled-loss-tokens", type=at_least(0), default=0, help="with --seq: tiled_loss_tokens")
    estimate.add_argument("--tiled-mlp-tokens", type=at_least(0), default=0, help="with --seq: tiled_mlp_tokens")
    estimate.set_defaults(func=_estimate)


# [Note: why hf-zero launch exists]
# ``accelerate launch --config_file x.yaml`` rejects unknown top-level yaml keys and its
# ``distributed_type`` is a closed enum (``accelerate.utils.DistributedType``), so a yaml cannot
# carry the ZeRO config. ``hf-zero launch`` takes the ``hf_zero:`` section out, writes the rest
# to a temporary yaml, puts the section into ``HF_ZERO_*`` environment variables (every launcher
# copies the environment to its processes; HfZeroPlugin reads them) and runs ``accelerate
# launch`` with every other argument unchanged, the script run through ``hf_zero.run`` (so a
# plain ``Accelerator()`` in it uses hf_zero). It starts no process itself.
LAUNCH_OPTIONS = ("--zero_config", "--config_file")
CONFIG_ENVS = ("HF_ZERO_CONFIG", "HF_ZERO_CONFIG_FILE", "HF_ZERO_STAGE")  # any one names the run's ZeRO config


def _split_launch_argv(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """``--zero_config`` / ``--config_file`` taken from the launcher part of ``argv`` (before the
    script: the first ``*.py`` token, or the token after ``-m``); the rest unchanged."""
    options: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token.endswith(".py") or token in ("-m", "--module"):
            rest += argv[i:]
            break
        name, eq, value = token.partition("=")
        if name in LAUNCH_OPTIONS:
            if not eq:
                if i + 1 >= len(argv):
                    raise SystemExit(f"hf-zero launch: {name} needs a value")
                value, i = argv[i + 1], i + 1
            options[name.lstrip("-")] = value
        else:
            rest.append(token)
        i += 1
    return options, rest


RUNNER = ["-m", "hf_zero.run"]


def _through_runner(rest: list[str]) -> list[str]:
    """``rest`` with the script run by ``hf_zero.run``, so that a plain ``Accelerator()`` or
    ``Trainer`` in it uses hf_zero ([Note: the runner's Accelerate door]) and a script that ends
    up not using it fails instead of training as plain DDP."""
    for i, token in enumerate(rest):
        if token in ("-m", "--module"):
            if rest[i + 1:i + 2] == ["hf_zero.run"]:
                return rest
            return [*rest[:i], *RUNNER, "-m", *rest[i + 1:]]
        if token.endswith(".py"):
            return [*rest[:i], *RUNNER, *rest[i:]]
    return rest


def _hf_zero_section_env(section: object, yaml_path: str) -> dict[str, str]:
    """The ``hf_zero:`` yaml section as HF_ZERO_* variables; relative config paths are relative
    to the yaml's folder."""
    import os

    from hf_zero.integrations.accelerate import plugin_field_names

    fields = [f for f in plugin_field_names() if f not in ("config", "is_train_batch_min")]
    if not isinstance(section, dict):
        raise SystemExit(f"hf-zero launch: {yaml_path}: hf_zero must be a mapping, e.g. hf_zero: {{config_file: zero3.json}}")
    unknown = sorted(set(section) - {"config_file", *fields})
    if unknown:
        raise SystemExit(f"hf-zero launch: {yaml_path}: unknown hf_zero key(s) {unknown}; "
                         f"expected config_file or one of {fields}")
    env: dict[str, str] = {}
    for key, value in section.items():
        if key == "config_file":
            env["HF_ZERO_CONFIG"] = os.path.join(os.path.dirname(os.path.abspath(yaml_path)), str(value))
        else:
            env["HF_ZERO_STAGE" if key == "zero_stage" else f"HF_ZERO_{key.upper()}"] = str(value).lower() \
                if isinstance(value, bool) else str(value)
    return env


def _launch(argv: list[str]) -> int:
    import os
    import tempfile

    import yaml

    options, rest = _split_launch_argv(argv)
    env = dict(os.environ)
    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    tmp_path = None
    yaml_path = options.get("config_file")
    if yaml_path is not None:
        with open(yaml_path) as f:
            cluster = yaml.safe_load(f) or {}
        section = cluster.pop("hf_zero", None)
        if section is not None:
            env.update(_hf_zero_section_env(section, yaml_path))
            with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="hf_zero_accelerate_", delete=False) as tmp:
                yaml.safe_dump(cluster, tmp)
            tmp_path = yaml_path = tmp.name
        launch += ["--config_file", yaml_path]
    if "zero_config" in options:
        env["HF_ZERO_CONFIG"] = os.path.abspath(options["zero_config"])
    if not any(env.get(n) for n in CONFIG_ENVS):
        print("hf-zero launch: no ZeRO config: add an hf_zero: {config_file: z.json} section to the yaml, "
              "pass --zero_config z.json, or set HF_ZERO_CONFIG", file=sys.stderr)
        return 2
    rest = _through_runner(rest)
    shown = {k: v for k, v in env.items() if k.startswith("HF_ZERO_")}
    print("running:", " ".join(f"{k}={v}" for k, v in shown.items()), " ".join(launch + rest), flush=True)
    try:
        return subprocess.call(launch + rest, env=env)
    finally:
        if tmp_path is not None:
            os.unlink(tmp_path)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, but not for a required option, whose default is never used, nor for
    a default of None (the help says what leaving the option out does), nor for a flag (a
    ``store_true`` is off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default is None or isinstance(action, argparse._StoreTrueAction):
            return action.help
        return super()._get_help_string(action)


_FORMATTER = _Formatter
_LAUNCH_HELP = ("accelerate launch with an hf_zero: section in --config_file (or --zero_config z.json); "
                "every other argument goes to accelerate launch unchanged. With the deepspeed launcher's flags "
                "instead (--num_gpus, --num_nodes, --hostfile, --include/--exclude, --master_addr/--master_port, "
                "--no_ssh --node_rank R), torchrun on each node of this machine, the script's --deepspeed ds.json "
                "read as its ZeRO config")


def _version() -> str:
    # hf_zero/__init__.py imports no torch: [Note: the command imports torch late]
    from hf_zero.version import __version__

    return f"hf-zero {__version__} (python {sys.version.split()[0]})"


def _add_doctor(sub: Any) -> None:
    doctor = sub.add_parser("doctor", formatter_class=_FORMATTER,
                            help="what this machine has (torch, CUDA, NCCL, triton, GPUs, pinned memory), "
                            "then the CUDA suite",
                            description="Print the torch build, CUDA, NCCL, triton, the GPUs and whether pinned "
                            "host memory works, then run the CUDA suite with pytest and print its result and "
                            "duration. Exits non-zero when CUDA is missing or the suite does not pass.")
    doctor.add_argument("--facts-only", action="store_true", help="print the facts and exit 0, without the suite")
    doctor.add_argument("--repo", default=None,
                        help="the hf_zero checkout whose tests/ hold the CUDA suite (default: the one this "
                        "hf_zero was installed from with pip install -e, else the working directory)")
    doctor.set_defaults(func=_doctor)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-zero", description="hf_zero: ZeRO for Hugging Face models")
    parser.add_argument("--version", action="version", version=_version(), help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", formatter_class=_FORMATTER,
                          help="a real multi-process ZeRO training run of a small GPT-2, on CPU unless --device cuda",
                          description="Start `torchrun --standalone` on hf_zero.demo: a real ZeRO run of a small "
                          "GPT-2, with a progress bar and a summary. It runs on CPU over gloo even on a GPU "
                          "machine; --device cuda runs one rank per GPU over NCCL.")
    demo.add_argument("--nproc", type=at_least(1), default=2, help="processes (ranks) to start")
    add_demo_arguments(demo)
    demo.set_defaults(func=_demo, subparser=demo)
    _add_doctor(sub)
    check = sub.add_parser("check-config", formatter_class=_FORMATTER,
                           help="validate a DeepSpeed/hf_zero JSON (or hjson) config",
                           description="Check every key of a DeepSpeed-schema config (JSON, or hjson with comments "
                           "and trailing commas, as DeepSpeed reads) and report every problem at once; \"auto\" "
                           "values are listed, to be filled by the Trainer or Accelerate. Imports no torch.")
    check.add_argument("path", help="the JSON config file")
    check.set_defaults(func=_check_config)
    _add_export_and_estimate(sub)
    launch = sub.add_parser("launch", help=_LAUNCH_HELP, description=_LAUNCH_HELP)
    launch.add_argument("--config_file", help="an accelerate yaml, optionally with an hf_zero: section")
    launch.add_argument("--zero_config", help="a DeepSpeed-style JSON config (instead of the yaml section)")
    _add_deepspeed_launcher_flags(launch)
    launch.add_argument("script_and_args", nargs=argparse.REMAINDER,
                        help="accelerate launch options, the script and its arguments")
    return parser


def _add_deepspeed_launcher_flags(launch: argparse.ArgumentParser) -> None:
    """The deepspeed launcher's flags hf_zero.launcher takes, for ``--help`` (``main`` hands the
    command line to the launcher before any parsing)."""
    from hf_zero.launcher import FLAG_HELP, SWITCHES, VALUE_FLAGS

    group = launch.add_argument_group("the deepspeed launcher's flags (instead of accelerate's; docs/deepspeed-migration.md)")
    for dest, help_text in FLAG_HELP.items():
        names = [flag for flag, d in {**VALUE_FLAGS, **SWITCHES}.items() if d == dest]
        names.sort(key=lambda n: (not n.startswith("--"), n))
        if dest in SWITCHES.values():
            group.add_argument(*names, dest=f"ds_{dest}", action="store_true", help=help_text)
        else:
            metavar = {"hostfile": "PATH", "include": "HOSTS", "exclude": "HOSTS", "master_addr": "HOST"}.get(dest, "N")
            group.add_argument(*names, dest=f"ds_{dest}", metavar=metavar, help=help_text)


# [Note: one line per expected failure]
# What a command's input or its machine can make go wrong (a file it cannot read, a full disk, a
# state it cannot convert, input nested past Python's recursion limit, input too large for memory)
# ends the command with one line on stderr naming the command and the cause, and exit status 1;
# an output folder the command created and left empty is removed. Any other exception is a bug
# in hf_zero and keeps its traceback.
_EXPECTED_FAILURES = (OSError, ValueError, RuntimeError, NotImplementedError, RecursionError, MemoryError)
_WHY = {RecursionError: "the input is nested too deeply to read", MemoryError: "the input is too large to read"}


def _ours(error: BaseException) -> bool:
    return type(error).__module__.startswith("hf_zero")


def _failure_line(command: str, error: BaseException) -> str:
    reason = _WHY.get(type(error)) or " ".join(str(error).split()) or type(error).__name__
    kind = "" if _ours(error) else f"{type(error).__name__}: "
    return f"hf-zero {command}: {kind}{reason}"[:2000]


def _new_output_folder(args: argparse.Namespace) -> str | None:
    out = getattr(args, "out_dir", None)
    return None if out is None or os.path.lexists(out) else os.path.abspath(out)


def _remove_if_empty(folder: str | None) -> None:
    if folder is not None and os.path.isdir(folder) and not os.path.islink(folder) and not os.listdir(folder):
        os.rmdir(folder)


def _deepspeed_launch(argv: list[str]) -> int:
    import os

    from hf_zero import launcher
    from hf_zero.run import extract_config_flags

    try:
        found, _ = extract_config_flags(launcher.parse_args(argv)[1])
        if not found and not any(os.environ.get(n) for n in CONFIG_ENVS):
            raise launcher.LaunchError("no ZeRO config: give the script --deepspeed ds.json (or --zero_config ds.json), "
                                       "or set HF_ZERO_CONFIG")
        return launcher.launch(argv, dict(os.environ))
    except launcher.LaunchError as error:
        print(f"hf-zero launch: {error}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"] and argv[1:] not in (["--help"], ["-h"]):
        from hf_zero.launcher import uses_deepspeed_flags

        if uses_deepspeed_flags(argv[1:]):  # deepspeed's launcher's flags: torchrun per node
            return _deepspeed_launch(argv[1:])
        return _launch(argv[1:])  # everything after it belongs to accelerate launch or the script
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv[1:]
    new_folder = _new_output_folder(args)
    try:
        code = args.func(args, [])
    except _EXPECTED_FAILURES as error:  # [Note: one line per expected failure]
        if isinstance(error, RuntimeError) and not isinstance(error, (NotImplementedError, RecursionError)) \
                and not _ours(error):
            raise  # torch's or another library's RuntimeError: a bug to see whole
        print(_failure_line(argv[0], error), file=sys.stderr)
        code = 1
    if code:
        _remove_if_empty(new_folder)
    return code


if __name__ == "__main__":
    sys.exit(main())
