"""Set up and read object stores for the storage tests with clients that are not lakeml's:
pyarrow's S3 and Azure file systems (buckets, uploads) and delta-rs's Python reader.

usage:
  object_store.py s3 ENDPOINT mkdir BUCKET
  object_store.py s3 ENDPOINT upload LOCAL_DIR BUCKET/PREFIX [SUFFIX]
  object_store.py azure ENDPOINT mkdir CONTAINER
  object_store.py azure ENDPOINT upload LOCAL_DIR CONTAINER/PREFIX [SUFFIX]
  object_store.py s3|azure ENDPOINT read URL      (prints the Delta table as read_delta.py does)

ENDPOINT is host:port on 127.0.0.1. Credentials: S3 takes the test key pair below (moto
accepts any); Azure takes Azurite's well-known devstoreaccount1 key.
"""
import json
import os
import sys

import deltalake
import pyarrow.fs as pafs

S3_KEY, S3_SECRET = "lakeml-test", "lakeml-test-secret"
AZ_ACCOUNT = "devstoreaccount1"
AZ_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==")


def filesystem(kind: str, endpoint: str) -> pafs.FileSystem:
    if kind == "s3":
        return pafs.S3FileSystem(
            access_key=S3_KEY, secret_key=S3_SECRET, endpoint_override=endpoint,
            scheme="http", region="us-east-1", allow_bucket_creation=True)
    return pafs.AzureFileSystem(
        account_name=AZ_ACCOUNT, account_key=AZ_KEY,
        blob_storage_authority=endpoint, dfs_storage_authority=endpoint,
        blob_storage_scheme="http", dfs_storage_scheme="http")


def storage_options(kind: str, endpoint: str) -> dict:
    if kind == "s3":
        return {"aws_endpoint_url": f"http://{endpoint}", "aws_allow_http": "true",
                "aws_region": "us-east-1", "aws_access_key_id": S3_KEY,
                "aws_secret_access_key": S3_SECRET}
    return {"azure_storage_account_name": AZ_ACCOUNT, "azure_storage_account_key": AZ_KEY,
            "azure_storage_endpoint": f"http://{endpoint}/{AZ_ACCOUNT}",
            "azure_allow_http": "true"}


def main() -> None:
    kind, endpoint, verb = sys.argv[1:4]
    args = sys.argv[4:]
    if verb == "mkdir":
        filesystem(kind, endpoint).create_dir(args[0])
        print(json.dumps({"created": args[0]}))
    elif verb == "upload":
        local, dest = args[0], args[1]
        suffix = args[2] if len(args) > 2 else ""
        fs = filesystem(kind, endpoint)
        names = sorted(n for n in os.listdir(local)
                       if n.endswith(suffix) and os.path.isfile(os.path.join(local, n)))
        for name in names:
            with open(os.path.join(local, name), "rb") as src, \
                    fs.open_output_stream(f"{dest}/{name}") as out:
                out.write(src.read())
        print(json.dumps({"uploaded": names}))
    elif verb == "read":
        table = deltalake.DeltaTable(args[0], storage_options=storage_options(kind, endpoint))
        data = table.to_pyarrow_table()
        first = data.column_names[0]
        print(json.dumps({
            "version": table.version(),
            "num_rows": data.num_rows,
            "rows": sorted(data.to_pylist(), key=lambda r: r[first]),
            "history": [{"version": h.get("version"), "operation": h.get("operation"),
                         "lakeml": h.get("lakeml")} for h in table.history()],
        }, default=str))
    else:
        sys.exit(f"unknown verb {verb}")
    sys.stdout.flush()
    os._exit(0)  # delta-rs / pyarrow thread pools can abort the interpreter at shutdown


if __name__ == "__main__":
    main()
