"""The master process: the arbiter (fork, reap, signals), the loading of a model, the generations
and the fleet of worker hosts it owns, the gateway child, and the start's progress."""

from .arbiter import Arbiter
from .loading import EXIT_BIND, EXIT_LOAD, HaltServer

__all__ = ["Arbiter", "HaltServer", "EXIT_LOAD", "EXIT_BIND"]
