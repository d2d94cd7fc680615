"""The one place nats-py's failures become ``BusError`` (rollout_ledger/shared/kit/bus.py): what passes is retryable, a
refusal is not (also when nats-py builds the error without its code, as its KV errors are), and anything else passes
through ``bus_errors`` unchanged."""

from __future__ import annotations

import nats.errors
import pytest
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError, ServiceUnavailableError

from rollout_ledger.shared.errors import BusError
from rollout_ledger.shared.kit import bus


@pytest.mark.parametrize(("exc", "retryable"), [
    (TimeoutError(), True),
    (nats.errors.NoRespondersError(), True),
    (ServiceUnavailableError(code=503, description="no leader"), True),
    (KeyWrongLastSequenceError(), False),
    (KeyNotFoundError(), False),
    (nats.errors.ConnectionClosedError(), False),
])
def test_what_passes_is_retryable_and_a_refusal_is_not(exc: Exception, retryable: bool) -> None:
    assert bus.is_retryable(exc) is retryable
    err = bus.as_bus_error(exc, "read a lease")
    assert err.retryable is retryable and str(err).startswith(f"read a lease failed: {type(exc).__name__}")


def test_bus_errors_converts_nats_failures_and_nothing_else() -> None:
    with pytest.raises(BusError) as err, bus.bus_errors("take a lease"):
        raise KeyWrongLastSequenceError()
    assert not err.value.retryable and isinstance(err.value.__cause__, KeyWrongLastSequenceError)
    with pytest.raises(ValueError, match="a bug"), bus.bus_errors("take a lease"):
        raise ValueError("a bug")


class _Answers:
    """A fake JetStream API request: raises each of ``failures`` in turn, then answers ``"ok"``."""

    def __init__(self, *failures: Exception) -> None:
        self.failures = list(failures)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "ok"


async def test_settled_retries_what_passes_until_the_server_answers() -> None:
    op = _Answers(nats.errors.TimeoutError(), ServiceUnavailableError(code=503, description="no meta leader"))
    assert await bus.settled(op, "create the stream RL_WORK", retry_for_s=10.0) == "ok"
    assert op.calls == 3


async def test_settled_raises_a_refusal_as_nats_raised_it_at_once() -> None:
    op = _Answers(BadRequestError(code=400, err_code=10058, description="stream name already in use"))
    with pytest.raises(BadRequestError):
        await bus.settled(op, "create the stream RL_WORK", retry_for_s=10.0)
    assert op.calls == 1


async def test_settled_gives_up_with_a_retryable_bus_error_when_its_time_is_spent() -> None:
    op = _Answers(*[nats.errors.TimeoutError() for _ in range(100)])
    with pytest.raises(BusError, match="create the stream RL_WORK failed: TimeoutError") as err:
        await bus.settled(op, "create the stream RL_WORK", retry_for_s=0.05)
    assert err.value.retryable and 1 <= op.calls < 100


@pytest.mark.parametrize("exc", [nats.errors.ConnectionClosedError(), nats.errors.MsgAlreadyAckdError(),
                                 TimeoutError(), BusError("ack failed", retryable=True), ConnectionResetError()])
def test_best_effort_drops_a_nats_failure(exc: Exception) -> None:
    with bus.best_effort("ack a finished item"):
        raise exc


def test_best_effort_raises_a_bug() -> None:
    with pytest.raises(TypeError, match="a bug"), bus.best_effort("ack a finished item"):
        raise TypeError("a bug")
