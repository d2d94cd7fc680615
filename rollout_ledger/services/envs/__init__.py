"""The environment library the env worker and the envserver share: the ``Env`` protocol (``base``), the registry,
the built-ins, tool calls and remote environment actors."""
