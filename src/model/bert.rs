//! BERT (and MiniLM, which is a BERT) and RoBERTa, which differs only in its position ids
//! and its classification head.
//!
//! Follows transformers 5.23 `models/bert/modeling_bert.py` and
//! `models/roberta/modeling_roberta.py`; variable paths are HF's weight names.

use serde::Deserialize;
use tch::Tensor;
use tch::nn::{self, Module};

use super::{
    Classifier, EncoderLayer, FeedForward, Fused, Linear, attention, attention_bias, dropout,
    embedding, feed_forward, layer_norm, linear, project_qkv, queries,
};
use crate::error::{Error, Result};

/// `BertConfig` / `RobertaConfig`: the fields the forward pass reads.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct Config {
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub intermediate_size: i64,
    #[serde(default = "gelu")]
    pub hidden_act: String,
    #[serde(default = "default_dropout")]
    pub hidden_dropout_prob: f64,
    #[serde(default = "default_dropout")]
    pub attention_probs_dropout_prob: f64,
    #[serde(default = "max_positions")]
    pub max_position_embeddings: i64,
    #[serde(default = "type_vocab")]
    pub type_vocab_size: i64,
    #[serde(default = "init_range")]
    pub initializer_range: f64,
    #[serde(default = "eps")]
    pub layer_norm_eps: f64,
    #[serde(default)]
    pub pad_token_id: i64,
    pub classifier_dropout: Option<f64>,
    pub position_embedding_type: Option<String>,
}

fn gelu() -> String {
    "gelu".into()
}
fn default_dropout() -> f64 {
    0.1
}
fn max_positions() -> i64 {
    512
}
fn type_vocab() -> i64 {
    2
}
fn init_range() -> f64 {
    0.02
}
fn eps() -> f64 {
    1e-12
}

impl Config {
    fn check(&self) -> Result<()> {
        if let Some(kind) = &self.position_embedding_type
            && kind != "absolute"
        {
            return Err(Error::Model(format!(
                "position_embedding_type `{kind}` is not supported; lakeml implements `absolute`"
            )));
        }
        if !super::ACTIVATIONS.contains(&self.hidden_act.as_str()) {
            return Err(Error::Model(format!(
                "hidden_act `{}` is not supported; lakeml implements {}",
                self.hidden_act,
                super::ACTIVATIONS.join(", ")
            )));
        }
        if self.hidden_size % self.num_attention_heads != 0 {
            return Err(Error::Model(format!(
                "hidden_size {} is not a multiple of num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            )));
        }
        Ok(())
    }
}

/// `BertEmbeddings` / `RobertaEmbeddings`.
struct Embeddings {
    word: nn::Embedding,
    position: nn::Embedding,
    token_type: nn::Embedding,
    norm: nn::LayerNorm,
    dropout: f64,
    /// RoBERTa: positions count real tokens from `padding_idx + 1`.
    roberta_padding_idx: Option<i64>,
}

impl Embeddings {
    fn new(p: nn::Path, c: &Config, roberta: bool) -> Self {
        let pad = Some(c.pad_token_id);
        Self {
            word: embedding(
                &p / "word_embeddings",
                c.vocab_size,
                c.hidden_size,
                c.initializer_range,
                pad,
            ),
            position: embedding(
                &p / "position_embeddings",
                c.max_position_embeddings,
                c.hidden_size,
                c.initializer_range,
                if roberta { pad } else { None },
            ),
            token_type: embedding(
                &p / "token_type_embeddings",
                c.type_vocab_size,
                c.hidden_size,
                c.initializer_range,
                None,
            ),
            norm: layer_norm(&p / "LayerNorm", c.hidden_size, c.layer_norm_eps),
            dropout: c.hidden_dropout_prob,
            roberta_padding_idx: roberta.then_some(c.pad_token_id),
        }
    }

    fn forward_t(&self, input_ids: &Tensor, train: bool) -> Tensor {
        let (b, t) = (input_ids.size()[0], input_ids.size()[1]);
        let positions = match self.roberta_padding_idx {
            // `create_position_ids_from_input_ids`
            Some(pad) => {
                let real = input_ids.ne(pad).to_kind(tch::Kind::Int64);
                real.cumsum(1, tch::Kind::Int64) * &real + pad
            }
            None => Tensor::arange(t, (tch::Kind::Int64, input_ids.device()))
                .unsqueeze(0)
                .expand([b, t], false),
        };
        let types = input_ids.zeros_like();
        let x = self.word.forward(input_ids)
            + self.token_type.forward(&types)
            + self.position.forward(&positions);
        dropout(&self.norm.forward(&x), self.dropout, train)
    }
}

/// `BertLayer`: self-attention + feed-forward, each with residual and LayerNorm.
struct Layer {
    query: Linear,
    key: Linear,
    value: Linear,
    /// int8 inference: query, key and value as one product.
    qkv: Option<Fused<3>>,
    /// Float inference: the query, key and value weights as one (see
    /// [`Classifier::fuse_qkv`]).
    qkv_weight: Option<Tensor>,
    attn_out: Linear,
    attn_norm: nn::LayerNorm,
    intermediate: Linear,
    output: Linear,
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

impl Layer {
    fn new(p: nn::Path, c: &Config) -> Self {
        let (h, std) = (c.hidden_size, c.initializer_range);
        let attn = &p / "attention";
        Self {
            query: linear(&attn / "self" / "query", h, h, std),
            key: linear(&attn / "self" / "key", h, h, std),
            value: linear(&attn / "self" / "value", h, h, std),
            qkv: None,
            qkv_weight: None,
            attn_out: linear(&attn / "output" / "dense", h, h, std),
            attn_norm: layer_norm(&attn / "output" / "LayerNorm", h, c.layer_norm_eps),
            intermediate: linear(&p / "intermediate" / "dense", h, c.intermediate_size, std),
            output: linear(&p / "output" / "dense", c.intermediate_size, h, std),
            ffn: None,
            out_norm: layer_norm(&p / "output" / "LayerNorm", h, c.layer_norm_eps),
            heads: c.num_attention_heads,
            act: c.hidden_act.clone(),
            eps: c.layer_norm_eps,
            dropout: c.hidden_dropout_prob,
            attn_dropout: c.attention_probs_dropout_prob,
        }
    }

    /// int8 products (query, key and value fused), but bf16 for the feed-forward
    /// down-projection (see `model::linear`).
    fn quantize_int8(&mut self) {
        self.qkv = Some(Fused::int8([&self.query, &self.key, &self.value]));
        self.attn_out.quantize();
        self.ffn = FeedForward::quantize(&self.act, &mut self.intermediate, &mut self.output);
    }

    /// See [`Classifier::fuse_qkv`].
    fn fuse_qkv(&mut self) {
        self.qkv_weight = EncoderLayer::fused_weight([&self.query, &self.key, &self.value]);
    }

    /// The layer's parts, for float inference with lakeml's own passes (see
    /// [`EncoderLayer`]); none once its products run in int8.
    fn encoder_layer(&self) -> Option<EncoderLayer<'_>> {
        (self.qkv.is_none() && self.ffn.is_none()).then(|| EncoderLayer {
            qkv: [&self.query, &self.key, &self.value],
            qkv_weight: self.qkv_weight.as_ref(),
            out: &self.attn_out,
            attn_norm: &self.attn_norm,
            up: &self.intermediate,
            down: &self.output,
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
            [&self.query, &self.key, &self.value],
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
        let x = self.attn_norm.forward(&if train {
            dropout(&self.attn_out.forward(&ctx), self.dropout, true) + q
        } else {
            self.attn_out.forward_add(&ctx, &q)
        });
        let out = feed_forward(
            self.ffn.as_ref(),
            [&self.intermediate, &self.output],
            &self.act,
            &x,
            self.dropout,
            train,
        );
        self.out_norm.forward(&out)
    }
}

/// `BertModel` without its pooler (the heads below own theirs).
struct Encoder {
    embeddings: Embeddings,
    layers: Vec<Layer>,
}

impl Encoder {
    /// Every layer's products in int8 (see [`Classifier::quantize_int8`]).
    fn quantize_int8(&mut self) {
        self.layers.iter_mut().for_each(Layer::quantize_int8);
    }

    fn fuse_qkv(&mut self) {
        self.layers.iter_mut().for_each(Layer::fuse_qkv);
    }

    fn new(p: &nn::Path, c: &Config, roberta: bool) -> Result<Self> {
        c.check()?;
        Ok(Self {
            embeddings: Embeddings::new(p / "embeddings", c, roberta),
            layers: (0..c.num_hidden_layers)
                .map(|i| Layer::new(p / "encoder" / "layer" / i, c))
                .collect(),
        })
    }

    /// Hidden states `[batch, seq, hidden]`; with `first_only`, the last layer computes the
    /// first token only (`[batch, 1, hidden]`), which is all the classification heads read:
    /// in training too, where nothing else reaches the loss, so the gradients are the full
    /// layer's (tested below) without its other rows' query, output and feed-forward.
    fn forward_t(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        train: bool,
        first_only: bool,
    ) -> Tensor {
        let mut x = self.embeddings.forward_t(input_ids, train);
        let bias = attention_bias(attention_mask, x.kind());
        let last = self.layers.len().saturating_sub(1);
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward_t(&x, &bias, train, first_only && i == last);
        }
        x
    }
}

/// `BertForSequenceClassification`: pooler (dense + tanh on `[CLS]`), dropout, classifier.
pub(crate) struct BertClassifier {
    encoder: Encoder,
    pooler: Linear,
    classifier: Linear,
    dropout: f64,
}

impl BertClassifier {
    pub(crate) fn new(p: &nn::Path, c: &Config, num_labels: i64) -> Result<Self> {
        let bert = p / "bert";
        let std = c.initializer_range;
        Ok(Self {
            encoder: Encoder::new(&bert, c, false)?,
            pooler: linear(
                &bert / "pooler" / "dense",
                c.hidden_size,
                c.hidden_size,
                std,
            ),
            classifier: linear(p / "classifier", c.hidden_size, num_labels, std),
            dropout: c.classifier_dropout.unwrap_or(c.hidden_dropout_prob),
        })
    }
}

impl Classifier for BertClassifier {
    fn forward_t(&self, input_ids: &Tensor, attention_mask: &Tensor, train: bool) -> Tensor {
        let x = self
            .encoder
            .forward_t(input_ids, attention_mask, train, true);
        let pooled = self.pooler.forward(&x.select(1, 0)).tanh();
        self.classifier
            .forward(&dropout(&pooled, self.dropout, train))
            .to_kind(tch::Kind::Float)
    }

    fn encode(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Tensor {
        self.encoder
            .forward_t(input_ids, attention_mask, false, false)
            .to_kind(tch::Kind::Float)
    }

    fn quantize_int8(&mut self) {
        self.encoder.quantize_int8();
    }

    fn fuse_qkv(&mut self) {
        self.encoder.fuse_qkv();
    }
}

/// `RobertaForSequenceClassification`: `RobertaClassificationHead` on `<s>`, no pooler.
pub(crate) struct RobertaClassifier {
    encoder: Encoder,
    dense: Linear,
    out_proj: Linear,
    dropout: f64,
}

impl RobertaClassifier {
    pub(crate) fn new(p: &nn::Path, c: &Config, num_labels: i64) -> Result<Self> {
        let head = p / "classifier";
        let std = c.initializer_range;
        Ok(Self {
            encoder: Encoder::new(&(p / "roberta"), c, true)?,
            dense: linear(&head / "dense", c.hidden_size, c.hidden_size, std),
            out_proj: linear(&head / "out_proj", c.hidden_size, num_labels, std),
            dropout: c.classifier_dropout.unwrap_or(c.hidden_dropout_prob),
        })
    }
}

impl Classifier for RobertaClassifier {
    fn forward_t(&self, input_ids: &Tensor, attention_mask: &Tensor, train: bool) -> Tensor {
        let x = self
            .encoder
            .forward_t(input_ids, attention_mask, train, true);
        let x = dropout(&x.select(1, 0), self.dropout, train);
        let x = dropout(&self.dense.forward(&x).tanh(), self.dropout, train);
        self.out_proj.forward(&x).to_kind(tch::Kind::Float)
    }

    fn encode(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Tensor {
        self.encoder
            .forward_t(input_ids, attention_mask, false, false)
            .to_kind(tch::Kind::Float)
    }

    fn quantize_int8(&mut self) {
        self.encoder.quantize_int8();
    }

    fn fuse_qkv(&mut self) {
        self.encoder.fuse_qkv();
    }
}

#[cfg(test)]
mod tests {
    use tch::nn::{self, Module};
    use tch::{Device, Tensor};

    use super::{BertClassifier, Classifier, Config, attention_bias};
    use crate::model::tests::{assert_same_gradients, fixture_config};

    #[test]
    fn the_cls_only_last_layer_trains_with_the_full_layers_gradients() {
        let (dir, mut c, ids, mask): (_, Config, _, _) = fixture_config("bert");
        let (ids, mask) = (&ids, &mask);
        c.hidden_dropout_prob = 0.0;
        c.attention_probs_dropout_prob = 0.0;
        c.classifier_dropout = Some(0.0);
        let vs = nn::VarStore::new(Device::Cpu);
        let net = BertClassifier::new(&vs.root(), &c, 3).expect("build");
        crate::model::weights::load(&vs, &dir, "bert").expect("weights");
        let full = || -> Tensor {
            let e = &net.encoder;
            let mut x = e.embeddings.forward_t(ids, true);
            let bias = attention_bias(mask, x.kind());
            for layer in &e.layers {
                x = layer.forward_t(&x, &bias, true, false);
            }
            let pooled = net.pooler.forward(&x.select(1, 0)).tanh();
            net.classifier.forward(&pooled)
        };
        assert_same_gradients(&vs, || net.forward_t(ids, mask, true), full);
    }

    /// Float inference's own passes take an activation other than exact GELU through
    /// libtorch's (after adding the bias): the logits are those of libtorch's ops, which the
    /// same model runs with gradients on.
    #[test]
    fn own_inference_with_a_tanh_gelu_matches_libtorchs_ops() {
        let (dir, mut c, ids, mask): (_, Config, _, _) = fixture_config("bert");
        c.hidden_act = "gelu_new".into();
        let vs = nn::VarStore::new(Device::Cpu);
        let net = BertClassifier::new(&vs.root(), &c, 3).expect("build");
        crate::model::weights::load(&vs, &dir, "bert").expect("weights");
        let own = tch::no_grad(|| net.forward_t(&ids, &mask, false));
        let ops = net.forward_t(&ids, &mask, false).detach();
        let d = f64::try_from((&own - &ops).abs().max()).expect("scalar");
        // fp32, summation order; 0 would mean both ran libtorch's ops.
        assert!(d <= 1e-5 && d > 0.0, "logits differ by {d}");
    }
}
