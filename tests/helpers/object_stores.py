"""Real object-store servers on 127.0.0.1 for the object-storage tests: S3 (moto), Azure Blob (Azurite), and a TCP
proxy in front of S3 to cut the network.

moto's server mode (``moto[server]``, the server s3fs's own test suite runs against) keeps its buckets in memory;
the proxy lets a test refuse connections (an outage) or hold them without an answer (a stalled upload) and then
answer again, without losing what the server holds. Both bind 127.0.0.1 only.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["AzuriteServer", "Link", "LinkProcess", "MotoServer", "Proxy", "free_port", "s3_env"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _moto_command(port: int) -> list[str]:
    exe = Path(sys.executable).with_name("moto_server")
    if exe.is_file():
        return [str(exe), "-H", "127.0.0.1", "-p", str(port)]
    found = shutil.which("moto_server")
    if found is not None:
        return [found, "-H", "127.0.0.1", "-p", str(port)]
    if importlib.util.find_spec("moto") is not None:  # installed without its scripts (pip --target, on a lent GPU)
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    raise RuntimeError("moto_server is not installed: make test installs it with the dev extra (moto[server])")


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


@dataclass
class Link:
    """A network between a client and its store, for a :class:`Proxy` to model: ``mb_s`` megabytes per second each
    way, shared by every connection (one machine's link), and ``latency_ms`` one way. The store on 127.0.0.1 has
    neither: a benchmark through this sees the wait a real bucket adds (the client's CPU is idle meanwhile)."""

    mb_s: float
    latency_ms: float = 0.0
    _free: dict[str, float] = field(default_factory=lambda: {"up": 0.0, "down": 0.0}, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def delivery(self, direction: str, size: int) -> float:
        """When ``size`` bytes sent now in ``direction`` reach the other end (monotonic): after the bytes queued
        on the link before them, their own time on the wire, and the latency."""
        with self._lock:
            start = max(time.monotonic(), self._free[direction])
            self._free[direction] = end = start + size / (self.mb_s * 1e6)
        return end + self.latency_ms / 1e3


class Proxy:
    """A TCP proxy on 127.0.0.1 to ``target_port``; :meth:`refuse` closes its port (connection refused),
    :meth:`stall` takes connections and answers nothing, :meth:`restore` forwards again. With a ``link``, it forwards
    at the link's bandwidth and latency instead (a benchmark's network; refuse and stall are not for it)."""

    def __init__(self, target_port: int, port: int | None = None, link: Link | None = None) -> None:
        self.target_port = target_port
        self.link = link
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
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
        except OSError:
            client.close()
            return
        with self._lock:
            self._conns.append(upstream)
        if self.link is None:
            self._pipe(client, upstream)
        else:
            self._shaped(client, upstream)

    def _pipe(self, client: socket.socket, upstream: socket.socket) -> None:
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

    def _shaped(self, client: socket.socket, upstream: socket.socket) -> None:
        """Forward both ways through :attr:`link`: each chunk is read at once and sent on at its delivery time."""
        for src, dst, direction in ((client, upstream, "up"), (upstream, client, "down")):
            chunks: queue.Queue[tuple[float, bytes]] = queue.Queue()
            threading.Thread(target=self._read_into, args=(src, chunks, direction), daemon=True).start()
            threading.Thread(target=self._send_from, args=(chunks, dst), daemon=True).start()

    def _read_into(self, src: socket.socket, chunks: queue.Queue, direction: str) -> None:
        assert self.link is not None
        try:
            while data := src.recv(1 << 16):
                chunks.put((self.link.delivery(direction, len(data)), data))
        except OSError:
            pass
        chunks.put((0.0, b""))  # the end of the stream, sent on after the chunks before it

    def _send_from(self, chunks: queue.Queue, dst: socket.socket) -> None:
        try:
            while True:
                due, data = chunks.get()
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                time.sleep(max(0.0, due - time.monotonic()))
                dst.sendall(data)
        except OSError:
            return

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


def _listening(proc: subprocess.Popen, port: int, what: str, timeout: float) -> None:
    """Return once ``proc`` listens on 127.0.0.1:``port``; kill it and raise, naming ``what``, if it exits first or
    does not listen within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}") from None
            time.sleep(0.05)
    _kill(proc)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout} s")


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


class LinkProcess:
    """A :class:`Proxy` with a :class:`Link`, in a process of its own (``python -m tests.helpers.object_stores``): its
    threads then take no turns at the benchmark's interpreter lock, as a network would not."""

    def __init__(self, target_port: int, link: Link) -> None:
        self.target_port, self.link = target_port, link
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> LinkProcess:
        args = [str(a) for a in (self.target_port, self.port, self.link.mb_s, self.link.latency_ms)]
        root = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.object_stores", *args], cwd=root, stdout=subprocess.DEVNULL
        )
        _listening(self.proc, self.port, "the link's proxy", timeout)
        return self

    def stop(self) -> None:
        _kill(self.proc)


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
        _listening(self.proc, self.port, "azurite-blob", timeout)
        return self

    def stop(self) -> None:
        _kill(self.proc)  # its data is a test's temporary folder; SIGTERM left it running for seconds


if __name__ == "__main__":  # LinkProcess: TARGET_PORT PORT MB_S LATENCY_MS
    target, port, mb_s, latency_ms = sys.argv[1:5]
    Proxy(int(target), int(port), Link(float(mb_s), float(latency_ms))).start()
    threading.Event().wait()
