"""What the Spark test scripts share: a local Spark session (with lakeml_spark's data source,
or Spark alone), and printing the result as the last stdout line before a hard exit.

The package comes from the checkout (tests/it/spark.rs puts python/src on PYTHONPATH, which
the local Spark's Python workers inherit), so the tests always run the working tree's code.
Needs JAVA_HOME (Java 17) and SPARK_LOCAL_IP, as scripts/env.sh's ensure_java sets them.
"""
import json
import math
import os
import sys
import time


def session(name: str, master: str = "local[2]", lakeml: bool = True):
    """A local Spark session; with `lakeml`, format("lakeml") registered (the package from the
    checkout). Without it, Spark alone: an engine independent of lakeml's code."""
    # the Python workers must be this interpreter (pyarrow, deltalake), not whatever is on PATH
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    started = time.monotonic()
    spark = (
        SparkSession.builder.master(master)
        .appName(name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", "1g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    if lakeml:
        import lakeml_spark

        lakeml_spark.register(spark)
    print(f"{name}: Spark started in {time.monotonic() - started:.1f} s", file=sys.stderr)
    return spark


def json_safe(value):
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def finish(spark, result: dict) -> None:
    print(json.dumps(json_safe(result)))
    sys.stdout.flush()
    sys.stderr.flush()
    if spark is not None:
        spark.stop()
    # the py4j gateway / JVM can linger at interpreter shutdown; the output is complete here
    os._exit(0)


def error_text(e: BaseException) -> str:
    """An exception's message, with what Spark wraps around a Python worker's error kept."""
    return f"{type(e).__name__}: {e}"
