"""The prefix cache's host-memory and disk tiers: every block they bring back holds exactly the KV of
the tokens it is looked up for — across evictions, restarts, and corrupt, truncated or foreign files.

The KV arrays themselves are the shadow here: each slot's "key" holds the token and the position
written there, so a block copied out to host memory or to disk and back carries them, and a sequence
reading its context through its block table checks what every tier served.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache.batch import build_batch_arrays
from kvcache.disk_tier import HEADER_BYTES, SUFFIX
from kvcache.manager import KVCacheManager
from kvcache.prefix_tiers import PrefixTiers, TierSettings, namespace
from kvcache.storage import KVCacheSpec, KVCacheStorage

NUM_BLOCKS = 8
BLOCK_SIZE = 4
MAX_MODEL_LEN = 32
SPEC = KVCacheSpec(n_layers=2, n_kv_heads=1, head_dim=2, block_size=BLOCK_SIZE, dtype="float32")
BLOCK_BYTES = SPEC.bytes_per_block
MODEL = b"model fingerprint"[:16]
ROOT = namespace(MODEL, SPEC.dtype, BLOCK_SIZE, "exact")

SHARED_PREFIXES = [[7, 1, 4, 4, 2, 9, 3, 3, 5, 0, 8, 6, 1, 2, 2, 7, 3, 9, 0, 4], [5] * 20, [1, 2, 3, 4] * 5]
prompts = st.builds(
    lambda prefix, length, tail: prefix[:length] + tail,
    st.sampled_from(SHARED_PREFIXES),
    st.integers(0, 20),
    st.lists(st.integers(0, 3), max_size=6),
).filter(bool)


def new_cache(directory: Path | None, ram_blocks: int, disk_blocks: int = 64,
              root: bytes = ROOT, model: bytes = MODEL) -> tuple[KVCacheManager, KVCacheStorage, PrefixTiers]:
    storage = KVCacheStorage.allocate(SPEC, NUM_BLOCKS)
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN, root_hash=root)
    disk_bytes = disk_blocks * (HEADER_BYTES + BLOCK_BYTES)
    tiers = PrefixTiers(storage, TierSettings(ram_blocks * BLOCK_BYTES, directory, disk_bytes, flush_seconds=10),
                        root, model, "exact")
    kv.attach_tiers(tiers)
    return kv, storage, tiers


def write_kv(storage: KVCacheStorage, slots: np.ndarray, token_ids: list[int], positions: np.ndarray) -> None:
    """What a model step does to the cache, reduced to its identity: the token and position of each
    slot, on every layer, in keys and values."""
    blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    for layer in range(SPEC.n_layers):
        storage.key_cache[layer, 0, blocks, 0, offsets] = token_ids
        storage.key_cache[layer, 0, blocks, 1, offsets] = positions
        storage.value_cache[layer, 0, blocks, offsets, 0] = token_ids
        storage.value_cache[layer, 0, blocks, offsets, 1] = positions


def written(token_ids: list[int]) -> list[tuple[int, int]]:
    """What a context of these tokens holds: each token at its position."""
    return [(token, position) for position, token in enumerate(token_ids)]


def read_context(kv: KVCacheManager, storage: KVCacheStorage, seq_id: int, num_tokens: int) -> list[tuple]:
    positions = np.arange(num_tokens)
    slots = kv.block_table(seq_id)[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    context = []
    for layer in range(SPEC.n_layers):
        keys = storage.key_cache[layer, 0, blocks, :, offsets]
        values = storage.value_cache[layer, 0, blocks, offsets, :]
        assert np.array_equal(keys, values), "keys and values of a slot came from different writes"
        context.append([(int(t), int(p)) for t, p in keys])
    assert all(layer == context[0] for layer in context), "the layers of a block came from different writes"
    return context[0]


class TieredCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="treadle-tiers-"))
        self.kv, self.storage, self.tiers = new_cache(self.directory, ram_blocks=3)
        self.token_ids: dict[int, list[int]] = {}
        self.pending_prompt: dict[int, list[int]] = {}
        self.next_seq_id = 0
        self.num_tier_hits = 0

    @rule(prompt=prompts)
    def allocate(self, prompt: list[int]) -> None:
        if not self.kv.can_allocate(prompt):
            return
        self.next_seq_id += 1
        seq_id = self.next_seq_id
        tier_hits_before = self.kv.stats.num_tier_hit_blocks
        num_cached = self.kv.allocate(seq_id, prompt)
        self.num_tier_hits += self.kv.stats.num_tier_hit_blocks - tier_hits_before
        assert num_cached % BLOCK_SIZE == 0 and num_cached < len(prompt)
        self.token_ids[seq_id] = prompt[:num_cached]
        self.pending_prompt[seq_id] = prompt[num_cached:]
        # whatever the pool or a tier served holds exactly these tokens at these positions
        assert read_context(self.kv, self.storage, seq_id, num_cached) == written(prompt[:num_cached])

    @precondition(lambda self: self.token_ids)
    @rule(data=st.data(), chunk=st.integers(1, 7), sampled_token=st.integers(0, 3))
    def step(self, data: st.DataObject, chunk: int, sampled_token: int) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.token_ids)))
        pending = self.pending_prompt[seq_id]
        new_tokens = pending[:chunk] if pending else [sampled_token]
        num_tokens = len(self.token_ids[seq_id]) + len(new_tokens)
        if num_tokens > MAX_MODEL_LEN or -(-num_tokens // BLOCK_SIZE) > NUM_BLOCKS:
            return
        if not self.kv.can_append(seq_id, len(new_tokens)):
            return
        copies = self.kv.append_slots(seq_id, new_tokens)
        self.storage.copy_blocks(copies)
        arrays = build_batch_arrays(self.kv, [seq_id], [len(new_tokens)])
        write_kv(self.storage, arrays.slot_mapping, new_tokens, arrays.positions)
        self.token_ids[seq_id] += new_tokens
        del pending[: len(new_tokens) if pending else 0]

    @precondition(lambda self: self.token_ids)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.token_ids)))
        self.kv.free(seq_id)
        del self.token_ids[seq_id], self.pending_prompt[seq_id]

    @rule(first_token=st.integers(1000, 1100))
    def flood(self, first_token: int) -> None:
        """A prompt of fresh tokens as long as the free pool: every cached block is evicted to the tiers."""
        num_tokens = min(self.kv.pool.num_available_blocks * BLOCK_SIZE, MAX_MODEL_LEN)
        if num_tokens < 1:
            return
        self.next_seq_id += 1
        prompt = list(range(first_token, first_token + num_tokens))
        num_cached = self.kv.allocate(self.next_seq_id, prompt)
        rest = prompt[num_cached:]
        self.storage.copy_blocks(self.kv.append_slots(self.next_seq_id, rest))
        arrays = build_batch_arrays(self.kv, [self.next_seq_id], [len(rest)])
        write_kv(self.storage, arrays.slot_mapping, rest, arrays.positions)
        self.kv.free(self.next_seq_id)

    @rule()
    def restart(self) -> None:
        """A graceful shutdown (the disk gets what it lacks) and a new process: an empty pool and host
        memory, the disk as it was left."""
        for seq_id in list(self.token_ids):
            self.kv.free(seq_id)
        self.token_ids.clear()
        self.pending_prompt.clear()
        assert self.kv.flush_tiers()
        self.tiers.close()
        self.kv, self.storage, self.tiers = new_cache(self.directory, ram_blocks=3)

    @rule(data=st.data(), how=st.sampled_from(["truncate", "flip a payload byte", "flip a header byte", "empty"]))
    def damage_a_file(self, data: st.DataObject, how: str) -> None:
        """A crash mid-write on a filesystem without rename atomicity, a bad disk, a stray tool."""
        assert self.tiers.disk is not None
        assert self.tiers.disk.flush(10)
        files = sorted(p for p in self.directory.iterdir() if p.name.endswith(SUFFIX))
        if not files:
            return
        # a block is dropped, not written, while the writer's queue is full: timing, so the file count may
        # differ when hypothesis replays a case (which it refuses as flaky); draw a number independent of it
        path = files[data.draw(st.integers(min_value=0, max_value=1 << 16)) % len(files)]
        content = bytearray(path.read_bytes())
        if how == "truncate":
            content = content[: len(content) // 2]
        elif how == "empty":
            content = bytearray()
        elif len(content) > 40:
            index = len(content) - 3 if how == "flip a payload byte" else 30
            content[index] ^= 0x55
        path.write_bytes(bytes(content))

    @invariant()
    def every_sequence_reads_its_own_context(self) -> None:
        for seq_id, token_ids in self.token_ids.items():
            assert read_context(self.kv, self.storage, seq_id, len(token_ids)) == written(token_ids)

    def teardown(self) -> None:
        self.tiers.close()
        shutil.rmtree(self.directory, ignore_errors=True)


TieredCacheMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None,
                                                suppress_health_check=[HealthCheck.filter_too_much])
TestTieredCache = TieredCacheMachine.TestCase


def fill(kv: KVCacheManager, storage: KVCacheStorage, seq_id: int, prompt: list[int]) -> int:
    """Admit and prefill a prompt in one step; returns how many of its tokens were found cached."""
    num_cached = kv.allocate(seq_id, prompt)
    rest = prompt[num_cached:]
    kv.append_slots(seq_id, rest)
    arrays = build_batch_arrays(kv, [seq_id], [len(rest)])
    write_kv(storage, arrays.slot_mapping, rest, arrays.positions)
    return num_cached


def test_a_prefix_evicted_from_the_pool_comes_back_from_host_memory(tmp_path):
    kv, storage, tiers = new_cache(None, ram_blocks=8)
    system = list(range(100, 124))  # 6 blocks
    fill(kv, storage, 1, [*system, 1])
    kv.free(1)
    fill(kv, storage, 2, list(range(200, 229)))  # 8 blocks: evicts every block of the first prompt
    kv.free(2)
    assert kv.pool.match_prefix([*system, 2], 6)[0] == [], "the pool no longer holds the system prompt"
    assert len(tiers.host) == 6
    assert fill(kv, storage, 3, [*system, 2]) == 24
    assert read_context(kv, storage, 3, 24) == written(system)
    assert tiers.ram.hits == 6 and kv.stats.num_tier_hit_blocks == 6
    assert len(tiers.host) == 6 - 6 + 6, "blocks taken back left the host tier; the second prompt's came in"


def test_blocks_written_through_survive_a_crash_and_a_restart(tmp_path):
    kv, storage, tiers = new_cache(tmp_path, ram_blocks=0)
    system = list(range(100, 124))
    fill(kv, storage, 1, [*system, 1])
    kv.append_slots(1, [9])  # the next step proves the prefill ran: its blocks are published
    assert tiers.disk is not None and tiers.disk.flush(10)
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 6
    # a crash: nothing is flushed or closed; a new process maps the same directory
    kv2, storage2, tiers2 = new_cache(tmp_path, ram_blocks=0)
    assert tiers2.disk is not None and tiers2.disk.num_blocks == 6
    assert fill(kv2, storage2, 1, [*system, 3]) == 24
    assert read_context(kv2, storage2, 1, 24) == written(system)
    assert tiers2.counters("disk").hits == 6
    tiers.close()
    tiers2.close()


def test_a_graceful_shutdown_writes_what_the_disk_lacks(tmp_path):
    kv, storage, tiers = new_cache(tmp_path, ram_blocks=8)
    assert tiers.disk is not None
    tiers.disk.max_pending_bytes = 0  # a disk that cannot keep up: every write-through is dropped
    system, other = list(range(100, 124)), list(range(200, 229))
    fill(kv, storage, 1, [*system, 1])
    kv.free(1)
    fill(kv, storage, 2, other)  # evicts the system prompt into host memory
    assert tiers.disk.flush(10) and not list(tmp_path.glob(f"*{SUFFIX}"))
    assert tiers.disk.stats.num_dropped_writes > 0 and len(tiers.host) == 6
    kv.free(2)  # the shutdown ends every request (publishing its computed blocks), then flushes:
    assert kv.flush_tiers()  # host memory's six and the pool's seven reach the disk
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 6 + 7
    tiers.close()
    kv2, storage2, tiers2 = new_cache(tmp_path, ram_blocks=8)
    assert fill(kv2, storage2, 1, [*system, 2]) == 24
    kv2.free(1)
    assert fill(kv2, storage2, 2, [*other[:28], 5]) == 28
    tiers2.close()


def system_prompt_on_disk(directory: Path) -> tuple[KVCacheManager, list[int]]:
    """A server computed a 6-block system prompt, wrote it to `directory` and stopped; its manager
    (its pool still indexes the blocks) and the prompt."""
    kv, storage, tiers = new_cache(directory, ram_blocks=0)
    system = list(range(100, 124))
    fill(kv, storage, 1, [*system, 1])
    kv.free(1)
    assert kv.flush_tiers()
    tiers.close()
    return kv, system


@pytest.mark.parametrize("other", ["model", "dtype", "block size", "kernels", "code"])
def test_files_of_another_configuration_are_ignored_removed_and_logged_once(tmp_path, caplog, other):
    system_prompt_on_disk(tmp_path)
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 6
    model, dtype, block_size, kernels = MODEL, "float32", BLOCK_SIZE, "exact"
    if other == "model":
        model = b"another model...."[:16]
    elif other == "dtype":
        dtype = "float16"
    elif other == "block size":
        block_size = 8
    elif other == "kernels":
        kernels = "fast"
    root = namespace(model, dtype, block_size, kernels) if other != "code" else b"\x01" * 16
    spec = KVCacheSpec(n_layers=2, n_kv_heads=1, head_dim=2, block_size=block_size, dtype=dtype)
    storage2 = KVCacheStorage.allocate(spec, NUM_BLOCKS)
    with caplog.at_level(logging.WARNING, logger="kvcache.disk_tier"):
        tiers2 = PrefixTiers(storage2, TierSettings(0, tmp_path, 1 << 30), root, model, kernels)
    warnings = [r for r in caplog.records if "ignored and removed" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert not list(tmp_path.glob(f"*{SUFFIX}")), "foreign blocks are removed"
    assert tiers2.disk is not None and tiers2.disk.num_blocks == 0 and tiers2.disk.stats.num_rejected == 6
    tiers2.close()


def test_a_corrupt_file_found_at_lookup_is_a_miss_and_is_removed(tmp_path, caplog):
    kv, system = system_prompt_on_disk(tmp_path)
    kv2, storage2, tiers2 = new_cache(tmp_path, ram_blocks=0)  # the scan reads headers only
    hashes = [h for h, _ in kv.pool.hashed_blocks()]
    third = tmp_path / f"{hashes[2].hex()}{SUFFIX}"
    content = bytearray(third.read_bytes())
    content[-1] ^= 0xFF
    third.write_bytes(bytes(content))
    with caplog.at_level(logging.WARNING, logger="kvcache.disk_tier"):
        assert fill(kv2, storage2, 1, [*system, 1]) == 8, "the two blocks before the corrupt one are served"
    assert read_context(kv2, storage2, 1, 25)[:24] == written(system)
    assert "checksum mismatch" in caplog.text
    assert tiers2.disk is not None and tiers2.disk.stats.num_rejected == 1
    tiers2.close()


def test_two_servers_share_a_directory(tmp_path):
    kv_a, storage_a, tiers_a = new_cache(tmp_path, ram_blocks=0)
    kv_b, storage_b, tiers_b = new_cache(tmp_path, ram_blocks=0)
    system = list(range(100, 124))
    fill(kv_a, storage_a, 1, [*system, 1])
    kv_a.free(1)
    assert kv_a.flush_tiers()
    assert fill(kv_b, storage_b, 1, [*system, 2]) == 24, "B finds what A wrote after B started"
    assert read_context(kv_b, storage_b, 1, 24) == written(system)
    for path in tmp_path.glob(f"*{SUFFIX}"):
        path.unlink()  # A evicted them (or an operator cleared the directory)
    kv_b.free(1)
    kv_b.clear_prefix_cache()
    assert fill(kv_b, storage_b, 2, [*system, 3]) == 0, "vanished files are misses, not errors"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    tiers_a.close()
    tiers_b.close()


def test_the_disk_tier_keeps_within_its_bound_least_recently_used_first(tmp_path):
    kv, storage, tiers = new_cache(tmp_path, ram_blocks=0, disk_blocks=4)
    first, second = list(range(100, 108)), list(range(200, 208))
    fill(kv, storage, 1, [*first, 1])
    kv.free(1)
    fill(kv, storage, 2, [*second, 1])
    kv.free(2)
    assert kv.flush_tiers()
    kv.pool.forget_prefixes()  # the pool forgets; the disk keeps its four
    assert fill(kv, storage, 3, [*first, 2]) == 8  # touches the first prompt's files
    kv.free(3)
    third = list(range(300, 308))
    fill(kv, storage, 4, [*third, 1])
    kv.free(4)
    assert kv.flush_tiers()
    assert tiers.disk is not None and tiers.disk.num_blocks == 4 and tiers.disk.stats.num_evictions == 2
    names = {p.name for p in tmp_path.glob(f"*{SUFFIX}")}
    kv.pool.forget_prefixes()
    assert fill(kv, storage, 5, [*first, 3]) == 8, "the recently used prompt stayed"
    kv.free(5)
    kv.pool.forget_prefixes()
    assert fill(kv, storage, 6, [*second, 3]) == 0, "the least recently used went"
    assert len(names) == 4
    tiers.close()


def test_clear_empties_every_tier(tmp_path):
    kv, storage, tiers = new_cache(tmp_path, ram_blocks=8)
    system = list(range(100, 124))
    fill(kv, storage, 1, [*system, 1])
    kv.free(1)
    fill(kv, storage, 2, list(range(200, 229)))  # evicts the system prompt into host memory
    kv.free(2)
    assert kv.flush_tiers()
    cleared = kv.clear_prefix_cache()
    assert cleared["pool"] == 7 and cleared["ram"] == 6 and cleared["disk"] == 13
    assert fill(kv, storage, 3, [*system, 2]) == 0
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(SUFFIX)]
    tiers.close()


def test_a_directory_that_fails_costs_the_cache_not_the_server(tmp_path, caplog):
    directory = tmp_path / "cache"
    kv, storage, tiers = new_cache(directory, ram_blocks=0)
    shutil.rmtree(directory)  # an operator's cleanup, an unmounted volume: every write now fails
    system = list(range(100, 124))
    with caplog.at_level(logging.WARNING, logger="kvcache.disk_tier"):
        fill(kv, storage, 1, [*system, 1])
        kv.free(1)
        assert kv.flush_tiers()
    assert "could not be written" in caplog.text
    assert len([r for r in caplog.records if "could not be written" in r.getMessage()]) == 1, "logged once"
    kv.pool.forget_prefixes()
    assert fill(kv, storage, 2, [*system, 2]) == 0
    tiers.close()


# ---- through the engine, on a real model -------------------------------------------------------------

SYSTEM_TEXT = ("You are a careful assistant for a weaving cooperative. You answer questions about looms, yarn, "
               "dyes, patterns and the history of the craft, briefly and accurately, and you say so when you do "
               "not know. ") * 3
FLOOD_TEXT = "Numbers, colours and the names of rivers: " + ", ".join(f"river {i} is blue" for i in range(60))


@pytest.mark.parametrize(("kernels", "kv_dtype"), [("fast", "auto"), ("exact", "auto"), ("fast", "int8"),
                                                   ("exact", "int8")])
def test_a_prefix_from_any_tier_gives_the_tokens_a_cold_computation_gives(default_model, tmp_path, kernels,
                                                                          kv_dtype):
    from decoding.engine.engine import Engine, EngineConfig
    from decoding.engine.params import SamplingParams

    tok = default_model.tokenizer
    prompt = tok.encode(SYSTEM_TEXT + "Question: what is a heddle?")
    flood = tok.encode(FLOOD_TEXT)
    assert len(prompt) > 8 * 16 and len(flood) > 20 * 16
    requests = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)]
    config = EngineConfig(num_kv_blocks=28, kernels=kernels, kv_cache_dtype=kv_dtype, prefix_cache_ram_mb=64,
                          prefix_cache_dir=str(tmp_path), max_num_seqs=2)

    def answers(engine: Engine) -> list[tuple[list[int], int]]:
        """Each request's tokens and how many prompt tokens it found computed."""
        results = []
        for params in requests:
            (out,) = engine.generate(prompt, params)
            results.append((out.token_ids, out.usage.cached_tokens))
        return results

    cold = Engine(default_model, EngineConfig(num_kv_blocks=28, kernels=kernels, kv_cache_dtype=kv_dtype,
                                              enable_prefix_caching=False)).start()
    try:
        expected = [tokens for tokens, _ in answers(cold)]
    finally:
        cold.shutdown()

    engine = Engine(default_model, config).start()
    try:
        tiers = engine.kv.tiers
        assert tiers is not None and tiers.disk is not None
        first = answers(engine)  # the first computes the prompt, the second finds it in the pool
        assert [tokens for tokens, _ in first] == expected
        assert first[0][1] == 0 and first[1][1] > 0
        engine.generate(flood, SamplingParams(max_tokens=1))  # evicts the prompt's blocks to host memory
        assert tiers.counters("ram").hits == 0
        from_ram = answers(engine)
        assert [tokens for tokens, _ in from_ram] == expected
        assert tiers.counters("ram").hits > 0 and from_ram[0][1] >= len(prompt) - 32
    finally:
        engine.shutdown()  # writes to disk what it lacks

    restarted = Engine(default_model, config).start()
    try:
        from_disk = answers(restarted)
        assert [tokens for tokens, _ in from_disk] == expected
        assert restarted.kv.tiers.counters("disk").hits > 0 and from_disk[0][1] >= len(prompt) - 32
    finally:
        restarted.shutdown()


def test_a_failed_step_publishes_nothing_into_any_tier(default_model, tmp_path):
    from decoding.engine.engine import Engine, EngineConfig
    from decoding.engine.params import SamplingParams

    prompt = default_model.tokenizer.encode(SYSTEM_TEXT)
    engine = Engine(default_model, EngineConfig(num_kv_blocks=28, kernels="exact", prefix_cache_ram_mb=64,
                                                prefix_cache_dir=str(tmp_path))).start()
    try:
        def fail(scheduled):
            raise RuntimeError("injected fault")

        engine.fault_hook = fail
        (failed,) = engine.generate(prompt, SamplingParams(max_tokens=4))
        assert failed.finish_reason == "error"
        engine.fault_hook = None
        assert engine.kv.flush_tiers()
        assert not list(tmp_path.glob(f"*{SUFFIX}")) and len(engine.kv.tiers.host) == 0
        assert engine.kv.pool.hashed_blocks() == []
        (served,) = engine.generate(prompt, SamplingParams(max_tokens=4))
        assert served.finish_reason == "length" and served.usage.cached_tokens == 0
        assert engine.kv.flush_tiers()
        assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == (len(prompt) + 3) // 16  # the answer so far too
    finally:
        engine.shutdown()
