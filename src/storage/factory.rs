//! lakeml's object-store and log-store factories, registered with delta-rs for each
//! object-store URL scheme.
//!
//! delta-rs's `s3` feature would bring the AWS SDK (about 41 crates) for a DynamoDB lock that
//! S3's conditional puts have made unnecessary. object_store's own S3, Azure and GCS clients
//! are already compiled (the Delta kernel needs them), so lakeml builds stores with them and
//! keeps delta-rs's default log store, whose commits are `PutMode::Create` puts.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::{Arc, Once};

use deltalake::logstore::{
    LogStore, LogStoreFactory, ObjectStoreFactory, ObjectStoreRef, StorageConfig, default_logstore,
    logstore_factories, object_store_factories,
};
use deltalake::{DeltaResult, DeltaTableError, Path};
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::{ObjectStore, RetryConfig};
use url::Url;

use super::Provider;

/// Registers the factories once per process; later calls do nothing.
pub(super) fn register() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for provider in Provider::ALL {
            for scheme in provider.schemes() {
                let Ok(url) = Url::parse(&format!("{scheme}://")) else {
                    continue;
                };
                object_store_factories().insert(url.clone(), Arc::new(Factory(provider)));
                logstore_factories().insert(url, Arc::new(Factory(provider)));
            }
        }
    });
}

/// Builds the store for a bucket or container (`url` is `scheme://bucket`) from the
/// provider's environment variables and `options`, which win. Makes no request.
pub(super) fn build(
    provider: Provider,
    url: &Url,
    options: &HashMap<String, String>,
) -> Result<Arc<dyn ObjectStore>, object_store::Error> {
    build_with(provider, url, options, None)
}

/// [`build`], with `retry` instead of object_store's default retries.
pub(super) fn build_with(
    provider: Provider,
    url: &Url,
    options: &HashMap<String, String>,
    retry: Option<RetryConfig>,
) -> Result<Arc<dyn ObjectStore>, object_store::Error> {
    match provider {
        Provider::S3 => configure::<AmazonS3Builder>(url, options, retry),
        Provider::Azure => configure::<MicrosoftAzureBuilder>(url, options, retry),
        Provider::Gcs => configure::<GoogleCloudStorageBuilder>(url, options, retry),
    }
}

/// True when `provider`'s builder reads the (lower-case) option `key`.
pub(super) fn knows_key(provider: Provider, key: &str) -> bool {
    match provider {
        Provider::S3 => key.parse::<AmazonS3ConfigKey>().is_ok(),
        Provider::Azure => key.parse::<AzureConfigKey>().is_ok(),
        Provider::Gcs => key.parse::<GoogleConfigKey>().is_ok(),
    }
}

fn configure<B: StoreBuilder>(
    url: &Url,
    options: &HashMap<String, String>,
    retry: Option<RetryConfig>,
) -> Result<Arc<dyn ObjectStore>, object_store::Error> {
    let mut builder = B::from_env().with_url(url.as_str());
    for (key, value) in options {
        // Keys that are delta-rs's own (limits, runtime) are not the builder's.
        if let Ok(key) = key.to_ascii_lowercase().parse::<B::Key>() {
            builder = builder.with_config(key, value);
        }
    }
    if let Some(retry) = retry {
        builder = builder.with_retry(retry);
    }
    builder.build()
}

/// The part of object_store's three store builders lakeml uses; they share no trait.
trait StoreBuilder: Sized {
    type Key: FromStr;
    fn from_env() -> Self;
    fn with_url(self, url: &str) -> Self;
    fn with_config(self, key: Self::Key, value: &str) -> Self;
    fn with_retry(self, retry: RetryConfig) -> Self;
    fn build(self) -> Result<Arc<dyn ObjectStore>, object_store::Error>;
}

macro_rules! store_builder {
    ($builder:ty, $key:ty) => {
        impl StoreBuilder for $builder {
            type Key = $key;
            fn from_env() -> Self {
                <$builder>::from_env()
            }
            fn with_url(self, url: &str) -> Self {
                <$builder>::with_url(self, url)
            }
            fn with_config(self, key: $key, value: &str) -> Self {
                <$builder>::with_config(self, key, value)
            }
            fn with_retry(self, retry: RetryConfig) -> Self {
                <$builder>::with_retry(self, retry)
            }
            fn build(self) -> Result<Arc<dyn ObjectStore>, object_store::Error> {
                Ok(Arc::new(<$builder>::build(self)?))
            }
        }
    };
}

store_builder!(AmazonS3Builder, AmazonS3ConfigKey);
store_builder!(MicrosoftAzureBuilder, AzureConfigKey);
store_builder!(GoogleCloudStorageBuilder, GoogleConfigKey);

/// delta-rs asks this for a table's store and log store.
struct Factory(Provider);

impl ObjectStoreFactory for Factory {
    fn parse_url_opts(
        &self,
        url: &Url,
        config: &StorageConfig,
    ) -> DeltaResult<(ObjectStoreRef, Path)> {
        let mut root = url.clone();
        root.set_path("");
        let mut store = build(self.0, &root, &config.raw)
            .map_err(|e| DeltaTableError::generic(e.to_string()))?;
        if let Some(runtime) = &config.runtime {
            store = Arc::new(deltalake::logstore::DeltaIOStorageBackend::new(
                store,
                runtime.clone(),
            )) as Arc<dyn ObjectStore>;
        }
        let path =
            Path::from_url_path(url.path()).map_err(|e| DeltaTableError::generic(e.to_string()))?;
        Ok((store, path))
    }
}

impl LogStoreFactory for Factory {
    fn with_options(
        &self,
        prefixed_store: ObjectStoreRef,
        root_store: ObjectStoreRef,
        location: &Url,
        options: &StorageConfig,
    ) -> DeltaResult<Arc<dyn LogStore>> {
        Ok(default_logstore(
            prefixed_store,
            root_store,
            location,
            options,
        ))
    }
}
