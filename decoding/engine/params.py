"""SamplingParams: what a request asks of the sampler and the stop checks, validated once at the edge."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .reasoning import ReasoningParams
from .structured import Constraint

MAX_STOP_STRINGS = 16  # OpenAI allows 4; vLLM has no cap. A bound keeps per-token stop checks cheap.
MAX_STOP_STRING_CHARS = 256
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_N = 16
# vLLM's _SAMPLING_EPS: below it a temperature is greedy, since 1/t would overflow (float32 from ~3e-39)
# and the draw would return token 0 whatever the logits.
GREEDY_TEMPERATURE = 1e-5


class InvalidParams(ValueError):
    """A sampling parameter is out of range; `param` names it (the app answers 400 with it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ToolCallTrigger:
    """Under tool_choice auto: once `token_id` is drawn, what follows it until `arguments` ends is held
    to that grammar (a call's arguments to their schema); then the text is free again."""

    token_id: int
    arguments: Constraint


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0  # vLLM's: EOS, stop token ids and stop strings cannot end the first min_tokens tokens
    temperature: float = 1.0  # below GREEDY_TEMPERATURE (0 included) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's: divides positive logits of seen tokens (prompt and output)
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from each token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the generated text
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False  # vLLM's: the matched stop string ends the text instead of being cut
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k ≥ 0: the sampled token's and the top k
    prompt_logprobs: int | None = None  # same for every prompt token (completions' echo)
    n: int = 1
    skip_special_tokens: bool = True
    constraint: Constraint | None = None  # structured output: what the text must match
    call_trigger: ToolCallTrigger | None = None  # tool calls under tool_choice auto
    reasoning: ReasoningParams | None = None  # a thinking model's markers and budget (chat under a reasoning parser)

    def __post_init__(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidParams(param, message)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            check(math.isfinite(getattr(self, name)), name, f"{name} must be a finite number")
        check(self.max_tokens >= 1, "max_tokens", "max_tokens must be at least 1")
        check(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
              f"min_tokens must be between 0 and max_tokens ({self.max_tokens})")
        check(0.0 <= self.temperature <= 100.0, "temperature", "temperature must be between 0 and 100")
        check(0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]")
        check(self.top_k == -1 or self.top_k >= 0, "top_k", "top_k must be -1, 0 (disabled) or positive")
        check(0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]")
        check(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", "repetition_penalty must be in (0, 10]")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "presence_penalty must be in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "frequency_penalty must be in [-2, 2]")
        check(1 <= self.n <= MAX_N, "n", f"n must be between 1 and {MAX_N}")
        check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings")
        check(all(0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop), "stop",
              f"stop strings must be 1..{MAX_STOP_STRING_CHARS} characters")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or 0 <= value <= MAX_TOP_LOGPROBS, name,
                  f"{name} must be between 0 and {MAX_TOP_LOGPROBS}")
        check(all(math.isfinite(b) and -100 <= b <= 100 for b in self.logit_bias.values()), "logit_bias",
              "logit_bias values must be between -100 and 100")
        check(self.seed is None or -(2**63) <= self.seed < 2**64, "seed", "seed must fit in 64 bits")
        budget = self.reasoning.budget if self.reasoning is not None else None
        check(budget is None or budget >= 0, "thinking_token_budget", "thinking_token_budget must be at least 0")
        # min_tokens would forbid the end a grammar may already require: refused rather than half kept
        check(self.constraint is None or self.min_tokens == 0, "min_tokens",
              "min_tokens cannot be combined with structured output")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def effective_top_k(self) -> int:
        return max(self.top_k, 0)
