"""The prefix tiers through a real server: a long system prompt comes back from host memory and, after
a restart, from disk, with the same answer; /metrics shows every tier; /v1/cache/clear empties them."""

from __future__ import annotations

import json
import tempfile

import httpx
import pytest
from openai import OpenAI

from tests.conftest_server import API_KEY, TreadleServer

SYSTEM = ("You are the archivist of a weaving cooperative. You keep records of every loom, every yarn lot "
          "and every pattern, and you answer in one short sentence. ") * 6


def ask(server: TreadleServer, question: str) -> tuple[str, int]:
    """The answer and the prompt tokens the server found computed."""
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY)
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct", max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    return reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens


def flood(server: TreadleServer) -> None:
    """A prompt of other text as long as the pool: the system prompt's blocks leave it."""
    text = " ".join(f"entry {i}: a skein of undyed wool" for i in range(23))
    httpx.post(f"{server.base_url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
               json={"prompt": text, "max_tokens": 1}, timeout=120).raise_for_status()


@pytest.fixture
def cache_dir(tmp_path):
    return tmp_path / "kv"


def start(cache_dir) -> TreadleServer:
    # 20 blocks of 16 tokens: the system prompt and the flood cannot both stay in the pool
    return TreadleServer(["--num-kv-blocks", "20", "--max-num-seqs", "2", "--prefix-cache-ram-mb", "64",
                          "--prefix-cache-dir", str(cache_dir), "--api-key", API_KEY], API_KEY).wait_ready()


def test_a_system_prompt_comes_back_from_memory_then_from_disk_after_a_restart(cache_dir):
    server = start(cache_dir)
    try:
        assert "prefix cache beyond the KV pool: 64 MiB in host memory" in server.log()
        cold, cached = ask(server, "What do you keep?")
        assert cached == 0
        again, cached = ask(server, "What do you keep?")
        assert again == cold and cached > 200  # from the pool
        flood(server)
        before = server.metrics()
        from_ram, cached = ask(server, "What do you keep?")
        after = server.metrics()
        assert from_ram == cold and cached > 200
        ram_hits = 'treadle_prefix_cache_tier_hits_total{tier="ram"}'
        assert after[ram_hits] - before[ram_hits] >= 10
        for tier in ("pool", "ram", "disk"):
            assert f'treadle_prefix_cache_tier_capacity_bytes{{tier="{tier}"}}' in after
        assert after['treadle_prefix_cache_tier_written_bytes_total{tier="disk"}'] > 0
    finally:
        server.stop()  # SIGTERM: the disk gets what it lacks
    assert "prefix cache on disk:" in server.log() and "all written" in server.log()

    restarted = start(cache_dir)
    try:
        from_disk, cached = ask(restarted, "What do you keep?")
        assert from_disk == cold and cached > 200
        assert restarted.metrics()['treadle_prefix_cache_tier_hits_total{tier="disk"}'] >= 10
    finally:
        restarted.stop()


def test_cache_clear_needs_the_key_refuses_parameters_and_empties_every_tier(cache_dir):
    server = start(cache_dir)
    try:
        url = f"{server.base_url}/v1/cache/clear"
        ask(server, "Which looms are there?")
        flood(server)  # the system prompt now sits in host memory (and on disk)
        assert httpx.post(url, timeout=30).status_code == 401
        refused = httpx.post(url, headers=server.headers, json={"tiers": ["ram"]}, timeout=30)
        assert refused.status_code == 400 and "no parameters" in refused.json()["error"]["message"]
        cleared = httpx.post(url, headers=server.headers, timeout=30)
        assert cleared.status_code == 200, cleared.text
        blocks = cleared.json()["cleared_blocks"]
        assert blocks["pool"] > 0 and blocks["ram"] > 0 and blocks["disk"] > 0
        assert not list(cache_dir.glob("*.kvb"))
        _, cached = ask(server, "Which looms are there?")
        assert cached == 0, "nothing of the prompt is found after a clear"
        assert httpx.get(f"{server.base_url}/health", timeout=10).json()["status"] == "ok"
    finally:
        server.stop()


def test_the_benchmark_prints_its_table_and_writes_json(tmp_path, capsys, monkeypatch):
    from bench import prefix_tiers
    from decoding.model.registry import DEFAULT_MODEL, resolve_model_path

    model, _ = resolve_model_path(DEFAULT_MODEL)
    out = tmp_path / "tiers.json"
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    assert prefix_tiers.main([str(model), "--system-tokens", "96", "--agents", "2", "--agent-tokens", "64",
                              "--json", str(out)]) == 0
    assert list(temp.iterdir()) == []  # its servers' logs and the disk tier's directory are gone
    result = json.loads(out.read_text())
    single = result["single"]
    assert single["ram_hit_blocks"] >= 5 and single["disk_hit_blocks"] >= 5
    assert set(result["mixed"]) >= {"tiers off", "tiers on"}
    assert "host memory" in capsys.readouterr().out
