"""Runs first in every Python process of the test session (tests/conftest.py puts this folder on PYTHONPATH): hands
the command to the session's zygote (server.py beside this file) and stays as its proxy.

A command is handed over when ``LIGHTNING_ACCEL_TEST_ZYGOTE`` names the zygote's socket and this interpreter, and
it is ``python [-u] SCRIPT|-m MODULE|-c CODE ...`` with no descriptors beyond the three standard streams. Everything
else starts fresh, as do these, on purpose:
- launchers (torchrun, ``lightning-accel torchrun``): tests walk and kill their trees of workers, whose parent must
  be the launcher the test started;
- Ray's own processes, which Ray starts, watches and kills by itself;
- ``-c`` one-liners that import neither torch nor Lightning (a command a test's callback runs): forked, they would
  pay the preloaded modules' teardown at exit.
If the zygote cannot be reached, the process starts fresh too: only slower.

The proxy keeps the pid its caller knows. Signals it gets go to the process; it exits with the process's code, or
by the process's signal; killed itself (SIGKILL), its connection closes and the zygote kills the process.
"""

import os
import sys

__all__: list = []

FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGABRT", "SIGCONT", "SIGALRM")
FRESH_MODULES = ("torch.distributed.run", "torch.distributed.launch", "ray.")


class SkippedOptionalImports:
    """A finder that reports ``rfc3987_syntax`` as not installed. jsonschema imports it, if present, for its optional
    "iri" format checks, and it builds an Earley parser of RFC 3987 at import: 2.8 of 3.1 s of CPU for each
    ``import jsonschema`` here. It is here only as a dependency of jupyterlab (HolisticTraceAnalysis' extra), and
    every Ray process imports jsonschema, about 25 of them per Ray cluster the tests start. Nothing in the suite, and
    no schema of Ray's, checks formats; so the tests' processes skip it, as an install without jupyterlab does."""

    NAMES = ("rfc3987_syntax",)

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.partition(".")[0] in self.NAMES:
            raise ModuleNotFoundError(f"No module named {name!r} (skipped in the test session)", name=name)


def _command() -> "dict | None":
    """The request for this process's command line, or None when it starts fresh."""
    with open("/proc/self/cmdline", "rb") as f:
        argv = [a.decode("utf-8", "surrogateescape") for a in f.read().split(b"\0")[:-1]]
    unbuffered, i = False, 1
    while i < len(argv) and argv[i] in ("-u", "-B"):
        unbuffered, i = unbuffered or argv[i] == "-u", i + 1
    if i >= len(argv):
        return None
    if argv[i] in ("-m", "-c") and i + 1 < len(argv):
        mode, target, args = ("module" if argv[i] == "-m" else "code"), argv[i + 1], argv[i + 2 :]
    elif not argv[i].startswith("-"):
        mode, target, args = "script", argv[i], argv[i + 1 :]
    else:
        return None
    if mode == "module" and (
        target.startswith(FRESH_MODULES) or (target == "lightning_accel.cli" and args[:1] == ["torchrun"])
    ):
        return None
    if mode == "script" and ("/ray/" in target or (target.endswith("lightning-accel") and args[:1] == ["torchrun"])):
        return None
    if mode == "code" and ("multiprocessing" in target or not ("torch" in target or "lightning" in target)):
        return None  # (a one-liner without torch would pay its teardown, forked: about 1 s against 0.05 s fresh)
    return {"mode": mode, "target": target, "args": args, "unbuffered": unbuffered}


def _exit_as(status: int) -> None:
    import signal

    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _receive_int(conn) -> "int | None":
    import struct

    data = b""
    while len(data) < 4:
        chunk = conn.recv(4 - len(data))
        if not chunk:
            return None
        data += chunk
    return struct.unpack("!i", data)[0]


def _hand_over(path: str) -> None:
    if sorted(os.listdir("/proc/self/fd"), key=int) != ["0", "1", "2", "3"]:  # (3: the listing's own)
        return  # a standard stream closed, or descriptors beyond them (multiprocessing's pipes): fresh
    request = _command()
    if request is None:
        return
    import json
    import signal
    import socket
    import struct

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        return
    try:
        request.update(cwd=os.getcwd(), env=dict(os.environ))
        payload = json.dumps(request).encode()
        socket.send_fds(conn, [struct.pack("!I", len(payload))], [0, 1, 2])
        conn.sendall(payload)
        pid = _receive_int(conn)
    except OSError:
        pid = None
    if pid is None:  # nothing started: start fresh
        conn.close()
        return

    def forward(sig: int, _frame: object) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for name in FORWARDED:
        signal.signal(getattr(signal, name), forward)
    status = _receive_int(conn)
    if status is None:
        os._exit(255)
    _exit_as(status)


sys.meta_path.insert(0, SkippedOptionalImports())
_path = os.environ.get("LIGHTNING_ACCEL_TEST_ZYGOTE", "")
if _path and os.environ.get("LIGHTNING_ACCEL_TEST_ZYGOTE_PYTHON") == sys.executable:
    _hand_over(_path)
