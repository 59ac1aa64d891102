"""The test session's process zygote: one interpreter that has imported torch, Lightning and the rest of the
third-party stack once, and forks a new process from that image for each Python command the tests start.

    python tests/helpers/zygote/server.py SOCKET

Why: each test process spends about 6.5 s of CPU importing torch and Lightning before it does anything, and the
suite starts about 180 of them on two cores. A process forked from here starts with those modules in memory and
runs our code from the top, as a fresh one does: ``lightning_accel`` is never imported here, so every import-time
effect of ours still happens in each process.

How a command gets here: ``sitecustomize.py`` beside this file runs first in every Python process of the session.
It sends this server its command line, working folder, environment and standard streams, and stays as a thin proxy
with the pid the caller knows: it forwards signals, and exits as the forked process exits (with its code, or killed
by its signal). A proxy killed with SIGKILL closes its connection, and its process is killed too.

Each connection gets a handler, forked from the server, which forks the process and then watches both: the
process's exit (reported to the proxy) and the proxy's connection (its end kills the process).
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import io
import json
import logging
import os
import runpy
import select
import signal
import socket
import struct
import sys

__all__ = ["serve"]

# What every test process imports first, costing most of its start (measured: 6.9 of 7.6 s of CPU for
# `import lightning_accel.cli`). Nothing here starts a thread of Python's or touches a GPU.
PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed.checkpoint",
    "torchmetrics",
    "matplotlib.pyplot",
    "lightning.pytorch",
    "fsspec",
)
PR_SET_PDEATHSIG = 1
STREAMS = 3  # stdin, stdout, stderr


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: a 4-byte length with the standard streams' descriptors attached, then that many bytes of JSON."""
    header, fds, _, _ = socket.recv_fds(conn, 4, STREAMS)
    (size,) = struct.unpack("!I", header)
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the proxy went away mid-request")
        data += chunk
    return json.loads(data), fds


def reopen_stdio(unbuffered: bool) -> None:
    """New sys.stdin/stdout/stderr over descriptors 0-2 (now the caller's), buffered as CPython would for them, and
    logging handlers that wrote to the old streams moved to the new ones (Lightning adds one at import)."""
    old = {id(sys.stdout): "stdout", id(sys.stderr): "stderr"}
    encoding = (os.environ.get("PYTHONIOENCODING") or "utf-8").split(":")[0]
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=encoding)
    for fd, name, errors in ((1, "stdout", "strict"), (2, "stderr", "backslashreplace")):
        raw = io.FileIO(fd, "w", closefd=False)
        line = raw.isatty() or name == "stderr"  # (since 3.9 stderr is line-buffered everywhere)
        stream = io.TextIOWrapper(
            io.BufferedWriter(raw), encoding=encoding, errors=errors, line_buffering=line, write_through=unbuffered
        )
        setattr(sys, name, stream)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    loggers = [
        logging.getLogger(),
        *(lg for lg in logging.Logger.manager.loggerDict.values() if hasattr(lg, "handlers")),
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in old:
                handler.setStream(getattr(sys, old[id(handler.stream)]))


def rebuild_path(first: str, pythonpath: str, own_pythonpath: str) -> None:
    """sys.path as a fresh interpreter would have it: ``first`` (the script's folder, or the working folder), then
    the new PYTHONPATH, then this interpreter's own entries (stdlib, site-packages) without its ``own_pythonpath``."""
    ours = [os.path.abspath(p) for p in own_pythonpath.split(os.pathsep) if p]
    rest = [p for p in sys.path[1:] if os.path.abspath(p or ".") not in ours]
    extra = [os.path.abspath(p) for p in pythonpath.split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *rest]
    importlib.invalidate_caches()


def become(request: dict, fds: list[int]) -> None:
    """Turn this forked process into the requested one, up to running its code."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # its handler gone (the session ending): gone too
    os.setsid()  # a group of its own: a signal to its group never reaches the zygote
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(request["cwd"])
    own_pythonpath = os.environ.get("PYTHONPATH", "")
    os.environ.clear()
    os.environ.update(request["env"])
    if "tempfile" in sys.modules:  # the preload may have asked for the temporary folder: the zygote's TMPDIR, cached
        sys.modules["tempfile"].tempdir = None  # found again from this process's own, as a fresh process finds it
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():  # torch read it when this zygote imported it; a fresh process reads its own
        import torch

        torch.set_num_threads(int(threads))
    unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    reopen_stdio(unbuffered)
    mode, target = request["mode"], request["target"]
    first = os.path.dirname(os.path.abspath(target)) if mode == "script" else (os.getcwd() if mode == "module" else "")
    rebuild_path(first, os.environ.get("PYTHONPATH", ""), own_pythonpath)


def run(request: dict) -> None:
    """Run the command's code as ``__main__``. Its SystemExit and exceptions leave through the interpreter's top
    level, so it exits, prints a traceback and runs its atexit functions as a fresh process does."""
    mode, target, args = request["mode"], request["target"], request["args"]
    if mode == "module":
        sys.argv = ["-m", *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif mode == "script":
        sys.argv = [target, *args]
        runpy.run_path(target, run_name="__main__")
    else:
        sys.argv = ["-c", *args]
        main = type(sys)("__main__")
        sys.modules["__main__"] = main
        exec(compile(target, "<string>", "exec"), main.__dict__)


def handle(conn: socket.socket) -> dict:
    """In the handler: fork the process; return its request in the process; in the handler, report its exit to the
    proxy, or kill it when the proxy's connection ends first, and exit."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server ignores it (no zombies); this one waits
    request, fds = receive(conn)
    pid = os.fork()
    if pid == 0:
        conn.close()
        become(request, fds)
        return request
    for fd in fds:
        os.close(fd)
    conn.sendall(struct.pack("!i", pid))
    pidfd = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([conn, pidfd], [], [])
        if pidfd in ready:
            _, status = os.waitpid(pid, 0)
            try:
                conn.sendall(struct.pack("!i", status))
            finally:
                os._exit(0)
        if not conn.recv(1):  # the proxy is gone (SIGKILL): its process goes with it, as the caller expects
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os._exit(0)


def serve(path: str) -> dict:
    """Accept requests forever; returns only in a forked process, with its request."""
    for name in PRELOAD:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # the preloaded objects out of the collector's sight: its passes in a child copy none of their pages
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(128)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers are reaped by the kernel
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            server.close()
            return handle(conn)
        conn.close()


def main() -> None:
    request = serve(sys.argv[1])
    run(request)


if __name__ == "__main__":
    main()
