//! Where data lives: one place turns a table or model location, a local path or an
//! object-store URL, into a store, a path and options. The catalog, the Delta commits, the
//! model loader, the jobs and serve all ask it; no other module parses URLs.
//!
//! Object stores are object_store's own clients for S3, Azure Blob / ADLS Gen2 and GCS,
//! registered with delta-rs under their URL schemes ([`factory`]). Delta commits on all three
//! are conditional puts (`If-None-Match: *`, or GCS's generation 0), so two writers never
//! both take one version, with no lock service.

mod cache;
mod factory;
mod mirror;
mod options;
mod probe;
mod stamp;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use object_store::ObjectStore;
use url::Url;

pub(crate) use cache::{cache_root, is_url, model_dir, model_name, remote_identity};
pub(crate) use mirror::{Mirror, run_dir};
pub(crate) use options::{Defaults, StorageOptions};
pub(crate) use probe::explain;
pub(crate) use stamp::{STAMP, Stamp};

/// The object-store services lakeml talks to, each under its own URL schemes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Provider {
    S3,
    Azure,
    Gcs,
}

/// Every scheme lakeml accepts, for messages.
const SCHEMES: &str = "s3://, s3a://, az://, abfs://, abfss://, azure://, gs:// or file://";

impl Provider {
    fn of_scheme(scheme: &str) -> Option<Self> {
        match scheme {
            "s3" | "s3a" => Some(Self::S3),
            "az" | "abfs" | "abfss" | "azure" => Some(Self::Azure),
            "gs" => Some(Self::Gcs),
            _ => None,
        }
    }

    /// The key of this provider's defaults under the file's `storage:` section.
    pub(crate) fn key(self) -> &'static str {
        match self {
            Self::S3 => "s3",
            Self::Azure => "azure",
            Self::Gcs => "gcs",
        }
    }

    /// The URL schemes delta-rs is told to hand to lakeml's store factory.
    fn schemes(self) -> &'static [&'static str] {
        match self {
            Self::S3 => &["s3", "s3a"],
            Self::Azure => &["az", "abfs", "abfss", "azure"],
            Self::Gcs => &["gs"],
        }
    }

    const ALL: [Provider; 3] = [Self::S3, Self::Azure, Self::Gcs];
}

/// A table, a file set or a model directory: on local disk or in an object store.
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum Location {
    Local(PathBuf),
    Remote(Remote),
}

/// A location in an object store: its URL (never with credentials) and the options that
/// reach it.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Remote {
    url: Url,
    provider: Provider,
    options: StorageOptions,
}

impl Location {
    /// Reads a location as written in a pipeline file: an object-store URL, a `file://` URL,
    /// or a path (`~/` and relative paths resolved against `base`). `options` are the
    /// location's own `storage_options:`, over the file's `storage:` defaults.
    ///
    /// A URL whose scheme lakeml does not know is refused, never read as a local path.
    pub(crate) fn parse(
        base: &Path,
        text: &str,
        defaults: &Defaults,
        options: &StorageOptions,
    ) -> Result<Self, String> {
        if !is_url(text) {
            if !options.is_empty() {
                return Err(format!(
                    "`storage_options` apply to object-store URLs, and `{text}` is a local path"
                ));
            }
            return Ok(Self::Local(resolve(base, text)));
        }
        let url = Url::parse(text).map_err(|e| format!("`{text}` is not a valid URL: {e}"))?;
        if url.scheme() == "file" {
            let path = url
                .to_file_path()
                .map_err(|()| format!("`{text}` is not a local file URL (file:///abs/path)"))?;
            return Self::parse(base, &path.to_string_lossy(), defaults, options);
        }
        let Some(provider) = Provider::of_scheme(url.scheme()) else {
            return Err(format!(
                "`{text}`: lakeml does not read `{}://` URLs; use a local path or one of {SCHEMES}",
                url.scheme()
            ));
        };
        if !url.username().is_empty() && url.password().is_some() {
            return Err(format!(
                "`{}://{}`: credentials do not belong in a URL, where logs would show them; \
                 give them in `storage_options` or the environment",
                url.scheme(),
                url.host_str().unwrap_or_default()
            ));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(format!(
                "`{text}` names no bucket or container; write {}://<bucket>/<path>",
                url.scheme()
            ));
        }
        let options = defaults.for_provider(provider).merged(options);
        options.check(provider)?;
        factory::register();
        Ok(Self::Remote(Remote {
            url,
            provider,
            options,
        }))
    }

    /// The local path, or `None` for an object store.
    pub(crate) fn local(&self) -> Option<&Path> {
        match self {
            Self::Local(p) => Some(p),
            Self::Remote(_) => None,
        }
    }

    pub(crate) fn remote(&self) -> Option<&Remote> {
        match self {
            Self::Local(_) => None,
            Self::Remote(r) => Some(r),
        }
    }

    /// The location as a directory URL (a Delta table's root), for delta-rs.
    pub(crate) fn dir_url(&self) -> Result<Url, String> {
        match self {
            Self::Local(path) => Url::from_directory_path(path)
                .map_err(|()| format!("`{}` is not an absolute local path", path.display())),
            Self::Remote(r) => Ok(r.dir_url()),
        }
    }

    /// The options delta-rs opens this location with (empty on local disk).
    pub(crate) fn delta_options(&self) -> std::collections::HashMap<String, String> {
        match self {
            Self::Local(_) => Default::default(),
            Self::Remote(r) => r.options.expose(),
        }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Local(p) => write!(f, "{}", p.display()),
            Self::Remote(r) => write!(f, "{}", r.url),
        }
    }
}

impl fmt::Debug for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Local(p) => write!(f, "Local({})", p.display()),
            Self::Remote(r) => write!(f, "{r:?}"),
        }
    }
}

impl fmt::Debug for Remote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Remote({}, {:?})", self.url, self.options)
    }
}

impl Remote {
    pub(crate) fn url(&self) -> &Url {
        &self.url
    }

    pub(crate) fn provider(&self) -> Provider {
        self.provider
    }

    /// The URL with a trailing slash: a directory (a Delta table's root, a model directory).
    fn dir_url(&self) -> Url {
        let mut url = self.url.clone();
        if !url.path().ends_with('/') {
            url.set_path(&format!("{}/", url.path()));
        }
        url
    }

    /// `scheme://bucket`: the key DataFusion's object-store registry finds this store by.
    pub(crate) fn store_url(&self) -> Url {
        let mut url = self.url.clone();
        url.set_path("");
        url.set_query(None);
        url.set_fragment(None);
        url
    }

    /// The path inside the bucket or container.
    pub(crate) fn key(&self) -> Result<object_store::path::Path, String> {
        object_store::path::Path::from_url_path(self.url.path())
            .map_err(|e| format!("`{}`: {e}", self.url))
    }

    /// The store for the whole bucket or container, built from the environment and the
    /// options (options win).
    pub(crate) fn store(&self) -> Result<Arc<dyn ObjectStore>, String> {
        factory::build(self.provider, &self.store_url(), &self.options.expose())
            .map_err(|e| format!("{}: {e}", self.url))
    }
}

/// A setting that takes a local path only: a URL there is refused, never read as a path.
pub(crate) fn local_path(base: &Path, text: &str) -> Result<PathBuf, String> {
    if is_url(text) {
        Err(format!(
            "`{text}`: this setting takes a local path; object-store URLs are not supported \
             here yet"
        ))
    } else {
        Ok(resolve(base, text))
    }
}

/// `~/x` and paths relative to the pipeline file's directory.
pub(crate) fn resolve(base: &Path, path: &str) -> PathBuf {
    let expanded = match (path.strip_prefix("~/"), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => PathBuf::from(path),
    };
    let joined = if expanded.is_absolute() {
        expanded
    } else {
        base.join(expanded)
    };
    // Lexical clean-up of `.` and `..` so messages and table URLs read naturally.
    let mut out = PathBuf::new();
    for part in joined.components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

#[cfg(test)]
mod tests;
