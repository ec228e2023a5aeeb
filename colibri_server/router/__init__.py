"""The router process: one poll loop between clients and workers (loop.py), its records (requests,
workers, generations), the control requests it answers itself, and the worker hosts of a head."""

from .loop import EXIT_ROUTER_BIND, Router, router_main

__all__ = ["Router", "router_main", "EXIT_ROUTER_BIND"]
