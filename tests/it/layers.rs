//! The library's top-level modules import one way (ARCHITECTURE.md, "Layers"): no module
//! reaches itself through `crate::` imports, directly or through others.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src/ is readable").flatten() {
        let path = entry.path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Top-level module → the top-level modules its code names as `crate::x`. Comments and unit
/// tests (`tests.rs`, `*_tests.rs`, and what follows a file's `#[cfg(test)]`) are left out.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let rel = file.strip_prefix(&src).expect("under src/");
        let name = rel.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if name == "tests.rs" || name.ends_with("_tests.rs") {
            continue;
        }
        let first = rel
            .iter()
            .next()
            .and_then(|c| c.to_str())
            .unwrap_or_default();
        let top = first.trim_end_matches(".rs").to_string();
        if top == "lib" || top == "main" {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("readable source");
        let deps = graph.entry(top.clone()).or_default();
        for line in text.lines() {
            let line = line.trim_start();
            if line.starts_with("#[cfg(test)]") {
                break;
            }
            if line.starts_with("//") {
                continue;
            }
            for (at, _) in line.match_indices("crate::") {
                let module: String = line[at + "crate::".len()..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                let lower = module
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_lowercase());
                if lower && module != top {
                    deps.insert(module);
                }
            }
        }
    }
    graph
}

/// A path from `from` back to `to`, if there is one.
fn path_to(
    graph: &BTreeMap<String, BTreeSet<String>>,
    from: &str,
    to: &str,
    seen: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    if from == to {
        return Some(vec![to.to_string()]);
    }
    if !seen.insert(from.to_string()) {
        return None;
    }
    for next in graph.get(from).into_iter().flatten() {
        if let Some(mut rest) = path_to(graph, next, to, seen) {
            rest.insert(0, from.to_string());
            return Some(rest);
        }
    }
    None
}

#[test]
fn modules_import_one_way() {
    let graph = imports();
    assert!(
        ["plan", "stages", "train", "predict", "config"]
            .iter()
            .all(|m| graph.contains_key(*m)),
        "the scan found no modules: {graph:?}"
    );
    let mut circles = Vec::new();
    for (module, deps) in &graph {
        for dep in deps {
            if let Some(back) = path_to(&graph, dep, module, &mut BTreeSet::new()) {
                circles.push(format!("{module} -> {}", back.join(" -> ")));
            }
        }
    }
    assert!(
        circles.is_empty(),
        "modules that import each other (settle which layer owns what):\n{}",
        circles.join("\n")
    );
}
