"""What one rank holds of the model and how it comes and goes: flat groups of parameters
(``flat_group``) split into their parameter storage, gradient buffer and fp32 master
(``param_storage``, ``grad_buffer``, ``master_state``), the buffer pool that gives full buffers
their memory, where a shard's values come from at load (``param_source``, ``deferred_load``), the
stand-in a sharded parameter is between uses (``sharded_param``), how a reduction averages
(``grad_average``) and which parameters a step updates (``param_usage``)."""
