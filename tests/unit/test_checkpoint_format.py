"""The pure parts of checkpoints: resharding arithmetic, streamed safetensors, JSON encoding,
export naming. No process group."""

from __future__ import annotations

import math
import os

import pytest
import torch
from safetensors import safe_open

from hf_zero.checkpoint.errors import CheckpointError
from hf_zero.checkpoint.export import export_names, parse_size
from hf_zero.checkpoint.manifest import check_plain_json, check_tag, decode_state, encode_state
from hf_zero.checkpoint.reshard import Piece, index_saved_slots, plan_pieces
from hf_zero.checkpoint.safetensors_io import TensorEntry, read_header, write_safetensors
from hf_zero.partition import padded_length


def _group(label: str, sizes: dict[str, int], world: int) -> dict:
    """A manifest group record in the layout checkpoints had before parameters were aligned
    (parameters back to back, padded to a multiple of world x 4), which loads must keep reading:
    resharding maps slots by name and offset, whatever rule placed them."""
    slots, offset = [], 0
    for name, numel in sizes.items():
        slots.append({"name": name, "shape": [numel], "offset": offset, "numel": numel})
        offset += numel
    return {"group": label, "slots": slots, "numel": offset,
            "padded_numel": padded_length(offset, world, alignment=4), "world_size": world}


def _gather(groups: list[dict], data: dict[str, list[float]]) -> dict[int, dict[str, list[float]]]:
    """What each saved rank file would hold: its shard of each group's padded flat buffer."""
    files: dict[int, dict[str, list[float]]] = {}
    for g in groups:
        flat = [0.0] * g["padded_numel"]
        for s in g["slots"]:
            flat[s["offset"]:s["offset"] + s["numel"]] = data[s["name"]]
        shard = g["padded_numel"] // g["world_size"]
        for k in range(g["world_size"]):
            files.setdefault(k, {})[g["group"]] = flat[k * shard:(k + 1) * shard]
    return files


def test_unchanged_layout_reads_one_slice_per_group():
    saved = [_group("u#0", {"a": 10, "b": 7}, world=2)]  # 17 -> padded 24, shards of 12
    pieces = plan_pieces(saved[0]["slots"], (12, 24), index_saved_slots(saved))
    assert pieces == [Piece(1, "u#0", 0, 5, 0, 5)]  # rank 1 owns b[2:7], then padding


@pytest.mark.parametrize("old_world,new_world", [(2, 3), (3, 2), (2, 1), (1, 3), (3, 3)])
def test_any_world_size_to_any_other_reassembles_every_parameter(old_world, new_world):
    sizes = {"a": 10, "b": 7, "c": 1, "d": 23}
    data = {n: [float(hash((n, i)) % 1000) for i in range(k)] for n, k in sizes.items()}
    # saved as two groups; the new layout is one group in another order (another stage's split)
    saved = [_group("x#0", {"a": 10, "c": 1}, old_world), _group("x#1", {"b": 7, "d": 23}, old_world)]
    files = _gather(saved, data)
    target = _group("y#0", {"d": 23, "a": 10, "b": 7, "c": 1}, new_world)
    shard = target["padded_numel"] // new_world
    rebuilt = []
    for rank in range(new_world):
        out = [0.0] * shard
        for p in plan_pieces(target["slots"], (rank * shard, (rank + 1) * shard), index_saved_slots(saved)):
            out[p.dst_lo:p.dst_hi] = files[p.file_index][p.label][p.src_lo:p.src_hi]
        rebuilt += out
    for s in target["slots"]:
        assert rebuilt[s["offset"]:s["offset"] + s["numel"]] == data[s["name"]]
    assert rebuilt[target["numel"]:] == [0.0] * (target["padded_numel"] - target["numel"])


def test_a_parameter_across_three_saved_shards_is_cut_at_the_boundaries():
    saved = [_group("g", {"w": 30}, world=3)]  # padded 36, shards of 12
    pieces = plan_pieces([{"name": "w", "offset": 0, "numel": 30}], (0, 30), index_saved_slots(saved))
    assert [(p.file_index, p.src_lo, p.src_hi, p.dst_lo, p.dst_hi) for p in pieces] == [
        (0, 0, 12, 0, 12), (1, 0, 12, 12, 24), (2, 0, 6, 24, 30)]


def test_streamed_safetensors_are_read_by_safe_open(tmp_path):
    tensors = {"a/param": torch.randn(13), "b": torch.arange(6, dtype=torch.int64).reshape(2, 3),
               "c": torch.randn(5).to(torch.bfloat16), "empty": torch.zeros(0), "flag": torch.tensor([True, False])}
    entries = [TensorEntry(n, t.dtype, tuple(t.shape), lambda t=t: t) for n, t in tensors.items()]
    path = str(tmp_path / "x.safetensors")
    size = write_safetensors(path, entries, {"save_id": "abc"})
    assert size == os.path.getsize(path)
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"save_id": "abc"}
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name), tensor)
        assert torch.equal(f.get_slice("a/param")[3:7], tensors["a/param"][3:7])
    header, metadata = read_header(path)
    assert set(header) == set(tensors) and metadata["save_id"] == "abc"
    with open(path, "r+b") as handle:
        handle.truncate(size - 1)
    with pytest.raises(ValueError, match="truncated"):
        read_header(path)


def test_a_producer_that_breaks_its_promise_is_refused(tmp_path):
    entry = TensorEntry("a", torch.float32, (3,), lambda: torch.zeros(4))
    with pytest.raises(ValueError, match="promised"):
        write_safetensors(str(tmp_path / "x.safetensors"), [entry])


def test_run_state_round_trips_through_json():
    state = {"step": torch.tensor(3.0), "betas": (0.9, 0.95), "lr": 1e-3, "none": None, "inf": math.inf,
             "groups": [{"params": [0, 1], "dtype": torch.bfloat16}], 7: "int key", "nested": {"t": torch.arange(3)}}
    import json

    back = decode_state(json.loads(json.dumps(encode_state(state, "state"))))
    assert back["betas"] == (0.9, 0.95) and back[7] == "int key" and back["inf"] == math.inf
    assert torch.equal(back["step"], state["step"]) and back["step"].dtype == torch.float32
    assert back["groups"][0]["dtype"] is torch.bfloat16 and torch.equal(back["nested"]["t"], torch.arange(3))
    with pytest.raises(CheckpointError, match="state.big: a tensor of 5000 elements"):
        encode_state({"big": torch.zeros(5000)}, "state")


def test_client_state_must_be_json_and_says_where_it_is_not():
    check_plain_json({"a": [1, 2.5, "x", None, True], "b": {"c": (1, 2)}})
    with pytest.raises(CheckpointError, match=r"client_state\['a'\]\[1\] is a Tensor"):
        check_plain_json({"a": [1, torch.zeros(2)]})
    with pytest.raises(CheckpointError, match="key 3"):
        check_plain_json({3: 1})


@pytest.mark.parametrize("tag", ["", "latest", ".hidden", "a/b", "../x", "-x"])
def test_bad_tags_are_refused(tag):
    with pytest.raises(CheckpointError, match="not usable as a directory name"):
        check_tag(tag)


def test_tied_weights_are_named_like_save_pretrained():
    gpt2 = {"aliases": {"lm_head.weight": "transformer.wte.weight"}, "tied_weight_keys": ["lm_head.weight"]}
    assert export_names("transformer.wte.weight", gpt2) == ["transformer.wte.weight"]
    undeclared = {"aliases": {"head.weight": "emb.weight"}, "tied_weight_keys": []}
    assert export_names("emb.weight", undeclared) == ["emb.weight", "head.weight"]
    ignored = {"aliases": {}, "keys_to_ignore_on_save": ["x.weight"]}
    assert export_names("x.weight", ignored) == []


def test_sizes_parse_like_transformers():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("500MB") == 5 * 10**8
    assert parse_size(1234) == 1234 and parse_size("8KB") == 8000
    with pytest.raises(ValueError, match="expected bytes or a size"):
        parse_size("five gigs")
