"""Claude Code (npm ``@anthropic-ai/claude-code``, pinned in package.json here) as an agent: ``claude -p`` (print
mode, one task, then it exits) in the episode's fresh working directory, its Anthropic API the episode's session
(``ANTHROPIC_BASE_URL``, the key as ``ANTHROPIC_API_KEY``), its reward the file the task asks for
(``verifier.file_reward``).

    ROLLOUT_AGENTS="claude=examples.harnesses.claude_code:CLAUDE_CODE"
    task: {"prompt": "Write hello into answer.txt", "path": "answer.txt", "expected": "hello"}

Every model call is a Messages API call (streamed) with Claude Code's system prompt and tools: one turn of the
episode. Its tools run in the working directory (``--allowedTools``: the ones it may use without asking; print mode
has nobody to ask). Offline: ``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC`` (telemetry, error reporting, auto-update,
release notes, feature flags), each of those switches also set by its own name, no plugin marketplace install, no
feedback survey; ``HOME`` is the episode's own, so no user's settings, hooks or MCP servers are read.
"""

from __future__ import annotations

from examples.harnesses.npm import claude_executable
from examples.harnesses.verifier import file_reward, task_files
from rollout_ledger.services.env_worker.agents.command import CommandAgent

OFFLINE = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_UPDATES": "1",
    "DISABLE_BUG_COMMAND": "1",
    "DISABLE_GROWTHBOOK": "1",
    "DISABLE_INSTALLATION_CHECKS": "1",
    "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
    "CLAUDE_CODE_DISABLE_OFFICIAL_MARKETPLACE_AUTOINSTALL": "1",
    "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",  # no billing line (with a per-build hash) at the top of the system prompt
}
"""Claude Code's own switches for every request that is not a model call."""

CLAUDE_CODE = CommandAgent(
    argv=[claude_executable(), "-p", "{prompt}", "--output-format", "json", "--model", "policy",
          "--max-turns", "8", "--allowedTools", "Bash,Read,Write,Edit", "--strict-mcp-config"],
    env={**OFFLINE,
         "ANTHROPIC_MODEL": "policy", "ANTHROPIC_SMALL_FAST_MODEL": "policy",  # any background call: the policy too
         "ANTHROPIC_DEFAULT_HAIKU_MODEL": "policy",
         "CLAUDE_CODE_MAX_RETRIES": "0"},  # a retried call would be one more turn of the episode
    files=task_files,
    reward=file_reward,
    description="Claude Code (claude -p) on the session's Messages API",
)
