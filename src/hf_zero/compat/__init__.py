"""Other libraries' APIs on hf_zero, so a script written for them ports by its import line:
``import hf_zero.compat.deepspeed as deepspeed`` (see :mod:`hf_zero.compat.deepspeed`)."""
