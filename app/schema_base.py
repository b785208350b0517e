"""What every API's request schemas share: the strict body, field types that say what they accept, and
the refusal of fields that would change the output but are not implemented (never silently dropped)."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler, WrapValidator

from .errors import APIError


def one_of(message: str) -> WrapValidator:
    """One plain message for a union field, instead of one pydantic error per member of the union."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(message) from None

    return WrapValidator(validate)


NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Prompt = Annotated[NonEmptyStr | TokenIds, one_of("must be a non-empty string or a non-empty list of token ids")]
Stop = Annotated[str | list[str], one_of("must be a string or a list of strings")]


# Fields that would change the output and are not implemented, each with the values that change nothing.
# Any other value is refused with 400 `unsupported_parameter` naming the field: never silently dropped.
# (OpenAI's old `functions` / `function_call` are refused: `tools` / `tool_choice` replace them.) Fields that only
# describe the caller (user, metadata, store, service_tier, ...) are not listed: they are accepted and ignored.
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    # OpenAI's
    "functions": (None, []),
    "function_call": (None, "none"),
    "best_of": (None,),  # or equal to n, which is what n alone does (see `refuse_not_implemented`)
    "modalities": (None, ["text"]),
    "audio": (None,),
    "web_search_options": (None,),
    # vLLM's
    "use_beam_search": (None, False),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "return_tokens_as_token_ids": (None, False),
    "spaces_between_special_tokens": (None, True),
}
CHAT_NOT_IMPLEMENTED = {
    **NOT_IMPLEMENTED,
    "echo": (None, False),  # vLLM's chat echo; completions implement theirs
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "add_special_tokens": (None, False),
    "chat_template": (None,),
    "documents": (None, []),
}
COMPLETION_NOT_IMPLEMENTED = {**NOT_IMPLEMENTED, "add_special_tokens": (None, True),
                              # a prompt's text is raw: there is no template and no thinking to split or cap
                              "chat_template_kwargs": (None,), "reasoning_effort": (None,),
                              "thinking_token_budget": (None,)}
MESSAGE_NOT_IMPLEMENTED = {"function_call": (None,)}  # an assistant's, in the history (the old API)


def refuse_not_implemented(data: dict[str, Any], table: dict[str, tuple[Any, ...]], prefix: str = "") -> None:
    for name, neutral in table.items():
        value = data.get(name)
        if value in neutral or (name == "best_of" and value == data.get("n", 1)):
            continue
        shown = " or ".join([json.dumps(v) for v in neutral] + (["n"] if name == "best_of" else []))
        raise APIError(400, f"{name} is not supported: it would change the output and treadle does not implement "
                            f"it yet (omit it, or send {shown})", prefix + name, code="unsupported_parameter")


class StrictBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
