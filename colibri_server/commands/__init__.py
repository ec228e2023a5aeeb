"""What some of `colibri`'s commands do beyond parsing: the terminal chat, the demo, the status
table, and the routing trace of `colibri inspect`."""

__all__ = ["chat", "demo", "status", "debug"]
