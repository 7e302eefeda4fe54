//! What a YAML error says to a person: serde's wording, with "did you mean" for a misspelled
//! key and what to do for the mistakes people make most.

/// Every key a pipeline file may hold, for "did you mean" on a misspelled one.
const KNOWN_KEYS: &[&str] = &[
    "name",
    "tables",
    "stages",
    "delta",
    "parquet",
    "csv",
    "json",
    "version",
    "timestamp",
    "has_header",
    "delimiter",
    "newlines_in_values",
    "compression",
    "storage",
    "storage_options",
    "s3",
    "azure",
    "gcs",
    "write",
    "tokenize",
    "from",
    "sql",
    "sql_file",
    "to",
    "mode",
    "tokenizer",
    "id",
    "text",
    "text_pair",
    "label",
    "labels",
    "keep",
    "max_length",
    "truncation",
    "add_special_tokens",
    "on_overlong",
    "on_null",
    "on_empty",
    "on_invalid_utf8",
    "batch_rows",
    "train",
    "model",
    "output",
    "split",
    "device",
    "precision",
    "seed",
    "epochs",
    "max_steps",
    "batch_size",
    "eval_batch_size",
    "grad_accum",
    "lr",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "schedule",
    "warmup_steps",
    "warmup_ratio",
    "max_grad_norm",
    "group_by_length",
    "prefetch",
    "distributed",
    "backend",
    "timeout",
    "eval_every",
    "checkpoint_every",
    "keep_checkpoints",
    "best_metric",
    "save",
    "early_stopping",
    "metric",
    "patience",
    "min_delta",
    "log_every",
    "threads",
    "tracking",
    "mlflow",
    "uri",
    "experiment",
    "run_name",
    "predict",
    "job",
    "batch_tokens",
    "replicas",
    "logits",
    "serve",
    "listen",
    "models",
    "path",
    "default",
    "auth",
    "users_file",
    "tokens",
    "token_ttl",
    "tls",
    "cert",
    "key",
    "limits",
    "max_concurrent_queries",
    "query_timeout",
    "shutdown_grace",
];

/// The known word within edit distance 2 of `word`, if any.
pub(crate) fn closest<'a>(word: &str, known: &[&'a str]) -> Option<&'a str> {
    known
        .iter()
        .map(|k| (edit_distance(word, k), *k))
        .filter(|(d, _)| *d <= 2)
        .min()
        .map(|(_, k)| k)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// serde's wording, plus what to do for the mistakes people make most.
pub(super) fn describe_yaml_error(e: &serde_yaml_ng::Error) -> String {
    let msg = e.to_string();
    // serde_yaml_ng appends " at line X column Y" itself; we already said where.
    let msg = match msg.find(" at line ") {
        Some(i) => msg[..i].to_string(),
        None => msg,
    };
    if let Some(field) = msg
        .strip_prefix("unknown field `")
        .or_else(|| msg.split(": unknown field `").nth(1))
        .and_then(|rest| rest.split('`').next())
    {
        match closest(field, KNOWN_KEYS) {
            Some(known) => format!("{msg}; did you mean `{known}`?"),
            None => format!("{msg}; remove it or fix its spelling"),
        }
    } else if msg.contains("unknown variant") {
        format!("{msg}; use one of the values listed")
    } else if msg.contains("missing field") {
        format!("{msg}; add it")
    } else {
        msg
    }
}

#[cfg(test)]
mod tests {
    use super::{KNOWN_KEYS, closest};

    #[test]
    fn misspelled_keys_get_a_suggestion_and_others_do_not() {
        assert_eq!(closest("max_lenght", KNOWN_KEYS), Some("max_length"));
        assert_eq!(closest("tokenise", KNOWN_KEYS), Some("tokenize"));
        assert_eq!(closest("frobnicate", KNOWN_KEYS), None);
    }
}
