"""Serving benchmark: `pipeline serve` (Flight SQL and DoExchange) against lakeml's predict stage.

Run with `scripts/bench.sh serve` (builds lakeml, installs the clients, then calls this);
`--precision fp32|bf16` (default fp32), `--repeats N` (default 3, medians), `--rows N` (a
fixed sample of N reviews, for quick runs; default all 12,808), `--model DIR` (a trained
classifier directory; default a MiniLM-L6 classifier with a seeded head, made here),
`--threads N`, `--clients 1,4,16`, `--deadline S`, `--out FILE` (a JSON summary), `--keep`.

What is measured: classifying every review of a Delta table with one classifier directory
(all-MiniLM-L6-v2 plus a 2-way head: rotten / fresh), four ways, in the same run over the
same rows with the same intra-op thread count:
1. predict stage (the baseline): `pipeline run --json --quiet --force benches/pipelines/
   predict.yaml`, table in, Delta table of predictions out; rows/s over the stage report's
   in-process `seconds`; the process's wall time is shown too.
2. Flight SQL: `SELECT id, predict(text) AS label FROM reviews` through ADBC's Flight SQL
   driver, fetched completely; rows/s over the client's time from execute to the last batch.
3. DoExchange: the table's (id, text) rows streamed through `pipeline serve`'s DoExchange
   (pyarrow.flight) in batches of 1024, written by one thread while the main one reads;
   rows/s over the time from opening the exchange to the last batch read.
4. Concurrency: C clients at once (C in 1, 4, 16), each on its own ADBC connection, cover
   all rows in C*8 disjoint slices (`WHERE id % (C*8) = k`), 8 queries one after another
   per client; total rows/s over the phase's wall time, p50 and p99 query latency. A phase
   stops at --deadline (default 600 s) and reports what it got.
Every server phase runs on a fresh `pipeline serve benches/pipelines/serve.yaml` process:
started and waited for (its ready line) untimed, timed, then stopped with SIGTERM (its exit
code and peak RSS are recorded). The labels of every server phase are checked against the
predict stage's table (fraction of rows with the same label; for DoExchange, the largest
score difference too, and that the rows came back in the order sent).

Why it is fair:
- Same input, same model: lakeml writes the input table once (benches/pipelines/
  predict_input.yaml, not timed); the predict stage and every server read that table and
  the same model directory.
- Same settings: benches/pipelines/serve.yaml gives the served model predict.yaml's stage
  settings: device cpu, the same precision, the same `threads`, max_length 512, lakeml's
  default batching (rows sorted by length, 4096 padded tokens per forward pass).
- No warm cache: the server keeps recent texts' scores, so a repeated query would be nearly
  free. Each timed phase runs on a fresh server process, and within a phase no row is asked
  for twice (the concurrency slices are disjoint). The server does score each distinct text
  once per call, where the stage scores every row: the input's count of distinct texts is
  printed (a repeated review within one call is the only work the server can skip).
- What each clock holds: the stage's `seconds` run from model load to the predictions
  committed (reading, tokenizing, forward passes, writing the Delta table). A server phase's
  clock starts after the server is ready (model loaded, untimed; the start-up time is
  printed) and holds planning, reading, tokenizing, forward passes, and sending every row
  to a client over loopback gRPC, which decodes it; it writes no table. The client runs on
  the same cores as the server, so its decoding and gRPC work are charged to the server's
  side.
- Same cores, one at a time: the stage, each server and each client run as child processes
  on the same machine, one after the other (the order of the stage, Flight SQL and
  DoExchange reversed on odd repeats), with the same intra-op thread count (lakeml's
  `threads`; OMP_NUM_THREADS / MKL_NUM_THREADS for all); peak RSS comes from wait4 on the
  stage's and each server's process.
"""
import argparse
import importlib.metadata
import json
import math
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench_predict import LABELS, lakeml_side
from measure import SideFailed, run_measured, tail, work_dir

EXCHANGE_BATCH = 1024  # rows per DoExchange batch
QUERIES_PER_CLIENT = 8  # the concurrency phase's slice queries per client
READY_TIMEOUT_S = 600.0  # a server start-up (model load) longer than this fails the run
STOP_TIMEOUT_S = 60.0  # SIGTERM to exit (the file's shutdown_grace is 5 s); then SIGKILL
RESULT = "BENCH_RESULT "  # prefix of a client child's result line
READY = re.compile(r"lakeml serve: listening on (\S+)\n")
SQL_ALL = "SELECT id, predict(text) AS label FROM reviews"
SIDES = {"stage": "predict stage", "sql": "Flight SQL", "exchange": "DoExchange"}


def slice_sql(slices: int, k: int) -> str:
    return f"SELECT id, predict(text) AS label FROM reviews WHERE id % {slices} = {k}"


def percentile(sorted_values: list[float], q: float):
    """Nearest rank, as tests/py/flight_load.py computes it."""
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * (len(sorted_values) - 1) + 0.5))]


# --- the server ------------------------------------------------------------------------------

class Server:
    """One `pipeline serve` process: started, waited for (untimed), stopped with SIGTERM.

    Its stdout and stderr go to files (never a pipe it could block on); the ready line is
    read back from the stdout file. On exit: `rc`, `rss_mib` (wait4), `wall_s` (start to
    exit), `ready_s` (start to the ready line).
    """

    def __init__(self, bin_: str, yaml: str, env: dict, logs: pathlib.Path):
        self.cmd = [bin_, "serve", yaml, "--listen", "127.0.0.1:0"]
        self.env, self.out_path, self.err_path = env, logs.with_suffix(".out"), logs.with_suffix(".err")
        self.proc = None
        self.uri = None
        self.ready_s = self.wall_s = self.rss_mib = self.rc = None

    def log_tail(self, lines: int = 20) -> str:
        text = ""
        for path in (self.out_path, self.err_path):
            if path.exists():
                text += path.read_text(errors="replace")
        return tail(text, lines)

    def __enter__(self) -> "Server":
        with open(self.out_path, "w") as out_f, open(self.err_path, "w") as err_f:
            self.started = time.perf_counter()
            self.proc = subprocess.Popen(self.cmd, stdout=out_f, stderr=err_f, stdin=subprocess.DEVNULL,
                                         env=self.env)
        try:
            while True:
                m = READY.search(self.out_path.read_text(errors="replace"))
                if m:
                    self.uri = m.group(1)
                    self.ready_s = time.perf_counter() - self.started
                    return self
                if self.proc.poll() is not None:
                    raise SideFailed(f"`{' '.join(self.cmd)}` exited {self.proc.returncode} before it was "
                                     f"ready:\n{self.log_tail()}")
                if time.perf_counter() - self.started > READY_TIMEOUT_S:
                    raise SideFailed(f"`{' '.join(self.cmd)}` was not ready after {READY_TIMEOUT_S:.0f} s:\n"
                                     f"{self.log_tail()}")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop()
        if exc_type is not None:
            print(f"server log ({self.out_path.parent}):\n{self.log_tail(10)}", file=sys.stderr)

    def stop(self) -> None:
        """SIGTERM, then wait4 (its peak RSS) up to STOP_TIMEOUT_S; SIGKILL if it is still up."""
        proc = self.proc
        if proc is None or self.rc is not None:
            return
        if proc.returncode is not None:  # it died on its own and poll() reaped it
            self.rc = proc.returncode
            self.wall_s = time.perf_counter() - self.started
            return
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        killed = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if not killed and time.monotonic() > deadline:
                proc.kill()
                killed = True
            time.sleep(0.02)
        self.wall_s = time.perf_counter() - self.started
        self.rc = os.waitstatus_to_exitcode(status)
        proc.returncode = self.rc  # reaped here, not by Popen
        self.rss_mib = usage.ru_maxrss / 1024
        if killed:
            self.rc = f"killed after {STOP_TIMEOUT_S:.0f} s ({self.rc})"


# --- clients (child processes) ---------------------------------------------------------------

def adbc_connect(uri: str, timeout_s: float):
    import adbc_driver_flightsql
    import adbc_driver_flightsql.dbapi as flight_sql

    options = adbc_driver_flightsql.DatabaseOptions
    db_kwargs = {options.TIMEOUT_QUERY.value: f"{timeout_s:g}", options.TIMEOUT_FETCH.value: f"{timeout_s:g}"}
    return flight_sql.connect(uri, db_kwargs=db_kwargs, autocommit=True)


def sql_child(spec: dict) -> dict:
    """Flight SQL: every row's label in one query, fetched completely."""
    import pyarrow.parquet as pq

    conn = adbc_connect(spec["uri"], spec["timeout_s"])
    cur = conn.cursor()
    t0 = time.perf_counter()
    cur.execute(SQL_ALL)
    table = cur.fetch_arrow_table()
    seconds = time.perf_counter() - t0
    cur.close()
    conn.close()
    pq.write_table(table.select([0, 1]).rename_columns(["id", "label"]), spec["out"])
    return {"rows": table.num_rows, "seconds": seconds, "columns": table.column_names}


def exchange_child(spec: dict) -> dict:
    """DoExchange: the (id, text) rows out in batches, the rows with predictions back."""
    import deltalake
    import pyarrow.flight as flight
    import pyarrow.parquet as pq

    data = deltalake.DeltaTable(spec["source"]).to_pyarrow_table(columns=["id", "text"]).combine_chunks()
    batches = data.to_batches(max_chunksize=spec["batch_rows"])
    client = flight.FlightClient(spec["uri"])
    options = flight.FlightCallOptions(timeout=spec["timeout_s"])
    descriptor = flight.FlightDescriptor.for_command(json.dumps({"text": "text"}).encode())
    write_errors = []

    t0 = time.perf_counter()
    writer, reader = client.do_exchange(descriptor, options)

    def write() -> None:
        # one thread writes while the main one reads, so flow control cannot stall the call
        try:
            writer.begin(data.schema)
            for batch in batches:
                writer.write_batch(batch)
            writer.done_writing()
        except Exception as e:  # noqa: BLE001 - the read side carries the server's status
            write_errors.append(e)

    writer_thread = threading.Thread(target=write, daemon=True)
    writer_thread.start()
    try:
        out = reader.read_all()
    finally:
        writer_thread.join(spec["timeout_s"])
    seconds = time.perf_counter() - t0
    try:
        writer.close()
    except Exception:  # noqa: BLE001
        pass
    if write_errors:
        raise write_errors[0]
    client.close()
    ids_in = data.column("id").to_pylist()
    ids_out = out.column("id").to_pylist() if "id" in out.column_names else []
    pq.write_table(out.select(["id", "label", "score"]), spec["out"])
    return {"rows": out.num_rows, "seconds": seconds, "batches_in": len(batches), "columns": out.column_names,
            "same_order": ids_in == ids_out}


def load_child(spec: dict) -> dict:
    """Concurrency: `clients` connections at once, each running its slice queries in turn."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    clients, queries = spec["clients"], spec["queries"]
    slices = clients * queries
    conns = [adbc_connect(spec["uri"], spec["timeout_s"]) for _ in range(clients)]  # untimed
    cursors = [c.cursor() for c in conns]
    lock = threading.Lock()
    latencies_ms, tables, errors = [], [], []
    counts = {"failed": 0, "skipped": 0}
    finished = [None] * clients
    go = threading.Event()
    clock = {}

    def client(i: int) -> None:
        go.wait()
        try:
            run_queries(i)
        finally:
            finished[i] = time.perf_counter()

    def run_queries(i: int) -> None:
        cur = cursors[i]
        for q in range(queries):
            if time.perf_counter() > clock["deadline"]:
                with lock:
                    counts["skipped"] += queries - q
                break
            t0 = time.perf_counter()
            try:
                cur.execute(slice_sql(slices, i + clients * q))
                table = cur.fetch_arrow_table()
            except Exception as e:  # noqa: BLE001 - counted and reported, the phase goes on
                with lock:
                    counts["failed"] += 1
                    if len(errors) < 5:
                        errors.append(f"client {i} query {q}: {type(e).__name__}: {e}")
                continue
            ms = (time.perf_counter() - t0) * 1000.0
            with lock:
                latencies_ms.append(ms)
                tables.append(table.select([0, 1]).rename_columns(["id", "label"]))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    clock["start"] = time.perf_counter()
    clock["deadline"] = clock["start"] + spec["deadline_s"]
    go.set()
    for t in threads:
        # a query running past the deadline gets a minute more, then the phase reports anyway
        t.join(max(0.0, clock["deadline"] + 60.0 - time.perf_counter()))
    hung = sum(t.is_alive() for t in threads)
    end = time.perf_counter() if hung else max(finished)
    wall_s = end - clock["start"]
    with lock:
        done = sorted(latencies_ms)
        rows = sum(t.num_rows for t in tables)
        if tables:
            pq.write_table(pa.concat_tables(tables), spec["out"])
        return {"clients": clients, "queries": slices, "succeeded": len(done), "failed": counts["failed"],
                "skipped": counts["skipped"], "hung": hung, "errors": list(errors), "rows": rows,
                "seconds": wall_s, "p50_ms": percentile(done, 0.50), "p99_ms": percentile(done, 0.99),
                "latencies_ms": done}


CHILDREN = {"sql": sql_child, "exchange": exchange_child, "load": load_child}


def child_main(kind: str, spec_json: str) -> None:
    result = CHILDREN[kind](json.loads(spec_json))
    print(RESULT + json.dumps(result), flush=True)
    sys.stderr.flush()
    # the ADBC driver's runtime can keep the interpreter from exiting (tests/py/flight_*.py do this too)
    os._exit(0)


def run_client(kind: str, spec: dict, env: dict, timeout_s: float) -> dict:
    """Runs one client child (bounded by timeout_s); returns its result line."""
    cmd = [sys.executable, __file__, "--child", kind, json.dumps(spec)]
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, stdin=subprocess.DEVNULL, env=env, text=True)
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = f"killed after {timeout_s:.0f} s"
        out_f.seek(0)
        err_f.seek(0)
        out, err = out_f.read(), err_f.read()
    lines = [x for x in out.splitlines() if x.startswith(RESULT)]
    if rc != 0 or not lines:
        raise SideFailed(f"the {kind} client exited {rc}:\n{tail(err + out)}")
    return json.loads(lines[-1][len(RESULT):])


# --- phases ----------------------------------------------------------------------------------

def served_phase(kind: str, spec: dict, args, serve_yaml: str, env: dict, work: pathlib.Path, tag: str) -> dict:
    """One timed client phase on a fresh server."""
    with Server(args.bin, serve_yaml, env, work / f"serve-{tag}") as server:
        res = run_client(kind, {**spec, "uri": server.uri, "timeout_s": args.deadline}, env, args.deadline + 120)
    if server.rc != 0:
        print(f"  WARNING: the server of {tag} exited {server.rc} on SIGTERM (want 0):\n{server.log_tail(5)}",
              flush=True)
    return {**res, "timed_s": res["seconds"], "ready_s": server.ready_s, "wall_s": server.wall_s,
            "rss_mib": server.rss_mib, "server_rc": server.rc, "out": spec["out"]}


# --- agreement -------------------------------------------------------------------------------

def load_reference(path: str) -> dict:
    import deltalake

    t = deltalake.DeltaTable(path).to_pyarrow_table(columns=["id", "label", "score"]).to_pydict()
    return {i: (l, s) for i, l, s in zip(t["id"], t["label"], t["score"])}


def agreement(reference: dict, path: str) -> dict:
    """The rows a server phase returned against the predict stage's: same-label fraction
    (over the rows returned), rows missing, duplicated or unknown, max |score diff|."""
    import pyarrow.parquet as pq

    if not os.path.exists(path):
        return {"rows": 0, "same_label": float("nan"), "missing": len(reference), "duplicates": 0, "unknown": 0,
                "max_score_diff": None}
    t = pq.read_table(path).to_pydict()
    ids = t["id"]
    got = dict(zip(ids, t["label"]))
    same = sum(1 for i, l in got.items() if i in reference and reference[i][0] == l)
    out = {"rows": len(ids), "same_label": same / len(got) if got else float("nan"),
           "missing": sum(1 for i in reference if i not in got), "duplicates": len(ids) - len(got),
           "unknown": sum(1 for i in got if i not in reference), "max_score_diff": None}
    if "score" in t:
        out["max_score_diff"] = max((abs(s - reference[i][1]) for i, s in zip(ids, t["score"]) if i in reference),
                                    default=None)
    return out


# --- driver ----------------------------------------------------------------------------------

def summarize(runs: list[dict], rows: int, distinct: int, args) -> dict:
    def med(xs, key):
        vals = [x[key] for x in xs if x.get(key) is not None]
        return statistics.median(vals) if vals else None

    def worst(xs, key):
        vals = [x["agreement"][key] for x in xs if x.get("agreement") and not math.isnan(x["agreement"][key])]
        return min(vals) if vals else None

    medians, compare = {}, {}
    for s in SIDES:
        xs = [r for r in runs if r["side"] == s]
        if xs:
            m = {k: med(xs, k) for k in ("timed_s", "wall_s", "ready_s", "rss_mib")}
            m["rows_per_s"] = rows / m["timed_s"]
            m["same_label"] = worst(xs, "same_label") if s != "stage" else None
            m["runs"] = len(xs)
            medians[s] = m
    for c in args.clients:
        xs = [r for r in runs if r["side"] == "load" and r["clients"] == c]
        if xs:
            m = {k: med(xs, k) for k in ("timed_s", "p50_ms", "p99_ms", "rows")}
            m["rows_per_s"] = statistics.median(x["rows"] / x["timed_s"] for x in xs)
            m["same_label"] = worst(xs, "same_label")
            m["failed"] = sum(x["failed"] + x["skipped"] + x["hung"] for x in xs)
            m["queries"] = sum(x["queries"] for x in xs)
            m["runs"] = len(xs)
            medians[f"load/{c}"] = m
    stage = medians.get("stage")

    def ratio(m):
        return m["rows_per_s"] / stage["rows_per_s"] if stage and m else None

    print()
    print(f"{args.precision}: {rows:,} rows ({distinct:,} distinct texts), {args.threads} intra-op threads "
          f"(os.cpu_count() = {os.cpu_count()}); medians of {args.repeats}; every server phase on a fresh server")
    print(f"{'side':16}{'rows/s':>9}{'timed s':>9}{'wall s':>9}{'start s':>9}{'peak RSS MiB':>14}"
          f"{'vs stage':>10}{'same label':>12}")
    for s, name in SIDES.items():
        m = medians.get(s)
        if not m:
            continue
        start = f"{m['ready_s']:9.2f}" if m["ready_s"] is not None else f"{'-':>9}"
        rss = f"{m['rss_mib']:14,.0f}" if m["rss_mib"] is not None else f"{'-':>14}"
        same = "(ref)" if s == "stage" else (f"{m['same_label']:.4f}" if m["same_label"] is not None else "-")
        print(f"{name:16}{m['rows_per_s']:9.1f}{m['timed_s']:9.2f}{m['wall_s']:9.2f}{start}{rss}"
              f"{ratio(m):9.2f}x{same:>12}")
    print("timed s: the stage report's in-process seconds (model load to predictions committed); for a server, "
          "the client's\n  time from the query (or exchange) to its last batch. wall s: the stage's process; a "
          "server's process,\n  start to exit. start s: a server's start to its ready line (model loaded; untimed).")
    print()
    print(f"concurrency: Flight SQL, C clients x {QUERIES_PER_CLIENT} queries each, one ADBC connection per "
          f"client, disjoint id slices covering all rows, fresh server per C; deadline {args.deadline:.0f} s")
    print(f"{'clients':>7}{'rows/s':>9}{'wall s':>9}{'p50 ms':>10}{'p99 ms':>10}{'vs stage':>10}"
          f"{'failed':>10}{'same label':>12}")
    for c in args.clients:
        m = medians.get(f"load/{c}")
        if not m:
            continue
        same = f"{m['same_label']:.4f}" if m["same_label"] is not None else "-"
        p50 = f"{m['p50_ms']:10.0f}" if m["p50_ms"] is not None else f"{'-':>10}"
        p99 = f"{m['p99_ms']:10.0f}" if m["p99_ms"] is not None else f"{'-':>10}"
        partial = "" if m["rows"] == rows else f"  (only {m['rows']:,.0f} of {rows:,} rows by the deadline)"
        print(f"{c:7}{m['rows_per_s']:9.1f}{m['timed_s']:9.2f}{p50}{p99}{ratio(m):9.2f}x"
              f"{m['failed']:>5}/{m['queries']:<4}{same:>12}{partial}")
    print("failed: queries (over all repeats) that failed, were not started by the deadline, or hung")
    print()
    for s in ("sql", "exchange"):
        if s in medians and stage:
            compare[f"{s}/stage"] = ratio(medians[s])
    for c in args.clients:
        if f"load/{c}" in medians and stage:
            compare[f"load{c}/stage"] = ratio(medians[f"load/{c}"])
    if "sql/stage" in compare:
        verdict = "meets" if compare["sql/stage"] >= 0.90 else "MISSES"
        print(f"Flight SQL / predict stage: {compare['sql/stage']:.2f}x ({verdict} the target, >= 0.90)")
    if "exchange/stage" in compare:
        print(f"DoExchange / predict stage: {compare['exchange/stage']:.2f}x")
    return {"medians": medians, "compare": compare}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.environ.get("LAKEML_BIN"), help="the pipeline binary (default $LAKEML_BIN)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--repeats", type=int, default=3, help="runs of every phase, each on a fresh server (median)")
    ap.add_argument("--rows", type=int, help="a fixed sample of N reviews (default: all)")
    ap.add_argument("--model", help="classifier directory (default: MiniLM-L6 + a seeded 2-way head, made here)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="intra-op threads for the stage and the server (default: all cores)")
    ap.add_argument("--clients", default="1,4,16", help="client counts of the concurrency phases (default 1,4,16)")
    ap.add_argument("--deadline", type=float, default=600.0,
                    help="seconds a phase may run (the concurrency phase then reports what it got)")
    ap.add_argument("--out", help="write a JSON summary here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (server logs, outputs)")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child_main(*args.child)
    if not args.bin:
        sys.exit("give the pipeline binary with --bin or LAKEML_BIN (scripts/bench.sh serve does)")
    try:
        args.clients = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        sys.exit("--clients takes client counts separated by commas, e.g. 1,4,16")
    if args.repeats < 1 or (args.rows is not None and args.rows < 1) or args.threads < 1 \
            or any(c < 1 for c in args.clients) or args.deadline <= 0:
        sys.exit("--repeats, --rows, --threads and --clients must be at least 1, --deadline positive")

    root = pathlib.Path(__file__).resolve().parent.parent
    assets = pathlib.Path(os.path.expanduser(os.environ.get("LAKEML_ASSETS", "~/.cache/lakeml/assets")))
    with work_dir("lakeml-bench-serve-", args.keep) as work:
        no_proxy = ",".join(x for x in (os.environ.get("NO_PROXY", ""), "127.0.0.1,localhost") if x)
        env = dict(os.environ, LAKEML_BENCH_DIR=str(work), LAKEML_ASSETS=str(assets),
                   LAKEML_BENCH_THREADS=str(args.threads), LAKEML_PRECISION=args.precision,
                   OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
                   TOKENIZERS_PARALLELISM="true", NO_PROXY=no_proxy, no_proxy=no_proxy)
        if args.rows:
            env["LAKEML_BENCH_ROWS"] = str(args.rows)
        print(f"machine: {os.cpu_count()} cores, {args.threads} intra-op threads for the stage and each server, "
              f"load average {os.getloadavg()[0]:.2f} (other work on these cores slows every side); work dir {work}",
              flush=True)
        run_all(args, root, assets, work, env)


def run_all(args, root: pathlib.Path, assets: pathlib.Path, work: pathlib.Path, env: dict) -> None:
    # The shared model: a classifier directory (made once, not timed, unless given).
    if args.model:
        model = str(pathlib.Path(args.model).resolve())
    else:
        model = str(work / "model")
        made = run_measured([sys.executable, str(root / "tests/py/make_classifier.py"),
                             str(assets / "all-MiniLM-L6-v2"), model, LABELS, "0"], env)
        if made["rc"] != 0:
            sys.exit(f"making the classifier failed:\n{tail(made['stderr'])}")
    env["LAKEML_BENCH_MODEL"] = model
    # The shared input: the reviews as a Delta table (made once by lakeml, not timed).
    made = run_measured([args.bin, "run", "--json", "--quiet", str(root / "benches/pipelines/predict_input.yaml")], env)
    if made["rc"] != 0:
        sys.exit(f"making the input table failed:\n{tail(made['stderr'])}")
    source = str(work / "reviews")
    import deltalake
    import pyarrow.compute as pc

    texts = deltalake.DeltaTable(source).to_pyarrow_table(columns=["id", "text"])
    rows, distinct = texts.num_rows, pc.count_distinct(texts.column("text")).as_py()
    del texts
    print(f"input: {rows:,} rows ({distinct:,} distinct texts) in {source}; model {model}", flush=True)
    predict_yaml = str(root / "benches/pipelines/predict.yaml")
    serve_yaml = str(root / "benches/pipelines/serve.yaml")
    check = run_measured([args.bin, "validate", predict_yaml], env)
    if check["rc"] != 0:
        sys.exit(f"`{args.bin} validate {predict_yaml}` failed:\n{tail(check['stderr'] + check['stdout'])}")

    runs = []
    try:
        for i in range(args.repeats):
            order = list(SIDES) if i % 2 == 0 else list(SIDES)[::-1]
            for s in order:
                if s == "stage":
                    r = lakeml_side(args.bin, predict_yaml, args.precision, env)
                    r = {**r, "side": "stage", "timed_s": r["stage_s"]}
                elif s == "sql":
                    r = served_phase("sql", {"out": str(work / f"sql-{i}.parquet")}, args, serve_yaml, env, work,
                                     f"sql-{i}")
                else:
                    r = served_phase("exchange", {"out": str(work / f"exchange-{i}.parquet"), "source": source,
                                                  "batch_rows": EXCHANGE_BATCH}, args, serve_yaml, env, work,
                                     f"exchange-{i}")
                    if not r["same_order"]:
                        print("  WARNING: DoExchange returned the rows in another order than they were sent")
                r = {**r, "side": s, "repeat": i, "precision": args.precision}
                if r["rows"] != rows:
                    raise SideFailed(f"{SIDES[s]} ({args.precision}) returned {r['rows']} rows of {rows}")
                runs.append(r)
                start = f", server ready in {r['ready_s']:.2f} s" if r.get("ready_s") is not None else ""
                rss = f", {r['rss_mib']:,.0f} MiB" if r.get("rss_mib") is not None else ""
                print(f"  run {i + 1} {SIDES[s]:14} {args.precision}: {rows / r['timed_s']:8.1f} rows/s, "
                      f"{r['timed_s']:.2f} s timed, {r['wall_s']:.2f} s wall{start}{rss}", flush=True)
            for c in args.clients:
                spec = {"out": str(work / f"load{c}-{i}.parquet"), "clients": c, "queries": QUERIES_PER_CLIENT,
                        "deadline_s": args.deadline}
                r = served_phase("load", spec, args, serve_yaml, env, work, f"load{c}-{i}")
                r = {**r, "side": "load", "repeat": i, "precision": args.precision}
                runs.append(r)
                lost = r["failed"] + r["skipped"] + r["hung"]
                p50 = f"{r['p50_ms']:.0f}" if r["p50_ms"] is not None else "-"
                p99 = f"{r['p99_ms']:.0f}" if r["p99_ms"] is not None else "-"
                print(f"  run {i + 1} {c:2} clients      {args.precision}: {r['rows'] / r['timed_s']:8.1f} rows/s, "
                      f"{r['timed_s']:.2f} s wall, p50 {p50} ms, p99 {p99} ms, {r['rows']:,} rows"
                      + (f", {lost} of {r['queries']} queries lost: {r['errors'][:1]}" if lost else ""), flush=True)
    except SideFailed as e:
        sys.exit(f"\n{e}")

    reference = load_reference(str(work / f"preds-lakeml-{args.precision}"))
    if len(reference) != rows:
        print(f"WARNING: the predict stage wrote {len(reference)} rows of {rows}")
    for r in runs:
        if r["side"] != "stage":
            r["agreement"] = agreement(reference, r["out"])
    summary = summarize(runs, rows, distinct, args)
    print()
    print("same label: fraction of the rows a server phase returned whose label equals the predict stage's "
          "(the worst repeat)")
    diffs = [r["agreement"]["max_score_diff"] for r in runs
             if r["side"] == "exchange" and r["agreement"]["max_score_diff"] is not None]
    if diffs:
        print(f"DoExchange scores: max |score diff| from the predict stage's {max(diffs):.2e}")
    for r in runs:
        ag = r.get("agreement")
        if not ag:
            continue
        problems = [f"{ag[k]} {k}" for k in ("missing", "duplicates", "unknown") if ag[k]]
        if r["side"] == "load" and r["rows"] < rows:
            problems = [p for p in problems if not p.endswith("missing")]  # cut short: reported above
        if problems:
            name = SIDES.get(r["side"]) or f"{r['clients']} clients"
            print(f"WARNING: {name}, run {r['repeat'] + 1}: {', '.join(problems)} rows against the predict "
                  "stage's table")
    bad_stops = [r for r in runs if r["side"] != "stage" and r["server_rc"] != 0]
    if bad_stops:
        print(f"WARNING: {len(bad_stops)} servers did not exit 0 on SIGTERM: "
              + ", ".join(f"{r['side']} run {r['repeat'] + 1}: {r['server_rc']}" for r in bad_stops))
    print(f"load average now {os.getloadavg()[0]:.2f} (1 min), {os.getloadavg()[2]:.2f} (15 min) "
          f"on {os.cpu_count()} cores")
    if args.out:
        def version(pkg):
            try:
                return importlib.metadata.version(pkg)
            except importlib.metadata.PackageNotFoundError:
                return None

        doc = {"machine": {"cpus": os.cpu_count(), "threads": args.threads,
                           "load_average_at_end": os.getloadavg()},
               "versions": {p: version(p) for p in ("torch", "pyarrow", "deltalake", "adbc-driver-flightsql",
                                                     "adbc-driver-manager")},
               "config": {"rows": rows, "distinct_texts": distinct, "max_length": 512, "model": model,
                          "precision": args.precision, "repeats": args.repeats, "clients": args.clients,
                          "queries_per_client": QUERIES_PER_CLIENT, "exchange_batch_rows": EXCHANGE_BATCH,
                          "deadline_s": args.deadline, "sql": SQL_ALL},
               "runs": runs,
               **summary}
        pathlib.Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"summary written to {args.out}")


if __name__ == "__main__":
    main()
