#!/usr/bin/env python3
"""Run llama.cpp's own convert_hf_to_gguf.py on a checkpoint whose tokenizer was trained offline (the tests'
and bench's tiny models): the converter names a BPE tokenizer's pre-tokenizer by the hash of its ids on a
check string and refuses any hash it does not know; this wrapper answers "gpt-2" (byte-level BPE with GPT-2's
split, what tests/hf_models.train_tokenizer builds) where it would refuse. Everything else is llama.cpp's.

    python tools/hf_to_gguf.py CHECKPOINT_DIR --outtype f16 --outfile model.gguf

The llama.cpp source: $LLAMA_CPP_SRC, else bench/.anchors/llama.cpp (bench/build_anchors.sh puts it there).
Needs torch, transformers and numpy (the test extra).
"""
import os
import runpy
import sys

SRC = os.environ.get("LLAMA_CPP_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", ".anchors",
                                                   "llama.cpp"))


def main() -> None:
    if not os.path.isfile(os.path.join(SRC, "convert_hf_to_gguf.py")):
        sys.exit(f"hf_to_gguf: no llama.cpp source at {SRC} (run bench/build_anchors.sh or set LLAMA_CPP_SRC)")
    sys.path[:0] = [SRC, os.path.join(SRC, "gguf-py")]
    from conversion import base

    known = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"
    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [os.path.join(SRC, "convert_hf_to_gguf.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
