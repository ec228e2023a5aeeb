"""`python -m colibri_server.settings`: the example TOML of every setting (configs/colibri.toml)."""
import sys

from .load import example_toml

sys.stdout.write(example_toml())
