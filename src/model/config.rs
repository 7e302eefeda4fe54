//! `config.json` as HF writes it: the architecture is picked by `model_type`.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};

/// The `model_type` values lakeml implements, for error messages.
pub(crate) const SUPPORTED: &[&str] = &["bert", "roberta", "distilbert", "deberta-v2"];

/// A parsed `config.json`, plus the file as read (saved back with new labels).
#[derive(Debug, Clone)]
pub(crate) struct ModelConfig {
    pub arch: Arch,
    pub raw: serde_json::Map<String, serde_json::Value>,
}

/// The architecture and its hyperparameters.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "model_type")]
pub(crate) enum Arch {
    #[serde(rename = "bert")]
    Bert(super::bert::Config),
    #[serde(rename = "roberta")]
    Roberta(super::bert::Config),
    #[serde(rename = "distilbert")]
    DistilBert(super::distilbert::Config),
    /// DeBERTa-v2 and DeBERTa-v3 (v3 checkpoints say `deberta-v2` too).
    #[serde(rename = "deberta-v2")]
    DebertaV2(super::deberta::Config),
}

impl Arch {
    /// The name HF gives the base model inside a `*ForSequenceClassification` checkpoint.
    pub(crate) fn prefix(&self) -> &'static str {
        match self {
            Arch::Bert(_) => "bert",
            Arch::Roberta(_) => "roberta",
            Arch::DistilBert(_) => "distilbert",
            Arch::DebertaV2(_) => "deberta",
        }
    }

    /// The `architectures` entry of a saved classifier.
    pub(crate) fn class_name(&self) -> &'static str {
        match self {
            Arch::Bert(_) => "BertForSequenceClassification",
            Arch::Roberta(_) => "RobertaForSequenceClassification",
            Arch::DistilBert(_) => "DistilBertForSequenceClassification",
            Arch::DebertaV2(_) => "DebertaV2ForSequenceClassification",
        }
    }

    /// The width of the encoder's hidden states.
    pub(crate) fn hidden_size(&self) -> i64 {
        match self {
            Arch::Bert(c) | Arch::Roberta(c) => c.hidden_size,
            Arch::DistilBert(c) => c.dim,
            Arch::DebertaV2(c) => c.hidden_size,
        }
    }

    pub(crate) fn vocab_size(&self) -> i64 {
        match self {
            Arch::Bert(c) | Arch::Roberta(c) => c.vocab_size,
            Arch::DistilBert(c) => c.vocab_size,
            Arch::DebertaV2(c) => c.vocab_size(),
        }
    }

    pub(crate) fn pad_token_id(&self) -> i64 {
        match self {
            Arch::Bert(c) | Arch::Roberta(c) => c.pad_token_id,
            Arch::DistilBert(c) => c.pad_token_id,
            Arch::DebertaV2(c) => c.pad_token_id(),
        }
    }

    /// Longest input the position embeddings allow.
    pub(crate) fn max_positions(&self) -> i64 {
        match self {
            Arch::Bert(c) => c.max_position_embeddings,
            // RoBERTa's positions start after the padding index.
            Arch::Roberta(c) => c.max_position_embeddings - c.pad_token_id - 1,
            Arch::DistilBert(c) => c.max_position_embeddings,
            Arch::DebertaV2(c) => c.max_positions(),
        }
    }
}

impl ModelConfig {
    /// Reads `dir/config.json`.
    pub(crate) fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| {
            Error::Model(format!(
                "cannot read {}: {e}; a model directory holds config.json, model.safetensors and tokenizer.json",
                path.display()
            ))
        })?;
        let raw: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&text)
            .map_err(|e| Error::Model(format!("{} is not valid JSON: {e}", path.display())))?;
        let model_type = raw
            .get("model_type")
            .and_then(|v| v.as_str())
            .ok_or_else(|| {
                Error::Model(format!(
                    "{} has no `model_type`; lakeml supports {}",
                    path.display(),
                    SUPPORTED.join(", ")
                ))
            })?;
        if !SUPPORTED.contains(&model_type) {
            return Err(Error::Model(format!(
                "{}: model_type `{model_type}` is not supported; lakeml supports {}",
                path.display(),
                SUPPORTED.join(", ")
            )));
        }
        let arch = Arch::deserialize(serde_json::Value::Object(raw.clone()))
            .map_err(|e| Error::Model(format!("{}: {e}", path.display())))?;
        Ok(Self { arch, raw })
    }

    /// Class names by id, from `id2label`; `None` when the config has none.
    pub(crate) fn labels(&self) -> Result<Option<Vec<String>>> {
        let Some(map) = self.raw.get("id2label").and_then(|v| v.as_object()) else {
            return Ok(None);
        };
        let mut names = vec![None; map.len()];
        for (id, name) in map {
            let slot = id
                .parse::<usize>()
                .ok()
                .and_then(|i| names.get_mut(i))
                .ok_or_else(|| {
                    Error::Model(format!(
                        "config.json: id2label key `{id}` is not a class id in 0..{}; ids must \
                         run from 0 without gaps",
                        map.len()
                    ))
                })?;
            *slot = Some(
                name.as_str()
                    .map_or_else(|| name.to_string(), str::to_string),
            );
        }
        Ok(Some(names.into_iter().flatten().collect()))
    }

    /// `config.json` for a saved classifier with these labels.
    pub(crate) fn with_labels(&self, labels: &[String]) -> serde_json::Value {
        let mut raw = self.raw.clone();
        let id2label: serde_json::Map<_, _> = labels
            .iter()
            .enumerate()
            .map(|(i, l)| (i.to_string(), serde_json::Value::from(l.clone())))
            .collect();
        let label2id: serde_json::Map<_, _> = labels
            .iter()
            .enumerate()
            .map(|(i, l)| (l.clone(), serde_json::Value::from(i)))
            .collect();
        raw.insert("id2label".into(), id2label.into());
        raw.insert("label2id".into(), label2id.into());
        raw.insert("num_labels".into(), labels.len().into());
        raw.insert(
            "architectures".into(),
            serde_json::json!([self.arch.class_name()]),
        );
        raw.insert("problem_type".into(), "single_label_classification".into());
        serde_json::Value::Object(raw)
    }
}
