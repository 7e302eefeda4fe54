#!/usr/bin/env bash
# Benchmarks against the HF stack, both sides in the same run: `scripts/bench.sh tokenize`.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ensure_venv
ensure_assets
ensure_build
core="$(cd "$LAKEML_ROOT" && cargo_env cargo bench --locked --bench tokenize --no-run \
  --message-format=json | "$LAKEML_PYTHON" -c 'import json, sys
exes = [m["executable"] for m in map(json.loads, sys.stdin)
        if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "tokenize"]
print(exes[-1])')"
what="${1:-tokenize}"
shift || true
case "$what" in
  tokenize) exec "$LAKEML_PYTHON" "$LAKEML_ROOT/benches/bench_tokenize.py" --bin "$LAKEML_BIN" --core "$core" "$@" ;;
  *) echo "unknown benchmark '$what' (known: tokenize)" >&2; exit 2 ;;
esac
