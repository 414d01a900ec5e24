//! The docs hold together (issue #37): every relative link in the repository's Markdown points at
//! a file that exists, and at one of its headings when it names one (GitHub's anchors); and
//! docs/config.md's tables document exactly the keys the config parser accepts, section by
//! section: none it accepts left out, none it refuses written in. The parser's keys are read from
//! the parser itself: its `Raw*` structs deny unknown fields, and serde's refusal of an unknown
//! key names every key the table accepts. Needs no root; `cargo xtask test` runs it, and so does
//! `cargo test -p ratelimit-userspace --test docs`.

use std::{
    collections::{BTreeSet, HashMap},
    fs,
    path::{Path, PathBuf},
};

use ratelimit::config::Config;

/// The workspace root (this crate's parent).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the crate lives in the workspace")
        .to_path_buf()
}

/// Every Markdown file of the repository, build output, VCS data and fuzzing data left out.
fn markdown_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let mut entries: Vec<_> = fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.expect("a directory entry").path())
            .collect();
        entries.sort();
        for path in entries {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if path.is_dir() {
                if !(name.starts_with('.')
                    || matches!(name, "target" | "corpus" | "artifacts" | "node_modules"))
                {
                    walk(&path, out);
                }
            } else if name.ends_with(".md") {
                out.push(path);
            }
        }
    }
    let mut out = Vec::new();
    walk(&root(), &mut out);
    out
}

/// The lines of `text` outside fenced code blocks, with their 1-based numbers.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fence: Option<&str> = None;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let marker = ["```", "~~~"].into_iter().find(|m| trimmed.starts_with(m));
        match (fence, marker) {
            (None, Some(m)) => fence = Some(m),
            (Some(open), Some(m)) if open == m => fence = None,
            (None, None) => out.push((i + 1, line)),
            _ => {}
        }
    }
    out
}

/// `line` without its inline code spans (a link inside backticks is not a link).
fn without_code(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(start) = rest.find('`') {
        out.push_str(&rest[..start]);
        let ticks = rest[start..].bytes().take_while(|&b| b == b'`').count();
        let fence = &rest[start..start + ticks];
        match rest[start + ticks..].find(fence) {
            Some(end) => rest = &rest[start + ticks + end + ticks..],
            None => {
                rest = &rest[start + ticks..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The destinations of the inline links (`[text](dest)`, images too) and reference definitions
/// (`[id]: dest`) in one line of prose.
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code(line);
    let mut out = Vec::new();
    let trimmed = line.trim_start();
    if trimmed.starts_with('[') {
        if let Some(at) = trimmed.find("]: ") {
            if !trimmed[..at].contains('(') {
                let dest = trimmed[at + 3..].split_whitespace().next().unwrap_or("");
                out.push(dest.trim_matches(['<', '>']).to_owned());
            }
        }
    }
    let mut rest = line.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        // The destination ends at the parenthesis that closes the one opened after `]`.
        let mut depth = 0usize;
        let mut end = after.len();
        for (i, c) in after.char_indices() {
            match c {
                '(' => depth += 1,
                ')' if depth == 0 => {
                    end = i;
                    break;
                }
                ')' => depth -= 1,
                _ => {}
            }
        }
        let dest = after[..end].split_whitespace().next().unwrap_or("");
        out.push(dest.trim_matches(['<', '>']).to_owned());
        rest = &after[end.min(after.len())..];
    }
    out
}

/// A heading's text as GitHub renders it: links become their text.
fn rendered(heading: &str) -> String {
    let mut out = String::new();
    let mut rest = heading;
    while let Some(open) = rest.find('[') {
        let Some(close) = rest[open..].find("](").map(|c| open + c) else {
            break;
        };
        let Some(end) = rest[close..].find(')').map(|e| close + e) else {
            break;
        };
        out.push_str(&rest[..open]);
        out.push_str(&rest[open + 1..close]);
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

/// GitHub's anchor for a heading: lowercase, punctuation dropped (but `-` and `_`), each space a
/// `-`.
fn slug(heading: &str) -> String {
    rendered(heading)
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown file's headings, repeated ones numbered as GitHub numbers them.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in prose_lines(text) {
        let hashes = line.bytes().take_while(|&b| b == b'#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(line[hashes..].trim().trim_end_matches('#'));
        let n = seen.entry(base.clone()).or_insert(0);
        out.insert(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

/// The broken relative links of one Markdown file, as `file:line: dest: why`.
fn broken_links(file: &Path, text: &str) -> Vec<String> {
    let dir = file.parent().expect("a file has a directory");
    let shown = file
        .strip_prefix(root())
        .unwrap_or(file)
        .display()
        .to_string();
    let mut broken = Vec::new();
    for (number, line) in prose_lines(text) {
        for dest in link_targets(line) {
            if dest.is_empty()
                || dest.contains("://")
                || dest.starts_with("mailto:")
                || dest.starts_with("tel:")
            {
                continue;
            }
            let (path, anchor) = dest.split_once('#').unwrap_or((&dest, ""));
            let target = if path.is_empty() {
                file.to_path_buf()
            } else {
                dir.join(path)
            };
            if !target.exists() {
                broken.push(format!("{shown}:{number}: {dest}: no such file"));
                continue;
            }
            if anchor.is_empty() || target.extension().is_none_or(|e| e != "md") {
                continue;
            }
            let target_text = fs::read_to_string(&target).expect("a Markdown file");
            if !anchors(&target_text).contains(anchor) {
                broken.push(format!(
                    "{shown}:{number}: {dest}: no heading with the anchor #{anchor}"
                ));
            }
        }
    }
    broken
}

#[test]
fn every_relative_link_points_at_a_file_and_heading_that_exist() {
    let files = markdown_files();
    for must in [
        "README.md",
        "BENCHMARKS.md",
        "CONTRIBUTING.md",
        "docs/config.md",
        "tests/README.md",
    ] {
        assert!(
            files.contains(&root().join(must)),
            "{must} is not among the Markdown files read: {files:?}"
        );
    }
    let mut broken = Vec::new();
    for file in &files {
        let text = fs::read_to_string(file).expect("a Markdown file");
        broken.extend(broken_links(file, &text));
    }
    assert!(
        broken.is_empty(),
        "{} broken link(s):\n{}",
        broken.len(),
        broken.join("\n")
    );
}

/// The tables of docs/config.md and the parser's key for each: the top level (`## The file`) and
/// one table per section, named in its heading.
const SECTIONS: [(&str, &str); 5] = [
    ("the file", "bogus_key_of_the_docs_test = 1\n"),
    ("[agent]", "[agent]\nbogus_key_of_the_docs_test = 1\n"),
    ("[[rule]]", "[[rule]]\nbogus_key_of_the_docs_test = 1\n"),
    (
        "[[rule.limit]]",
        "[[rule]]\n[[rule.limit]]\nbogus_key_of_the_docs_test = 1\n",
    ),
    ("[cluster]", "[cluster]\nbogus_key_of_the_docs_test = 1\n"),
];

/// The keys the parser accepts in the table `config` puts an unknown key in, from its refusal:
/// "unknown field `bogus`, expected one of `a`, `b`, ...".
fn parser_keys(config: &str) -> BTreeSet<String> {
    let err = Config::parse(config, "docs.toml")
        .expect_err("a config with an unknown key is refused")
        .to_string();
    let unknown = "unknown field `bogus_key_of_the_docs_test`, expected ";
    let at = err
        .find(unknown)
        .unwrap_or_else(|| panic!("not the refusal of an unknown key: {err}"));
    backticked(&err[at + unknown.len()..])
}

/// Every `word` between backticks in `text`.
fn backticked(text: &str) -> BTreeSet<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// docs/config.md's keys per section: the first cell of every row of the first table after each
/// `## ` heading that names a section of [`SECTIONS`].
fn documented_keys(text: &str) -> HashMap<&'static str, BTreeSet<String>> {
    let mut out: HashMap<&'static str, BTreeSet<String>> = HashMap::new();
    let mut section: Option<&'static str> = None;
    let mut in_table = false;
    for (_, line) in prose_lines(text) {
        if let Some(heading) = line.strip_prefix("## ") {
            let heading = heading.to_lowercase();
            section = SECTIONS
                .iter()
                .map(|(name, _)| *name)
                .find(|name| heading == *name || heading.split('`').nth(1) == Some(*name));
            in_table = false;
            continue;
        }
        let Some(name) = section else { continue };
        if line.starts_with('|') {
            in_table = true;
            let first = line.split('|').nth(1).unwrap_or("").trim();
            // The header row and the separator hold no key.
            if first == "key" || first.chars().all(|c| matches!(c, '-' | ':' | ' ')) {
                continue;
            }
            let keys = backticked(first);
            assert!(
                !keys.is_empty(),
                "docs/config.md, {name}: a row without a key: {line}"
            );
            out.entry(name).or_default().extend(keys);
        } else if in_table {
            // Only the first table after the heading lists the section's keys.
            section = None;
        }
    }
    out
}

#[test]
fn config_md_documents_exactly_the_keys_the_parser_accepts() {
    let text = fs::read_to_string(root().join("docs/config.md")).expect("docs/config.md");
    let documented = documented_keys(&text);
    let mut wrong = Vec::new();
    for (name, config) in SECTIONS {
        let accepted = parser_keys(config);
        assert!(!accepted.is_empty(), "{name}: the parser names no key");
        let Some(doc) = documented.get(name) else {
            wrong.push(format!("{name}: no table in docs/config.md"));
            continue;
        };
        let undocumented: Vec<_> = accepted.difference(doc).collect();
        let refused: Vec<_> = doc.difference(&accepted).collect();
        if !undocumented.is_empty() {
            wrong.push(format!(
                "{name}: accepted by the parser but not documented: {undocumented:?}"
            ));
        }
        if !refused.is_empty() {
            wrong.push(format!(
                "{name}: documented but refused by the parser: {refused:?}"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "docs/config.md and the parser disagree:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn anchors_follow_githubs_rules() {
    assert_eq!(slug("`on_partition = \"share\"`"), "on_partition--share");
    assert_eq!(
        slug("IPv4 sources are classified by their /16"),
        "ipv4-sources-are-classified-by-their-16"
    );
    assert_eq!(slug("[Cluster](../docs/design.md#cluster)"), "cluster");
    assert_eq!(
        slug("Several limits per rule (#16)"),
        "several-limits-per-rule-16"
    );
    let twice = anchors("# A\n## Soak\n```\n## Not a heading\n```\n### Soak\n");
    assert_eq!(
        twice.into_iter().collect::<Vec<_>>(),
        ["a", "soak", "soak-1"]
    );
    assert_eq!(
        link_targets("see [a](x.md#b) and `[c](y.md)`, [d](z.md \"title\")"),
        ["x.md#b", "z.md"]
    );
}
