"""Where the tiny model bundled with the package lives (colibri_server/data/tiny-stdlib.colibri,
trained by tools/train_tiny.py): the default of `--model` for the cli and the master."""
from __future__ import annotations

import os

BUNDLED_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tiny-stdlib.colibri")
