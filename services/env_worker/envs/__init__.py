"""Environments the env worker runs in process: the protocol, the registry and the built-ins."""

from rollout_ledger.services.env_worker.envs.base import Env, Message, StepResult, TaskError
from rollout_ledger.services.env_worker.envs.registry import EnvRegistry, EnvSpec, UnknownEnvError, builtin_registry

__all__ = ["Env", "EnvRegistry", "EnvSpec", "Message", "StepResult", "TaskError", "UnknownEnvError",
           "builtin_registry"]
