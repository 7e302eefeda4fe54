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
//! [`Error::Model`](crate::error::Error::Model) naming the option (see `config::Settings::from_config`).

mod attention;
mod config;

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use attention::{RelativeInputs, SelfAttention, relative_positions};
pub(crate) use config::Config;
use config::{Relative, Settings};

use super::{Classifier, Linear, activation, dropout};
use crate::error::Result;

/// upstream: `DebertaV2Embeddings` (embedding_size != hidden_size adds `embed_proj`).
#[derive(Debug)]
struct Embeddings {
    word: nn::Embedding,
    position: Option<nn::Embedding>,
    token_type: Option<nn::Embedding>,
    embed_proj: Option<Linear>,
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

/// upstream: `DebertaV2SelfOutput` and `DebertaV2Output` (dense, dropout, residual LayerNorm).
#[derive(Debug)]
struct Output {
    dense: Linear,
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
    intermediate: Linear,
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

    /// int8 products, but bf16 for the feed-forward down-projection (see `model::linear`).
    fn quantize_int8(&mut self) {
        let a = &mut self.attention;
        let linears = [&mut a.query_proj, &mut a.key_proj, &mut a.value_proj]
            .into_iter()
            .chain(a.pos_key_proj.as_mut())
            .chain(a.pos_query_proj.as_mut())
            .chain([&mut self.attention_output.dense, &mut self.intermediate]);
        linears.for_each(Linear::quantize);
        self.output.dense.use_bf16();
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
    /// Every layer's products in int8 (see [`Classifier::quantize_int8`]).
    fn quantize_int8(&mut self) {
        self.layers.iter_mut().for_each(Layer::quantize_int8);
    }

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
    dense: Linear,
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
    classifier: Linear,
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

    fn encode(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Tensor {
        let embedded = self.embeddings.forward_t(input_ids, attention_mask, false);
        self.encoder
            .forward_t(&embedded, attention_mask, false)
            .to_kind(Kind::Float)
    }

    fn quantize_int8(&mut self) {
        self.encoder.quantize_int8();
    }
}

#[cfg(test)]
mod tests;
