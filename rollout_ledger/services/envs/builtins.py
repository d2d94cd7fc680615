"""The built-in environments, as one registry (what an env worker and the envserver serve by default)."""

from __future__ import annotations

from rollout_ledger.services.envs.arithmetic import SPEC as ARITHMETIC
from rollout_ledger.services.envs.fixed_turns import SPEC as FIXED_TURNS
from rollout_ledger.services.envs.guess_number import SPEC as GUESS_NUMBER
from rollout_ledger.services.envs.registry import EnvRegistry
from rollout_ledger.services.envs.retail import SPEC as RETAIL


def builtin_registry() -> EnvRegistry:
    """A registry holding the built-in environments."""
    return EnvRegistry([ARITHMETIC, GUESS_NUMBER, FIXED_TURNS, RETAIL])
