"""The operating-system side of a process: core pinning and NUMA placement, memory figures from
/proc, systemd's notify socket, and the log format. Roles call these; none of them knows a role."""

__all__ = ["pinning", "numa", "memory", "systemd", "logs"]
