"""Rewrite a .colibri file's free-form metadata (tensors, config, tokenizer unchanged, byte for byte).

    python tools/set_metadata.py MODEL.colibri key=value [key=value ...] [--drop key]

Writes a temp file and renames it over MODEL (a running server keeps its mapping of the old
inode; send it USR1 to pick up the new file). Values that parse as JSON numbers stay numbers.
"""
from __future__ import annotations

import argparse
import json
import sys

from colibri_server.model import format as fmt
from colibri_server.model.writer import ColibriWriter


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("pairs", nargs="*", help="key=value")
    ap.add_argument("--drop", action="append", default=[])
    a = ap.parse_args(argv)
    cf = fmt.ColibriFile.open(a.model)
    meta = fmt.read_json_blob(a.model, "metadata", cf.metadata_json, required=False)
    for k in a.drop:
        meta.pop(k, None)
    for p in a.pairs:
        k, sep, v = p.partition("=")
        if not sep:
            sys.exit(f"not key=value: {p!r}")
        try:
            meta[k] = json.loads(v) if v[:1] in "-0123456789" else v
        except ValueError:
            meta[k] = v
    config = json.loads(cf.config_json)
    with ColibriWriter(a.model, config=config, metadata=meta, tokenizer_json=cf.tokenizer_json,
                       chat_template=cf.chat_template, num_experts=cf.header["num_experts"],
                       num_layers=cf.header["num_layers"]) as w:
        for r in cf.record_list:
            w.declare(r.name, r.dtype, r.shape)
        w.set_routing(list(cf.routing))
        for r in cf.record_list:
            w.write(r.name, cf.tensor_bytes(r.name))
    print(json.dumps(meta, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
