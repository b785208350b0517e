"""Prometheus text (a server's /metrics) read into {sample: value}, with prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def parse_metrics(text: str, sum_over: str | None = None) -> dict[str, float]:
    """Every sample, keyed `name{label="value",...}` with the labels sorted (or just `name`). With
    `sum_over` (e.g. "replica"), samples that differ only in that label are summed into one."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != sum_over)
            key = f"{s.name}{{{labels}}}" if labels else s.name
            samples[key] = samples.get(key, 0.0) + s.value
    return samples
