"""Predict from Spark through `pipeline serve`: mapInArrow streams each partition through
DoExchange (pyspark local[2], pyarrow.flight in the Python workers).

usage: spark_map_in_arrow.py URI TOKEN DELTA_DIR
Spark reads the Delta table's active files (from delta-rs's DeltaTable.file_uris(), as
spark_read_delta.py does: no delta-spark jars here), selects id and text, splits the rows
into 2 partitions and maps each with a function that opens its own Flight client, sends
the partition's Arrow batches with {"model": "sentiment", "text": "text"} and yields what
comes back, cast to "id long, text string, label string, label_id long, score float,
probabilities array<float>". Needs JAVA_HOME (Java 17) and SPARK_LOCAL_IP, as
scripts/env.sh's ensure_java sets them. Prints one JSON object: rows ([[id, label, score],
...] by id), partitions, probabilities_lengths (the distinct lengths seen).
"""
import json
import sys

import deltalake
from spark_common import finish, session

SPARK_SCHEMA = (
    "id long, text string, label string, label_id long, score float, "
    "probabilities array<float>"
)


def predict_partitions(uri: str, token: str):
    """The function Spark runs per partition: Arrow batches in, predicted batches out."""

    def predict(batches):
        import pyarrow as pa
        import pyarrow.flight as flight

        # Spark's Arrow schema for SPARK_SCHEMA (it names list items `element`)
        out_schema = pa.schema([
            ("id", pa.int64()),
            ("text", pa.string()),
            ("label", pa.string()),
            ("label_id", pa.int64()),
            ("score", pa.float32()),
            ("probabilities", pa.list_(pa.field("element", pa.float32()))),
        ])
        batches = [b for b in batches if b.num_rows > 0]
        if not batches:
            return
        client = flight.connect(uri)
        options = flight.FlightCallOptions(
            timeout=300.0, headers=[(b"authorization", b"Bearer " + token.encode())]
        )
        descriptor = flight.FlightDescriptor.for_command(
            json.dumps({"model": "sentiment", "text": "text"}).encode()
        )
        writer, reader = client.do_exchange(descriptor, options)
        write_error = None
        try:
            writer.begin(batches[0].schema)
            for batch in batches:
                writer.write_batch(batch)
            writer.done_writing()
        except Exception as e:  # noqa: BLE001 - the read below carries the server's status
            write_error = e
        try:
            result = reader.read_all()
        finally:
            try:
                writer.close()
            except Exception:  # noqa: BLE001
                pass
            client.close()
        if write_error is not None:
            raise write_error
        for batch in result.to_batches():
            yield pa.RecordBatch.from_arrays(
                [batch.column(f.name).cast(f.type) for f in out_schema], schema=out_schema
            )

    return predict


def main() -> None:
    uri, token, delta_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    files = deltalake.DeltaTable(delta_dir).file_uris()
    if not files:
        sys.exit(f"spark_map_in_arrow.py: {delta_dir} has no active files")

    spark = session("spark_map_in_arrow.py", lakeml=False)

    df = spark.read.parquet(*files).select("id", "text").repartition(2)
    predicted = df.mapInArrow(predict_partitions(uri, token), SPARK_SCHEMA)
    rows = predicted.collect()
    result = {
        "rows": sorted(([r["id"], r["label"], r["score"]] for r in rows), key=lambda r: r[0]),
        "partitions": df.rdd.getNumPartitions(),
        "probabilities_lengths": sorted({len(r["probabilities"] or []) for r in rows}),
    }
    finish(spark, result)


if __name__ == "__main__":
    main()
