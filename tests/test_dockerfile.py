"""The Dockerfile, without a container engine: its structure, and a replay of its build and run steps.

The replay runs the build stage's own commands (after the build context is filtered through
.dockerignore exactly as Docker does) with the image's absolute paths moved under a temporary "root
filesystem", then runs the final image's entrypoint, CMD and ENV, and its HEALTHCHECK command against
the running exporter.

Trade-off: the image installs dependencies from PyPI, which a test must not do (slow, needs network). The
replay therefore (1) builds the wheel with ``--no-build-isolation`` (setuptools from the test
environment instead of a fresh download) and (2) makes the image's virtualenv see the test
environment's site-packages through a ``.pth`` file and installs with ``PIP_NO_INDEX=1``. So the replay
proves the commands, the wheel (package data, console script, the [kubernetes] extra's imports) and the
runtime layout, but not that PyPI still serves every dependency for Python 3.12; the image's Python
version (3.12) also differs from the test interpreter's where they differ.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import shutil
import site
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import Child, free_port

from gpu_energy_exporter.daemon.config import (
    DEFAULT_METRICS_PORT,
    DEFAULT_OTLP_GRPC_PORT,
    DEFAULT_OTLP_PORT,
    load_config,
)

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"
VOLUME = "/var/lib/gpu-energy-exporter"
#: Top-level directories of a Debian image that the replay must never touch on this machine.
SYSTEM_DIRS = {"usr", "bin", "sbin", "etc", "lib", "lib64", "dev", "proc", "sys", "tmp", "run", "root", "home",
               "var", "nonexistent"}


# ---- a small Dockerfile reader ---------------------------------------------------------------------------


@dataclass
class Instruction:
    keyword: str
    args: str

    def json_args(self) -> list[str] | None:
        """Exec-form arguments (a JSON array), or None for the shell form."""
        if self.args.startswith("["):
            value = json.loads(self.args)
            assert isinstance(value, list)
            return [str(v) for v in value]
        return None


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction:
        found = self.all(keyword)
        assert found, f"stage {self.name or self.base} has no {keyword}"
        return found[-1]

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for i in self.all("ENV"):
            for token in shlex.split(i.args):
                key, _, value = token.partition("=")
                out[key] = value
        return out


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, with line continuations joined and comments dropped."""
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not current):
            continue  # Docker drops comment lines, even inside a continuation
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    assert not current, "the Dockerfile ends inside a line continuation"
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "ARG" and not stages:
            key, _, default = rest.partition("=")
            args[key] = default
        elif keyword == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            stages.append(Stage(base, name))
        else:
            assert stages, f"{keyword} before the first FROM"
            stages[-1].instructions.append(Instruction(keyword, rest))
    return args, stages


Parsed = tuple[dict[str, str], list[Stage]]


@pytest.fixture(scope="module")
def dockerfile() -> Parsed:
    return parse_dockerfile(DOCKERFILE.read_text())


# ---- structure -----------------------------------------------------------------------------------------


def test_multi_stage_on_slim_python_and_only_the_venv_reaches_the_image(dockerfile: Parsed) -> None:
    _, stages = dockerfile
    assert len(stages) >= 2
    build, final = stages[0], stages[-1]
    assert build.name == "build"
    assert {s.base for s in stages} == {"python:3.12-slim"}
    assert any("pip wheel" in i.args for i in build.all("RUN"))
    copies = [i.args for i in final.all("COPY")]
    assert copies == ["--from=build /opt/gpu-energy-exporter /opt/gpu-energy-exporter"]
    assert not any("pip " in i.args or "apt-get" in i.args for i in final.all("RUN"))


def test_non_root_user_volume_ports_and_nvidia_runtime_variables(dockerfile: Parsed) -> None:
    _, stages = dockerfile
    final = stages[-1]
    user = final.last("USER").args
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, "a numeric non-root USER lets Kubernetes check runAsNonRoot"
    setup = " ".join(i.args for i in final.all("RUN"))
    assert f"--uid {uid}" in setup and f"chown {uid}:{gid or uid} {VOLUME}" in setup
    assert json.loads(final.last("VOLUME").args) == [VOLUME]
    exposed = {int(p.split("/")[0]) for i in final.all("EXPOSE") for p in i.args.split()}
    assert exposed == {DEFAULT_METRICS_PORT, DEFAULT_OTLP_PORT, DEFAULT_OTLP_GRPC_PORT}
    env = final.env()
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"  # nothing written next to the code (read-only root)
    entrypoint = final.last("ENTRYPOINT").json_args()
    assert entrypoint == ["/opt/gpu-energy-exporter/bin/gpu-energy-exporter"]
    health = final.last("HEALTHCHECK").args
    assert "CMD" in health and "/-/healthy" in health and "curl" not in health


def test_image_arguments_are_valid_exporter_configuration(dockerfile: Parsed) -> None:
    _, stages = dockerfile
    final = stages[-1]
    cmd = final.last("CMD").json_args()
    assert cmd is not None
    cfg = load_config(cmd, final.env())
    assert cfg.otlp_listen_address == ("", DEFAULT_OTLP_PORT)  # reachable from outside the container
    assert cfg.otlp_grpc_listen_address == ("", DEFAULT_OTLP_GRPC_PORT)
    assert cfg.web_listen_address == ("", DEFAULT_METRICS_PORT)
    assert cfg.runs_csv is not None and cfg.runs_csv.startswith(VOLUME + "/")


def test_dockerignore_keeps_the_context_small() -> None:
    rules = dockerignore_rules((REPO / ".dockerignore").read_text())
    for path in (".git/config", ".venv/bin/python", "tests/test_dockerfile.py", "bench/x.py", "docs/deploy.md",
                 "gpu_energy_exporter/__pycache__/config.cpython-311.pyc", "dashboards/fleet.json"):
        assert excluded(path, rules), path
    for path in ("pyproject.toml", "README.md", "gpu_energy_exporter/daemon/config.py",
                 "gpu_energy_exporter/collectors/kubernetes/podresources.proto",
                 "gpu_energy_exporter/reference/data/x.csv"):
        assert not excluded(path, rules), path


# ---- the replay ----------------------------------------------------------------------------------------


def dockerignore_rules(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        rules.append((negate, re.compile(regex + r"\Z")))
    return rules


def excluded(rel: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent directories decides."""
    parts = rel.split("/")
    result = False
    for negate, rx in rules:
        if any(rx.match("/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            result = not negate
    return result


def build_context(dest: Path) -> None:
    rules = dockerignore_rules((REPO / ".dockerignore").read_text())
    for dirpath, dirnames, filenames in os.walk(REPO):
        rel_dir = os.path.relpath(dirpath, REPO)
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        # Prune what is excluded and that no "!" pattern could bring back (the .venv, .git, ...).
        dirnames[:] = [d for d in dirnames
                       if not excluded(rel_dir + d, rules) or any(neg and rx.pattern.startswith(re.escape(rel_dir + d))
                                                                  for neg, rx in rules)]
        for f in filenames:
            if not excluded(rel_dir + f, rules):
                target = dest / (rel_dir + f)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(Path(dirpath) / f, target)


class Replay:
    """Image paths (/opt/..., /src, /wheels, the volume) live under ``root``."""

    def __init__(self, root: Path, context: Path) -> None:
        self.root = root
        self.context = context
        self.workdir = Path("/")
        self.env: dict[str, str] = {}

    def path(self, image_path: str) -> Path:
        return self.root / image_path.lstrip("/")

    def rewrite(self, command: str) -> str:
        def sub(m: re.Match[str]) -> str:
            return m.group(0) if m.group(1) in SYSTEM_DIRS else str(self.root) + m.group(0)

        return re.sub(r"(?<![\w.~$-])/([\w.-]+)(?=[/\s\"')]|$)", sub, command)

    def run(self, instruction: Instruction) -> None:
        assert instruction.json_args() is None, "exec-form RUN is not replayed"
        command = self.rewrite(instruction.args)
        # The image's `python` is the interpreter of the test environment.
        command = re.sub(r"(?<![\w/])python(?= )", shlex.quote(sys.executable), command)
        command = command.replace("pip wheel", "pip wheel --no-build-isolation")
        venv = re.search(r"-m venv (\S+)", command)
        env = {**os.environ, **self.env, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=self.path(str(self.workdir)),
                              env=env, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, f"RUN {instruction.args}\n{proc.stdout}\n{proc.stderr}"
        if venv:
            # Dependencies come from this test environment rather than PyPI (see the module docstring).
            lib = next(Path(venv.group(1)).glob("lib/python3*/site-packages"))
            (lib / "test-environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    def copy(self, instruction: Instruction) -> None:
        words = instruction.args.split()
        if words[0].startswith("--from="):
            source, dest = words[1], words[2]
            assert self.path(source) == self.path(dest), "the replay shares one root between stages"
            assert self.path(source).is_dir(), f"COPY --from: {source} was not built"
            return
        *sources, dest = words
        target = self.path(str(self.workdir / dest))
        for s in sources:
            src = self.context / s
            assert src.exists(), f"COPY failed: {s} is not in the build context (see .dockerignore)"
            if src.is_dir():
                shutil.copytree(src, target if len(sources) == 1 and not dest.endswith("/") else target / s,
                                dirs_exist_ok=True)
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target / src.name)

    def stage(self, stage: Stage, *, run: bool) -> None:
        for i in stage.instructions:
            if i.keyword == "WORKDIR":
                self.workdir = self.workdir / i.args
                self.path(str(self.workdir)).mkdir(parents=True, exist_ok=True)
            elif i.keyword == "ENV":
                self.env.update(stage.env())
            elif i.keyword == "COPY":
                self.copy(i)
            elif i.keyword == "RUN" and run:
                self.run(i)


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory, dockerfile: Parsed) -> Iterator[Replay]:
    _, stages = dockerfile
    tmp = tmp_path_factory.mktemp("docker")
    context = tmp / "context"
    build_context(context)
    replay = Replay(tmp / "rootfs", context)
    replay.stage(stages[0], run=True)
    final = Replay(replay.root, context)
    # The final stage's RUN creates a system user and chowns the volume: root-only, checked structurally
    # above; here the volume directory is simply created.
    final.path(VOLUME).mkdir(parents=True, exist_ok=True)
    final.stage(stages[-1], run=False)
    yield final


def image_env(replay: Replay) -> dict[str, str]:
    env = dict(replay.env)
    env["PATH"] = ":".join(replay.rewrite(p) if p.startswith("/opt/") else p
                           for p in env["PATH"].replace("$PATH", os.environ["PATH"]).split(":"))
    return {**{k: v for k, v in os.environ.items() if k in ("HOME", "LANG", "TMPDIR")}, **env}


def test_replayed_entrypoint_answers_help(replayed: Replay, dockerfile: Parsed) -> None:
    _, stages = dockerfile
    entrypoint = stages[-1].last("ENTRYPOINT").json_args()
    assert entrypoint is not None
    proc = subprocess.run([replayed.rewrite(entrypoint[0]), *entrypoint[1:], "--help"],
                          env=image_env(replayed), capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "--web.listen-address" in proc.stdout and "--collector.kubernetes" in proc.stdout
    # The [kubernetes] extra made it into the image: the generated gRPC code imports there.
    python = replayed.path("/opt/gpu-energy-exporter/bin/python")
    probe = subprocess.run([str(python), "-c", "import gpu_energy_exporter.collectors.kubernetes.podresources as m; "
                            "print(m.__file__)"], cwd=replayed.path(VOLUME), env=image_env(replayed),
                           capture_output=True, text=True, timeout=60, check=False)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.startswith(str(replayed.root)), "imported from the source tree, not the image's venv"
    assert (Path(probe.stdout.strip()).parent / "podresources.proto").is_file()


def test_replayed_image_runs_healthcheck_passes_and_writes_only_the_volume(
    replayed: Replay, dockerfile: Parsed, tmp_path: Path
) -> None:
    _, stages = dockerfile
    final = stages[-1]
    entrypoint = final.last("ENTRYPOINT").json_args()
    cmd = final.last("CMD").json_args()
    assert entrypoint is not None and cmd is not None
    port = free_port()
    env = image_env(replayed)
    # Loopback only in a test, and the volume under the replay root; everything else as in the image.
    env.update({"GPU_ENERGY_EXPORTER_WEB_LISTEN_ADDRESS": f"127.0.0.1:{port}",
                "GPU_ENERGY_EXPORTER_OTLP_LISTEN_ADDRESS": f"127.0.0.1:{free_port()}",
                "GPU_ENERGY_EXPORTER_OTLP_GRPC_LISTEN_ADDRESS": f"127.0.0.1:{free_port()}",
                "GPU_ENERGY_EXPORTER_RUNS_CSV": str(replayed.path(env["GPU_ENERGY_EXPORTER_RUNS_CSV"])),
                "GPU_ENERGY_EXPORTER_NVML_LIBRARY": "", "HOME": "/nonexistent"})
    env.pop("GPU_ENERGY_EXPORTER_NVML_LIBRARY")
    before = {p for p in replayed.root.rglob("*")}
    exporter = Child([replayed.rewrite(entrypoint[0]), *cmd], environ=env, cwd=replayed.path(VOLUME))
    health = final.last("HEALTHCHECK").args
    check = json.loads(health[health.index("CMD") + 3:].strip())
    try:
        deadline = time.monotonic() + 60
        while True:
            result = subprocess.run(check, env=env, capture_output=True, text=True, timeout=30, check=False)
            if result.returncode == 0:
                break
            assert exporter.alive(), "the exporter exited: " + exporter.log()
            assert time.monotonic() < deadline, "HEALTHCHECK never passed: " + result.stderr
            time.sleep(0.2)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("GET", "/metrics")
            body = conn.getresponse().read().decode()
        finally:
            conn.close()
        assert "gpuenergy_" in body
    finally:
        exporter.stop(30)
    after = {p for p in replayed.root.rglob("*")}
    written = sorted(str(p.relative_to(replayed.root)) for p in after - before)
    assert all(w.startswith(VOLUME.lstrip("/")) for w in written), written
    stopped = subprocess.run(check, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert stopped.returncode != 0  # the health check fails when nothing answers
