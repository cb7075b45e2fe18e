"""Tiny Hugging Face models built from configs (no downloads), shared by the tests.

Sizes are chosen so that parameter and group sizes are not divisible by 2 or 3: padding and
uneven shards are exercised on purpose."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 97
SEQ = 12


def tiny_gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=15, n_layer=2, n_head=3,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
    )
    return GPT2LMHeadModel(config).float()


def tiny_llama(seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).float()


def tiny_bert_classifier(seed: int = 0) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=37, max_position_embeddings=32, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config).float()


BUILDERS = {"gpt2": tiny_gpt2, "llama": tiny_llama, "bert": tiny_bert_classifier}


def tiny_llama_wide_vocab(seed: int = 0) -> torch.nn.Module:
    """tiny_llama with a vocabulary of 65537 (the batches use its first 16 tokens): the embedding
    unit and the root unit (lm_head) hold groups of 1.05M elements. Wide layers would not do: at
    the scenarios' learning rate a hidden size of 320 diverges."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=65_537, hidden_size=16, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).float()


# What the distributed scenarios can build by name: the three models every integration test runs
# (BUILDERS), and models only some scenarios need.
SCENARIO_BUILDERS = {**BUILDERS, "llama_wide_vocab": tiny_llama_wide_vocab}


def batch_for_step(step: int, rows: int, seed: int = 1234) -> torch.Tensor:
    """The global batch of a step: ``rows`` sequences of token ids, the same on every rank."""
    generator = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randint(0, VOCAB, (rows, SEQ), generator=generator)


def freeze_some(model: nn.Module) -> None:
    """Freeze the position embeddings / first layer norms: frozen parameters get no gradient and
    no optimizer state, but still take part in forward."""
    for name, param in model.named_parameters():
        if "wpe" in name or name.endswith("ln_1.weight") or "input_layernorm" in name:
            param.requires_grad_(False)


# The learnable data: a sparse Markov chain over the first ACTIVE_VOCAB tokens (each token has 4
# possible successors; hf_zero.demo's data), so a few optimizer steps move the loss far from
# ln(VOCAB) toward ln(ACTIVE_VOCAB) and below, a signal much larger than any parity tolerance.
ACTIVE_VOCAB = 16


def learnable_batch(step: int, rows: int, seed: int = 1234) -> torch.Tensor:
    """The global batch of a step, learnable: ``rows`` Markov sequences, the same on every rank."""
    from hf_zero.demo import markov_batch, markov_successors

    return markov_batch(markov_successors(ACTIVE_VOCAB, seed), rows, SEQ, seed * 1000 + step)
