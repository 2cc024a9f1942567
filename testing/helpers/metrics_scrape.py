"""A served driver's /metrics, scraped over HTTP and parsed as Prometheus parses it.

`scrape` fetches one exposition (200 OK and the text format's content type
or the test fails); `Scrape` holds its samples by name and labels, with
the family types, so a test asks for one sample or sums over labels.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]


class Scrape:
    """One parsed exposition: samples by name and labels, and the family types."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: dict[str, dict[Labels, float]] = {}
        self.types: dict[str, str] = {}
        for family in text_string_to_metric_families(text):  # raises on anything malformed
            self.types[family.name] = family.type
            for sample in family.samples:
                self.samples.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value

    def value(self, name: str, /, **labels: str) -> float:
        """The one sample of `name` with exactly `labels`."""
        found = self.samples.get(name, {}).get(frozenset(labels.items()))
        assert found is not None, f"no sample {name}{labels} in:\n{self.text}"
        return found

    def total(self, name: str, /, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        wanted = set(labels.items())
        return sum(v for key, v in self.samples.get(name, {}).items() if wanted <= set(key))

    def matching(self, name: str, /, **labels: str) -> list[Mapping[str, str]]:
        wanted = set(labels.items())
        return [dict(key) for key in self.samples.get(name, {}) if wanted <= set(key)]


async def scrape(port: int, path: str = "/metrics") -> Scrape:
    """GET `path` from the driver's metrics listener on 127.0.0.1:`port`, parsed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = response.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0]
    assert status == b"HTTP/1.1 200 OK", head.decode(errors="replace")
    assert b"text/plain; version=0.0.4" in head
    return Scrape(body.decode())
