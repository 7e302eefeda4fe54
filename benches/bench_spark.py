"""Spark scale-out benchmark: lakeml_spark through a `pipeline serve` worker against the in-process
predict stage, and against the HF path a Databricks user writes today (a pandas UDF calling a
`transformers` pipeline, the recipe of `mlflow.pyfunc.spark_udf`).

Run with `scripts/bench.sh spark` (builds lakeml, installs the peers, then calls this);
`--precision fp32|bf16` (default fp32), `--repeats N` (default 3, medians), `--rows N` (a fixed
sample of N reviews, for quick runs; default all 12,808), `--threads N` (default 2),
`--partitions N` (Spark partitions of the Spark sides, default 4), `--side LIST` (comma-
separated, of stage, lakeml, local, hf, exchange, overhead; default all), `--model DIR`, `--out FILE`
(a JSON summary), `--keep`.

What is measured, in the same run over the same rows and the same model directory
(all-MiniLM-L6-v2 plus a 2-way head, rotten / fresh, made here unless --model):
1. stage: `pipeline run --force benches/pipelines/predict.yaml`, the predict stage, Delta table
   in, Delta table of predictions out, `threads` intra-op threads; rows/s over the stage
   report's in-process seconds (model load to predictions committed), as bench_serve.py.
2. lakeml: Spark `local[2]` and ONE `pipeline serve benches/pipelines/serve.yaml` worker of
   `threads` threads (the predict stage's settings). The job: format("lakeml") reads the
   table (in --partitions row ranges), lakeml_spark.predict() sends every partition's texts to
   the worker (one DoExchange per partition), lakeml_spark.write_delta() commits the
   predictions (id, label, label_id, score, probabilities) in one Delta commit. rows/s over
   the job, read to commit. The worker is a fresh process per repeat (it caches recent texts),
   started and loaded untimed; the Spark session is started and warmed up untimed (the job's
   shape on 64 synthetic rows, not in the input: forks the Python workers, warms the JVM).
2b. local: the lakeml side without a worker of its own: lakeml_spark.predict(df, model=DIR)
   with no endpoints, so the executor starts one local `pipeline serve` with the same model
   settings (`threads`, precision, max_length 512), in the untimed warm-up job, and stops it
   with the session (lakeml_spark._local). The same timed job; the target is within 5% of 2.
3. hf: the same Spark session set-up and the same job, but the predictions come from a
   pandas UDF (Iterator[pd.Series] -> Iterator[pd.DataFrame]) that loads
   `transformers.pipeline("text-classification", model=DIR, dtype=...)` once per Spark Python
   worker (a module-level cache, as mlflow's spark_udf loads the model once per worker) and
   calls it with batch_size=64, truncation=True; written with the same write_delta (id, label,
   score). The UDF's model load happens in the untimed warm-up job (both Python workers), as the
   lakeml worker's load happens before its clock starts. Threads: Spark local[2] runs two tasks at once, each with
   torch.set_num_threads(threads // 2), so HF uses the same `threads` cores as the worker
   (`--hf-task-threads` overrides).
4. the scaling model's inputs (see the README's "Scaling"):
   - exchange: all rows through one DoExchange on a fresh worker (no Spark), cold, then the
     same rows again, warm (the worker answers them from its text cache, so the second pass
     is Flight transfer, encoding and a cache lookup): worker cost per row = (cold - warm) /
     rows, Flight transfer cost per row = warm / rows;
   - overhead: the lakeml job's Spark shape with the model replaced by a constant (read,
     Arrow to Python and back, Parquet write, commit) at 2, 8 and 32 partitions: the slope
     over the partition count is the cost of a partition, the rest per row; and Spark alone
     (an identity mapInArrow over spark.range at the same partition counts): its slope is the
     Spark task overhead.
Labels of the lakeml and hf sides are checked against the stage's (fraction of rows with the
same label, max |score diff|).

Why it is fair: one input table (made once by lakeml, untimed), one model directory, the same
precision, `threads` cores of inference on every side (the worker's intra-op threads, the
stage's, and HF's per task x 2 tasks); the Spark sides share one machine with their worker
(its client, Arrow conversions and Parquet writing take cores from the model, as they would
not on a cluster); each side runs as its own child process, one after the other, the order
reversed on odd repeats.
"""
import argparse
import importlib.metadata
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench_predict import LABELS, lakeml_side
from bench_serve import Server
from measure import SideFailed, run_measured, tail, work_dir

RESULT = "BENCH_RESULT "
SIDES = {"stage": "predict stage", "lakeml": "Spark + lakeml worker", "local": "Spark + executor's worker",
         "hf": "Spark + HF pandas UDF"}
HF_BATCH = 64
OVERHEAD_PARTITIONS = (2, 8, 32)
CHILD_TIMEOUT_S = 3600.0

# --- children ----------------------------------------------------------------------------------


def spark_session(kind: str):
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    import lakeml_spark

    t0 = time.perf_counter()
    spark = (SparkSession.builder.master("local[2]").appName(f"lakeml-bench-spark-{kind}")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2").config("spark.driver.memory", "2g")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    lakeml_spark.register(spark)
    return spark, time.perf_counter() - t0


WARM_UP_ROWS = 64


def warm_up_frame(spark):
    """Texts that are not in the input (the worker caches the texts it has scored)."""
    rows = [(i, f"warm-up review number {i}: a film") for i in range(WARM_UP_ROWS)]
    return spark.createDataFrame(rows, "id long, text string").repartition(2)


def source_frame(spark, spec):
    import lakeml_spark

    rows = spec["rows"]
    per = -(-rows // spec["partitions"])
    return lakeml_spark.read_delta(spark, spec["source"], rows_per_partition=per).select("id", "text")


def timed_job(spec: dict, kind: str, predict) -> dict:
    """One Spark side: a session (untimed), the job's shape on WARM_UP_ROWS synthetic rows
    (untimed: forks the Python workers, loads the HF model there, warms the JVM), then the
    job over the table, timed from the read to the commit."""
    import lakeml_spark

    spark, session_s = spark_session(kind)
    lakeml_spark.read_delta(spark, spec["source"]).limit(8).collect()
    lakeml_spark.write_delta(predict(warm_up_frame(spark)), spec["dest"] + "-warm-up", mode="overwrite")
    t0 = time.perf_counter()
    res = lakeml_spark.write_delta(predict(source_frame(spark, spec)), spec["dest"], mode="overwrite")
    seconds = time.perf_counter() - t0
    spark.stop()
    return {"rows": res["rows"], "seconds": seconds, "session_s": session_s, "files": res["files"]}


def lakeml_child(spec: dict) -> dict:
    import lakeml_spark

    def predict(df):
        return lakeml_spark.predict(df, endpoints=[spec["uri"]], batch_rows=spec["batch_rows"],
                                    timeout=CHILD_TIMEOUT_S).drop("text")

    return timed_job(spec, "lakeml", predict)


def local_child(spec: dict) -> dict:
    """The lakeml side with no endpoints: the executor starts its own worker (the same model
    settings as serve.yaml's), in the untimed warm-up job."""
    import lakeml_spark

    def predict(df):
        return lakeml_spark.predict(df, model=spec["model"], threads=spec["threads"],
                                    precision=spec["precision"], max_length=512,
                                    batch_rows=spec["batch_rows"], timeout=CHILD_TIMEOUT_S).drop("text")

    return timed_job(spec, "local", predict)


_HF = {}


def hf_pipeline(model: str, precision: str, threads: int):
    """One transformers pipeline per Spark Python worker (mlflow's spark_udf loads once too)."""
    key = (model, precision, threads)
    if key not in _HF:
        import torch
        import transformers
        from transformers import pipeline

        torch.set_num_threads(threads)
        transformers.logging.set_verbosity_error()
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        _HF[key] = pipeline("text-classification", model=model, device="cpu", dtype=dtype)
    return _HF[key]


def hf_child(spec: dict) -> dict:
    from typing import Iterator

    import pandas as pd
    from pyspark.sql.functions import pandas_udf

    model, precision, threads = spec["model"], spec["precision"], spec["task_threads"]

    def classify(texts: Iterator[pd.Series]) -> Iterator[pd.DataFrame]:
        # The cache lives in an importable module (benches/ is on the workers' PYTHONPATH): a
        # function of __main__ is pickled by value with its globals, a fresh cache per task.
        import bench_spark

        clf = bench_spark.hf_pipeline(model, precision, threads)
        for s in texts:
            out = clf(s.tolist(), batch_size=HF_BATCH, truncation=True)
            yield pd.DataFrame({"label": [o["label"] for o in out],
                                "score": [float(o["score"]) for o in out]})

    def predict(df):
        udf = pandas_udf(classify, "label string, score float")  # needs the session: made here
        return df.withColumn("p", udf("text")).select("id", "p.label", "p.score")

    return timed_job(spec, "hf", predict)


def exchange_child(spec: dict) -> dict:
    """The worker alone: every row through one DoExchange, cold, then again, warm."""
    import deltalake

    from lakeml_spark import _flight

    data = deltalake.DeltaTable(spec["source"]).to_pyarrow_table(columns=["text"]).combine_chunks()
    out = {}
    for name in ("cold", "warm"):
        t0 = time.perf_counter()
        reply = _flight.exchange(spec["uri"], {"text": "text"}, data, spec["batch_rows"], None,
                                 CHILD_TIMEOUT_S)
        out[f"{name}_s"] = time.perf_counter() - t0
        assert reply.num_rows == data.num_rows
    bytes_in = sum(b.nbytes for b in data.to_batches())
    bytes_out = reply.nbytes
    return {"rows": data.num_rows, **out, "bytes_sent": bytes_in, "bytes_received": bytes_out}


def overhead_child(spec: dict) -> dict:
    """The lakeml job's Spark shape with the model replaced by constants, at several partition
    counts: read (data source) -> mapInArrow -> write_delta."""
    import pyarrow as pa

    import lakeml_spark

    spark, session_s = spark_session("overhead")
    schema = "id long, label string, label_id long, score float, probabilities array<float>"

    def constant(batches):
        for b in batches:
            n = b.num_rows
            yield pa.RecordBatch.from_pydict(
                {"id": b.column("id"), "label": pa.array(["fresh"] * n),
                 "label_id": pa.array([1] * n, pa.int64()), "score": pa.array([0.5] * n, pa.float32()),
                 "probabilities": pa.array([[0.5, 0.5]] * n, pa.list_(pa.field("element", pa.float32())))})

    def job(p: int) -> float:
        dest = f"{spec['dest']}-{p}"
        shutil.rmtree(dest, ignore_errors=True)
        t0 = time.perf_counter()
        df = source_frame(spark, {**spec, "partitions": p})
        res = lakeml_spark.write_delta(df.mapInArrow(constant, schema), dest, mode="overwrite")
        assert res["rows"] == spec["rows"], res
        return time.perf_counter() - t0

    def bare(p: int) -> float:
        """Spark alone: P tasks of an identity mapInArrow over spark.range, counted."""
        t0 = time.perf_counter()
        n = spark.range(0, spec["rows"], numPartitions=p).mapInArrow(lambda it: it, "id long").count()
        assert n == spec["rows"], n
        return time.perf_counter() - t0

    job(4)  # untimed: the first job of a session pays class loading and JIT warm-up
    bare(4)
    times = {str(p): job(p) for p in spec["partitions_list"]}
    bare_times = {str(p): bare(p) for p in spec["partitions_list"]}
    spark.stop()
    return {"rows": spec["rows"], "seconds_by_partitions": times, "bare_seconds_by_partitions": bare_times}


CHILDREN = {"lakeml": lakeml_child, "local": local_child, "hf": hf_child, "exchange": exchange_child,
            "overhead": overhead_child}


def child_main(kind: str, spec_json: str) -> None:
    result = CHILDREN[kind](json.loads(spec_json))
    print(RESULT + json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)  # the py4j gateway / JVM can linger at interpreter shutdown


def run_child(kind: str, spec: dict, env: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, json.dumps(spec)]
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, stdin=subprocess.DEVNULL, env=env, text=True)
        try:
            rc = proc.wait(CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = f"killed after {CHILD_TIMEOUT_S:.0f} s"
        wall = time.perf_counter() - started
        out_f.seek(0)
        err_f.seek(0)
        out, err = out_f.read(), err_f.read()
    lines = [x for x in out.splitlines() if x.startswith(RESULT)]
    if rc != 0 or not lines:
        raise SideFailed(f"the {kind} child exited {rc}:\n{tail(err + out, 30)}")
    return {**json.loads(lines[-1][len(RESULT):]), "wall_s": wall}


# --- agreement ---------------------------------------------------------------------------------


def load_labels(path: str) -> dict:
    import deltalake

    t = deltalake.DeltaTable(path).to_pyarrow_table(columns=["id", "label", "score"]).to_pydict()
    return {i: (l, s) for i, l, s in zip(t["id"], t["label"], t["score"])}


def agreement(reference: dict, path: str) -> dict:
    got = load_labels(path)
    same = sum(1 for i, (l, _) in got.items() if i in reference and reference[i][0] == l)
    diff = max((abs(s - reference[i][1]) for i, (_, s) in got.items() if i in reference), default=None)
    return {"rows": len(got), "same_label": same / len(got) if got else float("nan"),
            "missing": sum(1 for i in reference if i not in got), "max_score_diff": diff}


# --- driver ------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.environ.get("LAKEML_BIN"), help="the pipeline binary (default $LAKEML_BIN)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, help="a fixed sample of N reviews (default: all)")
    ap.add_argument("--threads", type=int, default=2, help="inference threads on every side (default 2)")
    ap.add_argument("--hf-task-threads", type=int, help="torch threads per Spark task on the HF side "
                    "(default threads // 2: two tasks at once in local[2])")
    ap.add_argument("--partitions", type=int, default=4, help="Spark partitions of the Spark sides")
    ap.add_argument("--batch-rows", type=int, default=8192, help="rows per Flight batch (lakeml_spark's default)")
    ap.add_argument("--side", default="all", help="comma-separated: stage, lakeml, hf, exchange, overhead "
                    "(default all)")
    ap.add_argument("--model", help="classifier directory (default: MiniLM-L6 + a seeded 2-way head, made here)")
    ap.add_argument("--out", help="write a JSON summary here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child_main(*args.child)
    if not args.bin:
        sys.exit("give the pipeline binary with --bin or LAKEML_BIN (scripts/bench.sh spark does)")
    if args.repeats < 1 or args.threads < 1 or args.partitions < 1 or (args.rows is not None and args.rows < 1):
        sys.exit("--repeats, --threads, --partitions and --rows must be at least 1")
    args.hf_task_threads = args.hf_task_threads or max(1, args.threads // 2)
    known = ["stage", "lakeml", "local", "hf", "exchange", "overhead"]
    args.sides = known if args.side == "all" else [x.strip() for x in args.side.split(",") if x.strip()]
    if not args.sides or any(x not in known for x in args.sides):
        sys.exit(f"--side takes a comma-separated list of {', '.join(known)} (or all)")

    root = pathlib.Path(__file__).resolve().parent.parent
    assets = pathlib.Path(os.path.expanduser(os.environ.get("LAKEML_ASSETS", "~/.cache/lakeml/assets")))
    with work_dir("lakeml-bench-spark-", args.keep) as work:
        no_proxy = ",".join(x for x in (os.environ.get("NO_PROXY", ""), "127.0.0.1,localhost") if x)
        # The package from this checkout, for the driver and (inherited) Spark's Python workers.
        pythonpath = os.pathsep.join(x for x in (str(root / "python" / "src"), str(root / "benches"),
                                                 os.environ.get("PYTHONPATH")) if x)
        env = dict(os.environ, LAKEML_BENCH_DIR=str(work), LAKEML_ASSETS=str(assets),
                   LAKEML_BENCH_THREADS=str(args.threads), LAKEML_PRECISION=args.precision,
                   OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
                   TOKENIZERS_PARALLELISM="true", NO_PROXY=no_proxy, no_proxy=no_proxy,
                   PYTHONPATH=pythonpath, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
                   SPARK_LOCAL_IP=os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"))
        if args.rows:
            env["LAKEML_BENCH_ROWS"] = str(args.rows)
        print(f"machine: {os.cpu_count()} cores, {args.threads} inference threads per side, Spark local[2], "
              f"load average {os.getloadavg()[0]:.2f}; work dir {work}", flush=True)
        run_all(args, root, assets, work, env)


def run_all(args, root: pathlib.Path, assets: pathlib.Path, work: pathlib.Path, env: dict) -> None:
    if args.model:
        model = str(pathlib.Path(args.model).resolve())
    else:
        model = str(work / "model")
        made = run_measured([sys.executable, str(root / "tests/py/make_classifier.py"),
                             str(assets / "all-MiniLM-L6-v2"), model, LABELS, "0"], env)
        if made["rc"] != 0:
            sys.exit(f"making the classifier failed:\n{tail(made['stderr'])}")
    env["LAKEML_BENCH_MODEL"] = model
    made = run_measured([args.bin, "run", "--json", "--quiet", str(root / "benches/pipelines/predict_input.yaml")], env)
    if made["rc"] != 0:
        sys.exit(f"making the input table failed:\n{tail(made['stderr'])}")
    source = str(work / "reviews")
    import deltalake

    rows = deltalake.DeltaTable(source).to_pyarrow_table(columns=["id"]).num_rows
    print(f"input: {rows:,} rows in {source}; model {model}; {args.partitions} Spark partitions", flush=True)
    predict_yaml = str(root / "benches/pipelines/predict.yaml")
    serve_yaml = str(root / "benches/pipelines/serve.yaml")
    sides = [x for x in ("stage", "lakeml", "local", "hf") if x in args.sides]
    base = {"source": source, "rows": rows, "partitions": args.partitions, "batch_rows": args.batch_rows,
            "model": model, "precision": args.precision, "task_threads": args.hf_task_threads,
            "threads": args.threads}

    runs, model_runs = [], []
    try:
        for i in range(args.repeats):
            for s in (sides if i % 2 == 0 else sides[::-1]):
                if s == "stage":
                    r = lakeml_side(args.bin, predict_yaml, args.precision, env)
                    r = {"side": "stage", "rows": r["rows"], "seconds": r["stage_s"], "wall_s": r["wall_s"]}
                elif s == "lakeml":
                    dest = str(work / "preds-spark-lakeml")
                    with Server(args.bin, serve_yaml, env, work / f"serve-lakeml-{i}") as server:
                        r = run_child("lakeml", {**base, "uri": server.uri, "dest": dest}, env)
                    r = {**r, "side": "lakeml", "worker_ready_s": server.ready_s, "worker_rss_mib": server.rss_mib}
                elif s == "local":
                    r = run_child("local", {**base, "dest": str(work / "preds-spark-local")},
                                  {**env, "LAKEML_PIPELINE": args.bin})
                    r = {**r, "side": "local"}
                else:
                    r = run_child("hf", {**base, "dest": str(work / "preds-spark-hf")}, env)
                    r = {**r, "side": "hf"}
                if r["rows"] != rows:
                    raise SideFailed(f"{SIDES[s]} wrote {r['rows']} rows of {rows}")
                r["repeat"] = i
                runs.append(r)
                extra = f", Spark session {r['session_s']:.1f} s (untimed)" if "session_s" in r else ""
                print(f"  run {i + 1} {SIDES[s]:24} {rows / r['seconds']:8.1f} rows/s, {r['seconds']:.2f} s timed, "
                      f"{r['wall_s']:.2f} s wall{extra}; load average {os.getloadavg()[0]:.2f}", flush=True)
            m = {}
            if "exchange" in args.sides:
                with Server(args.bin, serve_yaml, env, work / f"serve-model-{i}") as server:
                    m["exchange"] = ex = run_child("exchange", {**base, "uri": server.uri}, env)
                print(f"  run {i + 1} exchange (no Spark): cold {ex['cold_s']:.2f} s, warm {ex['warm_s']:.2f} s",
                      flush=True)
            if "overhead" in args.sides:
                m["overhead"] = ov = run_child("overhead", {**base, "dest": str(work / "overhead"),
                                                            "partitions_list": list(OVERHEAD_PARTITIONS)}, env)
                print(f"  run {i + 1} Spark without a model: " + ", ".join(
                    f"{p} partitions {t:.2f} s" for p, t in ov["seconds_by_partitions"].items()), flush=True)
            if m:
                model_runs.append(m)
    except SideFailed as e:
        sys.exit(f"\n{e}")
    summary = summarize(args, rows, runs, model_runs, work)
    if args.out:
        def version(pkg):
            try:
                return importlib.metadata.version(pkg)
            except importlib.metadata.PackageNotFoundError:
                return None

        doc = {"machine": {"cpus": os.cpu_count(), "threads": args.threads, "load_average_at_end": os.getloadavg()},
               "versions": {p: version(p) for p in ("pyspark", "pyarrow", "deltalake", "torch", "transformers")},
               "config": {"rows": rows, "precision": args.precision, "repeats": args.repeats,
                          "partitions": args.partitions, "batch_rows": args.batch_rows,
                          "hf_task_threads": args.hf_task_threads, "hf_batch_size": HF_BATCH, "model": model},
               "runs": runs, "model_runs": model_runs, **summary}
        pathlib.Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"summary written to {args.out}")


def summarize(args, rows: int, runs: list, model_runs: list, work: pathlib.Path) -> dict:
    med = {}
    for s in SIDES:
        xs = [r for r in runs if r["side"] == s]
        if xs:
            seconds = statistics.median(x["seconds"] for x in xs)
            med[s] = {"seconds": seconds, "rows_per_s": rows / seconds,
                      "wall_s": statistics.median(x["wall_s"] for x in xs), "runs": len(xs)}
    agree = {}
    stage_path = work / f"preds-lakeml-{args.precision}"
    if "stage" in med:
        reference = load_labels(str(stage_path))
        for s, path in (("lakeml", work / "preds-spark-lakeml"), ("local", work / "preds-spark-local"),
                        ("hf", work / "preds-spark-hf")):
            if s in med:
                agree[s] = agreement(reference, str(path))
    print()
    print(f"{args.precision}: {rows:,} rows, {args.threads} inference threads per side "
          f"(HF: {args.hf_task_threads} per task x 2 tasks), {args.partitions} Spark partitions, "
          f"medians of {args.repeats}")
    print(f"{'side':26}{'rows/s':>9}{'timed s':>9}{'wall s':>9}{'same label':>12}{'max |dscore|':>14}")
    for s, name in SIDES.items():
        m = med.get(s)
        if not m:
            continue
        ag = agree.get(s)
        same = "(ref)" if s == "stage" else (f"{ag['same_label']:.4f}" if ag else "-")
        diff = f"{ag['max_score_diff']:.1e}" if ag and ag["max_score_diff"] is not None else "-"
        print(f"{name:26}{m['rows_per_s']:9.1f}{m['seconds']:9.2f}{m['wall_s']:9.2f}{same:>12}{diff:>14}")
    print("timed s: the stage's in-process seconds (model load to commit); a Spark side's job from the read to "
          "the commit\n  (session start, warm-up and the worker's start-up untimed). wall s: the child process.")
    compare = {}
    if "lakeml" in med and "stage" in med:
        compare["lakeml/stage"] = med["lakeml"]["rows_per_s"] / med["stage"]["rows_per_s"]
        verdict = "meets" if compare["lakeml/stage"] >= 0.80 else "MISSES"
        print(f"Spark + lakeml worker / predict stage: {compare['lakeml/stage']:.2f}x ({verdict} the target, >= 0.80)")
    if "local" in med and "lakeml" in med:
        compare["local/lakeml"] = med["local"]["rows_per_s"] / med["lakeml"]["rows_per_s"]
        verdict = "meets" if compare["local/lakeml"] >= 0.95 else "MISSES"
        print(f"Spark + executor's worker / Spark + lakeml worker: {compare['local/lakeml']:.2f}x "
              f"({verdict} the target, within 5%)")
    if "lakeml" in med and "hf" in med:
        compare["lakeml/hf"] = med["lakeml"]["rows_per_s"] / med["hf"]["rows_per_s"]
        verdict = "meets" if compare["lakeml/hf"] >= 2.0 else "MISSES"
        print(f"Spark + lakeml worker / Spark + HF pandas UDF: {compare['lakeml/hf']:.2f}x ({verdict} the target, >= 2)")

    model = {}
    exchanges = [m["exchange"] for m in model_runs if "exchange" in m]
    overheads = [m["overhead"] for m in model_runs if "overhead" in m]
    if exchanges or overheads:
        print()
        print(f"scaling model inputs (medians; a {args.threads}-thread worker and Spark local[2] on this machine):")
    if exchanges:
        cold = statistics.median(x["cold_s"] for x in exchanges)
        warm = statistics.median(x["warm_s"] for x in exchanges)
        ex = exchanges[-1]
        model |= {"worker_row_s": (cold - warm) / rows, "transfer_row_s": warm / rows,
                  "exchange_cold_s": cold, "exchange_warm_s": warm,
                  "bytes_per_row": (ex["bytes_sent"] + ex["bytes_received"]) / rows}
        print(f"  worker cost per row        {model['worker_row_s'] * 1e3:8.3f} ms  "
              f"(exchange cold {cold:.2f} s - warm {warm:.2f} s, over {rows:,} rows; one worker: "
              f"{1 / model['worker_row_s']:.0f} rows/s)")
        print(f"  Flight transfer per row    {model['transfer_row_s'] * 1e3:8.3f} ms  "
              f"(the warm pass: send, cache lookup, return; {model['bytes_per_row']:.0f} bytes/row both ways)")
    if overheads:
        by_p = {p: statistics.median(x["seconds_by_partitions"][str(p)] for x in overheads)
                for p in OVERHEAD_PARTITIONS}
        bare_p = {p: statistics.median(x["bare_seconds_by_partitions"][str(p)] for x in overheads)
                  for p in OVERHEAD_PARTITIONS}

        def fit(points: dict) -> tuple[float, float]:
            """Least squares: seconds = fixed + partitions * per_task."""
            xs, ys = list(points), list(points.values())
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            return my - slope * mx, slope

        fixed_s, task_s = fit(by_p)
        _, bare_task_s = fit(bare_p)
        spark_row_s = max(fixed_s, 0.0) / rows
        lo, hi = OVERHEAD_PARTITIONS[0], OVERHEAD_PARTITIONS[-1]
        model |= {"spark_task_s": task_s, "spark_bare_task_s": bare_task_s, "spark_row_s": spark_row_s,
                  "spark_fixed_s": fixed_s, "spark_seconds_by_partitions": by_p,
                  "spark_bare_seconds_by_partitions": bare_p}
        print(f"  Spark task overhead        {bare_task_s * 1e3:8.1f} ms  "
              f"(per task, Spark alone: an identity mapInArrow over spark.range, {lo}..{hi} partitions: "
              + ", ".join(f"{p}: {t:.2f} s" for p, t in bare_p.items()) + ")")
        print(f"  the job's cost per partition {task_s * 1e3:6.1f} ms  "
              f"(the model-less job, read -> mapInArrow -> write_delta, {lo}..{hi} partitions: "
              + ", ".join(f"{p}: {t:.2f} s" for p, t in by_p.items()) + "; each row range re-reads its file's "
              "row group, and each task writes a file)")
        print(f"  Spark cost per row         {spark_row_s * 1e3:8.3f} ms  "
              f"(the fit's intercept {fixed_s:.2f} s over {rows:,} rows: read, Arrow to Python and back, "
              "Parquet, commit, job start; 2 local cores)")
    return {"medians": med, "agreement": agree, "compare": compare, "model": model}


if __name__ == "__main__":
    main()
