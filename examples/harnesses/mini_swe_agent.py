"""mini-swe-agent (PyPI ``mini-swe-agent``, pinned in the ``dev`` extra) as an agent: its ``mini`` command, unmodified,
in the episode's fresh working directory, its model an OpenAI-compatible one (litellm's ``openai/`` provider) on the
episode's session, its reward the file the task asks for (``verifier.file_reward``).

    ROLLOUT_AGENTS="mini=examples.harnesses.mini_swe_agent:MINI_SWE_AGENT"
    task: {"prompt": "Write hello into answer.txt", "path": "answer.txt", "expected": "hello"}

mini's default agent (no confirmations, it ends when a command prints ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``)
runs each bash tool call the policy makes in the working directory; every model call is a Chat Completions call
with its ``bash`` tool, one turn of the episode. Offline: litellm uses its bundled cost map and fetches nothing
(``LITELLM_LOCAL_MODEL_COST_MAP``, ``LITELLM_OFFLINE_MODE``), the cost tracking of an unknown model is off (its
``cost_tracking: ignore_errors`` and ``cost_limit: 0``), and mini's first-run setup is skipped.
"""

from __future__ import annotations

from examples.harnesses.verifier import file_reward, task_files
from rollout_ledger.services.env_worker.agents.command import CommandAgent

MINI_SWE_AGENT = CommandAgent(
    argv=["{python}", "-m", "minisweagent.run.mini", "--agent-class", "default", "--model", "openai/policy",
          "--task", "{prompt}", "--output", "{home}/trajectory.json",
          "--config", "mini.yaml", "--config", "agent.cost_limit=0", "--config", "agent.step_limit=20",
          "--config", "model.cost_tracking=ignore_errors", "--config", "model.model_kwargs.api_base={base_url}"],
    env={
        "MSWEA_CONFIGURED": "true",  # no interactive first-run setup
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_COST_TRACKING": "ignore_errors",  # the policy is no model litellm knows the price of
        "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",  # a retried call would be one more turn of the episode
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # the bundled cost map: nothing fetched at import
        "LITELLM_OFFLINE_MODE": "true",  # nor any other catalog or tokenizer litellm would fetch itself
        "HF_HUB_OFFLINE": "1",
    },
    files=task_files,
    reward=file_reward,
    description="mini-swe-agent (mini, default agent) on the session's Chat Completions",
)
