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

Tables (Delta) are under $LAKEML_ROOT/lake/. Read one back, e.g.:
  $LAKEML_PYTHON -c "import deltalake; t = deltalake.DeltaTable('$LAKEML_ROOT/lake/reviews_tokenized'); print(t.version(), t.schema()); print(t.to_pyarrow_table().slice(0, 3))"
MSG
