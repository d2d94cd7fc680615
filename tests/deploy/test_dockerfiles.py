"""docker/Dockerfile is hadolint clean and agrees with the code: targets, pinned bases, user, port, healthcheck,
model path and entrypoint (rollout_ledger/shared/deploy.py); .dockerignore lets in exactly what the build copies."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rollout_ledger.cli.images import MODEL_CONTEXT, WHEELS_CONTEXT
from rollout_ledger.services import catalog
from rollout_ledger.shared import deploy
from tests.deploy.manifests import ROOT, tool

DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
FINAL_TARGETS = ("service", "inference", "inference-cpu")


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [arg for kw, arg in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str:
        found = self.all(keyword)
        assert found, f"stage {self.name} has no {keyword}"
        return found[-1]


def parse(path: Path) -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARG defaults and the stages of a Dockerfile (continuation lines joined, comments dropped)."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        logical.append(pending + line)
        pending = ""
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest.strip(), re.IGNORECASE)
            assert match, f"every stage is named: {line}"
            base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), match.group(1))
            current = stages[match.group(2)] = Stage(match.group(2), base)
        elif current is None and keyword == "ARG":
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
        elif current is not None:
            current.instructions.append((keyword, rest.strip()))
    return args, stages


def env_of(stage: Stage, stages: dict[str, Stage]) -> dict[str, str]:
    """ENV values of a stage, following ``FROM <stage>``."""
    env = env_of(stages[stage.base], stages) if stage.base in stages else {}
    for arg in stage.all("ENV"):
        for key, value in re.findall(r"(\w+)=(\S+)", arg):
            env[key] = value
    return env


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    return parse(DOCKERFILE)


def test_hadolint_clean() -> None:
    proc = subprocess.run([tool("hadolint"), "--failure-threshold", "warning", "--no-color", str(DOCKERFILE)],
                          capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_bases_are_pinned(dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    _, stages = dockerfile
    for stage in stages.values():
        if stage.base in stages or stage.base == "scratch":  # scratch: the empty image, nothing to pin
            continue
        assert re.fullmatch(r"[\w./-]+:[\w.-]+", stage.base), f"{stage.name}: unpinned base {stage.base}"
        assert not stage.base.endswith(":latest"), stage.base
    assert stages["inference"].base == deploy.VLLM_BASE_IMAGE
    assert deploy.VLLM_BASE_IMAGE.startswith("vllm/vllm-openai:v")


@pytest.mark.parametrize("target", FINAL_TARGETS)
def test_final_images_agree_with_the_code(dockerfile: tuple[dict[str, str], dict[str, Stage]], target: str) -> None:
    _, stages = dockerfile
    stage = stages[target]
    assert stage.last("USER") == f"{deploy.RUN_AS_USER}:{deploy.RUN_AS_USER}"
    assert stage.last("EXPOSE") == str(deploy.HTTP_PORT)
    assert json.loads(stage.last("ENTRYPOINT")) == list(deploy.IMAGE_ENTRYPOINT)
    assert json.loads(stage.last("CMD"))[0] == "serve"
    healthcheck = stage.last("HEALTHCHECK")
    assert deploy.LIVENESS_PATH in healthcheck and "ROLLOUT_HTTP_PORT" in healthcheck
    env = env_of(stage, stages)
    assert env["ROLLOUT_MODEL"] == deploy.MODEL_DIR
    assert env["ROLLOUT_HTTP_PORT"] == str(deploy.HTTP_PORT)
    assert env["HOME"] == "/tmp", "a read-only root filesystem leaves only /tmp writable"
    assert any(deploy.MODEL_DIR in copy for copy in stage.all("COPY")), "the policy's files are in the image"
    assert any(f"--uid {deploy.RUN_AS_USER}" in run for run in stage.all("RUN")), "a named non-root user"


def test_cmds_name_real_services(dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    _, stages = dockerfile
    for target in FINAL_TARGETS:
        service = json.loads(stages[target].last("CMD"))[1]
        assert service in catalog.SERVICES
    assert json.loads(stages["inference"].last("CMD"))[1] == "inference-worker"
    assert env_of(stages["inference"], stages)["ROLLOUT_ENGINE"] == "vllm"


def test_dockerignore_admits_exactly_what_is_copied(dockerfile: tuple[dict[str, str], dict[str, Stage]]) -> None:
    _, stages = dockerfile
    sources: set[str] = set()
    for stage in stages.values():
        for arg in stage.all("COPY"):
            if arg.startswith("--from="):
                continue
            *srcs, _dest = arg.split()
            sources.update(s.rstrip("/") for s in srcs)
    lines = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "deny everything, then admit the build's inputs"
    admitted = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert admitted == sources
    staged = {str(c.relative_to(ROOT)) for c in (MODEL_CONTEXT, WHEELS_CONTEXT)}  # `rollout images` writes them
    for src in sources - staged:
        assert (ROOT / src).exists(), src
    assert sources & staged == staged


def test_the_test_servers_are_an_extra_no_image_carries() -> None:
    import importlib.util
    import tomllib

    spec = importlib.util.spec_from_file_location("docker_requirements", ROOT / "docker" / "requirements.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"]
    assert not {module.distribution(d) for d in deps} & module.DEV_ONLY, "a base dependency: every install has it"
    assert {module.distribution(d) for d in project["optional-dependencies"]["local"]} == module.DEV_ONLY
    kept = module.runtime_requirements(ROOT / "pyproject.toml")
    assert kept == deps
    with_envs = module.runtime_requirements(ROOT / "pyproject.toml", ("envs",))
    assert with_envs == kept + project["optional-dependencies"]["envs"], "the service image carries the envs extra"
    with pytest.raises(ValueError, match="local"):
        module.runtime_requirements(ROOT / "pyproject.toml", ("local",))
    assert module.distribution("psycopg[binary]>=3.2") == "psycopg"
    assert module.distribution("pydantic_settings>=2") == "pydantic-settings"


def test_the_wheel_holds_every_file_of_the_package(tmp_path: Path) -> None:
    """The images install the project's wheel, which holds only what pyproject lets in (an editable install hides a
    module or template left out): the wheel built from a copy of the sources holds every file of ``rollout_ledger/``."""
    import shutil
    import sys
    import zipfile

    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "rollout_ledger", source / "rollout_ledger", ignore=ignore)
    out = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "-w", str(out), str(source)], check=True, timeout=300)
    [wheel] = out.glob("rollout_ledger-*.whl")
    packed = {name for name in zipfile.ZipFile(wheel).namelist() if name.startswith("rollout_ledger/")}
    files = {path.relative_to(source).as_posix() for path in (source / "rollout_ledger").rglob("*") if path.is_file()}
    assert any(name.endswith(".jinja") for name in files) and any(name.endswith(".js") for name in files)
    assert files - packed == set(), "files the wheel (and so the images) would lack"
    assert packed - files == set(), "the wheel holds files the sources lack"
