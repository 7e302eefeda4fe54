//! Storage options: the file's `storage:` defaults and a location's `storage_options:`, in
//! delta-rs's own key names, checked before any request and never printed.

use super::{Provider, factory};
use std::collections::{BTreeMap, HashMap};
use std::fmt;

/// Options for one location. Keys are lower-cased (delta-rs and object_store read them so);
/// `Debug` shows a value only for keys known to hold no secret.
#[derive(Clone, Default, PartialEq, Eq)]
pub(crate) struct StorageOptions(BTreeMap<String, String>);

/// Keys whose values are shown in messages; every other value prints as `***`.
const PLAIN_KEYS: &[&str] = &[
    "region",
    "endpoint",
    "endpoint_url",
    "allow_http",
    "virtual_hosted_style_request",
    "use_emulator",
    "account_name",
    "container_name",
    "bucket",
    "skip_signature",
    "timeout",
    "connect_timeout",
];

fn is_plain(key: &str) -> bool {
    let bare = ["aws_", "azure_storage_", "azure_", "google_"]
        .iter()
        .find_map(|p| key.strip_prefix(p))
        .unwrap_or(key);
    PLAIN_KEYS.contains(&bare)
}

impl StorageOptions {
    pub(crate) fn new(options: impl IntoIterator<Item = (String, String)>) -> Self {
        Self(
            options
                .into_iter()
                .map(|(k, v)| (k.to_ascii_lowercase(), v))
                .collect(),
        )
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// These options over `defaults`: a key given here wins.
    pub(crate) fn merged(&self, over: &StorageOptions) -> Self {
        let mut out = self.0.clone();
        out.extend(over.0.iter().map(|(k, v)| (k.clone(), v.clone())));
        Self(out)
    }

    /// The values themselves, for the store builders only.
    pub(crate) fn expose(&self) -> HashMap<String, String> {
        self.0.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }

    /// Every key must be one delta-rs or object_store reads for `provider`; a few that would
    /// weaken commits are refused. Values are checked when the store is built.
    pub(crate) fn check(&self, provider: Provider) -> Result<(), String> {
        for (key, value) in &self.0 {
            let delta_rs = deltalake::logstore::StorageConfig::parse_options([(key, value)])
                .map_err(|e| format!("storage option `{key}`: {e}"))?;
            if delta_rs.unknown_properties.is_empty() {
                continue; // limits, runtime, certificates: delta-rs's own keys
            }
            refuse_weaker_commits(provider, key, value)?;
            if !factory::knows_key(provider, key) {
                let hint = match crate::config::closest(key, common_keys(provider)) {
                    Some(k) => format!("did you mean `{k}`?"),
                    None => format!(
                        "use delta-rs's key names for {} (e.g. {})",
                        provider.key(),
                        common_keys(provider)[..4].join(", ")
                    ),
                };
                return Err(format!(
                    "unknown storage option `{key}` for {}; {hint}",
                    provider.key()
                ));
            }
        }
        Ok(())
    }
}

/// Options that would let two writers both take one Delta version.
fn refuse_weaker_commits(provider: Provider, key: &str, value: &str) -> Result<(), String> {
    let bare = key.strip_prefix("aws_").unwrap_or(key);
    match (provider, bare) {
        (Provider::S3, "conditional_put") if !value.eq_ignore_ascii_case("etag") => Err(format!(
            "storage option `{key}: {value}`: lakeml commits to S3 with conditional puts \
             (If-None-Match), which keep concurrent writers safe; remove the option"
        )),
        (Provider::S3, "s3_locking_provider" | "s3_allow_unsafe_rename") => Err(format!(
            "storage option `{key}`: lakeml commits to S3 with conditional puts \
             (If-None-Match), so no lock service or unsafe rename is needed; remove it"
        )),
        _ => Ok(()),
    }
}

/// The keys people use most, for "did you mean".
fn common_keys(provider: Provider) -> &'static [&'static str] {
    match provider {
        Provider::S3 => &[
            "aws_access_key_id",
            "aws_secret_access_key",
            "aws_region",
            "aws_endpoint_url",
            "aws_session_token",
            "aws_allow_http",
            "aws_virtual_hosted_style_request",
            "aws_skip_signature",
            "aws_role_arn",
            "aws_web_identity_token_file",
            "access_key_id",
            "secret_access_key",
            "region",
            "endpoint",
            "endpoint_url",
            "session_token",
            "allow_http",
            "skip_signature",
        ],
        Provider::Azure => &[
            "azure_storage_account_name",
            "azure_storage_account_key",
            "azure_storage_sas_token",
            "azure_storage_endpoint",
            "azure_storage_use_emulator",
            "azure_client_id",
            "azure_client_secret",
            "azure_tenant_id",
            "azure_use_azure_cli",
            "azure_allow_http",
            "account_name",
            "account_key",
            "sas_token",
            "endpoint",
            "use_emulator",
            "allow_http",
        ],
        Provider::Gcs => &[
            "google_service_account",
            "google_service_account_key",
            "google_application_credentials",
            "google_bucket",
            "service_account",
            "service_account_key",
            "application_credentials",
        ],
    }
}

impl fmt::Debug for StorageOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut map = f.debug_map();
        for (k, v) in &self.0 {
            if is_plain(k) {
                map.entry(k, v);
            } else {
                map.entry(k, &format_args!("***"));
            }
        }
        map.finish()
    }
}

/// The file's `storage:` section: defaults for every URL of each provider.
#[derive(Debug, Clone, Default)]
pub(crate) struct Defaults(BTreeMap<Provider, StorageOptions>);

impl Defaults {
    pub(crate) fn new(by_provider: impl IntoIterator<Item = (Provider, StorageOptions)>) -> Self {
        Self(by_provider.into_iter().collect())
    }

    pub(crate) fn for_provider(&self, provider: Provider) -> StorageOptions {
        self.0.get(&provider).cloned().unwrap_or_default()
    }

    /// Each provider's defaults must hold keys that provider reads.
    pub(crate) fn check(&self) -> Result<(), String> {
        for (provider, options) in &self.0 {
            options
                .check(*provider)
                .map_err(|m| format!("storage.{}: {m}", provider.key()))?;
        }
        Ok(())
    }
}
