"""Workers on the executors: predict()/embed() with a `model` and no `endpoints`.

Each Spark executor runs one `pipeline serve` for a model (and its settings), on 127.0.0.1
with a random port and a random Bearer token; all tasks of that executor share it.

- The executor is the task's nearest `java` ancestor, named by its pid and start time (a
  reused pid is another executor). It is gone when that JVM exits, or when it no longer has
  PySpark Python processes, which it stops with its SparkContext (`spark.stop()` in local
  mode, where the JVM is the driver's and outlives the session).
- State lives in `$TMPDIR/lakeml-<uid>/workers/<executor>-<spec>/` (mode 0700): `lock`
  (an flock the first task takes to start the worker; the others wait on it, then connect),
  `worker.json` (port, token, pids; mode 0600), `busy` (tasks hold a shared flock on it while
  they exchange rows) and `used` (its mtime is the last use).
- The worker is started through a supervisor (`python -m lakeml_spark._local`, in a session
  of its own) that stops it with SIGTERM when the executor is gone (the Spark session
  stopped, the executor exited) or when no task has used it for `idle` seconds, and that
  exits when the worker does; `worker.json` is removed before either, so a task never
  connects to a worker on its way out without noticing (its exchange fails, and it starts a
  new one).
- A worker that cannot start fails the task with the worker's own message (its stderr).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import glob
import hashlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time

from ._errors import WorkerError

IDLE_S = 120.0
START_TIMEOUT_S = 600.0
READY = re.compile(r"listening on grpc://127\.0\.0\.1:(\d+)")


class LocalWorkerError(WorkerError):
    """The executor's worker could not be started (its own message is in the text)."""


@dataclasses.dataclass(frozen=True)
class LocalWorker:
    """What the executors' worker serves; pickled into the tasks."""

    model: str | None = None
    threads: int | None = None
    precision: str | None = None
    max_length: int | None = None
    idle: float = IDLE_S
    # Instead of a model: a pipeline file whose tables (and `serve.models`) the worker serves,
    # with the file's own auth (its token is the caller's to give).
    pipeline: str | None = None

    def spec(self) -> str:
        fields = dataclasses.asdict(self)
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]

    def state_dir(self) -> str:
        pid, started = executor()
        base = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"lakeml-{os.getuid()}", "workers")
        path = os.path.join(base, f"{pid}-{started}-{self.spec()}")
        os.makedirs(path, mode=0o700, exist_ok=True)
        if os.stat(path).st_uid != os.getuid() or os.stat(path).st_mode & 0o077:
            raise LocalWorkerError(f"lakeml_spark: {path} must be a directory only this user "
                                   "can read (mode 0700)")
        return path

    def connect(self) -> tuple[str, str, str]:
        """(uri, token, state dir) of this executor's worker, started if it is not running
        (the token is empty for a pipeline file's worker: the file's auth applies)."""
        path = self.state_dir()
        with _flock(os.path.join(path, "lock"), fcntl.LOCK_EX):
            info = _read_info(path)
            if info is None:
                info = self._start(path)
        _touch(os.path.join(path, "used"))
        return f"grpc://127.0.0.1:{info['port']}", info["token"], path

    def restart(self, path: str, uri: str) -> None:
        """The worker at `uri` failed a call: stop it if it is still the registered one, so
        that the next connect() starts a new one."""
        with _flock(os.path.join(path, "lock"), fcntl.LOCK_EX):
            info = _read_info(path)
            if info is not None and uri.endswith(f":{info['port']}"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(path, "worker.json"))
                with contextlib.suppress(ProcessLookupError):
                    os.kill(info["worker_pid"], signal.SIGKILL)

    def _start(self, path: str) -> dict:
        binary = pipeline_binary()
        check_torch()
        token = secrets.token_hex(24)
        if self.pipeline is not None:
            token = ""  # the file's own auth
            command = [binary, "serve", self.pipeline, "--listen", "127.0.0.1:0"]
        else:
            pipeline = os.path.join(path, "worker.yaml")
            model = {"path": self.model}
            for key in ("threads", "precision", "max_length"):
                if getattr(self, key) is not None:
                    model[key] = getattr(self, key)
            # JSON is YAML: every value is quoted as it must be.
            with open(pipeline, "w") as f:
                json.dump({"name": "lakeml-spark-worker",
                           "serve": {"listen": "127.0.0.1:0", "models": {"model": model},
                                     "auth": {"tokens": ["${LAKEML_WORKER_TOKEN}"]}}}, f)
            command = [binary, "serve", pipeline]
        what = f"pipeline {self.pipeline}" if self.pipeline else f"model {self.model}"
        log = os.path.join(path, "worker.log")
        pid, started = executor()
        with open(log, "ab") as err:  # appended: a restarted worker's log keeps the last one's
            supervisor = subprocess.Popen(
                [sys.executable, "-m", "lakeml_spark._local", path, str(pid), str(started),
                 str(self.idle), *command],
                env={**os.environ, "LAKEML_WORKER_TOKEN": token, "PYTHONPATH": _pythonpath()},
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            info = _read_info(path)
            if info is not None:
                return info
            if supervisor.poll() is not None:
                raise LocalWorkerError(
                    f"lakeml_spark: the local worker for {what} could not start: {_tail(log)}")
            time.sleep(0.05)
        supervisor.kill()
        raise LocalWorkerError(f"lakeml_spark: the local worker for {what} was not ready after "
                               f"{START_TIMEOUT_S:.0f} s; its log: {_tail(log)}")

    @contextlib.contextmanager
    def busy(self, path: str):
        """Held around a task's exchanges: the supervisor does not stop a worker in use."""
        with _flock(os.path.join(path, "busy"), fcntl.LOCK_SH):
            try:
                yield
            finally:
                _touch(os.path.join(path, "used"))


def executor() -> tuple[int, int]:
    """(pid, start time) of this task's executor: the nearest `java` ancestor (the
    executor's JVM; the driver's in local mode), else this process (outside Spark)."""
    parent = _ppid(os.getpid())
    while parent > 1:
        if _read(f"/proc/{parent}/comm").strip() == b"java":
            return parent, _start_time(parent)
        parent = _ppid(parent)
    return os.getpid(), _start_time(os.getpid())


def _python_workers(jvm: int) -> bool:
    """Whether the JVM has PySpark Python processes (daemons or workers) as children."""
    for stat in glob.glob("/proc/[0-9]*/stat"):
        pid = int(stat.split("/")[2])
        if _ppid(pid) == jvm and b"pyspark" in _read(f"/proc/{pid}/cmdline"):
            return True
    return False


def pipeline_binary() -> str:
    """The `pipeline` binary: $LAKEML_PIPELINE, else the one the lakeml wheel installed into
    this Python environment, else the PATH's."""
    explicit = os.environ.get("LAKEML_PIPELINE")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise LocalWorkerError(f"lakeml_spark: LAKEML_PIPELINE={explicit} is not an "
                                   "executable file")
        return explicit
    here = os.path.join(sysconfig.get_path("scripts"), "pipeline")
    if os.access(here, os.X_OK):
        return here
    found = shutil.which("pipeline")
    if found:
        return found
    raise LocalWorkerError(f"lakeml_spark: no `pipeline` binary in this executor's Python "
                           f"environment ({sys.prefix}); install lakeml there (pip install "
                           "lakeml) or set LAKEML_PIPELINE to the binary")


def check_torch() -> None:
    """The wheel's binary uses the libtorch of the environment's torch package."""
    if os.environ.get("LAKEML_PIPELINE"):
        return  # a binary built from source links its own libtorch
    if importlib.util.find_spec("torch") is None:
        raise LocalWorkerError(f"lakeml_spark: no torch in this executor's Python environment "
                               f"({sys.prefix}); lakeml runs on its libtorch: pip install "
                               "torch==2.11.0")


def _pythonpath() -> str:
    """The supervisor imports this package from where this process did."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rest = os.environ.get("PYTHONPATH")
    return here + (os.pathsep + rest if rest else "")


def _read_info(path: str) -> dict | None:
    """worker.json, when its worker is alive."""
    try:
        with open(os.path.join(path, "worker.json")) as f:
            info = json.load(f)
    except (FileNotFoundError, ValueError):
        return None
    return info if _alive(info["worker_pid"]) else None


def _alive(pid: int) -> bool:
    """Running (a killed worker its supervisor has not reaped yet is a zombie)."""
    fields = _stat(pid)
    return bool(fields) and fields[0] != b"Z"


@contextlib.contextmanager
def _flock(path: str, how: int):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)


def _touch(path: str) -> None:
    with open(path, "a"):
        os.utime(path)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _stat(pid: int) -> list[bytes]:
    # Fields after the command name, which may hold spaces and parentheses.
    return _read(f"/proc/{pid}/stat").rsplit(b")", 1)[-1].split()


def _ppid(pid: int) -> int:
    fields = _stat(pid)
    return int(fields[1]) if len(fields) > 1 else 0


def _start_time(pid: int) -> int:
    fields = _stat(pid)
    return int(fields[19]) if len(fields) > 19 else 0


def _tail(log: str, lines: int = 20) -> str:
    text = _read(log).decode("utf-8", "replace").strip()
    return "\n".join(text.splitlines()[-lines:]) or "(no output)"


# --- the supervisor ------------------------------------------------------------------------


def _supervise(path: str, executor_pid: int, executor_started: int, idle: float,
               command: list[str]) -> int:
    """Runs the worker (`command`: pipeline serve ...) until the executor is gone or the
    worker idles; writes worker.json once it listens. Exits with the worker's status."""
    worker = subprocess.Popen(command, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=None, text=True)
    port = None
    assert worker.stdout is not None
    for line in worker.stdout:
        sys.stderr.write(line)
        match = READY.search(line)
        if match:
            port = int(match.group(1))
            break
    if port is None:
        return worker.wait() or 1
    info = {"port": port, "token": os.environ.get("LAKEML_WORKER_TOKEN", ""), "worker_pid": worker.pid,
            "supervisor_pid": os.getpid()}
    tmp = os.path.join(path, "worker.json.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    _touch(os.path.join(path, "used"))
    os.replace(tmp, os.path.join(path, "worker.json"))
    # The rest of its stdout (a client snippet) goes to the log too: closing the pipe would
    # make the worker's next print fail.
    threading.Thread(target=_copy, args=(worker.stdout, sys.stderr), daemon=True).start()

    def retire(reason: str) -> None:
        with _flock(os.path.join(path, "lock"), fcntl.LOCK_EX):
            current = _read_info(path)
            if current is not None and current["worker_pid"] == worker.pid:
                os.unlink(os.path.join(path, "worker.json"))
        print(f"lakeml_spark: stopping the local worker (pid {worker.pid}): {reason}",
              file=sys.stderr, flush=True)
        worker.terminate()

    jvm = _read(f"/proc/{executor_pid}/comm").strip() == b"java"
    checked = 0.0
    while worker.poll() is None:
        time.sleep(0.5)
        if _start_time(executor_pid) != executor_started:
            retire("its executor is gone")
            break
        if time.monotonic() - checked > 2.0:
            checked = time.monotonic()
            if jvm and not _python_workers(executor_pid):
                retire("its executor stopped its Python workers (the Spark session ended)")
                break
        if _idle_for(path) > idle and _not_busy(path):
            retire(f"idle for {idle:.0f} s")
            break
    else:
        with _flock(os.path.join(path, "lock"), fcntl.LOCK_EX), \
                contextlib.suppress(FileNotFoundError, ValueError):
            with open(os.path.join(path, "worker.json")) as f:
                if json.load(f).get("worker_pid") == worker.pid:
                    os.unlink(os.path.join(path, "worker.json"))
        print(f"lakeml_spark: the local worker (pid {worker.pid}) exited with status "
              f"{worker.returncode}", file=sys.stderr, flush=True)
    try:
        return worker.wait(timeout=60)
    except subprocess.TimeoutExpired:
        worker.kill()
        return worker.wait()


def _copy(source, sink) -> None:
    for line in source:
        sink.write(line)
        sink.flush()


def _idle_for(path: str) -> float:
    try:
        return time.time() - os.stat(os.path.join(path, "used")).st_mtime
    except FileNotFoundError:
        return 0.0


def _not_busy(path: str) -> bool:
    fd = os.open(os.path.join(path, "busy"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


if __name__ == "__main__":
    _path, _pid, _started, _idle = sys.argv[1:5]
    sys.exit(_supervise(_path, int(_pid), int(_started), float(_idle), sys.argv[5:]))
