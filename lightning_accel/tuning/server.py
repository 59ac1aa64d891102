"""Tune's trial processes, the parent side: start each trial in a fresh process, bounded by a timeout.

A fresh process per trial (forked from a server that has only imported torch and Lightning, or a new interpreter
for multi-device runs) keeps compile caches, allocator state and memory peaks from leaking from one trial into the
next; each trial also gets an empty inductor cache folder. :func:`run_trial` never raises for a failed trial: its
:class:`TrialResult` says what went wrong.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning_accel.tuning.trial import TrialResult, run_trial_process

__all__ = ["TrialServer", "run_trial", "serve", "temporary_workdir"]


class TrialServer:
    """A Python process that has imported torch and Lightning once and forks one child per trial.

    Each child is a fresh process whose only history is those imports, started in a fraction of a second
    instead of the seconds a new interpreter takes to import them. Requests are JSON lines on its stdin;
    it answers ``PID <pid>`` and then ``EXIT <code>`` per trial. (multiprocessing's forkserver would import
    the caller's ``__main__`` again, which breaks scripts without an ``if __name__ == "__main__"`` guard.)
    """

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_accel.tuning", "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._buffer = b""
        atexit.register(self.close)
        if self._line(120.0) != "READY":  # imported torch and Lightning: trials start from here
            self.proc.kill()
            raise RuntimeError("tune's trial server did not start within 120 s")

    def _line(self, timeout_s: float | None) -> str | None:
        """The server's next answer line; ``None`` if none came within ``timeout_s``."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready, _, _ = select.select([fd], [], [], wait)
            if not ready:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"tune's trial server exited (code {self.proc.poll()})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def run(self, request: dict[str, str], timeout_s: float) -> int | None:
        """The trial's exit status (negative: killed by that signal), or ``None`` when it ran out of time."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        pid = int((self._line(60.0) or "PID -1").split()[1])
        if pid < 0:
            raise RuntimeError("tune's trial server did not start the trial within 60 s")
        answer = self._line(max(timeout_s, 1.0))
        if answer is not None:
            return int(answer.split()[1])
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it ended just now
        self._line(None)  # the server reaps it and answers
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def serve() -> None:
    """The fork server's loop (``python -m lightning_accel.tuning --serve``)."""
    # Everything a trial imports is imported by now (this module imports trial.py, which imports the recipe).
    print("READY", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the trial
            fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = request["cache"]
            code = 0
            try:
                run_trial_process(request["spec"], request["out"])
            except BaseException:
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(f"PID {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"EXIT {os.waitstatus_to_exitcode(status)}", flush=True)


_SERVER: TrialServer | None = None


def _fork_server() -> TrialServer:
    global _SERVER
    if _SERVER is None or _SERVER.proc.poll() is not None:
        _SERVER = TrialServer()
    return _SERVER


def _result_or_reason(out_path: Path, returncode: int | None, tail: str, wall: float) -> TrialResult:
    if out_path.exists():
        result = TrialResult(**json.loads(out_path.read_text()))
        result.wall_s = wall
        return result
    killed = returncode in (-9, 137)
    reason = "killed (out of memory?)" if killed else f"exit code {returncode}: {tail[-400:]}"
    return TrialResult(error=reason, oom=killed, wall_s=wall)


def run_trial(spec: dict[str, Any], timeout_s: float, workdir: Path) -> TrialResult:
    """Run one trial in a fresh process, killed after ``timeout_s``; never raises for a failed trial.

    ``spec["fork"]`` (default true): fork it from the server that has imported torch and Lightning (fast);
    false: a new interpreter, needed when the trial starts processes of its own by re-running its command
    line (multi-device runs).
    """
    fork = bool(spec.get("fork", True))
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path, log_path = workdir / "spec.json", workdir / "result.json", workdir / "trial.log"
    spec = {**spec, "root": str(workdir / "root")}
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)  # a result left by an earlier trial in this folder is not this one's
    started = time.perf_counter()
    if fork:
        request = {"spec": str(spec_path), "out": str(out_path), "log": str(log_path)}
        try:
            server = _fork_server()  # waits until it is ready
            # Starting the server (importing torch and Lightning, once per search) is not this trial's time: counted
            # in, it makes the first trial look far longer than the rest, and the budget then skips trials that fit.
            started = time.perf_counter()
            code = server.run({**request, "cache": str(workdir / "inductor_cache")}, timeout_s)
        except (RuntimeError, OSError, ValueError) as err:  # the server itself failed: report, never raise
            return TrialResult(error=f"trial server: {err}", wall_s=time.perf_counter() - started)
        if code is None:
            return TrialResult(error=f"timeout: stopped after {timeout_s:.0f}s (the budget left)", wall_s=timeout_s)
        log_text = log_path.read_text(errors="replace") if log_path.exists() else ""
        tail = " | ".join(log_text.strip().splitlines()[-3:])
        return _result_or_reason(out_path, code, tail, time.perf_counter() - started)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),  # the caller's modules import in the trial
        # A cold compile cache per trial: compile time is measured as a first run of the recipe would pay it.
        "TORCHINDUCTOR_CACHE_DIR": str(workdir / "inductor_cache"),
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "lightning_accel.tuning", str(spec_path), str(out_path)],
            capture_output=True,
            text=True,
            timeout=max(timeout_s, 1.0),
            env=env,
        )
    except subprocess.TimeoutExpired:
        return TrialResult(error=f"timeout: stopped after {timeout_s:.0f}s (the budget left)", wall_s=timeout_s)
    log_path.write_text(proc.stdout + proc.stderr)
    tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
    return _result_or_reason(out_path, proc.returncode, tail, time.perf_counter() - started)


def temporary_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="lightning_accel_tune_"))
