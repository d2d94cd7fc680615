"""The inference worker: serves turn requests over NATS from an engine (fake now, vLLM later)."""
