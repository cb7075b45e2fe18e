"""World size 1 with no launcher environment: runs in this very process, like a notebook."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import scenarios as S


@pytest.fixture
def no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    import torch.distributed as dist

    assert not dist.is_initialized()


@pytest.mark.parametrize("stage", [0, 3])
def test_world_size_one_in_process_matches_adamw(no_launcher_env, stage):
    sc = S.scenario("gpt2", stage, gas=2)
    result = S.train_engine(sc)
    reference = S.train_reference(sc, world=1)
    losses = [sum(step) / sc["gas"] for step in result["losses"]]
    assert losses == pytest.approx(reference["losses"], abs=1e-5)
    assert result["params"].keys() == reference["params"].keys()
    for name, values in reference["params"].items():
        assert max(abs(a - b) for a, b in zip(result["params"][name], values, strict=True)) <= 1e-5
    assert result["comm_per_step"][-1] == {}  # world size 1: collectives skipped, nothing counted


def test_config_scheduler_drives_the_learning_rate(no_launcher_env):
    import hf_zero

    config = S.make_config(S.scenario("gpt2", 2))
    config["scheduler"] = {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 4, "warmup_type": "linear"}}
    engine, optimizer, _, scheduler = hf_zero.initialize(model=S.build_model(S.scenario("gpt2", 2)), config=config)
    lrs = []
    for step in range(6):
        ids = torch.randint(0, 97, (2, 12))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        lrs.append(engine.get_lr()[0])
    # DeepSpeed's linear warmup: lr(i) = min + (max - min) * i / warmup, stepped after each step.
    assert lrs == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    assert scheduler is engine.lr_scheduler and optimizer is engine.optimizer


def test_step_is_a_no_op_between_accumulation_boundaries(no_launcher_env):
    import hf_zero

    sc = S.scenario("gpt2", 1, gas=3)
    engine, _, _, _ = hf_zero.initialize(model=S.build_model(sc), config=S.make_config(sc))
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    boundaries = []
    for _ in range(3):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        ids = torch.randint(0, 97, (2, 12))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        if len(boundaries) < 3:
            assert all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
    assert boundaries == [False, False, True]
    assert engine.global_steps == 1 and engine.micro_steps == 3
    assert any(not torch.equal(before[n], p) for n, p in engine.module.named_parameters())


def test_training_data_gives_a_micro_batch_dataloader_and_progress_lines(no_launcher_env, caplog):
    import logging

    import hf_zero

    rows = [{"input_ids": torch.randint(0, 97, (12,))} for _ in range(10)]
    config = S.make_config(S.scenario("gpt2", 3))
    config.update(train_micro_batch_size_per_gpu=4, steps_per_print=2, dataloader_drop_last=True)
    engine, _, loader, _ = hf_zero.initialize(model=S.build_model(S.scenario("gpt2", 3)), config=config,
                                              training_data=rows)
    assert [len(b["input_ids"]) for b in loader] == [4, 4]  # drop_last drops the 2 left over
    with caplog.at_level(logging.INFO, logger="hf_zero"):
        for _ in range(2):
            for batch in loader:
                engine.backward(engine(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss)
                engine.step()
    lines = [r.getMessage() for r in caplog.records if "grad_norm" in r.getMessage()]
    assert len(lines) == 2 and lines[0].startswith("hf_zero: step 2 loss ")
    assert "samples/s" in lines[0]


def test_initialize_reports_every_config_problem_at_once(no_launcher_env):
    import hf_zero

    bad = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 5, "overlap_com": True},
           "gradiant_clipping": 1.0}
    with pytest.raises(hf_zero.HfZeroConfigError) as info:
        hf_zero.initialize(model=S.build_model(S.scenario("gpt2", 1)), config=bad)
    paths = sorted(p.path for p in info.value.problems)
    assert paths == ["gradiant_clipping", "zero_optimization.overlap_com", "zero_optimization.stage"]
    assert "did you mean 'gradient_clipping'" in str(info.value)


def test_torch_optimizer_and_scheduler_passed_in_are_rebound_to_the_shards(no_launcher_env):
    import hf_zero

    sc = S.scenario("llama", 2, optimizer="torch")
    model = S.build_model(sc)
    user_optimizer = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if "norm" not in n], "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters() if "norm" in n], "weight_decay": 0.0},
    ], lr=1e-3)
    user_scheduler = torch.optim.lr_scheduler.LambdaLR(user_optimizer, lambda step: 1.0 / (step + 1))
    engine, optimizer, _, scheduler = hf_zero.initialize(
        model=model, config=S.make_config(sc), optimizer=user_optimizer, lr_scheduler=user_scheduler)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert all(p.dim() == 1 and p.dtype == torch.float32 for g in optimizer.param_groups for p in g["params"])
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    for _ in range(3):
        ids = torch.randint(0, 97, (2, 12))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    assert engine.get_lr() == pytest.approx([1e-3 / 4, 1e-3 / 4])
    # The sharded optimizer really stepped (not the user's original one, which the scheduler had
    # wrapped): it has Adam state for every shard and every parameter moved.
    assert len(optimizer.inner.state) == sum(len(g["params"]) for g in optimizer.param_groups)
    assert all(not torch.equal(before[n], p) for n, p in engine.module.named_parameters())
    assert all(len(s) == 0 for s in user_optimizer.state.values())
    assert scheduler is user_scheduler and scheduler.optimizer is optimizer


def test_stage3_parameter_read_outside_forward_names_it(no_launcher_env):
    """[Note: parameters read outside their unit]: a custom loss reading a weight after the
    forward, or a submodule called outside the model, gets an error that names the parameter
    and the fix; metadata stays readable, and gathered_parameters gives the values."""
    engine = S.stage3_llama_after_a_step()
    ids = torch.randint(0, 97, (2, 12))
    head = engine.module.lm_head.weight
    assert head.shape == (97, 16) and head.requires_grad  # metadata needs no gather
    with pytest.raises(RuntimeError, match=r"'lm_head.weight' is sharded by ZeRO stage 3.*gathered_parameters"):
        head.sum()
    # The input embedding is a unit of its own ([Note: edge units]): called directly, as scripts
    # do to build inputs_embeds, it is gathered where it runs and released after.
    embedding = engine.module.get_input_embeddings()
    with torch.no_grad():
        embedded = embedding(ids)
    with pytest.raises(RuntimeError, match=r"'model.embed_tokens.weight' is sharded"):
        embedding.weight.sum()
    with engine.gathered_parameters([head, embedding.weight]):
        total = float(head.detach().sum())
        assert type(head) is torch.nn.Parameter
        assert torch.equal(embedded, torch.nn.functional.embedding(ids, embedding.weight.detach()))
    assert total != 0.0
    engine.backward(S.model_loss(engine, "llama", ids))  # training goes on unaffected
    engine.step()



def test_a_trainable_model_without_an_optimizer_is_refused_at_initialize(no_launcher_env):
    """Not at the first engine.step(), steps later; a model in eval mode (from_pretrained's) or a
    frozen one is taken for inference, as deepspeed.initialize takes it."""
    import hf_zero

    config = S.make_config(S.scenario("gpt2", 3))
    del config["optimizer"]
    model = S.build_model(S.scenario("gpt2", 3)).train()
    with pytest.raises(ValueError, match=r"no optimizer .*add an \"optimizer\" section.*model\.eval\(\)"):
        hf_zero.initialize(model=model, config=config)
    engine, optimizer, _, _ = hf_zero.initialize(model=S.build_model(S.scenario("gpt2", 3)).eval(), config=config)
    assert optimizer is None and engine(torch.ones(1, 4, dtype=torch.long)) is not None
