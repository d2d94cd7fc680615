"""A three-node JetStream cluster on loopback (``PrivateNatsCluster``, rollout_ledger/cli/stack/servers.py) with the
service users of rollout_ledger/shared/nats_auth.py: streams and buckets at 3 replicas (an existing single-replica
topology is scaled up), and the bus helpers riding out the loss of a stream's leader: fetches fail with a retryable
``BusError`` and go on after the election, publishes are tried again until stored, and nothing is lost or stored
twice."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_ledger.cli.stack.servers import PrivateNatsCluster
from rollout_ledger.shared.errors import BusError, InfraError
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.publisher import StreamPublisher
from rollout_ledger.shared.subjects import BUCKETS, EVENTS_STREAM, STREAMS, ConsumerSpec, event_subject

ALL_STREAMS = [*(s.name for s in STREAMS), *(f"KV_{b}" for b in BUCKETS)]


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[PrivateNatsCluster]:
    """Three clustered nats-server nodes with authorization on, stopped after the test."""
    cluster = PrivateNatsCluster(tmp_path / "nats", 3, auth=True)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_cluster_needs_three_nodes(tmp_path: Path) -> None:
    with pytest.raises(InfraError, match="at least 3 nodes"):
        PrivateNatsCluster(tmp_path, 2)


async def test_topology_at_three_replicas_scales_an_existing_one_up(nats_cluster: PrivateNatsCluster) -> None:
    assert nats_cluster.url.count(",") == 2 and nats_cluster.url.startswith("nats://127.0.0.1:")
    nc = await bus.connect(nats_cluster.url, name="test-topology", security=nats_cluster.security(), initial_wait_s=10)
    try:
        js = nc.jetstream()
        await bus.ensure_topology(js, replicas=1)  # what a single server's deployment left behind
        assert (await js.stream_info(EVENTS_STREAM)).config.num_replicas == 1
        await bus.ensure_topology(js, replicas=3)
        for name in ALL_STREAMS:
            assert (await js.stream_info(name)).config.num_replicas == 3, name
        await asyncio.to_thread(nats_cluster.wait_current, ALL_STREAMS, 60.0)
        placement = nats_cluster.placement(EVENTS_STREAM)
        assert placement is not None and placement.current
        assert {placement.leader, *placement.replicas} == {"n0", "n1", "n2"}
        # a durable consumer follows its stream's replica count (num_replicas 0 = the stream's)
        spec = ConsumerSpec(stream=EVENTS_STREAM, durable="test-replicas", filter_subject=event_subject(">"),
                            ack_wait_s=5, max_deliver=-1, max_ack_pending=100, description="test")
        await bus.ensure_consumer(js, spec)
        info = await js.consumer_info(EVENTS_STREAM, "test-replicas")
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2
    finally:
        await nc.close()


async def test_publish_and_fetch_ride_out_the_stream_leaders_kill(nats_cluster: PrivateNatsCluster) -> None:
    nc = await bus.connect(nats_cluster.url, name="test-election", security=nats_cluster.security(),
                           initial_wait_s=10)
    publisher = StreamPublisher(nc, ack_timeout_s=2.0, retry_for_s=bus.RETRY_FOR_S)
    try:
        js = nc.jetstream()
        await bus.ensure_topology(js, replicas=3)
        await asyncio.to_thread(nats_cluster.wait_current, [EVENTS_STREAM], 60.0)
        spec = ConsumerSpec(stream=EVENTS_STREAM, durable="test-election", filter_subject=event_subject("test"),
                            ack_wait_s=5, max_deliver=-1, max_ack_pending=1000, description="test")
        await bus.ensure_consumer(js, spec)
        psub = await js.pull_subscribe_bind("test-election", EVENTS_STREAM)
        total, received, fetch_errors = 300, set[str](), list[BusError]()

        async def consume() -> None:
            deadline = time.monotonic() + 90
            while len(received) < total and time.monotonic() < deadline:
                try:
                    msgs = await bus.fetch(psub, 50, timeout=0.5)
                except BusError as exc:
                    assert exc.retryable, exc  # an election passes: never a reason to stop
                    fetch_errors.append(exc)
                    await asyncio.sleep(0.1)
                    continue
                for msg in msgs:
                    received.add((msg.headers or {})["Nats-Msg-Id"])
                    await msg.ack()

        leader = nats_cluster.leader_of(EVENTS_STREAM)
        assert leader, "the stream has a leader before the fault"

        async def produce() -> None:
            acks = []
            for i in range(total):
                acks.append(await publisher.publish_nowait("test", f"ev-{i}", b"x"))
                if i == total // 3:
                    nats_cluster.kill(leader)
                await asyncio.sleep(0.01)
            await asyncio.gather(*acks)  # every publish stored, through the election
            nats_cluster.restart(leader)

        consumer = asyncio.create_task(consume())
        await produce()
        await consumer
        assert received == {f"ev-{i}" for i in range(total)}
        info = await js.stream_info(EVENTS_STREAM, subjects_filter=event_subject("test"))
        assert (info.state.subjects or {}).get(event_subject("test")) == total  # each once: deduplicated
        # the election was seen (and ridden out): a fetch answered 503 or a publish was sent again
        assert fetch_errors or publisher.retries, "the leader's kill went unnoticed"
        print(f"fetch errors during the election: {len(fetch_errors)}, publishes sent again: {publisher.retries}")
        await asyncio.to_thread(nats_cluster.wait_current, [EVENTS_STREAM], 60.0)
    finally:
        await publisher.stop()
        await nc.close()


async def test_a_refusal_is_not_retried() -> None:
    assert bus.is_retryable(TimeoutError())
    assert not bus.is_retryable(ValueError("not a bus failure"))
    started = time.monotonic()

    async def refused() -> None:
        from nats.js.errors import BadRequestError

        raise BadRequestError(code=400, description="bad request")

    with pytest.raises(BusError) as err:
        await bus.retrying(refused, "a refused request", retry_for_s=30)
    assert not err.value.retryable and time.monotonic() - started < 1.0


def test_a_port_taken_before_the_bind_is_drawn_again(tmp_path: Path) -> None:
    cluster = PrivateNatsCluster(tmp_path / "nats", 3)
    route_port = int(cluster.nodes[1].extra_conf.split("listen: 127.0.0.1:")[1].split()[0])
    with socket.socket() as squatter:  # another process took the port meanwhile
        squatter.bind(("127.0.0.1", route_port))
        squatter.listen()
        cluster.start()
        try:
            assert f"127.0.0.1:{route_port}" not in cluster.nodes[1].extra_conf.split("routes:")[0]
            assert cluster.wait_meta_leader(10.0) in {"n0", "n1", "n2"}
        finally:
            cluster.stop()
