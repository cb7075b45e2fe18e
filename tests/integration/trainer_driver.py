"""Runs on every rank of a real 2-process torchrun launch: several Trainer jobs in one process.

Launching is the slow part (importing transformers takes seconds), so one launch runs a list of
jobs (a JSON plan) one after the other and every rank writes every job's result. Jobs:

- ``script``: the example script recipes/examples/run_trainer.py, unmodified, through
  ``hf_zero.run`` (so ``--zero_config`` and ``enable()`` work exactly as on the command line), or
  as a plain script (the DDP baseline) when the job has no ``zero_config``;
- ``explicit``: ``HfZeroTrainingArguments`` + ``HfZeroTrainer`` used directly: evaluate before
  training (a ZeRO-3 inference engine that training then replaces), train, evaluate, save, and
  ``generate`` with each rank stopping at a different length;
- ``seq2seq``: an unmodified ``Seq2SeqTrainer`` predicting with generation under stage 3;
- ``best``: ``load_best_model_at_end`` brings back an older checkpoint's weights;
- ``resolve``: the "auto" resolution at world size 2, against transformers' own code;
- ``muon``: Muon with AdamW for the rest, from the config's section under ``HfZeroTrainer`` or
  passed to transformers' Trainer under DDP;
- ``grad_norm``: ``HfZeroTrainer`` (or transformers' Trainer under DDP) recording, for every
  optimizer step, the full weights the step starts from and every rank's micro-batches, from
  which the test recomputes the step's gradient norm in fp64 (test_trainer_grad_norm.py).

Run through the runner, as users run a script:
``torchrun --standalone --nproc_per_node 2 -m hf_zero.run -m tests.integration.trainer_driver PLAN.json``
Each rank writes its results next to the plan's ``out`` (see :func:`rank_results_path`).
(the DDP baseline jobs first undo the runner's patches, so they run transformers unmodified).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import runpy
import sys
import traceback
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "recipes", "examples", "run_trainer.py")
CONFIG_ENV = "HF_ZERO_CONFIG"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def log_history(output_dir: str) -> dict[str, Any]:
    with open(os.path.join(output_dir, "trainer_state.json")) as f:
        history = json.load(f)["log_history"]
    steps = [h for h in history if "loss" in h]
    return {"loss": [h["loss"] for h in steps], "grad_norm": [h["grad_norm"] for h in steps],
            "learning_rate": [h["learning_rate"] for h in steps], "step": [h["step"] for h in steps]}


class _CompiledUnits(logging.Handler):
    """Counts the units ``engine.compile()`` reports compiling (its INFO line)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("hf_zero: compiled the forward of"):
            self.count += record.args[0]


def _wait_for_main_process_files() -> None:
    """The script's metrics and state files are written by rank 0 alone, after its last collective:
    another rank that reads them as soon as its own script returns can find them half written."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def run_script(job: dict[str, Any]) -> dict[str, Any]:
    """The example script, as ``python -m hf_zero.run SCRIPT --zero_config ...`` or plain."""
    argv = list(job["argv"])
    os.environ.pop(CONFIG_ENV, None)
    compiled, hf_zero_logger = _CompiledUnits(), logging.getLogger("hf_zero")
    level = hf_zero_logger.level
    hf_zero_logger.addHandler(compiled)
    hf_zero_logger.setLevel(min(level or logging.INFO, logging.INFO))
    if job.get("zero_config"):
        from hf_zero import run

        run.main([SCRIPT, *argv, "--zero_config", job["zero_config"]])
        os.environ.pop(CONFIG_ENV, None)
    else:  # the DDP baseline: Trainer and TrainingArguments exactly as transformers ships them
        from hf_zero.integrations.transformers import disable

        disable()
        sys.argv = [SCRIPT, *argv]
        runpy.run_path(SCRIPT, run_name="__main__")
    hf_zero_logger.removeHandler(compiled)
    hf_zero_logger.setLevel(level)
    _wait_for_main_process_files()
    output_dir = argv[argv.index("--output_dir") + 1]
    result: dict[str, Any] = {"output_dir": output_dir, "compiled_units": compiled.count}
    if "--do_train" in argv:
        result.update(log_history(output_dir))
    metrics_file = os.path.join(output_dir, "eval_results.json")
    if os.path.exists(metrics_file):
        with open(metrics_file) as f:
            result["eval_loss"] = json.load(f)["eval_loss"]
    return result


def _tiny_datasets(model_dir: str, train: int, evaluate: int) -> tuple[Any, Any]:
    """The example script's synthetic data, built the same way."""
    from datasets import Dataset
    from transformers import AutoConfig

    example = runpy.run_path(SCRIPT)  # its functions, without running main()
    config = AutoConfig.from_pretrained(model_dir)
    rows = example["synthetic_rows"]
    train_rows = rows(train, config.vocab_size, 12, 2, 1234)
    eval_rows = rows(evaluate, config.vocab_size, 12, 2, 1235)
    to_features = example["to_features"]
    return (to_features(Dataset.from_list(train_rows), "causal_lm"),
            to_features(Dataset.from_list(eval_rows), "causal_lm"))


def _explicit_args(job: dict[str, Any], **overrides: Any) -> Any:
    from hf_zero.integrations.transformers import HfZeroTrainingArguments

    kwargs = dict(job["training_args"])
    kwargs.update(overrides)
    return HfZeroTrainingArguments(zero_config=job["zero_config"], **kwargs)


def run_explicit(job: dict[str, Any]) -> dict[str, Any]:
    """Evaluate (inference engine) -> train (training engine) -> evaluate -> save -> generate."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hf_zero.integrations.transformers import HfZeroTrainer

    args = _explicit_args(job)
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"])
    loaded_on_meta = all(p.is_meta for p in model.parameters())
    train_dataset, eval_dataset = _tiny_datasets(job["model_dir"], job["train_samples"], job["eval_samples"])
    trainer = HfZeroTrainer(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    trainer.save_model(job["save_dir"])
    trainer.save_state()

    # Generation under stage 3: each rank stops at its own length; synced_gpus keeps the
    # finished rank running forwards so the other rank's unit gathers complete.
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(100 + rank)
    prompt = torch.randint(0, model.config.vocab_size, (1, 5), generator=generator)
    max_new_tokens = job["max_new_tokens"][rank]
    trainer.model.eval()
    with torch.no_grad():
        out = trainer.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                                     do_sample=False, pad_token_id=0, eos_token_id=None)
    generations = [None] * dist.get_world_size()
    dist.all_gather_object(generations, {"prompt": prompt[0].tolist(), "tokens": out[0].tolist(),
                                         "max_new_tokens": max_new_tokens})
    history = log_history(args.output_dir)
    return {"eval_loss_before": before, "eval_loss_after": after, "generations": generations,
            "save_dir": job["save_dir"],
            "loaded_on_meta": loaded_on_meta, "fsdp_flag": bool(getattr(trainer.model, "_is_fsdp_managed_module", False)),
            **history}


def run_seq2seq(job: dict[str, Any]) -> dict[str, Any]:
    """An unmodified ``Seq2SeqTrainer`` under :func:`enable` (``HF_ZERO_CONFIG`` set): predict
    with generation under stage 3 before any training (a ZeRO inference engine); transformers
    passes ``synced_gpus`` itself because the model carries ``_is_fsdp_managed_module``."""
    from transformers import AutoModelForCausalLM, Seq2SeqTrainer, Seq2SeqTrainingArguments

    from hf_zero.integrations.transformers import enable

    enable()
    os.environ[CONFIG_ENV] = job["zero_config"]
    try:
        args = Seq2SeqTrainingArguments(**job["training_args"])
    finally:
        os.environ.pop(CONFIG_ENV, None)
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"])
    model.config.pad_token_id = model.generation_config.pad_token_id = 0  # the tiny model has none
    _, eval_dataset = _tiny_datasets(job["model_dir"], 2, job["eval_samples"])
    trainer = Seq2SeqTrainer(model=model, args=args, eval_dataset=eval_dataset)
    output = trainer.predict(eval_dataset, max_length=job["max_length"])
    return {"tokens": output.predictions.tolist(), "inputs": [list(x) for x in eval_dataset["input_ids"]],
            "zero": args.hf_zero_config is not None}


def run_best(job: dict[str, Any]) -> dict[str, Any]:
    """``load_best_model_at_end`` with a metric that is best at the first evaluation (it counts
    the evaluations down), so the final weights must be brought back from an early checkpoint."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hf_zero.integrations._weights import engine_of, gather_full_state_dict
    from hf_zero.integrations.transformers import HfZeroTrainer

    args = _explicit_args(job)
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"])
    train_dataset, eval_dataset = _tiny_datasets(job["model_dir"], job["train_samples"], job["eval_samples"])
    evaluations = []

    def countdown(_: Any) -> dict[str, float]:
        evaluations.append(1)
        return {"countdown": -float(len(evaluations))}

    trainer = HfZeroTrainer(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                            compute_metrics=countdown)
    trainer.train()
    best = trainer.state.best_model_checkpoint
    final = gather_full_state_dict(engine_of(trainer.model), dtype=torch.float32)
    if _rank() != 0:
        return {}
    checkpoints = sorted(d for d in os.listdir(args.output_dir) if d.startswith("checkpoint-"))

    def diff_to(folder: str) -> float:
        saved = load_file(os.path.join(folder, "model.safetensors"))
        return max(float((final[k] - saved[k]).abs().max()) for k in saved)

    return {"best": os.path.basename(best), "checkpoints": checkpoints, "max_diff_to_best": diff_to(best),
            "max_diff_to_last": diff_to(os.path.join(args.output_dir, checkpoints[-1])),
            "engine_checkpoint": any(n.startswith("global_step") for n in os.listdir(best))}


def run_resolve(job: dict[str, Any]) -> dict[str, Any]:
    from tests.integration.resolution import hf_zero_resolution, transformers_resolution

    return {"hf_zero": hf_zero_resolution(job["config"], job["training_args"], job["hidden_size"], job["steps"]),
            "transformers": transformers_resolution(job["config"], job["training_args"], job["hidden_size"],
                                                    job["steps"])}


def run_muon(job: dict[str, Any]) -> dict[str, Any]:
    """Muon for the hidden 2-D weights and AdamW for the rest, on learnable data: with a
    ``zero_config``, ``HfZeroTrainer`` and the config's Muon section; without, transformers'
    Trainer under DDP given hf_zero's MuonWithAuxAdamW as a plain torch optimizer. Both run
    the Newton-Schulz iteration in fp32 (see tests.distributed.scenarios.fp32_newton_schulz)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from hf_zero.engine.optim.muon import MuonWithAuxAdamW, muon_param_groups
    from tests.distributed.scenarios import use_fp32_newton_schulz
    from tests.tiny_models import learnable_batch

    rows = learnable_batch(0, job["train_samples"]).tolist()
    train = Dataset.from_list([{"input_ids": r, "attention_mask": [1] * len(r), "labels": r} for r in rows])
    torchs = use_fp32_newton_schulz()
    try:
        model = AutoModelForCausalLM.from_pretrained(job["model_dir"])
        if job.get("zero_config"):
            from hf_zero.integrations.transformers import HfZeroTrainer

            args = _explicit_args(job)
            trainer = HfZeroTrainer(model=model, args=args, train_dataset=train)
        else:
            from hf_zero.integrations.transformers import disable

            disable()
            args = TrainingArguments(**job["training_args"])
            muon = dict(lr=args.learning_rate, weight_decay=args.weight_decay, momentum=0.95, nesterov=True, ns_steps=5)
            adamw = dict(lr=job["adam_lr"], weight_decay=args.weight_decay, betas=(args.adam_beta1, args.adam_beta2),
                         eps=args.adam_epsilon)
            optimizer = MuonWithAuxAdamW(muon_param_groups(model, muon, adamw))
            trainer = Trainer(model=model, args=args, train_dataset=train, optimizers=(optimizer, None))
        trainer.train()
        trainer.save_state()
    finally:
        torch.optim._muon._zeropower_via_newtonschulz = torchs
    _wait_for_main_process_files()
    return log_history(args.output_dir)


def run_grad_norm(job: dict[str, Any]) -> dict[str, Any]:
    """A Trainer run that keeps what an fp64 recomputation of each step's gradient norm needs:
    rank 0 writes the full fp32 weights each optimizer step starts from to
    ``<record_dir>/step<N>.pt`` (gathered from the shards under hf_zero), and every
    rank's micro-batches of each step, in the order they ran, with the ``num_items_in_batch``
    the Trainer divided their loss by, go to ``<record_dir>/batches.json``
    (``[step][rank][micro-batch]`` -> column -> rows)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from hf_zero.integrations._weights import engine_of, gather_full_state_dict

    if job.get("zero_config"):
        from hf_zero.integrations.transformers import HfZeroTrainer as base

        args = _explicit_args(job)
    else:  # transformers' Trainer exactly as shipped, under DDP
        from hf_zero.integrations.transformers import disable

        disable()
        base, args = Trainer, TrainingArguments(**job["training_args"])
    record_dir, batches = job["record_dir"], []
    os.makedirs(record_dir, exist_ok=True)

    class RecordingTrainer(base):  # type: ignore[misc, valid-type]
        def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
            record = {k: v.tolist() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
            record["num_items_in_batch"] = None if num_items_in_batch is None else float(num_items_in_batch)
            batches[-1].append(record)
            return super().training_step(model, inputs, num_items_in_batch)

    class WeightsAtStepBegin(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            batches.append([])
            engine = engine_of(model)
            if engine is not None:  # collective: every rank gathers, rank 0 keeps the result
                weights = gather_full_state_dict(engine, dtype=torch.float32)
            else:
                weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            if _rank() == 0:  # torch.save keeps tied weights one tensor, as the model has them
                torch.save(weights, os.path.join(record_dir, f"step{len(batches)}.pt"))

    syncs = _host_syncs_callback()
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"])
    train_dataset, _ = _tiny_datasets(job["model_dir"], job["train_samples"], 2)
    trainer = RecordingTrainer(model=model, args=args, train_dataset=train_dataset,
                               callbacks=[WeightsAtStepBegin(), syncs])
    trainer.train()
    trainer.save_state()
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, batches)
    if _rank() == 0:
        with open(os.path.join(record_dir, "batches.json"), "w") as f:
            json.dump([[rank_batches[step] for rank_batches in per_rank] for step in range(len(batches))], f)
    _wait_for_main_process_files()
    return {"record_dir": record_dir, "host_syncs": syncs.per_step, **log_history(args.output_dir)}


def _host_syncs_callback() -> Any:
    from transformers import TrainerCallback

    from hf_zero.execution.host_sync import HostSyncCounter
    from hf_zero.integrations._weights import engine_of

    class HostSyncsOfEachStep(TrainerCallback):
        """hf_zero's own host synchronisations ([Note: host synchronisations]) in each optimizer
        step of the Trainer under hf_zero, from its ``on_step_begin`` (after the callbacks before
        this one) to its ``on_step_end``: the micro-batches' forward and backward, the clipping, the
        step, and what the Trainer asks of it (``optimizer_step_was_skipped``, the learning rate).
        The log that follows reads the norm, which is the Trainer's read, after ``on_step_end``."""

        def __init__(self) -> None:
            self.counter: HostSyncCounter | None = None
            self.per_step: list[dict[str, int]] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            engine = engine_of(model)
            if engine is not None:
                self.counter = HostSyncCounter(engine.device).__enter__()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.counter is not None:
                self.counter.__exit__(None, None, None)
                self.per_step.append(self.counter.by_place())
                self.counter = None

    return HostSyncsOfEachStep()


JOBS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "grad_norm": run_grad_norm,
    "muon": run_muon,
    "script": run_script,
    "explicit": run_explicit,
    "best": run_best,
    "seq2seq": run_seq2seq,
    "resolve": run_resolve,
}


def run_plan(plan_path: str, run_job: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Every job of the plan in turn; a job that raises is recorded and the next one runs."""
    with open(plan_path) as f:
        plan = json.load(f)
    results: dict[str, Any] = {}
    for job in plan["jobs"]:
        try:
            results[job["name"]] = run_job(copy.deepcopy(job))
        except (Exception, SystemExit):  # record it (a script's argparse exits) and go on to the next job
            results[job["name"]] = {"error": traceback.format_exc()[-6000:]}
            os.environ.pop(CONFIG_ENV, None)
    # Every rank writes its own results: a job that fails on one rank only must fail its test.
    with open(rank_results_path(plan["out"], _rank()), "w") as f:
        json.dump(results, f, indent=1)


def main(plan_path: str) -> None:
    run_plan(plan_path, lambda job: JOBS[job["kind"]](job))


def rank_results_path(out: str, rank: int) -> str:
    return out if rank == 0 else f"{out}.rank{rank}"


if __name__ == "__main__":
    main(sys.argv[1])
