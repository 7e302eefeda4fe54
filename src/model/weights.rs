//! Weights in and out: HF safetensors (single file or sharded) mapped onto the VarStore by
//! name, and a trained model saved back as an HF directory's `model.safetensors`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tch::{Tensor, nn};

use crate::error::{Error, Result};

/// What loading found: variables the checkpoint did not have (they keep their fresh init).
pub(crate) struct Loaded {
    pub fresh: Vec<String>,
}

/// The safetensors files of a model directory: `model.safetensors`, or the shards listed by
/// `model.safetensors.index.json`.
pub(crate) fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index)
            .map_err(|e| Error::io(format!("reading {}", index.display()), e))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::Model(format!("{} is not valid JSON: {e}", index.display())))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::Model(format!("{} has no `weight_map`", index.display())))?;
        let mut files: Vec<PathBuf> = map
            .values()
            .filter_map(|v| v.as_str())
            .map(|f| dir.join(f))
            .collect();
        files.sort();
        files.dedup();
        return Ok(files);
    }
    let hint = if dir.join("pytorch_model.bin").is_file() {
        "; it has pytorch_model.bin: convert it with `model.save_pretrained(dir, safe_serialization=True)`"
    } else {
        ""
    };
    Err(Error::Model(format!(
        "{} has no model.safetensors (nor model.safetensors.index.json){hint}",
        dir.display()
    )))
}

/// A checkpoint name reduced to what every HF variant of it shares: without the base
/// model's prefix (`bert.` is absent from `BertModel` checkpoints such as MiniLM's) and with
/// the legacy LayerNorm names `gamma`/`beta`.
fn canonical(name: &str, prefix: &str) -> String {
    let name = name
        .strip_prefix(prefix)
        .and_then(|n| n.strip_prefix('.'))
        .unwrap_or(name);
    if let Some(stem) = name.strip_suffix(".gamma") {
        format!("{stem}.weight")
    } else if let Some(stem) = name.strip_suffix(".beta") {
        format!("{stem}.bias")
    } else {
        name.to_string()
    }
}

/// Copies the checkpoint in `dir` into `vs`. Head variables (outside the base model, or the
/// pooler) the checkpoint lacks, or has with another shape (another number of labels), keep
/// their initial values and are returned as fresh; any other gap is an error.
pub(crate) fn load(vs: &nn::VarStore, dir: &Path, prefix: &str) -> Result<Loaded> {
    let mut found: HashMap<String, Tensor> = HashMap::new();
    for file in weight_files(dir)? {
        let tensors = Tensor::read_safetensors(&file).map_err(|e| {
            Error::Model(format!(
                "cannot read {}: {e}; the file is corrupted or truncated, download it again",
                file.display()
            ))
        })?;
        for (name, t) in tensors {
            found.insert(canonical(&name, prefix), t);
        }
    }
    let mut fresh = Vec::new();
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, mut var) in vars {
        let is_head = !name.starts_with(&format!("{prefix}.")) || name.contains(".pooler.");
        match found.get(&canonical(&name, prefix)) {
            Some(t) if t.size() == var.size() => {
                let t = t.to_kind(var.kind()).to_device(var.device());
                tch::no_grad(|| var.copy_(&t));
            }
            Some(_) | None if is_head => fresh.push(name),
            Some(t) => {
                return Err(Error::Model(format!(
                    "{}: `{name}` has shape {:?} in the checkpoint but the config wants {:?}; \
                     config.json and model.safetensors do not belong together",
                    dir.display(),
                    t.size(),
                    var.size()
                )));
            }
            None => {
                return Err(Error::Model(format!(
                    "{}: the checkpoint has no weight for `{name}`; is it a `{prefix}` model \
                     as config.json says?",
                    dir.display()
                )));
            }
        }
    }
    Ok(Loaded { fresh })
}

/// Writes every variable, under its HF name, to `path` (fp32, CPU, as HF saves).
pub(crate) fn save(vs: &nn::VarStore, path: &Path) -> Result<()> {
    let mut vars: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(n, t)| {
            let t = t
                .detach()
                .to_device(tch::Device::Cpu)
                .to_kind(tch::Kind::Float)
                .contiguous();
            (n, t)
        })
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    Tensor::write_safetensors(&vars, path)
        .map_err(|e| Error::Model(format!("cannot write {}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::canonical;

    #[test]
    fn checkpoint_names_match_with_or_without_the_base_prefix() {
        assert_eq!(
            canonical("bert.embeddings.word_embeddings.weight", "bert"),
            canonical("embeddings.word_embeddings.weight", "bert")
        );
        assert_eq!(
            canonical("bert.embeddings.LayerNorm.gamma", "bert"),
            "embeddings.LayerNorm.weight"
        );
        assert_eq!(canonical("classifier.weight", "bert"), "classifier.weight");
    }
}
