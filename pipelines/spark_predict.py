"""Spark scale-out of pipelines/predict.yaml: every review in lake/reviews gets a prediction in
lake/reviews_scored_spark, computed by `pipeline serve` workers and written exactly once.

usage: python pipelines/spark_predict.py --endpoint grpc://127.0.0.1:50051 [--endpoint ...]
           [--token T (default $LAKEML_TOKEN)] [--model NAME] [--master local[2]]
           [--source DIR] [--target DIR] [--mode incremental|overwrite] [--partitions N]
           [--batch-rows N] [--timeout S] [--retries N] [--keep COL ...] [--json]

1. A Spark session (`--master`, default local[2]) with lakeml_spark's data source.
2. The source table (default lake/reviews) is read through format("lakeml") at its current
   Delta version V, exactly its active files, cut into --partitions row ranges (default: two
   per worker, at least the session's parallelism).
3. `incremental` (default): ids the target already holds are dropped (a broadcast anti-join
   against the target's current version), as the predict stage does. `overwrite`: every row.
4. lakeml_spark.predict() sends each partition's texts to one worker (partitions spread over
   the --endpoint list, failover on a dead worker), appends label, label_id, score,
   probabilities; predicted_at and run_id are added here.
5. lakeml_spark.write_delta() commits the result to the target (default
   lake/reviews_scored_spark) in one Delta commit with txn(app_id="lakeml/spark_predict",
   version=V). A rerun over the same source version finds the txn and does nothing; a killed
   run leaves the target at its previous version and the rerun completes it.

Prints a summary line (a JSON object with --json). Exit codes: 0 done (or nothing to do),
1 the job failed (the target unchanged), 2 bad usage.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time
import uuid

ROOT = pathlib.Path(__file__).resolve().parent.parent
APP_ID = "lakeml/spark_predict"


def importable_package() -> None:
    """Run from a checkout without `pip install ./python`: the package's source goes on the
    path of this process and (through PYTHONPATH) of the local Spark's Python workers."""
    try:
        import lakeml_spark  # noqa: F401
    except ImportError:
        src = str(ROOT / "python" / "src")
        sys.path.insert(0, src)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (src, os.environ.get("PYTHONPATH")) if p)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--endpoint", action="append", required=True,
                    help="a `pipeline serve` worker (grpc://HOST:PORT); repeat for more")
    ap.add_argument("--token", default=os.environ.get("LAKEML_TOKEN"),
                    help="the workers' Bearer token (default $LAKEML_TOKEN)")
    ap.add_argument("--model", help="a model name of the workers' serve.models (default: theirs)")
    ap.add_argument("--master", default=os.environ.get("SPARK_MASTER", "local[2]"))
    ap.add_argument("--source", default=str(ROOT / "lake" / "reviews"))
    ap.add_argument("--target", default=str(ROOT / "lake" / "reviews_scored_spark"))
    ap.add_argument("--mode", choices=["incremental", "overwrite"], default="incremental")
    ap.add_argument("--partitions", type=int, help="Spark partitions to predict (default: two "
                    "per worker, at least the session's default parallelism)")
    ap.add_argument("--batch-rows", type=int, default=8192, help="rows per Flight batch")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per partition's call")
    ap.add_argument("--retries", type=int, default=3)
    ap.add_argument("--keep", nargs="*", default=["split"],
                    help="source columns carried into the target (those that exist)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)
    if (args.partitions is not None and args.partitions < 1) or args.batch_rows < 1 \
            or args.retries < 0 or args.timeout <= 0:
        ap.error("--partitions and --batch-rows must be at least 1, --retries at least 0, "
                 "--timeout positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    importable_package()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    import deltalake
    import pyarrow as pa
    from pyspark.sql import SparkSession, functions as F

    import lakeml_spark

    started = time.monotonic()
    source = deltalake.DeltaTable(args.source)
    version = source.version()
    try:
        target = deltalake.DeltaTable(args.target)
    except deltalake.exceptions.TableNotFoundError:
        target = None
    summary = {"source": args.source, "source_version": version, "target": args.target,
               "app_id": APP_ID, "mode": args.mode}
    done = target.transaction_version(APP_ID) if target is not None else None
    if done is not None and done >= version:
        summary |= {"committed": False, "rows": 0, "target_version": target.version(),
                    "reason": f"up to date: the target's txn for {APP_ID} is at {done}, the "
                              f"source at version {version}"}
        report(summary, args.json)
        return 0

    spark = (SparkSession.builder.master(args.master).appName("lakeml-spark-predict")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "8")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    session_s = time.monotonic() - started
    partitions = args.partitions or max(2 * len(args.endpoint),
                                        spark.sparkContext.defaultParallelism)
    counts = pa.table(source.get_add_actions(flatten=False)).column("num_records").to_pylist()
    # the log's statistics, else the Parquet footers
    rows = sum(counts) if None not in counts else source.to_pyarrow_dataset().count_rows()
    reviews = lakeml_spark.read_delta(spark, args.source, version=version,
                                      rows_per_partition=max(1, math.ceil(rows / partitions)))
    keep = [c for c in args.keep if c in reviews.columns and c not in ("id", "text")]
    reviews = reviews.select("id", "text", *keep)
    if args.mode == "incremental" and target is not None:
        have = lakeml_spark.read_delta(spark, args.target).select("id")
        reviews = reviews.join(F.broadcast(have), "id", "left_anti")

    scored = lakeml_spark.predict(reviews, text="text", model=args.model,
                                  endpoints=args.endpoint, token=args.token,
                                  batch_rows=args.batch_rows, timeout=args.timeout,
                                  retries=args.retries)
    run_id = str(uuid.uuid4())
    scored = (scored.drop("text")
              .withColumn("predicted_at", F.current_timestamp())
              .withColumn("run_id", F.lit(run_id)))
    result = lakeml_spark.write_delta(
        scored, args.target, mode="append" if args.mode == "incremental" else "overwrite",
        app_id=APP_ID, version=version,
        metadata={"lakeml_spark_predict": {"run_id": run_id, "source": args.source,
                                           "source_version": version,
                                           "endpoints": args.endpoint}})
    spark.stop()
    summary |= {"committed": result["committed"], "rows": result["rows"],
                "files": result["files"], "target_version": result["version"],
                "partitions": partitions, "run_id": run_id, "session_s": round(session_s, 2),
                "seconds": round(time.monotonic() - started, 2)}
    if not result["committed"]:
        summary["reason"] = result["reason"]
    report(summary, args.json)
    return 0


def report(summary: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary), flush=True)
    elif summary.get("committed"):
        print(f"spark_predict: {summary['rows']} predictions from {summary['source']} "
              f"(version {summary['source_version']}) committed to {summary['target']} as "
              f"version {summary['target_version']} in {summary['seconds']} s", flush=True)
    else:
        print(f"spark_predict: nothing committed: {summary['reason']}", flush=True)


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - one clear line, then exit 1
        print(f"spark_predict: failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # the py4j gateway / JVM can linger at interpreter shutdown; the work is done here
    os._exit(code)
