//! A DeBERTa-v2/v3 `config.json` and the settings the blocks are built from: every option
//! upstream would ignore, crash on or compute garbage from is refused here, naming the
//! option, before any variable is made.

use serde::Deserialize;
use tch::nn;

use crate::error::{Error, Result};
use crate::model::{ACTIVATIONS, Linear};

/// A DeBERTa-v2/v3 `config.json`, as transformers' `DebertaV2Config` reads it.
///
/// Defaults are `DebertaV2Config`'s, and for the options the modeling code reads with
/// `getattr(config, name, default)` (buckets, shared keys, conv layer...) that default.
/// Unknown fields (`architectures`, `id2label`...) are ignored.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub(crate) struct Config {
    pub(super) vocab_size: i64,
    pub(crate) hidden_size: i64,
    pub(super) num_hidden_layers: i64,
    pub(super) num_attention_heads: i64,
    pub(super) intermediate_size: i64,
    pub(super) hidden_act: String,
    pub(super) hidden_dropout_prob: f64,
    pub(super) attention_probs_dropout_prob: f64,
    pub(super) max_position_embeddings: i64,
    pub(super) type_vocab_size: i64,
    pub(super) initializer_range: f64,
    pub(super) layer_norm_eps: f64,
    pub(super) relative_attention: bool,
    pub(super) max_relative_positions: i64,
    pub(super) pad_token_id: Option<i64>,
    pub(super) position_biased_input: bool,
    pub(super) pos_att_type: Option<StrOrList>,
    pub(super) pooler_dropout: f64,
    pub(super) pooler_hidden_act: String,
    /// `DebertaV2Config` sets it to `hidden_size` when absent.
    pub(super) pooler_hidden_size: Option<i64>,
    // Read by the modeling code with `getattr`, not declared by `DebertaV2Config`.
    pub(super) position_buckets: i64,
    pub(super) share_att_key: bool,
    pub(super) norm_rel_ebd: String,
    pub(super) embedding_size: Option<i64>,
    pub(super) attention_head_size: Option<i64>,
    pub(super) conv_kernel_size: i64,
    pub(super) conv_groups: i64,
    pub(super) conv_act: String,
    pub(super) cls_dropout: Option<f64>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            vocab_size: 128_100,
            hidden_size: 1536,
            num_hidden_layers: 24,
            num_attention_heads: 24,
            intermediate_size: 6144,
            hidden_act: "gelu".into(),
            hidden_dropout_prob: 0.1,
            attention_probs_dropout_prob: 0.1,
            max_position_embeddings: 512,
            type_vocab_size: 0,
            initializer_range: 0.02,
            layer_norm_eps: 1e-7,
            relative_attention: false,
            max_relative_positions: -1,
            pad_token_id: Some(0),
            position_biased_input: true,
            pos_att_type: None,
            pooler_dropout: 0.0,
            pooler_hidden_act: "gelu".into(),
            pooler_hidden_size: None,
            position_buckets: -1,
            share_att_key: false,
            norm_rel_ebd: "none".into(),
            embedding_size: None,
            attention_head_size: None,
            conv_kernel_size: 0,
            conv_groups: 1,
            conv_act: "tanh".into(),
            cls_dropout: None,
        }
    }
}

/// `pos_att_type` is a list (`["p2c", "c2p"]`) or, in older configs, a string (`"p2c|c2p"`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(super) enum StrOrList {
    Str(String),
    List(Vec<String>),
}

impl Config {
    pub(crate) fn vocab_size(&self) -> i64 {
        self.vocab_size
    }

    /// The id to pad batches with; 0 (what DeBERTa's tokenizers use) when the config has null.
    pub(crate) fn pad_token_id(&self) -> i64 {
        self.pad_token_id.unwrap_or(0)
    }

    /// The longest sequence to feed: `max_position_embeddings`. Without absolute positions
    /// (v3) the model would run longer, but its relative buckets were trained up to this.
    pub(crate) fn max_positions(&self) -> i64 {
        self.max_position_embeddings
    }

    /// `pos_att_type` as upstream normalizes it: a string is lower-cased and split on `|`.
    pub(super) fn pos_att_types(&self) -> Vec<String> {
        match &self.pos_att_type {
            None => Vec::new(),
            Some(StrOrList::Str(s)) => s
                .to_lowercase()
                .split('|')
                .map(|x| x.trim().to_string())
                .collect(),
            Some(StrOrList::List(v)) => v.clone(),
        }
    }
}

/// What the blocks need from a [`Config`], checked: every value upstream would ignore, crash
/// on or compute garbage from is an error here, before any variable is made.
#[derive(Debug, Clone)]
pub(super) struct Settings {
    pub(super) hidden: i64,
    pub(super) heads: i64,
    pub(super) head_size: i64,
    pub(super) embedding_size: i64,
    pub(super) eps: f64,
    pub(super) init: f64,
    pub(super) c2p: bool,
    pub(super) p2c: bool,
    /// `Some` with `relative_attention`.
    pub(super) relative: Option<Relative>,
    /// `norm_rel_ebd` has `layer_norm`.
    pub(super) rel_layer_norm: bool,
}

/// Relative attention's sizes, as upstream derives them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Relative {
    /// Half the rows of `rel_embeddings` (`pos_ebd_size` upstream): `position_buckets` if
    /// positive, else `max_relative_positions`.
    pub(super) att_span: i64,
    /// `position_buckets`; log buckets when positive.
    pub(super) buckets: i64,
    /// `max_relative_positions`, or `max_position_embeddings` when below 1.
    pub(super) max_relative_positions: i64,
}

fn unsupported(field: &str, value: impl std::fmt::Display, supported: &str) -> Error {
    Error::Model(format!(
        "DeBERTa-v2 config.json: {field} = {value} is not supported (supported: {supported})"
    ))
}

/// `Ok` when `ok`, else the [`unsupported`] error.
fn require(ok: bool, field: &str, value: impl std::fmt::Display, supported: &str) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(unsupported(field, value, supported))
    }
}

impl Settings {
    pub(super) fn from_config(cfg: &Config, num_labels: i64) -> Result<Self> {
        for (field, value) in [
            ("vocab_size", cfg.vocab_size),
            ("hidden_size", cfg.hidden_size),
            ("num_hidden_layers", cfg.num_hidden_layers),
            ("num_attention_heads", cfg.num_attention_heads),
            ("intermediate_size", cfg.intermediate_size),
            ("max_position_embeddings", cfg.max_position_embeddings),
            ("num_labels", num_labels),
        ] {
            require(value > 0, field, value, "a positive number")?;
        }
        for (field, name) in [
            ("hidden_act", &cfg.hidden_act),
            ("pooler_hidden_act", &cfg.pooler_hidden_act),
            ("conv_act", &cfg.conv_act),
        ] {
            let known = ACTIVATIONS.contains(&name.as_str());
            require(known, field, format!("{name:?}"), &ACTIVATIONS.join(", "))?;
        }
        let (hidden, heads) = (cfg.hidden_size, cfg.num_attention_heads);
        let divisor_of_hidden = format!("a divisor of hidden_size {hidden}");
        // DisentangledSelfAttention raises on this even when attention_head_size is given.
        require(
            hidden % heads == 0,
            "num_attention_heads",
            heads,
            &divisor_of_hidden,
        )?;
        // The attention output projection is hidden x hidden, so heads must tile hidden_size.
        let head_size = cfg.attention_head_size.unwrap_or(hidden / heads);
        let tiles = format!("hidden_size / num_attention_heads = {}", hidden / heads);
        require(
            head_size * heads == hidden,
            "attention_head_size",
            head_size,
            &tiles,
        )?;
        // ContextPooler's dense is pooler x pooler but the classifier reads hidden_size.
        let pooler = cfg.pooler_hidden_size.unwrap_or(hidden);
        let same = format!("hidden_size {hidden}");
        require(pooler == hidden, "pooler_hidden_size", pooler, &same)?;
        let embedding_size = cfg.embedding_size.unwrap_or(hidden);
        require(
            embedding_size > 0,
            "embedding_size",
            embedding_size,
            "a positive number",
        )?;
        if let Some(pad) = cfg.pad_token_id {
            let below = format!("an id below vocab_size {}", cfg.vocab_size);
            require(
                (0..cfg.vocab_size).contains(&pad),
                "pad_token_id",
                pad,
                &below,
            )?;
        }
        let types = cfg.type_vocab_size;
        require(types >= 0, "type_vocab_size", types, "0 or more")?;
        let (mut c2p, mut p2c) = (false, false);
        for kind in cfg.pos_att_types() {
            match kind.as_str() {
                "c2p" => c2p = true,
                "p2c" => p2c = true,
                // "p2p" (DeBERTa v1's paper) and typos would be silently ignored upstream.
                other => {
                    return Err(unsupported(
                        "pos_att_type",
                        format!("{other:?}"),
                        "c2p, p2c",
                    ));
                }
            }
        }
        let mut rel_layer_norm = false;
        for part in cfg.norm_rel_ebd.to_lowercase().split('|') {
            match part.trim() {
                "layer_norm" => rel_layer_norm = true,
                "none" | "" => {}
                other => {
                    let supported = "none, layer_norm";
                    return Err(unsupported("norm_rel_ebd", format!("{other:?}"), supported));
                }
            }
        }
        if cfg.conv_kernel_size > 0 {
            // Upstream pads by (k - 1) / 2, so an even kernel changes the sequence length.
            let k = cfg.conv_kernel_size;
            require(k % 2 == 1, "conv_kernel_size", k, "0 (off) or odd")?;
            let groups = cfg.conv_groups;
            let divides = groups > 0 && hidden % groups == 0;
            require(divides, "conv_groups", groups, &divisor_of_hidden)?;
        }
        let relative = if cfg.relative_attention {
            let max_relative_positions = if cfg.max_relative_positions < 1 {
                cfg.max_position_embeddings
            } else {
                cfg.max_relative_positions
            };
            // mid = buckets / 2 = 0 would divide by zero in make_log_bucket_position.
            let buckets = cfg.position_buckets;
            require(
                buckets != 1,
                "position_buckets",
                buckets,
                "-1 (off) or at least 2",
            )?;
            let att_span = if buckets > 0 {
                buckets
            } else {
                max_relative_positions
            };
            Some(Relative {
                att_span,
                buckets,
                max_relative_positions,
            })
        } else {
            None
        };
        Ok(Settings {
            hidden,
            heads,
            head_size,
            embedding_size,
            eps: cfg.layer_norm_eps,
            init: cfg.initializer_range,
            c2p,
            p2c,
            relative,
            rel_layer_norm,
        })
    }

    pub(super) fn linear(&self, p: nn::Path, input: i64, output: i64, bias: bool) -> Linear {
        let cfg = nn::LinearConfig {
            ws_init: nn::Init::Randn {
                mean: 0.0,
                stdev: self.init,
            },
            bs_init: bias.then_some(nn::Init::Const(0.0)),
            bias,
        };
        Linear::new(nn::linear(p, input, output, cfg))
    }

    pub(super) fn embedding(
        &self,
        p: nn::Path,
        rows: i64,
        dim: i64,
        padding_idx: Option<i64>,
    ) -> nn::Embedding {
        let cfg = nn::EmbeddingConfig {
            ws_init: nn::Init::Randn {
                mean: 0.0,
                stdev: self.init,
            },
            // Only affects training: the padding row gets no gradient, as in nn.Embedding.
            padding_idx: padding_idx.unwrap_or(-1),
            ..Default::default()
        };
        nn::embedding(p, rows, dim, cfg)
    }

    pub(super) fn layer_norm(&self, p: nn::Path) -> nn::LayerNorm {
        let cfg = nn::LayerNormConfig {
            eps: self.eps,
            ..Default::default()
        };
        nn::layer_norm(p, vec![self.hidden], cfg)
    }
}
