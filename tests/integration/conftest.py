"""Fixtures of the integration tests: the chat tokenizer and the in-test policy (tests that drive an env worker),
and synchronous SQL on the test's database."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.chat import ChatTokenizer, load_chat_tokenizer
from tests.helpers import Sql
from tests.integration.policy import Policy


@pytest.fixture
def tok(model_dir: str) -> ChatTokenizer:
    return load_chat_tokenizer(model_dir)


@pytest.fixture
async def policy(nc: bus.NATS, tok: ChatTokenizer) -> AsyncIterator[Policy]:
    """A started ``Policy`` on the test's NATS; released (held requests answered) and stopped after the test."""
    p = await Policy(nc, tok).start()
    yield p
    p.release.set()
    await p.stop()


@pytest.fixture
def sql(database_url: str) -> Iterator[Sql]:
    """Synchronous SQL on the test's database (closed after the test)."""
    s = Sql(database_url)
    yield s
    s.close()
