//! An HF `tokenizer.json` driven from Rust: the pipeline's settings override the padding and
//! truncation stored in the file, and batches are encoded in parallel with rayon straight
//! into the buffers of an Arrow `list<int32>` column.

use std::path::{Path, PathBuf};

use rayon::prelude::*;
use sha2::{Digest, Sha256};
use tokenizers::{
    EncodeInput, Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy,
};

use crate::config::Truncation;
use crate::error::{Error, Result};

/// Rows per rayon task: big enough to amortise scheduling, small enough to balance cores.
const ROWS_PER_TASK: usize = 128;

/// How rows are encoded; see the `tokenize` stage in the README.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct EncoderSettings {
    /// Most tokens per row, special tokens included.
    pub max_length: usize,
    /// Cut rows longer than `max_length` (else they are flagged, not cut).
    pub truncate: bool,
    pub(crate) truncation: Truncation,
    pub add_special_tokens: bool,
}

impl EncoderSettings {
    /// `max_length` tokens with HF's defaults: truncate longest-first, special tokens on.
    pub fn new(max_length: usize) -> Self {
        Self {
            max_length,
            truncate: true,
            truncation: Truncation::LongestFirst,
            add_special_tokens: true,
        }
    }
}

/// A loaded tokenizer with the pipeline's settings applied.
pub struct Encoder {
    tokenizer: Tokenizer,
    settings: EncoderSettings,
    path: PathBuf,
    sha256: String,
}

/// Token ids of a batch of rows, laid out as an Arrow list column.
#[derive(Debug, Default)]
pub struct Encoded {
    /// Every row's ids, concatenated.
    pub values: Vec<i32>,
    /// `values[offsets[i]..offsets[i + 1]]` are row i's ids.
    pub offsets: Vec<i32>,
    /// Rows whose text had more tokens than `max_length` (cut, or left whole when not truncating).
    pub overlong: Vec<bool>,
}

impl Encoded {
    pub fn len(&self, row: usize) -> usize {
        (self.offsets[row + 1] - self.offsets[row]) as usize
    }
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoder")
            .field("path", &self.path)
            .field("sha256", &self.sha256)
            .field("settings", &self.settings)
            .finish()
    }
}

impl Encoder {
    /// Loads `tokenizer.json`, or the one inside a model directory.
    pub fn from_path(path: &Path, settings: EncoderSettings) -> Result<Self> {
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        let bytes = std::fs::read(&file).map_err(|e| {
            Error::Tokenizer(format!(
                "cannot read tokenizer `{}`: {e}; give a tokenizer.json or a model directory \
                 that holds one",
                file.display()
            ))
        })?;
        let mut tokenizer = Tokenizer::from_bytes(&bytes).map_err(|e| {
            Error::Tokenizer(format!(
                "`{}` is not a valid HF tokenizer.json: {e}",
                file.display()
            ))
        })?;
        // tokenizer.json files often ship with padding and truncation switched on (MiniLM's
        // pads everything to 128): the pipeline's settings replace them. Padding is never
        // stored; batches are padded when they are built.
        tokenizer.with_padding(None);
        let truncation = settings.truncate.then_some(TruncationParams {
            max_length: settings.max_length,
            strategy: match settings.truncation {
                Truncation::LongestFirst => TruncationStrategy::LongestFirst,
                Truncation::OnlyFirst => TruncationStrategy::OnlyFirst,
                Truncation::OnlySecond => TruncationStrategy::OnlySecond,
            },
            stride: 0,
            direction: TruncationDirection::Right,
        });
        tokenizer
            .with_truncation(truncation)
            .map_err(|e| Error::Tokenizer(format!("tokenizer `{}`: {e}", file.display())))?;
        let sha256 = hex::encode(Sha256::digest(&bytes));
        Ok(Self {
            tokenizer,
            settings,
            path: file,
            sha256,
        })
    }

    /// sha256 of the tokenizer.json bytes (part of the tokenized table's fingerprint).
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    /// The settings the tokenizer was loaded with.
    pub fn settings(&self) -> EncoderSettings {
        self.settings
    }

    /// Encodes rows in parallel. `pairs`, when given, has one second text per row.
    pub fn encode(&self, texts: &[&str], pairs: Option<&[&str]>) -> Result<Encoded> {
        let chunks: Vec<Result<Encoded>> = (0..texts.len())
            .into_par_iter()
            .step_by(ROWS_PER_TASK)
            .map(|start| {
                let end = (start + ROWS_PER_TASK).min(texts.len());
                self.encode_serial(&texts[start..end], pairs.map(|p| &p[start..end]))
            })
            .collect();
        let mut out = Encoded {
            values: Vec::new(),
            offsets: Vec::with_capacity(texts.len() + 1),
            overlong: Vec::with_capacity(texts.len()),
        };
        out.offsets.push(0);
        let total: usize = chunks
            .iter()
            .map(|c| c.as_ref().map_or(0, |c| c.values.len()))
            .sum();
        out.values.reserve(total);
        for chunk in chunks {
            let chunk = chunk?;
            let base = *out.offsets.last().unwrap_or(&0);
            out.offsets
                .extend(chunk.offsets[1..].iter().map(|o| o + base));
            out.values.extend_from_slice(&chunk.values);
            out.overlong.extend_from_slice(&chunk.overlong);
        }
        Ok(out)
    }

    fn encode_serial(&self, texts: &[&str], pairs: Option<&[&str]>) -> Result<Encoded> {
        let mut out = Encoded {
            values: Vec::with_capacity(texts.len() * 32),
            offsets: Vec::with_capacity(texts.len() + 1),
            overlong: Vec::with_capacity(texts.len()),
        };
        out.offsets.push(0);
        for (i, text) in texts.iter().enumerate() {
            let input: EncodeInput = match pairs {
                Some(p) => (*text, p[i]).into(),
                None => (*text).into(),
            };
            let enc = self
                .tokenizer
                .encode_fast(input, self.settings.add_special_tokens)
                .map_err(|e| Error::Tokenizer(format!("tokenizer failed on a row: {e}")))?;
            let ids = enc.get_ids();
            let overlong = if self.settings.truncate {
                !enc.get_overflowing().is_empty()
            } else {
                ids.len() > self.settings.max_length
            };
            // Vocabularies are far below 2^31 ids, so the cast is exact.
            out.values.extend(ids.iter().map(|&id| id as i32));
            out.offsets.push(out.values.len() as i32);
            out.overlong.push(overlong);
        }
        Ok(out)
    }
}
