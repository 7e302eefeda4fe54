"""lakeml_spark on S3 (moto on 127.0.0.1), no JVM jars: write_delta from Spark local[2] into an
S3 Delta table (executors write the Parquet files to S3, the driver commits once with a
txn), a rerun of the same job version that commits nothing, then the table read back with
lakeml_spark.read_delta (Spark) and with delta-rs alone.

usage: spark_object_store.py ENDPOINT TABLE_URL ROWS
prints JSON: first, rerun (write_delta's summaries), spark_ids (sorted ids read by Spark),
delta (version, num_rows, files, ids sorted, lakeml_spark commit entries) read by deltalake.
"""
import sys

import deltalake

from spark_common import finish, session

S3_KEY, S3_SECRET = "lakeml-test", "lakeml-test-secret"


def main() -> None:
    endpoint, url, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
    options = {"aws_endpoint_url": f"http://{endpoint}", "aws_allow_http": "true",
               "aws_region": "us-east-1", "aws_access_key_id": S3_KEY,
               "aws_secret_access_key": S3_SECRET}
    spark = session("spark-object-store")
    import lakeml_spark

    df = spark.range(1, rows + 1, numPartitions=4).selectExpr(
        "id", "concat('review ', CAST(id AS STRING)) AS text")
    first = lakeml_spark.write_delta(df, url, app_id="test/s3", version=1,
                                     storage_options=options)
    rerun = lakeml_spark.write_delta(df, url, app_id="test/s3", version=1,
                                     storage_options=options)
    read = lakeml_spark.read_delta(spark, url, storage_options=options)
    spark_ids = sorted(r["id"] for r in read.select("id").collect())
    table = deltalake.DeltaTable(url, storage_options=options)
    data = table.to_pyarrow_table()
    finish(spark, {
        "first": first, "rerun": rerun, "spark_ids": spark_ids,
        "delta": {"version": table.version(), "num_rows": data.num_rows,
                  "files": len(table.file_uris()),
                  "ids": sorted(data.column("id").to_pylist()),
                  "commits": [h.get("lakeml_spark") for h in table.history()]},
    })


if __name__ == "__main__":
    main()
