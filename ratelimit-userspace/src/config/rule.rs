//! One `[[rule]]`: [`RuleConfig`] and its `[[rule.limit]]` tables ([`LimitConfig`]), their
//! defaults, and a rule serialized with the config file's keys. The checks a rule must pass are
//! in `validate.rs`; this room holds what a rule is.

use std::path::{Path, PathBuf};

use ipnet::IpNet;
use serde::Serialize;

use super::{
    model::NS_PER_SEC, Action, Per, Protocol, Scope, TcpFlags, DEFAULT_BYTES_BURST_FLOOR,
    MAX_TOLERANCE_NS,
};

/// One validated `[[rule]]`, with defaults filled in.
///
/// Serializes (e.g. to JSON for the CLI) with the config file's keys and spellings; keys that
/// have no meaning for the rule's action are left out, so the output parses back as the same rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleConfig {
    /// Unique name, `[A-Za-z0-9_.-]{1,64}`.
    pub name: String,
    /// Source prefixes (host bits zero, no duplicates), in the order written: from `source` (one
    /// CIDR or an array of them; a bare address means /32 or /128) or read from `source_file`.
    /// IPv4 and IPv6 prefixes may be mixed, except with `per = "/N"` or `protocol = "icmp"`.
    pub sources: Vec<IpNet>,
    /// The list file `sources` were read from (`source_file`), resolved against the config
    /// file's directory; `None` when they are written inline (`source`). Writing the rules back
    /// keeps the `source_file` key and never rewrites the list itself.
    pub source_file: Option<PathBuf>,
    /// What to do with matching packets.
    pub action: Action,
    /// Packets per second (limit rules).
    pub rate: Option<u64>,
    /// Packets; `Some(rate)` when the file gives `rate` but no `burst`.
    pub burst: Option<u64>,
    /// Bytes per second (limit rules).
    pub bytes_rate: Option<u64>,
    /// Bytes; when the file gives `bytes_rate` but no `bytes_burst`, `max(bytes_rate, 65536)`
    /// capped at one hour's worth of `bytes_rate`.
    pub bytes_burst: Option<u64>,
    /// Bucket granularity (meaningful for limit rules only).
    pub per: Per,
    /// L4 protocol to match.
    pub protocol: Protocol,
    /// Destination port to match (TCP or UDP rules only).
    pub dst_port: Option<u16>,
    /// TCP flags to match (`protocol = "tcp"` rules only).
    pub tcp_flags: Option<TcpFlags>,
    /// Local or cluster-wide budget (limit rules only).
    pub scope: Scope,
    /// Count would-be drops but pass the packets.
    pub dry_run: bool,
    /// The rule's further limits (`[[rule.limit]]`, at most [`MAX_EXTRA_LIMITS`]), after the one
    /// its own `rate`/`burst`/`bytes_*`/`per`/`scope` make: a packet passes only if it conforms
    /// to every one (limit rules only).
    pub limits: Vec<LimitConfig>,
    /// 1-based line where the rule's table starts in its file; 0 if it did not come from a file.
    pub line: usize,
}

/// Most `[[rule.limit]]` tables one rule may have (its own limit is the first of
/// [`ratelimit_common::MAX_LIMITS`]).
pub const MAX_EXTRA_LIMITS: usize = ratelimit_common::MAX_LIMITS - 1;

/// One `[[rule.limit]]`: a limit of a rule besides its own, with defaults filled in. Two limits
/// are equal when they limit alike, wherever they were written (`line` is not compared).
#[derive(Clone, Debug, Eq, Serialize)]
pub struct LimitConfig {
    /// Bucket granularity: required (`source`, `"/N"` or `rule`).
    pub per: Per,
    /// Packets per second.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate: Option<u64>,
    /// Packets; `Some(rate)` when `rate` is given without `burst`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst: Option<u64>,
    /// Bytes per second.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_rate: Option<u64>,
    /// Bytes; defaulted as the rule's own `bytes_burst`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_burst: Option<u64>,
    /// Local or cluster-wide budget.
    pub scope: Scope,
    /// 1-based line of the `[[rule.limit]]` header; 0 if it did not come from a file.
    #[serde(skip)]
    pub line: usize,
}

impl PartialEq for LimitConfig {
    fn eq(&self, other: &Self) -> bool {
        (
            self.per,
            self.rate,
            self.burst,
            self.bytes_rate,
            self.bytes_burst,
            self.scope,
        ) == (
            other.per,
            other.rate,
            other.burst,
            other.bytes_rate,
            other.bytes_burst,
            other.scope,
        )
    }
}

impl LimitConfig {
    /// A limit with no rate yet (which [`validate`](Self::validate) rejects).
    pub fn new(per: Per) -> Self {
        Self {
            per,
            rate: None,
            burst: None,
            bytes_rate: None,
            bytes_burst: None,
            scope: Scope::Local,
            line: 0,
        }
    }
}

impl RuleConfig {
    /// A rule with every optional key at its default: a limit rule with no limit yet (which
    /// [`validate`](Self::validate) rejects until `rate` or `bytes_rate` is set).
    pub fn new(name: impl Into<String>, source: IpNet) -> Self {
        Self::with_sources(name, vec![source])
    }

    /// Like [`new`](Self::new), for a rule with any number of source prefixes.
    pub fn with_sources(name: impl Into<String>, sources: Vec<IpNet>) -> Self {
        Self {
            name: name.into(),
            sources,
            source_file: None,
            action: Action::Limit,
            rate: None,
            burst: None,
            bytes_rate: None,
            bytes_burst: None,
            per: Per::Source,
            protocol: Protocol::Any,
            dst_port: None,
            tcp_flags: None,
            scope: Scope::Local,
            dry_run: false,
            limits: Vec::new(),
            line: 0,
        }
    }

    /// The rule's only source prefix, if it has exactly one (the common `source = "CIDR"`).
    pub fn source(&self) -> Option<IpNet> {
        match self.sources.as_slice() {
            [one] => Some(*one),
            _ => None,
        }
    }

    /// Whether the rule has (IPv4, IPv6) source prefixes.
    pub fn families(&self) -> (bool, bool) {
        let (mut v4, mut v6) = (false, false);
        for net in &self.sources {
            match net {
                IpNet::V4(_) => v4 = true,
                IpNet::V6(_) => v6 = true,
            }
            if v4 && v6 {
                break;
            }
        }
        (v4, v6)
    }

    /// The sources for a human, short: `10.0.0.0/8`, `10.0.0.0/8, 2001:db8::/32`,
    /// `5 prefixes (10.0.0.0/8, ...)` or `/etc/ratelimit/deny.txt (1234 prefixes)`.
    pub fn source_summary(&self) -> String {
        if let Some(file) = &self.source_file {
            let n = self.sources.len();
            return format!(
                "{} ({n} prefix{})",
                file.display(),
                if n == 1 { "" } else { "es" }
            );
        }
        match self.sources.as_slice() {
            [] => "(none)".to_owned(),
            list @ ([_] | [_, _] | [_, _, _]) => list
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            [first, ..] => format!("{} prefixes ({first}, ...)", self.sources.len()),
        }
    }
}

/// Serialized form of a rule: the config file's keys, without those meaningless for its action.
#[derive(Serialize)]
pub(super) struct RuleView<'a> {
    pub(super) name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) source: Option<SourceView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) source_file: Option<&'a Path>,
    pub(super) action: Action,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) rate: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) burst: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) bytes_rate: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) bytes_burst: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) per: Option<Per>,
    pub(super) protocol: Protocol,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) dst_port: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) tcp_flags: Option<TcpFlags>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) scope: Option<Scope>,
    pub(super) dry_run: bool,
    #[serde(skip_serializing_if = "<[LimitConfig]>::is_empty")]
    pub(super) limit: &'a [LimitConfig],
}

/// `source` as written: one CIDR, or an array of them.
#[derive(Serialize)]
#[serde(untagged)]
pub(super) enum SourceView {
    One(String),
    Many(Vec<String>),
}

impl Serialize for RuleConfig {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let limit = self.action == Action::Limit;
        let source = match (&self.source_file, self.source()) {
            (Some(_), _) => None,
            (None, Some(one)) => Some(SourceView::One(one.to_string())),
            (None, None) => Some(SourceView::Many(
                self.sources.iter().map(ToString::to_string).collect(),
            )),
        };
        RuleView {
            name: &self.name,
            source,
            source_file: self.source_file.as_deref(),
            action: self.action,
            rate: self.rate,
            burst: self.burst,
            bytes_rate: self.bytes_rate,
            bytes_burst: self.bytes_burst,
            per: limit.then_some(self.per),
            protocol: self.protocol,
            dst_port: self.dst_port,
            tcp_flags: self.tcp_flags,
            scope: limit.then_some(self.scope),
            dry_run: self.dry_run,
            limit: &self.limits,
        }
        .serialize(s)
    }
}

/// The default `bytes_burst` for `bytes_rate`: `max(bytes_rate, 65536)`, capped at one hour's
/// worth so that a tiny rate does not make its own default invalid.
pub(super) fn default_bytes_burst(bytes_rate: Option<u64>) -> Option<u64> {
    bytes_rate.map(|r| {
        r.max(DEFAULT_BYTES_BURST_FLOOR)
            .min(r.saturating_mul(MAX_TOLERANCE_NS / NS_PER_SEC))
    })
}
