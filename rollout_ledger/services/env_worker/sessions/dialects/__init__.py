"""The session endpoint's wire protocols, one module each, over the neutral turn types of ``sessions.turns``:

- ``chat``: OpenAI Chat Completions (``/v1/chat/completions``);
- ``responses``: the OpenAI Responses API (``/v1/responses``);
- ``messages``: the Anthropic Messages API (``/v1/messages``);
- ``sse``: server-sent events as they all write them.

A dialect parses its request into a ``TurnRequest`` (refusing what it cannot honour with an ``ApiError`` naming the
field), and writes a ``TurnResult`` as its response or stream and an ``ApiError`` in its error shape.
"""
