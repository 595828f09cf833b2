"""Tests for docker-compose.yml and the Dockerfile, without a container engine.

The file is checked against the Compose Specification schema and, where the
tool is installed, by ``docker-compose config``; each service's command is run
locally against a test Redis so the commands in the file cannot rot.

The schema and the CLI come from Debian's ``docker-compose`` package
(``apt-get install --no-install-recommends docker-compose``); without it those
two tests skip, except under CI (``CI`` set), where they fail.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

import jsonschema
import pytest
import redis
import yaml

from celery_redislock.server import RedisServer
from example_worker.app import settings_from_env

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"

#: Where Debian's docker-compose package (or a pip install of it) keeps the schema.
SCHEMA_GLOBS = [
    "/usr/lib/python3/dist-packages/compose/config/compose_spec.json",
    "/usr/lib/python3*/*-packages/compose/config/compose_spec.json",
    *(f"{p}/compose/config/compose_spec.json" for p in sys.path if p),
]


def load_compose() -> dict[str, Any]:
    """The parsed compose file."""
    with COMPOSE_FILE.open() as handle:
        data = yaml.safe_load(handle)
    assert isinstance(data, dict)
    return data


def missing_tool(what: str) -> None:
    """Skip locally, fail under CI: CI must install Debian's docker-compose."""
    message = f"{what} not found: apt-get install --no-install-recommends docker-compose"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def compose_schema() -> dict[str, Any]:
    """The Compose Specification JSON schema shipped with docker-compose."""
    for pattern in SCHEMA_GLOBS:
        for path in sorted(glob.glob(pattern)):
            with open(path) as handle:
                schema: dict[str, Any] = json.load(handle)
                return schema
    missing_tool("the compose-spec schema (compose_spec.json)")
    raise AssertionError("unreachable")


def compose_cli() -> list[str]:
    """A ``docker-compose``/``docker compose`` command that can run ``config``."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run(
            [docker, "compose", "version"], capture_output=True, text=True, check=False
        )
        if probe.returncode == 0:
            return [docker, "compose"]
    missing_tool("docker-compose (or the docker compose plugin)")
    raise AssertionError("unreachable")


def service_env(service: dict[str, Any]) -> dict[str, str]:
    """A service's ``environment`` (mapping or ``KEY=value`` list) as a dict."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def local_command(service: dict[str, Any]) -> list[str]:
    """A service's command with the image's ``python`` replaced by this interpreter."""
    command = service["command"]
    assert isinstance(command, list), "use the exec form so no shell is involved"
    assert command[0] == "python"
    return [sys.executable, *command[1:]]


def test_compose_file_matches_the_compose_spec_schema() -> None:
    """docker-compose.yml validates against the Compose Specification schema."""
    validator = jsonschema.Draft201909Validator(compose_schema())
    errors = sorted(error.message for error in validator.iter_errors(load_compose()))
    assert errors == []


def test_compose_schema_check_catches_a_bad_file() -> None:
    """The schema check is not vacuous: an unknown option and a bad condition fail."""
    validator = jsonschema.Draft201909Validator(compose_schema())
    broken = load_compose()
    broken["services"]["worker"]["scale_to"] = 4
    broken["services"]["seckill"]["depends_on"]["redis"]["condition"] = "whenever"
    assert len(list(validator.iter_errors(broken))) >= 2


def test_docker_compose_config_accepts_the_file(tmp_path: Path) -> None:
    """`docker-compose config` (no engine needed) parses and validates the file."""
    done = subprocess.run(
        [*compose_cli(), "-f", str(COMPOSE_FILE), "config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)
    assert set(resolved["services"]) == {"redis", "worker", "seckill"}


def test_compose_services_are_wired_as_documented() -> None:
    """redis has a healthcheck; worker scales and waits for it; seckill is one-shot."""
    services = load_compose()["services"]
    assert set(services) == {"redis", "worker", "seckill"}

    redis_service = services["redis"]
    assert re.fullmatch(r"redis:[\w.-]+", redis_service["image"]), "the official image"
    probe = redis_service["healthcheck"]["test"]
    assert "redis-cli" in probe
    assert "ping" in probe

    worker, seckill = services["worker"], services["seckill"]
    for service in (worker, seckill):
        assert "build" in service
        assert service_env(service)["REDIS_URL"] == "redis://redis:6379/0"
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert worker["image"] == seckill["image"], "one image serves both"
    assert "container_name" not in worker, "a fixed name would stop --scale worker=4"
    assert "ports" not in worker
    assert "--worker" in worker["command"]
    assert "--enqueue-only" in seckill["command"]
    assert "worker" in seckill["depends_on"]
    assert seckill["restart"] == "no"


def test_dockerfile_installs_the_package() -> None:
    """The Dockerfile copies what `pip install .` needs (the package's source directory)
    and the example, which runs from the working directory."""
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.\d+", text, re.MULTILINE)
    assert re.search(r"^RUN pip install \.", text, re.MULTILINE)
    copied: set[str] = set()
    for line in re.findall(r"^COPY (.+)$", text, re.MULTILINE):
        *sources, _dest = line.split()
        for source in sources:
            assert (ROOT / source).exists(), f"COPY source {source} is missing"
            copied.add(source.rstrip("/"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", project["project"]["readme"], "example_worker"}
    needed |= set(project["tool"]["setuptools"]["package-dir"].values())
    assert needed <= copied
    ignored = {
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert not (copied & ignored), ".dockerignore drops a file the image needs"
    default = re.search(r"^CMD (\[.*\])$", text, re.MULTILINE)
    assert default is not None
    assert json.loads(default.group(1)) == load_compose()["services"]["worker"]["command"]


def test_app_settings_come_from_redis_url_with_overrides() -> None:
    """REDIS_URL sets the broker, backend and lock store; each can be overridden."""
    url = "redis://redis:6379/0"
    assert settings_from_env({"REDIS_URL": url}) == {
        "broker_url": url,
        "result_backend": url,
        "redislock_url": url,
    }
    settings = settings_from_env({"REDIS_URL": url, "REDISLOCK_URL": "redis://locks:6379/2"})
    assert settings["redislock_url"] == "redis://locks:6379/2"
    assert settings["broker_url"] == url
    assert settings_from_env({})["broker_url"] == "redis://127.0.0.1:6379/0"


def test_compose_commands_run_locally(
    redislock_server_factory: Callable[..., RedisServer], tmp_path: Path
) -> None:
    """Two `worker` commands and the `seckill` command, run as written, sell correctly."""
    services = load_compose()["services"]
    server = redislock_server_factory()
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SECKILL_")
        and k not in {"REDIS_URL", "BROKER_URL", "RESULT_BACKEND", "REDISLOCK_URL"}
    }

    def env_for(name: str, **extra: str) -> dict[str, str]:
        env = {**base, **service_env(services[name]), **extra}
        # The compose network's `redis` host is the test server here.
        env["REDIS_URL"] = server.url
        return env

    logs = [open(tmp_path / f"worker{i}.log", "wb") for i in range(2)]  # noqa: SIM115
    workers = [
        subprocess.Popen(
            local_command(services["worker"]),
            env=env_for("worker"),
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        for log in logs
    ]
    try:
        done = subprocess.run(
            local_command(services["seckill"]),
            env=env_for("seckill", SECKILL_BUYERS="12", SECKILL_TICKETS="4", SECKILL_WORKERS="2"),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
        codes = []
        for worker in workers:
            try:
                codes.append(worker.wait(30))
            except subprocess.TimeoutExpired:
                worker.kill()
                codes.append(worker.wait())
        for log in logs:
            log.close()
    worker_logs = "\n".join((tmp_path / f"worker{i}.log").read_text() for i in range(2))
    assert done.returncode == 0, done.stdout + done.stderr + worker_logs
    assert "invariants: OK" in done.stdout
    assert "2 worker(s)" in done.stderr
    assert codes == [0, 0], "workers shut down cleanly on SIGTERM (docker stop)\n" + worker_logs

    event = re.search(r"event (event-\w+)", done.stdout)
    assert event is not None
    client = redis.Redis.from_url(server.url, decode_responses=True)
    sales = [json.loads(s) for s in client.lrange(f"seckill:{{{event.group(1)}}}:sales", 0, -1)]
    assert len({sale["user"] for sale in sales}) == len(sales) == 4
    assert client.get(f"seckill:{{{event.group(1)}}}:stock") == "0"
    client.close()
