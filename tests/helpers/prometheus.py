"""Reading an exporter's scrape in tests with prometheus_client's own text parser."""

from __future__ import annotations

import socket

from prometheus_client.parser import text_string_to_metric_families


def sample(text: str, name: str, **labels: str) -> float:
    """The one sample of series ``name`` in a scrape whose labels include ``labels``; every sample of ours also
    carries a ``run`` (the fit's id) and a ``host`` (the machine's name), checked here."""
    found = [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, f"{len(found)} samples of {name} with {labels} in:\n{text[:2000]}"
    assert found[0].labels.get("run") and found[0].labels.get("host") == socket.gethostname(), found[0].labels
    return float(found[0].value)
