"""Where ``make harnesses`` installs the pinned npm harnesses (``package.json`` here): ``.build/harnesses`` of the
repository, or ``ROLLOUT_HARNESSES_DIR``; and the native executables inside their platform packages (each CLI's
npm entry point is a wrapper around one)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NODE_MODULES = Path(os.environ.get("ROLLOUT_HARNESSES_DIR") or REPO / ".build" / "harnesses") / "node_modules"
_ARCH = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine().lower(), "x64")


def claude_executable() -> str:
    """Claude Code's native ``claude`` from ``@anthropic-ai/claude-code-linux-<arch>`` (what the wrapper package's
    postinstall copies over its ``bin/claude.exe`` stub; used directly, it does not depend on that script)."""
    return str(NODE_MODULES / "@anthropic-ai" / f"claude-code-linux-{_ARCH}" / "claude")


def codex_executable() -> str:
    """Codex CLI's native ``codex`` from ``@openai/codex-linux-<arch>`` (what ``bin/codex.js`` starts)."""
    triple = {"x64": "x86_64", "arm64": "aarch64"}[_ARCH] + "-unknown-linux-musl"
    return str(NODE_MODULES / "@openai" / f"codex-linux-{_ARCH}" / "vendor" / triple / "bin" / "codex")
