"""Object-store tables for lakeml_spark, with no JVM jars: delta-rs (`deltalake`) reads and
commits with the table's storage options, and pyarrow's file systems, built from the same
options, read and write the Parquet files on the driver and the executors.

Options are delta-rs's keys (what a `pipeline` file's `storage_options` take): for S3
`aws_access_key_id`, `aws_secret_access_key`, `aws_session_token`, `aws_region`,
`aws_endpoint_url`, `aws_allow_http`; for Azure `azure_storage_account_name`,
`azure_storage_account_key`, `azure_storage_endpoint`, `azure_allow_http`. The `aws_` and
`azure_storage_` / `azure_` prefixes may be left out, as delta-rs allows. What is not given
comes from the environment, as pyarrow and delta-rs resolve it.
"""
from __future__ import annotations

import os
import urllib.parse

REMOTE_SCHEMES = {"s3", "s3a", "az", "abfs", "abfss", "azure", "gs"}


def is_remote(uri: str) -> bool:
    return urllib.parse.urlparse(uri).scheme in REMOTE_SCHEMES if "://" in uri else False


def local_path(uri: str) -> str:
    """A local path or `file://` URL as an absolute path; an unknown scheme is refused."""
    if "://" not in uri:
        return os.path.abspath(os.path.expanduser(uri))
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme != "file":
        raise ValueError(f"{uri}: lakeml_spark reads local paths, file:// and "
                         f"{', '.join(sorted(s + '://' for s in REMOTE_SCHEMES))} URLs")
    return urllib.parse.unquote(parsed.path)


def _get(options: dict, *names: str) -> str | None:
    lowered = {k.lower(): v for k, v in options.items()}
    return next((lowered[n] for n in names if n in lowered), None)


def _endpoint(url: str | None) -> tuple[str | None, str]:
    """(host:port, scheme) of an endpoint URL; its path (Azurite's account) is dropped."""
    if not url:
        return None, "https"
    parsed = urllib.parse.urlparse(url)
    return parsed.netloc, parsed.scheme or "https"


def filesystem(uri: str, options: dict | None = None):
    """(pyarrow file system, path in it) for a URI: (path, None) on local disk."""
    if not is_remote(uri):
        return local_path(uri), None
    import pyarrow.fs as pafs

    options = options or {}
    parsed = urllib.parse.urlparse(uri)
    key = urllib.parse.unquote(parsed.path).lstrip("/")
    if parsed.scheme in ("s3", "s3a"):
        host, scheme = _endpoint(_get(options, "aws_endpoint_url", "aws_endpoint",
                                      "endpoint_url", "endpoint")
                                 or os.environ.get("AWS_ENDPOINT_URL"))
        fs = pafs.S3FileSystem(
            access_key=_get(options, "aws_access_key_id", "access_key_id"),
            secret_key=_get(options, "aws_secret_access_key", "secret_access_key"),
            session_token=_get(options, "aws_session_token", "session_token"),
            region=_get(options, "aws_region", "region"),
            endpoint_override=host, scheme=scheme)
        return f"{parsed.netloc}/{key}", fs
    if parsed.scheme in ("az", "abfs", "abfss", "azure"):
        container, _, account_host = parsed.netloc.partition("@")
        account = (_get(options, "azure_storage_account_name", "account_name")
                   or account_host.split(".")[0] or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME"))
        host, scheme = _endpoint(_get(options, "azure_storage_endpoint", "azure_endpoint",
                                      "endpoint"))
        kwargs = {"blob_storage_authority": host, "dfs_storage_authority": host,
                  "blob_storage_scheme": scheme, "dfs_storage_scheme": scheme} if host else {}
        fs = pafs.AzureFileSystem(
            account_name=account,
            account_key=_get(options, "azure_storage_account_key", "account_key",
                             "access_key") or os.environ.get("AZURE_STORAGE_ACCOUNT_KEY"),
            **kwargs)
        return f"{container}/{key}", fs
    return f"{parsed.netloc}/{key}", pafs.GcsFileSystem()


def table_uri(uri: str) -> str:
    """What deltalake opens: the URL as given, or an absolute local path."""
    return uri if is_remote(uri) else local_path(uri)
