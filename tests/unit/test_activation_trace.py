"""The traced activations ([Note: traced activations] in hf_zero/activations.py) against the
resident peak of a real step on this CPU, and the effect of each setting against its own
arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hf_zero.activations import ActivationSettings, estimate_activations
from hf_zero.simulate import rank_env

LLAMA = dict(vocab_size=4096, hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096)

# One real forward and backward in a fresh interpreter: the growth of the resident peak (VmHWM) over
# what the process held with the model built. Parameter gradients are dropped as they land, as the
# estimate leaves them to the model states.
_MEASURE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, LlamaConfig
from hf_zero.simulate import reset_peak, rss
spec = json.loads(sys.argv[1])
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_config(LlamaConfig(**spec["config"]), attn_implementation="sdpa").train()
if spec["checkpointing"]:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
for param in model.parameters():
    param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
ids = torch.randint(0, spec["config"]["vocab_size"], (1, spec["seq"]))
warm = model(input_ids=ids[:, :64], labels=ids[:, :64]).loss
warm.backward()
del warm
before = reset_peak()
loss = model(input_ids=ids, labels=ids).loss
loss.backward()
print(json.dumps({"peak": rss("VmHWM") - before}))
"""


def _measured_peak(seq: int, checkpointing: bool) -> int:
    spec = {"config": LLAMA, "seq": seq, "checkpointing": checkpointing}
    done = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(spec)], env=rank_env(), capture_output=True,
                          text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["peak"]


def _config():  # noqa: ANN202
    from transformers import LlamaConfig

    return LlamaConfig(**LLAMA)


@pytest.mark.parametrize("seq,checkpointing", [(2048, False), (4096, False), (4096, True)])
def test_the_traced_peak_is_within_ten_percent_of_a_real_step(seq: int, checkpointing: bool) -> None:
    estimate = estimate_activations(_config(), ActivationSettings(seq_len=seq, dtype="fp32",
                                                                  gradient_checkpointing=checkpointing))
    measured = _measured_peak(seq, checkpointing)
    print(f"seq {seq} checkpointing {checkpointing}: traced {estimate.peak / 2**20:.1f} MiB, "
          f"measured {measured / 2**20:.1f} MiB")
    assert abs(estimate.peak - measured) <= 0.10 * measured, (estimate.peak, measured)


def test_each_setting_changes_the_activations_by_its_arithmetic() -> None:
    config, seq, hidden = _config(), 4096, LLAMA["hidden_size"]
    plain = estimate_activations(config, ActivationSettings(seq_len=seq, dtype="fp32"))
    logits = seq * LLAMA["vocab_size"] * 4  # one [tokens, vocab] fp32 tensor
    assert plain.layers == 3 and plain.after_forward > 3 * plain.per_layer_after_forward + logits
    # gradient checkpointing keeps each layer's input: one hidden state per token
    checkpointed = estimate_activations(config, ActivationSettings(seq_len=seq, dtype="fp32",
                                                                   gradient_checkpointing=True))
    assert checkpointed.per_layer_after_forward == seq * hidden * 4
    # S ranks hold 1/S of every activation but the attention's exchanged copies
    halves = estimate_activations(config, ActivationSettings(seq_len=seq, dtype="fp32", sequence_parallel_size=2))
    assert 0.45 <= halves.peak / plain.peak <= 0.55
    assert 0.45 <= halves.per_layer_after_forward / plain.per_layer_after_forward <= 0.6
    # bf16 halves the activations the model computes, but for the norms' fp32 statistics
    bf16 = estimate_activations(config, ActivationSettings(seq_len=seq, dtype="bf16"))
    assert 0.5 <= bf16.per_layer_after_forward / plain.per_layer_after_forward <= 0.6
    # the tiled MLP keeps no [tokens, intermediate] tensor; the tiled loss no [tokens, vocab] one
    tiled_mlp = estimate_activations(config, ActivationSettings(seq_len=seq, dtype="fp32", tiled_mlp_tokens=512))
    intermediates = 4 * seq * LLAMA["intermediate_size"] * 4  # gate, up, activation, product
    assert plain.per_layer_after_forward - tiled_mlp.per_layer_after_forward >= intermediates
    tiled_loss = estimate_activations(config, ActivationSettings(seq_len=seq, dtype="fp32", tiled_loss_tokens=512))
    assert plain.peak - tiled_loss.peak >= 2 * logits  # the logits, their log-softmax and its gradient
    # the head and the loss: the logits and the log-softmax the loss keeps (the fp32 logits are the
    # model's own in fp32; in bf16 the loss adds an fp32 copy), one tile of them when tiled
    per_logit = seq * LLAMA["vocab_size"]
    assert plain.logits_and_loss == pytest.approx(8 * per_logit, rel=1e-3)
    assert bf16.logits_and_loss == pytest.approx(10 * per_logit, rel=1e-3)
    assert tiled_loss.logits_and_loss == pytest.approx(8 * 512 * LLAMA["vocab_size"], rel=1e-3)


def test_estimate_with_a_sequence_prints_the_activations_and_the_peak(tmp_path, capsys) -> None:
    from hf_zero.cli import main
    from hf_zero.estimator import human_bytes

    _config().save_pretrained(tmp_path)
    args = ["estimate", "--model", str(tmp_path), "--gpus-per-node", "2", "--stages", "3", "--dtype", "fp32"]
    assert main(args) == 0
    assert "activations per rank" not in capsys.readouterr().out  # no --seq: the states alone
    assert main([*args, "--seq", "2048", "--sequence-parallel-size", "2", "--gradient-checkpointing"]) == 0
    out = capsys.readouterr().out
    traced = estimate_activations(_config(), ActivationSettings(seq_len=2048, dtype="fp32", sequence_parallel_size=2,
                                                                gradient_checkpointing=True))
    assert "sequence_parallel_size 2 (1024 tokens a rank)" in out and "gradient checkpointing" in out
    rows = {line[2:31].strip(): line[31:] for line in out.splitlines() if line.startswith("  ")}
    assert human_bytes(traced.peak) in rows["peak of forward and backward"]
    assert human_bytes(traced.logits_and_loss) in rows["logits and loss"]
    assert human_bytes(traced.after_forward) in rows["kept after the forward"]
    peak_rows = out[out.index("peak/rank"):].splitlines()[2:]
    assert len(peak_rows) == 3 and all(human_bytes(traced.peak) in row for row in peak_rows)
    assert main([*args, "--seq", "2048", "--sequence-parallel-size", "3"]) == 2
    assert "expected a divisor of the world size 2" in capsys.readouterr().err
