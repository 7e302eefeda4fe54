"""Object-storage benchmark: the same table on S3 (moto_server on 127.0.0.1) and on local disk.

Run with `scripts/bench.sh storage` (builds lakeml, installs moto, then calls this);
`--copies N` (how many times the reviews are replicated; default 1000: 12.8M rows, about
1.05 GB of Parquet),
`--predict-rows N` (default 20000), `--repeats N` (default 3, medians), `--threads N`,
`--out FILE` (a JSON summary), `--keep`.

What is measured, in one run, on the same rows, one side after the other:
1. Scan: `pipeline sql FILE "SELECT count(*), sum(length(text)) FROM big"` over the Delta
   table `big` on local disk and the byte-identical copy on S3; wall time of the whole
   process (start-up included on both sides, about the same), MB/s over the table's bytes.
2. Predict: the predict stage (fp32, the same model and settings) over the same
   `--predict-rows` rows of `big`, read from and written to local disk, then S3; rows/s over
   the stage report's `seconds`, which include reading the rows, the model and the commit.
3. The server's floor: every Parquet object of the S3 table read raw (pyarrow's S3 client,
   8 threads, no decoding), beside the same files read from local disk: how fast moto can
   hand out the bytes at all, so the scan's S3 time can be split into transfer and work.
4. Requests: moto logs every request it answers; the benchmark counts them per phase, by
   method, so a commit's cost (O(1) requests, no listing of `_delta_log`) is visible.

The table: the Rotten Tomatoes reviews (the demo's ingest) replicated `--copies` times, each
copy's text suffixed with its copy number so every row is distinct and Parquet's dictionary
cannot shrink the table to one copy's size; copies are the outer side of the join, so a
review's next copy is a batch (8,192 rows) away, beyond what page compression finds, and each
copy costs about one copy's compressed size (1.05 MB). It is written locally once (untimed), then copied
to S3 by a lakeml `write` stage (timed and reported, not compared).

Why it is fair: both sides run the same binary, pipeline file shape and rows, on the same
cores, alternating local and S3 on each repeat. The S3 server is moto, a Python server on
loopback: its throughput is a floor, not what S3 itself gives, and is named as such.
"""
import argparse
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import pyarrow.fs as pafs

from measure import run_ok, tail

ROOT = pathlib.Path(__file__).resolve().parent.parent
KEY, SECRET = "lakeml-bench", "lakeml-bench-secret"
REQUEST = re.compile(r'"(GET|PUT|HEAD|POST|DELETE) (\S+)')


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Moto:
    """moto_server on 127.0.0.1, its request log read per phase."""

    def __init__(self, work: pathlib.Path):
        self.port = free_port()
        self.log = work / "moto.log"
        self.proc = subprocess.Popen(
            [os.environ["LAKEML_MOTO"], "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 60
        while True:
            try:
                fs = self.filesystem()
                fs.create_dir("bench")
                break
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    sys.exit(f"moto_server did not start:\n{tail(self.log.read_text())}")
                time.sleep(0.5)
        self.mark = self.lines()

    def filesystem(self) -> pafs.S3FileSystem:
        return pafs.S3FileSystem(access_key=KEY, secret_key=SECRET, scheme="http",
                                 endpoint_override=f"127.0.0.1:{self.port}", region="us-east-1",
                                 allow_bucket_creation=True)

    def lines(self) -> int:
        return len(self.log.read_text().splitlines())

    def requests(self) -> dict:
        """Requests answered since the last call, by method (GETs that list are `LIST`)."""
        lines = self.log.read_text().splitlines()
        counts: dict = {}
        for line in lines[self.mark:]:
            m = REQUEST.search(line)
            if m:
                method = "LIST" if m[1] == "GET" and "list-type=" in m[2] else m[1]
                counts[method] = counts.get(method, 0) + 1
        self.mark = len(lines)
        return counts

    def stop(self) -> None:
        os.killpg(self.proc.pid, 15)
        self.proc.wait()


def storage(moto: Moto) -> str:
    return (f"storage:\n  s3: {{ endpoint: 'http://127.0.0.1:{moto.port}', allow_http: true, "
            f"region: us-east-1, access_key_id: {KEY}, secret_access_key: {SECRET} }}\n")


def pipeline(bin_: str, args: list[str], env: dict) -> dict:
    return run_ok([bin_, *args], env)


def reports(r: dict) -> list[dict]:
    return [json.loads(line) for line in r["stdout"].splitlines() if line.startswith("{")]


def dir_bytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*.parquet"))


def read_raw(fs, paths: list[str]) -> float:
    """Seconds to read every file in `paths` whole, 8 at a time, bytes discarded."""
    from concurrent.futures import ThreadPoolExecutor

    def one(path: str) -> int:
        # A random-access file reads whole in one GET; pyarrow's input stream would
        # fetch it in many small ranged GETs, each a round trip through moto.
        with fs.open_input_file(path) as f:
            return len(f.read())

    started = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, paths))
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--copies", type=int, default=1000)
    ap.add_argument("--predict-rows", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()

    work = pathlib.Path(tempfile.mkdtemp(prefix="lakeml-bench-storage-"))
    env = dict(os.environ, LAKEML_CACHE=str(work / "cache"))
    moto = Moto(work)
    try:
        model = work / "model"
        run_ok([sys.executable, str(ROOT / "tests/py/make_classifier.py"),
                str(pathlib.Path(env["LAKEML_ASSETS"]) / "all-MiniLM-L6-v2"), str(model),
                "rotten,fresh", "0"])
        csv = pathlib.Path(env["LAKEML_ASSETS"]) / "rotten_tomatoes/rotten_tomatoes_corpus_full.csv.bz2"
        # id = copy * 100,000 + review id (12,808 reviews): the predicted rows are the first
        # predict_rows / 2 reviews of copies 1 and 2.
        if a.predict_rows % 2 or not 2 <= a.predict_rows <= 2 * 12808 or a.copies < 2:
            sys.exit("--predict-rows must be even, at most 25,616, and --copies at least 2")
        predict_where = f"id / 100000 <= 2 AND id % 100000 <= {a.predict_rows // 2}"
        (work / "make.yaml").write_text(
            f"name: bench-storage-input\n{storage(moto)}tables:\n"
            f"  rotten_tomatoes_csv: {{ csv: '{csv}' }}\n  reviews: {{ delta: reviews }}\n"
            f"  big: {{ delta: big }}\n  big_s3: {{ delta: 's3://bench/big' }}\n"
            f"stages:\n  - write: {{ sql_file: '{ROOT / 'sql/ingest_reviews.sql'}', to: reviews }}\n"
            f"  - write:\n      to: big\n      sql: |\n"
            f"        SELECT CAST(g.value * 100000 + r.id AS BIGINT) AS id,\n"
            f"               concat(r.text, ' #', CAST(g.value AS VARCHAR)) AS text\n"
            f"        FROM generate_series(1, {a.copies}) g CROSS JOIN reviews r\n"
            f"  - write: {{ name: upload, from: big, to: big_s3 }}\n")
        made = reports(pipeline(a.bin, ["run", "--json", "--quiet", str(work / "make.yaml")], env))
        upload = next(r for r in made if r["stage"] == "upload")
        rows, size = upload["rows_out"], dir_bytes(work / "big")
        upload_requests = moto.requests()
        print(f"table: {rows:,} rows, {size / 1e9:.2f} GB of Parquet; copied to S3 in "
              f"{upload['seconds']:.1f} s ({size / 1e6 / upload['seconds']:.0f} MB/s), "
              f"requests {upload_requests}", flush=True)

        sides = {"local": "big", "s3": "s3://bench/big"}
        for side, loc in sides.items():
            (work / f"{side}.yaml").write_text(
                f"name: bench-storage-{side}\n{storage(moto)}tables:\n"
                f"  big: {{ delta: '{loc}' }}\n"
                f"  preds: {{ delta: '{'preds' if side == 'local' else 's3://bench/preds'}' }}\n"
                f"stages:\n  - predict:\n      sql: SELECT id, text FROM big WHERE {predict_where}\n"
                f"      model: {model}\n      to: preds\n      mode: overwrite\n"
                f"      device: cpu\n      precision: fp32\n      threads: {a.threads}\n")
        scan_sql = "SELECT count(*) AS n, sum(length(text)) AS chars FROM big"
        s3_fs = moto.filesystem()
        raw_paths = {
            "local": [str(p) for p in (work / "big").glob("*.parquet")],
            "s3": [f.path for f in s3_fs.get_file_info(pafs.FileSelector("bench/big"))
                   if f.path.endswith(".parquet")],
        }
        raw_fs = {"local": pafs.LocalFileSystem(), "s3": s3_fs}
        raws = {s: [] for s in sides}
        scans = {s: [] for s in sides}
        predicts = {s: [] for s in sides}
        requests = {}
        for rep in range(a.repeats):
            order = list(sides) if rep % 2 == 0 else list(reversed(sides))
            for side in order:
                raws[side].append(read_raw(raw_fs[side], raw_paths[side]))
                moto.requests()
                r = pipeline(a.bin, ["sql", str(work / f"{side}.yaml"), scan_sql], env)
                scans[side].append(r["wall"])
                requests[f"scan_{side}"] = moto.requests()
                r = pipeline(a.bin, ["run", "--json", "--quiet", "--force",
                                     str(work / f"{side}.yaml")], env)
                rep_ = reports(r)[0]
                predicts[side].append(rep_["rows_out"] / rep_["seconds"])
                requests[f"predict_{side}"] = moto.requests()
                print(f"repeat {rep + 1} {side}: raw read {raws[side][-1]:.1f} s, "
                      f"scan {scans[side][-1]:.1f} s, predict "
                      f"{predicts[side][-1]:.0f} rows/s ({rep_['rows_out']} rows)", flush=True)
        med = {k: {s: statistics.median(v[s]) for s in sides} for k, v in
               (("raw_read_s", raws), ("scan_s", scans), ("predict_rows_per_s", predicts))}
        summary = {
            "rows": rows, "parquet_bytes": size, "copies": a.copies,
            "predict_rows": a.predict_rows, "repeats": a.repeats, "threads": a.threads,
            "upload_seconds": upload["seconds"], "upload_requests": upload_requests,
            "medians": med, "requests": requests,
            "scan_s3_over_local": med["scan_s"]["s3"] / med["scan_s"]["local"],
            "predict_s3_over_local": med["predict_rows_per_s"]["s3"] / med["predict_rows_per_s"]["local"],
        }
        print(f"\nscan ({size / 1e9:.2f} GB): local {med['scan_s']['local']:.1f} s "
              f"({size / 1e6 / med['scan_s']['local']:.0f} MB/s), S3 {med['scan_s']['s3']:.1f} s "
              f"({size / 1e6 / med['scan_s']['s3']:.0f} MB/s): S3 takes "
              f"{summary['scan_s3_over_local']:.2f}x local's time")
        print(f"raw read of the same files, no decoding: local {med['raw_read_s']['local']:.1f} s, "
              f"S3 (moto) {med['raw_read_s']['s3']:.1f} s ({size / 1e6 / med['raw_read_s']['s3']:.0f} "
              f"MB/s): the server's floor")
        print(f"predict ({a.predict_rows} rows, fp32): local "
              f"{med['predict_rows_per_s']['local']:.0f} rows/s, S3 "
              f"{med['predict_rows_per_s']['s3']:.0f} rows/s: S3 at "
              f"{summary['predict_s3_over_local']:.3f}x local")
        print(f"requests per phase (last repeat): {json.dumps(requests)}")
        if a.out:
            pathlib.Path(a.out).write_text(json.dumps(summary, indent=2))
    finally:
        moto.stop()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")


if __name__ == "__main__":
    main()
