#!/usr/bin/env python3
"""Golden GGUF tokenization from llama.cpp itself: the truth for treadle's tokenizers.

    make golden-llamacpp-tokenizers   # or: .venv/bin/python scripts/make_golden_llamacpp_tokenizers.py

Runs in .venv with llama-cpp-python built (`make bench` builds it). For each GGUF it finds — the
default model (SmolLM2, pre-tokenizer `smollm`), the real Qwen2.5-Coder (`qwen2`) and Gemma 3
(SentencePiece `llama`) files when their PyPI parts are installed, and llama.cpp's own vocab-only
files for `llama-bpe` (Llama 3) and `llama-spm` (Llama 2) from the llama-cpp-python sdist — it
tokenizes CORPUS (over 200 strings: prose, code, digit runs, whitespace runs, emoji, CJK, other
scripts, each model's special-token text, awkward Unicode, and the strings of llama.cpp's own
tokenizer tests) with `Llama(path, vocab_only=True).tokenize(text, add_bos=False, special=True)`,
and writes tests/golden/llamacpp_tokens_<name>.json. transformers is not used: its GGUF tokenizer
conversion is wrong on some of these (SmolLM2's digits).
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
OUT = REPO / "tests" / "golden"
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
VOCAB_DIR = Path.home() / ".cache" / "treadle" / "llama.cpp-vocab"  # the vocab-only files, kept for the tests
VOCAB_FILES = {"llama-bpe": "ggml-vocab-llama-bpe.gguf", "llama-spm": "ggml-vocab-llama-spm.gguf"}
SEPARATOR = "\n__ggml_vocab_test__\n"

SPECIAL_TEXT = {
    "smollm2": ["<|im_start|>user\nhi<|im_end|>", "<|endoftext|>", "<|im_start|><|im_end|>", "<repo_name>x<file_sep>y"],
    "qwen2": ["<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>user\n", "<|endoftext|>",
              "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
              "<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "<|im_end|><|im_end|>", "x<|im_start|>"],
    "gemma3": ["<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<bos>text<eos>", "<pad>",
               "<start_of_image>", "<end_of_turn><start_of_turn>", " <start_of_turn> "],
    "llama-bpe": ["<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>", "<|eot_id|>",
                  "<|start_header_id|>assistant<|end_header_id|>\n\n"],
    "llama-spm": ["<s>hello</s>", "<unk>", " <s> "],
}  # fmt: skip


def corpus(name: str, inp_strings: list[str]) -> list[str]:
    from make_golden import TOKENIZER_CORPUS  # the transformers goldens' corpus, shared

    texts = list(TOKENIZER_CORPUS)
    texts += [str(10**n - 1) for n in range(1, 13)] + ["0" * n for n in (1, 2, 3, 4, 7)]
    texts += [f"{a} {b}" for a, b in (("1", "23"), ("12", "345"), ("x1", "y22"), ("3.5", "4.75"))]
    texts += ["1234567890123456789", "0.000001", "1e100", "-0", "+1", "1/2", "½ ¾", "１２３ full-width"]
    for ws in (" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n", "\n ", " \t \n"):
        texts += [f"a{ws}b", f"{ws}x", f"x{ws}", ws * 3]
    texts += ["    def f():\n        return 1\n", "if x:\n\tpass\nelse:\n\t\tpass", "a = [1,2,3]  # list",
              "fn main() { println!(\"hi\"); }", "#include <stdio.h>\nint main(void){return 0;}",
              "console.log(`${a} + ${b}`);", "x => x * 2", "<?php echo 'hi'; ?>", "SELECT 1;", "a:b::c:::d",
              "snake_case CamelCase kebab-case SCREAMING_CASE", "https://example.com/a/b?c=1&d=2#e",
              "user@example.com", "C:\\Users\\name\\file.txt", "~/.config/treadle.toml",
              "`code`  ```python\nx\n```"]  # fmt: skip
    texts += ["🙂", "🙂🙂🙂", "a🙂b", " 🙂", "🧑🏿‍💻", "🏳️‍🌈", "✅ done", "⚠️ warning", "1️⃣ 2️⃣", "🇺🇸🇬🇧"]
    texts += ["中文", "中 文", "漢字かなカナ", "한국어 텍스트", "ภาษาไทย", "עברית", "Ελληνικά", "Türkçe İı",
              "Tiếng Việt", "ქართული", "Ӂ ӂ", "👋 世界 hello"]  # fmt: skip
    texts += ["e\u0301", "\u00e9", "a\u0300\u0301\u0302", "\ufffd", "\ue000 private use", "\U0001f600\u200d",
              "\u200d", "\u2028line sep", "\u00a0\u00a0", "ﬁ ligature", "Ａ full-width", "\u0301 leading combining",
              "x\u0000y", "\x1b[31mred\x1b[0m", "\u202eright-to-left override"]  # fmt: skip
    texts += SPECIAL_TEXT.get(name, [])
    texts += inp_strings
    return list(dict.fromkeys(texts))  # unique, in order


def llama_cpp_sdist_vocab() -> dict[str, Path]:
    """llama.cpp's vocab-only test files, from the llama-cpp-python sdist (downloaded once)."""
    VOCAB_DIR.mkdir(parents=True, exist_ok=True)
    missing = [f for f in VOCAB_FILES.values() if not (VOCAB_DIR / f).exists()]
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d",
                        str(VOCAB_DIR), LLAMA_CPP_PYTHON], check=True)  # fmt: skip
        sdist = next(VOCAB_DIR.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                base = Path(member.name).name
                if any(base.startswith(f) for f in VOCAB_FILES.values()) and not base.endswith(".out"):
                    member.name = base
                    tar.extract(member, VOCAB_DIR, filter="data")
        sdist.unlink()
    return {name: VOCAB_DIR / f for name, f in VOCAB_FILES.items()}


def golden(name: str, path: Path, inp: Path) -> None:
    from llama_cpp import Llama

    inp_strings = inp.read_text().split(SEPARATOR)
    model = Llama(str(path), vocab_only=True, verbose=False)
    cases = []
    for text in corpus(name, inp_strings):
        ids = model.tokenize(text.encode("utf-8", "surrogatepass"), add_bos=False, special=True)
        cases.append({"text": text, "ids": ids})
    data = {
        "source": f"llama.cpp in llama-cpp-python {importlib.metadata.version('llama-cpp-python')}: "
                  f"Llama({path.name}, vocab_only=True).tokenize(text, add_bos=False, special=True)",
        "file": path.name,
        "cases": cases,
    }  # fmt: skip
    (OUT / f"llamacpp_tokens_{name}.json").write_text(json.dumps(data, ensure_ascii=False, indent=0))
    print(f"{name}: {len(cases)} strings from {path.name}")


def main() -> int:
    from decoding.model.registry import resolve_model_path
    from tests import real_models

    scratch = Path("/tmp/treadle-golden-real")
    scratch.mkdir(exist_ok=True)
    files: dict[str, Path] = {"smollm2": resolve_model_path("smollm2-135m-instruct")[0]}
    for name, function in (("qwen2", real_models.qwen25_coder_05b), ("gemma3", real_models.gemma3_270m)):
        try:
            files[name] = function(scratch)
        except BaseException as exc:  # noqa: BLE001 - pytest.skip when the parts are not installed
            print(f"{name}: skipped ({exc})", file=sys.stderr)
    vocab = llama_cpp_sdist_vocab()
    files.update(vocab)
    for name, path in files.items():  # llama.cpp's own tokenizer-test strings go into every corpus
        golden(name, path, vocab["llama-bpe"].with_name(VOCAB_FILES["llama-bpe"] + ".inp"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
