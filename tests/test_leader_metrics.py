"""``tangram_leader`` (issue 39) on two brokers that share a PostgreSQL store: the one that leads says 1 and the
one standing by says 0 on its ``/metrics``, so one query finds the leader."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.docker_nodes import new_broker_id
from tests.test_failover import broker_config
from tests.test_recovery import free_port, start_broker


async def leader_gauge(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(url + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    [value] = [sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "tangram_leader"]
    return value


async def leads(http: aiohttp.ClientSession, url: str) -> bool:
    async with http.get(url + "/readyz") as response:
        return response.status == 200


@pytest.mark.slow  # subprocess brokers: left out of the fast lane
async def test_the_leader_says_1_and_the_standby_0(postgres_url: str, run_dir: str, tmp_path: Path) -> None:
    ports = free_port(), free_port()
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    broker_id = new_broker_id()
    configs = [broker_config(tmp_path / f"b{i}.toml", postgres_url, broker_id, run_dir, port)
               for i, port in enumerate(ports)]
    brokers = [await start_broker(configs[0], ports[0])]
    try:
        async with aiohttp.ClientSession() as http:
            while not await leads(http, urls[0]):  # the first answers as a standby until it holds the lock
                await asyncio.sleep(0.05)
            brokers.append(await start_broker(configs[1], ports[1]))
            assert not await leads(http, urls[1])
            assert await leader_gauge(http, urls[0]) == 1
            assert await leader_gauge(http, urls[1]) == 0
    finally:
        for process in brokers:
            process.send_signal(signal.SIGTERM)
            await process.wait()
