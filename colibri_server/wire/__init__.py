"""What travels between the processes and who may send it: the protocol's frames, bodies and
checks (docs/protocol.md), CURVE keys and bind checks, the ZMTP options both ends of a tcp link
set, and a model file's identity as the backend messages carry it. Clients, the router, workers
and the gateway all speak through these modules; nothing here knows a role."""

__all__ = ["protocol", "security", "zmtp", "identity"]
