"""Where the tiny model bundled with the package lives (colibri_server/data/tiny-stdlib.colibri,
trained by tools/train_tiny.py): the default of `--model` for the cli and the master; and
`model_file_problem`, the one-line check of a model path both make before opening it."""
from __future__ import annotations

import os

BUNDLED_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tiny-stdlib.colibri")


def model_file_problem(path):
    """None if `path` may be a model file, else one line naming what is wrong with it (missing,
    a directory, not a regular file, empty, unreadable, not a .colibri file). Opens with
    O_NONBLOCK so that a FIFO at the path cannot hang this check."""
    import stat
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return f"model file not found: {path}"
    except IsADirectoryError:
        return f"model path {path} is a directory: give a .colibri file"
    except OSError as e:
        return f"model file {path}: {e.strerror}"
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return f"model path {path} is a directory: give a .colibri file"
        if not stat.S_ISREG(st.st_mode):
            kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device"
            return f"model path {path} is {kind}, not a regular file"
        if st.st_size == 0:
            return f"model file {path} is empty"
        head = os.pread(fd, 8, 0)
    except OSError as e:
        return f"model file {path}: {e.strerror}"
    finally:
        os.close(fd)
    from .model.format import MAGIC
    if not head.startswith(MAGIC[:min(len(MAGIC), 8)]):
        return f"{path} is not a .colibri model file (convert a checkpoint with `colibri convert`)"
    return None
