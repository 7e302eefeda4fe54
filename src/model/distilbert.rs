//! DistilBERT: BERT without token types or pooler, with its own weight names and head.
//!
//! Follows transformers 5.23 `models/distilbert/modeling_distilbert.py`; variable paths are
//! HF's weight names.

use serde::Deserialize;
use tch::Tensor;
use tch::nn::{self, Module};

use super::{
    Classifier, EncoderLayer, FeedForward, Fused, Linear, attention, attention_bias, dropout,
    embedding, feed_forward, layer_norm, linear, project_qkv, queries,
};
use crate::error::{Error, Result};

/// DistilBERT's LayerNorms use a fixed epsilon, not a config field.
const EPS: f64 = 1e-12;

/// `DistilBertConfig`: the fields the forward pass reads.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct Config {
    pub vocab_size: i64,
    #[serde(default = "dim")]
    pub dim: i64,
    #[serde(default = "n_layers")]
    pub n_layers: i64,
    #[serde(default = "n_heads")]
    pub n_heads: i64,
    #[serde(default = "hidden_dim")]
    pub hidden_dim: i64,
    #[serde(default = "default_dropout")]
    pub dropout: f64,
    #[serde(default = "default_dropout")]
    pub attention_dropout: f64,
    #[serde(default = "gelu")]
    pub activation: String,
    #[serde(default = "max_positions")]
    pub max_position_embeddings: i64,
    #[serde(default = "init_range")]
    pub initializer_range: f64,
    #[serde(default = "seq_classif_dropout")]
    pub seq_classif_dropout: f64,
    #[serde(default)]
    pub pad_token_id: i64,
}

fn dim() -> i64 {
    768
}
fn n_layers() -> i64 {
    6
}
fn n_heads() -> i64 {
    12
}
fn hidden_dim() -> i64 {
    3072
}
fn default_dropout() -> f64 {
    0.1
}
fn gelu() -> String {
    "gelu".into()
}
fn max_positions() -> i64 {
    512
}
fn init_range() -> f64 {
    0.02
}
fn seq_classif_dropout() -> f64 {
    0.2
}

/// `TransformerBlock`.
struct Block {
    q: Linear,
    k: Linear,
    v: Linear,
    /// int8 inference: q, k and v as one product.
    qkv: Option<Fused<3>>,
    /// Float inference: the q, k and v weights as one (see [`Classifier::fuse_qkv`]).
    qkv_weight: Option<Tensor>,
    out: Linear,
    sa_norm: nn::LayerNorm,
    lin1: Linear,
    lin2: Linear,
    /// int8 inference with exact GELU: the feed-forward block's products and the GELU fused.
    ffn: Option<FeedForward>,
    out_norm: nn::LayerNorm,
    heads: i64,
    act: String,
    /// The LayerNorms' epsilon.
    eps: f64,
    dropout: f64,
    attn_dropout: f64,
}

impl Block {
    fn new(p: nn::Path, c: &Config) -> Self {
        let (d, std) = (c.dim, c.initializer_range);
        let a = &p / "attention";
        Self {
            q: linear(&a / "q_lin", d, d, std),
            k: linear(&a / "k_lin", d, d, std),
            v: linear(&a / "v_lin", d, d, std),
            qkv: None,
            qkv_weight: None,
            out: linear(&a / "out_lin", d, d, std),
            sa_norm: layer_norm(&p / "sa_layer_norm", d, EPS),
            lin1: linear(&p / "ffn" / "lin1", d, c.hidden_dim, std),
            lin2: linear(&p / "ffn" / "lin2", c.hidden_dim, d, std),
            ffn: None,
            out_norm: layer_norm(&p / "output_layer_norm", d, EPS),
            heads: c.n_heads,
            act: c.activation.clone(),
            eps: EPS,
            dropout: c.dropout,
            attn_dropout: c.attention_dropout,
        }
    }

    /// int8 products (q, k and v fused), but bf16 for the feed-forward down-projection
    /// (see `model::linear`).
    fn quantize_int8(&mut self) {
        self.qkv = Some(Fused::int8([&self.q, &self.k, &self.v]));
        self.out.quantize();
        self.ffn = FeedForward::quantize(&self.act, &mut self.lin1, &mut self.lin2);
    }

    /// See [`Classifier::fuse_qkv`].
    fn fuse_qkv(&mut self) {
        self.qkv_weight = EncoderLayer::fused_weight([&self.q, &self.k, &self.v]);
    }

    /// The layer's parts, for float inference with lakeml's own passes (see
    /// [`EncoderLayer`]); none once its products run in int8.
    fn encoder_layer(&self) -> Option<EncoderLayer<'_>> {
        (self.qkv.is_none() && self.ffn.is_none()).then(|| EncoderLayer {
            qkv: [&self.q, &self.k, &self.v],
            qkv_weight: self.qkv_weight.as_ref(),
            out: &self.out,
            attn_norm: &self.sa_norm,
            up: &self.lin1,
            down: &self.lin2,
            out_norm: &self.out_norm,
            heads: self.heads,
            act: &self.act,
            eps: self.eps,
        })
    }

    /// `first_only`: compute the output of the first token only (see [`queries`]).
    fn forward_t(&self, x: &Tensor, bias: &Tensor, train: bool, first_only: bool) -> Tensor {
        if let Some(layer) = self.encoder_layer().filter(|l| l.runs(x, train)) {
            return layer.infer(x, bias, first_only);
        }
        let q = queries(x, first_only);
        let [query, key, value] = project_qkv(
            self.qkv.as_ref(),
            [&self.q, &self.k, &self.v],
            x,
            first_only,
        );
        let ctx = attention(
            &query,
            &key,
            &value,
            bias,
            self.heads,
            self.attn_dropout,
            train,
        );
        let x = self.sa_norm.forward(&self.out.forward_add(&ctx, &q));
        let out = feed_forward(
            self.ffn.as_ref(),
            [&self.lin1, &self.lin2],
            &self.act,
            &x,
            self.dropout,
            train,
        );
        self.out_norm.forward(&out)
    }
}

/// `DistilBertForSequenceClassification`: `[CLS]` → pre_classifier → ReLU → dropout →
/// classifier.
pub(crate) struct DistilBertClassifier {
    word: nn::Embedding,
    position: nn::Embedding,
    norm: nn::LayerNorm,
    blocks: Vec<Block>,
    pre_classifier: Linear,
    classifier: Linear,
    dropout: f64,
    head_dropout: f64,
}

impl DistilBertClassifier {
    pub(crate) fn new(p: &nn::Path, c: &Config, num_labels: i64) -> Result<Self> {
        if !super::ACTIVATIONS.contains(&c.activation.as_str()) {
            return Err(Error::Model(format!(
                "activation `{}` is not supported; lakeml implements {}",
                c.activation,
                super::ACTIVATIONS.join(", ")
            )));
        }
        if c.dim % c.n_heads != 0 {
            return Err(Error::Model(format!(
                "dim {} is not a multiple of n_heads {}",
                c.dim, c.n_heads
            )));
        }
        let base = p / "distilbert";
        let emb = &base / "embeddings";
        let std = c.initializer_range;
        Ok(Self {
            word: embedding(
                &emb / "word_embeddings",
                c.vocab_size,
                c.dim,
                std,
                Some(c.pad_token_id),
            ),
            position: embedding(
                &emb / "position_embeddings",
                c.max_position_embeddings,
                c.dim,
                std,
                None,
            ),
            norm: layer_norm(&emb / "LayerNorm", c.dim, EPS),
            blocks: (0..c.n_layers)
                .map(|i| Block::new(&base / "transformer" / "layer" / i, c))
                .collect(),
            pre_classifier: linear(p / "pre_classifier", c.dim, c.dim, std),
            classifier: linear(p / "classifier", c.dim, num_labels, std),
            dropout: c.dropout,
            head_dropout: c.seq_classif_dropout,
        })
    }
}

impl DistilBertClassifier {
    /// Hidden states `[batch, seq, dim]`; with `first_only`, the last block computes `[CLS]`
    /// only, in training too: the head (and so the loss) reads nothing else, so the
    /// gradients are the full block's (tested below).
    fn hidden(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        train: bool,
        first_only: bool,
    ) -> Tensor {
        let t = input_ids.size()[1];
        let positions = Tensor::arange(t, (tch::Kind::Int64, input_ids.device())).unsqueeze(0);
        let x = self.word.forward(input_ids) + self.position.forward(&positions);
        let mut x = dropout(&self.norm.forward(&x), self.dropout, train);
        let bias = attention_bias(attention_mask, x.kind());
        let last = self.blocks.len().saturating_sub(1);
        for (i, block) in self.blocks.iter().enumerate() {
            x = block.forward_t(&x, &bias, train, first_only && i == last);
        }
        x
    }
}

impl Classifier for DistilBertClassifier {
    fn forward_t(&self, input_ids: &Tensor, attention_mask: &Tensor, train: bool) -> Tensor {
        let x = self.hidden(input_ids, attention_mask, train, true);
        let pooled = self.pre_classifier.forward(&x.select(1, 0)).relu();
        self.classifier
            .forward(&dropout(&pooled, self.head_dropout, train))
            .to_kind(tch::Kind::Float)
    }

    fn encode(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Tensor {
        self.hidden(input_ids, attention_mask, false, false)
            .to_kind(tch::Kind::Float)
    }

    fn quantize_int8(&mut self) {
        self.blocks.iter_mut().for_each(Block::quantize_int8);
    }

    fn fuse_qkv(&mut self) {
        self.blocks.iter_mut().for_each(Block::fuse_qkv);
    }
}

#[cfg(test)]
mod tests {
    use tch::nn::{self, Module};
    use tch::{Device, Kind, Tensor};

    use super::{Classifier, Config, DistilBertClassifier, attention_bias};
    use crate::model::tests::{assert_same_gradients, fixture_config};

    #[test]
    fn the_cls_only_last_block_trains_with_the_full_blocks_gradients() {
        let (dir, mut c, ids, mask): (_, Config, _, _) = fixture_config("distilbert");
        let (ids, mask) = (&ids, &mask);
        c.dropout = 0.0;
        c.attention_dropout = 0.0;
        c.seq_classif_dropout = 0.0;
        let vs = nn::VarStore::new(Device::Cpu);
        let net = DistilBertClassifier::new(&vs.root(), &c, 3).expect("build");
        crate::model::weights::load(&vs, &dir, "distilbert").expect("weights");
        let full = || -> Tensor {
            let t = ids.size()[1];
            let positions = Tensor::arange(t, (Kind::Int64, Device::Cpu)).unsqueeze(0);
            let x = net.word.forward(ids) + net.position.forward(&positions);
            let mut x = net.norm.forward(&x);
            let bias = attention_bias(mask, x.kind());
            for block in &net.blocks {
                x = block.forward_t(&x, &bias, true, false);
            }
            let pooled = net.pre_classifier.forward(&x.select(1, 0)).relu();
            net.classifier.forward(&pooled)
        };
        assert_same_gradients(&vs, || net.forward_t(ids, mask, true), full);
    }
}
