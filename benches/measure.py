"""What the benchmarks share: running one side as a child process and measuring it."""
import os
import subprocess
import sys
import tempfile
import time


def run_measured(cmd: list[str], env: dict | None = None) -> dict:
    """Runs cmd as a child; returns its wall time, its own peak RSS (wait4), exit code and output.

    Output goes to temporary files, not pipes: waiting on a child that fills a pipe
    would deadlock.
    """
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, env=env, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        out_f.seek(0)
        err_f.seek(0)
        out, err = out_f.read(), err_f.read()
    return {"wall": wall, "rss_mib": usage.ru_maxrss / 1024, "rc": os.waitstatus_to_exitcode(status),
            "stdout": out, "stderr": err}


def run_ok(cmd: list[str], env: dict | None = None) -> dict:
    """run_measured, ending the benchmark with the child's output if it failed."""
    r = run_measured(cmd, env)
    if r["rc"] != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r['stdout']}\n{r['stderr']}")
    return r
