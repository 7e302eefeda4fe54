//! Asks an object store once, before any work, whether a location can be reached, and says
//! what a failure means for a person: which bucket, which credentials, which endpoint.

use std::time::Duration;

use object_store::{ObjectStore, RetryConfig};

use super::{Provider, Remote, factory};

/// How long the reachability check may take: a refused or silent endpoint answers with an
/// error in seconds instead of the minutes the regular retries would spend.
const PROBE_TIMEOUT: Duration = Duration::from_secs(20);

impl Remote {
    /// One listing request at the location's prefix (the part before any glob). An empty
    /// prefix is fine: only an unreachable store, a missing bucket or refused credentials
    /// are errors.
    pub(crate) async fn probe(&self) -> Result<(), String> {
        let retry = RetryConfig {
            max_retries: 2,
            retry_timeout: PROBE_TIMEOUT,
            ..RetryConfig::default()
        };
        let store = factory::build_with(
            self.provider,
            &self.store_url(),
            &self.options.expose(),
            Some(retry),
        )
        .map_err(|e| explain(self, &e))?;
        let prefix = self.list_prefix()?;
        let listing = async {
            store
                .list_with_delimiter(Some(&prefix))
                .await
                .map(|_| ())
                .map_err(|e| explain(self, &e))
        };
        match tokio::time::timeout(PROBE_TIMEOUT, listing).await {
            Ok(result) => result,
            Err(_) => Err(format!(
                "{}: no answer from the {} endpoint within {}s; check the `endpoint` option \
                 and that the service is up",
                self.url,
                self.provider.key(),
                PROBE_TIMEOUT.as_secs()
            )),
        }
    }

    /// The prefix a listing of this location starts from: the key up to its first glob.
    pub(crate) fn list_prefix(&self) -> Result<object_store::path::Path, String> {
        let key = self.key()?;
        let text = key.as_ref();
        let cut = text
            .find(['*', '?', '['])
            .map_or(text.len(), |i| text[..i].rfind('/').unwrap_or(0));
        Ok(object_store::path::Path::from(&text[..cut]))
    }
}

/// What an object-store error means, and what to do about it.
pub(crate) fn explain(remote: &Remote, e: &object_store::Error) -> String {
    let url = remote.url();
    let bucket = url.host_str().unwrap_or_default();
    let provider = remote.provider();
    let credentials = match provider {
        Provider::S3 => {
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or `aws_access_key_id` and \
             `aws_secret_access_key` in storage_options"
        }
        Provider::Azure => {
            "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or a SAS token, or \
             `azure_storage_account_key` in storage_options"
        }
        Provider::Gcs => {
            "GOOGLE_APPLICATION_CREDENTIALS, or `google_service_account` in storage_options"
        }
    };
    let detail = chain(e);
    match e {
        object_store::Error::NotFound { .. } => format!(
            "{url}: the bucket or container `{bucket}` does not exist; create it, or fix the URL \
             ({detail})"
        ),
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => format!(
            "{url}: access denied; check the credentials ({credentials}) and that they may \
             read and write `{bucket}` ({detail})"
        ),
        _ if detail.contains("NoSuchBucket") || detail.contains("ContainerNotFound") => format!(
            "{url}: the bucket or container `{bucket}` does not exist; create it, or fix the URL \
             ({detail})"
        ),
        _ if detail.contains("onnect") || detail.contains("dns error") => format!(
            "{url}: cannot reach the {} endpoint; check the `endpoint` option (or the \
             provider's environment variables) and that the service is up ({detail})",
            provider.key()
        ),
        _ if detail.contains("redential") || detail.contains("token") => {
            format!("{url}: no usable credentials; set {credentials} ({detail})")
        }
        _ => format!("{url}: {detail}"),
    }
}

/// An error with its sources, on one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}
