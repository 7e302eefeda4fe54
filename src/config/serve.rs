//! The `serve:` section of a pipeline file: what `pipeline serve` listens on, which models
//! it exposes as SQL functions, who may call it, and its limits.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;
use serde::de::{self, MapAccess, Visitor};

use super::{Precision, Truncation, default_device};

/// `serve:`: the Flight SQL server over the pipeline's tables.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ServeSpec {
    /// `host:port` (port 0 picks a free one); default `127.0.0.1:50051`.
    #[serde(default = "default_listen")]
    pub listen: String,
    /// SQL function name → a fine-tuned HF classifier directory (or a map with `path`).
    #[serde(default)]
    pub models: BTreeMap<String, ModelEntry>,
    pub auth: Option<AuthSpec>,
    pub tls: Option<TlsSpec>,
    #[serde(default)]
    pub limits: LimitsSpec,
    /// Delta tables held in memory at their latest version (reloaded when a new version
    /// commits), for queries that scan them whole, such as an exact vector search.
    #[serde(default)]
    pub memory: Vec<String>,
    /// How long queries in flight may run on after SIGINT/SIGTERM (default `30s`).
    #[serde(default = "default_grace")]
    pub shutdown_grace: String,
}

/// A served model: its directory, and how to run it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ServeModelSpec {
    /// A fine-tuned HF classifier directory (config.json with id2label, weights, tokenizer).
    pub path: String,
    /// `predict()` calls this model (needed when there are several).
    #[serde(default)]
    pub default: bool,
    #[serde(default = "default_device")]
    pub device: String,
    pub precision: Option<Precision>,
    pub threads: Option<usize>,
    pub replicas: Option<usize>,
    pub max_length: Option<usize>,
    #[serde(default)]
    pub truncation: Truncation,
    pub batch_tokens: Option<usize>,
}

/// A model is a path (`sentiment: ../runs/x/model`) or a map with `path` and settings.
impl<'de> Deserialize<'de> for ModelEntry {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ModelEntry;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a model directory, or a map with `path` and settings")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(ModelEntry(ServeModelSpec {
                    path: v.to_string(),
                    default: false,
                    device: default_device(),
                    precision: None,
                    threads: None,
                    replicas: None,
                    max_length: None,
                    truncation: Truncation::default(),
                    batch_tokens: None,
                }))
            }
            fn visit_map<M: MapAccess<'de>>(self, map: M) -> Result<Self::Value, M::Error> {
                ServeModelSpec::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(ModelEntry)
            }
        }
        d.deserialize_any(V)
    }
}

/// What a `models:` entry deserializes through.
#[derive(Debug)]
pub(crate) struct ModelEntry(pub ServeModelSpec);

/// `auth:`: a users file (passwords, hashed), static bearer tokens, or both.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AuthSpec {
    /// A YAML file `users: {name: {password: <argon2 hash>, tables: [..]}}`.
    pub users_file: Option<String>,
    /// Bearer tokens accepted without a handshake, e.g. `["${LAKEML_TOKEN}"]`; full access.
    #[serde(default)]
    pub tokens: Vec<String>,
    /// How long a token from a handshake stays valid (default `12h`).
    #[serde(default = "default_token_ttl")]
    pub token_ttl: String,
}

/// `tls:`: PEM files of the server's certificate chain and private key.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TlsSpec {
    pub cert: String,
    pub key: String,
}

/// `limits:`: per-query limits.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LimitsSpec {
    /// Queries running at once; more are refused with RESOURCE_EXHAUSTED (default 64).
    #[serde(default = "default_max_queries")]
    pub max_concurrent_queries: usize,
    /// A query running longer is stopped with DEADLINE_EXCEEDED (default `10m`).
    #[serde(default = "default_query_timeout")]
    pub query_timeout: String,
}

impl Default for LimitsSpec {
    fn default() -> Self {
        Self {
            max_concurrent_queries: default_max_queries(),
            query_timeout: default_query_timeout(),
        }
    }
}

fn default_listen() -> String {
    "127.0.0.1:50051".into()
}
fn default_grace() -> String {
    "30s".into()
}
fn default_token_ttl() -> String {
    "12h".into()
}
fn default_max_queries() -> usize {
    64
}
fn default_query_timeout() -> String {
    "10m".into()
}

/// A duration written as a number and a unit: `250ms`, `30s`, `5m`, `12h`, `1d`.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let bad = || format!("`{text}` is not a duration; write e.g. `250ms`, `30s`, `5m`, `12h`");
    let n: u64 = number.parse().map_err(|_| bad())?;
    let ms = match unit.trim() {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(bad()),
    };
    n.checked_mul(ms).map(Duration::from_millis).ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_take_a_unit() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration(" 2h "), Ok(Duration::from_secs(7200)));
        for bad in ["", "5", "m", "1.5s", "-1s", "5 parsecs"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_model_is_a_path_or_a_map() {
        let spec: ServeSpec = serde_yaml_ng::from_str(
            "models:\n  a: dir/a\n  b: { path: dir/b, default: true, precision: bf16 }\n",
        )
        .expect("parse");
        assert_eq!(spec.models["a"].0.path, "dir/a");
        assert!(spec.models["b"].0.default);
        let err = serde_yaml_ng::from_str::<ServeSpec>("models:\n  b: { path: x, colour: 1 }\n")
            .expect_err("unknown key");
        assert!(err.to_string().contains("colour"), "{err}");
    }
}
