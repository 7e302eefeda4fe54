//! The tokenizing core alone: lakeml's `Encoder` over texts already in memory, in the
//! stage's batch size, no table I/O. Driven by `benches/bench_tokenize.py`, which times
//! `tokenizers.encode_batch_fast` on the same texts in the same run.
//!
//! usage: tokenize TOKENIZER TEXTS_JSONL MAX_LENGTH REPEATS
//! (TEXTS_JSONL holds one JSON string per line); prints one JSON line.

use std::time::Instant;

use lakeml::{Encoder, EncoderSettings};

const BATCH_ROWS: usize = 8192;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    // `cargo bench` passes `--bench`; the harness passes the four arguments.
    let args: Vec<&String> = args
        .iter()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let [tokenizer, texts, max_length, repeats] = args[..] else {
        eprintln!(
            "usage: tokenize TOKENIZER TEXTS_JSONL MAX_LENGTH REPEATS (see benches/bench_tokenize.py)"
        );
        return Ok(());
    };
    let texts: Vec<String> = std::fs::read_to_string(texts)?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let encoder = Encoder::from_path(
        tokenizer.as_ref(),
        EncoderSettings::new(max_length.parse()?),
    )?;
    let mut seconds = Vec::new();
    let mut tokens = 0;
    for _ in 0..repeats.parse::<usize>()? {
        let started = Instant::now();
        tokens = 0;
        for batch in refs.chunks(BATCH_ROWS) {
            tokens += encoder.encode(batch, None)?.values.len();
        }
        seconds.push(started.elapsed().as_secs_f64());
    }
    seconds.sort_by(f64::total_cmp);
    let median = seconds[seconds.len() / 2];
    println!(
        "{}",
        serde_json::json!({
            "rows": refs.len(),
            "tokens": tokens,
            "seconds_median": median,
            "rows_per_s": refs.len() as f64 / median,
            "tokens_per_s": tokens as f64 / median,
        })
    );
    Ok(())
}
