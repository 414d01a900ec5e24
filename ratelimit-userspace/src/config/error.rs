//! [`ConfigError`]: why a config file was refused, always naming the file, the line and the key;
//! [`Source`], the text being parsed, which turns byte offsets into lines; and how a TOML error's
//! byte offset is traced back to the key (and `[[rule]]`) it is about.

use std::{
    fmt,
    ops::Range,
    path::{Path, PathBuf},
};

/// Why a config file was rejected. Every variant's message starts with the file name, and those
/// about the content with the line and the key at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be opened or read (missing, permission denied, I/O error).
    #[error("{}: cannot read config file: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The path names a directory, not a file.
    #[error("{}: is a directory, expected a TOML config file", path.display())]
    IsDirectory {
        /// The directory.
        path: PathBuf,
    },
    /// The file is not UTF-8 text.
    #[error("{origin}:{line}: not valid UTF-8 text (TOML files must be UTF-8)")]
    NotUtf8 {
        /// The file.
        origin: String,
        /// Line of the first invalid byte.
        line: usize,
    },
    /// The text is not TOML (unterminated string, missing `=`, duplicate key...).
    #[error("{origin}:{line}:{column}: {}TOML syntax error: {message}", Where("", field.as_deref()))]
    Syntax {
        /// The file.
        origin: String,
        /// Line of the error.
        line: usize,
        /// Column (in characters, 1-based) of the error.
        column: usize,
        /// The key being defined on that line, if one could be made out.
        field: Option<String>,
        /// The TOML parser's message.
        message: String,
    },
    /// A key is unknown or missing, or its value has the wrong type (reported by the TOML
    /// deserializer).
    #[error("{origin}:{line}: {}{message}", Where(section, field.as_deref()))]
    Schema {
        /// The file.
        origin: String,
        /// Line of the offending key or value.
        line: usize,
        /// Where: `[agent]`, `[cluster]`, `rule "name"` or `rule #N`; empty at the top level.
        section: String,
        /// The key at fault.
        field: Option<String>,
        /// What is wrong.
        message: String,
    },
    /// A value is well-formed but unacceptable: out of range, or in conflict with another key or
    /// another rule.
    #[error("{origin}:{line}: {}{message}", Where(section, Some(field.as_str())))]
    Invalid {
        /// The file.
        origin: String,
        /// Line of the offending value (or of the rule's table when the problem is a missing key).
        line: usize,
        /// Where: `[agent]`, `[cluster]`, `rule "name"` or `rule #N`; empty at the top level.
        section: String,
        /// The key at fault.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// A rule's `source_file` could not be read (missing, a directory, permission denied...).
    #[error("{}: cannot read source list: {source} (rule {rule:?}, {origin}:{line})", path.display())]
    ListRead {
        /// The list file.
        path: PathBuf,
        /// The rule naming it.
        rule: String,
        /// The config file.
        origin: String,
        /// Line of the `source_file` key in the config file.
        line: usize,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// An entry of a rule's `source_file` is invalid.
    #[error("{}:{list_line}: {message} (rule {rule:?}, {origin}:{line})", path.display())]
    List {
        /// The list file.
        path: PathBuf,
        /// Line of the entry in the list file.
        list_line: usize,
        /// What is wrong.
        message: String,
        /// The rule naming the list.
        rule: String,
        /// The config file.
        origin: String,
        /// Line of the `source_file` key in the config file.
        line: usize,
    },
    /// Writing the config file back failed. The file is unchanged, unless only the final sync
    /// of its directory failed.
    #[error("{}: cannot write config file: {source}", path.display())]
    Write {
        /// The config file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The rules were not written back because the file would not read back as them (for
    /// example a `scope = "cluster"` rule while the file has no `[cluster]` table); the file is
    /// unchanged.
    #[error("{}: not written: {reason}", path.display())]
    NotWritten {
        /// The config file.
        path: PathBuf,
        /// Why, for a human.
        reason: String,
    },
}

/// Formats the `section: field `x`: ` part of an error message.
pub(super) struct Where<'a>(&'a str, Option<&'a str>);

impl fmt::Display for Where<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.0.is_empty() {
            write!(f, "{}: ", self.0)?;
        }
        if let Some(field) = self.1 {
            write!(f, "field `{field}`: ")?;
        }
        Ok(())
    }
}

impl ConfigError {
    /// The 1-based line the error is about, if it is about a file's content (for
    /// [`ConfigError::List`], the line in the list file).
    pub fn line(&self) -> Option<usize> {
        match self {
            ConfigError::Read { .. }
            | ConfigError::IsDirectory { .. }
            | ConfigError::ListRead { .. }
            | ConfigError::Write { .. }
            | ConfigError::NotWritten { .. } => None,
            ConfigError::NotUtf8 { line, .. }
            | ConfigError::Syntax { line, .. }
            | ConfigError::Schema { line, .. }
            | ConfigError::Invalid { line, .. } => Some(*line),
            // The line in the list file, which the message names first.
            ConfigError::List { list_line, .. } => Some(*list_line),
        }
    }

    /// The message without the file and line it is about: for a rule that came as something
    /// other than a file (the API's JSON, see [`Config::parse_rule`](super::Config::parse_rule)),
    /// `rule "name": field `key`: what is wrong`, as the file's message reads after its place.
    #[must_use]
    pub fn without_place(&self) -> String {
        match self {
            ConfigError::Schema {
                section,
                field,
                message,
                ..
            } => format!("{}{message}", Where(section, field.as_deref())),
            ConfigError::Invalid {
                section,
                field,
                message,
                ..
            } => format!("{}{message}", Where(section, Some(field.as_str()))),
            ConfigError::Syntax { field, message, .. } => {
                format!(
                    "{}TOML syntax error: {message}",
                    Where("", field.as_deref())
                )
            }
            other => other.to_string(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Locating TOML errors.

pub(super) fn syntax_error(src: &Source, e: &toml_edit::TomlError) -> ConfigError {
    let offset = e.span().map_or(0, |s| s.start).min(src.text.len());
    let line_start = src.text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let line_text = src.text[line_start..].lines().next().unwrap_or("");
    // Best effort: the key defined on the failing line, if it looks like `key = ...`.
    let field = line_text
        .split_once('=')
        .map(|(k, _)| k.trim())
        .filter(|k| {
            !k.is_empty()
                && k.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '"'))
        });
    ConfigError::Syntax {
        origin: src.origin.to_owned(),
        line: src.line(offset),
        column: src.text[line_start..offset].chars().count() + 1,
        field: field.map(str::to_owned),
        message: one_line(e.message()),
    }
}

pub(super) fn one_line(message: &str) -> String {
    message
        .trim()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

#[derive(Debug)]
pub(super) enum Seg {
    Key(String),
    Index(usize),
}

pub(super) fn schema_error(
    src: &Source,
    root: &toml_edit::Table,
    e: &toml_edit::de::Error,
) -> ConfigError {
    let offset = e.span().map_or(0, |s| s.start);
    let mut path = Vec::new();
    locate_in_table(root, offset, &mut path);
    let mut message = one_line(e.message());
    let key = |i: usize| match path.get(i) {
        Some(Seg::Key(k)) => Some(k.clone()),
        _ => None,
    };
    let (section, mut field) = match (key(0).as_deref(), path.get(1)) {
        (Some("rule"), Some(Seg::Index(i))) => {
            let name = root
                .get("rule")
                .and_then(|r| r.get(*i))
                .and_then(|t| t.get("name"))
                .and_then(|n| n.as_str())
                .unwrap_or("");
            match (key(2).as_deref(), path.get(3)) {
                // Inside a `[[rule.limit]]`: that table, named as its checks name it, and the
                // key in it.
                (Some("limit"), Some(Seg::Index(j))) => (
                    format!(
                        "{} limit {} ([[rule.limit]] #{})",
                        rule_section(name, *i),
                        j + 2,
                        j + 1
                    ),
                    key(4).or_else(|| key(2)),
                ),
                _ => (rule_section(name, *i), key(2)),
            }
        }
        (Some(table @ ("agent" | "cluster")), _) => (format!("[{table}]"), key(1)),
        (first, _) => (String::new(), first.map(str::to_owned)),
    };
    // serde says "missing field `x`" at the enclosing table: make `x` the field.
    if let Some(missing) = message
        .strip_prefix("missing field `")
        .and_then(|m| m.strip_suffix('`'))
    {
        field = Some(missing.to_owned());
        message = "required, but missing".to_owned();
    }
    ConfigError::Schema {
        origin: src.origin.to_owned(),
        line: src.line(offset),
        section,
        field,
        message,
    }
}

pub(super) fn contains(span: Option<Range<usize>>, offset: usize) -> bool {
    // Empty spans (end of input) still claim their start.
    span.is_some_and(|s| s.start <= offset && offset < s.end.max(s.start + 1))
}

/// Finds the path of keys/indices to the deepest item whose key or value span contains `offset`.
/// Tables are searched whole because a `[table]`'s span covers only its header.
pub(super) fn locate_in_table(
    table: &toml_edit::Table,
    offset: usize,
    path: &mut Vec<Seg>,
) -> bool {
    for (k, item) in table.iter() {
        path.push(Seg::Key(k.to_owned()));
        let key_span = table.key(k).and_then(toml_edit::Key::span);
        if locate_in_item(item, offset, path) || contains(key_span, offset) {
            return true;
        }
        path.pop();
    }
    false
}

pub(super) fn locate_in_item(item: &toml_edit::Item, offset: usize, path: &mut Vec<Seg>) -> bool {
    match item {
        toml_edit::Item::None => false,
        toml_edit::Item::Value(v) => locate_in_value(v, offset, path),
        toml_edit::Item::Table(t) => locate_in_table(t, offset, path) || contains(t.span(), offset),
        toml_edit::Item::ArrayOfTables(a) => {
            for (i, t) in a.iter().enumerate() {
                path.push(Seg::Index(i));
                if locate_in_table(t, offset, path) || contains(t.span(), offset) {
                    return true;
                }
                path.pop();
            }
            contains(a.span(), offset)
        }
    }
}

pub(super) fn locate_in_value(
    value: &toml_edit::Value,
    offset: usize,
    path: &mut Vec<Seg>,
) -> bool {
    match value {
        toml_edit::Value::InlineTable(t) => {
            for (k, v) in t.iter() {
                path.push(Seg::Key(k.to_owned()));
                if locate_in_value(v, offset, path)
                    || contains(t.key(k).and_then(toml_edit::Key::span), offset)
                {
                    return true;
                }
                path.pop();
            }
        }
        toml_edit::Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                path.push(Seg::Index(i));
                if locate_in_value(v, offset, path) {
                    return true;
                }
                path.pop();
            }
        }
        _ => {}
    }
    contains(value.span(), offset)
}

/// The text being parsed, for turning byte offsets into lines in error messages.
pub(super) struct Source<'a> {
    pub(super) origin: &'a str,
    pub(super) text: &'a str,
    /// Directory relative `source_file` paths are resolved against.
    pub(super) base: &'a Path,
    /// Where each line ends (the offsets of `text`'s newlines), found once on the first
    /// [`Source::line`]: each rule asks for its line, and a scan of the text for each would make
    /// a file of the rule cap's rules take seconds to parse.
    newlines: std::cell::OnceCell<Vec<usize>>,
}

impl<'a> Source<'a> {
    pub(super) fn new(origin: &'a str, text: &'a str, base: &'a Path) -> Self {
        Self {
            origin,
            text,
            base,
            newlines: std::cell::OnceCell::new(),
        }
    }

    /// The 1-based line of byte `offset` (the last line's past the end).
    pub(super) fn line(&self, offset: usize) -> usize {
        let newlines = self.newlines.get_or_init(|| {
            self.text
                .bytes()
                .enumerate()
                .filter_map(|(i, b)| (b == b'\n').then_some(i))
                .collect()
        });
        // Newlines before `offset`, plus one.
        newlines.partition_point(|&n| n < offset.min(self.text.len())) + 1
    }

    pub(super) fn invalid(
        &self,
        offset: usize,
        section: &str,
        field: &str,
        message: impl Into<String>,
    ) -> ConfigError {
        ConfigError::Invalid {
            origin: self.origin.to_owned(),
            line: self.line(offset),
            section: section.to_owned(),
            field: field.to_owned(),
            message: message.into(),
        }
    }
}

pub(super) fn rule_section(name: &str, index: usize) -> String {
    if name.is_empty() {
        format!("rule #{}", index + 1)
    } else {
        format!("rule {name:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::Source;

    /// Lines found from the newlines' offsets are the lines counted from the start, at every
    /// offset: on a newline, after it, past the end.
    #[test]
    fn a_line_is_its_newlines_before_plus_one() {
        for text in [
            "",
            "\n",
            "a",
            "a\nb",
            "[[rule]]\nname = \"a\"\n\n\nrate = 1\n",
            "\n\nx\n",
        ] {
            let src = Source::new("t.toml", text, std::path::Path::new("."));
            for offset in 0..text.len() + 3 {
                let counted = text.as_bytes()[..offset.min(text.len())]
                    .iter()
                    .filter(|&&b| b == b'\n')
                    .count()
                    + 1;
                assert_eq!(src.line(offset), counted, "{text:?} at {offset}");
            }
        }
    }
}
