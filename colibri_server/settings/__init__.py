"""Every setting of the server and the gateway, declared once (schema.py: name, type, default,
bound, reload rule, doc, env, flag), and their loading (load.py: defaults < TOML < COLIBRI_* env
< command-line flags -> Settings); parser.py is the exact-flag argument parser both commands use."""

from .load import (
                   ENV_PREFIX,
                   HUP,
                   RESTART,
                   SCHEMA,
                   SETTINGS,
                   USR1,
                   Setting,
                   Settings,
                   SettingsError,
                   add_arguments,
                   defaults,
                   describe,
                   example_toml,
                   format_size,
                   load_settings,
                   parse_bool,
                   parse_duration,
                   parse_size,
                   resolve_runtime_dir,
)
from .parser import Parser

__all__ = [
    "SettingsError", "Setting", "SCHEMA", "SETTINGS", "Settings", "HUP", "USR1", "RESTART",
    "ENV_PREFIX", "load_settings", "defaults", "add_arguments", "describe", "example_toml",
    "parse_size", "format_size", "parse_duration", "parse_bool", "resolve_runtime_dir", "Parser",
]
