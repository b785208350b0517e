"""What makes a request unservable, checked before it is queued: each refusal names its field."""

from __future__ import annotations

from kvcache.errors import KVCacheError
from kvcache.manager import KVCacheManager

from .errors import RequestTooLarge
from .params import InvalidParams, SamplingParams
from .structured import Guide, StructuredOutputError


def validate_request(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                     max_num_seqs: int, kv: KVCacheManager) -> None:
    """Raise `InvalidParams` (naming the field) or `RequestTooLarge` for what could never be served,
    however long it waited: bad token ids, more choices than run together, more than the context or
    the whole KV cache holds."""
    if not prompt_ids:
        raise InvalidParams("prompt", "the prompt is empty")
    if params.n > max_num_seqs:
        raise InvalidParams("n", f"n = {params.n} choices cannot run together: this server runs at most "
                                 f"{max_num_seqs} sequences at once (max_num_seqs)")
    for field, token_ids in (("prompt", prompt_ids), ("logit_bias", params.logit_bias),
                             ("stop_token_ids", params.stop_token_ids)):
        if any(not 0 <= t < vocab_size for t in token_ids):
            raise InvalidParams(field, f"token ids must lie in [0, {vocab_size})")
    total = len(prompt_ids) + params.max_tokens
    if len(prompt_ids) >= max_model_len:
        raise RequestTooLarge(f"the prompt has {len(prompt_ids)} tokens; the context holds {max_model_len}")
    if total > max_model_len:
        raise RequestTooLarge(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceed "
                              f"the context of {max_model_len} tokens")
    try:
        kv.check_fits(total)
    except KVCacheError as exc:
        raise RequestTooLarge(str(exc)) from None


def validate_constraints(params: SamplingParams, guide: Guide) -> None:
    """Compile each grammar the request may be held to (its answer's, its tool calls' arguments', a
    thinking budget's forced end), so one that cannot compile is refused before it is queued."""
    forced_end = params.reasoning.markers.end_constraint() if params.reasoning is not None else None
    for constraint in (params.constraint, params.call_trigger.arguments if params.call_trigger else None,
                       forced_end if params.reasoning and params.reasoning.budget is not None else None):
        if constraint is None:
            continue
        try:
            guide.compile(constraint)  # compiled once per grammar text, then cached
        except StructuredOutputError as exc:
            raise InvalidParams(constraint.field, f"{constraint.field} cannot be compiled: {exc}") from None
