#!/usr/bin/env bash
# Builds the lakeml wheel (the `pipeline` binary + the `lakeml_spark` package, see
# pyproject.toml) into $CARGO_TARGET_DIR/wheels and prints its path. maturin builds with the
# same build directory and release profile as scripts/demo.sh and scripts/test.sh, so a warm
# build only links the binary again. Install it with `pip install <path>`: pip pulls
# torch==2.11.0, whose libtorch the binary uses.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ensure_venv
ensure_maturin
out="$CARGO_TARGET_DIR/wheels"
mkdir -p "$out"
log "building the wheel (maturin $MATURIN_VERSION)"
# --auditwheel warn: the platform tag is the lowest manylinux whose glibc covers the
# binary's symbols; libtorch, which auditwheel would otherwise copy into the wheel, stays
# an external library that the torch wheel provides.
(cd "$LAKEML_ROOT" && cargo_env "$LAKEML_MATURIN" build --release --auditwheel warn \
  --out "$out" "$@") >&2
ls -t "$out"/lakeml-*.whl | head -1
