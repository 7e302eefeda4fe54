"""Tokenization benchmark: lakeml against HF `datasets.map`, both sides in the same run.

Run with `scripts/bench.sh tokenize` (builds lakeml, installs the peers, then calls this).

Both sides read the same Delta table (Rotten Tomatoes x20 = 256,160 reviews, made once by
lakeml) and write a Delta table of token ids, on the same cores, one child process each so
peak RSS is per side. The HF side is its lean configuration: a fast tokenizer,
`datasets.map(batched=True)`, and only `input_ids` returned (no attention mask or type ids).
The tokenizing cores are then compared without table I/O: lakeml's `Encoder` (the Rust
bench `benches/tokenize.rs`) against `tokenizers.Tokenizer.encode_batch_fast` on the same
texts. Each measurement is repeated (interleaved) and the median is reported.
"""
import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

from measure import run_ok

MAX_LENGTH = 128


def hf_side(source: str, dest: str, model: str) -> None:
    """Child process: the HF pipeline, table in, table out; prints its own timings."""
    import datasets
    import deltalake
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    started = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model)
    table = deltalake.DeltaTable(source).to_pyarrow_table()
    ds = datasets.Dataset(table)
    labels = sorted(set(ds.unique("label")))
    out = ds.map(
        lambda b: {
            "input_ids": tok(b["text"], truncation=True, max_length=MAX_LENGTH,
                             return_attention_mask=False, return_token_type_ids=False)["input_ids"],
            "label": [labels.index(x) for x in b["label"]],
        },
        batched=True,
        remove_columns=["text"],
    )
    tokens = sum(len(x) for x in out["input_ids"])
    deltalake.write_deltalake(dest, out.data.table, mode="overwrite")
    print(json.dumps({"seconds": time.perf_counter() - started, "rows": len(out), "tokens": tokens}))


def core_python(texts_file: str, model: str, repeats: int) -> None:
    """Child process: tokenizers.encode_batch_fast alone, same batches as lakeml's core."""
    from tokenizers import Tokenizer

    texts = [json.loads(line) for line in open(texts_file)]
    tok = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(MAX_LENGTH)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        tokens = 0
        for i in range(0, len(texts), 8192):
            tokens += sum(len(e.ids) for e in tok.encode_batch_fast(texts[i:i + 8192]))
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    print(json.dumps({"rows": len(texts), "tokens": tokens, "seconds_median": median,
                      "rows_per_s": len(texts) / median, "tokens_per_s": tokens / median}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", help="the pipeline binary")
    ap.add_argument("--core", help="the Rust core bench binary (benches/tokenize.rs)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-child", nargs=3, metavar=("SOURCE", "DEST", "MODEL"))
    ap.add_argument("--core-child", nargs=3, metavar=("TEXTS", "MODEL", "REPEATS"))
    args = ap.parse_args()
    if args.hf_child:
        return hf_side(*args.hf_child)
    if args.core_child:
        return core_python(args.core_child[0], args.core_child[1], int(args.core_child[2]))

    root = pathlib.Path(__file__).resolve().parent.parent
    assets = pathlib.Path(os.environ["LAKEML_ASSETS"])
    model = str(assets / "all-MiniLM-L6-v2")
    work = pathlib.Path(tempfile.mkdtemp(prefix="lakeml-bench-"))
    env = dict(os.environ, LAKEML_BENCH_DIR=str(work), TOKENIZERS_PARALLELISM="true")
    yaml = str(root / "benches/pipelines/tokenize.yaml")
    py = sys.executable
    print(f"machine: {os.cpu_count()} cores; work dir {work}", flush=True)

    # The shared input: 256k reviews as a Delta table (made once, not timed).
    made = run_ok([args.bin, "run", "--json", "--quiet",
                         str(root / "benches/pipelines/bench_input.yaml")], env)
    rows = json.loads(made["stdout"].splitlines()[-1])["rows_out"]
    print(f"input: {rows} rows in {work / 'reviews_x20'}", flush=True)

    lakeml, hf = [], []
    for i in range(args.repeats):
        r = run_ok([args.bin, "run", "--json", "--quiet", "--force", yaml], env)
        stage = json.loads(r["stdout"].splitlines()[-1])
        lakeml.append({"wall": r["wall"], "rss": r["rss_mib"], "stage_s": stage["seconds"],
                       "rows": stage["rows_out"], "tokens": stage["tokens"]})
        dest = work / "hf_tokenized"
        shutil.rmtree(dest, ignore_errors=True)
        r = run_ok([py, __file__, "--hf-child", str(work / "reviews_x20"), str(dest), model], env)
        out = json.loads(r["stdout"])
        hf.append({"wall": r["wall"], "rss": r["rss_mib"], "stage_s": out["seconds"],
                   "rows": out["rows"], "tokens": out["tokens"]})
        print(f"  run {i + 1}: lakeml {lakeml[-1]['wall']:.2f} s, datasets.map {hf[-1]['wall']:.2f} s",
              flush=True)

    # Cores alone, same texts, same batches.
    texts = work / "texts.jsonl"
    import deltalake
    with open(texts, "w") as f:
        for t in deltalake.DeltaTable(str(work / "reviews_x20")).to_pyarrow_table().column("text").to_pylist():
            f.write(json.dumps(t) + "\n")
    core_rs = json.loads(run_ok([args.core, model, str(texts), str(MAX_LENGTH), str(args.repeats)], env)["stdout"])
    core_py = json.loads(run_ok([py, __file__, "--core-child", str(texts), model, str(args.repeats)], env)["stdout"])

    def med(xs, key):
        return statistics.median(x[key] for x in xs)

    print()
    print(f"End to end: Delta table in ({rows} rows) -> tokenized Delta table out; medians of {args.repeats}")
    print(f"{'':24}{'wall s':>9}{'in-proc s':>11}{'rows/s':>11}{'tokens/s':>13}{'peak RSS MiB':>14}")
    for name, xs in [("lakeml", lakeml), ("HF datasets.map", hf)]:
        wall = med(xs, "wall")
        print(f"{name:24}{wall:9.2f}{med(xs, 'stage_s'):11.2f}{rows / wall:11,.0f}"
              f"{xs[0]['tokens'] / wall:13,.0f}{med(xs, 'rss'):14,.0f}")
    ratio = med(hf, "wall") / med(lakeml, "wall")
    print(f"ratio lakeml / datasets.map (rows/s, process wall time): {ratio:.2f}x  (target >= 2.5x)")
    print(f"  in-proc s: lakeml's tokenize stage report; HF's model load -> Delta written"
          f" (ratio {med(hf, 'stage_s') / med(lakeml, 'stage_s'):.2f}x)")
    print()
    print("Tokenizing core alone (texts in memory, batches of 8192, truncation at 128)")
    print(f"{'lakeml Encoder':24}{core_rs['rows_per_s']:11,.0f} rows/s {core_rs['tokens_per_s']:13,.0f} tokens/s")
    print(f"{'encode_batch_fast':24}{core_py['rows_per_s']:11,.0f} rows/s {core_py['tokens_per_s']:13,.0f} tokens/s")
    print(f"ratio lakeml / encode_batch_fast: {core_rs['rows_per_s'] / core_py['rows_per_s']:.2f}x  (target >= 0.8x)")
    if lakeml[0]["tokens"] != hf[0]["tokens"]:
        print(f"WARNING: token totals differ: lakeml {lakeml[0]['tokens']}, HF {hf[0]['tokens']}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
