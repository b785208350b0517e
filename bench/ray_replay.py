"""Multi-turn chat replay and a throughput run against `treadle serve --ray` (docs/scaling.md).

    python -m bench.ray_replay            # deploys locally: affinity on/off, 1 vs 2 replicas; prints figures

`replay()` sends each conversation's turns in order (conversations interleaved, `concurrency` at a
time), every turn resending the conversation so far plus one user message, with a system prompt
shared by several conversations. It reads the prefix-cache hit rate from the aggregated /metrics
(`treadle_prefix_cache_hit_tokens_total` / `treadle_prompt_tokens_total`, summed over replicas) and
time to first token as the client sees it.

`saturated_prefix()` is the other side of affinity: one request puts a long system prompt on a replica,
then a burst of requests with that same prompt arrives; affinity keeps them on that replica only until
its queue is `imbalanced_threshold` requests longer than the other's, then they spill over.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from bench.prometheus import parse_metrics
from bench.sse import iter_sse_data
from threadpool.numba_cache import use_numba_cache

SYSTEM_PROMPTS = [
    ("You are a patient tutor for a weaving workshop. Explain looms, shuttles, warps and wefts in plain words, "
     "one short paragraph at a time, and ask the learner a question at the end of each answer. "),
    ("You are a terse assistant for a bicycle repair shop. Answer in at most two sentences, name the tool needed, "
     "and never recommend a part the customer did not ask about. Be friendly but brief. "),
]
WORDS = ["loom", "shuttle", "warp", "weft", "heddle", "reed", "beam", "treadle", "bobbin", "spindle", "wool",
         "linen", "cotton", "silk", "pattern", "twill", "satin", "plain", "tabby", "selvedge"]


def context_note(conversation: int, words: int = 80) -> str:
    """A conversation's own opening text (deterministic), so later turns have more than the system prompt
    to reuse: only the replica that served the conversation before holds it."""
    return " ".join(WORDS[(conversation * 7 + i * (conversation + 3)) % len(WORDS)] for i in range(words))


USER_TURNS = ["Hello! Who are you?", "What should I learn first?", "Tell me one more thing.", "Thanks, and then?",
              "Can you summarise that?", "One last tip, please."]


@dataclass
class ReplayResult:
    requests: int = 0
    prompt_tokens: float = 0.0
    hit_tokens: float = 0.0
    ttft: list[float] = field(default_factory=list)
    sticky: int = 0  # turns after the first served by the replica that served the conversation's previous turn
    later_turns: int = 0
    replicas: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> dict[str, float]:
        return {"requests": self.requests, "hit_rate": round(self.hit_rate, 3),
                "ttft_mean_s": round(statistics.mean(self.ttft), 4) if self.ttft else 0.0,
                "ttft_p50_s": round(statistics.median(self.ttft), 4) if self.ttft else 0.0,
                "same_replica_as_previous_turn": f"{self.sticky}/{self.later_turns}",
                "replicas": dict(self.replicas)}


def metric_sums(base_url: str) -> dict[str, float]:
    """Each sample of the aggregated /metrics summed over replicas (its other labels kept apart)."""
    return parse_metrics(httpx.get(f"{base_url}/metrics", timeout=10).text, sum_over="replica")


def wait_for_finished(base_url: str, expected: float, timeout: float = 20.0) -> dict[str, float]:
    """The sums once the replicas have reported `expected` finished requests (reports lag ~1 s)."""
    deadline = time.monotonic() + timeout
    while True:
        sums = metric_sums(base_url)
        done = sum(v for k, v in sums.items() if k.startswith("treadle_request_success_total"))
        if done >= expected or time.monotonic() > deadline:
            return sums
        time.sleep(0.3)


def stream_chat(client: httpx.Client, base_url: str, messages: list[dict], max_tokens: int,
                timeout: float = 120.0) -> tuple[str, float, str, list[dict]]:
    """One streamed chat request → (text, time to first token, replica, events)."""
    started = time.perf_counter()
    ttft: float | None = None
    text, events = [], []
    with client.stream("POST", f"{base_url}/v1/chat/completions", timeout=timeout,
                       json={"messages": messages, "max_tokens": max_tokens, "stream": True,
                             "temperature": 0}) as response:
        response.raise_for_status()
        replica = response.headers.get("x-treadle-replica", "?")
        for data in iter_sse_data(response.iter_bytes()):
            if data == "[DONE]":
                continue
            event = json.loads(data)
            events.append(event)
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    text.append(piece)
    return "".join(text), float("nan") if ttft is None else ttft, replica, events


def replay(base_url: str, conversations: int = 6, turns: int = 4, max_tokens: int = 12,
           concurrency: int = 1) -> ReplayResult:
    before = metric_sums(base_url)
    result = ReplayResult()
    histories = [[{"role": "system", "content": SYSTEM_PROMPTS[c % len(SYSTEM_PROMPTS)]}]
                 for c in range(conversations)]
    last_replica: list[str | None] = [None] * conversations
    with httpx.Client() as client, ThreadPoolExecutor(concurrency) as pool:
        for turn in range(turns):
            def one(c: int, turn: int = turn) -> tuple[int, str, float, str]:
                opening = f"My notes: {context_note(c)}. " if turn == 0 else ""
                messages = [*histories[c], {"role": "user",
                                             "content": f"{opening}{USER_TURNS[turn % len(USER_TURNS)]}"}]
                text, ttft, replica, _ = stream_chat(client, base_url, messages, max_tokens)
                histories[c] = [*messages, {"role": "assistant", "content": text}]
                return c, text, ttft, replica
            for c, _, ttft, replica in pool.map(one, range(conversations)):
                result.requests += 1
                result.ttft.append(ttft)
                result.replicas[replica] = result.replicas.get(replica, 0) + 1
                if last_replica[c] is not None:
                    result.later_turns += 1
                    result.sticky += last_replica[c] == replica
                last_replica[c] = replica
    expected = sum(v for k, v in before.items() if k.startswith("treadle_request_success_total")) + result.requests
    after = wait_for_finished(base_url, expected)
    result.prompt_tokens = after.get("treadle_prompt_tokens_total", 0) - before.get("treadle_prompt_tokens_total", 0)
    result.hit_tokens = (after.get("treadle_prefix_cache_hit_tokens_total", 0)
                         - before.get("treadle_prefix_cache_hit_tokens_total", 0))
    return result


SATURATION_SYSTEM_PROMPT = (
    "You are the dispatcher of a weaving cooperative. Every order names a cloth, a width and a length; "
    "answer with the loom to use, the warp to set up and the day it can start, in that order. "
    "The cooperative's glossary, which you may use freely: "
    + " ".join(f"{WORDS[i % len(WORDS)]}-{WORDS[(i * 3 + 1) % len(WORDS)]}" for i in range(60)) + ". ")


@dataclass
class BurstResult:
    """One `saturated_prefix()` run. Times are seconds from the first request of the burst."""

    seed_replica: str
    replicas: list[str] = field(default_factory=list)  # each burst request's replica, in the order sent
    spans: list[tuple[float, float]] = field(default_factory=list)  # each one's (sent, last byte read)
    tokens: list[int] = field(default_factory=list)

    def open_on(self, replica: str, at: float) -> int:
        """Requests served by `replica` that were open (sent, not yet finished) at time `at`, client side:
        an upper bound on what the router saw, since the client sends before it and reads after it."""
        return sum(r == replica and sent < at < done for r, (sent, done) in zip(self.replicas, self.spans, strict=True))

    @property
    def first_elsewhere(self) -> int | None:
        """Index (in the order sent) of the first burst request not served by the seed's replica."""
        return next((i for i, r in enumerate(self.replicas) if r != self.seed_replica), None)

    def summary(self) -> dict[str, object]:
        short = {r: r.rsplit("#", 1)[-1] for r in {self.seed_replica, *self.replicas}}
        first = self.first_elsewhere
        return {"requests": len(self.replicas),
                "on_seed_replica": self.replicas.count(self.seed_replica),
                "elsewhere": len(self.replicas) - self.replicas.count(self.seed_replica),
                "order": "".join("R" if r == self.seed_replica else "o" for r in self.replicas),
                "first_elsewhere": first,
                "open_on_seed_replica_then": None if first is None
                else self.open_on(self.seed_replica, self.spans[first][0]),
                "seconds": round(max((d for _, d in self.spans), default=0.0), 2),
                "replicas": {short[r]: self.replicas.count(r) for r in sorted(set(self.replicas))}}


def saturated_prefix(base_url: str, requests: int = 12, max_tokens: int = 80, stagger_s: float = 0.04,
                     system_prompt: str = SATURATION_SYSTEM_PROMPT) -> BurstResult:
    """One request with `system_prompt` (its replica is the seed replica), then `requests` streams with the
    same system prompt and each its own user turn, sent `stagger_s` apart (so their order is known; all of
    them are open at once: `max_tokens` with `ignore_eos` lasts far longer than the burst takes to send)."""
    def body(user: str, tokens: int) -> dict:
        return {"messages": [{"role": "system", "content": system_prompt}, {"role": "user", "content": user}],
                "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True}

    limits = httpx.Limits(max_connections=requests + 4, max_keepalive_connections=requests + 4)
    with httpx.Client(limits=limits) as client:
        with client.stream("POST", f"{base_url}/v1/chat/completions", json=body("Hello!", 4),
                           timeout=120) as response:
            response.raise_for_status()
            seed = response.headers["x-treadle-replica"]
            response.read()
        time.sleep(0.5)  # the router's count of the seed's request drops back to 0 (a done callback)
        result = BurstResult(seed_replica=seed, replicas=[""] * requests, spans=[(0.0, 0.0)] * requests,
                             tokens=[0] * requests)
        start = time.perf_counter() + 0.2

        def one(i: int) -> None:
            time.sleep(max(0.0, start + i * stagger_s - time.perf_counter()))
            sent = time.perf_counter() - start
            tokens = 0
            with client.stream("POST", f"{base_url}/v1/chat/completions", timeout=300,
                               json=body(f"Order {i}: {WORDS[i % len(WORDS)]} cloth, {i + 1} metres.",
                                         max_tokens)) as response:
                response.raise_for_status()
                result.replicas[i] = response.headers["x-treadle-replica"]
                for data in iter_sse_data(response.iter_bytes()):
                    if not data.startswith("{"):
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        raise RuntimeError(f"burst request {i} failed: {event['error']}")
                    tokens += any(c.get("delta", {}).get("content") for c in event.get("choices", []))
            result.spans[i] = (sent, time.perf_counter() - start)
            result.tokens[i] = tokens

        with ThreadPoolExecutor(requests) as pool:
            list(pool.map(one, range(requests)))
    return result


def throughput(base_url: str, requests: int = 12, concurrency: int = 4, max_tokens: int = 32) -> float:
    """Generated tokens per second over `requests` distinct prompts, `concurrency` at a time."""
    def one(i: int) -> int:
        with httpx.Client() as client:
            r = client.post(f"{base_url}/v1/completions", timeout=300, json={
                "prompt": f"Request {i}: write about the history of weaving, part {i}.", "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0})
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(requests)))
    return tokens / (time.perf_counter() - started)


def deploy(replicas: int, affinity: bool, port: int, extra: list[str] | None = None) -> str:
    from ray import serve

    from app.ray.deployment import APP_NAME, build_application
    from app.settings import parse_settings

    settings = parse_settings(["--kv-cache-mb", "64", "--max-num-seqs", "16", *(extra or [])])
    serve.run(build_application(settings, replicas, 1, affinity), name=APP_NAME, route_prefix="/")
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the registry sees every replica
        health = httpx.get(f"{base_url}/health", timeout=10).json()
        if len(health.get("replicas", {})) == replicas:
            break
        time.sleep(0.5)
    return base_url


def main() -> int:
    import ray
    from ray import serve

    port = int(os.environ.get("PORT", "8790"))
    use_numba_cache()  # the kernels `make test` compiled, before the replicas import numba
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        figures = {}
        for replicas, affinity in ((2, True), (2, False)):
            base = deploy(replicas, affinity, port)
            figures[f"replay {replicas} replicas, affinity {'on' if affinity else 'off'}"] = replay(base).summary()
            if affinity:  # 12 same-prefix streams at once: how many stay on the replica holding the prefix
                figures["saturated prefix, 2 replicas, affinity on"] = saturated_prefix(base).summary()
            serve.delete("treadle")
        for replicas in (1, 2):
            base = deploy(replicas, True, port)
            throughput(base, requests=2, concurrency=2, max_tokens=4)  # warm
            figures[f"throughput {replicas} replica(s) x 1 thread, tokens/s"] = round(throughput(base), 1)
            serve.delete("treadle")
        print(json.dumps(figures, indent=2))
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
