"""A live broker's ``/metrics`` as samples a test can look up by name and labels."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.harness import Live


class Scrape:
    """One scrape's samples."""

    def __init__(self, exposition: str) -> None:
        self.samples = [sample for family in text_string_to_metric_families(exposition) for sample in family.samples]

    def value(self, name: str, **labels: str) -> float | None:
        """The sample ``name`` with exactly these labels (None: not exported)."""
        return next((sample.value for sample in self.samples if sample.name == name and sample.labels == labels),
                    None)

    def labelled(self, name: str) -> list[dict[str, str]]:
        """The label sets ``name`` is exported with."""
        return [sample.labels for sample in self.samples if sample.name == name]


async def scrape(live: Live) -> Scrape:
    status, exposition = await live.call("GET", "/metrics")
    assert status == 200, exposition
    return Scrape(exposition)
