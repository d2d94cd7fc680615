"""The layout shows the architecture, and stays that way: one package root, ``rollout_ledger/``, holds the contract
(``shared/``), the services (``services/``), the migrations, the client package (``client/``) and the CLI (``cli/``).
The import graph of its modules (read from the source with ``ast``, lazy imports inside functions included) has no
cycles, ``shared/`` imports no service, a service imports no other service (the catalog is shared by all, the env
library ``services/envs/`` by the services that run or read envs, and neither imports any service), the client package
``client/`` imports only itself and ``shared/`` (the exporter, which writes its feed to files, is the one service that
imports it), only the CLI imports ``cli/``, and the agent endpoint's session speaks no wire protocol (its dialects are
modules of their own, and the agent runtime is a room of its own beside the endpoint)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "rollout_ledger"
TOPS = ("cli", "client", "shared", "services", "migrations")
SHARED_BETWEEN_SERVICES = {"catalog"}
"""Service areas any service may import."""
ENV_LIBRARY = "envs"
ENV_LIBRARY_USERS = {"env_worker", "envserver", "exporter"}
"""The services that may import the env library: the env worker and the env server run its envs; the exporter reads
tool calls with its parser (atif.py)."""


def test_one_package_root_holds_the_project() -> None:
    """``rollout_ledger/`` is a real package (the wheel's, mypy's and the tests' import root, no mapping of folders):
    it holds the five top folders, each a package, and no Python package sits beside it at the repository's top."""
    assert (PACKAGE / "__init__.py").is_file()
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(TOPS)
    assert all((PACKAGE / top / "__init__.py").is_file() for top in TOPS)
    beside = {p.name for p in PACKAGE.parent.iterdir() if (p / "__init__.py").is_file()}
    assert beside <= {"rollout_ledger", "tests", "bench"}, beside


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return "rollout_ledger." + ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for top in TOPS for p in (PACKAGE / top).rglob("*.py")
            if "versions" not in p.parts}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules ``name`` imports (the longest known prefix of each imported name)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@functools.cache
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(name, path, known) for name, path in modules.items()}
    # a package's __init__ is imported on the way to any submodule: that edge is not a dependency of its own
    return {name: {d for d in deps if not name.startswith(d + ".")} for name, deps in graph.items()}


def _area(module: str) -> tuple[str, str]:
    """(top folder, service or sub-area): ('services', 'recorder'), ('shared', 'kit'), ('cli', 'stack')."""
    parts = module.split(".")[1:]
    return parts[0], parts[1] if len(parts) > 1 else ""


def test_the_module_graph_has_no_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycle = [*stack[stack.index(dep):], dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


@pytest.mark.parametrize("module", sorted(_graph()))
def test_imports_respect_the_boundaries(module: str) -> None:
    top, area = _area(module)
    for dep in _graph()[module]:
        dep_top, dep_area = _area(dep)
        if top == "shared":
            assert dep_top == "shared", f"{module} (the contract/kit) imports {dep}"
        if top == "services" and dep_top == "services" and dep_area != area:
            assert area not in (ENV_LIBRARY, *SHARED_BETWEEN_SERVICES), f"shared service module {module} imports {dep}"
            allowed = {*SHARED_BETWEEN_SERVICES, *([ENV_LIBRARY] if area in ENV_LIBRARY_USERS else [])}
            assert dep_area in allowed, f"service module {module} imports {dep}"
        if top != "cli":
            assert dep_top != "cli", f"{module} imports the CLI package ({dep})"
        if top == "client":
            assert dep_top in ("client", "shared"), f"client module {module} imports {dep} (trainers install it alone)"
        if top == "services" and dep_top == "client":
            assert area == "exporter", f"service module {module} imports the client package ({dep})"


def test_the_contract_does_not_import_the_kit() -> None:
    """``shared/`` top-level modules are the contract; ``shared/kit`` may use them, not the other way round (except
    ``deploy.py``'s values, which the kit serves)."""
    for module, deps in _graph().items():
        top, area = _area(module)
        if top == "shared" and area != "kit" and module.count(".") == 2:
            kit = sorted(d for d in deps if _area(d) == ("shared", "kit"))
            assert kit == [], f"contract module {module} imports the kit: {kit}"


SESSIONS = "rollout_ledger.services.env_worker.sessions"
AGENTS = "rollout_ledger.services.env_worker.agents"


def test_the_session_speaks_no_wire_protocol() -> None:
    """``sessions/session.py`` and ``sessions/turns.py`` import no dialect; a dialect imports no other dialect but
    the shared SSE writer (and Chat Completions' OpenAI error shape, which the Responses API shares); the endpoint
    imports nothing of the agent runtime."""
    graph = _graph()
    for core in (f"{SESSIONS}.session", f"{SESSIONS}.turns"):
        dialects = sorted(d for d in graph[core] if d.startswith(f"{SESSIONS}.dialects"))
        assert dialects == [], f"{core} imports wire protocols: {dialects}"
    for module, deps in graph.items():
        if module.startswith(SESSIONS):
            assert not any(d.startswith(AGENTS) for d in deps), f"{module} imports the agent runtime"
        if module.startswith(f"{SESSIONS}.dialects.") and not module.endswith((".sse", ".chat_completions")):
            others = sorted(d for d in deps if d.startswith(f"{SESSIONS}.dialects.")
                            and not d.endswith((".sse", ".chat_completions")))
            assert others == [], f"{module} imports another dialect: {others}"
