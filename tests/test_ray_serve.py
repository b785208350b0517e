"""`treadle serve --ray` on a local Ray cluster started here: 2 replicas x 1 thread behind Ray Serve's
proxy, the `openai` client streaming through it, msgpack, aggregated /health and /metrics, prefix
affinity on a multi-turn replay, affinity yielding to load when a burst shares one prefix, and a replica
killed mid-stream.

Needs the `ray` extra (`make install` installs it). Every wait has a timeout; Ray is shut down in a
finally, so a failure cannot leave the cluster (or the test) hanging.
"""

from __future__ import annotations

import json
import math
import time

import httpx
import msgpack
import pytest

ray = pytest.importorskip("ray", reason="the ray extra: pip install -e '.[ray]'")
serve = pytest.importorskip("ray.serve")

from app.ray.deployment import APP_NAME, routing_text  # noqa: E402 - after the skip when ray is missing
from bench.ray_replay import deploy, replay, saturated_prefix, stream_chat  # noqa: E402
from bench.sse import iter_sse_data  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

PORT = 8793


def test_routing_text_is_a_stable_prefix_across_turns() -> None:
    first = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}]
    second = [*first, {"role": "assistant", "content": "b"}, {"role": "user", "content": [{"type": "text",
                                                                                           "text": "c"}]}]
    one = routing_text("/v1/chat/completions", json.dumps({"messages": first}).encode(), "application/json")
    two = routing_text("/v1/chat/completions", msgpack.packb({"messages": second}), "application/msgpack")
    assert one and two and two.startswith(one) and two.endswith("<user>c\n")
    assert routing_text("/v1/completions", b'{"prompt": "xyz"}', "application/json") == "xyz"
    assert routing_text("/v1/models", b"", "") is None
    assert routing_text("/v1/completions", b"{not json", "application/json") is None


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        yield
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def base_url(cluster):
    return deploy(2, True, PORT)


def test_openai_client_streams_through_the_proxy(base_url: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=60, max_retries=0)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})  # greedy: text, not chance
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4, temperature=0)
    assert completion.usage.completion_tokens == 4
    # Errors are the replica's own, OpenAI-shaped.
    response = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": "nope"}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_msgpack_stream_and_replica_header(base_url: str) -> None:
    body = msgpack.packb({"prompt": "Hello", "max_tokens": 3, "stream": True, "ignore_eos": True})
    response = httpx.post(f"{base_url}/v1/completions", content=body, timeout=60,
                          headers={"Content-Type": "application/msgpack", "Accept": "application/msgpack"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/msgpack")
    assert response.headers["x-treadle-replica"].startswith("SERVE_REPLICA::")
    maps = list(_unpack_all(response.content))
    text = "".join(m["choices"][0]["text"] for m in maps if m.get("choices"))
    assert text and not any("error" in m for m in maps)


def _unpack_all(data: bytes):
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    yield from unpacker


def test_health_and_metrics_are_aggregated_and_per_replica(base_url: str) -> None:
    health = httpx.get(f"{base_url}/health", timeout=10)
    assert health.status_code == 200 and len(health.json()["replicas"]) == 2
    replicas = httpx.get(f"{base_url}/replicas", timeout=10).json()["replicas"]
    assert len(replicas) == 2
    cores = [tuple(r["cores"] or ()) for r in replicas]
    assert len(set(cores)) == 2, f"replicas share cores: {cores}"  # 2 cores here: one each
    metrics = httpx.get(f"{base_url}/metrics", timeout=10).text
    assert "treadle_replicas_up 2" in metrics
    for r in replicas:
        assert f'treadle_prompt_tokens_total{{replica="{r["id"]}"}}' in metrics
        own = httpx.get(f"{base_url}/replicas/{r['id']}/metrics", timeout=10)
        assert own.status_code == 200 and "treadle_kv_blocks_total" in own.text
        assert httpx.get(f"{base_url}/replicas/{r['id']}/health", timeout=10).status_code == 200
    assert httpx.get(f"{base_url}/replicas/nosuch/metrics", timeout=10).status_code == 404


def test_prefix_affinity_keeps_conversations_on_their_replica(base_url: str) -> None:
    result = replay(base_url, conversations=4, turns=3, max_tokens=8, concurrency=1)
    print("affinity on:", result.summary())
    # Sequential turns (no load imbalance): every later turn goes where its conversation's prefix is.
    assert result.sticky == result.later_turns == 8, result.summary()
    assert result.hit_rate > 0.5, result.summary()


def test_saturated_replica_spills_same_prefix_requests_to_the_other(base_url: str) -> None:
    """Affinity yields to load. One request puts a long system prompt on replica R; then 12 streams with that
    prompt (each its own user turn, 80 tokens with ignore_eos) are sent 40 ms apart, so all are open at once.
    The router sends them to R while R's queue (Ray's ongoing requests per replica, which counts the engine's
    waiting requests too: max_ongoing_requests is the engine's max_queue, 256) is at most the threshold (4)
    longer than the other's; past that, power of two choices sends them to the other replica."""
    from app.ray.router import DEFAULT_IMBALANCED_THRESHOLD as threshold

    result = saturated_prefix(base_url, requests=12, max_tokens=80, stagger_s=0.04)
    summary = result.summary()
    print("saturated prefix:", summary, "spans:", [(round(a, 2), round(b, 2)) for a, b in result.spans])
    assert min(result.tokens) > 0, summary
    # The burst overlapped (else no replica was ever loaded and there was nothing to fall back from).
    assert result.spans[0][1] > result.spans[-1][0], f"the burst did not overlap: {result.spans}"
    # Affinity while balanced: the first ones sent went to R. (Power of two choices alone sends the second
    # one elsewhere: R has one open, the other none. Three, not threshold + 1, for slack in arrival order.)
    assert result.replicas[:3] == [result.seed_replica] * 3, summary
    assert summary["on_seed_replica"] >= threshold, summary
    # Fallback: some went to the other replica (a router that always follows the prefix puts all 12 on R)...
    assert summary["elsewhere"] >= 2, summary
    # ... and only once R was loaded: when the first of them was sent, at least `threshold` were open on R
    # (client-side spans, which hold the router's view: the client sends before it and reads after it).
    assert summary["open_on_seed_replica_then"] >= threshold, summary


def test_killed_replica_ends_its_stream_and_survivors_serve(base_url: str) -> None:
    survivors_ok = 0
    with httpx.Client() as client:
        with client.stream("POST", f"{base_url}/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": "Count to one thousand."}], "max_tokens": 400,
                "ignore_eos": True, "stream": True}) as response:
            victim = response.headers["x-treadle-replica"]
            stream = iter_sse_data(response.iter_bytes())
            events = []
            for data in stream:
                events.append(data)
                if len(events) >= 3:
                    break
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
            killed_at = time.monotonic()
            events += list(stream)  # must end, not hang (timeout 60)
        assert time.monotonic() - killed_at < 60
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])
        assert error["error"]["code"] == "replica_died", events[-3:]
        # New requests flow to the survivor meanwhile (the router may learn of the death on a first try).
        for _ in range(4):
            try:
                text, _, replica, _ = stream_chat(client, base_url, [{"role": "user", "content": "Hi"}], 4,
                                                  timeout=60)
                survivors_ok += replica != victim and bool(text)
            except httpx.HTTPStatusError as exc:
                assert exc.response.status_code == 503  # the one that met the dead replica
    assert survivors_ok >= 3
    # Ray restarts it.
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        replicas = httpx.get(f"{base_url}/replicas", timeout=10).json()["replicas"]
        if len(replicas) == 2 and victim not in [r["actor"] for r in replicas]:
            break
        time.sleep(1)
    else:
        pytest.fail(f"the killed replica was not replaced: {replicas}")
    text, _, _, _ = stream_chat(httpx.Client(), base_url, [{"role": "user", "content": "Hi again"}], 4)
    assert text


def test_affinity_off_for_comparison(base_url: str) -> None:
    """The same replay through Ray's default router (power of two choices): recorded, for the docs."""
    serve.delete(APP_NAME)
    off = deploy(2, False, PORT)
    result = replay(off, conversations=4, turns=3, max_tokens=8, concurrency=1)
    print("affinity off:", result.summary())
    assert result.requests == 12 and not any(math.isnan(t) for t in result.ttft)
