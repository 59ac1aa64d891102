"""Real object-store servers on 127.0.0.1 for the object-storage tests: S3 (moto), Azure Blob (Azurite), and a TCP
proxy in front of S3 to cut the network.

moto's server mode (``moto[server]``, the server s3fs's own test suite runs against) keeps its buckets in memory;
the proxy lets a test refuse connections (an outage) or hold them without an answer (a stalled upload) and then
answer again, without losing what the server holds. Both bind 127.0.0.1 only.
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

__all__ = ["AzuriteServer", "MotoServer", "Proxy", "free_port", "s3_env"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _moto_command(port: int) -> list[str]:
    exe = Path(sys.executable).with_name("moto_server")
    if exe.is_file():
        return [str(exe), "-H", "127.0.0.1", "-p", str(port)]
    found = shutil.which("moto_server")
    if found is None:
        raise RuntimeError("moto_server is not installed: make test installs it with the dev extra (moto[server])")
    return [found, "-H", "127.0.0.1", "-p", str(port)]


class MotoServer:
    """``moto_server`` on a free port of 127.0.0.1, started and stopped by the test session."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> MotoServer:
        self.proc = subprocess.Popen(
            _moto_command(self.port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_no_proxy_env()
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}")
            try:
                urllib.request.urlopen(self.url + "/moto-api/", timeout=1).close()
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto_server did not answer on {self.url} within {timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _no_proxy_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        env.pop(key, None)
    return env


def s3_env(endpoint: str) -> dict[str, str]:
    """The standard AWS variables that point s3fs and boto at ``endpoint`` (test credentials, nothing real)."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        # botocore's own retries would hide a refused connection for about 7 s; ours (with backoff) are under test
        "AWS_MAX_ATTEMPTS": "1",
        "NO_PROXY": "127.0.0.1,localhost",
    }


class Proxy:
    """A TCP proxy on 127.0.0.1 to ``target_port``; :meth:`refuse` closes its port (connection refused),
    :meth:`stall` takes connections and answers nothing, :meth:`restore` forwards again."""

    def __init__(self, target_port: int, port: int | None = None) -> None:
        self.target_port = target_port
        self.target_url = f"http://127.0.0.1:{target_port}"  # the server itself, for a test's own look past a cut
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.mode = "forward"
        self._server: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def start(self) -> Proxy:
        self._listen()
        return self

    def _listen(self) -> None:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(64)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                client, _ = server.accept()
            except OSError:
                return  # closed by refuse() or stop()
            with self._lock:
                self._conns.append(client)
            if self.mode == "stall":
                continue  # held open, never answered
            threading.Thread(target=self._pipe, args=(client,), daemon=True).start()

    def _pipe(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
        except OSError:
            client.close()
            return
        with self._lock:
            self._conns.append(upstream)
        pair = {client: upstream, upstream: client}
        try:
            while not self._stop.is_set() and self.mode == "forward":
                ready, _, _ = select.select(list(pair), [], [], 0.2)
                for sock in ready:
                    data = sock.recv(1 << 16)
                    if not data:
                        return
                    pair[sock].sendall(data)
        except OSError:
            return
        finally:
            client.close()
            upstream.close()

    def _drop_connections(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def refuse(self) -> None:
        """Close the port and every connection: new connections are refused."""
        self.mode = "refuse"
        if self._server is not None:
            self._server.close()
            self._server = None
        self._drop_connections()

    def stall(self) -> None:
        """Keep the port open but forward nothing: a request waits with no answer."""
        self.mode = "stall"
        self._drop_connections()

    def restore(self) -> None:
        if self.mode == "forward" and self._server is not None:
            return  # forwarding already: the clients' pooled connections stay good
        self._drop_connections()
        self.mode = "forward"
        if self._server is None:
            self._listen()

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.close()
        self._drop_connections()

    @contextmanager
    def refused(self):
        self.refuse()
        try:
            yield
        finally:
            self.restore()


AZURITE = Path(__file__).resolve().parents[2] / ".azurite" / "node_modules" / ".bin" / "azurite-blob"
# Azurite's well-known development account (documented by Microsoft; it opens nothing but the local emulator)
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


class AzuriteServer:
    """Azurite's Blob service (Microsoft's Azure Storage emulator, installed by ``make test`` from the npm registry
    into ``.azurite/``) on a free port of 127.0.0.1, its data in ``location``."""

    def __init__(self, location: Path) -> None:
        self.port = free_port()
        self.location = location
        self.proc: subprocess.Popen | None = None

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={AZURITE_KEY};"
            f"BlobEndpoint=http://127.0.0.1:{self.port}/devstoreaccount1;"
        )

    def start(self, timeout: float = 30.0) -> AzuriteServer:
        cmd = [str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--location", str(self.location)]
        self.proc = subprocess.Popen([*cmd, "--skipApiVersionCheck", "--loose"], stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"azurite-blob exited with {self.proc.returncode}") from None
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"azurite-blob did not listen on 127.0.0.1:{self.port} within {timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # its data is a test's temporary folder; SIGTERM left it running for seconds
            self.proc.wait()
