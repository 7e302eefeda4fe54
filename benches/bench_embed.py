"""Embedding benchmark: lakeml's embed stage and its exact vector search against the CPU peers.

Run with `scripts/bench.sh embed` (builds lakeml, installs the peers, then calls this);
`--part throughput|search|all` (default all), `--precision fp32|bf16|int8|both|all` (default
all; both = fp32 and bf16), `--repeats N` (default 3, medians), `--rows N` (a fixed sample of
N reviews, for quick runs; default all 12,808), `--vectors N` (rows of the search table,
default 1,000,000), `--side all|SIDE[,SIDE...]` (keys of SIDES and SEARCH_SIDES below; lakeml
is in both parts), `--threads N`, `--out FILE` (a JSON summary), `--keep`.

Part 1, throughput: embedding every review of a Delta table, table in, table of vectors out
(id, embedding list<float32>). The model: all-MiniLM-L6-v2 as sentence-transformers ships it
(modules.json: Transformer, mean pooling, Normalize; sentence_bert_config.json's
max_seq_length 256), made once in the work dir from the bundled weights, not timed. Per side
and precision: rows/s over the child process's whole wall time (start-up, imports, model
load, read, tokenize, forward passes, pooling, write), the in-process seconds, the forward
passes alone where the side reports them, peak RSS, and MFU (the model's FLOPs over the real
tokens, truncated at 256, per second of wall time, over the GEMM peak at that precision that
`pipeline info --json` measures here). The sides:
- lakeml (fp32, bf16, int8): the embed stage of benches/pipelines/embed.yaml, its defaults
  on CPU (rows sorted by length, 4096 padded tokens per forward pass). On a CPU without int8
  (or bf16) dot products lakeml runs that precision as fp32 (or bf16), warns, and its stage
  report says which ran; the table names the side "lakeml (ran fp32)" and prints the warning.
- st (fp32, bf16): sentence-transformers `SentenceTransformer(dir, device="cpu")` and
  `encode(texts, batch_size=64, convert_to_numpy=True)`, which sorts rows by length itself;
  bf16 by `model_kwargs={"dtype": torch.bfloat16}` (the weights loaded in bf16, as its docs
  say to: its `torch_dtype`/`dtype` model kwarg).
- st_mkl (fp32, bf16): the same with MKL's CPU check overridden (LD_PRELOAD) and glibc
  keeping freed memory for reuse (measure.TUNED_MALLOC): the HF stack's best configuration.
- ort (fp32, int8): ONNX Runtime over the encoder exported by `torch.onnx.export` (AutoModel,
  `last_hidden_state`), int8 by `quantize_dynamic` (QInt8 weights, per channel), rows sorted
  by length in batches of 64 truncated at 256, mean pooling over the attention mask and L2
  normalization in numpy, with the same malloc tuning.
Every side's vectors are compared with lakeml's at fp32, by id: per-row cosine, min and mean.

Part 2, search: exact top-10 by cosine over N vectors of 384 dims (float32): the reviews'
lakeml fp32 embeddings replicated to N rows with seeded Gaussian noise (sigma 0.02 per
component, renormalized), written once as a Delta table `vectors` (id, embedding), not timed.
20 queries: the unperturbed embeddings of 20 reviews (a seeded choice). Per side, the median
latency of a query (each timed alone, one after another), and the memory bandwidth that
reaches (N x 384 x 4 bytes over the latency), against numpy's read bandwidth of the same
matrix (`X.sum()`, one thread and --threads threads, best of 3). The sides:
- faiss: `IndexFlatIP` with every vector added (not timed), `omp_set_num_threads(threads)`,
  `index.search(q[None], 10)` per query;
- numpy: `scores = X @ q`, `argpartition` for the 10 best, those 10 sorted;
- lakeml: `pipeline serve benches/pipelines/search.yaml` holding `vectors` in memory
  (started, loaded and waited for untimed), `SELECT id FROM vectors ORDER BY
  cosine_distance(embedding, [q...]) LIMIT 10` through ADBC's Flight SQL driver, the query
  vector as an array literal; the first query is run once untimed as a warm-up. Its clock
  holds what a client sees: planning, the scan, and the round trip over loopback gRPC.
lakeml's and numpy's top-10 ids are checked against faiss's for every query.

Why it is fair:
- Same input, same model: lakeml writes the reviews table once (benches/pipelines/
  predict_input.yaml, not timed); every throughput side reads it and the same model
  directory, and writes one Delta table. Every search side reads the same vectors table.
- Same work: every row, truncation at 256 tokens, mean pooling and L2 normalization on every
  side, the same precision (fp32; bf16 weights and activations; int8 weights with dynamic
  int8 activations). Search: the same exact scan of every vector (no index, no
  approximation), the same k, results checked equal.
- Same cores: each side runs in its own child process on the same machine, one after the
  other (interleaved when repeated, the order reversed on odd repeats), with the same
  intra-op thread count (lakeml's `threads`, `torch.set_num_threads`, ORT's
  intra_op_num_threads, faiss's OpenMP threads, OMP_NUM_THREADS / MKL_NUM_THREADS /
  OPENBLAS_NUM_THREADS for all; the server is pinned to --threads cores when that is fewer
  than all, as DataFusion runs one partition per core); peak RSS comes from wait4 on that
  child. The search client runs on the same cores as the server. The driver stays small (its
  set-up work runs in children too), as a child's peak RSS counts its parent's at the fork.
- In-process seconds: lakeml's embed stage report (model load -> vectors committed); on the
  peers, from after the imports to the Delta table written. `encode s`: the encode call, or
  the ORT batches with their pooling.
"""
import argparse
import json
import os
import pathlib
import re
import shutil
import statistics
import sys
import time

from bench_predict import LAKEML_SIDES, export_onnx, lakeml_side, model_flops, ort_session, sorted_batches
from bench_serve import Server, adbc_connect
from measure import (RESULT, SideFailed, gemm_peaks, medians, mkl_override_lib, peer_env, peer_result,
                     run_measured, tail, work_dir)

BATCH_SIZE = 64
MAX_LENGTH = 256  # all-MiniLM-L6-v2's max_seq_length (sentence_bert_config.json)
SIDES = {"lakeml": "lakeml", "st": "sentence-transformers", "st_mkl": "ST + MKL, malloc",
         "ort": "ONNX Runtime"}
PRECISIONS = {"lakeml": ("fp32", "bf16", "int8"), "st": ("fp32", "bf16"), "st_mkl": ("fp32", "bf16"),
              "ort": ("fp32", "int8")}
SEARCH_SIDES = {"faiss": "faiss IndexFlatIP", "numpy": "numpy X @ q", "lakeml": "lakeml serve (SQL)"}
K = 10
QUERIES = 20
NOISE = 0.02  # per-component sigma of the replicated vectors' noise
SEED = 17
CHUNK = 65536  # rows per batch written to (and generated for) the vectors table


# --- the model (made once, not timed) --------------------------------------------------------

def make_st_model(minilm: pathlib.Path, out: pathlib.Path) -> None:
    """all-MiniLM-L6-v2 as sentence-transformers ships it: the bundled weights and tokenizer
    (links) plus modules.json (Transformer, Pooling, Normalize), mean pooling and max_seq_length
    256, so that every side pools, normalizes and truncates the same way."""
    (out / "1_Pooling").mkdir(parents=True)
    (out / "2_Normalize").mkdir()
    for f in minilm.iterdir():
        if f.is_file():
            (out / f.name).symlink_to(f.resolve())
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    hidden = json.loads((minilm / "config.json").read_text())["hidden_size"]
    pooling = {"word_embedding_dimension": hidden, "pooling_mode_cls_token": False,
               "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
               "pooling_mode_lasttoken": False, "include_prompt": True}
    (out / "1_Pooling/config.json").write_text(json.dumps(pooling, indent=2))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_LENGTH,
                                                                "do_lower_case": False}))


# --- Delta tables of vectors -----------------------------------------------------------------

def vectors_table(ids, matrix):
    """(id, embedding list<float32>) as an Arrow table, from ids and an (n, d) float32 matrix."""
    import numpy as np
    import pyarrow as pa

    n, d = matrix.shape
    offsets = pa.array(np.arange(0, n * d + 1, d, dtype=np.int32))
    values = pa.array(np.ascontiguousarray(matrix, dtype=np.float32).reshape(-1))
    return pa.table({"id": pa.array(ids, pa.int64()), "embedding": pa.ListArray.from_arrays(offsets, values)})


def read_vectors(path: str):
    """A Delta table's (id, embedding) as ids (int64) and an (n, d) float32 matrix, sorted by id."""
    import deltalake
    import numpy as np

    table = deltalake.DeltaTable(path).to_pyarrow_table(columns=["id", "embedding"])
    ids = table.column("id").to_numpy()
    chunks = [c.flatten().to_numpy(zero_copy_only=False) for c in table.column("embedding").chunks]
    del table
    x = np.concatenate(chunks).astype(np.float32, copy=False) if chunks else np.zeros(0, np.float32)
    del chunks
    x = x.reshape(len(ids), -1) if len(ids) else x.reshape(0, 0)
    if len(ids) > 1 and not (np.diff(ids) > 0).all():  # the files came back out of order
        order = np.argsort(ids, kind="stable")
        ids, x = ids[order], x[order]
    return ids, x


# --- peer sides of part 1 (child processes) --------------------------------------------------

def peer_child(kind: str, source: str, model: str, precision: str, threads: int, dest: str) -> None:
    """Child process: one peer side, Delta table in, Delta table of (id, embedding) out."""
    import torch

    torch.set_num_threads(threads)
    import deltalake
    import numpy as np
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    extra = {}
    started = time.perf_counter()
    table = deltalake.DeltaTable(source).to_pyarrow_table(columns=["id", "text"])
    texts = table.column("text").to_pylist()
    if kind == "ort":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        session = ort_session(precision, threads)
        vectors = [None] * len(texts)
        t0 = time.perf_counter()
        for rows, b in sorted_batches(tok, texts, MAX_LENGTH):
            mask = b["attention_mask"].astype(np.int64)
            states = session.run(None, {"input_ids": b["input_ids"].astype(np.int64), "attention_mask": mask})[0]
            m = mask[:, :, None].astype(np.float32)
            pooled = (states * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
            pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
            for r, v in zip(rows, pooled):
                vectors[r] = v
        encode_s = time.perf_counter() - t0
        matrix = np.stack(vectors).astype(np.float32)
        import onnxruntime

        extra["onnxruntime"] = onnxruntime.__version__
    else:
        from sentence_transformers import SentenceTransformer

        kwargs = {"model_kwargs": {"dtype": torch.bfloat16}} if precision == "bf16" else {}
        st = SentenceTransformer(model, device="cpu", **kwargs)
        t0 = time.perf_counter()
        matrix = st.encode(texts, batch_size=BATCH_SIZE, convert_to_numpy=True, show_progress_bar=False)
        encode_s = time.perf_counter() - t0
        matrix = np.asarray(matrix, dtype=np.float32)
        extra |= {"model_dtype": str(st.dtype), "max_seq_length": st.max_seq_length,
                  "mkl_override": "LD_PRELOAD" in os.environ}
    deltalake.write_deltalake(dest, vectors_table(table.column("id").to_numpy(), matrix), mode="overwrite")
    stage_s = time.perf_counter() - started
    print(RESULT + json.dumps({"rows": table.num_rows, "stage_s": stage_s, "predict_s": encode_s,
                               "threads": torch.get_num_threads(), **extra}), flush=True)


def peer_side(kind: str, source: str, model: str, precision: str, threads: int, dest: str, env: dict) -> dict:
    mkl = kind == "st_mkl"
    r = run_measured([sys.executable, __file__, "--child", "st" if mkl else kind, source, model, precision,
                      str(threads), dest], peer_env(env, mkl, tuned=kind == "ort"))
    return {"side": kind, "precision": precision, **peer_result(r, f"{SIDES[kind]} ({precision})", mkl)}


def quality(reference: str, other: str) -> dict:
    """Per-row cosine of the other table's vectors with the reference's, matched by id."""
    import numpy as np

    ids_a, a = read_vectors(reference)
    ids_b, b = read_vectors(other)
    common, ia, ib = np.intersect1d(ids_a, ids_b, assume_unique=True, return_indices=True)
    x, y = a[ia].astype(np.float64), b[ib].astype(np.float64)
    cos = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
    return {"rows": len(ids_a), "other_rows": len(ids_b), "missing": len(ids_a) - len(common),
            "min_cosine": float(cos.min()) if len(cos) else float("nan"),
            "mean_cosine": float(cos.mean()) if len(cos) else float("nan"),
            "dims": int(b.shape[1]) if b.ndim == 2 else 0}


# --- part 1 driver -----------------------------------------------------------------------------

def throughput(args, root: pathlib.Path, precisions: list[str], sides: list[str], work: pathlib.Path,
               env: dict, source: str, rows: int, model: str) -> dict:
    if "ort" in sides:
        env["LAKEML_BENCH_ONNX"] = str(work / "onnx")
        made = run_measured([sys.executable, __file__, "--export-onnx", model, env["LAKEML_BENCH_ONNX"]], env)
        if made["rc"] != 0:
            sys.exit(f"exporting the encoder to ONNX failed:\n{tail(made['stderr'])}")
    if "st_mkl" in sides:
        env["LAKEML_BENCH_MKL_OVERRIDE"] = mkl_override_lib(work)
    peaks = gemm_peaks(args.bin, env)
    lengths = helper("lengths", env, source=source, model=model)
    flops = model_flops(model, lengths)
    print(f"model FLOPs over the {rows:,} rows ({sum(lengths):,} tokens, truncated at {MAX_LENGTH}): "
          f"{flops / 1e12:.2f} TFLOP; GEMM peaks here (pipeline info): "
          + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()), flush=True)
    yaml = str(root / "benches/pipelines/embed.yaml")
    if "lakeml" in sides:
        check = run_measured([args.bin, "validate", yaml], env)
        if check["rc"] != 0:
            sys.exit(f"lakeml side: `{args.bin} validate {yaml}` failed:\n{tail(check['stderr'] + check['stdout'])}")

    runs = []
    try:
        for i in range(args.repeats):
            for p in precisions:
                for s in (sides if i % 2 == 0 else sides[::-1]):
                    if p not in PRECISIONS[s]:
                        continue
                    if s in LAKEML_SIDES:
                        r = lakeml_side(args.bin, yaml, p, env, side=s, kind="embed")
                        # What the model ran at: a CPU without bf16 or int8 dot products
                        # runs fp32 instead (the run warns, the report says).
                        if r["report"].get("precision", p) != p:
                            r["precision_used"] = r["report"]["precision"]
                    else:
                        shutil.rmtree(emb_dest(work, s, p), ignore_errors=True)
                        r = peer_side(s, source, model, p, args.threads, emb_dest(work, s, p), env)
                    if r["rows"] != rows:
                        raise SideFailed(f"{SIDES[s]} ({p}) embedded {r['rows']} rows of {rows}")
                    runs.append(r)
                    print(f"  run {i + 1} {SIDES[s]:23} {p}: {rows / r['wall_s']:8.1f} rows/s, "
                          f"{r['wall_s']:.2f} s wall, {r['stage_s']:.2f} s in-process, "
                          f"{r['rss_mib']:,.0f} MiB", flush=True)
    except SideFailed as e:
        sys.exit(f"\n{e}")

    # Every side's vectors against lakeml's at fp32 (or at the same precision without fp32).
    pairs = {}
    if "lakeml" in sides:
        for p in precisions:
            ref = emb_dest(work, "lakeml", "fp32" if "fp32" in precisions else p)
            for s in sides:
                if p in PRECISIONS[s] and emb_dest(work, s, p) != ref:
                    pairs[f"{s}/{p}"] = [ref, emb_dest(work, s, p)]
    qual = helper("quality", env, pairs=pairs) if pairs else {}
    print()
    print("cos min / mean: per-row cosine of each side's vectors with lakeml's at "
          + ("fp32" if "fp32" in precisions else "the same precision") + ", by id; MFU at the precision run")
    summary = summarize(runs, sides, precisions, qual, rows, args, flops, peaks)
    warnings = sorted({w for r in runs for w in r.get("warnings", [])})
    for w in warnings:
        print(w)
    return {"gemm_peaks": peaks, "model_tflop": flops / 1e12, "tokens": sum(lengths), "runs": runs,
            "lakeml_warnings": warnings, **summary}


def emb_dest(work: pathlib.Path, side: str, precision: str) -> str:
    return str(work / f"emb-{side}-{precision}")  # embed.yaml's output table for the lakeml side


def summarize(runs: list[dict], sides: list[str], precisions: list[str], qual: dict, rows: int,
              args, flops: float, peaks: dict) -> dict:
    med = medians(runs, sides, precisions, rows, flops, peaks)  # `predict_s`: the encode seconds
    compare = {}
    for p in precisions:
        print()
        print(f"{p}: {rows:,} rows, table -> table of vectors, {args.threads} intra-op threads per side "
              f"(os.cpu_count() = {os.cpu_count()}); medians of {args.repeats}; GEMM peak here "
              f"{peaks.get(p, float('nan')):.0f} G{'OP' if p == 'int8' else 'FLOP'}/s")
        print(f"{'side':24}{'rows/s':>9}{'wall s':>9}{'in-proc s':>11}{'encode s':>10}"
              f"{'peak RSS MiB':>14}{'cos min':>10}{'cos mean':>10}{'MFU':>8}")
        for s in sides:
            m = med.get(f"{s}/{p}")
            if not m:
                continue
            enc = f"{m['predict_s']:10.2f}" if m["predict_s"] is not None else f"{'-':>10}"
            q = qual.get(f"{s}/{p}")
            if (s, p) == ("lakeml", "fp32"):
                cmin, cmean = "(ref)", "(ref)"
            else:
                cmin, cmean = (f"{q['min_cosine']:.6f}", f"{q['mean_cosine']:.6f}") if q else ("-", "-")
            mfu = f"{m['mfu']:8.1%}" if m["mfu"] is not None else f"{'-':>8}"
            name = SIDES[s] if m["precision_used"] == p else f"{SIDES[s]} (ran {m['precision_used']})"
            print(f"{name:24}{m['rows_per_s']:9.1f}{m['wall_s']:9.2f}{m['stage_s']:11.2f}{enc}"
                  f"{m['rss_mib']:14,.0f}{cmin:>10}{cmean:>10}{mfu}")
        lk = med.get(f"lakeml/{p}")
        peers = {s: med[f"{s}/{p}"] for s in sides if s not in LAKEML_SIDES and f"{s}/{p}" in med}
        if lk and peers:
            fastest = max(peers, key=lambda s: peers[s]["rows_per_s"])
            compare[p] = ({f"lakeml/{s}": lk["rows_per_s"] / m["rows_per_s"] for s, m in peers.items()}
                          | {"lakeml/fastest_peer": lk["rows_per_s"] / peers[fastest]["rows_per_s"],
                             "fastest_peer": fastest})
            print("rows/s (wall): " + "; ".join(f"lakeml / {SIDES[s]} {lk['rows_per_s'] / m['rows_per_s']:.2f}x"
                                                 for s, m in peers.items())
                  + f"; lakeml / fastest peer ({SIDES[fastest]}) {lk['rows_per_s'] / peers[fastest]['rows_per_s']:.2f}x")
        for s in sides:
            q = qual.get(f"{s}/{p}")
            if q and (q["missing"] or q["other_rows"] != q["rows"]):
                print(f"WARNING: {SIDES[s]} wrote {q['other_rows']} rows, lakeml {q['rows']} "
                      f"({q['missing']} of lakeml's ids missing)")
    return {"medians": med, "compare": compare, "quality": qual}


# --- part 2: search sides (child processes) --------------------------------------------------

def load_matrix(path: str):
    """The vectors table as one (N, d) float32 matrix, row i = id i (ids are 0..N-1)."""
    ids, x = read_vectors(path)
    if len(ids) and (ids[0] != 0 or ids[-1] != len(ids) - 1):
        raise SystemExit(f"{path}: ids are not 0..N-1")
    return x


def search_child(kind: str, spec_path: str) -> None:
    """Child process: one search side over the vectors table; prints the per-query latencies
    (ms, each query timed alone) and top-k ids."""
    import numpy as np

    spec = json.loads(pathlib.Path(spec_path).read_text())
    queries = np.load(spec["queries"])
    threads = spec["threads"]
    extra = {}
    latencies, tops = [], []
    if kind == "lakeml":
        conn = adbc_connect(spec["uri"], 600)
        cur = conn.cursor()

        def sql(q):
            literal = ", ".join(np.format_float_positional(v, unique=True, trim="0") for v in q)
            return f"SELECT id FROM vectors ORDER BY cosine_distance(embedding, [{literal}]) LIMIT {K}"

        cur.execute(sql(queries[0]))  # warm-up, untimed
        cur.fetchall()
        for q in queries:
            text = sql(q)
            t0 = time.perf_counter()
            cur.execute(text)
            got = cur.fetchall()
            latencies.append((time.perf_counter() - t0) * 1e3)
            tops.append([int(r[0]) for r in got])
        cur.close()
        conn.close()
    else:
        x = load_matrix(spec["vectors"])
        if kind == "faiss":
            import faiss

            faiss.omp_set_num_threads(threads)
            index = faiss.IndexFlatIP(x.shape[1])
            index.add(x)
            del x
            extra["faiss"] = faiss.__version__
            for q in queries:
                t0 = time.perf_counter()
                _, idx = index.search(q[None], K)
                latencies.append((time.perf_counter() - t0) * 1e3)
                tops.append([int(i) for i in idx[0]])
        else:
            for q in queries:
                t0 = time.perf_counter()
                scores = x @ q
                best = np.argpartition(-scores, K)[:K]
                best = best[np.argsort(-scores[best])]
                latencies.append((time.perf_counter() - t0) * 1e3)
                tops.append([int(i) for i in best])
            extra["read_gbps"] = read_bandwidth(x, threads)
    print(RESULT + json.dumps({"latencies_ms": latencies, "tops": tops, **extra}), flush=True)


def read_bandwidth(x, threads: int) -> dict:
    """numpy's read bandwidth over the matrix (GB/s): `x.sum()` on one thread, and row slices
    summed on `threads` threads at once (numpy releases the GIL in the reduction); best of 3."""
    from concurrent.futures import ThreadPoolExecutor

    out = {}
    slices = [x[i * len(x) // threads:(i + 1) * len(x) // threads] for i in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        for name, fn in (("1", lambda: x.sum()),
                         (str(threads), lambda: sum(pool.map(lambda s: s.sum(), slices)))):
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            out[name] = x.nbytes / best / 1e9
    return out


def search_side(kind: str, spec: dict, work: pathlib.Path, env: dict, args) -> dict:
    spec_path = work / f"search-{kind}.json"
    server = None
    try:
        if kind == "lakeml":
            server = Server(args.bin, spec["yaml"], env, work / "search-server")
            if args.threads < os.cpu_count():  # DataFusion plans one partition per core it may use
                server.cmd = ["taskset", "-c", f"0-{args.threads - 1}"] + server.cmd
            server.__enter__()
            spec = dict(spec, uri=server.uri)
        spec_path.write_text(json.dumps(spec))
        r = run_measured([sys.executable, __file__, "--search-child", kind, str(spec_path)], env)
    finally:
        if server is not None:
            server.stop()
    lines = [x for x in r["stdout"].splitlines() if x.startswith(RESULT)]
    if r["rc"] != 0 or not lines:
        raise SideFailed(f"{SEARCH_SIDES[kind]} exited {r['rc']}:\n{tail(r['stderr'] + r['stdout'])}"
                         + (f"\nserver log:\n{server.log_tail(10)}" if server else ""))
    out = json.loads(lines[-1][len(RESULT):])
    res = {"side": kind, **out, "median_ms": statistics.median(out["latencies_ms"]),
           "rss_mib": r["rss_mib"], "wall_s": r["wall"]}
    if server is not None:
        loaded = re.search(r"table `vectors` in memory: ([^\n]*)", server.log_tail(1000))
        res |= {"server_rss_mib": server.rss_mib, "server_ready_s": server.ready_s, "server_rc": server.rc,
                "server_memory": loaded.group(1) if loaded else None}
    return res


def write_vectors(base, n: int, path: str) -> None:
    """`base` (the reviews' vectors) replicated to n rows, row i from base[i % len(base)] plus
    seeded Gaussian noise, renormalized; written in chunks as one Delta commit."""
    import deltalake
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(SEED)

    def batches():
        for start in range(0, n, CHUNK):
            ids = np.arange(start, min(n, start + CHUNK), dtype=np.int64)
            x = base[ids % len(base)] + rng.normal(0.0, NOISE, (len(ids), base.shape[1])).astype(np.float32)
            x /= np.linalg.norm(x, axis=1, keepdims=True)
            yield from vectors_table(ids, x).to_batches()

    schema = pa.schema([("id", pa.int64()), ("embedding", pa.list_(pa.float32()))])
    deltalake.write_deltalake(path, pa.RecordBatchReader.from_batches(schema, batches()), mode="overwrite")


def search(args, root: pathlib.Path, sides: list[str], work: pathlib.Path, env: dict) -> dict:
    ref = emb_dest(work, "lakeml", "fp32")
    if not os.path.exists(ref):  # part 1 did not run lakeml fp32: once, not timed
        try:
            lakeml_side(args.bin, str(root / "benches/pipelines/embed.yaml"), "fp32", env, kind="embed")
        except SideFailed as e:
            sys.exit(f"embedding the reviews for the search vectors failed: {e}")
    t0 = time.perf_counter()
    made = helper("vectors", env, ref=ref, n=args.vectors, out=str(work / "vectors"), queries=str(work / "queries.npy"))
    d = made["dims"]
    print(f"\nsearch: {args.vectors:,} vectors of {d} dims ({args.vectors * d * 4 / 1e9:.2f} GB as float32) "
          f"from the {made['base_rows']:,} reviews' lakeml fp32 vectors plus noise (sigma {NOISE}), written in "
          f"{time.perf_counter() - t0:.1f} s to {work / 'vectors'}; {made['queries']} queries: reviews' "
          f"vectors without noise", flush=True)
    spec = {"vectors": str(work / "vectors"), "queries": str(work / "queries.npy"), "threads": args.threads,
            "yaml": str(root / "benches/pipelines/search.yaml")}
    if "lakeml" in sides:
        check = run_measured([args.bin, "validate", spec["yaml"]], env)
        if check["rc"] != 0:
            sys.exit(f"lakeml side: `{args.bin} validate {spec['yaml']}` failed:\n"
                     f"{tail(check['stderr'] + check['stdout'])}")
    runs = []
    try:
        for i in range(args.repeats):
            for s in (sides if i % 2 == 0 else sides[::-1]):
                r = search_side(s, spec, work, env, args)
                runs.append(r)
                print(f"  run {i + 1} {SEARCH_SIDES[s]:20}: median {r['median_ms']:8.2f} ms over "
                      f"{len(r['latencies_ms'])} queries, {r['rss_mib']:,.0f} MiB"
                      + (f" (server {r['server_rss_mib']:,.0f} MiB, ready in {r['server_ready_s']:.1f} s; "
                         f"in memory: {r['server_memory'] or 'no'})" if "server_rss_mib" in r else ""), flush=True)
    except SideFailed as e:
        sys.exit(f"\n{e}")

    nbytes = args.vectors * d * 4
    med = {}
    for s in sides:
        xs = [r for r in runs if r["side"] == s]
        m = statistics.median(r["median_ms"] for r in xs)
        med[s] = {"median_ms": m, "min_ms": min(min(r["latencies_ms"]) for r in xs),
                  "gbps": nbytes / (m / 1e3) / 1e9, "rss_mib": statistics.median(r["rss_mib"] for r in xs)}
        if "server_rss_mib" in xs[0]:
            med[s]["server_rss_mib"] = statistics.median(r["server_rss_mib"] for r in xs)
    bw = {}
    for r in runs:
        for k, v in r.get("read_gbps", {}).items():
            bw[k] = max(bw.get(k, 0.0), v)
    # Top-k agreement with faiss, query by query (from the last run of each side).
    last = {r["side"]: r for r in runs}
    agree = {}
    if "faiss" in last:
        for s in sides:
            if s != "faiss":
                pairs = list(zip(last[s]["tops"], last["faiss"]["tops"]))
                agree[s] = {"queries": len(pairs), "ids_differ": sum(a != b for a, b in pairs),
                            "sets_differ": sum(set(a) != set(b) for a, b in pairs)}
    print()
    print(f"exact top-{K} by cosine over {args.vectors:,} x {d} float32 ({nbytes / 1e9:.2f} GB), "
          f"{len(last[sides[0]]['latencies_ms'])} queries each timed alone, {args.threads} threads per side; "
          f"medians of {args.repeats}")
    print(f"{'side':22}{'median ms':>11}{'min ms':>9}{'GB/s':>8}{'RSS MiB':>10}{'server MiB':>12}"
          f"{f'top-{K} != faiss':>17}")
    for s in sides:
        m = med[s]
        a = agree.get(s)
        diff = "(ref)" if s == "faiss" else (f"{a['ids_differ']} of {a['queries']}" if a else "-")
        server = f"{m['server_rss_mib']:12,.0f}" if "server_rss_mib" in m else f"{'-':>12}"
        print(f"{SEARCH_SIDES[s]:22}{m['median_ms']:11.2f}{m['min_ms']:9.2f}{m['gbps']:8.2f}{m['rss_mib']:10,.0f}"
              f"{server}{diff:>17}")
    print("RSS: the side's process (for lakeml, the Flight SQL client); server: `pipeline serve`'s peak RSS")
    if bw:
        print("memory read bandwidth here (numpy sum over the same matrix, best of 3): "
              + ", ".join(f"{v:.2f} GB/s on {k} thread{'s' if k != '1' else ''}" for k, v in bw.items()))
    compare = {}
    if "lakeml" in med:
        for s in ("faiss", "numpy"):
            if s in med:
                compare[f"lakeml/{s}"] = med["lakeml"]["median_ms"] / med[s]["median_ms"]
        if compare:
            print("latency: " + "; ".join(f"{k.replace('/', ' / ')} {v:.2f}x" for k, v in compare.items())
                  + " (above 1: lakeml slower)")
    for s, a in agree.items():
        if a["ids_differ"]:
            print(f"WARNING: {SEARCH_SIDES[s]}: {a['ids_differ']} of {a['queries']} queries' top-{K} ids differ "
                  f"from faiss's ({a['sets_differ']} as sets)")
    return {"vectors": args.vectors, "dims": d, "queries": made["queries"], "noise_sigma": NOISE, "medians": med,
            "compare": compare, "agreement_with_faiss": agree, "read_gbps": bw,
            "runs": [{k: v for k, v in r.items() if k != "tops"} for r in runs]}


# --- helpers: the driver's heavy lifting, in child processes --------------------------------------
# A child's peak RSS (wait4) counts its parent's peak at the fork too (Linux carries the old
# memory map's high-water mark over exec), so the driver stays small: whatever would grow it
# (transformers, matrices of vectors) runs in one of these children, none of them timed.

def driver_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def helper(name: str, env: dict, **kw):
    r = run_measured([sys.executable, __file__, "--helper", name, json.dumps(kw)], env)
    lines = [x for x in r["stdout"].splitlines() if x.startswith(RESULT)]
    if r["rc"] != 0 or not lines:
        sys.exit(f"{name} (a set-up step, not timed) failed:\n{tail(r['stderr'] + r['stdout'])}")
    return json.loads(lines[-1][len(RESULT):])


def run_helper(name: str, kw: dict) -> None:
    if name == "lengths":  # token lengths of every row, truncated at MAX_LENGTH, for the FLOPs
        import deltalake
        from transformers import AutoTokenizer

        texts = deltalake.DeltaTable(kw["source"]).to_pyarrow_table(columns=["text"]).column("text").to_pylist()
        enc = AutoTokenizer.from_pretrained(kw["model"])(texts, truncation=True, max_length=MAX_LENGTH)
        out = [len(x) for x in enc["input_ids"]]
    elif name == "quality":
        out = {key: quality(ref, other) for key, (ref, other) in kw["pairs"].items()}
    else:  # vectors: the search table and its queries
        import numpy as np

        _, base = read_vectors(kw["ref"])
        write_vectors(base, kw["n"], kw["out"])
        choice = np.random.default_rng(SEED + 1).choice(len(base), size=min(QUERIES, len(base)), replace=False)
        np.save(kw["queries"], base[np.sort(choice)])
        out = {"dims": int(base.shape[1]), "base_rows": len(base), "queries": len(choice)}
    print(RESULT + json.dumps(out), flush=True)


# --- main ----------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.environ.get("LAKEML_BIN"), help="the pipeline binary (default $LAKEML_BIN)")
    ap.add_argument("--part", choices=["throughput", "search", "all"], default="all")
    ap.add_argument("--precision", choices=["fp32", "bf16", "int8", "both", "all"], default="all",
                    help="part 1; both: fp32 and bf16; all: fp32, bf16 and int8")
    ap.add_argument("--repeats", type=int, default=3, help="runs per side (and precision), interleaved (median)")
    ap.add_argument("--rows", type=int, help="embed a fixed sample of N reviews (default: all)")
    ap.add_argument("--vectors", type=int, default=1_000_000, help="part 2: rows of the vectors table")
    ap.add_argument("--side", default="all",
                    help=f"all, or a comma-separated list of {', '.join(dict.fromkeys([*SIDES, *SEARCH_SIDES]))}")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="intra-op threads for every side (default: all cores)")
    ap.add_argument("--out", help="write a JSON summary here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    ap.add_argument("--child", nargs=6, metavar=("KIND", "SOURCE", "MODEL", "PRECISION", "THREADS", "DEST"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--search-child", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    ap.add_argument("--export-onnx", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--helper", nargs=2, metavar=("NAME", "JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.helper:
        return run_helper(args.helper[0], json.loads(args.helper[1]))
    if args.child:
        kind, source, model, precision, threads, dest = args.child
        return peer_child(kind, source, model, precision, int(threads), dest)
    if args.search_child:
        return search_child(*args.search_child)
    if args.export_onnx:
        return export_onnx(*args.export_onnx, encoder=True)
    known = dict.fromkeys([*SIDES, *SEARCH_SIDES])
    chosen = list(known) if args.side == "all" else args.side.split(",")
    if unknown := [s for s in chosen if s not in known]:
        sys.exit(f"--side: unknown {', '.join(unknown)} (known: all, {', '.join(known)})")
    sides = [s for s in SIDES if s in chosen]
    search_sides = [s for s in SEARCH_SIDES if s in chosen]
    if not args.bin:
        sys.exit("give the pipeline binary with --bin or LAKEML_BIN (scripts/bench.sh embed does)")
    if args.repeats < 1 or (args.rows is not None and args.rows < 1) or args.vectors <= K or args.threads < 1:
        sys.exit(f"--repeats, --rows and --threads must be at least 1, --vectors more than {K}")
    if args.part == "all":  # the parts that --side leaves sides in
        parts = [p for p, xs in (("throughput", sides), ("search", search_sides)) if xs]
    elif not (sides if args.part == "throughput" else search_sides):
        sys.exit(f"--side {args.side}: no side of --part {args.part}")
    else:
        parts = [args.part]

    root = pathlib.Path(__file__).resolve().parent.parent
    assets = pathlib.Path(os.path.expanduser(os.environ.get("LAKEML_ASSETS", "~/.cache/lakeml/assets")))
    precisions = {"both": ["fp32", "bf16"], "all": ["fp32", "bf16", "int8"]}.get(args.precision, [args.precision])
    with work_dir("lakeml-bench-embed-", args.keep) as work:
        threads = str(args.threads)
        env = dict(os.environ, LAKEML_BENCH_DIR=str(work), LAKEML_ASSETS=str(assets), LAKEML_BENCH_THREADS=threads,
                   OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads,
                   TOKENIZERS_PARALLELISM="true")
        if args.rows:
            env["LAKEML_BENCH_ROWS"] = str(args.rows)
        print(f"machine: {os.cpu_count()} cores, {args.threads} intra-op threads on every side, load average "
              f"{os.getloadavg()[0]:.2f} (other work on these cores slows every side); work dir {work}", flush=True)
        # The shared model and input, made once, not timed.
        model = work / "model"
        make_st_model(assets / "all-MiniLM-L6-v2", model)
        env["LAKEML_BENCH_MODEL"] = str(model)
        made = run_measured([args.bin, "run", "--json", "--quiet", str(root / "benches/pipelines/predict_input.yaml")],
                            env)
        if made["rc"] != 0:
            sys.exit(f"making the input table failed:\n{tail(made['stderr'])}")
        source = str(work / "reviews")
        import deltalake
        rows = deltalake.DeltaTable(source).to_pyarrow_table(columns=["id"]).num_rows
        print(f"input: {rows:,} rows in {source}; model {model} (all-MiniLM-L6-v2, mean pooling, normalized, "
              f"max_seq_length {MAX_LENGTH})", flush=True)
        doc = {"machine": {"cpus": os.cpu_count(), "threads": args.threads},
               "config": {"rows": rows, "batch_size": BATCH_SIZE, "max_length": MAX_LENGTH,
                          "repeats": args.repeats, "precisions": precisions, "parts": parts}}
        if "throughput" in parts:
            doc["throughput"] = throughput(args, root, precisions, sides, work, env, source, rows, str(model))
        if "search" in parts:
            doc["search"] = search(args, root, search_sides, work, env)
        print(f"load average now {os.getloadavg()[0]:.2f} (1 min), {os.getloadavg()[2]:.2f} (15 min) "
              f"on {os.cpu_count()} cores; this driver's peak RSS {driver_rss_mib():,.0f} MiB (every child's "
              f"peak RSS reads at least its parent's at the fork)")
        if args.out:
            import importlib.metadata as md
            doc["machine"]["load_average_at_end"] = os.getloadavg()
            doc["versions"] = {p: md.version(p) for p in ("torch", "transformers", "sentence-transformers",
                                                           "onnxruntime", "faiss-cpu", "numpy", "deltalake")}
            pathlib.Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
            print(f"summary written to {args.out}")


if __name__ == "__main__":
    main()
