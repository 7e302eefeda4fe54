#!/usr/bin/env bash
# Benchmarks against the HF stack, both sides in the same run:
#   scripts/bench.sh tokenize [args]   lakeml tokenize vs datasets.map (benches/bench_tokenize.py)
#   scripts/bench.sh train [args]      lakeml train vs HF Trainer, and vs HF with the MKL override
#                                      preloaded (benches/bench_train.py; --precision fp32|bf16|both,
#                                      --repeat N, --limit N, --side, --out FILE; --nproc N adds
#                                      N-rank lakeml against HF DDP under torchrun, and the
#                                      gradient all-reduce against torch.distributed's)
#   scripts/bench.sh predict [args]    lakeml predict (fp32, bf16, int8) vs HF pipeline,
#                                      Trainer.predict, careful PyTorch (+ MKL override) and ONNX
#                                      Runtime (benches/bench_predict.py; --precision
#                                      fp32|bf16|int8|both|all, --repeats N, --rows N, --model DIR,
#                                      --side, --out FILE)
#   scripts/bench.sh serve [args]      pipeline serve (Flight SQL, DoExchange, 1/4/16 clients) vs
#                                      the predict stage (benches/bench_serve.py; --precision
#                                      fp32|bf16, --repeats N, --rows N, --model DIR, --out FILE)
#   scripts/bench.sh embed [args]      lakeml embed (fp32, bf16, int8) vs sentence-transformers (+ MKL
#                                      override) and ONNX Runtime, table -> vectors; and exact top-10
#                                      search over 1M vectors: pipeline serve (SQL) vs faiss and numpy
#                                      (benches/bench_embed.py; --part throughput|search|all,
#                                      --precision, --repeats N, --rows N, --vectors N, --threads N,
#                                      --side, --out FILE)
#   scripts/bench.sh spark [args]      Spark local[2] + one `pipeline serve` worker (lakeml_spark), and
#                                      + the executor's own worker (no endpoints), vs
#                                      the predict stage and vs a Spark pandas UDF over transformers,
#                                      plus the scaling model's inputs (benches/bench_spark.py;
#                                      --precision, --repeats N, --rows N, --threads N, --partitions N,
#                                      --side all|stage|lakeml|hf|model, --out FILE); needs Java 17
#   scripts/bench.sh storage [args]    a >= 1 GB Delta table on S3 (moto_server, 127.0.0.1) vs the
#                                      same on local disk: full scan and the predict stage over the
#                                      same rows, requests per phase (benches/bench_storage.py;
#                                      --copies N, --predict-rows N, --repeats N, --out FILE)
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ensure_venv
ensure_assets
ensure_build
export LAKEML_BIN
what="${1:-tokenize}"
shift || true
case "$what" in
  tokenize)
    core="$(cd "$LAKEML_ROOT" && cargo_env cargo bench --locked --bench tokenize --no-run \
      --message-format=json | "$LAKEML_PYTHON" -c 'import json, sys
exes = [m["executable"] for m in map(json.loads, sys.stdin)
        if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "tokenize"]
print(exes[-1])')"
    exec "$LAKEML_PYTHON" "$LAKEML_ROOT/benches/bench_tokenize.py" --bin "$LAKEML_BIN" --core "$core" "$@" ;;
  train) exec "$LAKEML_PYTHON" "$LAKEML_ROOT/benches/bench_train.py" --bin "$LAKEML_BIN" "$@" ;;
  predict) exec "$LAKEML_PYTHON" "$LAKEML_ROOT/benches/bench_predict.py" --bin "$LAKEML_BIN" "$@" ;;
  serve) exec "$LAKEML_PYTHON" "$LAKEML_ROOT/benches/bench_serve.py" --bin "$LAKEML_BIN" "$@" ;;
  embed) exec "$LAKEML_PYTHON" "$LAKEML_ROOT/benches/bench_embed.py" --bin "$LAKEML_BIN" "$@" ;;
  storage)
    ensure_object_stores
    exec "$LAKEML_PYTHON" "$LAKEML_ROOT/benches/bench_storage.py" --bin "$LAKEML_BIN" "$@" ;;
  spark)
    ensure_java
    exec "$LAKEML_PYTHON" "$LAKEML_ROOT/benches/bench_spark.py" --bin "$LAKEML_BIN" "$@" ;;
  *) echo "unknown benchmark '$what' (known: tokenize, train, predict, serve, embed, spark, storage)" >&2; exit 2 ;;
esac
