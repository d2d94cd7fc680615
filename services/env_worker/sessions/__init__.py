"""Agents as environments: a per-session OpenAI-compatible endpoint and the agent functions that call it.

- ``protocol``: the OpenAI chat-completions wire format (requests validated into ``ChatRequest``, messages
  normalised, errors in the OpenAI shape);
- ``mapping``: model text <-> OpenAI messages (hermes tool calls, logprobs, responses and SSE chunks);
- ``session``: one episode's conversation with the policy, token-exact across its calls (segments on rewrites);
- ``app``: the HTTP app (``/sessions/{episode_id}/v1/...``) and the registry of open sessions;
- ``agents``: loading ``async def run(task, client)`` by ``module:function`` and running it as an episode.
"""
