"""Codex CLI (npm ``@openai/codex``, pinned in package.json here) as an agent: ``codex exec`` (one task, then it
exits) in the episode's fresh working directory, its model provider the episode's session on the Responses API,
its reward the file the task asks for (``verifier.file_reward``).

    ROLLOUT_AGENTS="codex=examples.harnesses.codex:CODEX"
    task: {"prompt": "Write hello into answer.txt", "path": "answer.txt", "expected": "hello"}

The provider is declared on the command line (``-c model_providers.rollout...``: the session's base URL, the key
from ``OPENAI_API_KEY``, ``wire_api = "responses"``, no retries: a retried call would be another turn), so nothing
is written to its config. Its ``CODEX_HOME`` is under the episode's own ``HOME``. Every model call is a
``POST /v1/responses`` (streamed) with Codex's instructions and tools: one turn of the episode. Offline: analytics,
feedback and OpenTelemetry export off, no update check, web search off, by its own config keys, and its plugins
feature off (at start it syncs a plugin marketplace from GitHub and ChatGPT otherwise). Sub-agents are off too: a
sub-agent's calls would interleave with the episode's own conversation (each a new segment); the session accepts
their ``namespace`` tool, so leaving them on works too.
"""

from __future__ import annotations

from examples.harnesses.npm import codex_executable
from examples.harnesses.verifier import file_reward, task_files
from rollout_ledger.services.env_worker.agents.command import CommandAgent

PROVIDER = [
    "-c", 'model_provider="rollout"',
    "-c", 'model_providers.rollout.name="rollout-ledger session"',
    "-c", 'model_providers.rollout.base_url="{base_url}"',
    "-c", 'model_providers.rollout.env_key="OPENAI_API_KEY"',
    "-c", 'model_providers.rollout.wire_api="responses"',
    "-c", "model_providers.rollout.request_max_retries=0",
    "-c", "model_providers.rollout.stream_max_retries=0",
    "-c", 'model="policy"',
]
"""The session as Codex's model provider."""

OFFLINE = [
    "-c", "analytics.enabled=false",
    "-c", "feedback.enabled=false",
    "-c", "check_for_update_on_startup=false",
    "-c", 'otel.exporter="none"',
    "-c", 'otel.trace_exporter="none"',
    "-c", 'otel.metrics_exporter="none"',
    "-c", 'web_search="disabled"',
]
"""Codex's own switches for every request that is not a model call."""

FEATURES = [
    "--disable", "plugins",  # its plugin marketplace sync (github.com, api.github.com, chatgpt.com at start)
    "--disable", "multi_agent",  # sub-agents: their calls would interleave with the episode's conversation
]
"""Codex features turned off."""

CODEX = CommandAgent(
    argv=[codex_executable(), "exec", "--skip-git-repo-check", "--sandbox", "workspace-write", "--color", "never",
          "--strict-config", *FEATURES, *PROVIDER, *OFFLINE, "{prompt}"],
    env={"RUST_LOG": "error"},  # its CODEX_HOME: ~/.codex, under the episode's own HOME
    files=task_files,
    reward=file_reward,
    description="Codex CLI (codex exec) on the session's Responses API",
)
