"""Read a Delta table with Spark (pyspark, local[2]; an independent engine) and print a summary.

usage: spark_read_delta.py TABLE_DIR ID_COLUMN
prints one JSON line: files (active files in the Delta log), all_parquet_files (*.parquet under
TABLE_DIR outside _delta_log, removed ones included), rows, distinct_ids (of ID_COLUMN),
schema (name -> Spark simpleString), label_counts (if a `label` column exists), sample (first
3 rows by ID_COLUMN).

No delta-spark jars are reachable here (no Maven), and reading the directory as plain Parquet
would also read files the log has removed: the active files come from the Delta log
(delta-rs's DeltaTable.file_uris()) and Spark reads exactly those. Needs JAVA_HOME (Java 17)
and SPARK_LOCAL_IP, as scripts/env.sh's ensure_java sets them.
"""
import os
import sys

import deltalake
from spark_common import finish, json_safe, session

# Table features that make a data file's Parquet differ from the table's rows; reading the
# files directly would be wrong, so refuse rather than print a plausible answer.
UNSUPPORTED_READER_FEATURES = {"deletionVectors", "columnMapping"}


def count_parquet_files(root: str) -> int:
    count = 0
    for dirpath, dirnames, filenames in os.walk(root):
        # checkpoints in _delta_log are Parquet too, but they are not data files
        dirnames[:] = [d for d in dirnames if d != "_delta_log"]
        count += sum(1 for name in filenames if name.endswith(".parquet"))
    return count


def main() -> None:
    path, id_column = sys.argv[1], sys.argv[2]
    table = deltalake.DeltaTable(path)
    protocol = table.protocol()
    features = set(protocol.reader_features or [])
    if protocol.min_reader_version == 2 or features & UNSUPPORTED_READER_FEATURES:
        sys.exit(f"spark_read_delta.py: {path} needs Delta reader features Spark cannot get "
                 f"from plain Parquet (reader v{protocol.min_reader_version}, {sorted(features)})")
    files = table.file_uris()
    partitioned = bool(table.metadata().partition_columns)

    spark = session("spark_read_delta.py", lakeml=False)

    if files:
        reader = spark.read
        if partitioned:
            # partition values live in the paths (col=value/), not in the files
            reader = reader.option("basePath", os.path.abspath(path))
        df = reader.parquet(*files)
    else:
        # no active files: an empty frame with the table's schema (delta-rs gives arro3)
        import pyarrow

        df = spark.createDataFrame(pyarrow.schema(table.schema().to_arrow()).empty_table())

    result = {
        "files": len(files),
        "all_parquet_files": count_parquet_files(path),
        "rows": df.count(),
        "distinct_ids": df.select(id_column).distinct().count(),
        "schema": {f.name: f.dataType.simpleString() for f in df.schema.fields},
    }
    if "label" in df.columns:
        result["label_counts"] = {
            str(r["label"]): r["count"] for r in df.groupBy("label").count().collect()
        }
    result["sample"] = [
        json_safe(r.asDict(recursive=True)) for r in df.orderBy(id_column).limit(3).collect()
    ]
    finish(spark, result)


if __name__ == "__main__":
    main()
