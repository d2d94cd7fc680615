"""The agent runtime: agents (Python functions, or harness processes such as Claude Code and Codex) run as episodes
against the worker's session endpoint (``sessions``).

- ``outcome``: a run and what came of it, as plain data;
- ``run``: loading ``name=module:attr`` entries and running one call of an agent function;
- ``command``: a harness process as an agent (its environment points it at the session; exit code, deadline, kill);
- ``process``: an agent process (many runs on one event loop, over a socket to its worker);
- ``pool``: the worker's pool of agent processes;
- ``episode``: one agent episode attempt against its session (outcomes, resume by replay);
- ``runtime``: the worker's agents, where their runs go, and the session server.
"""
