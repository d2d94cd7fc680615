"""The schema revision the code expects is the newest migration (rollout_ledger/shared/db.py does not import
rollout_ledger/migrations/)."""

from rollout_ledger.migrations.runner import head
from rollout_ledger.shared.db import SCHEMA_REVISION


def test_the_code_expects_the_newest_migration() -> None:
    assert head() == SCHEMA_REVISION, "a migration was added: move rollout_ledger/shared/db.py SCHEMA_REVISION to it"
