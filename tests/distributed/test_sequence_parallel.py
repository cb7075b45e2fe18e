"""Ulysses sequence parallelism (``sequence_parallel_size``) equals training on whole sequences.

World 4 runs as 2 data x 2 sequence ranks and as 4 sequence ranks, at stages 1-3, against one
process training the same model on the full sequences with torch's AdamW: every step's loss
and the final parameters. The models use grouped-query attention with fewer key/value heads than
ranks (repeated) and with as many (split), rotary positions, sdpa and eager attention, and a
sequence length that 4 does not divide (padded).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.distributed.launch import run_distributed

STEPS = 6
ROWS = 2  # per data-parallel group
SEQ = 14  # padded to 16 at S = 4
VOCAB = 61
LR = 2e-2


def _model(kind: str, attn: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    torch.manual_seed(0)
    if kind == "llama":  # 4 query heads, 2 key/value heads
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=23, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    else:  # qwen2: 4 query heads, 1 key/value head
        config = Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=23, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                             use_sliding_window=False)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).float()


def _batch(step: int, groups: int) -> torch.Tensor:
    """Learnable rows (a sparse Markov chain over 16 tokens): the loss falls well past the tolerances."""
    from hf_zero.demo import markov_batch, markov_successors

    return markov_batch(markov_successors(16, 1234), ROWS * groups, SEQ, 100 + step)


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    # SGD sees any error in the gradient's scale (Adam divides most of one away).
    return torch.optim.SGD(params, lr=0.5) if kind == "sgd" else torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def _train_sequence_parallel(kind: str, attn: str, stage: int, size: int, optim: str) -> dict[str, Any]:
    import torch.distributed as dist

    import hf_zero

    model = _model(kind, attn)
    config = {
        "train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage}, "sequence_parallel_size": size, "gradient_clipping": 1.0,
    }
    engine, _, loader, _ = hf_zero.initialize(model=model, config=config, optimizer=_optimizer(optim, model.parameters()),
                                              training_data=list(range(8)))
    losses = []
    for step in range(STEPS):
        rows = _batch(step, engine.data_parallel_world_size)
        mine = rows[engine.data_parallel_rank * ROWS:(engine.data_parallel_rank + 1) * ROWS]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    with engine.gathered_parameters():
        params = {n: p.detach().clone().tolist() for n, p in model.named_parameters()}
    sampler = loader.sampler
    info = {"dp": engine.data_parallel_world_size, "dp_rank": engine.data_parallel_rank,
            "train_batch_size": engine.train_batch_size(),
            "sampler": [getattr(sampler, "num_replicas", 1), getattr(sampler, "rank", 0)]}
    reference = _train_whole(kind, attn, engine.data_parallel_world_size, optim) if dist.get_rank() == 0 else None
    return {"losses": losses, "params": params, "info": info, "reference": reference}


def _train_whole(kind: str, attn: str, groups: int, optim: str) -> dict[str, Any]:
    model = _model(kind, attn)
    optimizer = _optimizer(optim, model.parameters())
    losses = []
    for step in range(STEPS):
        rows = _batch(step, groups)
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {n: p.detach().tolist() for n, p in model.named_parameters()}}


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(float((torch.tensor(a[n]) - torch.tensor(b[n])).abs().max()) for n in a)


@pytest.mark.parametrize("kind,attn,stage,size,optim", [
    ("llama", "sdpa", 3, 2, "adamw"),
    ("llama", "sdpa", 2, 4, "adamw"),
    ("qwen2", "sdpa", 1, 2, "adamw"),
    ("qwen2", "sdpa", 3, 4, "sgd"),
    ("llama", "eager", 3, 4, "adamw"),
])
def test_sequence_parallel_equals_whole_sequences(kind: str, attn: str, stage: int, size: int, optim: str) -> None:
    results = run_distributed(_train_sequence_parallel, 4, kind, attn, stage, size, optim)
    reference = results[0]["reference"]
    groups = 4 // size
    assert [r["info"]["dp"] for r in results] == [groups] * 4
    assert [r["info"]["dp_rank"] for r in results] == [rank // size for rank in range(4)]
    assert results[0]["info"]["train_batch_size"] == ROWS * groups
    # training_data= is sharded over the data-parallel ranks: a group's ranks read the same samples
    assert [r["info"]["sampler"] for r in results] == [[groups, rank // size] if groups > 1 else [1, 0]
                                                        for rank in range(4)]
    for rank, result in enumerate(results):  # the ranks of a group hold the group's loss
        assert result["losses"] == results[rank - rank % size]["losses"]
    mean = [sum(results[g * size]["losses"][s] for g in range(groups)) / groups for s in range(STEPS)]
    assert reference["losses"][-1] < reference["losses"][0] - 0.1  # the signal the tolerances sit under
    for ours, theirs in zip(mean, reference["losses"]):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs), (mean, reference["losses"])
    for result in results:
        assert _max_diff(result["params"], reference["params"]) < 2e-5
    moved = _max_diff(reference["params"], _initial_params(kind, attn))
    assert moved > 100 * 2e-5


def _initial_params(kind: str, attn: str) -> dict[str, Any]:
    return {n: p.detach().tolist() for n, p in _model(kind, attn).named_parameters()}


def _refusals_and_eval() -> dict[str, Any]:
    import torch.distributed as dist

    import hf_zero

    model = _model("llama")
    config = {"train_micro_batch_size_per_gpu": ROWS, "zero_optimization": {"stage": 3}, "sequence_parallel_size": 2}
    engine, _, _, _ = hf_zero.initialize(model=model, config=config, optimizer=_optimizer("adamw", model.parameters()))
    found: dict[str, Any] = {}
    rows = _batch(0, 1)
    mine = rows + dist.get_rank()  # a sampler over all ranks: each rank of the group gets other rows
    try:
        engine(input_ids=mine, labels=mine)
    except ValueError as exc:
        found["different"] = str(exc)
    engine.sequence_parallel._checked = False  # the first-batch check, once more
    mask = torch.ones_like(rows)
    mask[:, :2] = 0  # padding on the left
    try:
        engine(input_ids=rows, attention_mask=mask, labels=rows)
    except ValueError as exc:
        found["left"] = str(exc)
    engine.eval()  # evaluation runs whole sequences on every rank, as without sequence parallelism
    with torch.no_grad():
        logits = engine(input_ids=rows).logits
    reference = _model("llama")
    reference.eval()
    with torch.no_grad():
        found["eval_diff"] = float((logits - reference(input_ids=rows).logits).abs().max())
    found["eval_shape"] = list(logits.shape)
    engine.train()  # one step, saved, resumed without sequence parallelism: the states do not depend on S
    engine.backward(engine(input_ids=rows, labels=rows).loss)
    engine.step()
    folder = os.environ["SP_CHECKPOINT_DIR"]
    engine.save_checkpoint(folder, tag="sp")
    with engine.gathered_parameters():
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain = _model("llama")
    resumed, _, _, _ = hf_zero.initialize(model=plain, config={**config, "sequence_parallel_size": 1},
                                          optimizer=_optimizer("adamw", plain.parameters()))
    resumed.load_checkpoint(folder, tag="sp")
    with resumed.gathered_parameters():
        found["resume_diff"] = max(float((p - saved[n]).abs().max()) for n, p in plain.named_parameters())
    found["moved"] = max(float((p - _model("llama").state_dict()[n]).abs().max()) for n, p in saved.items())
    return found


def test_refusals_whole_sequence_evaluation_and_resume_without(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SP_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    results = run_distributed(_refusals_and_eval, 2)
    for found in results:
        assert "got different batches" in found["different"] and "data_parallel_rank" in found["different"]
        assert "padding on the right" in found["left"]
        assert found["eval_shape"] == [ROWS, SEQ, VOCAB]
        assert found["eval_diff"] < 1e-5
        assert found["resume_diff"] == 0.0 and found["moved"] > 1e-4
