#!/usr/bin/env bash
# The test suite: formatting, lints, unit and integration tests (real data, real peers).
# Installs what is missing into ~/.cache/lakeml (see scripts/env.sh) and reuses it after.
# Ends with each phase's wall time and the five slowest tests, also when a phase fails, so
# anyone can see how close the suite is to CI's 90-minute limit.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

phases=() running="" phase_start=$(date +%s)
suite_start=$phase_start
# Ends the running phase (records its name and wall time) and starts phase NAME.
phase() {
  local now
  now=$(date +%s)
  [[ -z "$running" ]] || phases+=("$running $((now - phase_start))")
  running="$1" phase_start=$now
}

results="$(mktemp)"
summary() {
  local status=$? line name secs
  set +e
  [[ $status -eq 0 || -z "$running" ]] || running="$running (failed)"
  phase ""
  {
    printf '\n'
    log "wall time by phase (exit $status)"
    for line in "${phases[@]}"; do
      name="${line% *}" secs="${line##* }"
      printf '  %-12s %4dm%02ds\n' "$name" $((secs / 60)) $((secs % 60))
    done
    secs=$(($(date +%s) - suite_start))
    printf '  %-12s %4dm%02ds\n' "total" $((secs / 60)) $((secs % 60))
    # libtest's --report-time lines: `test NAME ... ok <12.345s>`.
    log "the five slowest tests"
    sed -nE 's/^test (.*) \.\.\. [a-zA-Z]+ <([0-9.]+)s>$/\2 \1/p' "$results" |
      sort -rn | head -5 | awk '{ printf "  %8.1fs  %s\n", $1, $2 }'
    # cargo's `test result:` lines of every phase, summed into one closing line.
    awk '/^test result:/ { p += $4; f += $6 } END { printf "tests: %d passed, %d failed\n", p, f }' \
      "$results"
  } >&2
  rm -f "$results"
}
trap summary EXIT

# Runs `cargo test ARGS` and keeps its output for the summary. The test binaries run with
# libtest's --report-time (an unstable libtest flag: RUSTC_BOOTSTRAP is set for the test
# processes alone, through cargo's runner, so no crate's fingerprint changes).
cargo_test() {
  CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="env RUSTC_BOOTSTRAP=1" \
    cargo_env cargo test --release --locked "$@" 2>&1 | tee -a "$results"
}

phase setup
ensure_venv
ensure_assets
ensure_mlflow
ensure_java
ensure_object_stores
cd "$LAKEML_ROOT"
phase fmt
log "cargo fmt --check"
cargo fmt --check
phase clippy
log "cargo clippy"
cargo_env cargo clippy --release --locked --all-targets -- -D warnings
phase build
log "cargo build (the binary and the test binaries)"
cargo_env cargo test --release --locked --no-run
phase unit
log "unit tests"
cargo_test --lib --bins -- --test-threads=2 -Z unstable-options --report-time
cargo_test --doc
phase integration
log "integration tests"
cargo_test --test it -- --test-threads=2 -Z unstable-options --report-time
