"""A causal-LM Trainer script in the shape of transformers' examples/pytorch/language-modeling/run_clm.py,
unmodified for any engine: the model is loaded with the keywords run_clm passes to
``from_pretrained``; the data are random token blocks (no download). Run it as run_clm is run:

    torchrun --nproc_per_node 2 clm_script.py --model_name_or_path M --output_dir O --do_train ...
    torchrun --nproc_per_node 2 -m hf_zero.run clm_script.py --zero_config zero3.json ...
    torchrun --nproc_per_node 2 clm_script.py --deepspeed ds_zero3.json ...
"""

from dataclasses import dataclass, field
from typing import Optional

import torch
from datasets import Dataset
from transformers import (AutoConfig, AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments,
                          default_data_collator, set_seed)


@dataclass
class ModelArguments:
    model_name_or_path: str
    cache_dir: Optional[str] = None
    model_revision: str = "main"
    token: Optional[str] = None
    trust_remote_code: bool = False
    torch_dtype: Optional[str] = field(default=None, metadata={"choices": ["auto", "bfloat16", "float16", "float32"]})
    low_cpu_mem_usage: bool = False


@dataclass
class DataArguments:
    train_samples: int = 64
    block_size: int = 128
    data_seed_synthetic: int = 1234


def main() -> None:
    model_args, data_args, training_args = HfArgumentParser(
        (ModelArguments, DataArguments, TrainingArguments)).parse_args_into_dataclasses()
    set_seed(training_args.seed)
    config = AutoConfig.from_pretrained(model_args.model_name_or_path, cache_dir=model_args.cache_dir,
                                        revision=model_args.model_revision, token=model_args.token,
                                        trust_remote_code=model_args.trust_remote_code)
    torch_dtype = (model_args.torch_dtype if model_args.torch_dtype in ["auto", None]
                   else getattr(torch, model_args.torch_dtype))
    model = AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path,
        from_tf=bool(".ckpt" in model_args.model_name_or_path),
        config=config,
        cache_dir=model_args.cache_dir,
        revision=model_args.model_revision,
        token=model_args.token,
        trust_remote_code=model_args.trust_remote_code,
        torch_dtype=torch_dtype,
        low_cpu_mem_usage=model_args.low_cpu_mem_usage,
    )
    generator = torch.Generator().manual_seed(data_args.data_seed_synthetic)
    ids = torch.randint(0, config.vocab_size, (data_args.train_samples, data_args.block_size), generator=generator)
    train_dataset = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(),
                                       "labels": ids.tolist()})
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset,
                      data_collator=default_data_collator)
    trainer.train()
    trainer.save_model()
    trainer.save_state()


if __name__ == "__main__":
    main()
