"""bench/prometheus.py: /metrics text into {sample: value}, and summed over the replicas of `serve --ray`."""

from __future__ import annotations

from bench.prometheus import parse_metrics

# As app/ray/deployment.py aggregates replicas: HELP/TYPE once, each replica's samples relabelled.
AGGREGATED = """# HELP treadle_prompt_tokens Prompt tokens
# TYPE treadle_prompt_tokens counter
treadle_prompt_tokens_total{replica="a"} 3.0
# HELP treadle_request_success Finished requests
# TYPE treadle_request_success counter
treadle_request_success_total{replica="a",finish_reason="stop"} 1.0
treadle_prompt_tokens_total{replica="b"} 4.0
treadle_request_success_total{replica="b",finish_reason="stop"} 2.0
treadle_request_success_total{replica="b",finish_reason="length"} 5.0
treadle_replicas_up 2
"""


def test_samples_are_keyed_by_name_and_sorted_labels():
    samples = parse_metrics(AGGREGATED)
    assert samples['treadle_request_success_total{finish_reason="stop",replica="a"}'] == 1.0
    assert samples['treadle_prompt_tokens_total{replica="b"}'] == 4.0
    assert samples["treadle_replicas_up"] == 2.0


def test_summing_over_a_label_keeps_the_other_labels_apart():
    assert parse_metrics(AGGREGATED, sum_over="replica") == {
        "treadle_prompt_tokens_total": 7.0, 'treadle_request_success_total{finish_reason="stop"}': 3.0,
        'treadle_request_success_total{finish_reason="length"}': 5.0, "treadle_replicas_up": 2.0}
