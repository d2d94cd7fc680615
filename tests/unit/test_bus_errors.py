"""The one place nats-py's failures become ``BusError`` (shared/kit/bus.py): what passes is retryable, a refusal is
not (also when nats-py builds the error without its code, as its KV errors are), and anything else passes through
``bus_errors`` unchanged."""

from __future__ import annotations

import nats.errors
import pytest
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, ServiceUnavailableError

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
