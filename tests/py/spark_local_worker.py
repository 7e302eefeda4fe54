"""lakeml_spark.predict with a model and no endpoints: Spark local[2] starts its own worker.

usage: spark_local_worker.py MODEL REVIEWS_DIR [KILL_ROWS]
       spark_local_worker.py --expect-failure MODEL REVIEWS_DIR

The workers' state (and so the processes counted) is under $TMPDIR, which the test gives
this run alone. Prints JSON:
- first: the predictions of every review, [id, label, score] sorted by id, with 4 partitions
  over the executor's 2 task slots; workers: `pipeline serve` processes after it;
- killed: a second job over the first KILL_ROWS reviews during which the worker is killed
  with SIGKILL as soon as a task is exchanging rows: rows, distinct ids, the rows whose
  label differs from the first job's, workers after it, and whether a task restarted it;
- missing_model: the exception of a job whose model directory does not exist;
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


def workers() -> list[int]:
    """pids of `pipeline serve` processes serving a worker file under $TMPDIR."""
    tmp = os.environ["TMPDIR"]
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

    model, path, kill_rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
    spark = session("spark_local_worker.py", lakeml=False)
    out = {}

    started = time.monotonic()
    df = reviews(spark, path)
    scored = lakeml_spark.predict(df, text="text", model=model)
    first = sorted((r["id"], r["label"], r["score"])
                   for r in scored.select("id", "label", "score").collect())
    out["first"] = first
    out["first_s"] = time.monotonic() - started
    out["workers"] = len(workers())

    stop, killed = threading.Event(), []
    killer = threading.Thread(target=kill_when_busy, args=(stop, killed), daemon=True)
    killer.start()
    again = lakeml_spark.predict(reviews(spark, path, kill_rows), text="text", model=model)
    rows = again.select("id", "label").collect()
    stop.set()
    killer.join()
    labels = {i: label for i, label, _ in first}
    log = "".join(open(p).read() for p in glob.glob(
        os.path.join(os.environ["TMPDIR"], "lakeml-*/workers/*/worker.log")))
    out["killed"] = {
        "killed_pids": killed,
        "rows": len(rows),
        "ids": len({r["id"] for r in rows}),
        "max_id": max(r["id"] for r in rows),
        "differ": sum(1 for r in rows if labels[r["id"]] != r["label"]),
        "workers": len(workers()),
        "supervisor_saw_exit": "exited with status" in log,
    }

    try:
        lakeml_spark.predict(reviews(spark, path, 10), text="text",
                             model=os.path.join(os.path.dirname(model), "no-such-model")).collect()
        out["missing_model"] = None
    except Exception as e:  # noqa: BLE001
        out["missing_model"] = error_text(e)

    before = workers()
    spark.stop()
    deadline = time.monotonic() + 20
    while workers() and time.monotonic() < deadline:
        time.sleep(0.2)
    out["before_stop"] = len(before)
    out["after_stop"] = len(workers())
    print(json.dumps(json_safe(out)))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
