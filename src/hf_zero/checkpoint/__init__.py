"""Checkpoints: sharded save, load at any world size and stage, export to a Hugging Face folder.

``save_checkpoint`` / ``load_checkpoint`` take the engine (``engine.save_checkpoint(...)`` and
``engine.load_checkpoint(...)`` delegate here); ``export_hf_model`` needs only the checkpoint;
``import_deepspeed_checkpoint`` turns a DeepSpeed ZeRO checkpoint into one ``load_checkpoint`` resumes;
``export_dcp_checkpoint`` / ``import_dcp_checkpoint`` write one as, or read one from, a PyTorch
``torch.distributed.checkpoint`` folder that FSDP2 loads or saved.
"""

from hf_zero.checkpoint.dcp_interop import export_dcp_checkpoint, import_dcp_checkpoint
from hf_zero.checkpoint.deepspeed_import import import_deepspeed_checkpoint
from hf_zero.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from hf_zero.checkpoint.export import export_hf_model
from hf_zero.checkpoint.load import load_checkpoint
from hf_zero.checkpoint.manifest import list_tags, read_manifest, resolve_checkpoint_dir
from hf_zero.checkpoint.save import save_checkpoint

__all__ = [
    "CheckpointError", "CheckpointNotFoundError", "export_dcp_checkpoint", "export_hf_model", "import_dcp_checkpoint",
    "import_deepspeed_checkpoint", "list_tags", "load_checkpoint",
    "read_manifest", "resolve_checkpoint_dir", "save_checkpoint",
]
