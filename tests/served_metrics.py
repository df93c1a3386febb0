"""A served pdserve's /metrics as the HTTP tests read it: every sample by name and labels, and
whether the cluster is idle (every KV block free, no request left at the coordinator)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metric_samples(url: str) -> dict[str, float]:
    """Samples of /metrics by name and labels: {'name{a="b"}': value}."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def idle(url: str) -> bool:
    """Every KV block free (as the nodes' last heartbeats reported them) and no request left at
    the coordinator."""
    m = metric_samples(url)
    free = sum(v for k, v in m.items() if k.startswith("pdserve_kv_blocks_free{"))
    total = sum(v for k, v in m.items() if k.startswith("pdserve_kv_blocks_total{"))
    busy = m["pdserve_requests_running"] + m["pdserve_requests_waiting"]
    return total > 0 and free == total and busy == 0
