"""The container tests' images: the local base images (docker/engine.sh) and the service image built from this
checkout's docker/Dockerfile once per session (Docker's layer cache makes a rebuild after a code change the last
layer only). Without a Docker engine they skip on a laptop, and fail on CI (``CI`` set), where one must answer."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rollout_ledger.cli import images


@pytest.fixture(scope="session")
def local_images() -> images.LocalImages:
    if not images.engine_answers():
        pytest.fail("no Docker engine answers: `make engine` starts one (docker/engine.sh); the container tests need "
                    "it, here as on CI")
    return images.ensure_engine()


@pytest.fixture(scope="session")
def service_image(local_images: images.LocalImages, model_dir: str) -> str:
    started = time.monotonic()
    images.stage_model(Path(model_dir), with_weights=False)
    images.stage_wheels()
    images.build("service", local_images.service, local_images.base)
    print(f"service image {local_images.service} built in {time.monotonic() - started:.0f} s")
    return local_images.service
