"""The ``hf_zero`` logger's defaults: its INFO lines reach the user without any logging set-up.

A script that never configures logging (the Trainer-less loop of the README, an Accelerate
script) still sees what ``initialize`` did, in one line, and the ``steps_per_print`` lines, as
DeepSpeed's users do. ``HF_ZERO_VERBOSITY`` (debug, info, warning or error; info by default)
sets the level; ``logging.getLogger("hf_zero").setLevel(...)`` in the script overrides it.

Notes
-----
[Note: one route for each record]
The default handler writes only while the root logger has no handler of its own. A script that
calls ``logging.basicConfig`` (transformers' examples, TRL's scripts) gets each record once,
through its own handler and format, by propagation; pytest's capture handlers sit on the root
too, so tests see records where they look for them and nothing on stderr twice.
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "hf_zero"
VERBOSITY_ENV = "HF_ZERO_VERBOSITY"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _UnlessRootConfigured(logging.StreamHandler):
    """stderr, looked up at each record (a test's or a notebook's replacement included), while the
    root logger has no handler: [Note: one route for each record]."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        self.stream = sys.stderr
        super().emit(record)


def configure_library_logger(environ: dict[str, str]) -> None:
    """Give the ``hf_zero`` logger its default handler and level, once; a level the script set
    first is kept. An unknown ``HF_ZERO_VERBOSITY`` is an error naming the values it takes."""
    logger = logging.getLogger(LOGGER_NAME)
    if any(isinstance(handler, _UnlessRootConfigured) for handler in logger.handlers):
        return
    name = environ.get(VERBOSITY_ENV, "info").strip().lower()
    if name not in LEVELS:
        raise ValueError(f"{VERBOSITY_ENV}={environ[VERBOSITY_ENV]!r} is not a level: use one of {', '.join(LEVELS)}")
    if logger.level == logging.NOTSET:
        logger.setLevel(LEVELS[name])
    handler = _UnlessRootConfigured()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
