"""``keel serve`` as a subprocess on 127.0.0.1 for the serving tests: the export it serves and a
small client."""

from __future__ import annotations

import http.client
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from keelproc import keel_env

from conftest import train_tiny
from torchkeel.export import export_run


@pytest.fixture(scope="session")  # read-only: shared by the serving test modules
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve")
    trainer = train_tiny(out, 30)
    export_run(out / "tiny", "torchscript", out / "export")
    eager = trainer.model.eval()
    return out / "export", eager


@pytest.fixture(scope="session")
def image_exported(tmp_path_factory):
    """A small CNN trained on encoded images through ``data.preprocess``, exported: (dir, eager, config)."""
    from imagedata import image_run_overrides

    out = tmp_path_factory.mktemp("serve-images")
    trainer = train_tiny(out, 12, *image_run_overrides(), "name=colours")
    export_run(out / "colours", "torchscript", out / "export")
    return out / "export", trainer.model.eval(), trainer.config


def metric(server: "Server", name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` with ``labels`` in the server's /metrics."""
    text = server.request("GET", "/metrics")[1].decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def eager_rows(eager, inputs: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return eager(torch.from_numpy(inputs)).numpy()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(
        self, export_dir: Path | list[Path], *args: str, grpc: bool = False, env: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.grpc_port = free_port() if grpc else 0
        dirs = [str(d) for d in (export_dir if isinstance(export_dir, list) else [export_dir])]
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torchkeel.cli.main",
                "serve",
                *dirs,
                "--port",
                str(self.port),
                "--grpc-port",
                str(self.grpc_port),
                *args,
            ],
            env={**keel_env(), **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if self.request("GET", "/v2/health/ready")[0] == 200:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(self.proc.stderr.read())
            time.sleep(0.1)
        self.proc.kill()  # the test never gets the server to stop: it must not outlive the test
        _, err = self.proc.communicate(timeout=30)
        raise RuntimeError(f"server did not become ready in 60 s: {err[-2000:]}")

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def request(
        self,
        method: str,
        path: str,
        body: bytes | str | None = None,
        headers: dict | None = None,
        timeout: float = 30,
    ):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            return response.status, response.read(), dict(response.getheaders())
        finally:
            conn.close()

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.stdout, self.stderr = self.proc.communicate(timeout=60)
        return self.proc.returncode
