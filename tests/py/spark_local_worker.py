"""lakeml_spark.predict with a model and no endpoints: Spark local[2] starts its own worker.

usage: spark_local_worker.py MODEL REVIEWS_DIR KILL_ROWS ENCODER PIPELINE TOKEN
       spark_local_worker.py --expect-failure MODEL REVIEWS_DIR

The workers' state (and so the processes counted) is under $TMPDIR, which the test gives
this run alone. Prints JSON:
- killed: a job over the first KILL_ROWS reviews during which the worker is killed with
  SIGKILL as soon as a task is exchanging rows (the first job: the worker caches the texts
  it has scored, so a later job's exchanges could end before the kill): rows, distinct ids,
  the rows whose label differs from the next job's, workers after it, and whether the
  supervisor saw its worker exit;
- first: the predictions of every review, [id, label, score] sorted by id, with 4 partitions
  over the executor's 2 task slots; workers: `pipeline serve` processes after it;
- embedded: lakeml_spark.embed over 40 reviews with ENCODER (a second worker, for another
  model): rows, the vectors' sizes, workers after it;
- queried: a Flight SQL query (`predict(text)` over `reviews` of PIPELINE, whose serve auth
  takes TOKEN) through format("lakeml") with option("pipeline") and no endpoint: rows, the
  labels that differ from the first job's, workers serving PIPELINE;
- missing_model: the exception of a job whose model directory does not exist;
- idle: workers before and after a worker with idle_timeout=2 s (its own spec) stopped by
  itself, and how long that took after its job;
- after_stop: `pipeline serve` processes once spark.stop() returned (waiting up to 20 s).
With --expect-failure, only the exception of one job (for a binary that cannot start).
"""
import fcntl
import glob
import json
import os
import signal
import sys
import threading
import time

import deltalake

from spark_common import error_text, finish, json_safe, session


def workers(under: str | None = None) -> list[int]:
    """pids of `pipeline serve` processes serving a file under `under` (default: $TMPDIR,
    where the model workers' files are)."""
    tmp = under or os.environ["TMPDIR"]
    found = []
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmdline, "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if len(argv) > 2 and argv[0].endswith(b"pipeline") and argv[1] == b"serve" \
                and argv[2].startswith(tmp.encode()):
            found.append(int(cmdline.split("/")[2]))
    return sorted(found)


def kill_when_busy(stop: threading.Event, killed: list) -> None:
    """SIGKILL the worker once a task holds the `busy` lock (rows are in flight)."""
    while not stop.is_set():
        for busy in glob.glob(os.path.join(os.environ["TMPDIR"], "lakeml-*/workers/*/busy")):
            fd = os.open(busy, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                with open(os.path.join(os.path.dirname(busy), "worker.json")) as f:
                    pid = json.load(f)["worker_pid"]
                time.sleep(0.2)  # well into the exchange
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            finally:
                os.close(fd)
        time.sleep(0.01)


def reviews(spark, path, rows=None):
    df = spark.read.parquet(*deltalake.DeltaTable(path).file_uris()).select("id", "text")
    if rows is not None:
        df = df.where(f"id <= {int(rows)}")
    return df.repartition(4)


def main() -> None:
    import lakeml_spark

    if sys.argv[1] == "--expect-failure":
        model, path = sys.argv[2:4]
        spark = session("spark_local_worker.py", lakeml=False)
        try:
            lakeml_spark.predict(reviews(spark, path, 10), text="text", model=model).collect()
            result = {"error": None}
        except Exception as e:  # noqa: BLE001
            result = {"error": error_text(e)}
        result["workers"] = len(workers())
        finish(spark, result)
        return

    model, path, kill_rows, encoder, pipeline, token = sys.argv[1:7]
    kill_rows = int(kill_rows)
    spark = session("spark_local_worker.py", lakeml=False)
    out = {}

    # predict() returns once its probe job (one row, on the worker it starts) is done; the
    # killer starts after it, so it kills the worker under the job's own exchanges.
    killed_job = lakeml_spark.predict(reviews(spark, path, kill_rows), text="text", model=model)
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=kill_when_busy, args=(stop, killed), daemon=True)
    killer.start()
    rows = killed_job.select("id", "label").collect()
    stop.set()
    killer.join()
    killed_workers = len(workers())

    started = time.monotonic()
    df = reviews(spark, path)
    scored = lakeml_spark.predict(df, text="text", model=model)
    first = sorted((r["id"], r["label"], r["score"])
                   for r in scored.select("id", "label", "score").collect())
    out["first"] = first
    out["first_s"] = time.monotonic() - started
    out["workers"] = len(workers())
    labels = {i: label for i, label, _ in first}
    log = "".join(open(p).read() for p in glob.glob(
        os.path.join(os.environ["TMPDIR"], "lakeml-*/workers/*/worker.log")))
    out["killed"] = {
        "killed_pids": killed,
        "rows": len(rows),
        "ids": len({r["id"] for r in rows}),
        "max_id": max(r["id"] for r in rows),
        "differ": sum(1 for r in rows if labels[r["id"]] != r["label"]),
        "workers": killed_workers,
        "supervisor_saw_exit": "exited with status" in log,
    }

    vectors = lakeml_spark.embed(reviews(spark, path, 40), text="text", model=encoder)
    vectors = vectors.select("id", "embedding").collect()
    out["embedded"] = {
        "rows": len(vectors),
        "sizes": sorted({len(r["embedding"]) for r in vectors}),
        "workers": len(workers()),
    }

    queried = lakeml_spark.read_query(
        spark, "SELECT id, predict(text) AS label FROM reviews WHERE id <= 500", token=token,
        pipeline=pipeline).collect()
    out["queried"] = {
        "rows": len(queried),
        "ids": len({r["id"] for r in queried}),
        "differ": sum(1 for r in queried if labels[r["id"]] != r["label"]),
        "workers": len(workers(pipeline)),
    }

    try:
        lakeml_spark.predict(reviews(spark, path, 10), text="text",
                             model=os.path.join(os.path.dirname(model), "no-such-model")).collect()
        out["missing_model"] = None
    except Exception as e:  # noqa: BLE001
        out["missing_model"] = error_text(e)

    # A worker unused for idle_timeout seconds stops by itself (its own spec: a third worker).
    lakeml_spark.predict(reviews(spark, path, 10), text="text", model=model, threads=1,
                         idle_timeout=2).collect()
    idle_before = len(workers())
    deadline = time.monotonic() + 20
    while len(workers()) == idle_before and time.monotonic() < deadline:
        time.sleep(0.2)
    out["idle"] = {"before": idle_before, "after": len(workers()),
                   "stopped_after_s": round(time.monotonic() - deadline + 20, 1)}

    def every() -> list[int]:
        return workers() + workers(pipeline)

    before = every()
    spark.stop()
    deadline = time.monotonic() + 20
    while every() and time.monotonic() < deadline:
        time.sleep(0.2)
    out["before_stop"] = len(before)
    out["after_stop"] = len(every())
    print(json.dumps(json_safe(out)))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
