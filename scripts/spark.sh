#!/usr/bin/env bash
# The Spark job (pipelines/spark_predict.py) with nothing to set by hand: the cache's venv
# (pyspark, lakeml_spark), Java 17 and SPARK_LOCAL_IP as scripts/env.sh finds them. Arguments
# go to the job, e.g. --endpoint grpc://127.0.0.1:50051 --endpoint grpc://127.0.0.1:50052.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ensure_venv
ensure_java
exec "$LAKEML_PYTHON" "$LAKEML_ROOT/pipelines/spark_predict.py" "$@"
