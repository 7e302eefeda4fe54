"""Kill one `pipeline serve` worker (SIGKILL) in the middle of a lakeml_spark job.

usage: spark_failover.py SOURCE TARGET VICTIM_PID PARTITIONS ENDPOINT [ENDPOINT ...]
(the workers' token in LAKEML_TOKEN)
Reads SOURCE (a Delta table of id, text) through format("lakeml") in PARTITIONS row ranges,
predicts with lakeml_spark.predict over the endpoints (retries=4, backoff 0.2 s) and writes
TARGET with write_delta (app_id "test/failover", version = SOURCE's version). A thread watches
Spark's status tracker and, once at least one task of the job has finished while others are
still to run, kills VICTIM_PID with SIGKILL. Prints one JSON object:
  killed          whether the victim was killed while the job ran
  at_kill         {"done": tasks finished, "active": tasks running, "total": tasks} then
  result          write_delta's summary
  partitions      the Spark partitions of the input
"""
import os
import signal
import sys
import threading
import time

from spark_common import finish, session


def main() -> None:
    source, target, victim, partitions = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    endpoints = sys.argv[5:]
    token = os.environ["LAKEML_TOKEN"]

    import deltalake

    import lakeml_spark

    spark = session("lakeml-spark-failover")
    version = deltalake.DeltaTable(source).version()
    rows = deltalake.DeltaTable(source).count()
    df = lakeml_spark.read_delta(spark, source, version=version,
                                 rows_per_partition=-(-rows // partitions)).select("id", "text")
    scored = lakeml_spark.predict(df, endpoints=endpoints, token=token, model="sentiment",
                                  batch_rows=16, retries=4, backoff=0.2, timeout=120.0)

    tracker = spark.sparkContext.statusTracker()
    state = {"killed": False, "at_kill": None}
    stop = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + 600
        while not stop.is_set() and time.monotonic() < deadline:
            for stage in tracker.getActiveStageIds():
                info = tracker.getStageInfo(stage)
                if info is None:
                    continue
                done = info.numCompletedTasks
                if done >= 1 and done < info.numTasks:
                    os.kill(victim, signal.SIGKILL)
                    state["killed"] = True
                    state["at_kill"] = {"done": done, "active": info.numActiveTasks,
                                        "total": info.numTasks}
                    return
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    result = lakeml_spark.write_delta(scored, target, app_id="test/failover", version=version)
    stop.set()
    watcher.join(5)
    finish(spark, {**state, "result": result, "partitions": df.rdd.getNumPartitions()})


if __name__ == "__main__":
    main()
