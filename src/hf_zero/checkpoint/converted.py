"""What the imports of other engines' checkpoints (DeepSpeed's, FSDP2's DCP folders) share: the
optimizers their Adam state resumes in, the checks on the target folder, and writing the result
as an hf_zero checkpoint of one rank file, published only when complete ([Note: atomic save])."""

from __future__ import annotations

import os
import shutil
from typing import Any

from hf_zero.checkpoint.manifest import MANIFEST_NAME, rank_file_name
from hf_zero.checkpoint.safetensors_io import TensorEntry
from hf_zero.checkpoint.save import _publish, _write_json, _write_rank_file

CARRIED_HYPER = ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay")
TARGET_OPTIMIZERS = ("ZeroAdam", "Adam", "AdamW")  # what engine.optimizer.inner may be when it resumes


def check_conversion_target(source_dir: str, out_dir: str, optimizer_class: str, source: str,
                            same_folder_detail: str = "") -> None:
    """``optimizer_class`` is one an Adam state resumes in, and ``out_dir`` is not the source
    folder itself (``source`` names it: "DeepSpeed's Adam state", "the DCP folder"...)."""
    if optimizer_class not in TARGET_OPTIMIZERS:
        raise ValueError(f"optimizer_class={optimizer_class!r}: {source}'s Adam state resumes in one of "
                         f"{', '.join(TARGET_OPTIMIZERS)} (ZeroAdam: the config's Adam/AdamW; 'AdamW' or 'Adam': a "
                         "torch optimizer passed to hf_zero.initialize, as the Trainer's)")
    if os.path.realpath(source_dir) == os.path.realpath(out_dir):
        raise ValueError(f"out_dir {out_dir} is the {source} folder itself; write the hf_zero checkpoint elsewhere"
                         f"{same_folder_detail}")


def write_converted(out_dir: str, tag: str, save_id: str, entries: list[TensorEntry], manifest: dict[str, Any]) -> str:
    """The rank file and the manifest into a temporary folder, published only when complete."""
    created = not os.path.lexists(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tmp_dir = os.path.join(out_dir, f".{tag}.tmp-{save_id}")
    try:
        os.mkdir(tmp_dir)
    except BaseException:
        _remove_if_created_and_empty(out_dir, created)
        raise
    try:
        metadata = {"format": "hf_zero", "save_id": save_id, "tag": tag, "rank": "0", "world_size": "1"}
        record = _write_rank_file(os.path.join(tmp_dir, rank_file_name(0, 1)), entries, metadata)
        manifest["files"] = [record]
        _write_json(os.path.join(tmp_dir, MANIFEST_NAME), manifest)
        return _publish(out_dir, tmp_dir, tag, save_id)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        _remove_if_created_and_empty(out_dir, created)  # a refused import leaves no empty folder behind
        raise


def _remove_if_created_and_empty(out_dir: str, created: bool) -> None:
    if created and os.path.isdir(out_dir) and not os.listdir(out_dir):
        os.rmdir(out_dir)
