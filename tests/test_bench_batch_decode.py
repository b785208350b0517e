"""`treadle bench batch-decode`: a decode step of N sequences together beside the int8 roof."""

from __future__ import annotations

import pytest

from bench.batch_decode import decode_macs_per_token, measure, prompt_macs_per_token, report
from bench.synth import write_model
from decoding import load_model


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory, default_model):
    path = tmp_path_factory.mktemp("batch-decode") / "tiny.gguf"
    write_model("tiny", path, tokenizer=default_model.path)
    return path


def test_a_tokens_multiply_accumulates_are_its_matrices_and_the_lm_head(tiny_file):
    cfg = load_model(tiny_file).config
    per_layer = (cfg.q_dim + 2 * cfg.kv_dim) * cfg.dim + cfg.dim * cfg.q_dim + 3 * cfg.dim * cfg.hidden_dim
    assert decode_macs_per_token(cfg) == cfg.n_layers * per_layer + cfg.vocab_size * cfg.dim
    assert prompt_macs_per_token(cfg) == cfg.n_layers * per_layer


def test_each_level_gets_a_step_time_its_rate_and_where_its_time_went(tiny_file):
    results = measure(tiny_file, [1, 4], context=40, threads=2, steps=2, prompt_tokens=37)
    assert [level["streams"] for level in results["levels"]] == [1, 4]
    for level in results["levels"]:
        assert level["step_ms"] > 0 and level["gmacs"] == pytest.approx(
            level["streams"] * results["decode_macs_per_token"] / level["step_ms"] / 1e6)
        assert sum(level["phases"].values()) == pytest.approx(1.0) and "lm head" in level["phases"]
    probes = [results["probes"][when]["int8_gmacs"] for when in ("before", "after")]
    assert min(probes) > 0 and results["int8_gmacs"] == max(probes)  # the roof: the higher of the two
    table = report(results)
    assert "| 4 |" in table and "share of the roof" in table
    prompt = results["prompt"]
    cfg = load_model(tiny_file).config
    assert prompt["tokens"] == 37 and prompt["gmacs"] == pytest.approx(
        (37 * prompt_macs_per_token(cfg) + cfg.vocab_size * cfg.dim) / prompt["step_ms"] / 1e6)
    assert "lm head" in prompt["phases"] and "paged attention" in prompt["phases"]
    assert "| a 37-token prompt |" in table


def test_against_no_tiles_alternates_each_step_with_the_vnni_kernels_alone(tiny_file, monkeypatch):
    monkeypatch.setenv("TREADLE_AMX", "emulate")  # the tiles' path on any CPU, from one tile of 16 tokens
    results = measure(tiny_file, [4, 16], context=40, threads=2, steps=1, prompt_tokens=37, against_no_tiles=2)
    for level in (*results["levels"], results["prompt"]):
        assert level["no_tiles_step_ms"] > 0 and level["tiles_speedup"] > 0
    table = report(results)
    assert "the tiles' speedup" in table and f"{results['prompt']['tiles_speedup']:.2f}x |" in table
    assert "the tiles' speedup" not in report(measure(tiny_file, [4], context=40, threads=2, steps=1))


def test_against_one_row_alternates_the_prompt_with_attention_items_of_one_row(tiny_file):
    results = measure(tiny_file, [1], context=40, threads=2, steps=1, prompt_tokens=37, against_one_row=2)
    prompt = results["prompt"]
    assert prompt["attention_ms"] > 0 and prompt["one_row_attention_ms"] > 0 and prompt["rows_together_speedup"] > 0
    assert f"{prompt['rows_together_speedup']:.2f}x (medians of alternated rounds; the same logits)" in report(results)
    assert "items of one" not in report(measure(tiny_file, [1], context=40, threads=2, steps=1, prompt_tokens=37))
