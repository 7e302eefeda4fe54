//! The documentation stays true to the binary (README.md and docs/, ARCHITECTURE.md
//! "Documentation"):
//! - every ```yaml snippet that is a whole pipeline file (a top-level `tables:` or `stages:`)
//!   passes `pipeline validate`, run in a scratch directory that holds the tables, models and
//!   files the snippets name;
//! - a snippet marked `<!-- fragment -->` on the line before its fence parses as YAML; one that
//!   is a list of stages is wrapped into a pipeline over the scratch tables and validated;
//! - a snippet marked `<!-- validate: parse-only: REASON -->` only parses (kept rare: a
//!   snippet that needs infrastructure, such as buckets);
//! - every `pipeline <subcommand>` in a ```sh snippet names a subcommand `pipeline --help`
//!   lists;
//! - every relative link resolves to a file, and every `#anchor` to a heading.
//!
//! No server starts; the scratch tables take one short `pipeline run`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::common::{Scratch, assets, minilm, pipeline_command, repo};

/// What the line before a fence says about its snippet.
#[derive(Debug, Clone, PartialEq)]
enum Marker {
    /// A whole file: validated.
    Whole,
    /// `<!-- fragment -->`: parsed; stages are wrapped into a pipeline and validated.
    Fragment,
    /// `<!-- validate: parse-only: REASON -->`: parsed only.
    ParseOnly(String),
}

/// One fenced code block.
struct Block {
    /// `file:line` of the opening fence, for messages.
    at: String,
    lang: String,
    marker: Marker,
    body: String,
}

/// README.md and every page under docs/ (the files whose snippets are checked).
fn snippet_files() -> Vec<PathBuf> {
    let mut files = vec![repo().join("README.md")];
    markdown_under(&repo().join("docs"), &mut files);
    files
}

/// Every file whose links are checked: the snippet files, CHANGELOG.md and ARCHITECTURE.md.
fn linked_files() -> Vec<PathBuf> {
    let mut files = snippet_files();
    files.push(repo().join("CHANGELOG.md"));
    files.push(repo().join("ARCHITECTURE.md"));
    files
}

fn markdown_under(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            markdown_under(&path, out);
        } else if path.extension().is_some_and(|e| e == "md") {
            out.push(path);
        }
    }
}

fn relative(path: &Path) -> String {
    path.strip_prefix(repo())
        .unwrap_or(path)
        .display()
        .to_string()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The fenced code blocks of a Markdown file, with the marker on the line before each.
fn blocks(path: &Path) -> Vec<Block> {
    let text = read(path);
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let Some(lang) = lines[i].strip_prefix("```") else {
            i += 1;
            continue;
        };
        let open = i;
        let close = (open + 1..lines.len())
            .find(|&j| lines[j].starts_with("```"))
            .unwrap_or_else(|| panic!("{}:{}: unclosed fence", relative(path), open + 1));
        let before = if open > 0 { lines[open - 1].trim() } else { "" };
        let marker = if before.starts_with("<!-- fragment") {
            Marker::Fragment
        } else if let Some(rest) = before.strip_prefix("<!-- validate: parse-only") {
            Marker::ParseOnly(
                rest.trim_start_matches(':')
                    .trim_end_matches("-->")
                    .trim()
                    .to_string(),
            )
        } else {
            Marker::Whole
        };
        let mut body = lines[open + 1..close].join("\n");
        body.push('\n');
        out.push(Block {
            at: format!("{}:{}", relative(path), open + 1),
            lang: lang.trim().to_string(),
            marker,
            body,
        });
        i = close + 1;
    }
    out
}

/// A `pipeline` with the scratch directory's environment.
fn pipeline(root: &Path, dir: &Path, args: &[&str]) -> std::process::Output {
    pipeline_command()
        .args(args)
        .current_dir(dir)
        .env("HOME", root.join("home"))
        .env("LAKEML_TOKEN", "0123456789abcdef0123456789abcdef")
        .output()
        .expect("run pipeline")
}

fn symlink(target: &Path, link: &Path) {
    std::fs::create_dir_all(link.parent().expect("parent")).expect("mkdir");
    std::os::unix::fs::symlink(target, link)
        .unwrap_or_else(|e| panic!("symlink {}: {e}", link.display()));
}

/// Tables read by stage fragments: they exist in the scratch lake.
const FRAGMENT_TABLES: &str = "  reviews: { delta: ../lake/reviews }\n  \
                               reviews_tokenized: { delta: ../lake/reviews_tokenized }\n";

/// The scratch directory the snippets are validated in. Snippets live in `p/`, so `x` in a
/// snippet is `p/x` and `../x` is `x`:
/// - `lake/reviews` (`id, text, label, split, truth`; versions 0 to 3, for time travel),
///   `lake/reviews_tokenized` (by `doc_id`, with `split`); no run history (the scheduler makes
///   it, and validation must not need it);
/// - `runs/rotten-tomatoes/model` and `p/runs/model/model`: MiniLM with an `id2label`;
///   `p/models/minilm` and `~/.cache/lakeml/assets/all-MiniLM-L6-v2` (HOME is `home/`): MiniLM;
/// - `p/data/reviews.csv.bz2` (the Rotten Tomatoes CSV), `p/data/events/*.parquet`,
///   `p/data/more.jsonl`, `sql/ingest.sql`;
/// - `secrets/users.yaml` (one user, reading `reviews`), `p/server.pem` and `p/server.key`.
fn scratch() -> Scratch {
    let s = Scratch::new();
    let root = s.path().to_path_buf();
    let mut rows = String::new();
    for id in 1..=12 {
        let label = if id % 2 == 1 { "fresh" } else { "rotten" };
        let split = ["train", "train", "validation", "test"][id % 4];
        rows.push_str(&format!(
            "{{\"id\": {id}, \"text\": \"review {id}: the film was {}\", \"label\": \"{label}\", \
             \"split\": \"{split}\", \"truth\": \"{label}\"}}\n",
            if id % 2 == 1 { "great" } else { "dull" }
        ));
    }
    s.write("fixture/reviews.jsonl", &rows);
    s.write("p/data/more.jsonl", &rows);
    // Four overwrites give `reviews` versions 0 to 3.
    s.write(
        "setup.yaml",
        &format!(
            "name: docs-fixture\ntables:\n  src: {{ json: fixture/reviews.jsonl }}\n  \
             reviews: {{ delta: lake/reviews }}\n  \
             reviews_tokenized: {{ delta: lake/reviews_tokenized }}\nstages:\n\
             {versions}  - tokenize:\n      sql: SELECT id AS doc_id, text, label, split FROM reviews\n      \
             tokenizer: {minilm}\n      id: doc_id\n      label: label\n      keep: [split]\n      \
             to: reviews_tokenized\n",
            versions = (0..4)
                .map(|v| format!(
                    "  - write: {{ name: v{v}, sql: \"SELECT * FROM src WHERE id > {}\", \
                     to: reviews, mode: overwrite }}\n",
                    3 - v
                ))
                .collect::<String>(),
            minilm = minilm().display()
        ),
    );
    s.run_ok(&["setup.yaml"]);
    // A classifier: MiniLM's files with labels in config.json (validation reads no weights).
    let model = root.join("runs/rotten-tomatoes/model");
    std::fs::create_dir_all(&model).expect("mkdir");
    for entry in std::fs::read_dir(minilm()).expect("MiniLM dir") {
        let path = entry.expect("entry").path();
        let name = path.file_name().expect("file name");
        if name != "config.json" {
            symlink(&path, &model.join(name));
        }
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&read(&minilm().join("config.json"))).expect("config.json");
    config["id2label"] = serde_json::json!({"0": "fresh", "1": "rotten"});
    config["label2id"] = serde_json::json!({"fresh": 0, "rotten": 1});
    s.write(
        "runs/rotten-tomatoes/model/config.json",
        &config.to_string(),
    );
    symlink(&model, &root.join("p/runs/model/model"));
    symlink(&minilm(), &root.join("p/models/minilm"));
    symlink(
        &minilm(),
        &root.join("home/.cache/lakeml/assets/all-MiniLM-L6-v2"),
    );
    symlink(
        &assets().join("rotten_tomatoes/rotten_tomatoes_corpus_full.csv.bz2"),
        &root.join("p/data/reviews.csv.bz2"),
    );
    let parquet = std::fs::read_dir(root.join("lake/reviews"))
        .expect("lake/reviews")
        .map(|e| e.expect("entry").path())
        .find(|p| p.extension().is_some_and(|e| e == "parquet"))
        .expect("a parquet file in lake/reviews");
    std::fs::create_dir_all(root.join("p/data/events")).expect("mkdir");
    std::fs::copy(&parquet, root.join("p/data/events/part-0.parquet")).expect("copy parquet");
    s.write(
        "sql/ingest.sql",
        "SELECT CAST(row_number() OVER (ORDER BY text) AS BIGINT) AS id, text, category AS label\n\
         FROM raw WHERE category IN ('fresh', 'rotten')\n",
    );
    // A users file with a real argon2 hash, made by the binary.
    let mut hasher = pipeline_command()
        .arg("hash-password")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run pipeline hash-password");
    hasher
        .stdin
        .take()
        .expect("stdin")
        .write_all(b"a password for the docs test\n")
        .expect("write password");
    let hashed = hasher.wait_with_output().expect("hash-password");
    assert!(
        hashed.status.success(),
        "hash-password: {}",
        String::from_utf8_lossy(&hashed.stderr)
    );
    let hash = String::from_utf8_lossy(&hashed.stdout).trim().to_string();
    s.write(
        "secrets/users.yaml",
        &format!("users:\n  alice:\n    password: \"{hash}\"\n    tables: [reviews]\n"),
    );
    let made = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            "server.key",
            "-out",
            "server.pem",
            "-subj",
            "/CN=localhost",
        ])
        .current_dir(root.join("p"))
        .output()
        .expect("run openssl");
    assert!(
        made.status.success(),
        "openssl: {}",
        String::from_utf8_lossy(&made.stderr)
    );
    s
}

/// A fragment that is a list of stages, as a pipeline over the scratch tables (each stage's
/// `to` table declared under `lake/`); `None` for any other fragment.
fn wrap_stages(at: &str, body: &str, yaml: &serde_yaml_ng::Value) -> Option<String> {
    let stages = yaml.as_sequence()?;
    let mut tables = FRAGMENT_TABLES.to_string();
    for stage in stages {
        let map = stage.as_mapping().filter(|m| m.len() == 1)?;
        let (_, settings) = map.iter().next()?;
        if let Some(to) = settings.get("to").and_then(|t| t.as_str()) {
            assert!(
                !FRAGMENT_TABLES.contains(&format!(" {to}:")),
                "{at}: a fragment writes `{to}`, a table the test's scratch lake reads"
            );
            tables.push_str(&format!("  {to}: {{ delta: ../lake/{to} }}\n"));
        }
    }
    Some(format!(
        "name: docs-fragment\ntables:\n{tables}stages:\n{body}"
    ))
}

#[test]
fn yaml_snippets_are_valid_pipeline_files() {
    let s = scratch();
    let root = s.path().to_path_buf();
    let mut failures = Vec::new();
    let (mut validated, mut parsed) = (0, 0);
    for file in snippet_files() {
        for (n, block) in blocks(&file)
            .into_iter()
            .filter(|b| b.lang == "yaml")
            .enumerate()
        {
            let at = &block.at;
            let yaml: serde_yaml_ng::Value = match serde_yaml_ng::from_str(&block.body) {
                Ok(v) => v,
                Err(e) => {
                    failures.push(format!("{at}: not YAML: {e}"));
                    continue;
                }
            };
            let file_text = match &block.marker {
                Marker::ParseOnly(reason) => {
                    if reason.is_empty() {
                        failures.push(format!(
                            "{at}: say why the snippet cannot be validated: \
                             `<!-- validate: parse-only: REASON -->`"
                        ));
                    }
                    parsed += 1;
                    continue;
                }
                Marker::Fragment => match wrap_stages(at, &block.body, &yaml) {
                    Some(text) => text,
                    None => {
                        parsed += 1;
                        continue;
                    }
                },
                Marker::Whole => {
                    let whole = yaml
                        .as_mapping()
                        .is_some_and(|m| m.contains_key("tables") || m.contains_key("stages"));
                    if !whole {
                        failures.push(format!(
                            "{at}: neither `tables:` nor `stages:` at the top, so not a whole \
                             pipeline file; put `<!-- fragment -->` on the line before the fence"
                        ));
                        continue;
                    }
                    block.body.clone()
                }
            };
            let stem = relative(&file).replace(['/', '.'], "_");
            let name = format!("{stem}_{n}.yaml");
            s.write(&format!("p/{name}"), &file_text);
            let out = pipeline(&root, &root.join("p"), &["validate", &name]);
            if out.status.success() {
                validated += 1;
            } else {
                failures.push(format!(
                    "{at}: `pipeline validate` failed ({}):\n{}\n--- the file validated:\n{file_text}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n\n"));
    assert!(
        validated >= 8,
        "only {validated} snippets were validated (and {parsed} parsed): is the extraction broken?"
    );
}

/// The subcommands `pipeline --help` lists.
fn subcommands() -> BTreeSet<String> {
    let out = pipeline_command()
        .arg("--help")
        .output()
        .expect("run pipeline --help");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout).into_owned();
    let commands: BTreeSet<String> = help
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect();
    assert!(
        commands.contains("run") && commands.contains("validate"),
        "cannot read the commands from `pipeline --help`:\n{help}"
    );
    commands
}

/// `pipeline` invocations of a shell line: (the subcommand named, or `None`).
fn invocations(line: &str) -> Vec<Option<String>> {
    let code = line.split(" #").next().unwrap_or_default();
    let code = code.replace("$(", ";");
    code.split(['|', ';', '&'])
        .filter_map(|segment| {
            let mut words = segment.split_whitespace();
            let first = words.next()?;
            (first == "pipeline" || first.ends_with("/pipeline"))
                .then(|| words.find(|w| !w.starts_with('-')).map(str::to_string))
        })
        .collect()
}

#[test]
fn shell_snippets_name_real_subcommands() {
    let known = subcommands();
    let mut failures = Vec::new();
    let mut seen = 0;
    for file in snippet_files() {
        for block in blocks(&file)
            .into_iter()
            .filter(|b| matches!(b.lang.as_str(), "sh" | "bash" | "shell"))
        {
            for (i, line) in block.body.lines().enumerate() {
                for named in invocations(line) {
                    seen += 1;
                    match named {
                        Some(c) if known.contains(&c) => {}
                        other => failures.push(format!(
                            "{} (+{}): `{}` runs `pipeline {}`, not one of: {}",
                            block.at,
                            i + 1,
                            line.trim(),
                            other.unwrap_or_default(),
                            known.iter().cloned().collect::<Vec<_>>().join(", ")
                        )),
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
    assert!(
        seen >= 3,
        "only {seen} `pipeline` lines in shell snippets: is the extraction broken?"
    );
}

/// GitHub's anchors for a Markdown file's headings (outside code blocks).
fn anchors(path: &Path) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    let mut fenced = false;
    for line in read(path).lines() {
        if line.starts_with("```") {
            fenced = !fenced;
            continue;
        }
        let Some(title) = line.strip_prefix('#') else {
            continue;
        };
        if fenced {
            continue;
        }
        let title = title.trim_start_matches('#');
        if !title.starts_with(' ') {
            continue;
        }
        let slug: String = title
            .trim()
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        let count = seen.entry(slug.clone()).or_default();
        out.insert(if *count == 0 {
            slug.clone()
        } else {
            format!("{slug}-{count}")
        });
        *count += 1;
    }
    out
}

/// The targets of a Markdown file's inline links, outside code blocks and code spans.
fn links(path: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in read(path).lines() {
        if line.starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Drop code spans: the text between pairs of backticks.
        let prose: String = line
            .split('`')
            .enumerate()
            .map(|(i, part)| if i % 2 == 0 { part } else { "code" })
            .collect();
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let end = after.find(')').unwrap_or(after.len());
            out.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn relative_links_and_anchors_resolve() {
    let mut failures = Vec::new();
    let mut checked = 0;
    for file in linked_files() {
        let dir = file.parent().expect("parent").to_path_buf();
        for link in links(&file) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, anchor) = link.split_once('#').unwrap_or((link.as_str(), ""));
            let target = if path.is_empty() {
                file.clone()
            } else {
                dir.join(path)
            };
            if !target.exists() {
                failures.push(format!(
                    "{}: `{link}`: no such file {}",
                    relative(&file),
                    relative(&target)
                ));
                continue;
            }
            if !anchor.is_empty() && !anchors(&target).contains(anchor) {
                failures.push(format!(
                    "{}: `{link}`: {} has no heading with the anchor `#{anchor}`",
                    relative(&file),
                    relative(&target)
                ));
            }
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
    assert!(
        checked >= 20,
        "only {checked} relative links: is the extraction broken?"
    );
}
