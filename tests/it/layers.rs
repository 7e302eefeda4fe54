//! The library's modules import one way (ARCHITECTURE.md, "Layers"). The layer table is read
//! from ARCHITECTURE.md itself, so the document and the code cannot drift apart:
//! - every top-level module of `src/` is in the table, once;
//! - a module imports only modules of its own layer or of layers below it;
//! - no top-level module reaches itself through `crate::` imports, directly or through
//!   others, and no file of a module reaches itself through its sibling files.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A file's module path under `src/`: `serve/flight.rs` is `[serve, flight]`, `serve/mod.rs`
/// is `[serve]`.
type Module = Vec<String>;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every library `.rs` file under `src/` by its module path, with its code: comments and
/// unit tests (`tests.rs`, `*_tests.rs`, and what follows a file's `#[cfg(test)]`) left out.
fn sources() -> BTreeMap<Module, String> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("src/ is readable").flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let root = src();
    let mut files = Vec::new();
    walk(&root, &mut files);
    let mut modules = BTreeMap::new();
    for file in files {
        let rel = file.strip_prefix(&root).expect("under src/");
        let name = rel.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if name == "tests.rs" || name.ends_with("_tests.rs") {
            continue;
        }
        let mut module: Module = rel
            .with_extension("")
            .iter()
            .map(|c| c.to_string_lossy().into_owned())
            .collect();
        if module.last().is_some_and(|m| m == "mod") {
            module.pop();
        }
        if module == ["lib"] || module == ["main"] {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("readable source");
        let mut code = String::new();
        for line in text.lines() {
            let trimmed = line.trim_start();
            if trimmed.starts_with("#[cfg(test)]") {
                break;
            }
            if !trimmed.starts_with("//") {
                code.push_str(line);
                code.push('\n');
            }
        }
        modules.insert(module, code);
    }
    modules
}

/// The identifier at the start of `s`.
fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The items of a `{a, b::{c}, d}` group that starts `s` (after its `{`), at its top level.
fn group_items(s: &str) -> Vec<&str> {
    let (mut depth, mut start, mut items) = (0usize, 0, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                items.push(&s[start..i]);
                break;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items
}

/// The modules a path that continues as `rest` from module `base` names, descending while its
/// segments are modules (`flight::Service` from `[serve]` names `[serve, flight]`).
fn named(base: &[String], rest: &str, known: &BTreeSet<Module>, out: &mut BTreeSet<Module>) {
    let rest = rest.trim_start();
    if let Some(group) = rest.strip_prefix('{') {
        for item in group_items(group) {
            named(base, item, known, out);
        }
        return;
    }
    let name = ident(rest);
    if name.is_empty() || matches!(name, "self" | "super" | "crate") {
        return;
    }
    let mut module = base.to_vec();
    module.push(name.to_string());
    if known.contains(&module) {
        if let Some(next) = rest[name.len()..].strip_prefix("::") {
            named(&module, next, known, out);
        }
        out.insert(module);
    }
}

/// Module → the modules its code names through `crate::`, `super::` and `self::` paths.
fn imports(modules: &BTreeMap<Module, String>) -> BTreeMap<Module, BTreeSet<Module>> {
    let known: BTreeSet<Module> = modules.keys().cloned().collect();
    let mut graph = BTreeMap::new();
    for (module, code) in modules {
        let mut deps = BTreeSet::new();
        for (at, _) in code.match_indices("::") {
            let before = &code[..at];
            let word_start = before
                .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .map_or(0, |i| i + 1);
            if before[..word_start].ends_with("::") {
                continue; // not the first segment of a path
            }
            let mut rest = &code[at + 2..];
            let base: Module = match &before[word_start..] {
                "crate" => Vec::new(),
                "self" => module.clone(),
                "super" => {
                    let mut base = module[..module.len().saturating_sub(1)].to_vec();
                    while let Some(next) = rest.strip_prefix("super::") {
                        base.pop();
                        rest = next;
                    }
                    base
                }
                _ => continue,
            };
            named(&base, rest, &known, &mut deps);
        }
        deps.remove(module);
        graph.insert(module.clone(), deps);
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

/// Every `a -> ... -> a` in `graph`, one line each.
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let mut found = Vec::new();
    for (module, deps) in graph {
        for dep in deps {
            if let Some(back) = path_to(graph, dep, module, &mut BTreeSet::new()) {
                found.push(format!("{module} -> {}", back.join(" -> ")));
            }
        }
    }
    found
}

/// `a` without what stands in parentheses, at any depth.
fn outside_parentheses(a: &str) -> String {
    let mut depth = 0usize;
    a.chars()
        .filter(|&c| {
            match c {
                '(' => depth += 1,
                ')' => depth = depth.saturating_sub(1),
                _ => return depth == 0,
            }
            false
        })
        .collect()
}

/// ARCHITECTURE.md's layer table, top layer first: each layer's name and its modules (the
/// backquoted names of its second column, outside parentheses).
fn layers() -> Vec<(String, Vec<String>)> {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("ARCHITECTURE.md"))
            .expect("ARCHITECTURE.md");
    let table = doc
        .split("## Layers")
        .nth(1)
        .expect("ARCHITECTURE.md has a `## Layers` section");
    let mut layers = Vec::new();
    for row in table.lines().skip_while(|l| !l.starts_with('|')) {
        if !row.starts_with('|') {
            break;
        }
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let (Some(layer), Some(modules)) = (cells.get(1), cells.get(2)) else {
            continue;
        };
        if *layer == "layer" || layer.starts_with("---") {
            continue;
        }
        let names = outside_parentheses(modules)
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect();
        layers.push((layer.to_string(), names));
    }
    layers
}

#[test]
fn modules_import_one_way_down_the_documented_layers() {
    let modules = sources();
    let files = imports(&modules);
    // Top-level module → the top-level modules it imports.
    let mut top: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, deps) in &files {
        let entry = top.entry(module[0].clone()).or_default();
        entry.extend(
            deps.iter()
                .map(|d| d[0].clone())
                .filter(|d| *d != module[0]),
        );
    }
    assert!(
        ["plan", "stages", "train", "predict", "config"]
            .iter()
            .all(|m| top.get(*m).is_some_and(|deps| !deps.is_empty())),
        "the scan found no imports: {top:?}"
    );

    let layers = layers();
    let mut layer_of = BTreeMap::new();
    for (rank, (layer, names)) in layers.iter().enumerate() {
        for name in names {
            let before = layer_of.insert(name.clone(), (rank, layer.clone()));
            assert!(before.is_none(), "ARCHITECTURE.md places `{name}` twice");
        }
    }
    let unplaced: Vec<&String> = top.keys().filter(|m| !layer_of.contains_key(*m)).collect();
    assert!(
        unplaced.is_empty(),
        "modules missing from ARCHITECTURE.md's layer table (add each to its layer): \
         {unplaced:?}"
    );
    let mut upward = Vec::new();
    for (module, deps) in &top {
        let (rank, layer) = &layer_of[module];
        for dep in deps {
            let (dep_rank, dep_layer) = &layer_of[dep];
            if dep_rank < rank {
                upward.push(format!("{module} ({layer}) imports {dep} ({dep_layer})"));
            }
        }
    }
    assert!(
        upward.is_empty(),
        "imports from a higher layer (move the item down, or the importer up):\n{}",
        upward.join("\n")
    );
    let top_circles = circles(&top);
    assert!(
        top_circles.is_empty(),
        "modules that import each other (settle which layer owns what):\n{}",
        top_circles.join("\n")
    );

    // Inside a module: sibling files, not a file and the `mod.rs` above it (which declares
    // and re-exports it), must not import each other round.
    let mut siblings: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, deps) in &files {
        let entry = siblings.entry(module.join("::")).or_default();
        for dep in deps {
            let nested = dep.starts_with(module) || module.starts_with(dep);
            if dep[0] == module[0] && !nested {
                entry.insert(dep.join("::"));
            }
        }
    }
    let inner = circles(&siblings);
    assert!(
        inner.is_empty(),
        "files of one module that import each other (move what both need into a file of \
         its own):\n{}",
        inner.join("\n")
    );
}
