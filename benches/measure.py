"""What the benchmarks share: running one side as a child process and measuring it."""
import contextlib
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# MKL's "is this an Intel CPU?" answered yes: preloaded into a PyTorch side (LD_PRELOAD), its
# fp32 products take MKL's fast path on any x86 CPU, as lakeml's do by default (src/gemm.rs)
# and as HF's text-embeddings-inference CPU image does.
MKL_OVERRIDE_C = "int mkl_serv_intel_cpu_true(void) { return 1; }\n"

# glibc keeping freed memory for reuse instead of unmapping every large block on free (and
# page-faulting it in again on the next forward pass): what the lakeml binary sets with
# mallopt at start-up, and what a tuned user gets from these tunables (or from jemalloc or
# tcmalloc). The tuned peers run with it too.
TUNED_MALLOC = {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"}


def mkl_override_lib(work: pathlib.Path) -> str:
    """Builds the MKL override as a shared library in `work` (with the system's cc) and
    returns its path, for LD_PRELOAD."""
    src, lib = work / "mkl_override.c", work / "libmkl_override.so"
    if not lib.exists():
        src.write_text(MKL_OVERRIDE_C)
        r = run_measured(["cc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(src)])
        if r["rc"] != 0:
            sys.exit(f"building the MKL override library failed (a C compiler `cc` is needed):\n{r['stderr']}")
    return str(lib)


def gemm_peaks(bin_: str, env: dict | None = None) -> dict:
    """`pipeline info --json`'s GEMM microbenchmark (4096x384 . 384x1536 with this process's
    threads): GFLOP/s at fp32 (lakeml's MKL path) and bf16, GOP/s at int8, as the peaks
    that MFU is measured against."""
    peaks = {}
    for _ in range(2):  # a peak: the better of two measurements (the machine is shared)
        g = json.loads(run_ok([bin_, "info", "--json"], env)["stdout"])["gemm"]
        for key, field in (("fp32", "fp32_gflops"), ("bf16", "bf16_gflops"), ("int8", "int8_gops")):
            peaks[key] = max(peaks.get(key, 0.0), g[field])
    return peaks


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


class SideFailed(Exception):
    """One side of a benchmark could not run; the message says why."""


def medians(runs: list[dict], sides: list[str], precisions: list[str], rows: int, flops: float,
            peaks: dict) -> dict:
    """Per "side/precision": the medians of its runs' wall, in-process and forward-pass
    seconds and peak RSS, rows/s over the wall time, and MFU (the model's FLOPs per second
    over the GEMM peak of the precision that actually ran: a run's `precision_used`, else
    its own)."""
    med = {}
    for p in precisions:
        for s in sides:
            xs = [r for r in runs if r["side"] == s and r["precision"] == p]
            if not xs:
                continue
            m = {k: statistics.median(x[k] for x in xs) for k in ("wall_s", "rss_mib", "stage_s")}
            passes = [x["predict_s"] for x in xs if x.get("predict_s") is not None]
            m["predict_s"] = statistics.median(passes) if passes else None
            m["rows_per_s"] = rows / m["wall_s"]
            m["precision_used"] = xs[0].get("precision_used", p)
            m["model_gflops"] = flops / m["wall_s"] / 1e9
            peak = peaks.get(m["precision_used"])
            m["mfu"] = m["model_gflops"] / peak if peak else None
            m["runs"] = len(xs)
            med[f"{s}/{p}"] = m
    return med


# The prefix of a child side's result line (the libraries it runs log on stdout too).
RESULT = "BENCH_RESULT "


def peer_env(env: dict, mkl: bool, tuned: bool) -> dict:
    """A peer child's environment: with the MKL override preloaded (`mkl`, which implies the
    malloc tuning) or the malloc tuning alone (`tuned`)."""
    if mkl:
        return dict(env, LD_PRELOAD=env["LAKEML_BENCH_MKL_OVERRIDE"], **TUNED_MALLOC)
    return dict(env, **TUNED_MALLOC) if tuned else env


def peer_result(r: dict, label: str, mkl: bool) -> dict:
    """A peer child's measured run: its last RESULT line's fields, its wall time, peak RSS and
    stderr's end; SideFailed naming `label` if it failed, printed no result, or (`mkl`) did
    not get the MKL override."""
    lines = [x for x in r["stdout"].splitlines() if x.startswith(RESULT)]
    if r["rc"] != 0 or not lines:
        raise SideFailed(f"{label} exited {r['rc']}:\n{tail(r['stderr'] + r['stdout'])}")
    out = json.loads(lines[-1][len(RESULT):])
    if mkl and not out.get("mkl_override"):
        raise SideFailed(f"{label}: LD_PRELOAD of the MKL override did not reach the child")
    return {**out, "rss_mib": r["rss_mib"], "wall_s": r["wall"], "stderr_tail": tail(r["stderr"], 5)}


def tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def stage_reports(stdout: str) -> list[dict]:
    """`pipeline run --json` output: one JSON report per line, or one JSON array."""
    try:
        parsed = json.loads(stdout)
        return parsed if isinstance(parsed, list) else [parsed]
    except json.JSONDecodeError:
        return [json.loads(line) for line in stdout.splitlines() if line.strip().startswith("{")]


@contextlib.contextmanager
def work_dir(prefix: str, keep: bool):
    """A scratch directory for one benchmark run, removed at the end unless `keep`."""
    work = pathlib.Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield work
    finally:
        if keep:
            print(f"work dir kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
