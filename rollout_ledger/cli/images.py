"""Builds the project's container images on this machine and names them: the local tags of docker/images.env.

Only a source checkout has docker/: ``docker/engine.sh`` provides a Docker engine and the base images (Debian +
python3, NATS, PostgreSQL) that nothing can pull here; this module builds the project's own images from
docker/Dockerfile on that base (``rollout images`` / ``make images``) and is what the tests use to find them.

The model files an image needs come from this machine's converted model (``rollout model fetch``), put in the
build context under ``.build/docker-model`` (``MODEL_SOURCE=context``): the upstream default converts the GGUF
inside the build with CPU torch from download.pytorch.org, which this machine cannot reach.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = ROOT / "docker"
TAGS_FILE = DOCKER_DIR / "images.env"
MODEL_CONTEXT = ROOT / ".build" / "docker-model"
WHEELS_CONTEXT = ROOT / ".build" / "docker-wheels"
LOCAL_WHEELS = (Path("/opt/wheels"),)
"""Where this machine keeps wheels PyPI lacks (CPU torch): staged for the inference-cpu image when found."""
CACERT = Path(os.environ.get("CACERT", "/etc/ssl/certs/ca-certificates.crt"))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "config.json", "generation_config.json")
"""What the CPU services need of the model: the tokenizer and its chat template (no weights)."""


class ImageError(RuntimeError):
    """No Docker engine answers, or an image build failed."""


@dataclass(frozen=True)
class LocalImages:
    """The local tags (docker/images.env)."""

    base: str
    nats: str
    postgres: str
    service: str
    inference_cpu: str


def tags(path: Path = TAGS_FILE) -> dict[str, str]:
    """``docker/images.env`` as a dict (``KEY=value`` lines; ``#`` comments)."""
    if not path.is_file():
        raise ImageError(f"{path} not found: the local images are built from a source checkout of Rollout Ledger")
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            if not sep:
                raise ImageError(f"{path}: not KEY=value: {line!r}")
            values[key.strip()] = value.strip()
    return values


def local_images() -> LocalImages:
    t = tags()
    return LocalImages(base=t["BASE_IMAGE"], nats=t["NATS_IMAGE"], postgres=t["POSTGRES_IMAGE"],
                       service=t["SERVICE_IMAGE"], inference_cpu=t["INFERENCE_CPU_IMAGE"])


def _docker(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise ImageError(f"docker {' '.join(args[:3])} ... failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc


def engine_answers() -> bool:
    """Whether a Docker engine answers (the CLI is there and ``docker info`` succeeds)."""
    if shutil.which("docker") is None:
        return False
    try:
        return _docker("info", timeout=15, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def has_image(tag: str) -> bool:
    return _docker("image", "inspect", tag, check=False).returncode == 0


def build_cli() -> str:
    """A docker CLI that builds with BuildKit (``RUN --mount=type=secret``): one with buildx, else Debian's
    docker.io CLI, whose 20.10 has BuildKit built in (a newer CLI without buildx refuses BuildKit builds)."""
    if _docker("buildx", "version", check=False).returncode == 0:
        return "docker"
    if Path("/usr/bin/docker").is_file():
        return "/usr/bin/docker"
    raise ImageError("this docker CLI has no buildx: install the buildx plugin (https://docs.docker.com/go/buildx/)")


def ensure_engine() -> LocalImages:
    """``docker/engine.sh``: an engine and the base images (idempotent, seconds when both are there)."""
    proc = subprocess.run(["bash", str(DOCKER_DIR / "engine.sh")], capture_output=True, text=True, timeout=900,
                          check=False)
    if proc.returncode != 0:
        raise ImageError(f"docker/engine.sh failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return local_images()


def stage_model(model_dir: Path, with_weights: bool) -> None:
    """The build context's model folder: ``tokenizer/`` always, ``model/`` (with weights) for an inference image."""
    tok, full = MODEL_CONTEXT / "tokenizer", MODEL_CONTEXT / "model"
    shutil.rmtree(MODEL_CONTEXT, ignore_errors=True)
    tok.mkdir(parents=True)
    full.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, tok / name)
    if not (tok / "tokenizer.json").is_file():
        raise ImageError(f"{model_dir} has no tokenizer.json: run `rollout model fetch` first")
    if with_weights:
        for path in model_dir.iterdir():
            if path.is_file():
                shutil.copy2(path, full / path.name)
    else:
        for path in tok.iterdir():
            shutil.copy2(path, full / path.name)


def stage_wheels() -> bool:
    """``.build/docker-wheels``: this machine's CPU torch wheel, if it has one (True then)."""
    shutil.rmtree(WHEELS_CONTEXT, ignore_errors=True)
    WHEELS_CONTEXT.mkdir(parents=True)
    found = [w for folder in LOCAL_WHEELS if folder.is_dir() for w in folder.glob("torch-*+cpu-*.whl")]
    for wheel in found:
        shutil.copy2(wheel, WHEELS_CONTEXT / wheel.name)
    return bool(found)


def build(target: str, tag: str, base: str, timeout: float = 1800, args: dict[str, str] | None = None) -> float:
    """``docker build --target TARGET`` of docker/Dockerfile on the local base; returns the seconds it took."""
    cmd = [build_cli(), "build", "--quiet", "-f", str(DOCKER_DIR / "Dockerfile"), "--target", target, "-t", tag,
           "--build-arg", f"PYTHON_IMAGE={base}", "--build-arg", "MODEL_SOURCE=context"]
    for key, value in (args or {}).items():
        cmd += ["--build-arg", f"{key}={value}"]
    if CACERT.is_file():
        cmd += ["--secret", f"id=cacert,src={CACERT}"]
    started = time.monotonic()
    proc = subprocess.run([*cmd, str(ROOT)], capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "DOCKER_BUILDKIT": "1"})
    if proc.returncode != 0:
        raise ImageError(f"building {tag} (target {target}) failed:\n{proc.stderr[-4000:]}")
    return time.monotonic() - started


def build_images(model_dir: Path, inference_cpu: bool = False) -> dict[str, float]:
    """The engine, the base images, then the service image (and the CPU inference image): tag -> seconds."""
    images = ensure_engine()
    stage_model(model_dir, with_weights=inference_cpu)
    local_torch = stage_wheels()
    took = {images.service: build("service", images.service, images.base)}
    if inference_cpu:
        took[images.inference_cpu] = build("inference-cpu", images.inference_cpu, images.base, timeout=3600,
                                           args={"TORCH_INDEX_URL": ""} if local_torch else None)
    return took
