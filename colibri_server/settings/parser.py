"""The argument parser of `colibri` and `colibri-http`: exact flags only, errors from the parser at fault.

Stock argparse takes any unambiguous prefix of a long flag (`--max-token 5` silently becomes
`--max-tokens 5`) and leaves a subcommand's unknown flags to the top-level parser, whose
error shows the top-level usage (`colibri serve --wokers 2` -> `usage: colibri COMMAND ...`).
Here a flag is taken only as spelled, and the parser that owns the arguments reports what
it does not know: its own usage, then one line naming the flag and the nearest real one.
"""
from __future__ import annotations

import argparse
import difflib
import sys

# a usage longer than this many lines is replaced by a short one in error messages
# (`colibri serve` has a flag per setting: its full usage is in --help)
_USAGE_LINES = 6


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(self._unrecognized(extras))
        return ns, extras

    def _unrecognized(self, extras) -> str:
        flags = [e for e in extras if e.startswith("-") and e != "-"]
        if not flags:
            return f"unrecognized arguments: {' '.join(extras)}"
        known = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        out = []
        for f in flags:
            name = f.split("=", 1)[0]
            near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            out.append(f"{name} (did you mean {near[0]}?)" if near else name)
        return f"unrecognized argument{'s' if len(out) > 1 else ''}: {', '.join(out)}"

    def format_short_usage(self) -> str:
        usage = self.format_usage()
        if usage.count("\n") > _USAGE_LINES:
            usage = f"usage: {self.prog} [options]  (`{self.prog} --help` lists them)\n"
        return usage

    def error(self, message):
        sys.stderr.write(self.format_short_usage())
        self.exit(2, f"{self.prog}: error: {message}\n")
