//! TOML text to [`Config`]: the document is deserialized into `Raw*` mirrors whose fields keep
//! their spans, then converted to the typed form with defaults filled in and every value checked
//! where it was written.

use std::{
    collections::{HashMap, HashSet},
    path::Path,
};

use ipnet::IpNet;
use serde::Deserialize;
use toml::Spanned;

use super::{
    cluster::cluster_from_raw,
    error::{rule_section, schema_error, syntax_error, ConfigError, Source},
    keywords::{Action, Per, Protocol, Scope, TcpFlags},
    lists::{base_dir, list_sources, read_text, SourcesFrom},
    model::{AgentConfig, Config, MAX_MAX_BUCKETS, MAX_TOTAL_PREFIXES, MIN_MAX_BUCKETS},
    raw::{RawAgent, RawConfig, RawLimit, RawRule, RawSource},
    rule::{default_bytes_burst, RuleConfig},
    validate::{no_meaning, parse_source, validate_source},
};

/// Converts a non-negative TOML integer (TOML integers are i64) to u64.
pub(super) fn non_negative(
    src: &Source,
    v: &Spanned<i64>,
    section: &str,
    field: &str,
) -> Result<u64, ConfigError> {
    u64::try_from(*v.get_ref()).map_err(|_| {
        src.invalid(
            v.span().start,
            section,
            field,
            format!("must not be negative (got {})", v.get_ref()),
        )
    })
}

impl Config {
    /// Reads and validates the config file at `path` (and the `source_file` lists it names).
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = read_text(path)?;
        Config::parse_in(&text, &path.display().to_string(), base_dir(path))
    }

    /// Parses and validates config `text`; `origin` is the file name that error messages show.
    /// Relative `source_file` paths are resolved against the directory part of `origin`.
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        Config::parse_in(text, origin, base_dir(Path::new(origin)))
    }

    /// Parses and validates one rule given as a TOML document of a single `[[rule]]` table (and
    /// its `[[rule.limit]]`s), as the config file's rules are: the same keys, defaults, ranges and
    /// messages. What only the whole config can tell (names and matches unique among the rules,
    /// `scope = "cluster"` with a `[cluster]` section) is left to it. `origin` names the text in
    /// messages; `source_file` lists are refused (there is no file to resolve them against).
    pub fn parse_rule(text: &str, origin: &str) -> Result<RuleConfig, ConfigError> {
        let src = Source::new(origin, text, Path::new("."));
        let doc = toml_edit::ImDocument::parse(text).map_err(|e| syntax_error(&src, &e))?;
        let raw = RawConfig::deserialize(toml_edit::de::Deserializer::from(doc.clone()))
            .map_err(|e| schema_error(&src, doc.as_table(), &e))?;
        if raw.agent.is_some() || raw.cluster.is_some() || raw.rules.len() != 1 {
            return Err(src.invalid(
                0,
                "",
                "rule",
                "expected exactly one [[rule]] table and nothing else",
            ));
        }
        let Some(raw_rule) = raw.rules.into_iter().next() else {
            unreachable!("one rule, checked above");
        };
        if let Some(file) = &raw_rule.get_ref().source_file {
            return Err(src.invalid(
                file.span().start,
                &rule_section(raw_rule.get_ref().name.get_ref(), 0),
                "source_file",
                "list files can only be named in the config file; send `source` with the prefixes",
            ));
        }
        let (rule, from) = rule_from_raw(&src, 0, raw_rule, true)?;
        if rule.sources.len() > MAX_TOTAL_PREFIXES {
            return Err(src.invalid(
                from.key_offset(),
                &rule_section(&rule.name, 0),
                from.key(),
                format!(
                    "lists {} distinct source prefixes; at most {MAX_TOTAL_PREFIXES} fit over all \
                     rules (the prefix trie holds two rule sets during a swap)",
                    rule.sources.len()
                ),
            ));
        }
        Ok(rule)
    }

    pub(super) fn parse_in(text: &str, origin: &str, base: &Path) -> Result<Config, ConfigError> {
        let src = Source::new(origin, text, base);
        let doc = toml_edit::ImDocument::parse(text).map_err(|e| syntax_error(&src, &e))?;
        let raw = RawConfig::deserialize(toml_edit::de::Deserializer::from(doc.clone()))
            .map_err(|e| schema_error(&src, doc.as_table(), &e))?;

        let agent = match raw.agent {
            Some(a) => agent_from_raw(&src, a)?,
            None => AgentConfig::default(),
        };
        let cluster = raw.cluster.map(|c| cluster_from_raw(&src, c)).transpose()?;
        if raw.rules.len() > ratelimit_common::MAX_RULES as usize {
            let extra = &raw.rules[ratelimit_common::MAX_RULES as usize];
            return Err(src.invalid(
                extra.span().start,
                &rule_section(
                    extra.get_ref().name.get_ref(),
                    ratelimit_common::MAX_RULES as usize,
                ),
                "name",
                format!(
                    "too many rules: at most {} are supported",
                    ratelimit_common::MAX_RULES
                ),
            ));
        }
        let mut rules: Vec<RuleConfig> = Vec::with_capacity(raw.rules.len());
        // Uniqueness, remembering the line that came first for the message.
        let mut names: HashMap<String, usize> = HashMap::new();
        // (prefix, protocol, port, TCP flags) -> index of the rule that matches it.
        let mut matches: HashMap<(IpNet, Protocol, Option<u16>, Option<TcpFlags>), usize> =
            HashMap::new();
        let mut distinct: HashSet<IpNet> = HashSet::new();
        for (index, raw_rule) in raw.rules.into_iter().enumerate() {
            let name_offset = raw_rule.get_ref().name.span().start;
            let (rule, from) = rule_from_raw(&src, index, raw_rule, cluster.is_some())?;
            let section = rule_section(&rule.name, index);
            if let Some(first) = names.insert(rule.name.clone(), rule.line) {
                return Err(src.invalid(
                    name_offset,
                    &section,
                    "name",
                    format!("duplicate rule name (first used by the rule at line {first})"),
                ));
            }
            matches.reserve(rule.sources.len());
            for (i, &net) in rule.sources.iter().enumerate() {
                match matches.entry((net, rule.protocol, rule.dst_port, rule.tcp_flags)) {
                    std::collections::hash_map::Entry::Vacant(e) => {
                        e.insert(index);
                    }
                    std::collections::hash_map::Entry::Occupied(e) => {
                        let other = &rules[*e.get()];
                        let message = format!(
                            "rule {:?} (line {}) already matches source {net}, protocol {}{}; \
                             two rules cannot match the same traffic",
                            other.name,
                            other.line,
                            rule.protocol,
                            rule.dst_port
                                .map(|p| format!(", dst_port {p}"))
                                .unwrap_or_default()
                                + &rule
                                    .tcp_flags
                                    .map(|f| format!(", tcp_flags {f}"))
                                    .unwrap_or_default(),
                        );
                        return Err(from.error_at(&src, &section, &rule.name, i, message));
                    }
                }
            }
            distinct.extend(rule.sources.iter().copied());
            if distinct.len() > MAX_TOTAL_PREFIXES {
                return Err(src.invalid(
                    from.key_offset(),
                    &section,
                    from.key(),
                    format!(
                        "the rules up to this one list {} distinct source prefixes; at most \
                         {MAX_TOTAL_PREFIXES} fit over all rules (the prefix trie holds two rule \
                         sets during a swap)",
                        distinct.len()
                    ),
                ));
            }
            rules.push(rule);
        }
        Ok(Config {
            agent,
            rules,
            cluster,
        })
    }
}

pub(super) fn agent_from_raw(src: &Source, raw: RawAgent) -> Result<AgentConfig, ConfigError> {
    const S: &str = "[agent]";
    let mut agent = AgentConfig::default();
    let mut seen = HashSet::new();
    for ifname in raw.interfaces.unwrap_or_default() {
        let at = ifname.span().start;
        let name = ifname.into_inner();
        if let Err(why) = validate_ifname(&name) {
            return Err(src.invalid(at, S, "interfaces", why));
        }
        if !seen.insert(name.clone()) {
            return Err(src.invalid(at, S, "interfaces", format!("{name:?} is listed twice")));
        }
        agent.interfaces.push(name);
    }
    agent.mode = raw.mode.unwrap_or_default();
    if let Some(socket) = raw.socket {
        if socket.get_ref().as_os_str().is_empty() {
            return Err(src.invalid(socket.span().start, S, "socket", "must not be empty"));
        }
        agent.socket = socket.into_inner();
    }
    agent.metrics = raw.metrics;
    if let Some(v) = raw.max_buckets {
        let n = *v.get_ref();
        agent.max_buckets = u32::try_from(n)
            .ok()
            .filter(|n| (MIN_MAX_BUCKETS..=MAX_MAX_BUCKETS).contains(n))
            .ok_or_else(|| {
                src.invalid(
                    v.span().start,
                    S,
                    "max_buckets",
                    format!("must be between {MIN_MAX_BUCKETS} and {MAX_MAX_BUCKETS} (got {n})"),
                )
            })?;
    }
    if let Some(pin) = raw.pin_path {
        if !pin.get_ref().is_absolute() {
            return Err(src.invalid(
                pin.span().start,
                S,
                "pin_path",
                format!(
                    "{:?} must be an absolute path (under a bpffs mount)",
                    pin.get_ref()
                ),
            ));
        }
        agent.pin_path = pin.into_inner();
    }
    agent.dry_run = raw.dry_run.unwrap_or(false);
    agent.ebpf_log = raw.ebpf_log.unwrap_or(false);
    agent.log_format = raw.log_format.unwrap_or_default();
    agent.learn = raw.learn.unwrap_or(true);
    if let Some(dir) = raw.state_dir {
        if !dir.get_ref().is_absolute() {
            return Err(src.invalid(
                dir.span().start,
                S,
                "state_dir",
                format!("{:?} must be an absolute path", dir.get_ref()),
            ));
        }
        agent.state_dir = dir.into_inner();
    }
    Ok(agent)
}

/// Linux interface name rules (`dev_valid_name` in net/core/dev.c).
pub(super) fn validate_ifname(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 15 {
        return Err(format!(
            "{name:?} is not a valid interface name: must be 1 to 15 bytes long"
        ));
    }
    if name == "." || name == ".." {
        return Err(format!("{name:?} is not a valid interface name"));
    }
    if name.contains('/') || name.contains(':') || name.chars().any(char::is_whitespace) {
        return Err(format!(
            "{name:?} is not a valid interface name: no '/', ':' or whitespace allowed"
        ));
    }
    Ok(())
}

/// One `[[rule]]` table: its sources, its keys, then [`RuleConfig::validate`], each error at the
/// key it names. Returns the rule and where its sources were written.
pub(super) fn rule_from_raw(
    src: &Source,
    index: usize,
    raw: Spanned<RawRule>,
    has_cluster: bool,
) -> Result<(RuleConfig, SourcesFrom), ConfigError> {
    let table_offset = raw.span().start;
    let mut raw = raw.into_inner();
    let section = rule_section(raw.name.get_ref(), index);
    let (sources, from) = rule_sources(src, &section, table_offset, &mut raw)?;
    let mut rule = RuleConfig::with_sources(raw.name.get_ref().clone(), sources);
    if let SourcesFrom::List { path, .. } = &from {
        rule.source_file = Some(path.clone());
    }
    rule.line = src.line(table_offset);
    rule.action = raw.action.as_ref().map_or(Action::Limit, |a| *a.get_ref());
    let offsets = key_offsets(src, &section, &raw, &from, rule.action)?;
    rule_keys(src, &section, raw, &mut rule, has_cluster)?;

    rule.validate().map_err(|e| {
        // A key that was not written (e.g. the missing `rate`) is reported at the table's line.
        let offset = offsets.get(e.field).copied().unwrap_or(table_offset);
        src.invalid(offset, &section, e.field, e.message)
    })?;
    Ok((rule, from))
}

/// A rule's prefixes, from `source` or `source_file` (exactly one of them); takes both out of
/// `raw`.
fn rule_sources(
    src: &Source,
    section: &str,
    table_offset: usize,
    raw: &mut RawRule,
) -> Result<(Vec<IpNet>, SourcesFrom), ConfigError> {
    match (raw.source.take(), raw.source_file.take()) {
        (Some(_), Some(file)) => Err(src.invalid(
            file.span().start,
            section,
            "source_file",
            "cannot be combined with `source`: give the prefixes inline (`source`) or in a \
             file (`source_file`), not both",
        )),
        (None, None) => Err(src.invalid(
            table_offset,
            section,
            "source",
            "required, but missing: give `source` (a CIDR or an array of CIDRs) or \
             `source_file` (a file with one CIDR per line)",
        )),
        (Some(source), None) => inline_sources(src, section, source),
        (None, Some(file)) => list_sources(src, section, raw.name.get_ref(), file),
    }
}

/// Where each key of a `[[rule]]` was written, so that errors found on the typed rule point at
/// it. Refuses the limit keys on a rule whose `action` is not `limit`.
fn key_offsets(
    src: &Source,
    section: &str,
    raw: &RawRule,
    from: &SourcesFrom,
    action: Action,
) -> Result<HashMap<&'static str, usize>, ConfigError> {
    let mut offsets: HashMap<&'static str, usize> = HashMap::new();
    offsets.insert("name", raw.name.span().start);
    offsets.insert(from.key(), from.key_offset());
    let limit_keys = [
        ("rate", raw.rate.as_ref().map(|v| v.span())),
        ("burst", raw.burst.as_ref().map(|v| v.span())),
        ("bytes_rate", raw.bytes_rate.as_ref().map(|v| v.span())),
        ("bytes_burst", raw.bytes_burst.as_ref().map(|v| v.span())),
        ("per", raw.per.as_ref().map(|v| v.span())),
        ("scope", raw.scope.as_ref().map(|v| v.span())),
    ];
    for (key, span) in limit_keys {
        if let Some(span) = span {
            // Checked on the raw form: the typed form cannot tell `per = "source"` from no `per`.
            if action != Action::Limit {
                let e = no_meaning(key, action);
                return Err(src.invalid(span.start, section, key, e.message));
            }
            offsets.insert(key, span.start);
        }
    }
    for (key, span) in [
        ("action", raw.action.as_ref().map(|v| v.span())),
        ("protocol", raw.protocol.as_ref().map(|v| v.span())),
        ("dst_port", raw.dst_port.as_ref().map(|v| v.span())),
        ("tcp_flags", raw.tcp_flags.as_ref().map(|v| v.span())),
    ] {
        if let Some(span) = span {
            offsets.insert(key, span.start);
        }
    }
    Ok(offsets)
}

/// A `[[rule]]`'s keys after its sources and action, onto `rule` with their defaults: the limit
/// numbers, `per`, the match keys, `scope`, `dry_run` and the `[[rule.limit]]` tables.
fn rule_keys(
    src: &Source,
    section: &str,
    raw: RawRule,
    rule: &mut RuleConfig,
    has_cluster: bool,
) -> Result<(), ConfigError> {
    let number = |v: &Option<Spanned<i64>>, key| {
        v.as_ref()
            .map(|v| non_negative(src, v, section, key))
            .transpose()
    };
    rule.rate = number(&raw.rate, "rate")?;
    rule.burst = number(&raw.burst, "burst")?.or(rule.rate);
    rule.bytes_rate = number(&raw.bytes_rate, "bytes_rate")?;
    rule.bytes_burst =
        number(&raw.bytes_burst, "bytes_burst")?.or_else(|| default_bytes_burst(rule.bytes_rate));
    rule.per = raw.per.map_or(Per::Source, Spanned::into_inner);
    rule.protocol = raw.protocol.map_or(Protocol::Any, Spanned::into_inner);
    if let Some(port) = raw.dst_port {
        let n = *port.get_ref();
        let p = u16::try_from(n).ok().filter(|&p| p != 0).ok_or_else(|| {
            src.invalid(
                port.span().start,
                section,
                "dst_port",
                format!("must be between 1 and 65535 (got {n})"),
            )
        })?;
        rule.dst_port = Some(p);
    }
    rule.tcp_flags = raw.tcp_flags.map(Spanned::into_inner);
    if let Some(scope) = raw.scope {
        rule.scope = scope_in(src, scope, section, has_cluster)?;
    }
    rule.dry_run = raw.dry_run.is_some_and(Spanned::into_inner);
    if let Some(limits) = raw.limit {
        rule.limits = limits_from_raw(src, section, rule, limits, has_cluster)?;
    }
    Ok(())
}

/// A rule's or a limit's `scope` in `section`: `cluster` only where the file has a `[cluster]`
/// table.
fn scope_in(
    src: &Source,
    scope: Spanned<Scope>,
    section: &str,
    has_cluster: bool,
) -> Result<Scope, ConfigError> {
    if *scope.get_ref() == Scope::Cluster && !has_cluster {
        return Err(src.invalid(
            scope.span().start,
            section,
            "scope",
            "scope = \"cluster\" needs a [cluster] table (the peers that share the budget); \
             add one, or use scope = \"local\"",
        ));
    }
    Ok(scope.into_inner())
}

/// A rule's `[[rule.limit]]` tables, each checked where it was written.
fn limits_from_raw(
    src: &Source,
    section: &str,
    rule: &RuleConfig,
    raw: Vec<Spanned<RawLimit>>,
    has_cluster: bool,
) -> Result<Vec<crate::config::LimitConfig>, ConfigError> {
    use crate::config::{LimitConfig, MAX_EXTRA_LIMITS};
    let mut out = Vec::with_capacity(raw.len());
    for (i, raw) in raw.into_iter().enumerate() {
        let at = raw.span().start;
        let raw = raw.into_inner();
        let section = format!("{section} limit {} ([[rule.limit]] #{})", i + 2, i + 1);
        if rule.action != Action::Limit {
            let e = no_meaning("limit", rule.action);
            return Err(src.invalid(at, &section, "limit", e.message));
        }
        if i >= MAX_EXTRA_LIMITS {
            return Err(src.invalid(
                at,
                &section,
                "limit",
                format!(
                    "too many limits: a rule may have at most {} (its own and {MAX_EXTRA_LIMITS} \
                     `[[rule.limit]]` tables)",
                    MAX_EXTRA_LIMITS + 1
                ),
            ));
        }
        let Some(per) = raw.per else {
            return Err(src.invalid(
                at,
                &section,
                "per",
                "required, but missing: say what this limit counts together (\"source\", \"/N\" \
                 or \"rule\")",
            ));
        };
        let mut offsets: HashMap<&'static str, usize> = HashMap::new();
        offsets.insert("per", per.span().start);
        for (key, v) in [
            ("rate", &raw.rate),
            ("burst", &raw.burst),
            ("bytes_rate", &raw.bytes_rate),
            ("bytes_burst", &raw.bytes_burst),
        ] {
            if let Some(v) = v {
                offsets.insert(key, v.span().start);
            }
        }
        let number = |v: &Option<Spanned<i64>>, key| {
            v.as_ref()
                .map(|v| non_negative(src, v, &section, key))
                .transpose()
        };
        let mut l = LimitConfig::new(per.into_inner());
        l.line = src.line(at);
        l.rate = number(&raw.rate, "rate")?;
        l.burst = number(&raw.burst, "burst")?.or(l.rate);
        l.bytes_rate = number(&raw.bytes_rate, "bytes_rate")?;
        l.bytes_burst =
            number(&raw.bytes_burst, "bytes_burst")?.or_else(|| default_bytes_burst(l.bytes_rate));
        if let Some(scope) = raw.scope {
            offsets.insert("scope", scope.span().start);
            l.scope = scope_in(src, scope, &section, has_cluster)?;
        }
        l.validate(rule.families()).map_err(|e| {
            let offset = offsets.get(e.field).copied().unwrap_or(at);
            src.invalid(offset, &section, e.field, e.message)
        })?;
        out.push(l);
    }
    Ok(out)
}

/// The prefixes of an inline `source`, without duplicates.
pub(super) fn inline_sources(
    src: &Source,
    section: &str,
    source: Spanned<RawSource>,
) -> Result<(Vec<IpNet>, SourcesFrom), ConfigError> {
    let key_offset = source.span().start;
    let written: Vec<(String, usize)> = match source.into_inner() {
        RawSource::One(text) => vec![(text, key_offset)],
        RawSource::Many(list) => list
            .into_iter()
            .map(|s| {
                let at = s.span().start;
                (s.into_inner(), at)
            })
            .collect(),
    };
    let mut seen = HashSet::with_capacity(written.len());
    let mut nets = Vec::with_capacity(written.len());
    let mut at = Vec::with_capacity(written.len());
    for (text, offset) in written {
        let net = parse_source(&text)
            .and_then(|net| validate_source(&net).map(|()| net))
            .map_err(|m| src.invalid(offset, section, "source", m))?;
        if seen.insert(net) {
            nets.push(net);
            at.push(offset);
        }
    }
    Ok((nets, SourcesFrom::Inline { key_offset, at }))
}
