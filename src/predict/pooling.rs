//! Sentence embeddings from an encoder's hidden states, pooled as sentence-transformers
//! configures them in the model directory:
//! - `modules.json` lists the modules: the Transformer, a `Pooling`, optionally `Normalize`;
//! - the Pooling module's `config.json` (`1_Pooling/` as a rule) enables CLS, max, mean,
//!   mean-sqrt-len or last-token pooling, concatenated in that order when several are on;
//! - `Normalize` divides each vector by its L2 norm.
//!
//! A directory without `modules.json` gets mean pooling, unnormalized: what
//! sentence-transformers itself builds for a plain HF model. Modules lakeml does not run
//! (`Dense`, weighted-mean pooling, ...) are refused by name instead of giving other vectors.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;
use tch::{Kind, Tensor};

use crate::error::{Error, Result};

/// One pooling of the token vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Mode {
    Cls,
    Max,
    Mean,
    MeanSqrtLen,
    LastToken,
}

/// How a model's sentence vectors are made.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub(crate) struct Pooling {
    pub modes: Vec<Mode>,
    /// The model's own `Normalize` module.
    pub normalize: bool,
    /// Where the configuration came from, for the report.
    pub source: String,
}

#[derive(Deserialize)]
struct Module {
    #[serde(default)]
    path: String,
    #[serde(rename = "type")]
    kind: String,
}

impl Pooling {
    /// Reads the sentence-transformers configuration of the model in `dir`.
    pub(crate) fn read(dir: &Path) -> Result<Self> {
        let bad = |what: String| Error::Model(format!("{}: {what}", dir.display()));
        let Ok(text) = std::fs::read_to_string(dir.join("modules.json")) else {
            return Ok(Self {
                modes: vec![Mode::Mean],
                normalize: false,
                source: "default: mean pooling, no sentence-transformers modules.json".into(),
            });
        };
        let modules: Vec<Module> = serde_json::from_str(&text)
            .map_err(|e| bad(format!("modules.json is not a list of modules: {e}")))?;
        let mut modes = None;
        let mut normalize = false;
        for (i, m) in modules.iter().enumerate() {
            let kind = m.kind.rsplit('.').next().unwrap_or_default();
            match kind {
                "Transformer" if i == 0 => {}
                "Pooling" if modes.is_none() => {
                    modes = Some(read_pooling(&dir.join(&m.path).join("config.json"))?);
                }
                "Normalize" if modes.is_some() => normalize = true,
                _ => {
                    return Err(bad(format!(
                        "modules.json: module {i} is `{}`, which lakeml does not run; it runs \
                         a Transformer, then Pooling, then optionally Normalize",
                        m.kind
                    )));
                }
            }
        }
        let modes = modes.ok_or_else(|| {
            bad("modules.json has no Pooling module after the Transformer".into())
        })?;
        let source = format!(
            "modules.json: {}{}",
            modes_text(&modes),
            if normalize { ", normalized" } else { "" }
        );
        Ok(Self {
            modes,
            normalize,
            source,
        })
    }

    /// The sentence vectors `[batch, hidden × modes]` (fp32) of `hidden` `[batch, seq,
    /// hidden]` whose real tokens `mask` `[batch, seq]` (1 = token) marks, right-padded;
    /// not normalized (the caller normalizes after any truncation).
    pub(crate) fn pool(&self, hidden: &Tensor, mask: &Tensor) -> Tensor {
        let hidden = hidden.to_kind(Kind::Float);
        let weights = mask.to_kind(Kind::Float).unsqueeze(-1);
        let counts = weights
            .sum_dim_intlist(1, false, Kind::Float)
            .clamp_min(1e-9);
        let sum = || (&hidden * &weights).sum_dim_intlist(1, false, Kind::Float);
        let parts: Vec<Tensor> = self
            .modes
            .iter()
            .map(|mode| match mode {
                Mode::Cls => hidden.select(1, 0),
                Mode::Max => hidden.masked_fill(&weights.eq(0.0), -1e9).amax(1, false),
                Mode::Mean => sum() / &counts,
                Mode::MeanSqrtLen => sum() / counts.sqrt(),
                Mode::LastToken => {
                    let last = (mask.sum_dim_intlist(1, false, Kind::Int64) - 1).clamp_min(0);
                    let index = last
                        .view([-1, 1, 1])
                        .expand([-1, 1, hidden.size()[2]], false);
                    hidden.gather(1, &index, false).squeeze_dim(1)
                }
            })
            .collect();
        Tensor::cat(&parts, 1)
    }

    /// The width of a pooled vector for an encoder of `hidden` units.
    pub(crate) fn width(&self, hidden: usize) -> usize {
        hidden * self.modes.len()
    }
}

/// Each row divided by its L2 norm (a zero row stays zero), as `F.normalize` does.
pub(crate) fn normalized(x: &Tensor) -> Tensor {
    let norm = x
        .square()
        .sum_dim_intlist(-1, true, Kind::Float)
        .sqrt()
        .clamp_min(1e-12);
    x / norm
}

fn modes_text(modes: &[Mode]) -> String {
    let names: Vec<String> = modes
        .iter()
        .map(|m| {
            serde_json::to_value(m)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default()
        })
        .collect();
    format!("{} pooling", names.join(" + "))
}

/// The modes a Pooling `config.json` turns on, in sentence-transformers' concatenation order.
fn read_pooling(path: &Path) -> Result<Vec<Mode>> {
    let bad = |what: String| Error::Model(format!("{}: {what}", path.display()));
    let text = std::fs::read_to_string(path)
        .map_err(|e| bad(format!("cannot read the Pooling module's config: {e}")))?;
    let config: Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let on = |key: &str| config.get(key).and_then(Value::as_bool).unwrap_or(false);
    if on("pooling_mode_weightedmean_tokens") {
        return Err(bad(
            "weighted-mean pooling is not supported; lakeml pools by CLS, max, mean, \
             mean-sqrt-len or last token"
                .into(),
        ));
    }
    let modes: Vec<Mode> = [
        ("pooling_mode_cls_token", Mode::Cls),
        ("pooling_mode_max_tokens", Mode::Max),
        ("pooling_mode_mean_tokens", Mode::Mean),
        ("pooling_mode_mean_sqrt_len_tokens", Mode::MeanSqrtLen),
        ("pooling_mode_lasttoken", Mode::LastToken),
    ]
    .into_iter()
    .filter(|(key, _)| on(key))
    .map(|(_, mode)| mode)
    .collect();
    if modes.is_empty() {
        return Err(bad("turns no pooling mode on".into()));
    }
    Ok(modes)
}
