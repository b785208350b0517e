"""After sampling: append each token, detokenize, check stop conditions, build the deltas to publish."""

from __future__ import annotations

import time

import numpy as np

from .outputs import RequestOutput, Usage
from .sampling import TokenLogprobs, log_softmax, top_logprobs
from .sequence import Request, Sequence, find_stop, partial_stop_suffix


def finish_output(seq: Sequence, reason: str, stop_reason: str | int | None = None, error: str | None = None,
                  flush_text: bool = True) -> RequestOutput:
    """The closing delta of a choice: whatever text was held back, and why it ended."""
    text = ""
    if flush_text:
        text = seq.held_text + seq.detokenizer.flush()
    seq.held_text = ""
    seq.finish_reason = reason
    return RequestOutput(seq.request.request_id, seq.index, text=text, finish_reason=reason,
                         stop_reason=stop_reason, error=error)


def process_token(seq: Sequence, token: int, logprobs: TokenLogprobs | None, eos_token_ids: tuple[int, ...],
                  max_model_len: int, grammar_complete: bool = False) -> RequestOutput:
    """Append a sampled token to its sequence; returns the delta (with finish_reason if it ended).
    `grammar_complete`: the sequence's structured-output grammar accepts nothing after this token."""
    request, params = seq.request, seq.params
    now = time.monotonic()
    request.first_token_time = request.first_token_time or now
    request.last_token_time = now
    seq.output_ids.append(token)
    logprob_list = [logprobs] if logprobs is not None else []

    def ended(reason: str, stop_reason: str | int | None = None, flush: bool = True) -> RequestOutput:
        out = finish_output(seq, reason, stop_reason, flush_text=flush)
        out.token_ids, out.logprobs = [token], logprob_list
        return out

    # vLLM's min_tokens: no stop condition ends a sequence before min_tokens tokens precede the one that
    # ends it (the sampler masks EOS and the stop token ids until then; stop strings are not looked for).
    can_stop = len(seq.output_ids) > params.min_tokens
    if can_stop and token in eos_token_ids and not params.ignore_eos:
        return ended("stop")
    if can_stop and token in params.stop_token_ids:
        return ended("stop", token)
    num_held = len(seq.held_text)
    text = seq.held_text + seq.detokenizer.add(token)
    if params.stop:
        # A match must take in this token's text: held text never holds a whole stop string, unless one
        # that completed before min_tokens (and so does not count).
        match = find_stop(text, params.stop, num_held) if can_stop else None
        if match is not None:
            start, stop = match
            seq.held_text = ""
            out = ended("stop", stop, flush=False)
            out.text = text[: start + len(stop) if params.include_stop_str_in_output else start]
            return out
        hold = partial_stop_suffix(text, params.stop)
        text, seq.held_text = text[: len(text) - hold], text[len(text) - hold :]
    else:
        seq.held_text = ""
    if grammar_complete or len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= max_model_len:
        out = ended("stop" if grammar_complete else "length")
        out.text = text + out.text
        return out
    return RequestOutput(request.request_id, seq.index, text=text, token_ids=[token], logprobs=logprob_list)


def usage_of(request: Request) -> Usage:
    return Usage(len(request.prompt_ids), request.num_completion_tokens, request.num_cached_tokens,
                 *request.draft_token_counts)


def record_prompt_logprobs(seq: Sequence, token_ids: list[int], logits: np.ndarray) -> None:
    """Row i of a chunk predicts the token after it: the logprob of each prompt token given its prefix."""
    request = seq.request
    if request.prompt_logprobs is None:
        request.prompt_logprobs = [None]  # nothing predicts the first token
    begin = seq.num_computed_tokens - len(token_ids)
    del request.prompt_logprobs[begin + 1 :]  # a prompt preempted mid-prefill records its rows again
    logprobs = log_softmax(logits)
    k = request.params.prompt_logprobs or 0
    for i in range(len(token_ids)):
        position = begin + i + 1
        if position < len(request.prompt_ids):
            token = request.prompt_ids[position]
            request.prompt_logprobs.append(TokenLogprobs(token, float(logprobs[i, token]),
                                                         top_logprobs(logprobs[i], k)))
