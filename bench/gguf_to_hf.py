#!/usr/bin/env python3
"""Write a Hugging Face directory from a GGUF file, for the transformers baseline of side_by_side.py.

`transformers serve DIR:FILE.gguf` fails on SmolLM2's GGUF (the config it builds from the file has no
`architectures`), so the baseline serves this directory instead: the same weights, dequantized by
transformers' own GGUF loader to float32 (as it does at every GGUF load), saved as safetensors.

Runs in .venv-bench (torch + transformers):  .venv-bench/bin/python bench/gguf_to_hf.py GGUF OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> int:
    gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.config.architectures = [type(model).__name__]
    # The weights are plain float32 tensors now; only the loader's bookkeeping says "gguf", and
    # save_pretrained refuses a model it thinks is quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"{gguf.name} -> {out} ({type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
