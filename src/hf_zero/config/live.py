"""The stage-3 config the user keeps alive.

As with transformers' ``HfDeepSpeedConfig``, creating a stage-3 :class:`HfZeroConfig` and
keeping a reference to it changes how models are loaded: ``from_pretrained`` then builds the
model with its parameters on the meta device and leaves the reading of the weights to
``hf_zero.initialize``, which reads only the slices each rank owns. Only a weak reference is kept
here, so dropping the config turns this off. Listeners (registered by the package's public API
layer) do the actual hooking, so this module imports nothing from transformers.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

_live: weakref.ReferenceType | None = None
_listeners: list[Callable[[], None]] = []


def set_live_zero3_config(config: Any) -> None:
    global _live
    _live = weakref.ref(config)
    for listener in _listeners:
        listener()


def restore_live_zero3_config(previous: Any | None) -> None:
    """Make ``previous`` (a config, or None for none) the live one again, calling no listener:
    what a context that set a config of its own leaves behind (compat.deepspeed.zero.Init)."""
    global _live
    _live = weakref.ref(previous) if previous is not None else None


def live_zero3_config() -> Any | None:
    """The stage-3 HfZeroConfig the user created most recently, if it is still alive."""
    return _live() if _live is not None else None


def on_live_zero3_config(listener: Callable[[], None]) -> None:
    """Call ``listener`` whenever a stage-3 config becomes the live one."""
    _listeners.append(listener)
