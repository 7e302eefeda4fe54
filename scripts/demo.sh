#!/usr/bin/env bash
# The main job, end to end on the bundled real data (Rotten Tomatoes + all-MiniLM-L6-v2).
# Installs what is missing into ~/.cache/lakeml (see scripts/env.sh), builds, runs
# pipelines/train.yaml. Extra arguments go to `pipeline run` (e.g. --force).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ensure_venv
ensure_assets
ensure_build
"$LAKEML_BIN" run "$LAKEML_ROOT/pipelines/train.yaml" "$@"
cat <<MSG

The binary is $LAKEML_BIN ("pipeline" above). Tables (Delta) are under $LAKEML_ROOT/lake/,
the model under $LAKEML_ROOT/runs/. Query them with SQL, e.g.:
  $LAKEML_BIN sql $LAKEML_ROOT/pipelines/train.yaml "SELECT avg(CAST(label = true_label AS DOUBLE)) AS accuracy, count(*) AS n FROM review_predictions"
or read one back with deltalake:
  $LAKEML_PYTHON -c "import deltalake; t = deltalake.DeltaTable('$LAKEML_ROOT/lake/review_predictions'); print(t.version(), t.schema()); print(t.to_pyarrow_table().slice(0, 3))"
MSG
