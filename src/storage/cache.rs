//! Model directories in object stores, copied once into a local cache.
//!
//! A remote model directory is listed (one request per 1,000 files), and the cache's copy is
//! reused while every file's size and ETag still match; otherwise it is downloaded again into
//! a fresh directory that replaces the old one only once complete, so a killed download never
//! leaves a half model behind.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use futures::TryStreamExt;
use object_store::{ObjectStore, ObjectStoreExt};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::stamp::{STAMP, Stamp};
use super::{Defaults, Location, Remote, StorageOptions};

/// True when `text` is a URL (`scheme://...`) rather than a path.
pub(crate) fn is_url(text: &str) -> bool {
    text.split_once("://").is_some_and(|(scheme, _)| {
        scheme.len() > 1
            && scheme.starts_with(|c: char| c.is_ascii_alphabetic())
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
    })
}

/// The local directory of a model given as a path or an object-store URL; a URL's directory
/// is copied into the cache first (or found there, unchanged).
pub(crate) fn model_dir(base: &Path, text: &str, defaults: &Defaults) -> Result<PathBuf, String> {
    match Location::parse(base, text, defaults, &StorageOptions::default())? {
        Location::Local(path) => Ok(path),
        Location::Remote(remote) => block_on(fetch_dir(&remote)),
    }
}

/// What the cache recorded of each file: its size and ETag in the store.
#[derive(Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Manifest {
    url: String,
    files: BTreeMap<String, (u64, Option<String>)>,
}

const MANIFEST: &str = ".lakeml-remote.json";

async fn fetch_dir(remote: &Remote) -> Result<PathBuf, String> {
    remote.probe().await?;
    let store = remote.store()?;
    let prefix = remote.key()?;
    let explain = |e: object_store::Error| super::explain(remote, &e);
    let objects: Vec<object_store::ObjectMeta> = store
        .list(Some(&prefix))
        .try_collect()
        .await
        .map_err(explain)?;
    let mut want = Manifest {
        url: remote.url().to_string(),
        files: BTreeMap::new(),
    };
    for meta in &objects {
        let Some(rel) = meta.location.prefix_match(&prefix) else {
            continue;
        };
        let rel: Vec<String> = rel.map(|p| p.as_ref().to_string()).collect();
        want.files
            .insert(rel.join("/"), (meta.size, meta.e_tag.clone()));
    }
    if want.files.is_empty() {
        return Err(format!(
            "{}: no files there; give the URL of a model directory (config.json, \
             model.safetensors, tokenizer.json)",
            remote.url()
        ));
    }
    if want.files.contains_key(STAMP) {
        check_stamp(store.as_ref(), remote, &prefix, &want).await?;
    }
    let dir = cache_root()
        .join("models")
        .join(short_hash(remote.url().as_str()));
    if read_manifest(&dir).as_ref() == Some(&want) {
        return Ok(dir);
    }
    let io = |what: &Path, e: std::io::Error| format!("{}: {e}", what.display());
    let parent = dir.parent().unwrap_or(&dir).to_path_buf();
    std::fs::create_dir_all(&parent).map_err(|e| io(&parent, e))?;
    let partial = parent.join(format!(
        ".{}.partial-{}",
        dir.file_name().and_then(|n| n.to_str()).unwrap_or("model"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&partial);
    for rel in want.files.keys() {
        let target = partial.join(rel);
        if let Some(p) = target.parent() {
            std::fs::create_dir_all(p).map_err(|e| io(p, e))?;
        }
        let source = object_store::path::Path::from(format!("{prefix}/{rel}"));
        download(store.as_ref(), &source, &target)
            .await
            .map_err(|e| format!("{}: copying `{rel}`: {e}", remote.url()))?;
    }
    let manifest = serde_json::to_vec_pretty(&want).map_err(|e| e.to_string())?;
    std::fs::write(partial.join(MANIFEST), manifest).map_err(|e| io(&partial, e))?;
    if std::fs::rename(&partial, &dir).is_err() {
        // An older copy is there, or another process finished the same copy first.
        if read_manifest(&dir).as_ref() == Some(&want) {
            let _ = std::fs::remove_dir_all(&partial);
            return Ok(dir);
        }
        let stale = partial.with_extension("stale");
        std::fs::rename(&dir, &stale).map_err(|e| io(&dir, e))?;
        std::fs::rename(&partial, &dir).map_err(|e| io(&dir, e))?;
        let _ = std::fs::remove_dir_all(&stale);
    }
    Ok(dir)
}

/// A model directory a training run writes carries its stamp: it must say complete, and
/// list exactly the sizes the store holds.
async fn check_stamp(
    store: &dyn ObjectStore,
    remote: &Remote,
    prefix: &object_store::path::Path,
    want: &Manifest,
) -> Result<(), String> {
    let key: object_store::path::Path = prefix.parts().chain([STAMP.into()]).collect();
    let body = store
        .get(&key)
        .await
        .map_err(|e| super::explain(remote, &e))?
        .bytes()
        .await
        .map_err(|e| super::explain(remote, &e))?;
    let stamp: Stamp = serde_json::from_slice(&body)
        .map_err(|e| format!("{}: its {STAMP} is unreadable ({e})", remote.url()))?;
    if !stamp.is_complete() {
        return Err(format!(
            "{}: a training run ({}, since {}) is still writing this model, or was killed \
             before it finished; wait for it, or rerun its training",
            remote.url(),
            stamp.by,
            stamp.at
        ));
    }
    let held: BTreeMap<&str, u64> = want
        .files
        .iter()
        .map(|(name, (size, _))| (name.as_str(), *size))
        .collect();
    for (name, size) in &stamp.files {
        if held.get(name.as_str()) != Some(size) {
            return Err(format!(
                "{}: `{name}` does not match the model's {STAMP} (a new model is being \
                 published); try again in a moment",
                remote.url()
            ));
        }
    }
    Ok(())
}

/// What identifies a model directory copied from a store, on every machine whatever its
/// cache: the URL it came from and each file's size and ETag there. `None` for a directory
/// that is not such a copy.
pub(crate) fn remote_identity(dir: &Path) -> Option<serde_json::Value> {
    let manifest = read_manifest(dir)?;
    Some(serde_json::json!({ "url": manifest.url, "files": manifest.files }))
}

/// How a model directory is named to people and in run parameters: the URL it was copied
/// from, or its path.
pub(crate) fn model_name(dir: &Path) -> String {
    read_manifest(dir).map_or_else(|| dir.display().to_string(), |m| m.url)
}

fn read_manifest(dir: &Path) -> Option<Manifest> {
    std::fs::read(dir.join(MANIFEST))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
}

/// The first 8 bytes of a text's SHA-256, in hex: a cache directory's name.
pub(super) fn short_hash(text: &str) -> String {
    hex::encode(&Sha256::digest(text.as_bytes())[..8])
}

/// Streams one object into a file.
pub(super) async fn download(
    store: &dyn ObjectStore,
    source: &object_store::path::Path,
    target: &Path,
) -> Result<(), String> {
    use std::io::Write;
    let mut stream = store
        .get(source)
        .await
        .map_err(|e| e.to_string())?
        .into_stream();
    let mut file = std::fs::File::create(target).map_err(|e| e.to_string())?;
    while let Some(chunk) = stream.try_next().await.map_err(|e| e.to_string())? {
        file.write_all(&chunk).map_err(|e| e.to_string())?;
    }
    file.sync_all().map_err(|e| e.to_string())
}

/// `$LAKEML_CACHE`, else `$XDG_CACHE_HOME/lakeml`, else `~/.cache/lakeml`: the cache the
/// project's scripts use too.
pub(crate) fn cache_root() -> PathBuf {
    if let Some(dir) = std::env::var_os("LAKEML_CACHE") {
        return PathBuf::from(dir);
    }
    let xdg = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from);
    let home = std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache"));
    xdg.or(home)
        .unwrap_or_else(std::env::temp_dir)
        .join("lakeml")
}

/// Runs `future` to completion from synchronous code, on a thread of its own so it works
/// whether or not the caller is inside a runtime.
pub(crate) fn block_on<T: Send>(
    future: impl std::future::Future<Output = Result<T, String>> + Send,
) -> Result<T, String> {
    std::thread::scope(|s| {
        s.spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("starting an I/O runtime: {e}"))?
                .block_on(future)
        })
        .join()
        .unwrap_or_else(|_| Err("the download thread panicked".into()))
    })
}
