"""Put on PYTHONPATH of the plain DDP reference runs only: torch's gloo group can deadlock a rank
as it exits after all its work (a worker thread waiting for the GIL while the group's destructor
joins it), which would fail a test about hf_zero for a reason outside it. This applies the same
remedy hf_zero applies to its own runs ([Note: leaving a gloo group]); it changes no result."""

from hf_zero.comm.process_group import let_gloo_workers_finish_after_destroy

let_gloo_workers_finish_after_destroy()
