//! BERT-family sequence classifiers in tch, loaded from (and saved as) HF model directories.
//!
//! Each architecture lives in its own file, mirrors its `modeling_*.py` block by block, and
//! names its variables exactly as the HF `*ForSequenceClassification` checkpoint does, so
//! weights load by name (see [`weights`]).

mod attend;
mod bert;
mod config;
mod deberta;
mod distilbert;
mod dropout;
mod epilogue;
mod int8;
mod linear;
#[cfg(test)]
mod tests;
pub(crate) mod thread;
mod weights;

pub(crate) use weights::weight_files;

use std::path::Path;

use tch::nn::Module;
use tch::{Device, Tensor, nn};

pub(crate) use config::{Arch, ModelConfig};
pub(crate) use dropout::dropout;
pub(crate) use epilogue::EncoderLayer;
pub(crate) use linear::{FeedForward, Fused, Linear};

use crate::error::{Error, Result};

/// A classifier with its weights: the network, the VarStore that owns its variables, and the
/// config it was built from.
pub(crate) struct Model {
    pub vs: nn::VarStore,
    pub net: Box<dyn Classifier>,
    pub config: ModelConfig,
    /// Variables the checkpoint lacked, which start from HF's initialisation (a new head).
    pub fresh: Vec<String>,
}

impl Model {
    /// Loads the weights of an HF model directory, whose `config.json` is `config` (read
    /// with [`ModelConfig::load`]), with a classification head of `num_labels` classes on
    /// `device`.
    pub(crate) fn load(
        config: ModelConfig,
        dir: &Path,
        num_labels: i64,
        device: Device,
    ) -> Result<Self> {
        let vs = nn::VarStore::new(device);
        let net = build(&vs.root(), &config.arch, num_labels)?;
        let loaded = weights::load(&vs, dir, config.arch.prefix())?;
        Ok(Self {
            vs,
            net,
            config,
            fresh: loaded.fresh,
        })
    }

    /// Writes the weights as `model.safetensors` into `dir`.
    pub(crate) fn save_weights(&self, dir: &Path) -> Result<()> {
        weights::save(&self.vs, &dir.join("model.safetensors"))
    }
}

fn build(p: &nn::Path, arch: &Arch, num_labels: i64) -> Result<Box<dyn Classifier>> {
    if num_labels < 2 {
        return Err(Error::Model(format!(
            "a classifier needs at least 2 classes, got {num_labels}"
        )));
    }
    Ok(match arch {
        Arch::Bert(c) => Box::new(bert::BertClassifier::new(p, c, num_labels)?),
        Arch::Roberta(c) => Box::new(bert::RobertaClassifier::new(p, c, num_labels)?),
        Arch::DistilBert(c) => Box::new(distilbert::DistilBertClassifier::new(p, c, num_labels)?),
        Arch::DebertaV2(c) => Box::new(deberta::DebertaV2ForSequenceClassification::new(
            p, c, num_labels,
        )?),
    })
}

/// A sequence classifier: token ids in, logits out.
pub(crate) trait Classifier: Send {
    /// Logits `[batch, num_labels]` (fp32) for `input_ids` `[batch, seq]` (int64) whose real
    /// tokens are marked by `attention_mask` `[batch, seq]` (int64, 1 = token, 0 = padding).
    /// `train` switches dropout on.
    fn forward_t(&self, input_ids: &Tensor, attention_mask: &Tensor, train: bool) -> Tensor;

    /// The encoder's last hidden states `[batch, seq, hidden]` (fp32) for every token, for
    /// inference: what sentence-embedding pooling reads. The classification head is not run.
    fn encode(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Tensor;

    /// Switches the encoder's linear layers to int8 products (see [`Linear::quantize`]) for
    /// inference, except each feed-forward down-projection, which runs in bf16
    /// ([`Linear::use_bf16`]); embeddings, LayerNorms, attention and the head stay fp32.
    fn quantize_int8(&mut self);

    /// For fp32 or bf16 inference only (predict, serve): each encoder layer's query, key and
    /// value weights copied into one `[3 × hidden, hidden]` weight, so that they run as one
    /// product (see [`EncoderLayer`]). The copies do not follow later changes to the weights:
    /// call this once they are final. DeBERTa keeps three products.
    fn fuse_qkv(&mut self) {}
}

/// An additive attention bias `[batch, 1, 1, seq]` from a `[batch, seq]` 0/1 mask: 0 where a
/// token may be attended to, the dtype's lowest value where it is padding (as HF does).
pub(crate) fn attention_bias(attention_mask: &Tensor, kind: tch::Kind) -> Tensor {
    let keep = attention_mask.to_kind(kind).unsqueeze(1).unsqueeze(1);
    let min = match kind {
        tch::Kind::BFloat16 => -3.389_531_4e38,
        tch::Kind::Half => -65504.0,
        _ => f64::from(f32::MIN),
    };
    (keep.ones_like() - keep) * min
}

/// The `hidden_act` values [`activation`] implements.
pub(crate) const ACTIVATIONS: &[&str] = &[
    "gelu",
    "gelu_new",
    "gelu_pytorch_tanh",
    "gelu_fast",
    "relu",
    "tanh",
];

/// The rows of `x` `[batch, seq, hidden]` a layer must compute: all of them, or only the
/// first token's when nothing after the layer reads the others (the last layer of a
/// classifier whose head reads `[CLS]`). Keys and values still come from every token, so
/// the first token's output is exactly what the full layer gives it. The first tokens are
/// copied out (`batch` rows): libtorch multiplies a strided view of them by a weight through
/// `bmm`, with a copy of the whole weight per sequence.
pub(crate) fn queries(x: &Tensor, first_only: bool) -> Tensor {
    if first_only {
        x.narrow(1, 0, 1).contiguous()
    } else {
        x.shallow_clone()
    }
}

/// A layer's queries (for the rows [`queries`] keeps), keys and values for `x`: from one
/// fused product when the layer has one (int8 inference), else from its three layers.
pub(crate) fn project_qkv(
    fused: Option<&Fused<3>>,
    [query, key, value]: [&Linear; 3],
    x: &Tensor,
    first_only: bool,
) -> [Tensor; 3] {
    match fused {
        // The fused product computes every row's query; a last layer keeps the first.
        Some(qkv) => {
            let [q, k, v] = qkv.forward(x);
            [queries(&q, first_only), k, v]
        }
        None => [
            query.forward(&queries(x, first_only)),
            key.forward(x),
            value.forward(x),
        ],
    }
}

/// A layer's feed-forward block over `x`, plus `x` (its residual): `down(act(up(x)))`
/// with dropout, or the fused int8 block when the layer has one (int8 inference).
pub(crate) fn feed_forward(
    fused: Option<&FeedForward>,
    [up, down]: [&Linear; 2],
    act: &str,
    x: &Tensor,
    dropout: f64,
    train: bool,
) -> Tensor {
    match fused {
        Some(ffn) => ffn.forward(x, x),
        None => {
            self::dropout(
                &down.forward(&activation(act, &up.forward(x))),
                dropout,
                train,
            ) + x
        }
    }
}

/// HF's `ACT2FN` for the activations these models use.
pub(crate) fn activation(name: &str, x: &Tensor) -> Tensor {
    match name {
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => x.gelu("tanh"),
        "relu" => x.relu(),
        "tanh" => x.tanh(),
        // "gelu" (exact, erf-based); configs are checked against ACTIVATIONS.
        _ => x.gelu("none"),
    }
}

/// [`Linear`] initialised as HF does (normal(0, std) weights, zero bias); the init only
/// matters for weights the checkpoint lacks, such as a fresh classification head.
pub(crate) fn linear(p: tch::nn::Path, input: i64, output: i64, std: f64) -> Linear {
    Linear::new(tch::nn::linear(
        p,
        input,
        output,
        tch::nn::LinearConfig {
            ws_init: tch::nn::Init::Randn {
                mean: 0.0,
                stdev: std,
            },
            bs_init: Some(tch::nn::Init::Const(0.0)),
            bias: true,
        },
    ))
}

pub(crate) fn layer_norm(p: tch::nn::Path, dim: i64, eps: f64) -> tch::nn::LayerNorm {
    tch::nn::layer_norm(
        p,
        vec![dim],
        tch::nn::LayerNormConfig {
            eps,
            ..Default::default()
        },
    )
}

/// `nn::Embedding`; rows at `padding_idx` (if any) get no gradient, as in PyTorch.
pub(crate) fn embedding(
    p: tch::nn::Path,
    rows: i64,
    dim: i64,
    std: f64,
    padding_idx: Option<i64>,
) -> tch::nn::Embedding {
    tch::nn::embedding(
        p,
        rows,
        dim,
        tch::nn::EmbeddingConfig {
            ws_init: tch::nn::Init::Randn {
                mean: 0.0,
                stdev: std,
            },
            padding_idx: padding_idx.unwrap_or(-1),
            ..Default::default()
        },
    )
}

/// Multi-head scaled dot-product attention of `[batch, queries, hidden]` queries over
/// `[batch, seq, hidden]` keys and values, with an additive `bias` `[batch, 1, 1, seq]`;
/// returns `[batch, queries, hidden]`.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    heads: i64,
    dropout: f64,
    train: bool,
) -> Tensor {
    let size = q.size();
    let (b, t, hidden) = (size[0], size[1], size[2]);
    // Queries may be fewer than keys (only the first token's, in a classifier's last layer).
    let split = |x: &Tensor| {
        x.view([b, x.size()[1], heads, hidden / heads])
            .transpose(1, 2)
    };
    let keys = k.size()[1];
    let d = hidden / heads;
    let scale = 1.0 / (d as f64).sqrt();
    let cpu = q.device() == tch::Device::Cpu;
    let dropout = if train { dropout } else { 0.0 };
    if !train && attend::runs(q, k) {
        // Inference on short sequences: one own pass per sequence, reading the projections
        // in place (see `attend`).
        return attend::attention(q, k, v, None, bias, heads as usize, scale as f32);
    }
    let short = keys <= short_attention(q.kind());
    let (q, k, v) = (split(q), split(k), split(v));
    let ctx = if cpu && (dropout > 0.0 || short) {
        // Short sequences on CPU: three batched products beat the fused kernel,
        // whose per-block overhead dominates at these sizes (about 1.6x at 27 tokens in
        // fp32, 2x in bf16, on an AVX-512 CPU). Same arithmetic as HF's "eager" attention.
        // With dropout the fused kernel would fall back to these same products, with
        // libtorch's serial dropout; here the probabilities get lakeml's (see `dropout`).
        let bh = b * heads;
        let (q, k) = (
            q.reshape([bh, t, d]),
            k.reshape([bh, keys, d]).transpose(1, 2),
        );
        let scores = bias
            .expand([b, heads, t, keys], false)
            .reshape([bh, t, keys])
            .baddbmm(&q, &k, 1.0, scale);
        let probs = self::dropout(&scores.softmax(-1, scores.kind()), dropout, train);
        probs.bmm(&v.reshape([bh, keys, d])).view([b, heads, t, d])
    } else {
        Tensor::scaled_dot_product_attention(&q, &k, &v, Some(bias), dropout, false, None, false)
    };
    ctx.transpose(1, 2).reshape([b, t, hidden])
}

/// The longest key sequence for which inference on CPU computes attention with lakeml's own
/// pass (`attend`, on AVX-512). Measured alone (2 threads, 12 heads of 32 channels, 136
/// sequences of 30 keys): 2.7 ms in bf16 and 4.1-4.7 ms in fp32, where the batched products
/// took 7.8-9.3 and 5.1-6.9 ms and the fused SDPA kernel 6.0-9.8 and 6.4-8.8; at 64 keys
/// (64 sequences) 4.8-5.1 and 5.3-5.8 ms. The pass's first version was even with the
/// products up to 96 keys and slower at 128; the limit has not been re-measured since.
const OWN_ATTENTION_KEYS: i64 = 96;

/// The longest key sequence for which attention on CPU runs as batched products rather than
/// with the fused SDPA kernel (measured on CPU: the fused kernel wins beyond about 64 keys
/// in fp32; in bf16 the products still win at 256).
fn short_attention(kind: tch::Kind) -> i64 {
    if kind == tch::Kind::BFloat16 { 256 } else { 64 }
}
