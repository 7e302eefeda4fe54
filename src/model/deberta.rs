//! DeBERTa-v2 and DeBERTa-v3 (config `model_type: "deberta-v2"`) as a sequence classifier.
//!
//! Block by block after transformers 5.23's `modeling_deberta_v2.py`
//! (<https://github.com/huggingface/transformers/blob/v5.23.0/src/transformers/models/deberta_v2/modeling_deberta_v2.py>);
//! each block names the upstream class it follows. Variables are named as in HF checkpoints (`deberta.embeddings...`,
//! `deberta.encoder.layer.N...`, `deberta.encoder.rel_embeddings.weight`, `pooler.dense...`,
//! `classifier...`), so weights load by name.
//!
//! Unlike BERT, attention adds content-to-position (c2p) and position-to-content (p2c) scores
//! taken from one table of relative-position embeddings (log-bucketed in v3), the embeddings
//! zero padded positions, v2-xlarge runs a convolution beside the first layer, and the head
//! pools the first token through a ContextPooler. Every option of `DebertaV2Config` that
//! changes the forward pass is supported; values upstream would ignore, crash on or compute
//! garbage from make [`DebertaV2ForSequenceClassification::new`] fail with an
//! [`Error::Model`] naming the option (see `Settings::from_config`).

use serde::Deserialize;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

use super::{ACTIVATIONS, Classifier, activation};
use crate::error::{Error, Result};

/// A DeBERTa-v2/v3 `config.json`, as transformers' `DebertaV2Config` reads it.
///
/// Defaults are `DebertaV2Config`'s, and for the options the modeling code reads with
/// `getattr(config, name, default)` (buckets, shared keys, conv layer...) that default.
/// Unknown fields (`architectures`, `id2label`...) are ignored.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub(crate) struct Config {
    vocab_size: i64,
    hidden_size: i64,
    num_hidden_layers: i64,
    num_attention_heads: i64,
    intermediate_size: i64,
    hidden_act: String,
    hidden_dropout_prob: f64,
    attention_probs_dropout_prob: f64,
    max_position_embeddings: i64,
    type_vocab_size: i64,
    initializer_range: f64,
    layer_norm_eps: f64,
    relative_attention: bool,
    max_relative_positions: i64,
    pad_token_id: Option<i64>,
    position_biased_input: bool,
    pos_att_type: Option<StrOrList>,
    pooler_dropout: f64,
    pooler_hidden_act: String,
    /// `DebertaV2Config` sets it to `hidden_size` when absent.
    pooler_hidden_size: Option<i64>,
    // Read by the modeling code with `getattr`, not declared by `DebertaV2Config`.
    position_buckets: i64,
    share_att_key: bool,
    norm_rel_ebd: String,
    embedding_size: Option<i64>,
    attention_head_size: Option<i64>,
    conv_kernel_size: i64,
    conv_groups: i64,
    conv_act: String,
    cls_dropout: Option<f64>,
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
enum StrOrList {
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
    fn pos_att_types(&self) -> Vec<String> {
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
struct Settings {
    hidden: i64,
    heads: i64,
    head_size: i64,
    embedding_size: i64,
    eps: f64,
    init: f64,
    c2p: bool,
    p2c: bool,
    /// `Some` with `relative_attention`.
    relative: Option<Relative>,
    /// `norm_rel_ebd` has `layer_norm`.
    rel_layer_norm: bool,
}

/// Relative attention's sizes, as upstream derives them.
#[derive(Debug, Clone, Copy)]
struct Relative {
    /// Half the rows of `rel_embeddings` (`pos_ebd_size` upstream): `position_buckets` if
    /// positive, else `max_relative_positions`.
    att_span: i64,
    /// `position_buckets`; log buckets when positive.
    buckets: i64,
    /// `max_relative_positions`, or `max_position_embeddings` when below 1.
    max_relative_positions: i64,
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
    fn from_config(cfg: &Config, num_labels: i64) -> Result<Self> {
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

    fn linear(&self, p: nn::Path, input: i64, output: i64, bias: bool) -> nn::Linear {
        let cfg = nn::LinearConfig {
            ws_init: nn::Init::Randn {
                mean: 0.0,
                stdev: self.init,
            },
            bs_init: bias.then_some(nn::Init::Const(0.0)),
            bias,
        };
        nn::linear(p, input, output, cfg)
    }

    fn embedding(
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

    fn layer_norm(&self, p: nn::Path) -> nn::LayerNorm {
        let cfg = nn::LayerNormConfig {
            eps: self.eps,
            ..Default::default()
        };
        nn::layer_norm(p, vec![self.hidden], cfg)
    }
}

/// Dropout when training, the identity otherwise.
fn dropout(x: &Tensor, p: f64, train: bool) -> Tensor {
    if train && p > 0.0 {
        x.dropout(p, true)
    } else {
        x.shallow_clone()
    }
}

/// upstream: `DebertaV2Embeddings` (embedding_size != hidden_size adds `embed_proj`).
#[derive(Debug)]
struct Embeddings {
    word: nn::Embedding,
    position: Option<nn::Embedding>,
    token_type: Option<nn::Embedding>,
    embed_proj: Option<nn::Linear>,
    layer_norm: nn::LayerNorm,
    dropout: f64,
}

impl Embeddings {
    fn new(p: nn::Path, cfg: &Config, s: &Settings) -> Self {
        let e = s.embedding_size;
        Embeddings {
            word: s.embedding(&p / "word_embeddings", cfg.vocab_size, e, cfg.pad_token_id),
            position: cfg.position_biased_input.then(|| {
                s.embedding(
                    &p / "position_embeddings",
                    cfg.max_position_embeddings,
                    e,
                    None,
                )
            }),
            token_type: (cfg.type_vocab_size > 0)
                .then(|| s.embedding(&p / "token_type_embeddings", cfg.type_vocab_size, e, None)),
            embed_proj: (e != s.hidden).then(|| s.linear(&p / "embed_proj", e, s.hidden, false)),
            layer_norm: s.layer_norm(&p / "LayerNorm"),
            dropout: cfg.hidden_dropout_prob,
        }
    }

    /// `mask` is the attention mask `[batch, seq]`; padded positions come out as zeros.
    fn forward_t(&self, input_ids: &Tensor, mask: &Tensor, train: bool) -> Tensor {
        let x = input_ids.apply(&self.word);
        let x = match &self.position {
            Some(position) => {
                let ids = Tensor::arange(input_ids.size()[1], (Kind::Int64, input_ids.device()));
                x + ids.apply(position)
            }
            None => x,
        };
        // lakeml passes no token_type_ids, so upstream looks up type 0 for every token.
        let x = match &self.token_type {
            Some(token_type) => x + token_type.ws.get(0),
            None => x,
        };
        let x = match &self.embed_proj {
            Some(proj) => x.apply(proj),
            None => x,
        };
        let x = x.apply(&self.layer_norm);
        let mask = mask.unsqueeze(2).to_kind(x.kind());
        dropout(&(x * mask), self.dropout, train)
    }
}

/// upstream: `DisentangledSelfAttention`, computed per head on `[batch, heads, seq, dim]`
/// instead of upstream's `[batch * heads, seq, dim]` (same numbers).
#[derive(Debug)]
struct SelfAttention {
    query_proj: nn::Linear,
    key_proj: nn::Linear,
    value_proj: nn::Linear,
    /// Separate projections of the relative embeddings, made when `share_att_key` is false
    /// and only for the scores that are on (c2p reads `pos_key_proj`, p2c `pos_query_proj`);
    /// otherwise `key_proj` and `query_proj` project them too.
    pos_key_proj: Option<nn::Linear>,
    pos_query_proj: Option<nn::Linear>,
    heads: i64,
    c2p: bool,
    p2c: bool,
    att_span: Option<i64>,
    /// `sqrt(head_size * scale_factor)`, scale_factor = 1 + one per score type: upstream
    /// divides content and both position scores by the same number, so their sum keeps the
    /// variance of one. Computed in f32 as upstream does (`torch.sqrt` of a float tensor).
    scale: f64,
    dropout: f64,
    pos_dropout: f64,
}

/// What every layer's attention shares in one forward pass.
struct RelativeInputs {
    /// `[seq, seq]` int64: (bucketed) `i - j` for query `i`, key `j`.
    positions: Tensor,
    /// `[2 * att_span, hidden]`, after the encoder's optional LayerNorm.
    embeddings: Tensor,
}

impl SelfAttention {
    fn new(p: nn::Path, cfg: &Config, s: &Settings) -> Self {
        let all = s.heads * s.head_size;
        let separate = s.relative.is_some() && !cfg.share_att_key;
        let scale_factor = 1 + i64::from(s.c2p) + i64::from(s.p2c);
        Self {
            query_proj: s.linear(&p / "query_proj", s.hidden, all, true),
            key_proj: s.linear(&p / "key_proj", s.hidden, all, true),
            value_proj: s.linear(&p / "value_proj", s.hidden, all, true),
            pos_key_proj: (separate && s.c2p)
                .then(|| s.linear(&p / "pos_key_proj", s.hidden, all, true)),
            pos_query_proj: (separate && s.p2c)
                .then(|| s.linear(&p / "pos_query_proj", s.hidden, all, true)),
            heads: s.heads,
            c2p: s.c2p,
            p2c: s.p2c,
            att_span: s.relative.map(|r| r.att_span),
            scale: f64::from((s.head_size as f32 * scale_factor as f32).sqrt()),
            dropout: cfg.attention_probs_dropout_prob,
            pos_dropout: cfg.hidden_dropout_prob,
        }
    }

    /// `[batch, seq, heads * dim]` -> `[batch, heads, seq, dim]`.
    fn split_heads(&self, x: &Tensor) -> Tensor {
        x.unflatten(-1, [self.heads, -1]).permute([0, 2, 1, 3])
    }

    /// `mask` is `[batch, 1, seq, seq]` bool, true where query and key are both real tokens.
    fn forward_t(
        &self,
        x: &Tensor,
        mask: &Tensor,
        relative: Option<&RelativeInputs>,
        train: bool,
    ) -> Tensor {
        let q = self.split_heads(&x.apply(&self.query_proj));
        let k = self.split_heads(&x.apply(&self.key_proj));
        let v = self.split_heads(&x.apply(&self.value_proj));

        // Upstream scales k before the product: bmm(q, k^T / scale).
        let scores = q.matmul(&(k.transpose(-1, -2) / self.scale));
        let bias = match (relative, self.att_span) {
            (Some(rel), Some(att_span)) => {
                let rel_embeddings = dropout(&rel.embeddings, self.pos_dropout, train);
                self.disentangled_bias(&q, &k, &rel.positions, &rel_embeddings, att_span)
            }
            _ => None,
        };
        let scores = match bias {
            Some(bias) => scores + bias,
            None => scores,
        };
        // Fully masked rows (padding queries) get a uniform softmax, as upstream: a finite
        // minimum, not -inf, so no NaN reaches the values of padded positions.
        let scores = scores.masked_fill(&mask.logical_not(), kind_min(scores.kind()));
        let probs = dropout(&scores.softmax(-1, scores.kind()), self.dropout, train);
        probs.matmul(&v).permute([0, 2, 1, 3]).flatten(2, 3)
    }

    /// upstream: `DisentangledSelfAttention.disentangled_attention_bias`. `q`, `k` are
    /// `[batch, heads, seq, dim]`, `positions` `[seq, seq]`, `rel_embeddings` `[2 span, hidden]`.
    fn disentangled_bias(
        &self,
        q: &Tensor,
        k: &Tensor,
        positions: &Tensor,
        rel_embeddings: &Tensor,
        att_span: i64,
    ) -> Option<Tensor> {
        let (batch, heads) = (q.size()[0], q.size()[1]);
        let rel = rel_embeddings.narrow(0, 0, 2 * att_span).unsqueeze(0);
        // Index into the 2 * att_span rows: relative position r reads row r + att_span.
        let gather = |att: Tensor, index: Tensor| {
            att.gather(-1, &index.expand([batch, heads, -1, -1], false), false)
        };
        let mut score: Option<Tensor> = None;
        if self.c2p {
            let proj = self.pos_key_proj.as_ref().unwrap_or(&self.key_proj);
            let pos_key = self.split_heads(&rel.apply(proj));
            let c2p_pos = (positions + att_span).clamp(0, 2 * att_span - 1);
            let c2p = gather(q.matmul(&pos_key.transpose(-1, -2)), c2p_pos) / self.scale;
            score = Some(c2p);
        }
        if self.p2c {
            let proj = self.pos_query_proj.as_ref().unwrap_or(&self.query_proj);
            let pos_query = self.split_heads(&rel.apply(proj));
            // Upstream's build_rpos only rebuilds positions when query and key lengths
            // differ (never in self-attention); it would pass buckets and max positions
            // swapped there, which cannot matter here.
            let p2c_pos = (-positions + att_span).clamp(0, 2 * att_span - 1);
            let p2c = gather(k.matmul(&pos_query.transpose(-1, -2)), p2c_pos).transpose(-1, -2)
                / self.scale;
            score = Some(match score {
                Some(c2p) => c2p + p2c,
                None => p2c,
            });
        }
        score
    }
}

/// The most negative finite value of a float kind (`torch.finfo(dtype).min`).
fn kind_min(kind: Kind) -> f64 {
    match kind {
        Kind::Half => -65504.0,
        Kind::BFloat16 => -3.389_531_389_251_535_5e38,
        Kind::Double => f64::MIN,
        _ => f64::from(f32::MIN),
    }
}

/// upstream: `build_relative_position` with `make_log_bucket_position`: `[seq, seq]` int64
/// holding `i - j`, or with buckets its log-bucketed value. Built with the same f32 tensor ops
/// as upstream so that `ceil` rounds at exactly the same places.
fn relative_positions(t: i64, rel: Relative, device: Device) -> Tensor {
    let ids = Tensor::arange(t, (Kind::Int64, device));
    let positions = ids.unsqueeze(1) - ids.unsqueeze(0);
    if rel.buckets <= 0 || rel.max_relative_positions <= 0 {
        return positions;
    }
    let mid = rel.buckets / 2;
    let sign = positions.sign();
    let near = positions.lt(mid).logical_and(&positions.gt(-mid));
    let abs_pos = positions.abs().masked_fill(&near, mid - 1);
    // Upstream: torch.log(torch.tensor((max_position - 1) / mid)), an f32 0-d tensor.
    let denominator =
        Tensor::from(((rel.max_relative_positions - 1) as f64 / mid as f64) as f32).log();
    let log_pos =
        ((&abs_pos / mid as f64).log() / denominator.to_device(device) * (mid - 1) as f64).ceil()
            + mid as f64;
    let bucketed = positions
        .to_kind(Kind::Float)
        .where_self(&abs_pos.le(mid), &(log_pos * sign));
    bucketed.to_kind(Kind::Int64)
}

/// upstream: `DebertaV2SelfOutput` and `DebertaV2Output` (dense, dropout, residual LayerNorm).
#[derive(Debug)]
struct Output {
    dense: nn::Linear,
    layer_norm: nn::LayerNorm,
    dropout: f64,
}

impl Output {
    fn new(p: nn::Path, input: i64, cfg: &Config, s: &Settings) -> Self {
        Output {
            dense: s.linear(&p / "dense", input, s.hidden, true),
            layer_norm: s.layer_norm(&p / "LayerNorm"),
            dropout: cfg.hidden_dropout_prob,
        }
    }

    fn forward_t(&self, x: &Tensor, residual: &Tensor, train: bool) -> Tensor {
        (dropout(&x.apply(&self.dense), self.dropout, train) + residual).apply(&self.layer_norm)
    }
}

/// upstream: `DebertaV2Layer` (= `DebertaV2Attention` + `DebertaV2Intermediate` +
/// `DebertaV2Output`).
#[derive(Debug)]
struct Layer {
    attention: SelfAttention,
    attention_output: Output,
    intermediate: nn::Linear,
    act: String,
    output: Output,
}

impl Layer {
    fn new(p: nn::Path, cfg: &Config, s: &Settings) -> Self {
        Layer {
            attention: SelfAttention::new(&p / "attention" / "self", cfg, s),
            attention_output: Output::new(&p / "attention" / "output", s.hidden, cfg, s),
            intermediate: s.linear(
                &p / "intermediate" / "dense",
                s.hidden,
                cfg.intermediate_size,
                true,
            ),
            act: cfg.hidden_act.clone(),
            output: Output::new(&p / "output", cfg.intermediate_size, cfg, s),
        }
    }

    fn forward_t(
        &self,
        x: &Tensor,
        mask: &Tensor,
        rel: Option<&RelativeInputs>,
        train: bool,
    ) -> Tensor {
        let attended = self.attention.forward_t(x, mask, rel, train);
        let attended = self.attention_output.forward_t(&attended, x, train);
        let hidden = activation(&self.act, &attended.apply(&self.intermediate));
        self.output.forward_t(&hidden, &attended, train)
    }
}

/// upstream: `ConvLayer` (deberta-v2-xlarge/xxlarge: `conv_kernel_size` 3), applied once,
/// after the first layer, to the encoder's input.
#[derive(Debug)]
struct ConvLayer {
    conv: nn::Conv1D,
    layer_norm: nn::LayerNorm,
    act: String,
    dropout: f64,
}

impl ConvLayer {
    fn new(p: nn::Path, cfg: &Config, s: &Settings) -> Self {
        let k = cfg.conv_kernel_size;
        let conv_cfg = nn::ConvConfig {
            padding: (k - 1) / 2,
            groups: cfg.conv_groups,
            ws_init: nn::Init::Randn {
                mean: 0.0,
                stdev: s.init,
            },
            bs_init: nn::Init::Const(0.0),
            ..Default::default()
        };
        ConvLayer {
            conv: nn::conv1d(&p / "conv", s.hidden, s.hidden, k, conv_cfg),
            layer_norm: s.layer_norm(&p / "LayerNorm"),
            act: cfg.conv_act.clone(),
            dropout: cfg.hidden_dropout_prob,
        }
    }

    /// `mask` is the attention mask `[batch, seq]`.
    fn forward_t(&self, x: &Tensor, residual: &Tensor, mask: &Tensor, train: bool) -> Tensor {
        let out = self
            .conv
            .forward(&x.permute([0, 2, 1]).contiguous())
            .permute([0, 2, 1]);
        let out = out.masked_fill(&mask.eq(0).unsqueeze(-1), 0.0);
        let out = activation(&self.act, &dropout(&out, self.dropout, train));
        let out = (residual + out).apply(&self.layer_norm);
        let mask = mask.unsqueeze(2).to_kind(out.kind());
        out * mask
    }
}

/// upstream: `DebertaV2Encoder`.
#[derive(Debug)]
struct Encoder {
    layers: Vec<Layer>,
    rel_embeddings: Option<nn::Embedding>,
    /// `norm_rel_ebd: "layer_norm"`: LayerNorm on the relative embeddings (v3).
    rel_layer_norm: Option<nn::LayerNorm>,
    relative: Option<Relative>,
    conv: Option<ConvLayer>,
}

impl Encoder {
    fn new(p: nn::Path, cfg: &Config, s: &Settings) -> Self {
        let layer = &p / "layer";
        Encoder {
            layers: (0..cfg.num_hidden_layers)
                .map(|i| Layer::new(&layer / i, cfg, s))
                .collect(),
            rel_embeddings: s
                .relative
                .map(|r| s.embedding(&p / "rel_embeddings", 2 * r.att_span, s.hidden, None)),
            // Made whenever configured, as upstream does (and checkpoints hold it), even
            // though only relative attention reads it.
            rel_layer_norm: s.rel_layer_norm.then(|| s.layer_norm(&p / "LayerNorm")),
            relative: s.relative,
            conv: (cfg.conv_kernel_size > 0).then(|| ConvLayer::new(&p / "conv", cfg, s)),
        }
    }

    fn forward_t(&self, embedded: &Tensor, mask: &Tensor, train: bool) -> Tensor {
        // get_attention_mask: pairs (i, j) where both are real tokens, [batch, 1, seq, seq].
        let pair_mask = mask.unsqueeze(1).unsqueeze(2) * mask.unsqueeze(1).unsqueeze(3);
        let pair_mask = pair_mask.ne(0);
        // get_rel_pos and get_rel_embedding: once per forward, shared by every layer.
        let relative = match (&self.rel_embeddings, self.relative) {
            (Some(table), Some(rel)) => {
                let embeddings = match &self.rel_layer_norm {
                    Some(ln) => table.ws.apply(ln),
                    None => table.ws.shallow_clone(),
                };
                let positions = relative_positions(embedded.size()[1], rel, embedded.device());
                Some(RelativeInputs {
                    positions,
                    embeddings,
                })
            }
            _ => None,
        };
        let mut hidden = embedded.shallow_clone();
        for (i, layer) in self.layers.iter().enumerate() {
            hidden = layer.forward_t(&hidden, &pair_mask, relative.as_ref(), train);
            if let (0, Some(conv)) = (i, &self.conv) {
                hidden = conv.forward_t(embedded, &hidden, mask, train);
            }
        }
        hidden
    }
}

/// upstream: `ContextPooler`: the first token, dropout, dense, activation.
#[derive(Debug)]
struct ContextPooler {
    dense: nn::Linear,
    act: String,
    dropout: f64,
}

impl ContextPooler {
    fn forward_t(&self, hidden: &Tensor, train: bool) -> Tensor {
        let first = dropout(&hidden.select(1, 0), self.dropout, train);
        activation(&self.act, &first.apply(&self.dense))
    }
}

/// upstream: `DebertaV2ForSequenceClassification` (with `DebertaV2Model` inlined; its
/// `z_steps` is always 0 and so left out).
///
/// Dropout: upstream 5.23 uses plain `nn.Dropout` everywhere (the `StableDropout` of older
/// releases and of Microsoft's code is gone), and so does this.
#[derive(Debug)]
pub(crate) struct DebertaV2ForSequenceClassification {
    embeddings: Embeddings,
    encoder: Encoder,
    pooler: ContextPooler,
    classifier: nn::Linear,
    /// `cls_dropout`, or `hidden_dropout_prob` when the config has none.
    dropout: f64,
}

impl DebertaV2ForSequenceClassification {
    /// `p` is the VarStore root; variables are named exactly as the HF checkpoint
    /// (deberta.embeddings..., deberta.encoder.layer.N..., deberta.encoder.rel_embeddings.weight,
    /// pooler.dense..., classifier...), so weights load by name.
    pub(crate) fn new(p: &nn::Path, cfg: &Config, num_labels: i64) -> Result<Self> {
        let s = Settings::from_config(cfg, num_labels)?;
        let deberta = p / "deberta";
        Ok(Self {
            embeddings: Embeddings::new(&deberta / "embeddings", cfg, &s),
            encoder: Encoder::new(&deberta / "encoder", cfg, &s),
            pooler: ContextPooler {
                dense: s.linear(p / "pooler" / "dense", s.hidden, s.hidden, true),
                act: cfg.pooler_hidden_act.clone(),
                dropout: cfg.pooler_dropout,
            },
            classifier: s.linear(p / "classifier", s.hidden, num_labels, true),
            dropout: cfg.cls_dropout.unwrap_or(cfg.hidden_dropout_prob),
        })
    }
}

impl Classifier for DebertaV2ForSequenceClassification {
    fn forward_t(&self, input_ids: &Tensor, attention_mask: &Tensor, train: bool) -> Tensor {
        let embedded = self.embeddings.forward_t(input_ids, attention_mask, train);
        let hidden = self.encoder.forward_t(&embedded, attention_mask, train);
        let pooled = dropout(&self.pooler.forward_t(&hidden, train), self.dropout, train);
        pooled.apply(&self.classifier).to_kind(Kind::Float)
    }
}

#[cfg(test)]
#[path = "deberta_tests.rs"]
mod tests;
