//! One served model: its tokenizer, the shared [`Engine`], and a cache of recent texts'
//! probabilities and sentence vectors, so `predict(text)` and `predict_score(text)` in one
//! query, the same text asked again, or the one query text of a search
//! (`ORDER BY cosine_distance(embedding, embed('...'))`) run the model once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use arrow::array::{Array, ArrayRef, AsArray, Int32Array, ListArray};
use arrow::buffer::{NullBuffer, OffsetBuffer, ScalarBuffer};
use arrow::datatypes::{DataType, Field};

use super::plan::ServedModel;
use crate::error::{Error, Result};
use crate::predict::{Engine, Head, softmax};
use crate::tokenize::{Encoder, EncoderSettings};

/// Entries per cache generation; two generations are kept (about the last 64k texts).
const CACHE_ENTRIES: usize = 32_768;

/// Probabilities of a column of texts.
pub(crate) struct Scores {
    /// `[rows, classes]`, row-major; rows with a null text hold zeros.
    pub probabilities: Vec<f32>,
    /// Null where the text (or its pair) was null.
    pub nulls: Option<NullBuffer>,
    pub classes: usize,
}

impl Scores {
    /// The most likely class of each row and its probability.
    pub(crate) fn best(&self) -> (Vec<i64>, Vec<f32>) {
        let mut ids = Vec::with_capacity(self.probabilities.len() / self.classes);
        let mut scores = Vec::with_capacity(ids.capacity());
        for row in self.probabilities.chunks_exact(self.classes) {
            let (mut best, mut best_p) = (0usize, f32::NEG_INFINITY);
            for (i, &p) in row.iter().enumerate() {
                if p > best_p {
                    (best, best_p) = (i, p);
                }
            }
            ids.push(best as i64);
            scores.push(best_p);
        }
        (ids, scores)
    }
}

/// Sentence vectors of a column of texts.
pub(crate) struct Vectors {
    /// `[rows, dims]`, row-major; rows with a null text hold zeros.
    pub values: Vec<f32>,
    /// Null where the text was null.
    pub nulls: Option<NullBuffer>,
    pub dims: usize,
}

/// A model behind SQL functions and DoExchange.
pub(crate) struct Scorer {
    pub name: String,
    /// Empty for an encoder without a classification head: it serves `embed` only.
    pub labels: Vec<String>,
    encoder: Arc<Encoder>,
    engine: Engine,
    /// What `embed` runs: the model's pooling, normalized as its modules say.
    embed_head: Arc<Head>,
    cache: Mutex<Cache>,
}

impl std::fmt::Debug for Scorer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scorer").field("name", &self.name).finish()
    }
}

/// Two generations of text → probabilities: when the young one is full it becomes the old
/// one, so recently used texts stay and memory stays bounded.
#[derive(Default)]
struct Cache {
    young: HashMap<String, Arc<[f32]>>,
    old: HashMap<String, Arc<[f32]>>,
}

impl Cache {
    fn get(&mut self, key: &str) -> Option<Arc<[f32]>> {
        if let Some(p) = self.young.get(key) {
            return Some(p.clone());
        }
        let p = self.old.remove(key)?;
        self.insert(key.to_string(), p.clone());
        Some(p)
    }

    fn insert(&mut self, key: String, p: Arc<[f32]>) {
        if self.young.len() >= CACHE_ENTRIES {
            self.old = std::mem::take(&mut self.young);
        }
        self.young.insert(key, p);
    }
}

/// The cache key of a text, or of a text and its pair (the text's length is part of the key,
/// so no two different pairs share one), for one kind of output (`p`robabilities or
/// `e`mbedding).
fn key(kind: char, text: &str, pair: Option<&str>) -> String {
    match pair {
        None => format!("{kind}1{text}"),
        Some(p) => format!("{kind}2{}\u{0}{text}{p}", text.len()),
    }
}

impl Scorer {
    /// Loads the model (its replicas are ready when this returns) and its tokenizer.
    pub(crate) async fn start(model: &ServedModel) -> Result<Self> {
        let s = &model.settings;
        let encoder = Encoder::from_path(
            &model.dir,
            EncoderSettings {
                max_length: s.max_length,
                truncate: true,
                truncation: s.truncation,
                add_special_tokens: true,
            },
        )?;
        let hidden = usize::try_from(model.config.arch.hidden_size()).unwrap_or(0);
        let embed_head = Arc::new(Head::Embed {
            pooling: Arc::new(model.pooling.clone()),
            dims: model.pooling.width(hidden),
            normalize: model.pooling.normalize,
        });
        let head = if model.labels.is_empty() {
            embed_head.as_ref().clone()
        } else {
            Head::Classify {
                classes: model.labels.len(),
            }
        };
        let engine = Engine::start(&model.dir, &model.config, head, model.device, s).await?;
        Ok(Self {
            name: model.name.clone(),
            labels: model.labels.clone(),
            encoder: Arc::new(encoder),
            engine,
            embed_head,
            cache: Mutex::new(Cache::default()),
        })
    }

    /// The sentence vector of each row of `texts` (any string type); a null text gives a
    /// null row.
    pub(crate) async fn embed(&self, texts: &ArrayRef) -> Result<Vectors> {
        let (values, nulls, dims) = self
            .outputs(texts, None, 'e', self.embed_head.clone(), |v, _| v)
            .await?;
        Ok(Vectors {
            values,
            nulls,
            dims,
        })
    }

    /// Class probabilities of each row of `texts` (and `pairs`, for pair models): any string
    /// type; a null text gives a null row. Texts longer than the model's `max_length` are
    /// truncated, as the predict stage does.
    pub(crate) async fn score(&self, texts: &ArrayRef, pairs: Option<&ArrayRef>) -> Result<Scores> {
        if self.labels.is_empty() {
            return Err(Error::Model(format!(
                "model `{}` has no classification head (its config.json has no id2label), so \
                 it serves embed() only",
                self.name
            )));
        }
        let head = Arc::new(Head::Classify {
            classes: self.labels.len(),
        });
        let (probabilities, nulls, classes) = self
            .outputs(texts, pairs, 'p', head, |logits, classes| {
                softmax(&logits, classes).probabilities
            })
            .await?;
        Ok(Scores {
            probabilities,
            nulls,
            classes,
        })
    }

    /// `head`'s output of each row, `finish`ed (logits into probabilities, say): each
    /// distinct text runs once, and texts in the cache (under `kind`) not at all.
    async fn outputs(
        &self,
        texts: &ArrayRef,
        pairs: Option<&ArrayRef>,
        kind: char,
        head: Arc<Head>,
        finish: fn(Vec<f32>, usize) -> Vec<f32>,
    ) -> Result<(Vec<f32>, Option<NullBuffer>, usize)> {
        let width = head.width();
        let utf8 = |a: &ArrayRef| {
            arrow::compute::cast(a, &DataType::Utf8)
                .map_err(|e| Error::Data(format!("the text argument is not a string: {e}")))
        };
        let texts = utf8(texts)?;
        let texts = texts.as_string::<i32>();
        let pairs = pairs.map(utf8).transpose()?;
        let pairs = pairs.as_ref().map(|p| p.as_string::<i32>());
        let rows = texts.len();
        let nulls = NullBuffer::union(texts.nulls(), pairs.and_then(|p| p.nulls()));
        let valid = |r: usize| nulls.as_ref().is_none_or(|n| n.is_valid(r));

        // Rows the cache answers, and the distinct texts the model must run.
        let mut found: Vec<Option<Arc<[f32]>>> = vec![None; rows];
        let mut todo: Vec<usize> = Vec::new();
        let mut wanted: HashMap<String, usize> = HashMap::new();
        let mut slot_of: Vec<Option<usize>> = vec![None; rows];
        {
            let mut cache = self
                .cache
                .lock()
                .map_err(|_| Error::Internal("the score cache is poisoned".into()))?;
            for r in (0..rows).filter(|&r| valid(r)) {
                let k = key(kind, texts.value(r), pairs.map(|p| p.value(r)));
                if let Some(p) = cache.get(&k) {
                    found[r] = Some(p);
                } else {
                    let next = wanted.len();
                    let slot = *wanted.entry(k).or_insert_with(|| {
                        todo.push(r);
                        next
                    });
                    slot_of[r] = Some(slot);
                }
            }
        }
        let mut computed: Vec<Arc<[f32]>> = Vec::new();
        if !todo.is_empty() {
            let first: Vec<String> = todo.iter().map(|&r| texts.value(r).to_string()).collect();
            let second: Option<Vec<String>> =
                pairs.map(|p| todo.iter().map(|&r| p.value(r).to_string()).collect());
            let encoder = self.encoder.clone();
            let encoded = tokio::task::spawn_blocking(move || {
                let a: Vec<&str> = first.iter().map(String::as_str).collect();
                let b: Option<Vec<&str>> = second
                    .as_ref()
                    .map(|s| s.iter().map(String::as_str).collect());
                encoder.encode(&a, b.as_deref())
            })
            .await
            .map_err(|e| Error::Internal(format!("tokenizing: {e}")))??;
            let ids = ListArray::try_new(
                Arc::new(Field::new_list_field(DataType::Int32, false)),
                OffsetBuffer::new(ScalarBuffer::from(encoded.offsets)),
                Arc::new(Int32Array::from(encoded.values)),
                None,
            )
            .map_err(|e| Error::Internal(format!("input_ids: {e}")))?;
            let values = finish(self.engine.run_head(ids, head).await?, width);
            computed = values.chunks_exact(width).map(Arc::<[f32]>::from).collect();
            let mut cache = self
                .cache
                .lock()
                .map_err(|_| Error::Internal("the score cache is poisoned".into()))?;
            for (k, slot) in wanted {
                cache.insert(k, computed[slot].clone());
            }
        }
        let mut out = vec![0f32; rows * width];
        for r in 0..rows {
            let p = match (&found[r], slot_of[r]) {
                (Some(p), _) => p.as_ref(),
                (None, Some(slot)) => computed[slot].as_ref(),
                (None, None) => continue,
            };
            out[r * width..(r + 1) * width].copy_from_slice(p);
        }
        Ok((out, nulls, width))
    }
}
