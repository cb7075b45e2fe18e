#!/usr/bin/env python
"""Train a causal LM or a sequence classifier with the Hugging Face Trainer (run_clm style).

A plain Transformers script: it never imports hf_zero. Run it with DDP as usual, or on hf_zero's
ZeRO engine through the runner, which adds ``--zero_config``:

    torchrun --nproc_per_node 2 recipes/examples/run_trainer.py --model_name_or_path MODEL \\
        --train_file train.jsonl --output_dir out --do_train --do_eval

    torchrun --nproc_per_node 2 -m hf_zero.run recipes/examples/run_trainer.py \\
        --zero_config recipes/examples/zero3.json --model_name_or_path MODEL \\
        --train_file train.jsonl --output_dir out --do_train --do_eval

On a machine without GPUs add ``--use_cpu``, so that the processes join over gloo (without it
the Trainer stops and asks for it), e.g. a 2-step smoke test on random data:

    torchrun --nproc_per_node 2 -m hf_zero.run recipes/examples/run_trainer.py \\
        --zero_config recipes/examples/zero3.json --model_name_or_path MODEL --use_cpu \\
        --synthetic_train_samples 16 --max_steps 2 --output_dir out --do_train

Data: JSON lines with ``input_ids`` (a list of token ids) and, for sequence classification,
``label``. Without files, ``--synthetic_train_samples N`` / ``--synthetic_eval_samples N`` make
random token sequences from the model's vocabulary (handy for smoke tests).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
from datasets import Dataset, load_dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "A model folder or Hub id."})
    task: str = field(default="causal_lm", metadata={"help": "causal_lm or sequence_classification"})


@dataclass
class DataTrainingArguments:
    train_file: str | None = field(default=None, metadata={"help": "JSON lines: input_ids[, label]"})
    validation_file: str | None = field(default=None, metadata={"help": "JSON lines: input_ids[, label]"})
    synthetic_train_samples: int = field(default=0, metadata={"help": "random training sequences"})
    synthetic_eval_samples: int = field(default=0, metadata={"help": "random evaluation sequences"})
    block_size: int = field(default=12, metadata={"help": "length of the synthetic sequences"})
    data_seed_synthetic: int = field(default=1234, metadata={"help": "seed of the synthetic data"})


def synthetic_rows(samples: int, vocab: int, block_size: int, num_labels: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (samples, block_size), generator=generator)
    return [{"input_ids": row.tolist(), "label": int(row[0]) % num_labels} for row in ids]


def load_split(path: str | None, samples: int, seed: int, config, data_args) -> Dataset | None:
    if path is not None:
        return load_dataset("json", data_files={"split": path})["split"]
    if samples <= 0:
        return None
    num_labels = getattr(config, "num_labels", 2)
    return Dataset.from_list(synthetic_rows(samples, config.vocab_size, data_args.block_size, num_labels, seed))


def to_features(dataset: Dataset, task: str) -> Dataset:
    def convert(example: dict) -> dict:
        ids = example["input_ids"]
        labels = ids if task == "causal_lm" else example["label"]
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}

    return dataset.map(convert, remove_columns=dataset.column_names)


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(level=logging.INFO if training_args.should_log else logging.WARNING)

    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
    set_seed(training_args.seed)

    config = AutoConfig.from_pretrained(model_args.model_name_or_path)
    model_cls = AutoModelForCausalLM if model_args.task == "causal_lm" else AutoModelForSequenceClassification
    model = model_cls.from_pretrained(model_args.model_name_or_path)

    seed = data_args.data_seed_synthetic
    train_dataset = load_split(data_args.train_file, data_args.synthetic_train_samples, seed, config, data_args)
    eval_dataset = load_split(data_args.validation_file, data_args.synthetic_eval_samples, seed + 1, config, data_args)
    train_dataset = to_features(train_dataset, model_args.task) if train_dataset is not None else None
    eval_dataset = to_features(eval_dataset, model_args.task) if eval_dataset is not None else None

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval or training_args.do_predict else None,
        data_collator=default_data_collator,
    )

    if training_args.do_train:
        checkpoint = training_args.resume_from_checkpoint or last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        if model_args.task == "causal_lm":
            metrics["perplexity"] = math.exp(metrics["eval_loss"]) if metrics["eval_loss"] < 50 else float("inf")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    if training_args.do_predict:
        output = trainer.predict(eval_dataset, metric_key_prefix="predict")
        trainer.log_metrics("predict", output.metrics)
        trainer.save_metrics("predict", output.metrics)
        if trainer.is_world_process_zero():
            logits = output.predictions[0] if isinstance(output.predictions, tuple) else output.predictions
            np.save(os.path.join(training_args.output_dir, "predict_logits.npy"), logits)
            with open(os.path.join(training_args.output_dir, "predict_inputs.json"), "w") as f:
                json.dump([list(ids) for ids in eval_dataset["input_ids"]], f)


if __name__ == "__main__":
    main()
