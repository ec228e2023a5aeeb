"""A model file's identity as the backend messages carry it (READY's `identity`, ROLL's): what a
worker host compares with a head's."""
from __future__ import annotations

__all__ = ["file_identity"]


def file_identity(path) -> str:
    """ColibriFile.identity of the file at `path` now, reading only what precedes its tensor data
    (a worker host checks the file under its model path against a head's rollout)."""
    from ..model.format import ColibriFile
    cf = ColibriFile.open(path, populate=False, hugepages=False)
    try:
        return cf.identity
    finally:
        cf.close()
