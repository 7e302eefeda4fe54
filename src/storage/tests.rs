//! Locations and options, checked without a server; the servers are in tests/it/storage.rs.

use std::path::Path;

use super::{Defaults, Location, Provider, StorageOptions, is_url};

fn options(pairs: &[(&str, &str)]) -> StorageOptions {
    StorageOptions::new(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())))
}

fn parse(text: &str, opts: &[(&str, &str)]) -> Result<Location, String> {
    Location::parse(
        Path::new("/base"),
        text,
        &Defaults::default(),
        &options(opts),
    )
}

fn provider(text: &str) -> Option<Provider> {
    parse(text, &[]).ok()?.remote().map(|r| r.provider())
}

#[test]
fn each_scheme_maps_to_its_provider_and_paths_stay_local() {
    assert_eq!(provider("s3://lake/reviews"), Some(Provider::S3));
    assert_eq!(provider("s3a://lake/reviews"), Some(Provider::S3));
    for url in [
        "az://c/t",
        "azure://c/t",
        "abfs://c/t",
        "abfss://c@acct.dfs.core.windows.net/t",
    ] {
        assert_eq!(provider(url), Some(Provider::Azure), "{url}");
    }
    assert_eq!(provider("gs://lake/t"), Some(Provider::Gcs));
    assert_eq!(
        parse("file:///data/t", &[]).map(|l| l.local().map(Path::to_path_buf)),
        Ok(Some("/data/t".into()))
    );
    assert_eq!(
        parse("lake/t", &[]).map(|l| l.local().map(Path::to_path_buf)),
        Ok(Some("/base/lake/t".into()))
    );
    assert!(!is_url("C:/x") && !is_url("lake/a://b") && is_url("s3://b"));
}

#[test]
fn unknown_schemes_and_credentials_in_urls_are_refused_not_read_as_paths() {
    let e = parse("hdfs://nn/t", &[]).expect_err("hdfs");
    assert!(
        e.contains("does not read `hdfs://`") && e.contains("s3://"),
        "{e}"
    );
    let e = parse("https://example.com/t", &[]).expect_err("https");
    assert!(e.contains("`https://`"), "{e}");
    let e = parse("s3://key:secret@lake/t", &[]).expect_err("userinfo");
    assert!(
        !e.contains("secret") && e.contains("storage_options"),
        "{e}"
    );
    let e = parse("s3:///t", &[]).expect_err("no bucket");
    assert!(e.contains("no bucket"), "{e}");
    let e = parse("lake/t", &[("region", "x")]).expect_err("options on a path");
    assert!(e.contains("local path"), "{e}");
}

#[test]
fn option_keys_are_checked_per_provider_and_weaker_commits_refused() {
    assert!(
        parse(
            "s3://b/t",
            &[("AWS_REGION", "eu-west-1"), ("timeout", "30s")]
        )
        .is_ok()
    );
    let e = parse("s3://b/t", &[("aws_secret_acess_key", "x")]).expect_err("typo");
    assert!(e.contains("did you mean `aws_secret_access_key`"), "{e}");
    let e = parse("gs://b/t", &[("aws_region", "x")]).expect_err("wrong provider");
    assert!(
        e.contains("unknown storage option `aws_region` for gcs"),
        "{e}"
    );
    let e = parse("s3://b/t", &[("aws_conditional_put", "disabled")]).expect_err("cput");
    assert!(e.contains("conditional puts"), "{e}");
    let e = parse("s3://b/t", &[("AWS_S3_LOCKING_PROVIDER", "dynamodb")]).expect_err("lock");
    assert!(e.contains("no lock service"), "{e}");
    assert!(parse("az://c/t", &[("azure_storage_account_key", "k")]).is_ok());
}

#[test]
fn table_options_win_over_file_defaults() {
    let defaults = Defaults::new([(
        Provider::S3,
        options(&[("region", "eu-west-1"), ("endpoint", "http://a")]),
    )]);
    let table = options(&[("endpoint", "http://b")]);
    let loc = Location::parse(Path::new("/"), "s3://b/t", &defaults, &table).expect("parse");
    let opts = loc.delta_options();
    assert_eq!(opts["region"], "eu-west-1");
    assert_eq!(opts["endpoint"], "http://b");
}

#[test]
fn secrets_never_print_and_plain_settings_do() {
    let loc = parse(
        "s3://b/t",
        &[
            ("aws_secret_access_key", "hunter2"),
            ("aws_session_token", "tok3n"),
            ("aws_region", "eu-west-1"),
        ],
    )
    .expect("parse");
    let shown = format!("{loc:?} {loc}");
    assert!(
        !shown.contains("hunter2") && !shown.contains("tok3n"),
        "{shown}"
    );
    assert!(
        shown.contains("eu-west-1") && shown.contains("***"),
        "{shown}"
    );
}

#[test]
fn a_bad_gcs_service_account_fails_when_the_store_is_built_without_a_request() {
    let loc = parse(
        "gs://b/t",
        &[("google_service_account", "/nonexistent/sa.json")],
    )
    .expect("parse");
    let e = loc.remote().expect("remote").store().expect_err("no file");
    assert!(e.contains("gs://b/t"), "{e}");
}

#[test]
fn a_glob_lists_from_the_directory_before_its_first_wildcard() {
    let prefix = |text: &str| {
        parse(text, &[])
            .expect("parse")
            .remote()
            .expect("remote")
            .list_prefix()
            .expect("prefix")
            .to_string()
    };
    assert_eq!(prefix("s3://b/raw/2026/*.parquet"), "raw/2026");
    assert_eq!(prefix("s3://b/raw/"), "raw");
    assert_eq!(prefix("s3://b/*.csv"), "");
}
