//! Parallel tokenization into Arrow: the HF tokenizer core ([`Encoder`]) and the per-batch
//! transform with its bad-row policies.

mod batch;
mod encoder;

pub(crate) use batch::{Counters, LabelMap, RowPolicy, output_schema, tokenize_batch};
pub use encoder::{Encoded, Encoder, EncoderSettings};
