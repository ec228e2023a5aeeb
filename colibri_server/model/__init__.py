"""The model core: the .colibri format, the converter, and the forward pass."""
from .engine import Completion, Model, StreamEvent  # noqa: F401
from .format import ColibriFormatError  # noqa: F401
