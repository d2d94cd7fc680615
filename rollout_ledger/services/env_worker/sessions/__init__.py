"""The per-session model endpoint an agent episode calls: one conversation per episode, token-exact, in the wire
protocol the agent speaks.

- ``turns``: the protocol-neutral turn types (``TurnRequest``, ``TurnResult``, canonical messages, tool calls);
- ``session``: one episode's conversation with the policy, token-exact across its calls (segments on rewrites);
- ``dialects``: one module per wire protocol (Chat Completions, Responses, Anthropic Messages) over those types;
- ``app``: the HTTP app (``/sessions/{episode_id}/v1/...``), its keys, and the registry of open sessions.

The agents that call it (functions, harness processes) are the agent runtime's (``env_worker/agents/``).
"""
