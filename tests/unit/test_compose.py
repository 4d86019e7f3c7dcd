"""docker-compose.yml, checked by parsing (no Docker engine here): every command is real."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

import celeryconfig
from pglock_celery.config import SETTINGS
from tasks.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
KNOWN_ENV = {env for _, env, _ in SETTINGS} | set(
    re.findall(r"\b(ORCH_[A-Z_]+)\b", (ROOT / "celeryconfig.py").read_text())
)


def test_the_stack_has_every_service_with_healthchecks_on_the_stores() -> None:
    assert set(SERVICES) >= {"postgres", "redis", "worker", "beat", "flower"}
    for store in ("postgres", "redis"):
        assert SERVICES[store]["healthcheck"]["test"]
    assert SERVICES["worker"]["deploy"]["replicas"] == 3


def test_all_app_services_share_one_image() -> None:
    images = {(s["build"], s["image"]) for s in SERVICES.values() if "build" in s}
    assert images == {(".", "pglock-celery-orchestrator")}
    assert (ROOT / "Dockerfile").exists()


def test_celery_commands_name_the_tasks_app_and_valid_options() -> None:
    celery_services = [s for s in SERVICES.values() if s.get("command", [""])[0] == "celery"]
    assert len(celery_services) == 3
    for service in celery_services:
        command = service["command"]
        assert command[1:3] == ["-A", "tasks"]
        subcommand = command[3]
        assert subcommand in {"worker", "beat", "flower"}
        if subcommand == "flower":
            from flower.options import options

            for option in command[4:]:
                assert option.lstrip("-").split("=")[0] in options, option
            continue
        # click refuses an unknown option even with --help: exit code 2.
        done = subprocess.run(
            [sys.executable, "-m", "celery", *command[1:], "--help"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr


def test_the_init_command_parses() -> None:
    command = SERVICES["init"]["command"]
    assert command[:3] == ["python", "-m", "tasks"]
    args = build_parser().parse_args(command[3:])
    assert args.command == "init-db" and args.tenants == 20


def test_every_environment_variable_is_a_real_setting() -> None:
    for name, service in SERVICES.items():
        if "build" not in service:
            continue
        for variable in service.get("environment", {}):
            assert variable in KNOWN_ENV or variable.startswith("FLOWER_"), (name, variable)


def test_the_beat_schedule_names_a_registered_task() -> None:
    import tasks

    for entry in celeryconfig.beat_schedule.values():
        assert entry["task"] in tasks.app.tasks
