"""lakeml_spark.predict with bad rows, fail_on_error true and false, against `pipeline serve`.

usage: spark_bad_rows.py URI (the worker's token in LAKEML_TOKEN)
Cases (each a small DataFrame made here, one partition per two rows):
  binary_lenient   id, text BINARY: good UTF-8, NULL, bytes that are not UTF-8, good UTF-8;
                   fail_on_error=False
  string_lenient   id, text STRING with a NULL; fail_on_error=False
  string_strict    the same with fail_on_error=True (a NULL text is not an error)
  int_lenient      id, text BIGINT (not a string at all); fail_on_error=False
  binary_strict    the binary frame with fail_on_error=True: the job fails
  int_strict       the int frame with fail_on_error=True: the job fails
  split            the worker refusing a whole request (an int64 text column sent as it is):
                   the request is split down to single rows, each gets the refusal
Prints one JSON object: per lenient/strict-success case, rows [[id, label, score, error], ...]
by id and the columns; per failing case {"error": message}; split: {"errors": [...],
"labels": [...]}.
"""
import os
import sys

from spark_common import error_text, finish, session


def main() -> None:
    uri = sys.argv[1]
    token = os.environ["LAKEML_TOKEN"]

    import pyarrow as pa
    from pyspark.sql.types import BinaryType, LongType, StringType, StructField, StructType

    import lakeml_spark
    from lakeml_spark._predict import _Job

    spark = session("lakeml-spark-bad-rows")

    def frame(values, spark_type):
        schema = StructType([StructField("id", LongType()), StructField("text", spark_type)])
        return spark.createDataFrame([(i + 1, v) for i, v in enumerate(values)], schema) \
            .repartition(2, "id")

    binary = frame([b"a warm, funny film", None, b"\xff\xfe not utf-8 \xc3", b"dull and long"],
                   BinaryType())
    strings = frame(["a warm, funny film", None, "dull and long"], StringType())
    ints = frame([1, 2, None], LongType())

    def run(df, fail_on_error):
        out = lakeml_spark.predict(df, endpoints=[uri], token=token, model="sentiment",
                                   fail_on_error=fail_on_error, retries=1, backoff=0.1)
        rows = sorted(out.collect(), key=lambda r: r["id"])
        return {"columns": out.columns,
                "rows": [[r["id"], r["label"], r["score"], r["error"] if "error" in out.columns
                          else None] for r in rows]}

    def fails(df):
        try:
            got = run(df, True)
            return {"rows": got["rows"]}
        except Exception as e:  # noqa: BLE001 - the refusal is the result
            return {"error": error_text(e)}

    result = {
        "binary_lenient": run(binary, False),
        "string_lenient": run(strings, False),
        "string_strict": run(strings, True),
        "int_lenient": run(ints, False),
        "binary_strict": fails(binary),
        "int_strict": fails(ints),
    }

    # The split path, straight on the task's code: the worker refuses the int64 column of
    # every request, so each of the 5 rows ends alone with the worker's message.
    job = _Job(endpoints=(uri,), token=token, text="text", text_pair=None,
               command={"model": "sentiment", "text": "text", "text_pair": None},
               predicted=("label",), out_types=(pa.string(),), batch_rows=2, timeout=60.0,
               fail_on_error=False, retries=0, backoff=0.0)
    predicted, errors = job.call_or_split(pa.table({"text": pa.array([1, 2, 3, 4, 5])}), 0, 0)
    result["split"] = {"errors": errors, "labels": predicted.column("label").to_pylist()}
    finish(spark, result)


if __name__ == "__main__":
    main()
