"""A real Prometheus server on loopback for end-to-end tests (Debian's ``prometheus`` package)."""

from __future__ import annotations

import json
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from helpers import free_port, http_ok, poll, require_binary


class Prometheus:
    """``targets`` are scraped by the job gpu-energy-exporter (with ``target_labels``, as service discovery
    would label them); ``scrape_configs`` adds jobs of its own."""

    def __init__(self, workdir: Path, targets: list[str], rule_files: list[Path] | None = None,
                 interval: str = "1s", scrape_configs: list[dict[str, Any]] | None = None,
                 target_labels: dict[str, str] | None = None) -> None:
        binary = require_binary("prometheus")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config: dict[str, Any] = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [{"job_name": "gpu-energy-exporter",
                                "static_configs": [{"targets": targets, "labels": dict(target_labels or {})}]},
                               *(scrape_configs or [])],
        }
        if rule_files:
            config["rule_files"] = [str(p) for p in rule_files]
        workdir.mkdir(parents=True, exist_ok=True)
        cfg = workdir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config))
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        if poll(lambda: http_ok(self.url + "/-/ready"), 60):
            return
        self.stop()
        raise AssertionError("prometheus did not become ready: " + (workdir / "prometheus.log").read_text())

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            doc = json.load(r)
        assert doc["status"] == "success", doc
        return list(doc["data"]["result"])

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        if not result:
            return None
        assert len(result) == 1, result
        return float(result[0]["value"][1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
