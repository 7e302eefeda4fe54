//! A training run's directory in an object store (`train.output: s3://…`).
//!
//! The trainer works in a local copy under the cache (`runs/<hash>/`), and what it writes is
//! uploaded as it is written, so a run killed on one machine resumes on another:
//! - a checkpoint directory is uploaded with its marker file last, after the old marker was
//!   deleted: a reader that finds the marker finds the whole directory ([`Mirror::push_dir`]);
//! - the model directory is uploaded to a temporary prefix, copied into place inside the
//!   store, and stamped complete by [`STAMP`], written last ([`Mirror::publish`]). Readers
//!   ([`super::model_dir`]) refuse a directory whose stamp says it is still being written.
//!
//! A local manifest records each file's size and ETag as uploaded or downloaded, so a file
//! already here is not fetched again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::TryStreamExt;
use object_store::path::Path as Key;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload, WriteMultipart};

use super::cache::{block_on, cache_root, download, short_hash};
use super::stamp::{STAMP, Stamp};
use super::{Defaults, Location, Remote, StorageOptions};

/// Files up to this size are one PUT; larger ones a multipart upload in parts of this size.
const PART: usize = 16 << 20;

const MANIFEST: &str = ".lakeml-mirror.json";

/// A run directory given as `train.output`: the local directory the trainer writes, and the
/// object-store prefix it is mirrored to, if any. A URL is probed before any work.
pub(crate) fn run_dir(
    base: &Path,
    text: &str,
    defaults: &Defaults,
) -> Result<(PathBuf, Option<Remote>), String> {
    match Location::parse(base, text, defaults, &StorageOptions::default())? {
        Location::Local(path) => Ok((path, None)),
        Location::Remote(remote) => {
            block_on(remote.probe())?;
            Ok((local_dir(&remote), Some(remote)))
        }
    }
}

/// The cache directory that holds the local copy of a remote run directory.
fn local_dir(remote: &Remote) -> PathBuf {
    cache_root()
        .join("runs")
        .join(short_hash(remote.url().as_str()))
}

/// A local run directory and the object-store prefix it is mirrored to.
#[derive(Debug)]
pub(crate) struct Mirror {
    remote: Remote,
    store: Arc<dyn ObjectStore>,
    prefix: Key,
    local: PathBuf,
}

/// size and ETag of each file, by its path relative to the run directory.
type Manifest = BTreeMap<String, (u64, Option<String>)>;

impl Mirror {
    pub(crate) fn new(remote: &Remote) -> Result<Self, String> {
        Ok(Self {
            store: remote.store()?,
            prefix: remote.key()?,
            local: local_dir(remote),
            remote: remote.clone(),
        })
    }

    /// `url/rel`, for messages and reports.
    pub(crate) fn url_of(&self, rel: &str) -> String {
        format!("{}/{rel}", self.remote.url().as_str().trim_end_matches('/'))
    }

    fn key(&self, rel: &str) -> Key {
        self.prefix.parts().chain(Key::from(rel).parts()).collect()
    }

    fn fail(&self, what: &str) -> impl Fn(object_store::Error) -> String + '_ {
        let what = what.to_string();
        move |e| format!("{what}: {}", super::explain(&self.remote, &e))
    }

    fn manifest(&self) -> Manifest {
        std::fs::read(self.local.join(MANIFEST))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }

    fn save_manifest(&self, manifest: &Manifest) -> Result<(), String> {
        let text = serde_json::to_vec_pretty(manifest).map_err(|e| e.to_string())?;
        std::fs::create_dir_all(&self.local)
            .and_then(|()| std::fs::write(self.local.join(MANIFEST), text))
            .map_err(|e| format!("{}: {e}", self.local.display()))
    }

    /// Uploads the local file `rel` to `rel` under the prefix.
    pub(crate) fn push_file(&self, rel: &str) -> Result<(), String> {
        block_on(async {
            let mut manifest = self.manifest();
            self.upload(rel, rel, &mut manifest).await?;
            self.save_manifest(&manifest)
        })
    }

    /// Uploads every file under the local directory `rel`; with a `marker` (a file in it),
    /// the store's old marker is deleted first and the new one uploaded last, so the
    /// marker's presence means the directory is whole. Objects under `rel` that are not
    /// local any more are deleted.
    pub(crate) fn push_dir(&self, rel: &str, marker: Option<&str>) -> Result<(), String> {
        block_on(async {
            let marker = marker.map(|m| format!("{rel}/{m}"));
            if let Some(m) = &marker {
                self.delete(m).await?;
            }
            let mut manifest = self.manifest();
            let files = local_files(&self.local, rel)?;
            for file in files.iter().filter(|f| Some(*f) != marker.as_ref()) {
                self.upload(file, file, &mut manifest).await?;
            }
            for stale in self.list(rel).await?.into_keys() {
                if !files.contains(&stale) {
                    self.delete(&stale).await?;
                    manifest.remove(&stale);
                }
            }
            if let Some(m) = &marker {
                self.upload(m, m, &mut manifest).await?;
            }
            self.save_manifest(&manifest)
        })
    }

    /// Deletes every object under `rel`, the directory's `marker` first.
    pub(crate) fn remove_dir(&self, rel: &str, marker: Option<&str>) -> Result<(), String> {
        block_on(async {
            if let Some(m) = marker {
                self.delete(&format!("{rel}/{m}")).await?;
            }
            let mut manifest = self.manifest();
            for name in self.list(rel).await?.into_keys() {
                self.delete(&name).await?;
                manifest.remove(&name);
            }
            self.save_manifest(&manifest)
        })
    }

    /// Names of the directories directly under `rel` that hold `marker`: the whole ones.
    pub(crate) fn whole_dirs(&self, rel: &str, marker: &str) -> Result<Vec<String>, String> {
        block_on(async {
            let mut out: Vec<String> = self
                .list(rel)
                .await?
                .into_keys()
                .filter_map(|name| {
                    let rest = name.strip_prefix(&format!("{rel}/"))?;
                    let (dir, file) = rest.split_once('/')?;
                    (file == marker).then(|| dir.to_string())
                })
                .collect();
            out.sort();
            out.dedup();
            Ok(out)
        })
    }

    /// Makes the local `rel` (a file, or a directory and everything under it) what the store
    /// holds under `rel`, downloading only what the manifest does not already have; `rel`
    /// is removed locally when the store has nothing there.
    pub(crate) fn pull(&self, rel: &str) -> Result<(), String> {
        block_on(async {
            let mut manifest = self.manifest();
            let mut remote = self.list(rel).await?;
            // Nothing under `rel/`: it may be a single object.
            if remote.is_empty()
                && let Ok(meta) = self.store.head(&self.key(rel)).await
            {
                remote.insert(rel.to_string(), (meta.size, meta.e_tag));
            }
            let target = self.local.join(rel);
            let here: Vec<String> = if target.is_dir() {
                local_files(&self.local, rel)?
            } else if target.is_file() {
                vec![rel.to_string()]
            } else {
                Vec::new()
            };
            for name in here.iter().filter(|n| !remote.contains_key(*n)) {
                let path = self.local.join(name);
                std::fs::remove_file(&path).map_err(|e| format!("{}: {e}", path.display()))?;
                manifest.remove(name);
            }
            for (name, identity) in &remote {
                let path = self.local.join(name);
                if manifest.get(name) == Some(identity) && path.is_file() {
                    continue;
                }
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
                }
                let partial = path.with_extension("partial");
                download(self.store.as_ref(), &self.key(name), &partial)
                    .await
                    .map_err(|e| format!("{}: {e}", self.url_of(name)))?;
                std::fs::rename(&partial, &path).map_err(|e| format!("{}: {e}", path.display()))?;
                manifest.insert(name.clone(), identity.clone());
            }
            if remote.is_empty() && target.is_dir() {
                let _ = std::fs::remove_dir_all(&target);
            }
            self.save_manifest(&manifest)
        })
    }

    /// The object `rel`, if there is one.
    pub(crate) fn read(&self, rel: &str) -> Result<Option<Vec<u8>>, String> {
        block_on(async {
            match self.store.get(&self.key(rel)).await {
                Ok(got) => Ok(Some(
                    got.bytes()
                        .await
                        .map_err(self.fail(&self.url_of(rel)))?
                        .to_vec(),
                )),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(self.fail(&self.url_of(rel))(e)),
            }
        })
    }

    /// Publishes the local model directory `rel`: its files go to a temporary prefix, the
    /// stamp of `rel` turns to `writing`, the files are copied into `rel` inside the store
    /// (objects of an older model that are not in this one are deleted), and the stamp turns
    /// `complete` last. A reader sees a complete model or a refusal, never a mix.
    pub(crate) fn publish(&self, rel: &str) -> Result<(), String> {
        block_on(async {
            let staging = format!(".{rel}.tmp-{}", uuid::Uuid::new_v4().simple());
            let files = local_files(&self.local, rel)?;
            let mut manifest = self.manifest();
            let mut sizes = BTreeMap::new();
            for file in &files {
                let name = &file[rel.len() + 1..];
                let size = std::fs::metadata(self.local.join(file))
                    .map_err(|e| format!("{file}: {e}"))?
                    .len();
                sizes.insert(name.to_string(), size);
                self.upload(file, &format!("{staging}/{name}"), &mut manifest)
                    .await?;
            }
            self.stamp(rel, &Stamp::new("writing", BTreeMap::new()))
                .await?;
            for name in sizes.keys() {
                let (from, to) = (format!("{staging}/{name}"), format!("{rel}/{name}"));
                self.store
                    .copy(&self.key(&from), &self.key(&to))
                    .await
                    .map_err(self.fail(&format!("copying the model into {}", self.url_of(rel))))?;
                manifest.remove(&to);
            }
            for old in self.list(rel).await?.into_keys() {
                let name = &old[rel.len() + 1..];
                if name != STAMP && !sizes.contains_key(name) {
                    self.delete(&old).await?;
                }
            }
            self.stamp(rel, &Stamp::new("complete", sizes)).await?;
            // This upload's staging prefix, and any a killed run left behind.
            let left = format!(".{rel}.tmp-");
            for name in self.list_top().await? {
                if name.starts_with(&left) {
                    for object in self.list(&name).await?.into_keys() {
                        self.delete(&object).await?;
                        manifest.remove(&object);
                    }
                }
            }
            self.save_manifest(&manifest)
        })
    }

    async fn stamp(&self, rel: &str, stamp: &Stamp) -> Result<(), String> {
        let body = serde_json::to_vec_pretty(stamp).map_err(|e| e.to_string())?;
        let key = self.key(&format!("{rel}/{STAMP}"));
        self.store
            .put(&key, PutPayload::from(body))
            .await
            .map(|_| ())
            .map_err(self.fail(&format!("stamping {}", self.url_of(rel))))
    }

    /// The objects under `rel/`, by path relative to the prefix: size and ETag.
    async fn list(&self, rel: &str) -> Result<Manifest, String> {
        let key = self.key(rel);
        let objects: Vec<object_store::ObjectMeta> = self
            .store
            .list(Some(&key))
            .try_collect()
            .await
            .map_err(self.fail(&format!("listing {}", self.url_of(rel))))?;
        Ok(objects
            .into_iter()
            .filter_map(|meta| {
                let parts: Vec<String> = meta
                    .location
                    .prefix_match(&self.prefix)?
                    .map(|p| p.as_ref().to_string())
                    .collect();
                Some((parts.join("/"), (meta.size, meta.e_tag)))
            })
            .collect())
    }

    /// The names of the directories directly under the prefix.
    async fn list_top(&self) -> Result<Vec<String>, String> {
        let listed = self
            .store
            .list_with_delimiter(Some(&self.prefix))
            .await
            .map_err(self.fail(&format!("listing {}", self.remote.url())))?;
        Ok(listed
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename().map(str::to_string))
            .collect())
    }

    async fn delete(&self, rel: &str) -> Result<(), String> {
        match self.store.delete(&self.key(rel)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.fail(&format!("deleting {}", self.url_of(rel)))(e)),
        }
    }

    /// Uploads the local file `rel` as `to`: one PUT, or a multipart upload when large.
    async fn upload(&self, rel: &str, to: &str, manifest: &mut Manifest) -> Result<(), String> {
        use std::io::Read;
        let path = self.local.join(rel);
        let io = |e: std::io::Error| format!("{}: {e}", path.display());
        let size = std::fs::metadata(&path).map_err(io)?.len();
        let key = self.key(to);
        let failed = self.fail(&format!("uploading {}", self.url_of(to)));
        let put = if size <= PART as u64 {
            let body = std::fs::read(&path).map_err(io)?;
            self.store.put(&key, PutPayload::from(body)).await
        } else {
            let upload = self.store.put_multipart(&key).await.map_err(&failed)?;
            let mut writer = WriteMultipart::new_with_chunk_size(upload, PART);
            let mut file = std::fs::File::open(&path).map_err(io)?;
            let mut buf = vec![0u8; PART];
            loop {
                let n = file.read(&mut buf).map_err(io)?;
                if n == 0 {
                    break;
                }
                writer.wait_for_capacity(4).await.map_err(&failed)?;
                writer.write(&buf[..n]);
            }
            writer.finish().await
        };
        let put = put.map_err(failed)?;
        manifest.insert(to.to_string(), (size, put.e_tag));
        Ok(())
    }
}

/// Every file under the local directory `base/rel`, as paths relative to `base`, sorted.
fn local_files(base: &Path, rel: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut pending = vec![base.join(rel)];
    while let Some(dir) = pending.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if let Ok(relative) = path.strip_prefix(base) {
                out.push(relative.to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    Ok(out)
}
