"""Opt-in pytest plugin: where the suite's wall time goes, per xdist worker and per test file.

    TEST_TIMES=OUT.tsv python -m pytest ...      (conftest loads it when the variable is set)
    python tests/worker_times.py OUT.tsv         (the summary below)

Each worker appends one line per test: worker, start and end (epoch seconds, setup to teardown), node id.
The summary prints each worker's last end (from the first start) and busy seconds, then the test files by
their seconds and the worker that ran them: whether the two workers end together (the split is even) and
which files hold the time. Off unless the variable is set.
"""
from __future__ import annotations

import collections
import os
import sys
import time

ENV = "TEST_TIMES"
_start: dict = {}


def pytest_runtest_protocol(item, nextitem):
    _start[item.nodeid] = time.time()


def pytest_runtest_logfinish(nodeid, location):
    if nodeid not in _start:            # the xdist controller hears of every test: only the worker that ran it writes
        return
    with open(os.environ[ENV], "a") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\t{_start.pop(nodeid):.2f}\t{time.time():.2f}\t{nodeid}\n")


def summary(path: str, files: int = 30) -> str:
    rows = []
    with open(path) as f:
        for line in f:
            w, a, b, node = line.rstrip("\n").split("\t")
            rows.append((w, float(a), float(b), node))
    t0 = min(a for _, a, _, _ in rows)
    out = []
    for w in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == w]
        out.append(f"{w}: ends at {max(b for _, _, b, _ in mine) - t0:.0f} s, busy {sum(b - a for _, a, b, _ in mine):.0f} s"
                   f" ({len(mine)} tests)")
    per_file, where = collections.Counter(), collections.defaultdict(set)
    for w, a, b, node in rows:
        per_file[node.split("::")[0]] += b - a
        where[node.split("::")[0]].add(w)      # one worker under --dist loadfile; any that ran a part otherwise
    out += [f"{s:8.1f} s  {'+'.join(sorted(where[f]))}  {f}" for f, s in per_file.most_common(files)]
    return "\n".join(out)


if __name__ == "__main__":
    print(summary(sys.argv[1]))
