//! DeBERTa's disentangled self-attention: content-to-content scores plus content-to-position
//! (c2p) and position-to-content (p2c) scores from one table of relative-position embeddings
//! (log-bucketed in v3).

use tch::nn;
use tch::{Device, Kind, Tensor};

use super::config::{Config, Relative, Settings};
use super::dropout;
use crate::model::Linear;

/// upstream: `DisentangledSelfAttention`, computed per head on `[batch, heads, seq, dim]`
/// instead of upstream's `[batch * heads, seq, dim]` (same numbers).
#[derive(Debug)]
pub(super) struct SelfAttention {
    pub(super) query_proj: Linear,
    pub(super) key_proj: Linear,
    pub(super) value_proj: Linear,
    /// Separate projections of the relative embeddings, made when `share_att_key` is false
    /// and only for the scores that are on (c2p reads `pos_key_proj`, p2c `pos_query_proj`);
    /// otherwise `key_proj` and `query_proj` project them too.
    pub(super) pos_key_proj: Option<Linear>,
    pub(super) pos_query_proj: Option<Linear>,
    pub(super) heads: i64,
    pub(super) c2p: bool,
    pub(super) p2c: bool,
    pub(super) att_span: Option<i64>,
    /// `sqrt(head_size * scale_factor)`, scale_factor = 1 + one per score type: upstream
    /// divides content and both position scores by the same number, so their sum keeps the
    /// variance of one. Computed in f32 as upstream does (`torch.sqrt` of a float tensor).
    pub(super) scale: f64,
    pub(super) dropout: f64,
    pub(super) pos_dropout: f64,
}

/// What every layer's attention shares in one forward pass.
pub(super) struct RelativeInputs {
    /// `[seq, seq]` int64: (bucketed) `i - j` for query `i`, key `j`.
    pub(super) positions: Tensor,
    /// `[2 * att_span, hidden]`, after the encoder's optional LayerNorm.
    pub(super) embeddings: Tensor,
}

impl SelfAttention {
    pub(super) fn new(p: nn::Path, cfg: &Config, s: &Settings) -> Self {
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
    pub(super) fn forward_t(
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
pub(super) fn relative_positions(t: i64, rel: Relative, device: Device) -> Tensor {
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
