"""Env-aware routing, the pure parts: route tokens and consumer names (rollout_ledger/shared/subjects.py), adverts and
routes of a worker's envs and the fair split of its free slots (rollout_ledger/services/env_worker/routing.py), and the
scheduler's reading of adverts (rollout_ledger/services/scheduler/route_book.py) on an in-memory bucket."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from nats.js.errors import KeyNotFoundError

from rollout_ledger.services.env_worker.routing import FairSlots, adverts, routes_of
from rollout_ledger.services.envs.base import EnvSpec
from rollout_ledger.services.envs.builtins import builtin_registry
from rollout_ledger.services.scheduler import route_book
from rollout_ledger.shared import subjects as sj
from rollout_ledger.shared.nats_auth import may
from rollout_ledger.shared.route_advert import RouteAdvert
from tests.helpers import until


def _spec(name: str, family: str = "") -> EnvSpec:
    return EnvSpec(name=name, factory=lambda: None, description=f"the {name} env",
                   multi_turn=False, example_task={"q": name}, family=family)


FAMILY = [_spec("fam:alpha", "fam"), _spec("fam:beta", "fam"), _spec("fam:gamma.v2", "fam")]
"""A fake parametrised family (the real ``rg`` one is registered by rollout_ledger/services/envs/reasoning_gym.py)."""


@pytest.mark.parametrize("route", ["arithmetic", "guess-number", "remote:echo", "openenv:echo_env", "rg",
                                   "a.b*c>d/e\\f g=h", "émoji-🙂", "x" * 100])
def test_route_tokens_are_one_safe_token_and_reversible(route: str) -> None:
    token = sj.route_token(route)
    assert sj.route_of_token(token) == route
    assert all(c.isascii() and (c.isalnum() or c in "-_=") for c in token), token
    subject = sj.work_subject(route)
    assert subject.split(".")[:3] == ["rl", "work", "episodes"] and len(subject.split(".")) == 4
    assert may(sj.WORK_ROUTES, subject) and not may(sj.WORK_SUBJECT, subject)
    consumer = sj.work_consumer(route)
    assert not any(c in consumer for c in ".*> /\\"), "a consumer name NATS accepts"
    assert sj.work_consumer_subject(consumer) == subject


def test_distinct_routes_never_share_a_subject() -> None:
    routes = ["a:b", "a=3Ab", "a_b", "a-b", "A:b", "a::b", "a.b", "a=2Eb"]
    assert len({sj.work_subject(r) for r in routes}) == len(routes)


@pytest.mark.parametrize("name", ["recorder", "env-workers-", "env-workersX", "env-workers-a=3a", "env-workers-a=",
                                  "env-workers-a=ZZ", "env-workers-a.b", "env-workers-a=2", "ENV-WORKERS-a"])
def test_only_canonical_work_consumers_have_a_subject(name: str) -> None:
    """The recorder trusts a max-deliveries advisory only for a consumer name this code could have made."""
    assert sj.work_consumer_subject(name) is None


def test_the_legacy_consumer_keeps_the_previous_single_subject() -> None:
    assert sj.work_consumer_subject(sj.WORK_CONSUMER) == sj.WORK_SUBJECT == "rl.work.episodes"
    assert sj.work_max_deliveries_advisory(sj.WORK_CONSUMER) == sj.WORK_MAX_DELIVERIES_ADVISORY
    assert may(sj.WORK_MAX_DELIVERIES_ADVISORIES, sj.work_max_deliveries_advisory(sj.work_consumer("remote:x")))
    (work,) = [s for s in sj.STREAMS if s.name == sj.WORK_STREAM]
    assert work.subjects == [sj.WORK_SUBJECT, sj.WORK_ROUTES] and work.retention == "workqueue"


def test_a_family_is_one_advert_listing_its_members_and_routed_as_one() -> None:
    specs = [*builtin_registry().specs(), *FAMILY]
    routes = routes_of(specs, agents=["my-agent"])
    assert routes["fam"] == ["fam:alpha", "fam:beta", "fam:gamma.v2"]
    assert routes["arithmetic"] == ["arithmetic"] and routes["my-agent"] == ["my-agent"]
    ads = adverts(specs, "w1")
    assert "fam:alpha" not in ads, "members are not advertised one by one"
    fam = ads["fam:*"]
    assert fam["members"] == ["fam:alpha", "fam:beta", "fam:gamma.v2"]
    assert (fam["route"], fam["family"], fam["registered_by"]) == ("fam", "fam", "w1")
    assert ads["guess-number"]["route"] == "guess-number" and ads["guess-number"]["multi_turn"] is True


class MemoryKV:
    """The two KeyValue calls the scheduler's routing.py makes (``get``), on a dict."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = {sj.env_key(k): v if isinstance(v, bytes) else orjson.dumps(v) for k, v in values.items()}

    async def get(self, key: str) -> Any:
        if key not in self.values:
            raise KeyNotFoundError

        class Entry:
            value = self.values[key]
        return Entry()


async def test_the_scheduler_resolves_routes_from_adverts() -> None:
    ads = adverts([*builtin_registry().specs(), *FAMILY], "w1")
    kv: Any = MemoryKV({**ads, "remote:echo": {"name": "remote:echo"}, "by-hand": b"not json",
                        "my-agent": {"name": "my-agent", "kind": "agent"}})
    assert await route_book.resolve(kv, "arithmetic") == (True, "arithmetic")
    assert await route_book.resolve(kv, "fam:beta") == (True, "fam")
    assert await route_book.resolve(kv, "fam:gamma.v2") == (True, "fam")
    assert await route_book.resolve(kv, "fam:delta") == (False, "fam"), "not listed (by the last advert): routed"
    assert await route_book.resolve(kv, "other:delta") == (False, "other:delta")
    assert await route_book.resolve(kv, "remote:echo") == (True, "remote:echo"), "an advert without a route"
    assert await route_book.resolve(kv, "by-hand") == (True, "by-hand")
    assert await route_book.resolve(kv, "my-agent") == (True, "my-agent")
    assert await route_book.resolve(kv, "nope") == (False, "nope")
    assert RouteAdvert.family_entry("fam:*") is None and RouteAdvert.family_entry("x") is None


def test_a_route_advert_reads_back_what_a_worker_wrote() -> None:
    ads = adverts([*builtin_registry().specs(), *FAMILY], "w1")
    fam = RouteAdvert.parse("fam:*", orjson.dumps(ads["fam:*"]))
    assert fam == RouteAdvert.for_family("fam", ["fam:alpha", "fam:beta", "fam:gamma.v2"])
    assert RouteAdvert.parse("arithmetic", orjson.dumps(ads["arithmetic"])) == RouteAdvert.for_env("arithmetic",
                                                                                                    "arithmetic")
    assert RouteAdvert.parse("by-hand", b"not json") == RouteAdvert("by-hand", None)
    assert RouteAdvert.parse("odd", orjson.dumps({"route": 3, "members": "x"})) == RouteAdvert("odd", None)
    assert RouteAdvert.family_entry("fam:beta") == "fam:*"


def test_served_means_a_live_worker_runs_the_env() -> None:
    live = [route_book.LiveWorker("w1", ["arithmetic", "fam"], ["arithmetic", "fam:alpha"])]
    assert route_book.served(live, "fam:alpha") and route_book.served(live, "arithmetic")
    assert not route_book.served(live, "fam:beta") and not route_book.served(live, "guess-number")
    assert not route_book.served([], "arithmetic")


def test_fair_slots_never_ask_for_more_than_is_free() -> None:
    held = [0]
    slots = FairSlots(capacity=8, batch=64, in_use=lambda: held[0])
    # nothing found yet: every route keeps a probe of one item open
    assert [slots.grant(r) for r in ("a", "b", "c")] == [1, 1, 1]
    assert slots.free() == 8, "probes hold no slot back"
    slots.settle("a", 1, 1)
    held[0] += 1  # a's item runs
    slots.settle("b", 1, 0)
    slots.settle("c", 1, 0)
    # a found work: it may take every free slot (b and c are idle)
    assert slots.grant("a") == 7 and slots.grant("b") == 0, "no slot left for b's probe"
    slots.settle("a", 7, 7)
    held[0] += 7
    assert slots.free() == 0 and slots.grant("c") == 0


def test_fair_slots_share_evenly_between_busy_routes() -> None:
    held = [0]
    slots = FairSlots(capacity=64, batch=64, in_use=lambda: held[0])
    for route in ("a", "b"):
        slots.settle(route, slots.grant(route), 1)
        held[0] += 1
    a, b = slots.grant("a"), slots.grant("b")
    assert a == b == 31, (a, b)
    slots.settle("a", a, 0)
    slots.settle("b", b, b)
    held[0] += b
    # a came back empty: it probes again; b takes the free slots
    assert slots.grant("a") == 1
    assert slots.grant("b") == 64 - held[0]


def test_fair_slots_respect_the_fetch_batch() -> None:
    slots = FairSlots(capacity=100, batch=5, in_use=lambda: 0)
    slots.settle("a", slots.grant("a"), 1)
    assert slots.grant("a") == 5


def test_idle_routes_probes_do_not_hold_slots_from_a_busy_route() -> None:
    """A worker with more routes than slots: every idle route probes, and a route with work still gets every slot
    that does not run an episode."""
    held = [0]
    slots = FairSlots(capacity=4, batch=64, in_use=lambda: held[0])
    assert [slots.grant(r) for r in ("a", "b", "c", "d", "e", "f")] == [1] * 6
    slots.settle("a", 1, 1)  # a's probe found work
    held[0] += 1
    assert slots.grant("a") == 3


async def test_a_notify_before_the_wait_starts_is_not_lost() -> None:
    held = [1]
    slots = FairSlots(capacity=1, batch=1, in_use=lambda: held[0])
    assert slots.grant("b") == 0
    changed = slots.changed()  # b takes it at once; its wait starts later, after the running episode ended
    held[0] = 0
    slots.notify()
    assert changed.is_set()
    assert slots.grant("b") == 1


async def test_a_busy_route_among_more_idle_routes_than_slots_is_served() -> None:
    """The pull loop of env_worker/worker.py on FairSlots, with fake pulls: 8 routes, 4 slots, work on the last
    route only. Probes take turns (first come first served), so the busy route is found and drained."""
    import asyncio

    from rollout_ledger.services.env_worker.pull_loop import _first

    tasks: set[asyncio.Task[None]] = set()
    slots = FairSlots(capacity=4, batch=1, in_use=lambda: len(tasks))
    queued = {f"r{i}": 0 for i in range(8)} | {"r7": 30}
    stop = asyncio.Event()
    peak = [0]

    async def fetch(route: str, n: int) -> int:
        if queued[route]:
            k = min(n, queued[route])
            queued[route] -= k
            return k
        await asyncio.sleep(0.01)  # an empty pull waits (fetch_timeout_s)
        return 0

    def done(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        slots.notify()

    async def pull(route: str) -> None:
        while not stop.is_set():
            granted = slots.grant(route)
            if granted <= 0:
                changed = slots.changed()
                await _first(changed.wait(), stop.wait())
                continue
            got = await fetch(route, granted)
            for _ in range(got):
                task = asyncio.create_task(asyncio.sleep(0.005))
                tasks.add(task)
                task.add_done_callback(done)
            peak[0] = max(peak[0], len(tasks))
            slots.settle(route, granted, got)
            if not got:
                await asyncio.sleep(0)

    pullers = [asyncio.create_task(pull(r)) for r in queued]
    await until(lambda: not queued["r7"] and not tasks, 30, "route r7's queue emptied and its tasks done")
    stop.set()
    await asyncio.gather(*pullers)
    assert queued["r7"] == 0 and peak[0] <= 4
