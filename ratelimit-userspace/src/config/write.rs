//! Writing a changed rule set back into the config file ([`write_rules`]): `toml_edit` keeps the
//! rest of the document (comments, formatting, other tables) as it is; the result is read back
//! and compared before it replaces the file. A rule as TOML ([`RuleConfig::to_toml`]) too.

use std::{
    collections::{HashMap, HashSet},
    path::Path,
    str::FromStr,
};

use ipnet::IpNet;

use super::{
    error::Source,
    error::{syntax_error, ConfigError},
    keywords::{Action, Per, Protocol, Scope},
    lists::{base_dir, read_text, resolve},
    model::Config,
    rule::{default_bytes_burst, LimitConfig, RuleConfig},
    validate::parse_source,
};

// ---------------------------------------------------------------------------------------------
// Writing rules back.

/// The keys of a `[[rule]]` table, in the order a new table gets them.
pub(super) const RULE_KEYS: [&str; 14] = [
    "name",
    "source",
    "source_file",
    "action",
    "protocol",
    "dst_port",
    "tcp_flags",
    "rate",
    "burst",
    "bytes_rate",
    "bytes_burst",
    "per",
    "scope",
    "dry_run",
];

pub(super) fn int_value(n: u64) -> toml_edit::Value {
    // Validated values are far below i64::MAX; anything else fails the read-back check.
    i64::try_from(n).unwrap_or(i64::MAX).into()
}

/// `source` for `sources`: a string for one prefix, else an array (one prefix per line when
/// there are more than three).
pub(super) fn sources_value(sources: &[IpNet]) -> toml_edit::Value {
    if let [one] = sources {
        return one.to_string().into();
    }
    let mut array = toml_edit::Array::new();
    for net in sources {
        array.push(net.to_string());
    }
    if sources.len() > 3 {
        for v in array.iter_mut() {
            v.decor_mut().set_prefix("\n    ");
            v.decor_mut().set_suffix("");
        }
        array.set_trailing_comma(true);
        array.set_trailing("\n");
    }
    toml_edit::Value::Array(array)
}

/// The value `key` needs in a table for `rule`; `None` when the key should be left out (its
/// default, or meaningless for the rule).
pub(super) fn wanted_value(rule: &RuleConfig, key: &str) -> Option<toml_edit::Value> {
    let limit = rule.action == Action::Limit;
    match key {
        "name" => Some(rule.name.as_str().into()),
        "source" => rule
            .source_file
            .is_none()
            .then(|| sources_value(&rule.sources)),
        "source_file" => rule
            .source_file
            .as_ref()
            .map(|p| p.to_string_lossy().into_owned().into()),
        "action" => (rule.action != Action::Limit).then(|| rule.action.as_str().into()),
        "protocol" => (rule.protocol != Protocol::Any).then(|| rule.protocol.as_str().into()),
        "dst_port" => rule.dst_port.map(|p| i64::from(p).into()),
        "tcp_flags" => rule.tcp_flags.map(|f| f.as_str().into()),
        "rate" if limit => rule.rate.map(int_value),
        "burst" if limit && rule.burst != rule.rate => rule.burst.map(int_value),
        "bytes_rate" if limit => rule.bytes_rate.map(int_value),
        "bytes_burst" if limit && rule.bytes_burst != default_bytes_burst(rule.bytes_rate) => {
            rule.bytes_burst.map(int_value)
        }
        "per" if limit && rule.per != Per::Source => Some(rule.per.to_string().into()),
        "scope" if limit && rule.scope != Scope::Local => Some(rule.scope.as_str().into()),
        "dry_run" if rule.dry_run => Some(true.into()),
        _ => None,
    }
}

/// Whether `item`, written for `key` in a rule table of a config file in directory `base`,
/// already says what `rule` has.
pub(super) fn written_as(
    rule: &RuleConfig,
    key: &str,
    item: &toml_edit::Item,
    base: &Path,
) -> bool {
    let limit = rule.action == Action::Limit;
    let Some(v) = item.as_value() else {
        return false;
    };
    let int_is = |want: Option<u64>| {
        want.is_some() && v.as_integer().and_then(|i| u64::try_from(i).ok()) == want
    };
    fn word<T: FromStr>(v: &toml_edit::Value) -> Option<T> {
        v.as_str().and_then(|s| s.parse().ok())
    }
    match key {
        "name" => v.as_str() == Some(rule.name.as_str()),
        "source" => {
            rule.source_file.is_none()
                && written_sources(v).is_some_and(|nets| nets == rule.sources)
        }
        "source_file" => v.as_str().is_some_and(|p| {
            !p.is_empty() && rule.source_file.as_deref() == Some(&*resolve(base, Path::new(p)))
        }),
        "action" => word(v) == Some(rule.action),
        "protocol" => word(v) == Some(rule.protocol),
        "dst_port" => int_is(rule.dst_port.map(u64::from)),
        "tcp_flags" => rule.tcp_flags.is_some() && word(v) == rule.tcp_flags,
        "rate" => limit && int_is(rule.rate),
        "burst" => limit && int_is(rule.burst),
        "bytes_rate" => limit && int_is(rule.bytes_rate),
        "bytes_burst" => limit && int_is(rule.bytes_burst),
        "per" => limit && word(v) == Some(rule.per),
        "scope" => limit && word(v) == Some(rule.scope),
        "dry_run" => v.as_bool() == Some(rule.dry_run),
        _ => false,
    }
}

/// The prefixes a `source` value stands for, as the parser reads them.
pub(super) fn written_sources(v: &toml_edit::Value) -> Option<Vec<IpNet>> {
    let texts: Vec<&str> = match v {
        toml_edit::Value::String(s) => vec![s.value().as_str()],
        toml_edit::Value::Array(a) => a.iter().map(|e| e.as_str()).collect::<Option<_>>()?,
        _ => return None,
    };
    let mut seen = HashSet::new();
    let mut nets = Vec::new();
    for text in texts {
        let net = parse_source(text).ok()?;
        if seen.insert(net) {
            nets.push(net);
        }
    }
    Some(nets)
}

/// A new `[[rule]]` table for `rule` with only the keys that differ from their defaults.
pub(super) fn new_rule_table(rule: &RuleConfig) -> toml_edit::Table {
    let mut table = toml_edit::Table::new();
    for key in RULE_KEYS {
        if let Some(v) = wanted_value(rule, key) {
            table.insert(key, toml_edit::Item::Value(v));
        }
    }
    if let Some(limits) = limits_item(&rule.limits) {
        table.insert("limit", limits);
    }
    table
}

/// The `[[rule.limit]]` tables for `limits`, with only the keys that differ from their defaults
/// (`per` always); `None` for none.
fn limits_item(limits: &[LimitConfig]) -> Option<toml_edit::Item> {
    if limits.is_empty() {
        return None;
    }
    let mut aot = toml_edit::ArrayOfTables::new();
    for l in limits {
        let mut t = toml_edit::Table::new();
        t.insert("per", toml_edit::value(l.per.to_string()));
        if let Some(r) = l.rate {
            t.insert("rate", toml_edit::Item::Value(int_value(r)));
        }
        if l.burst != l.rate {
            if let Some(b) = l.burst {
                t.insert("burst", toml_edit::Item::Value(int_value(b)));
            }
        }
        if let Some(r) = l.bytes_rate {
            t.insert("bytes_rate", toml_edit::Item::Value(int_value(r)));
        }
        if l.bytes_burst != default_bytes_burst(l.bytes_rate) {
            if let Some(b) = l.bytes_burst {
                t.insert("bytes_burst", toml_edit::Item::Value(int_value(b)));
            }
        }
        if l.scope != Scope::Local {
            t.insert("scope", toml_edit::value(l.scope.as_str()));
        }
        aot.push(t);
    }
    Some(toml_edit::Item::ArrayOfTables(aot))
}

/// Whether the `[[rule.limit]]` tables `item` already say `limits`.
fn limits_written_as(item: &toml_edit::Item, limits: &[LimitConfig]) -> bool {
    let Some(aot) = item.as_array_of_tables() else {
        return false;
    };
    aot.len() == limits.len()
        && aot.iter().zip(limits).all(|(t, l)| {
            let int = |key: &str| {
                t.get(key)
                    .and_then(toml_edit::Item::as_integer)
                    .and_then(|i| u64::try_from(i).ok())
            };
            let word = |key: &str| t.get(key).and_then(toml_edit::Item::as_str);
            word("per").and_then(|p| p.parse::<Per>().ok()) == Some(l.per)
                && int("rate") == l.rate
                && int("burst").or(l.rate) == l.burst
                && int("bytes_rate") == l.bytes_rate
                && int("bytes_burst").or_else(|| default_bytes_burst(l.bytes_rate)) == l.bytes_burst
                && word("scope").map_or(Some(Scope::Local), |s| s.parse().ok()) == Some(l.scope)
        })
}

/// Makes an existing `[[rule]]` table say `rule`, leaving the keys that already do (their
/// spelling, comments and order) alone. A changed value keeps the comment after it.
pub(super) fn update_rule_table(table: &mut toml_edit::Table, rule: &RuleConfig, base: &Path) {
    if !table
        .get("limit")
        .is_some_and(|item| limits_written_as(item, &rule.limits))
    {
        match limits_item(&rule.limits) {
            Some(item) => {
                table.insert("limit", item);
            }
            None => {
                table.remove("limit");
            }
        }
    }
    for key in RULE_KEYS {
        if table
            .get(key)
            .is_some_and(|item| written_as(rule, key, item, base))
        {
            continue;
        }
        match (wanted_value(rule, key), table.get_mut(key)) {
            (None, _) => {
                table.remove(key);
            }
            (Some(mut v), Some(item)) => {
                if let Some(old) = item.as_value() {
                    *v.decor_mut() = old.decor().clone();
                }
                // Assigning through the entry keeps the key's own decor (comment lines above it).
                *item = toml_edit::Item::Value(v);
            }
            (Some(v), None) => {
                table.insert(key, toml_edit::Item::Value(v));
            }
        }
    }
}

/// The config file `text` with its rules replaced by `rules`, as [`write_rules`] writes it.
/// `origin` is the file's path (relative `source_file` paths in it are resolved against its
/// directory). Only fails if `text` is not TOML.
pub fn render_rules(text: &str, origin: &str, rules: &[RuleConfig]) -> Result<String, ConfigError> {
    let base = base_dir(Path::new(origin));
    let mut doc: toml_edit::DocumentMut = text
        .parse()
        .map_err(|e| syntax_error(&Source::new(origin, text, base), &e))?;
    let had_content = !text.trim().is_empty();
    let root = doc.as_table_mut();
    let old: Vec<toml_edit::Table> = match root.get_mut("rule").map(std::mem::take) {
        Some(toml_edit::Item::ArrayOfTables(tables)) => tables.into_iter().collect(),
        // `rule = [{ ... }, ...]`: becomes [[rule]] tables; the comments above the key go
        // above the first table.
        Some(toml_edit::Item::Value(toml_edit::Value::Array(values))) => {
            let above = root
                .key("rule")
                .and_then(|k| k.leaf_decor().prefix())
                .and_then(toml_edit::RawString::as_str)
                .map(str::to_owned);
            // A table header prints its key with the key's decor: reset it.
            if let Some(mut key) = root.key_mut("rule") {
                key.fmt();
            }
            let mut tables: Vec<toml_edit::Table> = values
                .into_iter()
                .filter_map(|v| match v {
                    toml_edit::Value::InlineTable(t) => Some(t.into_table()),
                    _ => None,
                })
                .collect();
            for (i, t) in tables.iter_mut().enumerate() {
                match (i, &above) {
                    (0, Some(above)) => t.decor_mut().set_prefix(above.clone()),
                    (0, None) => {}
                    _ => t.decor_mut().set_prefix("\n"),
                }
            }
            tables
        }
        _ => Vec::new(),
    };
    let mut by_name: HashMap<String, usize> = HashMap::new();
    for (i, t) in old.iter().enumerate() {
        if let Some(name) = t.get("name").and_then(toml_edit::Item::as_str) {
            by_name.entry(name.to_owned()).or_insert(i);
        }
    }
    let mut old: Vec<Option<toml_edit::Table>> = old.into_iter().map(Some).collect();
    let mut tables = Vec::with_capacity(rules.len());
    for rule in rules {
        let kept = by_name.remove(&rule.name).and_then(|i| old[i].take());
        let table = match kept {
            Some(mut table) => {
                update_rule_table(&mut table, rule, base);
                table
            }
            None => {
                let mut table = new_rule_table(rule);
                if had_content || !tables.is_empty() {
                    table.decor_mut().set_prefix("\n");
                }
                table
            }
        };
        tables.push(table);
    }
    // Tables are printed in the order of their positions in the original document (new tables
    // follow the table before them). Kept tables take the positions the kept tables had, in
    // their new order, so that the file lists the rules in the order given.
    let mut positions: Vec<usize> = tables
        .iter()
        .filter_map(toml_edit::Table::position)
        .collect();
    positions.sort_unstable();
    let mut positions = positions.into_iter();
    for table in &mut tables {
        if table.position().is_some() {
            table.set_position(positions.next().expect("one position per kept table"));
        }
    }
    if tables.is_empty() {
        root.remove("rule");
    } else {
        let mut array = toml_edit::ArrayOfTables::new();
        for table in tables {
            array.push(table);
        }
        // Through the entry: `insert` would reset the key's formatting.
        match root.entry("rule") {
            toml_edit::Entry::Occupied(mut e) => {
                e.insert(toml_edit::Item::ArrayOfTables(array));
            }
            toml_edit::Entry::Vacant(e) => {
                e.insert(toml_edit::Item::ArrayOfTables(array));
            }
        }
    }
    Ok(doc.to_string())
}

/// Writes `rules` back to the config file at `path`, replacing its `[[rule]]` tables and keeping
/// everything else as it is: comments, `[agent]`, `[cluster]`, and the text of the rules that did
/// not change.
///
/// Rules are matched to the file's tables by name. A kept rule's table is updated in place: keys
/// that already say the right thing (even a default spelled out) stay as written, changed values
/// keep the comment after them, keys now at their default are removed. Tables of rules not in
/// `rules` are removed; new rules are appended as new `[[rule]]` tables with only their
/// non-default keys. A `source_file` rule keeps its `source_file` key; the list file itself is
/// never written.
///
/// The new text must read back as exactly `rules` (ignoring [`RuleConfig::line`], and the
/// prefixes of `source_file` rules, which come from their files), else nothing is written
/// ([`ConfigError::NotWritten`]). The file is replaced atomically: `path.tmp-<pid>` is written in
/// the same directory, synced, given the original's permissions (and owner, where allowed) and
/// renamed over the file, then the directory is synced. A symlinked `path` stays a symlink: its
/// target is replaced. Callers must not write the same file from two threads at once.
pub fn write_rules(path: &Path, rules: &[RuleConfig]) -> Result<(), ConfigError> {
    let text = read_text(path)?;
    let origin = path.display().to_string();
    let new_text = render_rules(&text, &origin, rules)?;
    let not_written = |reason: String| ConfigError::NotWritten {
        path: path.to_owned(),
        reason,
    };
    let again = Config::parse_in(&new_text, &origin, base_dir(path))
        .map_err(|e| not_written(format!("the rules would make the file invalid: {e}")))?;
    if let Some(reason) = read_back_difference(rules, &again.rules) {
        return Err(not_written(reason));
    }
    write_atomically(path, new_text.as_bytes()).map_err(|source| ConfigError::Write {
        path: path.to_owned(),
        source,
    })
}

/// How `read` (parsed back from the written text) differs from `rules`, if it does.
pub(super) fn read_back_difference(rules: &[RuleConfig], read: &[RuleConfig]) -> Option<String> {
    if rules.len() != read.len() {
        return Some(format!(
            "{} rules given but {} would be read back",
            rules.len(),
            read.len()
        ));
    }
    for (want, got) in rules.iter().zip(read) {
        let mut got = got.clone();
        got.line = want.line;
        if want.source_file.is_some() && got.source_file == want.source_file {
            got.sources.clone_from(&want.sources);
        }
        if got != *want {
            return Some(format!(
                "rule {:?} would read back differently (are its sources free of duplicates \
                 and host bits?)",
                want.name
            ));
        }
    }
    None
}

/// Replaces the file at `path` (or the target of a symlink there) with `contents`, atomically.
///
/// The target must be a regular file owned by root or by this process's user: rules are never
/// written into a file that another user controls. The new text goes to a temporary file created
/// with `O_EXCL` under an unpredictable name in the same directory (`tempfile`), so nothing planted
/// in that directory (a symlink to `/etc/shadow`, say) is opened, truncated or handed over; it is
/// then renamed over the target.
pub(super) fn write_atomically(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    use std::{
        io::Write,
        os::unix::fs::{MetadataExt, PermissionsExt},
    };
    let target = std::fs::canonicalize(path)?;
    let meta = std::fs::metadata(&target)?;
    if !meta.is_file() {
        return Err(std::io::Error::other(format!(
            "{} is not a regular file",
            target.display()
        )));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if meta.uid() != 0 && meta.uid() != euid {
        return Err(std::io::Error::other(format!(
            "{} is owned by uid {}, neither root nor this agent's user (uid {euid}): refusing to \
             write rules into a file another user controls",
            target.display(),
            meta.uid()
        )));
    }
    let dir = base_dir(&target);
    let name = target
        .file_name()
        .ok_or_else(|| std::io::Error::other("not a file name"))?
        .to_string_lossy()
        .into_owned();
    let mut file = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .permissions(std::fs::Permissions::from_mode(0o600))
        .tempfile_in(dir)?;
    file.write_all(contents)?;
    // The owner matters when root edits a file someone else owns; only root may change it.
    let _ = std::os::unix::fs::fchown(file.as_file(), Some(meta.uid()), Some(meta.gid()));
    file.as_file().set_permissions(meta.permissions())?;
    file.as_file().sync_all()?;
    // On error the temporary file is removed when `file` drops.
    file.persist(&target).map_err(|e| e.error)?;
    std::fs::File::open(dir)?.sync_all()
}

impl RuleConfig {
    /// The rule as a `[[rule]]` table of the config file, with only the keys that differ from
    /// their defaults (for `rules list` and the like). A `source_file` rule shows its file, not
    /// the prefixes read from it.
    pub fn to_toml(&self) -> String {
        let mut doc = toml_edit::DocumentMut::new();
        let mut tables = toml_edit::ArrayOfTables::new();
        tables.push(new_rule_table(self));
        doc.insert("rule", toml_edit::Item::ArrayOfTables(tables));
        doc.to_string()
    }
}
