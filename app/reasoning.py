"""Reasoning models on the chat routes: which parser the server uses (`--reasoning-parser`), and what a
request's `thinking_token_budget`, `reasoning_effort` and `chat_template_kwargs` make of its thinking.

The parsers are vLLM's names. `qwen3`: the thinking is what the model writes between `<think>` and
`</think>` (Qwen3 opens it itself); `deepseek_r1`: the template opens it, so everything up to `</think>`
is thinking. Either way a prompt that ends by opening the thinking starts the answer in it, and one that
ends by closing it (Qwen3's `enable_thinking: false`) starts in the answer. `auto` picks from the chat
template and the vocabulary; `--reasoning-config` names other markers.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from decoding import TemplateError
from decoding.engine.reasoning import ReasoningMarkers, ReasoningParams, initial_phase
from decoding.model.tokenizer import Tokenizer

from .errors import APIError

log = logging.getLogger("treadle")

PARSERS = ("auto", "deepseek_r1", "qwen3", "none")
# `reasoning_effort` where the template does not read it: the thinking budget each level gets (tokens;
# None: no limit). "none" closes the thinking before it starts.
EFFORT_BUDGETS: dict[str, int | None] = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": None}
# Names the chat template already gets from the server: chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
_SAMPLE_CONVERSATION = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]


@dataclass(frozen=True, slots=True)
class ReasoningSetup:
    """The server's reasoning parser: its name, its markers, and whether its model always thinks first."""

    parser: str
    markers: ReasoningMarkers
    opens_by_default: bool  # deepseek_r1: the thinking is open from the first token unless the prompt closed it

    def params(self, prompt_text: str, budget: int | None) -> ReasoningParams:
        return ReasoningParams(self.markers, initial_phase(prompt_text, self.markers, self.opens_by_default), budget)


def reasoning_config(text: str) -> str:
    """`--reasoning-config`: a JSON object with `reasoning_start_str` and `reasoning_end_str`."""
    config = json.loads(text) if isinstance(text, str) else text
    if not isinstance(config, dict) or set(config) - {"reasoning_start_str", "reasoning_end_str"} or not all(
            isinstance(config.get(key), str) and config[key] for key in ("reasoning_start_str", "reasoning_end_str")):
        raise ValueError('must be a JSON object {"reasoning_start_str": ..., "reasoning_end_str": ...} of non-empty '
                         "strings")
    return json.dumps(config)


def template_kwargs(text: Any) -> str:
    """`--default-chat-template-kwargs`: a JSON object of plain values."""
    value = json.loads(text) if isinstance(text, str) else text
    check_template_kwargs(value, ValueError)
    return json.dumps(value)


def check_template_kwargs(value: Any, error: type[Exception] = ValueError) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise error("must be a JSON object")
    reserved = sorted(RESERVED_TEMPLATE_NAMES & set(value))
    if reserved:
        raise error(f"may not set {reserved[0]!r}: the server passes it to the template itself")
    return value


def _token_id(tokenizer: Tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text)
    return ids[0] if len(ids) == 1 else None


def resolve(parser: str, config_text: str | None, tokenizer: Tokenizer) -> ReasoningSetup | None:
    """The server's reasoning setup (None: the model's text is all answer); logs what `auto` chose."""
    if parser == "none":
        return None
    config = json.loads(config_text) if config_text else {}
    start, end = config.get("reasoning_start_str", "<think>"), config.get("reasoning_end_str", "</think>")
    markers = ReasoningMarkers(start, end, _token_id(tokenizer, start), _token_id(tokenizer, end))
    if parser == "auto":
        template = tokenizer.chat_template_source or ""
        in_vocabulary = markers.start_id is not None and markers.end_id is not None
        if end not in template and not in_vocabulary:
            log.info("reasoning parser: none (neither the chat template nor the vocabulary has %s)", end)
            return None
        parser = "deepseek_r1" if _template_opens_thinking(tokenizer, start) else "qwen3"
        log.info("reasoning parser: %s (chosen by auto from the %s; markers %s %s as %s)", parser,
                 "chat template" if end in template else "vocabulary", start, end,
                 "tokens" if in_vocabulary else "text")  # fmt: skip
    return ReasoningSetup(parser, markers, opens_by_default=parser == "deepseek_r1")


def _template_opens_thinking(tokenizer: Tokenizer, start: str) -> bool:
    try:
        return tokenizer.apply_chat_template(_SAMPLE_CONVERSATION, True).rstrip().endswith(start)
    except TemplateError:
        return False


def template_reads(tokenizer: Tokenizer, name: str) -> bool:
    return name in (tokenizer.chat_template_source or "")


def thinking_budget(setup: ReasoningSetup | None, tokenizer: Tokenizer, budget: int | None, effort: str | None,
                    default: int | None) -> int | None:  # fmt: skip
    """A request's thinking budget: its `thinking_token_budget`, else what its `reasoning_effort` maps to
    where the template does not read it, else the server's default. A 400 where the model does not think."""
    if setup is None and (budget is not None or effort is not None):
        field = "thinking_token_budget" if budget is not None else "reasoning_effort"
        raise APIError(400, f"{field} needs a thinking model: this server runs no reasoning parser "
                            "(--reasoning-parser)", field, code="unsupported_parameter")  # fmt: skip
    if budget is not None:
        return budget
    if effort is not None and not template_reads(tokenizer, "reasoning_effort"):
        return EFFORT_BUDGETS[effort]
    return default
