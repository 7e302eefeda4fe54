//! Planning a `predict` or `embed` stage: the model directory (or the train stage that will
//! write it), its labels or its pooling, the device and the batching settings, checked
//! before any work.

use std::path::{Path, PathBuf};

use super::train::device;
use super::{Stage, query};
use crate::config::{
    OnInvalidUtf8, OnOverlong, Precision, PredictMode, PredictSpec, Quantize, Truncation,
};
use crate::model::ModelConfig;
use crate::predict::{Pooling, PredictSettings};
use crate::tokenize::RowPolicy;

/// Most tokens per row when neither the pipeline nor the model says fewer.
const DEFAULT_MAX_LENGTH: usize = 512;

/// Padded tokens per forward pass: on CPU, larger passes gain nothing and leave the cache;
/// a GPU wants many rows at once.
const CPU_BATCH_TOKENS: usize = 4096;
const CUDA_BATCH_TOKENS: usize = 65536;

/// A validated `predict` stage.
#[derive(Debug)]
pub(crate) struct PredictStage {
    pub name: String,
    pub field: String,
    pub query: super::Query,
    pub to: String,
    pub model: PathBuf,
    /// Columns and row policies, as for tokenize (no label).
    pub policy: RowPolicy,
    pub mode: PredictMode,
    /// Key of the job in the table's Delta app transactions.
    pub job: Option<String>,
    /// Class names the model must have.
    pub labels: Option<Vec<String>>,
    /// An `embed` stage's vectors; `None`: class predictions.
    pub embed: Option<Embedding>,
    pub device: tch::Device,
    pub settings: PredictSettings,
}

/// What an `embed` stage writes: `dims` values per row, pooled as `pooling` says.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Embedding {
    pub pooling: Pooling,
    pub dims: usize,
    pub normalize: bool,
    /// Stored quantized (`embedding_scale` then follows `embedding`).
    pub quantize: Option<Quantize>,
}

impl PredictStage {
    /// `predict` or `embed`.
    pub(crate) fn kind(&self) -> &'static str {
        if self.embed.is_some() {
            "embed"
        } else {
            "predict"
        }
    }
}

/// `max_seq_length` of a sentence-transformers model (`sentence_bert_config.json`): the
/// length its vectors were made with.
fn sentence_max_length(dir: &Path) -> Option<usize> {
    let text = std::fs::read_to_string(dir.join("sentence_bert_config.json")).ok()?;
    let config: serde_json::Value = serde_json::from_str(&text).ok()?;
    usize::try_from(config.get("max_seq_length")?.as_u64()?).ok()
}

/// The `embed` settings of a stage, checked; and that it sets no `predict`-only key.
fn embedding(
    f: &str,
    p: &PredictSpec,
    model: &Path,
    config: &ModelConfig,
) -> Result<Embedding, String> {
    for (key, given) in [
        ("labels", p.labels.is_some()),
        ("logits", p.logits),
        ("text_pair", p.text_pair.is_some()),
    ] {
        if given {
            return Err(format!(
                "{f}.{key}: applies to predict stages; an embed stage writes one vector per text"
            ));
        }
    }
    let pooling = Pooling::read(model).map_err(|e| format!("{f}.model: {e}"))?;
    let width = pooling.width(usize::try_from(config.arch.hidden_size()).unwrap_or(0));
    let dims = p.dims.unwrap_or(width);
    if dims == 0 || dims > width {
        return Err(format!(
            "{f}.dims: {dims} is out of range; the model's vectors have {width} values, so \
             give 1..={width}"
        ));
    }
    Ok(Embedding {
        normalize: p.normalize.unwrap_or(pooling.normalize),
        pooling,
        dims,
        quantize: p.quantize,
    })
}

/// Checks that the model in `dir` is a trained classifier whose labels match `expected`.
pub(crate) fn model_labels(
    dir: &Path,
    config: &ModelConfig,
    expected: Option<&[String]>,
) -> Result<Vec<String>, String> {
    let labels = config.labels().map_err(|e| e.to_string())?.ok_or_else(|| {
        format!(
            "`{}`: config.json has no id2label, so this is not a fine-tuned classifier; give \
             the `model/` directory a train stage writes",
            dir.display()
        )
    })?;
    if labels.len() < 2 {
        return Err(format!(
            "`{}`: config.json's id2label lists {} class(es); a classifier needs at least 2",
            dir.display(),
            labels.len()
        ));
    }
    if let Some(expected) = expected
        && expected != labels.as_slice()
    {
        return Err(format!(
            "the model's labels do not match: `{}` has id2label [{}], the stage expects [{}]; \
             use the model trained for these labels, or fix `labels`",
            dir.display(),
            labels.join(", "),
            expected.join(", ")
        ));
    }
    Ok(labels)
}

/// The local copy of the model an earlier train stage of this file publishes to an object
/// store at `text`: this run reads what that stage wrote, not the store's older model.
fn trained_earlier(
    base: &Path,
    text: &str,
    earlier: &[Stage],
    storage: &crate::storage::Defaults,
) -> Option<std::path::PathBuf> {
    if !crate::storage::is_url(text) {
        return None;
    }
    let options = crate::storage::StorageOptions::default();
    let wanted = crate::storage::Location::parse(base, text, storage, &options).ok()?;
    let wanted = wanted.remote()?.url().as_str().trim_end_matches('/');
    earlier.iter().find_map(|s| match s {
        Stage::Train(t) => {
            let out = t
                .output_remote
                .as_ref()?
                .url()
                .as_str()
                .trim_end_matches('/');
            (format!("{out}/model") == wanted).then(|| t.output.join("model"))
        }
        _ => None,
    })
}

/// A `predict` stage, or with `embed` an `embed` stage.
pub(super) fn predict_stage(
    base: &Path,
    i: usize,
    p: PredictSpec,
    earlier: &[Stage],
    storage: &crate::storage::Defaults,
    embed: bool,
) -> Result<PredictStage, String> {
    let field = format!("stages[{i}].{}", if embed { "embed" } else { "predict" });
    let f = field.as_str();
    let query = query(base, &p.source, f)?;
    let model = match trained_earlier(base, &p.model, earlier, storage) {
        Some(dir) => dir,
        None => crate::storage::model_dir(base, &p.model, storage)
            .map_err(|m| format!("{f}.model: {m}"))?,
    };
    // The model may be the one an earlier train stage of this pipeline writes.
    let trainer = earlier.iter().find_map(|s| match s {
        Stage::Train(t) if t.output.join("model") == model => Some(t),
        _ => None,
    });
    let config = if model.is_dir() {
        let config = ModelConfig::load(&model).map_err(|e| format!("{f}.model: {e}"))?;
        if !model.join("tokenizer.json").is_file() {
            return Err(format!(
                "{f}.model: `{}` has no tokenizer.json; a model directory holds the tokenizer \
                 that made its training data",
                model.display()
            ));
        }
        if trainer.is_none() && !embed {
            model_labels(&model, &config, p.labels.as_deref()).map_err(|e| format!("{f}: {e}"))?;
        }
        config
    } else if let Some(t) = trainer {
        t.config.clone()
    } else {
        return Err(format!(
            "{f}.model: `{}` is not a directory; give a trained model directory (the `model/` \
             under a train stage's `output`), or run the pipeline that trains it first",
            model.display()
        ));
    };
    let embedding = if embed {
        Some(embedding(f, &p, &model, &config)?)
    } else {
        for (key, given) in [
            ("normalize", p.normalize.is_some()),
            ("dims", p.dims.is_some()),
            ("quantize", p.quantize.is_some()),
        ] {
            if given {
                return Err(format!("{f}.{key}: applies to embed stages"));
            }
        }
        None
    };
    if let Some(labels) = &p.labels {
        let mut seen = std::collections::HashSet::new();
        if labels.len() < 2 || !labels.iter().all(|l| seen.insert(l.as_str())) {
            return Err(format!("{f}.labels: list at least two classes, each once"));
        }
    }
    let (device, settings) = inference_settings(
        f,
        &config,
        &Inference {
            device: &p.device,
            precision: p.precision,
            threads: p.threads,
            replicas: p.replicas,
            max_length: p
                .max_length
                .or_else(|| embed.then(|| sentence_max_length(&model)).flatten()),
            truncation: p.truncation,
            batch_tokens: p.batch_tokens,
            batch_rows: p.batch_rows,
            logits: p.logits,
        },
    )?;
    Ok(PredictStage {
        name: p
            .name
            .unwrap_or_else(|| format!("{}-{}", if embed { "embed" } else { "predict" }, p.to)),
        field,
        query,
        to: p.to,
        model,
        policy: RowPolicy {
            id: p.id,
            text: p.text,
            text_pair: p.text_pair,
            label: None,
            keep: p.keep,
            on_overlong: OnOverlong::Truncate,
            on_null: p.on_null,
            on_empty: p.on_empty,
            on_invalid_utf8: OnInvalidUtf8::Error,
        },
        mode: p.mode,
        job: p.job,
        labels: p.labels,
        embed: embedding,
        device,
        settings,
    })
}

/// `int8` where the CPU has int8 dot products; otherwise bf16 (or fp32 without bf16 dot
/// products either) with a warning, never oneDNN's slow int8 emulation.
fn int8_or_fallback(f: &str) -> Precision {
    if crate::gemm::int8_dot_products() {
        return Precision::Int8;
    }
    let fallback = if crate::gemm::bf16_dot_products() {
        Precision::Bf16
    } else {
        Precision::Fp32
    };
    eprintln!(
        "lakeml: warning: {f}.precision: int8 needs int8 dot-product instructions (AVX512-VNNI \
         or AVX-VNNI, Arm dotprod), which this CPU lacks; running in {} instead",
        fallback.name()
    );
    fallback
}

/// How a model runs for inference, as a `predict` stage or a `serve` model writes it.
pub(crate) struct Inference<'a> {
    pub device: &'a str,
    pub precision: Option<Precision>,
    pub threads: Option<usize>,
    pub replicas: Option<usize>,
    pub max_length: Option<usize>,
    pub truncation: Truncation,
    pub batch_tokens: Option<usize>,
    pub batch_rows: usize,
    pub logits: bool,
}

/// The device and settings of a model run for inference, with defaults filled in and each
/// one checked; errors name the field under `f`.
pub(crate) fn inference_settings(
    f: &str,
    config: &ModelConfig,
    p: &Inference<'_>,
) -> Result<(tch::Device, PredictSettings), String> {
    let device = device(f, p.device)?;
    let positions = usize::try_from(config.arch.max_positions()).unwrap_or(0);
    let max_length = p.max_length.unwrap_or(DEFAULT_MAX_LENGTH.min(positions));
    if max_length < 2 || max_length > positions {
        return Err(format!(
            "{f}.max_length: {max_length} is out of range; the model takes 2..={positions} tokens"
        ));
    }
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let threads = p.threads.unwrap_or(cores);
    let replicas = p.replicas.unwrap_or(1);
    let batch_tokens = p.batch_tokens.unwrap_or(if device.is_cuda() {
        CUDA_BATCH_TOKENS
    } else {
        CPU_BATCH_TOKENS
    });
    for (key, n) in [
        ("threads", threads),
        ("replicas", replicas),
        ("batch_tokens", batch_tokens),
        ("batch_rows", p.batch_rows),
    ] {
        if n == 0 {
            return Err(format!("{f}.{key}: must be at least 1"));
        }
    }
    if replicas > threads {
        return Err(format!(
            "{f}.replicas: {replicas} replicas need at least as many `threads` ({threads})"
        ));
    }
    let precision = match p.precision {
        Some(Precision::Int8) if device.is_cuda() => {
            return Err(format!(
                "{f}.precision: int8 runs on CPU only; on CUDA use bf16 (the default there)"
            ));
        }
        Some(Precision::Int8) => int8_or_fallback(f),
        Some(Precision::Bf16) if !device.is_cuda() && !crate::gemm::bf16_dot_products() => {
            eprintln!(
                "lakeml: warning: {f}.precision: bf16 on CPU needs bf16 dot-product instructions \
                 (AVX512-BF16 or AMX, Arm bf16), which this CPU lacks: emulated bf16 products \
                 run several times slower than fp32; running in fp32 instead"
            );
            Precision::Fp32
        }
        Some(precision) => precision,
        None if device.is_cuda() => Precision::Bf16,
        None => Precision::Fp32,
    };
    Ok((
        device,
        PredictSettings {
            precision,
            max_length,
            truncation: p.truncation,
            batch_tokens,
            threads,
            replicas,
            logits: p.logits,
            batch_rows: p.batch_rows,
        },
    ))
}

/// Columns the embeddings table holds besides the `keep` ones.
pub(super) const EMBED_COLUMNS: &[&str] = &[
    "embedding",
    "embedding_scale",
    "model_version",
    "run_id",
    "embedded_at",
];

/// Columns the predictions table holds besides the `keep` ones.
pub(super) const PREDICT_COLUMNS: &[&str] = &[
    "label",
    "label_id",
    "score",
    "probabilities",
    "logits",
    "model_version",
    "run_id",
    "predicted_at",
];
