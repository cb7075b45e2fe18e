"""The optimizer step over the shards: ``optimizer`` (what ``hf_zero.initialize`` returns),
the step's stages (``step_pipeline``) and its inner step (``inner_step``: the fused Adam, a torch
optimizer, the whole-parameter step, NVMe), the overlapped offload step, which optimizers may
step flat shards (``optimizer_kinds``), Muon, the fp16 loss scaler and the LR schedulers."""
