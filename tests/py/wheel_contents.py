"""What a wheel holds: usage: wheel_contents.py WHEEL. Prints JSON: tag (the WHEEL file's),
requires (Requires-Dist lines), files (name -> uncompressed size), bytes (the wheel's size),
and scripts_mode (the `pipeline` entry's Unix mode)."""
import json
import os
import sys
import zipfile


def main() -> None:
    path = sys.argv[1]
    with zipfile.ZipFile(path) as z:
        files = {i.filename: i.file_size for i in z.infolist()}
        info = next(n for n in files if n.endswith(".dist-info/WHEEL"))
        meta = next(n for n in files if n.endswith(".dist-info/METADATA"))
        wheel = z.read(info).decode()
        metadata = z.read(meta).decode()
        script = next((i for i in z.infolist() if i.filename.endswith("/scripts/pipeline")), None)
    print(json.dumps({
        "tag": [line.split(": ", 1)[1] for line in wheel.splitlines() if line.startswith("Tag: ")],
        "requires": [line.split(": ", 1)[1] for line in metadata.splitlines()
                     if line.startswith("Requires-Dist: ")],
        "files": files,
        "bytes": os.path.getsize(path),
        "scripts_mode": oct(script.external_attr >> 16) if script else None,
    }))


if __name__ == "__main__":
    main()
