"""lakeml for Spark users (PyPI pyspark 4, no JVM jars).

- predict(df, text="text", model=None, endpoints=[...], token=None, ...): predictions through
  `pipeline serve` workers (mapInArrow + Flight DoExchange), see lakeml_spark.predict;
  embed(df, ...) the same for sentence vectors (`embedding`).
- register(spark); spark.read.format("lakeml"): Flight SQL queries (`query=`) and lakeml Delta
  tables (`path=`, `version=`), see lakeml_spark.datasource; read_query / read_delta wrap it.
- write_delta(df, path, mode=..., app_id=..., version=...): one Delta commit, exactly once
  per (app_id, version), see lakeml_spark.delta.
"""
from .datasource import LakemlDataSource, read_delta, read_query, register
from .delta import write_delta
from .predict import PREDICTED, WorkerError, embed, predict

__all__ = ["LakemlDataSource", "PREDICTED", "WorkerError", "embed", "predict", "read_delta",
           "read_query", "register", "write_delta"]
__version__ = "0.1.0"
