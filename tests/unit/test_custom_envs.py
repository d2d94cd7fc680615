"""Unit tests of user env classes (rollout_ledger/services/envs/custom.py): ``ROLLOUT_ENV_CLASSES`` and the
``rollout_ledger.envs`` entry points (a real distribution on a temporary sys.path entry), the gymnasium adapter with
sync and async classes, and every start-up check. Through a real stack: tests/integration/test_library_envs.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from rollout_ledger.services.env_worker.main import build_envs
from rollout_ledger.services.env_worker.settings import EnvWorkerSettings
from rollout_ledger.services.envs import custom
from rollout_ledger.services.envs.base import EnvContext
from rollout_ledger.services.envs.custom import EnvClassError, GymEnv, load_user_classes, parse_env_classes
from rollout_ledger.shared.errors import EnvError
from tests import envs_user


def settings(**fields: Any) -> EnvWorkerSettings:
    return EnvWorkerSettings(rg_datasets="none", **fields)


def install_entry_points(root: Path, monkeypatch: pytest.MonkeyPatch, entries: dict[str, str],
                         dist: str = "my_envs") -> None:
    """A distribution ``dist`` declaring ``entries`` in the group ``rollout_ledger.envs``, on sys.path."""
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "\n".join(f"{name} = {value}" for name, value in entries.items())
    (info / "entry_points.txt").write_text(f"[rollout_ledger.envs]\n{lines}\n")
    monkeypatch.syspath_prepend(str(root))


def test_the_setting_is_parsed() -> None:
    assert parse_env_classes(" a=tests.envs_user:SyncAdder, b = pkg.mod:Outer.Inner ,") == {
        "a": "tests.envs_user:SyncAdder", "b": "pkg.mod:Outer.Inner"}
    for bad in ("a", "a=tests.envs_user", "=m:C", "a=:C", "a=m:", "a=m:C,a=m:D"):
        with pytest.raises(EnvClassError, match="ROLLOUT_ENV_CLASSES"):
            parse_env_classes(bad)
    with pytest.raises(ValidationError, match="ROLLOUT_ENV_CLASSES entry 'adder': expected name=module:Class"):
        settings(env_classes="adder")


async def test_a_sync_class_from_the_setting() -> None:
    specs = {s.name: s for s in custom.specs(settings(env_classes="adder=tests.envs_user:SyncAdder"))}
    spec = specs["adder"]
    assert (spec.multi_turn, spec.example_task, spec.family) == (False, {"a": 12, "b": 7}, "")
    assert spec.description == "Adds two numbers: one turn, reward 1.0 when the last integer of the answer is the sum."
    env = spec.factory()
    assert isinstance(env, GymEnv)
    assert await env.reset({"a": 2, "b": 3}) == [{"role": "user", "content": "What is 2 + 3?"}]
    assert env.tools() is None
    right = await env.step("It is 5")
    assert (right.reward, right.terminated, right.truncated, right.observation) == (1.0, True, False, [])
    assert right.info == {"expected": 5, "parsed": 5}
    await env.close()
    assert env.env.closed
    seeded = [await spec.factory().reset({"seed": 4}) for _ in range(2)]  # the task's seed is reset's seed
    assert seeded[0] == seeded[1]


async def test_an_async_multi_turn_class_bound_to_its_episode() -> None:
    spec = custom.specs(settings(env_classes="guess=tests.envs_user:AsyncGuess"))[0]
    assert spec.multi_turn and spec.example_task == {"seed": 1, "high": 10, "tries": 6}
    env = spec.factory()
    env.bind(EnvContext(episode_id="b.0.0", batch_id="b", attempt=1))
    assert await env.reset({"seed": 1, "high": 10, "tries": 2}) == [
        {"role": "user", "content": "Guess a number between 1 and 10."}]
    assert isinstance(env, GymEnv) and env.env.context.episode_id == "b.0.0"
    secret = env.env.secret
    wrong = await env.step(f"{secret - 1 if secret > 1 else secret + 1}")
    assert not wrong.terminated and not wrong.truncated and wrong.reward == 0.0
    assert wrong.observation[0]["content"] in ("No, higher.", "No, lower.")
    assert (await env.step(str(secret))).reward == 1.0
    env2 = spec.factory()
    await env2.reset({"seed": 1, "tries": 1})
    last = await env2.step("none")
    assert last.truncated and not last.terminated


async def test_tools_a_native_env_and_bad_returns() -> None:
    specs = {s.name: s for s in custom.specs(settings(
        env_classes="tooled=tests.envs_user:WithTools,echo=tests.envs_user:NativeEcho,"
                    "old=tests.envs_user:FourTuple"))}
    tooled = specs["tooled"].factory()
    await tooled.reset({})
    assert [t["function"]["name"] for t in tooled.tools() or []] == ["add"]
    echo = specs["echo"].factory()
    assert isinstance(echo, envs_user.NativeEcho)  # our own Env, used as it is
    await echo.reset({"text": "hi"})
    assert (await echo.step("hi there")).reward == 1.0
    old = specs["old"].factory()
    await old.reset({})
    with pytest.raises(EnvError, match=r"step must return \(observation, reward, terminated, truncated, info\)"):
        await old.step("1")
    with pytest.raises(EnvError, match="the observation must be a str or chat messages"):
        custom.observation_messages(42, "x: step")
    assert custom.observation_messages({"role": "tool", "content": "3"}, "x") == [{"role": "tool", "content": "3"}]
    assert custom.observation_messages("", "x") == [] and custom.observation_messages(None, "x") == []


async def test_classes_from_an_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_entry_points(tmp_path, monkeypatch, {"ep-adder": "tests.envs_user:SyncAdder",
                                                 "ep-guess": "tests.envs_user:AsyncGuess"})
    specs = {s.name: s for s in custom.specs(settings())}
    assert set(specs) == {"ep-adder", "ep-guess"}
    env = specs["ep-adder"].factory()
    await env.reset({"a": 1, "b": 1})
    assert (await env.step("2")).reward == 1.0
    # the setting takes a name an entry point declares; build_envs registers them beside the built-ins
    envs = build_envs(settings(env_classes="ep-adder=tests.envs_user:WithTools"))
    assert {"ep-adder", "ep-guess", "arithmetic"} <= set(envs.names())
    assert envs.get("ep-adder").description.startswith("The adder, with a tool schema")


async def test_a_broken_entry_point_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_entry_points(tmp_path, monkeypatch, {"broken": "tests.envs_user:NoStep"}, dist="broken_envs")
    with pytest.raises(EnvClassError, match=r"entry point broken = tests.envs_user:NoStep \(group "
                                            r"rollout_ledger.envs, distribution broken_envs\): NoStep has no step"):
        load_user_classes("")


@pytest.mark.parametrize(("value", "message"), [
    ("x=tests.no_such_module:Env", "ROLLOUT_ENV_CLASSES entry x=tests.no_such_module:Env: cannot import "
                                   "tests.no_such_module: ModuleNotFoundError"),
    ("x=tests.envs_user:Missing", "tests.envs_user has no Missing"),
    ("x=tests.envs_user:NOT_A_CLASS", "tests.envs_user:NOT_A_CLASS is a int, not a class"),
    ("x=tests.envs_user:NoStep", "NoStep has no step() (a gymnasium-style env has reset(seed=None, options=None)"),
    ("x=tests.envs_user:OldReset", "OldReset.reset(self, task: 'dict[str, Any]') -> 'tuple[str, dict[str, Any]]' "
                                   "cannot be called as reset(seed=..., options=...)"),
    ("x=tests.envs_user:StepWithoutAction", "cannot be called as step(action)"),
    ("x=tests.envs_user:NeedsArguments", "NeedsArguments() needs arguments"),
    ("x=tests.envs_user:AbstractEnv", "AbstractEnv is abstract (implement step)"),
    ("arithmetic=tests.envs_user:SyncAdder", "the env 'arithmetic' clashes with a built-in env"),
    ("rg:mine=tests.envs_user:SyncAdder", "takes the prefix of a library env family"),
])
def test_each_misfit_stops_the_worker_with_a_clear_error(value: str, message: str) -> None:
    with pytest.raises(EnvClassError) as err:
        build_envs(settings(env_classes=value))
    assert message in str(err.value)
    assert str(err.value).startswith("ROLLOUT_ENV_CLASSES entry ")
