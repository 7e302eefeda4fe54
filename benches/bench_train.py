"""Fine-tuning benchmark: lakeml's train stage against HF Trainer, both sides in the same run.

Run with `scripts/bench.sh train` (builds lakeml, installs the peers, then calls this);
`--precision fp32|bf16|both` (default both), `--repeat N` (default 1: a run takes minutes),
`--limit N` (train on the first N train rows only, for quick checks), `--side all|SIDE[,SIDE]`
(lakeml, hf, hf_mkl; with --nproc also lakeml_dp, hf_ddp), `--out FILE` (a JSON summary).

`--nproc N` adds data parallelism on this machine's cores: lakeml with N ranks (`pipeline
run --nproc N`, batch 32 / N per rank, threads / N each) against HF Trainer under `torchrun
--nproc_per_node N` (DDP over gloo, the same per-device batch and threads, with the MKL
override and malloc tuning: its best fp32), beside the single-process sides; and the
gradient all-reduce per step, lakeml's own report against `torch.distributed.all_reduce` of
a buffer of the same size between N torchrun processes.

What is measured: fine-tuning all-MiniLM-L6-v2 plus a new 2-way head on the Rotten Tomatoes
train split, 1 epoch, batch size 32, lr 5e-5 (AdamW, linear decay, no warmup, no weight
decay, grad-norm clip 1.0), max_length 128, seed 42, then the accuracy on the test split.
Per side and precision: samples/s and tokens/s of the training loop (real tokens, not pad
slots), the padding ratio (pad slots / all slots of the training batches), the process's
peak RSS and the test accuracy.

Why it is fair:
- Same input: lakeml makes one tokenized Delta table (benches/pipelines/train_input.yaml,
  not timed) and both sides read it, so both train on identical token ids, rows and labels.
- Same work: same hyper-parameters, same seed, one epoch, same precision, and no
  evaluation or checkpointing inside the timed loop on either side.
- Same cores: each side runs in its own child process on the same machine, one after the
  other (interleaved when repeated, the order alternating), with the same intra-op thread
  count (torch.set_num_threads on HF's side, OMP_NUM_THREADS for both); peak RSS comes
  from wait4 on that child, so it is per side.
- HF's best configuration at that precision, not its defaults: Trainer with
  `train_sampling_strategy="group_by_length"` (length-grouped batches roughly double its
  speed over random batches) and `DataCollatorWithPadding` (pad to the longest in the
  batch), `use_cpu=True`, plus `bf16=True` for bf16, its default fused AdamW, and no data
  loader workers. HF's samples/s is Trainer's own `train_samples_per_second`: its clock
  starts after the data loader (and the length-grouping sampler) are built, so set-up is
  not charged to it.
- And HF with MKL's CPU check answered "Intel" (`hf_mkl`, fp32 only: bf16 products go
  through oneDNN): a library defining `mkl_serv_intel_cpu_true` preloaded into the Trainer's
  process, so its fp32 GEMMs take MKL's fast path on this AMD CPU, as lakeml's do by default,
  and glibc told to keep freed memory for reuse (measure.TUNED_MALLOC), as lakeml's binary
  does. That is what a tuned user can get from the HF stack.
- lakeml's figures are its train stage's own report (`pipeline run --json`), whose clock
  likewise covers the training loop only.
"""
import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import time

from measure import TUNED_MALLOC, SideFailed, mkl_override_lib, run_measured, stage_reports, tail, work_dir

SEED = 42
BATCH_SIZE = 32
LR = 5e-5
RESULT = "BENCH_RESULT "  # prefix of the HF child's result line (Trainer prints logs too)
SIDES = {"lakeml": "lakeml", "hf": "HF Trainer", "hf_mkl": "HF + MKL, malloc",
         "lakeml_dp": "lakeml, N ranks", "hf_ddp": "HF DDP + MKL, malloc"}
PRECISIONS = {"lakeml": ("fp32", "bf16"), "hf": ("fp32", "bf16"), "hf_mkl": ("fp32",),
              "lakeml_dp": ("fp32", "bf16"), "hf_ddp": ("fp32",)}
DATA_PARALLEL = ("lakeml_dp", "hf_ddp")


# --- lakeml side -----------------------------------------------------------------------------

def lakeml_side(bin_: str, yaml: str, work: pathlib.Path, precision: str, env: dict, nproc: int = 1) -> dict:
    """One timed lakeml run: the train stage of benches/pipelines/train.yaml, on `nproc` ranks."""
    shutil.rmtree(work / "run-lakeml", ignore_errors=True)
    cmd = [bin_, "run", "--json", "-q", "--force", yaml] + (["--nproc", str(nproc)] if nproc > 1 else [])
    r = run_measured(cmd, dict(env, LAKEML_PRECISION=precision, LAKEML_BATCH=str(BATCH_SIZE // nproc)))
    if r["rc"] != 0:
        raise SideFailed(f"lakeml ({precision}): `pipeline run {yaml}` exited {r['rc']}:\n{tail(r['stderr'])}")
    reports = [x for x in stage_reports(r["stdout"]) if isinstance(x.get("metrics"), dict)]
    if not reports:
        raise SideFailed(f"lakeml ({precision}): no stage report with `metrics` in its output:\n{tail(r['stdout'])}")
    m = reports[-1]["metrics"]
    missing = [k for k in ("samples_per_second", "tokens_per_second", "padding_ratio", "train_seconds",
                           "test_accuracy", "steps") if k not in m]
    if missing:
        raise SideFailed(f"lakeml ({precision}): train report lacks {missing}: {json.dumps(m)}")
    return {"side": "lakeml_dp" if nproc > 1 else "lakeml", "precision": precision,
            "samples_per_s": m["samples_per_second"], "tokens_per_s": m["tokens_per_second"],
            "padding_ratio": m["padding_ratio"], "train_s": m["train_seconds"], "steps": m["steps"],
            "test_acc": m["test_accuracy"], "all_reduce_ms": m.get("all_reduce_ms_per_step"),
            "all_reduce_mb": m.get("all_reduce_mb_per_step"),
            "rss_mib": r["rss_mib"], "wall_s": r["wall"], "report": reports[-1]}


def check_lakeml(bin_: str, yaml: str, env: dict) -> None:
    """Fails early and clearly when this build cannot run the train pipeline at all."""
    r = run_measured([bin_, "validate", yaml], env)
    if r["rc"] != 0:
        sys.exit(f"lakeml side: `{bin_} validate {yaml}` failed:\n{tail(r['stderr'] + r['stdout'])}\n"
                 "If this build has no `train` stage yet, run the HF side alone with `--side hf`.")


# --- HF side ---------------------------------------------------------------------------------

def hf_child(table: str, model: str, precision: str, threads: int, out_dir: str, batch_size: int) -> None:
    """Child process: HF Trainer's best configuration on the shared tokenized table. Under
    torchrun it is one DDP rank (Trainer sets up gloo from the environment), `batch_size` per
    rank, and rank 0 prints the result."""
    import torch

    torch.set_num_threads(threads)
    import datasets
    import deltalake
    import numpy as np
    import pyarrow.compute as pc
    import transformers
    from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                              Trainer, TrainingArguments)

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()

    t = deltalake.DeltaTable(table).to_pyarrow_table().sort_by("id")

    def split(name):
        part = t.filter(pc.equal(t["split"], name))
        return datasets.Dataset(part.select(["input_ids", "label"]).rename_columns(["input_ids", "labels"]))

    train, test = split("train"), split("test")

    class CountingCollator:
        """DataCollatorWithPadding, counting real tokens and pad slots of the training batches."""

        def __init__(self, inner):
            self.inner, self.counting, self.real, self.slots, self.batches = inner, True, 0, 0, 0

        def __call__(self, features):
            batch = self.inner(features)
            if self.counting:
                mask = batch["attention_mask"]
                self.real += int(mask.sum())
                self.slots += mask.numel()
                self.batches += 1
            return batch

    tok = AutoTokenizer.from_pretrained(model)
    collator = CountingCollator(DataCollatorWithPadding(tok))
    transformers.set_seed(SEED)  # the new head's initialisation
    net = AutoModelForSequenceClassification.from_pretrained(model, num_labels=2)
    args = TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        bf16=precision == "bf16",
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=64,
        learning_rate=LR,
        num_train_epochs=1,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        seed=SEED,
        data_seed=SEED,
        train_sampling_strategy="group_by_length",
        dataloader_num_workers=0,
        eval_strategy="no",
        save_strategy="no",
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Trainer(model=net, args=args, train_dataset=train, data_collator=collator, processing_class=tok)
    started = time.perf_counter()
    m = trainer.train().metrics
    loop_wall = time.perf_counter() - started
    collator.counting = False
    pred = trainer.predict(test)
    acc = float((np.argmax(pred.predictions, axis=-1) == pred.label_ids).mean())
    if int(os.environ.get("RANK", "0")) != 0:
        return
    print(RESULT + json.dumps({
        "samples_per_s": m["train_samples_per_second"],
        "tokens_per_s": collator.real / m["train_runtime"],
        "padding_ratio": (collator.slots - collator.real) / collator.slots,
        "train_s": m["train_runtime"], "train_call_s": loop_wall, "steps": trainer.state.global_step,
        "batches": collator.batches, "train_rows": len(train), "test_rows": len(test),
        "real_tokens": collator.real, "slots": collator.slots, "test_acc": acc,
        "threads": torch.get_num_threads(), "optim": getattr(args.optim, "value", str(args.optim)),
        "sampling": args.train_sampling_strategy, "bf16": args.bf16, "mkl_override": "LD_PRELOAD" in os.environ,
    }), flush=True)


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]


def hf_side(side: str, table: str, model: str, precision: str, threads: int, work: pathlib.Path,
            env: dict, nproc: int = 1) -> dict:
    out_dir = work / "run-hf"
    shutil.rmtree(out_dir, ignore_errors=True)
    if side in ("hf_mkl", "hf_ddp"):
        env = dict(env, LD_PRELOAD=mkl_override_lib(work), **TUNED_MALLOC)
    ranks = nproc if side == "hf_ddp" else 1
    launch = torchrun(ranks) if ranks > 1 else []
    if ranks > 1:
        env = dict(env, OMP_NUM_THREADS=str(threads // ranks), MKL_NUM_THREADS=str(threads // ranks))
    child = [sys.executable, __file__, "--hf-child", table, model, precision, str(threads // ranks), str(out_dir),
             str(BATCH_SIZE // ranks)]
    r = run_measured(launch + child[1:] if launch else child, env)
    lines = [x for x in r["stdout"].splitlines() if x.startswith(RESULT)]
    if r["rc"] != 0 or not lines:
        raise SideFailed(f"{SIDES[side]} ({precision}) exited {r['rc']}:\n{tail(r['stderr'] + r['stdout'])}")
    out = json.loads(lines[-1][len(RESULT):])
    return {"side": side, "precision": precision, **out, "rss_mib": r["rss_mib"], "wall_s": r["wall"]}


def all_reduce_child(model: str, repeat: int) -> None:
    """Under torchrun: `repeat` timed all-reduces (sum, then / world, as DDP averages) of a
    float32 buffer as large as the model's gradients (MiniLM with a 2-way head) over gloo;
    rank 0 prints the median milliseconds."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForSequenceClassification

    torch.set_num_threads(1)
    net = AutoModelForSequenceClassification.from_pretrained(model, num_labels=2)
    numel = sum(p.numel() for p in net.parameters())
    del net
    dist.init_process_group("gloo")
    buf = torch.randn(numel)
    times, cpu = [], []
    for i in range(repeat + 3):
        dist.barrier()
        started, started_cpu = time.perf_counter(), time.process_time()
        dist.all_reduce(buf)
        buf.div_(dist.get_world_size())
        if i >= 3:
            times.append(1e3 * (time.perf_counter() - started))
            cpu.append(1e3 * (time.process_time() - started_cpu))
    if dist.get_rank() == 0:
        # CPU time of the whole process (gloo's threads too): what an overlap with the backward
        # pass would have to find free cores for.
        print(RESULT + json.dumps({"all_reduce_ms": statistics.median(times),
                                   "all_reduce_cpu_ms": statistics.median(cpu), "numel": numel}), flush=True)
    dist.destroy_process_group()


def torch_all_reduce(nproc: int, model: str, env: dict) -> dict:
    r = run_measured(torchrun(nproc) + [__file__, "--all-reduce-child", model], env)
    lines = [x for x in r["stdout"].splitlines() if x.startswith(RESULT)]
    if r["rc"] != 0 or not lines:
        raise SideFailed(f"torch all-reduce exited {r['rc']}:\n{tail(r['stderr'] + r['stdout'])}")
    return json.loads(lines[-1][len(RESULT):])


# --- driver ----------------------------------------------------------------------------------

def summarize(runs: list[dict], sides: list[str], precisions: list[str], repeat: int) -> dict:
    keys = ("samples_per_s", "tokens_per_s", "padding_ratio", "rss_mib", "test_acc", "train_s", "wall_s")
    med = {}
    for p in precisions:
        for s in sides:
            xs = [r for r in runs if r["side"] == s and r["precision"] == p]
            if xs:
                med[f"{s}/{p}"] = {k: statistics.median(x[k] for x in xs) for k in keys} | {"runs": len(xs)}
    print()
    print(f"Fine-tuning MiniLM-L6 on the Rotten Tomatoes train split, 1 epoch, bs {BATCH_SIZE}; "
          f"medians of {repeat}")
    print(f"{'side':20}{'precision':>10}{'samples/s':>11}{'tokens/s':>11}{'padding':>9}"
          f"{'peak RSS MiB':>14}{'test acc':>10}{'train s':>9}{'wall s':>8}")
    for p in precisions:
        for s in sides:
            m = med.get(f"{s}/{p}")
            if m:
                print(f"{SIDES[s]:20}{p:>10}{m['samples_per_s']:11.1f}{m['tokens_per_s']:11,.0f}{m['padding_ratio']:9.1%}"
                      f"{m['rss_mib']:14,.0f}{m['test_acc']:10.4f}{m['train_s']:9.1f}{m['wall_s']:8.1f}")
    compare = {}
    for p in precisions:
        a = med.get(f"lakeml/{p}")
        for s, target in (("hf", 1.5), ("hf_mkl", 1.15), ("lakeml_dp", None)):
            b = med.get(f"{s}/{p}")
            if a and b:
                ratio = a["samples_per_s"] / b["samples_per_s"]
                diff = 100 * (a["test_acc"] - b["test_acc"])
                compare[f"{s}/{p}"] = {"samples_per_s_ratio": ratio, "test_acc_diff_points": diff,
                                       "speed_target": target,
                                       "speed_target_met": target is None or ratio >= target,
                                       "acc_target_met": diff >= -0.5}
                goal = f" (target >= {target}x)" if target else ""
                print(f"{p}: lakeml / {SIDES[s]} samples/s {ratio:.2f}x{goal}; "
                      f"test acc lakeml - {SIDES[s]} {diff:+.2f} points")
        a, b = med.get(f"lakeml_dp/{p}"), med.get(f"hf_ddp/{p}")
        if a and b:
            ratio = a["samples_per_s"] / b["samples_per_s"]
            diff = 100 * (a["test_acc"] - b["test_acc"])
            compare[f"dp/{p}"] = {"samples_per_s_ratio": ratio, "test_acc_diff_points": diff,
                                  "speed_target": 1.5, "speed_target_met": ratio >= 1.5}
            print(f"{p}: {SIDES['lakeml_dp']} / {SIDES['hf_ddp']} samples/s {ratio:.2f}x (target >= 1.5x); "
                  f"test acc {diff:+.2f} points")
    return {"medians": med, "compare": compare}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.environ.get("LAKEML_BIN"), help="the pipeline binary (default $LAKEML_BIN)")
    ap.add_argument("--precision", choices=["fp32", "bf16", "both"], default="both")
    ap.add_argument("--repeat", type=int, default=1, help="runs per side and precision, interleaved (median)")
    ap.add_argument("--limit", type=int, help="train on the first N train rows (by id) only, both sides")
    ap.add_argument("--side", default="all", help=f"all, or a comma-separated list of {', '.join(SIDES)}")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="intra-op threads for both sides (default: all usable cores)")
    ap.add_argument("--out", help="write a JSON summary here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    ap.add_argument("--nproc", type=int, default=1,
                    help="also run the data-parallel sides with N ranks on this machine (lakeml_dp, hf_ddp)")
    ap.add_argument("--hf-child", nargs=6, metavar=("TABLE", "MODEL", "PRECISION", "THREADS", "OUT_DIR", "BATCH"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--all-reduce-child", metavar="MODEL", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hf_child:
        table, model, precision, threads, out_dir, batch = args.hf_child
        return hf_child(table, model, precision, int(threads), out_dir, int(batch))
    if args.all_reduce_child:
        return all_reduce_child(args.all_reduce_child, 20)
    if not args.bin:
        sys.exit("give the pipeline binary with --bin or LAKEML_BIN (scripts/bench.sh train does)")

    root = pathlib.Path(__file__).resolve().parent.parent
    assets = pathlib.Path(os.path.expanduser(os.environ.get("LAKEML_ASSETS", "~/.cache/lakeml/assets")))
    model = str(assets / "all-MiniLM-L6-v2")
    precisions = ["fp32", "bf16"] if args.precision == "both" else [args.precision]
    sides = list(SIDES) if args.side in ("all", "both") else args.side.split(",")
    if unknown := [s for s in sides if s not in SIDES]:
        sys.exit(f"--side: unknown {', '.join(unknown)} (known: all, {', '.join(SIDES)})")
    if args.nproc < 2:
        sides = [s for s in sides if s not in DATA_PARALLEL]
    elif BATCH_SIZE % args.nproc or args.threads % args.nproc:
        sys.exit(f"--nproc {args.nproc} must divide the batch ({BATCH_SIZE}) and --threads ({args.threads})")
    with work_dir("lakeml-bench-train-", args.keep) as work:
        env = dict(os.environ, LAKEML_BENCH_DIR=str(work), LAKEML_ASSETS=str(assets),
                   OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
                   TOKENIZERS_PARALLELISM="false")
        if args.limit:
            env["LAKEML_BENCH_LIMIT"] = str(args.limit)
        print(f"machine: {os.cpu_count()} cores, {args.threads} threads per side, load average "
              f"{os.getloadavg()[0]:.2f} (other work on these cores slows both sides); work dir {work}", flush=True)
        run_all(args, root, model, precisions, sides, work, env)


def run_all(args, root: pathlib.Path, model: str, precisions: list[str], sides: list[str],
            work: pathlib.Path, env: dict) -> None:
    yaml = str(root / "benches/pipelines/train.yaml")
    # The shared input: the tokenized Rotten Tomatoes table (made once by lakeml, not timed).
    made = run_measured([args.bin, "run", "--json", "-q", str(root / "benches/pipelines/train_input.yaml")], env)
    if made["rc"] != 0:
        sys.exit(f"making the input table failed:\n{tail(made['stderr'])}")
    table = str(work / "reviews_tokenized")
    import collections
    import deltalake
    counts = collections.Counter(deltalake.DeltaTable(table).to_pyarrow_table().column("split").to_pylist())
    print(f"input: {table}: {dict(counts)}", flush=True)
    if "lakeml" in sides:
        check_lakeml(args.bin, yaml, env)

    runs = []
    try:
        for i in range(args.repeat):
            for p in precisions:
                order = sides if i % 2 == 0 else sides[::-1]
                for s in order:
                    if p not in PRECISIONS[s]:
                        continue
                    if s in ("lakeml", "lakeml_dp"):
                        r = lakeml_side(args.bin, yaml, work, p, env, args.nproc if s == "lakeml_dp" else 1)
                    else:
                        r = hf_side(s, table, model, p, args.threads, work, env, args.nproc)
                    runs.append(r)
                    print(f"  run {i + 1} {SIDES[s]:18} {p}: {r['samples_per_s']:.1f} samples/s, test acc "
                          f"{r['test_acc']:.4f}, {r['rss_mib']:,.0f} MiB, {r['wall_s']:.1f} s wall", flush=True)
        summary = summarize(runs, sides, precisions, args.repeat)
        ours = [r for r in runs if r["side"] == "lakeml_dp" and r["precision"] == "fp32"]
        if ours:
            torch_side = torch_all_reduce(args.nproc, model, env)
            mine = statistics.median(r["all_reduce_ms"] for r in ours)
            mb = statistics.median(r["all_reduce_mb"] for r in ours)
            theirs = torch_side["all_reduce_ms"]
            summary["all_reduce_ms"] = {"lakeml": mine, "lakeml_mb": mb, "torch": theirs,
                                        "torch_mb": 4e-6 * torch_side["numel"],
                                        "torch_cpu_ms": torch_side["all_reduce_cpu_ms"]}
            # lakeml sends the looked-up word-embedding rows only; torch, as DDP, the whole buffer.
            print(f"gradient all-reduce per step, {args.nproc} ranks: lakeml {mine:.1f} ms for {mb:.1f} MB "
                  f"(mean over its steps, from its train report), torch.distributed (gloo) {theirs:.1f} ms "
                  f"for {4e-6 * torch_side['numel']:.1f} MB, the whole gradient as DDP sends it "
                  f"(median of 20): {mine / theirs:.2f}x; torch's all-reduce keeps {torch_side['all_reduce_cpu_ms']:.1f} ms "
                  f"of CPU busy per rank (its threads together)")
    except SideFailed as e:
        sys.exit(f"\n{e}")
    print(f"load average now {os.getloadavg()[0]:.2f} (1 min), {os.getloadavg()[2]:.2f} (15 min) "
          f"on {os.cpu_count()} cores")
    if args.out:
        import torch
        import transformers
        doc = {"machine": {"cpus": os.cpu_count(), "threads": args.threads,
                           "load_average_at_end": os.getloadavg()},
               "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
               "config": {"epochs": 1, "batch_size": BATCH_SIZE, "lr": LR, "max_length": 128, "seed": SEED,
                          "limit": args.limit, "repeat": args.repeat, "train_rows": counts.get("train"),
                          "test_rows": counts.get("test")},
               "runs": runs, **summary}
        pathlib.Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"summary written to {args.out}")


if __name__ == "__main__":
    main()
