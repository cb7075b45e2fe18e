"""hf_zero's version, in a module of its own: the checkpoint and CLI code that records it need not
import the package root (which imports the engine, which imports the checkpoint code)."""

__version__ = "0.1.0"  # pyproject.toml's version
