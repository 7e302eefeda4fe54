"""lakeml for Spark users (PyPI pyspark 4, no JVM jars).

- predict(df, text="text", model="path/or/url"): predictions on the executors, each running
  one local `pipeline serve` for the model; or predict(df, ..., endpoints=[...], token=...)
  through a fleet of `pipeline serve` workers (mapInArrow + Flight DoExchange), see
  lakeml_spark._predict; embed(df, ...) the same for sentence vectors (`embedding`).
- register(spark); spark.read.format("lakeml"): Flight SQL queries (`query=`) and lakeml Delta
  tables (`path=`, `version=`), see lakeml_spark.datasource; read_query / read_delta wrap it.
- write_delta(df, path, mode=..., app_id=..., version=...): one Delta commit, exactly once
  per (app_id, version), see lakeml_spark.delta.
- train(spark, "pipeline.yaml", num_processes=N): `pipeline run` as N ranks of a
  data-parallel job on Spark barrier tasks (as TorchDistributor), see lakeml_spark._train.

Importing the package needs nothing but Python: pyspark, pyarrow and deltalake (the `spark`
extra, `pip install 'lakeml[spark]'`) are imported when a function is first used.
"""
import importlib

_EXPORTS = {
    "LakemlDataSource": "datasource", "read_delta": "datasource", "read_query": "datasource",
    "register": "datasource", "write_delta": "delta", "PREDICTED": "_predict",
    "WorkerError": "_errors", "embed": "_predict", "predict": "_predict", "train": "_train",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lakeml_spark' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
