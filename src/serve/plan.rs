//! Checks a pipeline file's `serve:` section before anything binds or loads: the address,
//! the models (trained classifiers with `id2label`, or encoders whose only function is
//! `embed`), the users file, TLS files and limits.
//! Every error names the field and says what to do.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::auth::Auth;
use crate::catalog::TableKind;
use crate::config::{ServeSpec, parse_duration};
use crate::model::ModelConfig;
use crate::plan::{Inference, Pipeline, inference_settings, model_labels};
use crate::predict::{Pooling, PredictSettings};

/// Rows the engine reads per window for served models (a query's batch is smaller).
const SERVE_BATCH_ROWS: usize = 8192;

/// A validated `serve:` section.
pub(crate) struct ServeConfig {
    pub listen: SocketAddr,
    pub models: Vec<ServedModel>,
    pub auth: Option<Auth>,
    /// PEM certificate chain and private key.
    pub tls: Option<(Vec<u8>, Vec<u8>)>,
    pub max_queries: usize,
    pub query_timeout: Duration,
    pub grace: Duration,
    /// Tables held in memory (`serve.memory`).
    pub memory: BTreeSet<String>,
}

/// A model served as SQL functions.
pub(crate) struct ServedModel {
    pub name: String,
    pub dir: PathBuf,
    pub config: ModelConfig,
    /// Empty for a model without `id2label`: it serves `embed` only.
    pub labels: Vec<String>,
    /// How `embed` pools its hidden states (sentence-transformers' modules, else mean).
    pub pooling: Pooling,
    pub device: tch::Device,
    pub settings: PredictSettings,
    /// `predict()` is this model.
    pub default: bool,
}

/// SQL words and built-in functions a model may not be named after.
const TAKEN: &[&str] = &[
    "select", "from", "where", "table", "count", "sum", "avg", "min", "max",
];

impl ServeConfig {
    /// Validates `pipeline`'s `serve:` section; `listen` overrides its address.
    pub(crate) fn from_pipeline(pipeline: &Pipeline, listen: Option<&str>) -> Result<Self, String> {
        let spec: &ServeSpec = pipeline.serve.as_ref().ok_or(
            "the file has no `serve` section; add one, e.g.\n  serve:\n    listen: \
             127.0.0.1:50051\n    models:\n      sentiment: ../runs/rotten-tomatoes/model",
        )?;
        let base = &pipeline.base;
        let address = listen.unwrap_or(&spec.listen);
        let field = if listen.is_some() {
            "--listen"
        } else {
            "serve.listen"
        };
        let listen: SocketAddr = address.parse().map_err(|e| {
            format!("{field}: `{address}` is not an address ({e}); write e.g. `127.0.0.1:50051`")
        })?;

        let mut models = Vec::new();
        for (name, entry) in &spec.models {
            let m = &entry.0;
            let f = format!("serve.models.{name}");
            let ok_name = name.chars().next().is_some_and(|c| c.is_ascii_lowercase())
                && name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            if !ok_name || TAKEN.contains(&name.as_str()) || name.starts_with("predict") {
                return Err(format!(
                    "{f}: `{name}` cannot name SQL functions; use lower-case letters, digits and \
                     `_`, starting with a letter (not `predict…` or an SQL word)"
                ));
            }
            let dir = crate::storage::model_dir(base, &m.path, &pipeline.storage)
                .map_err(|e| format!("{f}: {e}"))?;
            if !dir.is_dir() {
                return Err(format!(
                    "{f}: `{}` is not a directory; give a fine-tuned model directory (the \
                     `model/` under a train stage's `output`)",
                    dir.display()
                ));
            }
            let config = ModelConfig::load(&dir).map_err(|e| format!("{f}: {e}"))?;
            if !dir.join("tokenizer.json").is_file() {
                return Err(format!(
                    "{f}: `{}` has no tokenizer.json; a model directory holds the tokenizer \
                     that made its training data",
                    dir.display()
                ));
            }
            let labels = match config.labels().map_err(|e| format!("{f}: {e}"))? {
                Some(_) => model_labels(&dir, &config, None).map_err(|e| format!("{f}: {e}"))?,
                None => Vec::new(),
            };
            let pooling = Pooling::read(&dir).map_err(|e| format!("{f}: {e}"))?;
            let (device, settings) = inference_settings(
                &f,
                &config,
                &Inference {
                    device: &m.device,
                    precision: m.precision,
                    threads: m.threads,
                    replicas: m.replicas,
                    max_length: m.max_length,
                    truncation: m.truncation,
                    batch_tokens: m.batch_tokens,
                    batch_rows: SERVE_BATCH_ROWS,
                    logits: false,
                },
            )?;
            models.push(ServedModel {
                name: name.clone(),
                dir,
                config,
                labels,
                pooling,
                device,
                settings,
                default: m.default,
            });
        }
        match models.iter().filter(|m| m.default).count() {
            0 if models.len() == 1 => models[0].default = true,
            0 | 1 => {}
            _ => {
                return Err(
                    "serve.models: more than one model has `default: true`; mark one".into(),
                );
            }
        }

        let auth = match &spec.auth {
            Some(a) => Some(Auth::from_spec(a, base)?),
            None => None,
        };
        if auth.is_none() && !listen.ip().is_loopback() {
            return Err(format!(
                "serve.auth: listening on {listen} (not a loopback address) needs `auth`: a \
                 `users_file` or `tokens`; or listen on 127.0.0.1"
            ));
        }
        let tls = match &spec.tls {
            Some(t) => {
                let read = |key: &str, path: &str| {
                    let p = crate::plan::resolve(base, path);
                    std::fs::read(&p)
                        .map_err(|e| format!("serve.tls.{key}: cannot read `{}`: {e}", p.display()))
                };
                let (cert, key) = (read("cert", &t.cert)?, read("key", &t.key)?);
                check_pem(&cert, "serve.tls.cert", "CERTIFICATE")?;
                check_pem(&key, "serve.tls.key", "PRIVATE KEY")?;
                Some((cert, key))
            }
            None => None,
        };
        if spec.limits.max_concurrent_queries == 0 {
            return Err("serve.limits.max_concurrent_queries: must be at least 1".into());
        }
        let duration = |f: &str, text: &str| {
            parse_duration(text)
                .map_err(|e| format!("{f}: {e}"))
                .and_then(|d| {
                    if d.is_zero() {
                        Err(format!("{f}: must be more than 0"))
                    } else {
                        Ok(d)
                    }
                })
        };
        let mut memory = BTreeSet::new();
        for name in &spec.memory {
            let def = pipeline.tables.get(name).ok_or_else(|| {
                format!(
                    "serve.memory: `{name}` is not a declared table (declared: {})",
                    pipeline
                        .tables
                        .keys()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })?;
            if !matches!(def.kind, TableKind::Delta { .. }) {
                return Err(format!(
                    "serve.memory: `{name}` is not a Delta table; only Delta tables can be held \
                     in memory (their versions say when the copy is stale)"
                ));
            }
            memory.insert(name.clone());
        }
        Ok(Self {
            listen,
            models,
            memory,
            auth,
            tls,
            max_queries: spec.limits.max_concurrent_queries,
            query_timeout: duration("serve.limits.query_timeout", &spec.limits.query_timeout)?,
            grace: parse_duration(&spec.shutdown_grace)
                .map_err(|e| format!("serve.shutdown_grace: {e}"))?,
        })
    }

    /// Models by SQL function prefix: each model's own name, and `predict` for the default.
    pub(crate) fn prefixes(&self) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        for (i, m) in self.models.iter().enumerate() {
            out.insert(m.name.clone(), i);
            if m.default {
                out.insert("predict".to_string(), i);
            }
        }
        out
    }
}

/// A PEM file must hold a block of the expected kind (the TLS library's own error comes only
/// at the first connection).
fn check_pem(bytes: &[u8], field: &str, kind: &str) -> Result<(), String> {
    let text = String::from_utf8_lossy(bytes);
    if text.contains("-----BEGIN") && text.contains(kind) {
        Ok(())
    } else {
        Err(format!(
            "{field}: not a PEM file with a {kind} block; give the PEM-encoded file"
        ))
    }
}
