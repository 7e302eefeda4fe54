#!/usr/bin/env bash
# The test suite: formatting, lints, unit and integration tests (real data, real peers).
# Installs what is missing into ~/.cache/lakeml (see scripts/env.sh) and reuses it after.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ensure_venv
ensure_assets
ensure_mlflow
ensure_java
ensure_object_stores
cd "$LAKEML_ROOT"
log "cargo fmt --check"
cargo fmt --check
log "cargo clippy"
cargo_env cargo clippy --release --locked --all-targets -- -D warnings
log "cargo test"
cargo_env cargo test --release --locked -- --test-threads=2
