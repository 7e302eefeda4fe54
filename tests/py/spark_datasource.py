"""spark.read.format("lakeml"): a Flight SQL query in several endpoints, and Delta tables after
an overwrite (lakeml's and write_delta's).

usage: spark_datasource.py URI REVIEWS_DIR SCRATCH_DIR (the worker's token in LAKEML_TOKEN)
  query      `SELECT id, text FROM multi` (a Delta table of several files) through the data source:
             flight_endpoints (GetFlightInfo's), spark_partitions, rows, distinct_ids, ids
  predicted  `SELECT id, sentiment(text) AS label FROM multi WHERE id <= 150`: rows [[id, label], ...] by id,
             flight_endpoints, spark_partitions
  reviews    REVIEWS_DIR (a lakeml table overwritten once) read at its latest version and at
             version 0: rows, distinct_ids, ids, active_files, all_parquet_files (on disk)
  written    a table written here with write_delta (200 rows in 4 files), overwritten with 30
             rows: latest and version 0 as for reviews, plus rows_split (the latest read in
             row ranges of 7: spark_partitions, rows, distinct_ids)
"""
import os
import sys

from spark_common import finish, session


def parquet_files(root: str) -> int:
    count = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "_delta_log"]
        count += sum(1 for name in filenames if name.endswith(".parquet"))
    return count


def summary(df, with_ids=True) -> dict:
    ids = sorted(r["id"] for r in df.select("id").collect())
    out = {"rows": len(ids), "distinct_ids": len(set(ids)),
           "spark_partitions": df.rdd.getNumPartitions()}
    if with_ids:
        out["ids"] = ids
    return out


def table_reads(spark, path: str) -> dict:
    import deltalake

    import lakeml_spark

    table = deltalake.DeltaTable(path)
    return {
        "latest": summary(lakeml_spark.read_delta(spark, path)),
        "v0": summary(lakeml_spark.read_delta(spark, path, version=0)),
        "version": table.version(),
        "active_files": len(table.file_uris()),
        "all_parquet_files": parquet_files(path),
    }


def main() -> None:
    uri, reviews, scratch = sys.argv[1], sys.argv[2], sys.argv[3]
    token = os.environ["LAKEML_TOKEN"]

    import lakeml_spark
    from lakeml_spark.datasource import _QueryPlan

    spark = session("lakeml-spark-datasource")
    result = {}

    def query(sql):
        plan = _QueryPlan({"query": sql, "endpoint": uri, "token": token})
        endpoints = len(plan.info().endpoints)
        df = lakeml_spark.read_query(spark, sql, uri, token=token, timeout=120)
        return endpoints, df

    endpoints, df = query("SELECT id, text FROM multi")
    result["query"] = {"flight_endpoints": endpoints, **summary(df),
                       "columns": df.columns}
    endpoints, df = query("SELECT id, sentiment(text) AS label FROM multi WHERE id <= 150")
    rows = sorted(([r["id"], r["label"]] for r in df.collect()), key=lambda r: r[0])
    result["predicted"] = {"flight_endpoints": endpoints, "rows": rows,
                           "spark_partitions": df.rdd.getNumPartitions()}

    result["reviews"] = table_reads(spark, reviews)

    written = os.path.join(scratch, "written")
    first = spark.range(1, 201, numPartitions=4).selectExpr("id", "concat('review ', id) AS text")
    lakeml_spark.write_delta(first, written, mode="append")
    second = spark.range(1001, 1031, numPartitions=2).selectExpr("id", "concat('new ', id) AS text")
    lakeml_spark.write_delta(second, written, mode="overwrite")
    result["written"] = table_reads(spark, written)
    split = lakeml_spark.read_delta(spark, written, rows_per_partition=7)
    result["written"]["rows_split"] = summary(split, with_ids=False)
    finish(spark, result)


if __name__ == "__main__":
    main()
