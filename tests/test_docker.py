"""docker/: the compose file is valid Compose, its services fit together, its commands are ones the
real `tula serve` and `ray start` accept, the server image has no torch, and the server takes its
database from TULA_DATABASE_URL as the compose file sets it.

No Docker engine is needed: `docker compose config` runs too where the compose plugin exists.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import sqlalchemy as sa
import yaml
from sqlalchemy.engine import make_url

from tests.conftest import REPO, LiveServer
from tula_service.cli import build_parser
from tula_service.store.migrate import current_revision, head_revision

DOCKER = REPO / "docker"
COMPOSE = DOCKER / "compose.yaml"
SERVICES = {"postgres", "server", "ray-head", "gpu-worker"}
INTERPOLATION = re.compile(r"\$\{(?P<name>\w+)(?::?-(?P<default>[^}]*))?\}")


def interpolated(value: str) -> str:
    """Compose's `${NAME:-default}` with nothing set in the environment."""

    def default(match: re.Match) -> str:
        assert match.group("default") is not None, f"{match.group(0)} has no default: the stack needs it set"
        return match.group("default")

    return INTERPOLATION.sub(default, value)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def command_words(service: dict) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else list(command)


def shell_commands(service: dict) -> list[list[str]]:
    """The commands a service runs: its command, or each `&&` part of an `sh -c` script."""
    words = command_words(service)
    if words[:2] == ["sh", "-c"]:
        return [shlex.split(part.strip().removeprefix("exec ")) for part in words[2].split("&&")]
    return [words]


def tula_serve_args(service: dict) -> list[str]:
    [serve] = [words for words in shell_commands(service) if words[:2] == ["tula", "serve"]]
    return serve[2:]


def ray_start_args(service: dict) -> list[str]:
    [start] = [words for words in shell_commands(service) if words[:2] == ["ray", "start"]]
    return start[2:]


def dockerfile_of(service: dict) -> tuple[Path, Path]:
    """(build context, Dockerfile) of a service, relative paths resolved as Compose does."""
    build = service["build"]
    context = (COMPOSE.parent / build["context"]).resolve()
    return context, context / build.get("dockerfile", "Dockerfile")


def pip_installs(dockerfile: Path) -> list[str]:
    return [line for line in dockerfile.read_text().splitlines() if re.match(r"\s*RUN\b.*\bpip install\b", line)]


# --- the file --------------------------------------------------------------------------------------


def docker_compose_available() -> bool:
    try:
        return subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_the_compose_file_is_valid_compose():
    """Against the Compose Specification's JSON schema (vendored by check-jsonschema), and by
    `docker compose config` itself wherever the compose plugin is installed."""
    schema = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert schema.returncode == 0, f"check-jsonschema (the dev extra) says:\n{schema.stdout}{schema.stderr}"
    if docker_compose_available():
        config = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, timeout=120)
        assert config.returncode == 0, config.stdout + config.stderr


def test_the_stack_is_postgres_a_server_a_ray_head_and_a_gpu_worker(services):
    assert set(services) == SERVICES


def test_every_dependency_is_a_service_and_waits_only_on_real_healthchecks(services):
    for name, service in services.items():
        for target, rule in (service.get("depends_on") or {}).items():
            assert target in services, f"{name} depends on unknown service {target}"
            if rule.get("condition") == "service_healthy":
                assert "healthcheck" in services[target], f"{name} waits for {target} to be healthy; it has no healthcheck"
    assert set(services["server"]["depends_on"]) == {"postgres", "ray-head"}
    assert set(services["gpu-worker"]["depends_on"]) == {"ray-head"}


def test_every_build_has_its_context_dockerfile_and_copied_files(services):
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")}
    built = [name for name, service in services.items() if "build" in service]
    assert set(built) == {"server", "ray-head", "gpu-worker"}
    for name in built:
        context, dockerfile = dockerfile_of(services[name])
        assert context == REPO, f"{name}: the images are built from the repository root"
        assert dockerfile.is_file(), f"{name}: {dockerfile} is missing"
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY "):
                for source in line.split()[1:-1]:
                    assert (context / source).exists(), f"{dockerfile.name} copies {source}, which does not exist"
                    assert source not in ignored, f"{dockerfile.name} copies {source}, which .dockerignore leaves out"


# --- the images ------------------------------------------------------------------------------------


def test_the_server_image_installs_no_torch(services):
    _, dockerfile = dockerfile_of(services["server"])
    [install] = pip_installs(dockerfile)
    assert "'.[ray]'" in install
    assert "torch" not in install and "worker" not in install
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    server_requirements = project["dependencies"] + project["optional-dependencies"]["ray"]
    assert not [r for r in server_requirements if re.match(r"(torch|torchvision|nvidia-)", r)], server_requirements
    assert any(r.startswith("psycopg") for r in project["dependencies"]), "PostgreSQL needs psycopg in the server"


def test_the_worker_image_installs_the_worker_extra_with_pinned_torch(services):
    _, dockerfile = dockerfile_of(services["gpu-worker"])
    [install] = pip_installs(dockerfile)
    assert "-c constraints.txt" in install and "'.[worker,ray]'" in install
    assert "torch" in "".join(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["worker"])


def test_every_ray_node_runs_the_same_python(services):
    """Ray refuses a driver or node whose Python differs from the cluster's."""
    versions = set()
    for name in ("server", "ray-head", "gpu-worker"):
        _, dockerfile = dockerfile_of(services[name])
        assert "FROM python:${PYTHON_VERSION}" in dockerfile.read_text(), f"{dockerfile.name}: Python from the build argument"
        versions.add(services[name]["build"]["args"]["PYTHON_VERSION"])
    assert len(versions) == 1, versions


def test_the_gpu_worker_reserves_the_nvidia_gpus(services):
    [device] = services["gpu-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert "deploy" not in services["ray-head"] and "deploy" not in services["server"]


# --- the commands ----------------------------------------------------------------------------------


def parse_serve(args: list[str]):
    try:
        return build_parser().parse_args(["serve", *args])
    except SystemExit as error:  # argparse has printed why
        raise AssertionError(f"`tula serve {' '.join(args)}` is refused by the CLI") from error


def test_the_server_command_is_one_tula_serve_accepts(services):
    args = parse_serve(tula_serve_args(services["server"]))

    assert (args.host, args.executor, args.ray_address) == ("0.0.0.0", "ray", "ray-head:6379")
    # 0.0.0.0 with no API token yet: the server refuses to start without --insecure
    assert args.insecure
    assert args.database_url is None, "the database comes from TULA_DATABASE_URL"
    published = [mapping for mapping in services["server"]["ports"] if mapping.endswith(f":{args.port}")]
    assert published == ["127.0.0.1:8000:8000"], "the open API is published on the host's loopback only"
    assert f"127.0.0.1:{args.port}/healthz" in " ".join(services["server"]["healthcheck"]["test"])


def test_the_server_image_default_command_is_one_tula_serve_accepts(services):
    _, dockerfile = dockerfile_of(services["server"])
    [cmd] = [line for line in dockerfile.read_text().splitlines() if line.startswith("CMD ")]
    words = yaml.safe_load(cmd.removeprefix("CMD "))  # the exec form is a JSON list
    assert words[:2] == ["tula", "serve"]
    assert parse_serve(words[2:]).port == 8000


def ray_start_options(args: list[str]) -> dict:
    """What the installed Ray's `ray start` makes of these arguments (parsed, not run)."""
    from ray.scripts.scripts import start

    return start.make_context("start", list(args)).params


def test_the_ray_commands_are_ones_ray_start_accepts(services):
    head = ray_start_options(ray_start_args(services["ray-head"]))
    assert head["head"] and (head["num_cpus"], head["num_gpus"]) == (0, 0), "the head schedules, it profiles nothing"
    head_address = f"ray-head:{head['port']}"
    for name in ("server", "gpu-worker"):
        node = ray_start_options(ray_start_args(services[name]))
        assert node["address"] == head_address, f"{name} joins {node['address']}, the head is {head_address}"
    assert ray_start_options(ray_start_args(services["server"]))["num_gpus"] == 0
    assert parse_serve(tula_serve_args(services["server"])).ray_address == head_address
    assert services["ray-head"]["healthcheck"]["test"][1:3] == ["ray", "status"]


def test_the_server_database_url_names_the_postgres_service(services):
    database = make_url(interpolated(services["server"]["environment"]["TULA_DATABASE_URL"]))
    postgres = {key: interpolated(value) for key, value in services["postgres"]["environment"].items()}

    assert (database.drivername, database.host, database.port) == ("postgresql", "postgres", 5432)
    assert (database.username, database.password, database.database) == (
        postgres["POSTGRES_USER"], postgres["POSTGRES_PASSWORD"], postgres["POSTGRES_DB"],
    )  # fmt: skip
    assert f"-U {database.username} -d {database.database}" in " ".join(services["postgres"]["healthcheck"]["test"])


def test_the_server_takes_its_database_from_TULA_DATABASE_URL(postgres_server, tmp_path):
    """As in the compose file: a plain postgresql:// URL in the environment, no --database-url."""
    name = postgres_server.create_database()
    url = make_url(postgres_server.url(name)).set(drivername="postgresql").render_as_string(hide_password=False)
    server = LiveServer(
        None, tmp_path / "server.log", ("--executor", "none"), {"TULA_DATABASE_URL": url, "PYTHONPATH": str(REPO)},
        cwd=tmp_path, database_from_environment=True,
    )  # fmt: skip
    try:
        server.start()
        engine = sa.create_engine(postgres_server.url(name))
        with engine.connect() as connection:
            assert current_revision(connection) == head_revision()
        engine.dispose()
        assert not list(tmp_path.glob("**/*.db")), "the server fell back to an SQLite file"
    finally:
        server.stop()
        postgres_server.drop_database(name)
