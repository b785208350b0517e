"""A tiny random model of tests/golden/architectures copied with a chat template of a test's own and
tokens added to its vocabulary (a tool-call tag, a thinking marker, a fill-in-the-middle token), with room
in its context for long prompts: the shape of a real family's template on a model that loads in a blink."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ARCHITECTURES = Path(__file__).parent / "golden" / "architectures"


def chat_model(source: str, directory: Path, template: str | None, added: tuple[str, ...] = (),
               special: bool = False) -> Path:  # fmt: skip
    """`source` ("qwen2", "qwen3", ...) copied to `directory`; `added` become tokens of their own, numbered
    after the vocabulary (376, 377, ...), special or not; `template` (if any) replaces its chat template."""
    shutil.copytree(ARCHITECTURES / source, directory)
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    first = len(tokenizer["model"]["vocab"])
    tokenizer["added_tokens"] += [{"id": first + i, "content": tag, "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": special}
                                  for i, tag in enumerate(added)]  # fmt: skip
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    if template is not None:
        config = json.loads((directory / "tokenizer_config.json").read_text())
        (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    model_config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**model_config, "max_position_embeddings": 4096}))
    return directory
