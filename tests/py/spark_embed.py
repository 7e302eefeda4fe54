"""lakeml_spark.embed from Spark local[2] through `pipeline serve`, with a dead endpoint
first in the list (the partitions that start there fail over to the live one).

usage: spark_embed.py URI TOKEN REVIEWS_DIR EMBEDDINGS_DIR
Spark reads the reviews' active Parquet files (from delta-rs, no delta-spark jars), embeds
`text` with the workers' model `minilm`, and the vectors are compared with the embed stage's
table (read by delta-rs). Prints JSON: rows, ids (sorted), min_cosine, type (Spark's type of
`embedding`), partitions.
"""
import socket
import sys

import deltalake
import numpy as np

from spark_common import finish, session


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    uri, token, reviews, embeddings = sys.argv[1:5]
    spark = session("spark_embed.py")
    import lakeml_spark

    df = spark.read.parquet(*deltalake.DeltaTable(reviews).file_uris()).select("id", "text")
    df = df.repartition(2)
    dead = f"grpc://127.0.0.1:{free_port()}"
    out = lakeml_spark.embed(df, text="text", model="minilm", endpoints=[dead, uri],
                             token=token, retries=2, backoff=0.1)
    rows = {r["id"]: r["embedding"] for r in out.select("id", "embedding").collect()}
    stage = deltalake.DeltaTable(embeddings).to_pyarrow_table().to_pylist()
    want = {r["id"]: r["embedding"] for r in stage}
    ids = sorted(rows)
    a = np.array([rows[i] for i in ids], dtype=np.float32)
    b = np.array([want[i] for i in ids], dtype=np.float32)
    cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    finish(spark, {
        "rows": len(ids),
        "ids": ids,
        "min_cosine": float(cosine.min()),
        "type": out.schema["embedding"].dataType.simpleString(),
        "partitions": df.rdd.getNumPartitions(),
    })


if __name__ == "__main__":
    main()
