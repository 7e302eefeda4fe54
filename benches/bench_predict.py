"""Batch prediction benchmark: lakeml's predict stage against the CPU peers a user would pick.

Run with `scripts/bench.sh predict` (builds lakeml, installs the peers, then calls this);
`--precision fp32|bf16|int8|both|all` (default all; both = fp32 and bf16), `--repeats N`
(default 3, medians), `--rows N` (a fixed sample of N reviews, for quick runs; default all
12,808), `--model DIR` (a trained classifier directory; default a MiniLM-L6 classifier with a
seeded head, made here; give a fine-tuned one, such as the demo's runs/rotten-tomatoes/model,
for label agreement that means something), `--side all|SIDE[,SIDE...]` (the keys of SIDES
below), `--threads N`, `--out FILE` (a JSON summary).

The sides, each at the precisions it offers (PRECISIONS):
- lakeml (fp32, bf16, int8) and lakeml_generic (fp32, its MKL override off);
- HF `pipeline` and `Trainer.predict` (fp32, bf16): what HF's docs recommend;
- careful PyTorch (`torch`: rows sorted by length in batches of 64, `inference_mode`, bf16 by
  autocast), and the same with the MKL override preloaded and glibc keeping freed memory for
  reuse (`torch_mkl`; measure.TUNED_MALLOC, as lakeml's binary does): what a tuned user
  writes by hand;
- ONNX Runtime (`ort`): the model exported by `torch.onnx.export`, fp32, and int8 by
  `onnxruntime.quantization.quantize_dynamic` (QInt8 weights; per-channel, its more accurate
  setting here), sorted batches of 64 as above, with the same malloc tuning.
Every table of results has a column of label agreement with lakeml at fp32 (which equals
transformers at fp32) and one of MFU: the model's FLOPs (every linear layer and attention
product for each real token) per second of wall time, over the GEMM peak at that precision
that `pipeline info --json` measures on this machine.

What is measured: classifying every review of a Delta table with one classifier directory
(all-MiniLM-L6-v2 plus a 2-way head: rotten / fresh), table in, table out: each side reads
the rows (id, text) from the same Delta table and writes a Delta table of predictions
(id, label, score). Per side and precision: rows/s over the child process's whole wall time
(start-up, imports, model load, read, tokenize, forward passes, write), the in-process
seconds where the side reports them, and the process's peak RSS. The predicted labels of
the HF sides are checked against lakeml's (fraction of rows with the same label).

Why it is fair:
- Same input, same model: lakeml writes the input table once (benches/pipelines/
  predict_input.yaml, not timed), and every side reads it and the same model directory.
- Same work: every row, truncation at 512 tokens (the model's positions; HF's
  `truncation=True` cuts at the tokenizer's model_max_length, 512), same precision (fp32, or
  bf16 weights and activations on every side), one output table each.
- Same cores: each side runs in its own child process on the same machine, one after the
  other (interleaved when repeated, the order reversed on odd repeats), with the same
  intra-op thread count (lakeml's `threads`, `torch.set_num_threads` on the HF sides,
  OMP_NUM_THREADS / MKL_NUM_THREADS for all); peak RSS comes from wait4 on that child.
- HF at its recommended settings, not its defaults: `pipeline("text-classification",
  device="cpu", dtype=...)` called on the list of texts with batch_size=64 and
  truncation=True; and Trainer.predict on a `datasets.Dataset` tokenized with the fast
  tokenizer (batched map, truncation), `DataCollatorWithPadding` (pad to the longest of each
  batch), per_device_eval_batch_size=64, `use_cpu=True`, `bf16_full_eval=True` for bf16, no
  data loader workers (the collator only pads; workers would take cores from the forward
  passes), no pinned memory, report_to=[].
- lakeml runs its defaults on CPU (rows sorted by length, 4096 padded tokens per forward
  pass). The HF sides batch 64 rows in table order, as their APIs do; the share of pad slots
  that costs them is printed.
- In-process seconds: lakeml's predict stage report (model load -> predictions committed);
  on the HF sides, from after the imports to the Delta table written. `predict s` is the
  forward passes alone where the side reports them (Trainer's `test_runtime`; the pipeline
  call).
"""
import argparse
import json
import os
import pathlib
import shutil
import sys
import time

from measure import (RESULT, SideFailed, gemm_peaks, medians, mkl_override_lib, peer_env, peer_result, run_measured,
                     stage_reports, tail, work_dir)

BATCH_SIZE = 64
LABELS = "rotten,fresh"
SIDES = {"lakeml": "lakeml", "lakeml_generic": "lakeml, MKL generic", "pipeline": "HF pipeline",
         "trainer": "HF Trainer.predict", "torch": "PyTorch, careful", "torch_mkl": "PyTorch + MKL, malloc",
         "ort": "ONNX Runtime"}
PRECISIONS = {"lakeml": ("fp32", "bf16", "int8"), "lakeml_generic": ("fp32",), "pipeline": ("fp32", "bf16"),
              "trainer": ("fp32", "bf16"), "torch": ("fp32", "bf16"), "torch_mkl": ("fp32", "bf16"),
              "ort": ("fp32", "int8")}
# lakeml_generic: lakeml with its answer to MKL's CPU check switched off (LAKEML_MKL_OVERRIDE=0),
# so its fp32 products take MKL's generic path on a non-Intel CPU, as the HF sides' do.
LAKEML_SIDES = {"lakeml": {}, "lakeml_generic": {"LAKEML_MKL_OVERRIDE": "0"}}


# --- lakeml side -----------------------------------------------------------------------------

def lakeml_side(bin_: str, yaml: str, precision: str, env: dict, side: str = "lakeml",
                kind: str = "predict") -> dict:
    """One timed lakeml run: the `kind` stage (predict, or embed for bench_embed.py) of `yaml`,
    benches/pipelines/predict.yaml here (`side`: one of LAKEML_SIDES; bench_serve.py and
    bench_spark.py call it for the plain one). `warnings`: the run's `lakeml: warning:` lines
    (such as int8 running at another precision on a CPU without int8 dot products)."""
    r = run_measured([bin_, "run", "--json", "--quiet", "--force", yaml],
                     dict(env, LAKEML_PRECISION=precision, LAKEML_BENCH_SIDE=side, **LAKEML_SIDES[side]))
    if r["rc"] != 0:
        raise SideFailed(f"lakeml ({precision}): `pipeline run {yaml}` exited {r['rc']}:\n{tail(r['stderr'])}")
    reports = [x for x in stage_reports(r["stdout"]) if x.get("kind") == kind]
    if not reports:
        raise SideFailed(f"lakeml ({precision}): no {kind} stage report in its output:\n{tail(r['stdout'])}")
    rep = reports[-1]
    return {"side": side, "precision": precision, "rows": rep["rows_out"], "tokens": rep.get("tokens"),
            "stage_s": rep["seconds"], "predict_s": None, "rss_mib": r["rss_mib"], "wall_s": r["wall"],
            "report": rep, "warnings": [x for x in r["stderr"].splitlines() if x.startswith("lakeml: warning")]}


# --- HF sides (child processes) --------------------------------------------------------------

def sorted_batches(tok, texts: list[str], max_length: int | None = None):
    """The careful sides' batching: tokenized (fast tokenizer, truncation at max_length, by
    default the tokenizer's model_max_length: 512), rows sorted by length, BATCH_SIZE rows per
    batch padded to the longest; yields (row indices, batch)."""
    enc = tok(texts, truncation=True, max_length=max_length)["input_ids"]
    order = sorted(range(len(enc)), key=lambda i: len(enc[i]))
    for start in range(0, len(order), BATCH_SIZE):
        rows = order[start:start + BATCH_SIZE]
        yield rows, tok.pad({"input_ids": [enc[i] for i in rows]}, return_tensors="np")


def careful_child(kind: str, texts: list[str], model: str, precision: str, threads: int):
    """PyTorch by hand (`torch`) or ONNX Runtime (`ort`) over sorted batches; returns the logits in
    table order, the seconds the forward passes took, and facts about the side."""
    import numpy as np
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows_out = [None] * len(texts)  # each row's logits, in table order
    if kind == "ort":
        import onnxruntime as ort

        session = ort_session(precision, threads)
        t0 = time.perf_counter()
        for rows, b in sorted_batches(tok, texts):
            out = session.run(None, {"input_ids": b["input_ids"].astype(np.int64),
                                     "attention_mask": b["attention_mask"].astype(np.int64)})[0]
            for r, row in zip(rows, out):
                rows_out[r] = row
        return np.stack(rows_out), time.perf_counter() - t0, {"onnxruntime": ort.__version__}
    import torch
    from transformers import AutoModelForSequenceClassification

    net = AutoModelForSequenceClassification.from_pretrained(model).eval()
    t0 = time.perf_counter()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        for rows, b in sorted_batches(tok, texts):
            out = net(input_ids=torch.from_numpy(b["input_ids"]).long(),
                      attention_mask=torch.from_numpy(b["attention_mask"]).long()).logits.float().numpy()
            for r, row in zip(rows, out):
                rows_out[r] = row
    return np.stack(rows_out), time.perf_counter() - t0, {"mkl_override": "LD_PRELOAD" in os.environ}


def ort_session(precision: str, threads: int):
    """An ONNX Runtime CPU session of the model export_onnx wrote to LAKEML_BENCH_ONNX (by the
    driver, not timed): the int8 one at int8, else fp32; `threads` intra-op threads."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    path = os.path.join(os.environ["LAKEML_BENCH_ONNX"], "model.int8.onnx" if precision == "int8" else "model.onnx")
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def export_onnx(model: str, out: str, encoder: bool = False) -> None:
    """Child process (not timed): `torch.onnx.export` of the classifier (output `logits`), or
    with `encoder` of the bare encoder (AutoModel, output `last_hidden_state`; bench_embed.py),
    dynamic batch and length, to out/model.onnx, and `quantize_dynamic` of it to
    out/model.int8.onnx."""
    import warnings

    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    if encoder:
        class Encoder(torch.nn.Module):  # the encoder's token states alone (no pooler output)
            def __init__(self):
                super().__init__()
                self.net = AutoModel.from_pretrained(model)

            def forward(self, input_ids, attention_mask):
                return self.net(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

        net, output, output_axes = Encoder().eval(), "last_hidden_state", {0: "b", 1: "t"}
    else:
        net, output, output_axes = AutoModelForSequenceClassification.from_pretrained(model).eval(), "logits", {0: "b"}
    b = AutoTokenizer.from_pretrained(model)(["an example", "a longer example sentence"], padding=True,
                                             return_tensors="pt")
    os.makedirs(out, exist_ok=True)
    axes = {"b": 0, "t": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (b["input_ids"], b["attention_mask"]), os.path.join(out, "model.onnx"),
                          input_names=["input_ids", "attention_mask"], output_names=[output],
                          dynamic_axes={"input_ids": {v: k for k, v in axes.items()},
                                        "attention_mask": {v: k for k, v in axes.items()}, output: output_axes},
                          opset_version=17, dynamo=False)
        quantize_dynamic(os.path.join(out, "model.onnx"), os.path.join(out, "model.int8.onnx"),
                         weight_type=QuantType.QInt8, per_channel=True)


def hf_child(kind: str, source: str, model: str, precision: str, threads: int, dest: str) -> None:
    """Child process: one peer side, Delta table in, Delta table of (id, label, score) out."""
    import torch

    torch.set_num_threads(threads)
    import datasets
    import deltalake
    import numpy as np
    import pyarrow as pa
    import transformers
    from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                              Trainer, TrainingArguments, pipeline)

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    extra = {}

    started = time.perf_counter()
    table = deltalake.DeltaTable(source).to_pyarrow_table(columns=["id", "text"])
    if kind in ("torch", "ort"):
        logits, predict_s, more = careful_child(kind, table.column("text").to_pylist(), model, precision, threads)
        extra |= more
        id2label = json.loads(pathlib.Path(model, "config.json").read_text())["id2label"]
        z = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = z / z.sum(axis=-1, keepdims=True)
        labels = [id2label[str(int(i))] for i in probs.argmax(axis=-1)]
        scores = probs.max(axis=-1).tolist()
    elif kind == "pipeline":
        clf = pipeline("text-classification", model=model, device="cpu", dtype=dtype)
        texts = table.column("text").to_pylist()
        t0 = time.perf_counter()
        out = clf(texts, batch_size=BATCH_SIZE, truncation=True)
        predict_s = time.perf_counter() - t0
        labels = [o["label"] for o in out]
        scores = [o["score"] for o in out]
        extra["model_dtype"] = str(clf.model.dtype)
    else:
        tok = AutoTokenizer.from_pretrained(model)
        ds = datasets.Dataset(table).map(lambda b: tok(b["text"], truncation=True), batched=True,
                                         remove_columns=["id", "text"])
        net = AutoModelForSequenceClassification.from_pretrained(model)
        args = TrainingArguments(
            output_dir=os.path.join(os.path.dirname(dest), "trainer-out"),
            use_cpu=True,
            bf16_full_eval=precision == "bf16",
            per_device_eval_batch_size=BATCH_SIZE,
            dataloader_num_workers=0,
            dataloader_pin_memory=False,
            eval_strategy="no",
            save_strategy="no",
            logging_strategy="no",
            report_to=[],
            disable_tqdm=True,
        )
        trainer = Trainer(model=net, args=args, data_collator=DataCollatorWithPadding(tok), processing_class=tok)
        pred = trainer.predict(ds)
        predict_s = pred.metrics["test_runtime"]
        logits = np.asarray(pred.predictions, dtype=np.float32)
        z = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = z / z.sum(axis=-1, keepdims=True)
        ids = probs.argmax(axis=-1)
        labels = [net.config.id2label[int(i)] for i in ids]
        scores = probs.max(axis=-1).tolist()
        # Padding of 64-row batches in table order (the pipeline batches the same way).
        lengths = np.array([len(x) for x in ds["input_ids"]])
        slots = sum(int(lengths[i:i + BATCH_SIZE].max()) * len(lengths[i:i + BATCH_SIZE])
                    for i in range(0, len(lengths), BATCH_SIZE))
        extra |= {"tokens": int(lengths.sum()), "pad_ratio": 1 - lengths.sum() / slots,
                  "model_dtype": str(next(trainer.model.parameters()).dtype)}
    deltalake.write_deltalake(dest, pa.table({"id": table.column("id"), "label": pa.array(labels, pa.string()),
                                              "score": pa.array(scores, pa.float32())}), mode="overwrite")
    stage_s = time.perf_counter() - started
    print(RESULT + json.dumps({"rows": table.num_rows, "stage_s": stage_s, "predict_s": predict_s,
                               "threads": torch.get_num_threads(), **extra}), flush=True)


def hf_side(kind: str, source: str, model: str, precision: str, threads: int, dest: str, env: dict) -> dict:
    mkl = kind == "torch_mkl"
    r = run_measured([sys.executable, __file__, "--child", "torch" if mkl else kind, source, model, precision,
                      str(threads), dest], peer_env(env, mkl, tuned=kind == "ort"))
    return {"side": kind, "precision": precision, **peer_result(r, f"{SIDES[kind]} ({precision})", mkl)}


# --- agreement -------------------------------------------------------------------------------

def agreement(reference: str, other: str) -> dict:
    """Fraction of the reference's rows whose label the other table gives too; max |score diff|."""
    import deltalake

    def load(path):
        t = deltalake.DeltaTable(path).to_pyarrow_table(columns=["id", "label", "score"]).to_pydict()
        return {i: (l, s) for i, l, s in zip(t["id"], t["label"], t["score"])}

    a, b = load(reference), load(other)
    same = sum(1 for i, (l, _) in a.items() if i in b and b[i][0] == l)
    diff = max((abs(s - b[i][1]) for i, (_, s) in a.items() if i in b), default=float("nan"))
    return {"rows": len(a), "other_rows": len(b), "missing": sum(1 for i in a if i not in b),
            "same_label": same / len(a) if a else float("nan"), "max_score_diff": diff}


# --- driver ----------------------------------------------------------------------------------

def model_flops(model: str, lengths: list[int]) -> float:
    """FLOPs of the full forward pass over rows of these token lengths (no padding): every
    linear layer of every layer for each token, plus the attention products (QK^T and PV);
    the head and the elementwise work are left out (they are well under 1%)."""
    c = json.loads(pathlib.Path(model, "config.json").read_text())
    h = c.get("hidden_size", c.get("dim"))
    inner = c.get("intermediate_size", c.get("hidden_dim"))
    layers = c.get("num_hidden_layers", c.get("n_layers"))
    tokens, squares = sum(lengths), sum(t * t for t in lengths)
    return 2.0 * layers * (tokens * (4 * h * h + 2 * h * inner) + 2 * h * squares)


def summarize(runs: list[dict], sides: list[str], precisions: list[str], agree: dict, rows: int,
              args, flops: float, peaks: dict) -> dict:
    med = medians(runs, sides, precisions, rows, flops, peaks)
    compare = {}
    for p in precisions:
        print()
        print(f"{p}: {rows:,} rows, table -> table, {args.threads} intra-op threads per side "
              f"(os.cpu_count() = {os.cpu_count()}); medians of {args.repeats}; GEMM peak here "
              f"{peaks.get(p, float('nan')):.0f} G{'OP' if p == 'int8' else 'FLOP'}/s")
        print(f"{'side':24}{'rows/s':>9}{'wall s':>9}{'in-proc s':>11}{'predict s':>11}"
              f"{'peak RSS MiB':>14}{'same label':>12}{'MFU':>7}")
        for s in sides:
            m = med.get(f"{s}/{p}")
            if not m:
                continue
            pred = f"{m['predict_s']:11.2f}" if m["predict_s"] is not None else f"{'-':>11}"
            ag = agree.get(f"{s}/{p}")
            same = "(ref)" if (s, p) == ("lakeml", "fp32") else (f"{ag['same_label']:.4f}" if ag else "-")
            mfu = f"{m['mfu']:7.1%}" if m["mfu"] is not None else f"{'-':>7}"
            print(f"{SIDES[s]:24}{m['rows_per_s']:9.1f}{m['wall_s']:9.2f}{m['stage_s']:11.2f}{pred}"
                  f"{m['rss_mib']:14,.0f}{same:>12}{mfu}")
        lk = med.get(f"lakeml/{p}")
        peers = {s: med[f"{s}/{p}"] for s in sides if s not in LAKEML_SIDES and f"{s}/{p}" in med}
        if lk and peers:
            fastest = max(peers, key=lambda s: peers[s]["rows_per_s"])
            compare.setdefault(p, {}).update(
                {f"lakeml/{s}": lk["rows_per_s"] / m["rows_per_s"] for s, m in peers.items()}
                | {"lakeml/fastest_peer": lk["rows_per_s"] / peers[fastest]["rows_per_s"], "fastest_peer": fastest})
            print("rows/s (wall): " + "; ".join(f"lakeml / {SIDES[s]} {lk['rows_per_s'] / m['rows_per_s']:.2f}x"
                                                 for s, m in peers.items())
                  + f"; lakeml / fastest peer ({SIDES[fastest]}) {lk['rows_per_s'] / peers[fastest]['rows_per_s']:.2f}x")
        hf = {s: med[f"{s}/{p}"] for s in ("pipeline", "trainer") if f"{s}/{p}" in med}
        if lk and hf:
            c = {f"lakeml/{s}": lk["rows_per_s"] / m["rows_per_s"] for s, m in hf.items()}
            best = max(hf, key=lambda s: hf[s]["rows_per_s"])
            c["lakeml/faster_hf"] = lk["rows_per_s"] / hf[best]["rows_per_s"]
            c["faster_hf"] = SIDES[best]
            c["lakeml_rss_over_faster_hf"] = lk["rss_mib"] / hf[best]["rss_mib"]
            compare.setdefault(p, {}).update(c)
        generic = med.get(f"lakeml_generic/{p}")
        if lk and generic:
            compare.setdefault(p, {})["lakeml/lakeml_generic"] = lk["rows_per_s"] / generic["rows_per_s"]
            print(f"MKL override: lakeml / lakeml with MKL's generic path "
                  f"{lk['rows_per_s'] / generic['rows_per_s']:.2f}x")
        pads = [r["pad_ratio"] for r in runs if r["precision"] == p and "pad_ratio" in r]
        if pads:
            print(f"HF sides batch {BATCH_SIZE} rows in table order: {pads[0]:.1%} of their token slots are "
                  f"padding (lakeml sorts rows by length first)")
        for s in sides:
            ag = agree.get(f"{s}/{p}")
            if ag and (ag["missing"] or ag["other_rows"] != ag["rows"]):
                print(f"WARNING: {SIDES[s]} wrote {ag['other_rows']} rows, lakeml {ag['rows']} "
                      f"({ag['missing']} of lakeml's ids missing)")
    return {"medians": med, "compare": compare, "agreement": agree}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.environ.get("LAKEML_BIN"), help="the pipeline binary (default $LAKEML_BIN)")
    ap.add_argument("--precision", choices=["fp32", "bf16", "int8", "both", "all"], default="all",
                    help="both: fp32 and bf16; all: fp32, bf16 and int8")
    ap.add_argument("--repeats", type=int, default=3, help="runs per side and precision, interleaved (median)")
    ap.add_argument("--rows", type=int, help="predict a fixed sample of N reviews (default: all)")
    ap.add_argument("--model", help="classifier directory (default: MiniLM-L6 + a seeded 2-way head, made here)")
    ap.add_argument("--side", default="all", help=f"all, or a comma-separated list of {', '.join(SIDES)}")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="intra-op threads for every side (default: all cores)")
    ap.add_argument("--out", help="write a JSON summary here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    ap.add_argument("--child", nargs=6, metavar=("KIND", "SOURCE", "MODEL", "PRECISION", "THREADS", "DEST"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--export-onnx", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, source, model, precision, threads, dest = args.child
        return hf_child(kind, source, model, precision, int(threads), dest)
    if args.export_onnx:
        return export_onnx(*args.export_onnx)
    sides = list(SIDES) if args.side == "all" else args.side.split(",")
    if unknown := [s for s in sides if s not in SIDES]:
        sys.exit(f"--side: unknown {', '.join(unknown)} (known: all, {', '.join(SIDES)})")
    if not args.bin:
        sys.exit("give the pipeline binary with --bin or LAKEML_BIN (scripts/bench.sh predict does)")
    if args.repeats < 1 or (args.rows is not None and args.rows < 1):
        sys.exit("--repeats and --rows must be at least 1")

    root = pathlib.Path(__file__).resolve().parent.parent
    assets = pathlib.Path(os.path.expanduser(os.environ.get("LAKEML_ASSETS", "~/.cache/lakeml/assets")))
    precisions = {"both": ["fp32", "bf16"], "all": ["fp32", "bf16", "int8"]}.get(args.precision, [args.precision])
    with work_dir("lakeml-bench-predict-", args.keep) as work:
        env = dict(os.environ, LAKEML_BENCH_DIR=str(work), LAKEML_ASSETS=str(assets),
                   LAKEML_BENCH_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads),
                   MKL_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="true")
        if args.rows:
            env["LAKEML_BENCH_ROWS"] = str(args.rows)
        print(f"machine: {os.cpu_count()} cores, {args.threads} intra-op threads on every side, load average "
              f"{os.getloadavg()[0]:.2f} (other work on these cores slows every side); work dir {work}", flush=True)
        run_all(args, root, assets, precisions, sides, work, env)


def run_all(args, root: pathlib.Path, assets: pathlib.Path, precisions: list[str], sides: list[str],
            work: pathlib.Path, env: dict) -> None:
    # The shared model: a classifier directory (made once, not timed, unless given).
    if args.model:
        model = str(pathlib.Path(args.model).resolve())
    else:
        model = str(work / "model")
        made = run_measured([sys.executable, str(root / "tests/py/make_classifier.py"),
                             str(assets / "all-MiniLM-L6-v2"), model, LABELS, "0"], env)
        if made["rc"] != 0:
            sys.exit(f"making the classifier failed:\n{tail(made['stderr'])}")
    env["LAKEML_BENCH_MODEL"] = model
    # The shared input: the reviews as a Delta table (made once by lakeml, not timed).
    made = run_measured([args.bin, "run", "--json", "--quiet", str(root / "benches/pipelines/predict_input.yaml")], env)
    if made["rc"] != 0:
        sys.exit(f"making the input table failed:\n{tail(made['stderr'])}")
    source = str(work / "reviews")
    import deltalake
    rows = deltalake.DeltaTable(source).to_pyarrow_table(columns=["id"]).num_rows
    print(f"input: {rows:,} rows in {source}; model {model}", flush=True)
    # Set-up of the peers, not timed: the ONNX export and int8 model, the MKL override library.
    if "ort" in sides:
        env["LAKEML_BENCH_ONNX"] = str(work / "onnx")
        made = run_measured([sys.executable, __file__, "--export-onnx", model, env["LAKEML_BENCH_ONNX"]], env)
        if made["rc"] != 0:
            sys.exit(f"exporting the model to ONNX failed:\n{tail(made['stderr'])}")
    if "torch_mkl" in sides:
        env["LAKEML_BENCH_MKL_OVERRIDE"] = mkl_override_lib(work)
    # The model's FLOPs over these rows (real tokens, truncated at 512), and this machine's
    # GEMM peaks, for MFU.
    peaks = gemm_peaks(args.bin, env)
    from transformers import AutoTokenizer
    texts = deltalake.DeltaTable(source).to_pyarrow_table(columns=["text"]).column("text").to_pylist()
    lengths = [len(x) for x in AutoTokenizer.from_pretrained(model)(texts, truncation=True)["input_ids"]]
    flops = model_flops(model, lengths)
    print(f"model FLOPs over the {rows:,} rows ({sum(lengths):,} tokens): {flops / 1e12:.2f} TFLOP; GEMM peaks "
          f"here (pipeline info): " + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()), flush=True)
    yaml = str(root / "benches/pipelines/predict.yaml")
    if any(s in LAKEML_SIDES for s in sides):
        check = run_measured([args.bin, "validate", yaml], env)
        if check["rc"] != 0:
            sys.exit(f"lakeml side: `{args.bin} validate {yaml}` failed:\n{tail(check['stderr'] + check['stdout'])}\n"
                     "If this build has no `predict` stage yet, run an HF side alone with `--side pipeline`.")

    def dest(side, p):
        return str(work / f"preds-{side}-{p}")

    runs = []
    try:
        for i in range(args.repeats):
            for p in precisions:
                for s in (sides if i % 2 == 0 else sides[::-1]):
                    if p not in PRECISIONS[s]:
                        continue
                    if s in LAKEML_SIDES:
                        r = lakeml_side(args.bin, yaml, p, env, side=s)
                    else:
                        shutil.rmtree(dest(s, p), ignore_errors=True)
                        r = hf_side(s, source, model, p, args.threads, dest(s, p), env)
                    if r["rows"] != rows:
                        raise SideFailed(f"{SIDES[s]} ({p}) predicted {r['rows']} rows of {rows}")
                    runs.append(r)
                    print(f"  run {i + 1} {SIDES[s]:23} {p}: {rows / r['wall_s']:8.1f} rows/s, "
                          f"{r['wall_s']:.2f} s wall, {r['stage_s']:.2f} s in-process, "
                          f"{r['rss_mib']:,.0f} MiB", flush=True)
    except SideFailed as e:
        sys.exit(f"\n{e}")

    # Label agreement with lakeml at fp32 (which equals transformers at fp32), or with lakeml at
    # the same precision when fp32 was not run.
    agree = {}
    if "lakeml" in sides:
        for p in precisions:
            ref = dest("lakeml", "fp32" if "fp32" in precisions else p)
            for s in sides:
                if p in PRECISIONS[s] and dest(s, p) != ref:
                    agree[f"{s}/{p}"] = agreement(ref, dest(s, p))
    summary = summarize(runs, sides, precisions, agree, rows, args, flops, peaks)
    print()
    print("same label: fraction of rows whose predicted label equals lakeml's at "
          + ("fp32" if "fp32" in precisions else "the same precision"))
    for key, ag in agree.items():
        print(f"  {key:22} same label {ag['same_label']:.4f}, max |score diff| {ag['max_score_diff']:.2e}")
    print(f"load average now {os.getloadavg()[0]:.2f} (1 min), {os.getloadavg()[2]:.2f} (15 min) "
          f"on {os.cpu_count()} cores")
    if args.out:
        import torch
        import transformers
        doc = {"machine": {"cpus": os.cpu_count(), "threads": args.threads,
                           "load_average_at_end": os.getloadavg()},
               "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
               "config": {"rows": rows, "batch_size": BATCH_SIZE, "max_length": 512, "model": model,
                          "repeats": args.repeats, "precisions": precisions},
               "gemm_peaks": peaks, "model_tflop": flops / 1e12, "runs": runs, **summary}
        pathlib.Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"summary written to {args.out}")


if __name__ == "__main__":
    main()
