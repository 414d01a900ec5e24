//! The TOML config file (`/etc/ratelimit/ratelimit.toml`): parsing and validation.
//!
//! Every error names the file, the 1-based line and the key it is about, e.g.
//! `/etc/ratelimit/ratelimit.toml:14: rule "dns": field `dst_port`: only valid with protocol tcp or udp`.
//!
//! Parsing is two-staged. The text is first deserialized into private `Raw*` mirrors whose fields
//! are [`toml::Spanned`], so that type errors come from the TOML deserializer with a span and
//! semantic errors found afterwards can still point at the offending value. The raw form is then
//! converted into the public typed form ([`Config`]), filling in defaults; cross-field rule checks
//! live in [`RuleConfig::validate`] so that rules that do not come from a file (added over the
//! control socket) go through exactly the same checks.
//!
//! The document is parsed with `toml_edit` rather than `toml::from_str` because its parsed tree
//! keeps the position of every key: when the deserializer reports an error at some byte offset we
//! walk that tree to find which key (and which `[[rule]]`) the offset belongs to, since the error
//! itself only carries the span and a message.
//!
//! A rule's sources are one CIDR (`source = "10.0.0.0/8"`), an array of them, or a list file
//! (`source_file = "deny.txt"`, relative to the config file's directory): one CIDR per line, `#`
//! comments, blank lines ignored. Errors in a list name the list file and its line, then the rule
//! and the config line naming the list:
//! `/etc/ratelimit/deny.txt:1234: invalid CIDR "10.0.0.300/8" (rule "blocklist", /etc/ratelimit/ratelimit.toml:20)`.
//! A rule lists at most [`MAX_RULE_PREFIXES`], all rules together at most [`MAX_TOTAL_PREFIXES`]
//! distinct prefixes.
//!
//! [`write_rules`] writes a changed rule set back into the file with `toml_edit`, keeping the
//! rest of the document (comments, formatting, other tables) as it is.

use std::{
    collections::{HashMap, HashSet},
    fmt,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    ops::Range,
    path::{Path, PathBuf},
    str::FromStr,
};

use ipnet::{IpNet, Ipv6Net};
use serde::{Deserialize, Serialize};
use toml::Spanned;

/// Default control socket path (`[agent] socket`).
pub const DEFAULT_SOCKET: &str = "/run/ratelimit/agent.sock";
/// Default bpffs directory for pinned maps and links (`[agent] pin_path`).
pub const DEFAULT_PIN_PATH: &str = "/sys/fs/bpf/ratelimit";
/// Smallest accepted `[agent] max_buckets`.
pub const MIN_MAX_BUCKETS: u32 = 16;
/// Largest accepted `[agent] max_buckets` (2^26).
pub const MAX_MAX_BUCKETS: u32 = 1 << 26;
/// Largest `rate` (packets/s): one packet then costs 1 ns, the clock's resolution.
pub const MAX_RATE: u64 = 1_000_000_000;
/// Largest `bytes_rate` (bytes/s, 8 Tbit/s): keeps `byte_interval_fp` non-zero.
pub const MAX_BYTES_RATE: u64 = 1_000_000_000_000;
/// Largest time a full bucket takes to refill (`burst / rate`), in nanoseconds: one hour. Bounds
/// the tolerances so that the kernel's `now + tolerance` arithmetic cannot overflow.
pub const MAX_TOLERANCE_NS: u64 = 3_600_000_000_000;
/// Smallest `bytes_burst`: one full Ethernet frame must be able to pass.
pub const MIN_BYTES_BURST: u64 = 1514;
/// Floor of the default `bytes_burst` (the default is `max(bytes_rate, 65536)`).
pub const DEFAULT_BYTES_BURST_FLOOR: u64 = 65_536;
/// Longest rule name.
pub const MAX_NAME_LEN: usize = 64;
/// Most source prefixes one rule may list (`source` array or `source_file`).
pub const MAX_RULE_PREFIXES: usize = 250_000;
/// Most distinct source prefixes over all rules: half the prefix trie, because the trie holds
/// the installed and the next rule set during a swap.
pub const MAX_TOTAL_PREFIXES: usize = ratelimit_common::MAX_PREFIXES as usize / 2;

const NS_PER_SEC: u64 = 1_000_000_000;

/// A parsed and validated config file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Config {
    /// `[agent]`: how the agent attaches and where it listens.
    pub agent: AgentConfig,
    /// `[[rule]]` tables, in file order. May be empty: then every packet passes.
    pub rules: Vec<RuleConfig>,
    /// `[cluster]`: peers sharing cluster-scoped budgets, if any.
    pub cluster: Option<ClusterConfig>,
}

/// The `[agent]` table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AgentConfig {
    /// Interfaces the XDP program attaches to.
    pub interfaces: Vec<String>,
    /// XDP attach mode.
    pub mode: AttachMode,
    /// Control API Unix socket.
    pub socket: PathBuf,
    /// Prometheus endpoint, if enabled.
    pub metrics: Option<SocketAddr>,
    /// Capacity of the bucket map (tracked sources).
    pub max_buckets: u32,
    /// bpffs directory where maps and links are pinned (absolute).
    pub pin_path: PathBuf,
    /// Count would-be drops but pass everything, for every rule.
    pub dry_run: bool,
    /// Emit debug records from the XDP program.
    pub ebpf_log: bool,
    /// Log format on stderr (`--log-format` overrides it; read at start, not on reload).
    pub log_format: crate::logging::LogFormat,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            interfaces: Vec::new(),
            mode: AttachMode::Auto,
            socket: PathBuf::from(DEFAULT_SOCKET),
            metrics: None,
            max_buckets: ratelimit_common::DEFAULT_MAX_BUCKETS,
            pin_path: PathBuf::from(DEFAULT_PIN_PATH),
            dry_run: false,
            ebpf_log: false,
            log_format: crate::logging::LogFormat::Plain,
        }
    }
}

/// XDP attach mode (`[agent] mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AttachMode {
    /// Native (driver) mode if the driver supports it, else generic (skb) mode.
    #[default]
    Auto,
    /// Driver mode only; attaching fails if unsupported.
    Native,
    /// Generic mode (works everywhere, slower).
    Skb,
}

/// The `[cluster]` table. Parsed and checked for shape only; the cluster sync consumes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ClusterConfig {
    /// Address the gossip transport binds.
    pub listen: SocketAddr,
    /// Peers contacted at startup.
    pub seeds: Vec<SocketAddr>,
    /// Shared secret authenticating cluster messages.
    pub key_file: PathBuf,
    /// How often consumption is exchanged, in milliseconds (10..=10000).
    pub sync_interval_ms: u64,
    /// Name separating independent clusters on one network.
    pub cluster_id: String,
    /// Most keys (heavy sources) published per sync, and read from each peer (1..=100000,
    /// default 1000): bounds message size, CPU and the state a peer can make us hold.
    pub max_keys: usize,
}

/// What a rule does with the packets it matches (`action`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Token-bucket limit.
    #[default]
    Limit,
    /// Always pass.
    Allow,
    /// Always drop.
    Deny,
}

/// The L4 protocol a rule matches (`protocol`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// TCP (6).
    Tcp,
    /// UDP (17).
    Udp,
    /// ICMP (1) for an IPv4 rule, ICMPv6 (58) for an IPv6 rule.
    Icmp,
    /// Any protocol.
    #[default]
    Any,
}

/// Whose consumption a limit rule's budget counts (`scope`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// This host only.
    #[default]
    Local,
    /// Shared with the cluster's peers.
    Cluster,
}

/// Bucket granularity of a limit rule (`per`): which sources share one bucket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Per {
    /// One bucket per source address (`"source"`).
    #[default]
    Source,
    /// One bucket for the whole rule (`"rule"`).
    Rule,
    /// One bucket per source prefix of this length (`"/24"`).
    Prefix(u8),
}

macro_rules! keyword_enum {
    ($ty:ty, $what:literal, $($variant:ident => $text:literal),+) => {
        impl $ty {
            /// The spelling used in the config file.
            pub const fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $text),+ }
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
        impl FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($text => Ok(Self::$variant),)+
                    _ => Err(format!(
                        concat!("unknown ", $what, " {:?}, expected one of: ", $($text, " "),+),
                        s
                    )),
                }
            }
        }
    };
}
keyword_enum!(AttachMode, "mode", Auto => "auto", Native => "native", Skb => "skb");
keyword_enum!(Action, "action", Limit => "limit", Allow => "allow", Deny => "deny");
keyword_enum!(Protocol, "protocol", Tcp => "tcp", Udp => "udp", Icmp => "icmp", Any => "any");
keyword_enum!(Scope, "scope", Local => "local", Cluster => "cluster");

impl fmt::Display for Per {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Per::Source => f.write_str("source"),
            Per::Rule => f.write_str("rule"),
            Per::Prefix(len) => write!(f, "/{len}"),
        }
    }
}

impl FromStr for Per {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad =
            || format!("{s:?} is not \"source\", \"rule\" or a prefix length such as \"/24\"");
        match s {
            "source" => Ok(Per::Source),
            "rule" => Ok(Per::Rule),
            _ => {
                let digits = s.strip_prefix('/').ok_or_else(bad)?;
                // Only plain decimal digits: u8::from_str would accept "+24".
                if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                match digits.parse::<u8>() {
                    Ok(len) if len <= 128 => Ok(Per::Prefix(len)),
                    _ => Err(format!(
                        "prefix length in {s:?} must be 0..=32 (IPv4) or 0..=128 (IPv6)"
                    )),
                }
            }
        }
    }
}

impl Serialize for Per {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Per {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

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
    /// Local or cluster-wide budget (limit rules only).
    pub scope: Scope,
    /// Count would-be drops but pass the packets.
    pub dry_run: bool,
    /// 1-based line where the rule's table starts in its file; 0 if it did not come from a file.
    pub line: usize,
}

/// Why a [`RuleConfig`] is invalid: the key at fault and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("field `{field}`: {message}")]
pub struct RuleError {
    /// The config key at fault.
    pub field: &'static str,
    /// What is wrong, for a human.
    pub message: String,
}

fn rule_error(field: &'static str, message: impl Into<String>) -> RuleError {
    RuleError {
        field,
        message: message.into(),
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
            scope: Scope::Local,
            dry_run: false,
            line: 0,
        }
    }

    /// Checks everything that can be checked on one rule alone (not uniqueness across rules).
    ///
    /// Defaults are not filled in here: `burst` and `bytes_burst` must already be set when
    /// `rate` and `bytes_rate` are (the config parser does that).
    pub fn validate(&self) -> Result<(), RuleError> {
        validate_name(&self.name).map_err(|m| rule_error("name", m))?;
        self.validate_sources()?;
        if let Some(port) = self.dst_port {
            if port == 0 {
                return Err(rule_error("dst_port", "must be between 1 and 65535"));
            }
            if !matches!(self.protocol, Protocol::Tcp | Protocol::Udp) {
                return Err(rule_error(
                    "dst_port",
                    format!(
                        "only valid with protocol tcp or udp (this rule has protocol {})",
                        self.protocol
                    ),
                ));
            }
        }
        if self.action != Action::Limit {
            let stray = [
                ("rate", self.rate.is_some()),
                ("burst", self.burst.is_some()),
                ("bytes_rate", self.bytes_rate.is_some()),
                ("bytes_burst", self.bytes_burst.is_some()),
                ("per", self.per != Per::Source),
                ("scope", self.scope != Scope::Local),
            ];
            if let Some((field, _)) = stray.iter().find(|(_, set)| *set) {
                return Err(no_meaning(field, self.action));
            }
            return Ok(());
        }
        if self.rate.is_none() && self.bytes_rate.is_none() {
            return Err(rule_error(
                "rate",
                "a limit rule needs `rate` (packets/s) or `bytes_rate` (bytes/s), or both",
            ));
        }
        check_limit(
            ("rate", self.rate),
            ("burst", self.burst),
            (1, MAX_RATE, 1),
            "packets",
        )?;
        check_limit(
            ("bytes_rate", self.bytes_rate),
            ("bytes_burst", self.bytes_burst),
            (1, MAX_BYTES_RATE, MIN_BYTES_BURST),
            "bytes",
        )?;
        if let Per::Prefix(len) = self.per {
            let (width, family) = match self.families() {
                (true, true) => {
                    return Err(rule_error(
                        "per",
                        format!(
                            "\"/{len}\" groups sources by a prefix length of one address family, \
                             but this rule's sources mix IPv4 and IPv6 prefixes; use per = \"source\" \
                             or \"rule\", or split the rule into one rule per family"
                        ),
                    ))
                }
                (false, true) => (128, "IPv6"),
                _ => (32, "IPv4"),
            };
            if len > width {
                return Err(rule_error(
                    "per",
                    format!("/{len} is longer than an {family} address (at most /{width})"),
                ));
            }
        }
        Ok(())
    }

    /// The checks on `sources` (and `protocol = "icmp"`, which depends on their family).
    fn validate_sources(&self) -> Result<(), RuleError> {
        let key = if self.source_file.is_some() {
            "source_file"
        } else {
            "source"
        };
        if self.sources.is_empty() && self.source_file.is_none() {
            return Err(rule_error(key, "must list at least one prefix"));
        }
        if self.sources.len() > MAX_RULE_PREFIXES {
            return Err(rule_error(
                key,
                format!(
                    "lists {} prefixes; one rule may list at most {MAX_RULE_PREFIXES}",
                    self.sources.len()
                ),
            ));
        }
        for net in &self.sources {
            validate_source(net).map_err(|m| rule_error(key, m))?;
        }
        if self.protocol == Protocol::Icmp && self.families() == (true, true) {
            return Err(rule_error(
                "protocol",
                "\"icmp\" means ICMP for IPv4 sources and ICMPv6 for IPv6 sources, and one rule \
                 cannot match both: this rule's sources mix IPv4 and IPv6 prefixes; split it into \
                 one rule per family",
            ));
        }
        Ok(())
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

/// The error for a limit-only key (`field`) on an allow or deny rule.
pub(crate) fn no_meaning(field: &'static str, action: Action) -> RuleError {
    rule_error(
        field,
        format!(
            "has no meaning for {} {action} rule (only limit rules take rates, per and scope)",
            if matches!(action, Action::Allow) {
                "an"
            } else {
                "a"
            }
        ),
    )
}

/// Checks one rate/burst pair. `bounds` is (min rate, max rate, min burst).
fn check_limit(
    (rate_key, rate): (&'static str, Option<u64>),
    (burst_key, burst): (&'static str, Option<u64>),
    (min_rate, max_rate, min_burst): (u64, u64, u64),
    unit: &str,
) -> Result<(), RuleError> {
    let Some(rate) = rate else {
        return match burst {
            Some(_) => Err(rule_error(
                burst_key,
                format!("is set but `{rate_key}` is not"),
            )),
            None => Ok(()),
        };
    };
    if !(min_rate..=max_rate).contains(&rate) {
        return Err(rule_error(
            rate_key,
            format!("must be between {min_rate} and {max_rate} {unit}/s (got {rate})"),
        ));
    }
    let burst = burst.ok_or_else(|| rule_error(burst_key, "must be set when the rate is"))?;
    if burst < min_burst {
        let why = if min_burst > 1 {
            " (one full-size Ethernet frame)"
        } else {
            ""
        };
        return Err(rule_error(
            burst_key,
            format!("must be at least {min_burst}{why} (got {burst})"),
        ));
    }
    // The kernel stores burst/rate as a nanosecond tolerance; an hour bounds it far from overflow
    // and nobody means a bucket that takes longer than that to refill.
    let refill_ns = u128::from(burst) * u128::from(NS_PER_SEC) / u128::from(rate);
    if refill_ns > u128::from(MAX_TOLERANCE_NS) {
        return Err(rule_error(
            burst_key,
            format!(
                "{burst} {unit} at {rate} {unit}/s take {} s to refill; at most 3600 s (one hour) is allowed: \
                 raise `{rate_key}` or lower `{burst_key}` to at most {}",
                refill_ns / u128::from(NS_PER_SEC),
                rate.saturating_mul(3600),
            ),
        ));
    }
    Ok(())
}

fn validate_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    if name.len() > MAX_NAME_LEN {
        return Err(format!(
            "is {} characters long; at most {MAX_NAME_LEN} are allowed",
            name.len()
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')))
    {
        return Err(format!(
            "{name:?} contains {c:?}; only letters, digits, '_', '.' and '-' are allowed"
        ));
    }
    Ok(())
}

fn validate_source(net: &IpNet) -> Result<(), String> {
    let network = net.trunc();
    if network != *net {
        return Err(format!(
            "{net} has host bits set; did you mean \"{network}\" (or \"{}/{}\" for the single address)?",
            net.addr(),
            net.max_prefix_len()
        ));
    }
    // The XDP program keys IPv4 packets as IPv4, so an IPv4-mapped IPv6 prefix would never match.
    let mapped =
        Ipv6Net::new(Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0, 0), 96).expect("valid prefix");
    if let IpNet::V6(v6) = net {
        if v6.prefix_len() >= 96 && mapped.contains(v6) {
            let v4 = v6.addr().to_ipv4_mapped().expect("inside ::ffff:0:0/96");
            return Err(format!(
                "{net} is an IPv4-mapped IPv6 prefix, which IPv4 packets never match; write \"{v4}/{}\"",
                v6.prefix_len() - 96
            ));
        }
    }
    Ok(())
}

/// Parses a rule's `source`: a CIDR, or a bare address meaning a single host.
fn parse_source(text: &str) -> Result<IpNet, String> {
    if let Ok(net) = text.parse::<IpNet>() {
        return Ok(net);
    }
    if let Ok(addr) = text.parse::<IpAddr>() {
        return Ok(IpNet::from(addr));
    }
    Err(format!(
        "{text:?} is not an IPv4 or IPv6 CIDR (such as \"10.0.0.0/8\" or \"2001:db8::/32\") or address"
    ))
}

/// Serialized form of a rule: the config file's keys, without those meaningless for its action.
#[derive(Serialize)]
struct RuleView<'a> {
    name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    source: Option<SourceView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    source_file: Option<&'a Path>,
    action: Action,
    #[serde(skip_serializing_if = "Option::is_none")]
    rate: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    burst: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bytes_rate: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bytes_burst: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    per: Option<Per>,
    protocol: Protocol,
    #[serde(skip_serializing_if = "Option::is_none")]
    dst_port: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    scope: Option<Scope>,
    dry_run: bool,
}

/// `source` as written: one CIDR, or an array of them.
#[derive(Serialize)]
#[serde(untagged)]
enum SourceView {
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
            scope: limit.then_some(self.scope),
            dry_run: self.dry_run,
        }
        .serialize(s)
    }
}

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
struct Where<'a>(&'a str, Option<&'a str>);

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
}

// ---------------------------------------------------------------------------------------------
// Raw (as written) form.

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    agent: Option<RawAgent>,
    #[serde(default, rename = "rule")]
    rules: Vec<Spanned<RawRule>>,
    cluster: Option<RawCluster>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAgent {
    interfaces: Option<Vec<Spanned<String>>>,
    mode: Option<AttachMode>,
    socket: Option<Spanned<PathBuf>>,
    metrics: Option<SocketAddr>,
    max_buckets: Option<Spanned<i64>>,
    pin_path: Option<Spanned<PathBuf>>,
    dry_run: Option<bool>,
    ebpf_log: Option<bool>,
    log_format: Option<crate::logging::LogFormat>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    listen: SocketAddr,
    seeds: Option<Vec<SocketAddr>>,
    key_file: Spanned<PathBuf>,
    sync_interval_ms: Option<Spanned<i64>>,
    cluster_id: Option<Spanned<String>>,
    max_keys: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: Spanned<String>,
    source: Option<Spanned<RawSource>>,
    source_file: Option<Spanned<PathBuf>>,
    action: Option<Spanned<Action>>,
    rate: Option<Spanned<i64>>,
    burst: Option<Spanned<i64>>,
    bytes_rate: Option<Spanned<i64>>,
    bytes_burst: Option<Spanned<i64>>,
    per: Option<Spanned<Per>>,
    protocol: Option<Spanned<Protocol>>,
    dst_port: Option<Spanned<i64>>,
    scope: Option<Spanned<Scope>>,
    dry_run: Option<Spanned<bool>>,
}

/// A rule's `source` as written: one CIDR or an array of them.
enum RawSource {
    One(String),
    Many(Vec<Spanned<String>>),
}

impl<'de> Deserialize<'de> for RawSource {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = RawSource;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a CIDR string or an array of CIDR strings")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<RawSource, E> {
                Ok(RawSource::One(s.to_owned()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<RawSource, A::Error> {
                let mut list = Vec::with_capacity(seq.size_hint().unwrap_or(0));
                while let Some(item) = seq.next_element::<Spanned<String>>()? {
                    list.push(item);
                }
                Ok(RawSource::Many(list))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// The text being parsed, for turning byte offsets into lines in error messages.
struct Source<'a> {
    origin: &'a str,
    text: &'a str,
    /// Directory relative `source_file` paths are resolved against.
    base: &'a Path,
}

impl Source<'_> {
    fn line(&self, offset: usize) -> usize {
        line_of(self.text, offset)
    }

    fn invalid(
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

fn line_of(text: &str, offset: usize) -> usize {
    let offset = offset.min(text.len());
    text.as_bytes()[..offset]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// Converts a non-negative TOML integer (TOML integers are i64) to u64.
fn non_negative(
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

/// The text of the config file at `path`.
fn read_text(path: &Path) -> Result<String, ConfigError> {
    // Checked first because reading a directory fails with a less helpful EISDIR.
    if path.is_dir() {
        return Err(ConfigError::IsDirectory {
            path: path.to_owned(),
        });
    }
    let bytes = std::fs::read(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    String::from_utf8(bytes).map_err(|e| {
        let valid = &e.as_bytes()[..e.utf8_error().valid_up_to()];
        ConfigError::NotUtf8 {
            line: valid.iter().filter(|&&b| b == b'\n').count() + 1,
            origin: path.display().to_string(),
        }
    })
}

/// The directory relative paths in the config file at `path` are resolved against.
fn base_dir(path: &Path) -> &Path {
    path.parent().unwrap_or(Path::new(""))
}

/// `path` as named in a config file in directory `base`.
fn resolve(base: &Path, path: &Path) -> PathBuf {
    if path.is_absolute() {
        path.to_owned()
    } else {
        base.join(path)
    }
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

    fn parse_in(text: &str, origin: &str, base: &Path) -> Result<Config, ConfigError> {
        let src = Source { origin, text, base };
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
        // (prefix, protocol, port) -> index of the rule that matches it.
        let mut matches: HashMap<(IpNet, Protocol, Option<u16>), usize> = HashMap::new();
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
                match matches.entry((net, rule.protocol, rule.dst_port)) {
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

/// Where a rule's source prefixes were written, parallel to [`RuleConfig::sources`], so that
/// errors about one prefix can point at it.
enum SourcesFrom {
    /// `source`: byte offsets of the key's value and of each prefix in the config text.
    Inline { key_offset: usize, at: Vec<usize> },
    /// `source_file`: offset of the key's value in the config text; the list file and the line
    /// of each prefix in it.
    List {
        key_offset: usize,
        path: PathBuf,
        lines: Vec<usize>,
    },
}

impl SourcesFrom {
    fn key(&self) -> &'static str {
        match self {
            SourcesFrom::Inline { .. } => "source",
            SourcesFrom::List { .. } => "source_file",
        }
    }

    fn key_offset(&self) -> usize {
        match self {
            SourcesFrom::Inline { key_offset, .. } | SourcesFrom::List { key_offset, .. } => {
                *key_offset
            }
        }
    }

    /// An error about the rule's `index`th prefix.
    fn error_at(
        &self,
        src: &Source,
        section: &str,
        rule: &str,
        index: usize,
        message: String,
    ) -> ConfigError {
        match self {
            SourcesFrom::Inline { at, .. } => src.invalid(at[index], section, "source", message),
            SourcesFrom::List {
                key_offset,
                path,
                lines,
            } => ConfigError::List {
                path: path.clone(),
                list_line: lines[index],
                message,
                rule: rule.to_owned(),
                origin: src.origin.to_owned(),
                line: src.line(*key_offset),
            },
        }
    }
}

/// Reads a `source_file`: one CIDR (or address) per line, `#` comments, blank lines ignored.
/// Returns the distinct prefixes in file order with their 1-based lines, or the line and the
/// message of the first bad entry.
fn read_list(path: &Path) -> Result<(Vec<IpNet>, Vec<usize>), ListError> {
    if std::fs::metadata(path).map_err(ListError::Io)?.is_dir() {
        return Err(ListError::Io(std::io::Error::new(
            std::io::ErrorKind::IsADirectory,
            "is a directory, expected a file with one CIDR per line",
        )));
    }
    let bytes = std::fs::read(path).map_err(ListError::Io)?;
    parse_list(&bytes).map_err(|(line, message)| ListError::At(line, message))
}

/// Parses the contents of a `source_file` list: one CIDR (or address) per line, `#` comments,
/// blank lines ignored. Returns the distinct prefixes in order with their 1-based lines, or the
/// line and the message of the first bad entry.
pub fn parse_list(bytes: &[u8]) -> Result<(Vec<IpNet>, Vec<usize>), (usize, String)> {
    let mut seen = HashSet::new();
    let (mut nets, mut lines) = (Vec::new(), Vec::new());
    for (i, line) in bytes.split(|&b| b == b'\n').enumerate() {
        let content = match line.iter().position(|&b| b == b'#') {
            Some(end) => &line[..end],
            None => line,
        };
        let text = std::str::from_utf8(content)
            .map_err(|_| (i + 1, "not valid UTF-8 text".to_owned()))?
            .trim();
        if text.is_empty() {
            continue;
        }
        let net = parse_source(text).map_err(|_| (i + 1, format!("invalid CIDR {text:?}")))?;
        validate_source(&net).map_err(|m| (i + 1, m))?;
        if seen.insert(net) {
            if nets.len() == MAX_RULE_PREFIXES {
                return Err((
                    i + 1,
                    format!(
                        "more than {MAX_RULE_PREFIXES} prefixes: one rule may list at most \
                         {MAX_RULE_PREFIXES}"
                    ),
                ));
            }
            nets.push(net);
            lines.push(i + 1);
        }
    }
    Ok((nets, lines))
}

enum ListError {
    Io(std::io::Error),
    At(usize, String),
}

fn rule_section(name: &str, index: usize) -> String {
    if name.is_empty() {
        format!("rule #{}", index + 1)
    } else {
        format!("rule {name:?}")
    }
}

fn agent_from_raw(src: &Source, raw: RawAgent) -> Result<AgentConfig, ConfigError> {
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
    Ok(agent)
}

/// Linux interface name rules (`dev_valid_name` in net/core/dev.c).
fn validate_ifname(name: &str) -> Result<(), String> {
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

fn cluster_from_raw(src: &Source, raw: RawCluster) -> Result<ClusterConfig, ConfigError> {
    const S: &str = "[cluster]";
    if raw.key_file.get_ref().as_os_str().is_empty() {
        return Err(src.invalid(
            raw.key_file.span().start,
            S,
            "key_file",
            "must not be empty",
        ));
    }
    let sync_interval_ms = match raw.sync_interval_ms {
        None => 100,
        Some(v) => {
            let n = *v.get_ref();
            if !(10..=10_000).contains(&n) {
                return Err(src.invalid(
                    v.span().start,
                    S,
                    "sync_interval_ms",
                    format!("must be between 10 and 10000 milliseconds (got {n})"),
                ));
            }
            n as u64
        }
    };
    let cluster_id = match raw.cluster_id {
        None => "ratelimit".to_owned(),
        Some(id) => {
            validate_name(id.get_ref())
                .map_err(|m| src.invalid(id.span().start, S, "cluster_id", m))?;
            id.into_inner()
        }
    };
    let max_keys = match raw.max_keys {
        None => crate::cluster::MAX_KEYS,
        Some(v) => {
            let n = *v.get_ref();
            if !(1..=100_000).contains(&n) {
                return Err(src.invalid(
                    v.span().start,
                    S,
                    "max_keys",
                    format!("must be between 1 and 100000 (got {n})"),
                ));
            }
            usize::try_from(n).expect("bounded above")
        }
    };
    Ok(ClusterConfig {
        listen: raw.listen,
        seeds: raw.seeds.unwrap_or_default(),
        key_file: raw.key_file.into_inner(),
        sync_interval_ms,
        cluster_id,
        max_keys,
    })
}

fn rule_from_raw(
    src: &Source,
    index: usize,
    raw: Spanned<RawRule>,
    has_cluster: bool,
) -> Result<(RuleConfig, SourcesFrom), ConfigError> {
    let table_offset = raw.span().start;
    let mut raw = raw.into_inner();
    let section = rule_section(raw.name.get_ref(), index);
    let (sources, from) =
        match (raw.source.take(), raw.source_file.take()) {
            (Some(_), Some(file)) => return Err(src.invalid(
                file.span().start,
                &section,
                "source_file",
                "cannot be combined with `source`: give the prefixes inline (`source`) or in a \
                 file (`source_file`), not both",
            )),
            (None, None) => {
                return Err(src.invalid(
                    table_offset,
                    &section,
                    "source",
                    "required, but missing: give `source` (a CIDR or an array of CIDRs) or \
                 `source_file` (a file with one CIDR per line)",
                ))
            }
            (Some(source), None) => inline_sources(src, &section, source)?,
            (None, Some(file)) => list_sources(src, &section, raw.name.get_ref(), file)?,
        };
    let mut rule = RuleConfig::with_sources(raw.name.get_ref().clone(), sources);
    if let SourcesFrom::List { path, .. } = &from {
        rule.source_file = Some(path.clone());
    }
    rule.line = src.line(table_offset);
    rule.action = raw.action.as_ref().map_or(Action::Limit, |a| *a.get_ref());

    // Where each key was written, so that errors found on the typed rule point at it.
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
            if rule.action != Action::Limit {
                let e = no_meaning(key, rule.action);
                return Err(src.invalid(span.start, &section, key, e.message));
            }
            offsets.insert(key, span.start);
        }
    }
    for (key, span) in [
        ("action", raw.action.as_ref().map(|v| v.span())),
        ("protocol", raw.protocol.as_ref().map(|v| v.span())),
        ("dst_port", raw.dst_port.as_ref().map(|v| v.span())),
    ] {
        if let Some(span) = span {
            offsets.insert(key, span.start);
        }
    }

    let number = |v: &Option<Spanned<i64>>, key| {
        v.as_ref()
            .map(|v| non_negative(src, v, &section, key))
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
                &section,
                "dst_port",
                format!("must be between 1 and 65535 (got {n})"),
            )
        })?;
        rule.dst_port = Some(p);
    }
    if let Some(scope) = raw.scope {
        if *scope.get_ref() == Scope::Cluster && !has_cluster {
            return Err(src.invalid(
                scope.span().start,
                &section,
                "scope",
                "scope = \"cluster\" needs a [cluster] table (the peers that share the budget); \
                 add one, or use scope = \"local\"",
            ));
        }
        rule.scope = scope.into_inner();
    }
    rule.dry_run = raw.dry_run.is_some_and(Spanned::into_inner);

    rule.validate().map_err(|e| {
        // A key that was not written (e.g. the missing `rate`) is reported at the table's line.
        let offset = offsets.get(e.field).copied().unwrap_or(table_offset);
        src.invalid(offset, &section, e.field, e.message)
    })?;
    Ok((rule, from))
}

/// The prefixes of an inline `source`, without duplicates.
fn inline_sources(
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

/// The prefixes of a `source_file`, without duplicates.
fn list_sources(
    src: &Source,
    section: &str,
    rule: &str,
    file: Spanned<PathBuf>,
) -> Result<(Vec<IpNet>, SourcesFrom), ConfigError> {
    let key_offset = file.span().start;
    if file.get_ref().as_os_str().is_empty() {
        return Err(src.invalid(key_offset, section, "source_file", "must not be empty"));
    }
    let path = resolve(src.base, file.get_ref());
    let (nets, lines) = read_list(&path).map_err(|e| match e {
        ListError::Io(source) => ConfigError::ListRead {
            path: path.clone(),
            rule: rule.to_owned(),
            origin: src.origin.to_owned(),
            line: src.line(key_offset),
            source,
        },
        ListError::At(list_line, message) => ConfigError::List {
            path: path.clone(),
            list_line,
            message,
            rule: rule.to_owned(),
            origin: src.origin.to_owned(),
            line: src.line(key_offset),
        },
    })?;
    Ok((
        nets,
        SourcesFrom::List {
            key_offset,
            path,
            lines,
        },
    ))
}

// ---------------------------------------------------------------------------------------------
// Writing rules back.

/// The keys of a `[[rule]]` table, in the order a new table gets them.
const RULE_KEYS: [&str; 13] = [
    "name",
    "source",
    "source_file",
    "action",
    "protocol",
    "dst_port",
    "rate",
    "burst",
    "bytes_rate",
    "bytes_burst",
    "per",
    "scope",
    "dry_run",
];

/// The default `bytes_burst` for `bytes_rate`: `max(bytes_rate, 65536)`, capped at one hour's
/// worth so that a tiny rate does not make its own default invalid.
fn default_bytes_burst(bytes_rate: Option<u64>) -> Option<u64> {
    bytes_rate.map(|r| {
        r.max(DEFAULT_BYTES_BURST_FLOOR)
            .min(r.saturating_mul(MAX_TOLERANCE_NS / NS_PER_SEC))
    })
}

fn int_value(n: u64) -> toml_edit::Value {
    // Validated values are far below i64::MAX; anything else fails the read-back check.
    i64::try_from(n).unwrap_or(i64::MAX).into()
}

/// `source` for `sources`: a string for one prefix, else an array (one prefix per line when
/// there are more than three).
fn sources_value(sources: &[IpNet]) -> toml_edit::Value {
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
fn wanted_value(rule: &RuleConfig, key: &str) -> Option<toml_edit::Value> {
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
fn written_as(rule: &RuleConfig, key: &str, item: &toml_edit::Item, base: &Path) -> bool {
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
fn written_sources(v: &toml_edit::Value) -> Option<Vec<IpNet>> {
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
fn new_rule_table(rule: &RuleConfig) -> toml_edit::Table {
    let mut table = toml_edit::Table::new();
    for key in RULE_KEYS {
        if let Some(v) = wanted_value(rule, key) {
            table.insert(key, toml_edit::Item::Value(v));
        }
    }
    table
}

/// Makes an existing `[[rule]]` table say `rule`, leaving the keys that already do (their
/// spelling, comments and order) alone. A changed value keeps the comment after it.
fn update_rule_table(table: &mut toml_edit::Table, rule: &RuleConfig, base: &Path) {
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
        .map_err(|e| syntax_error(&Source { origin, text, base }, &e))?;
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
fn read_back_difference(rules: &[RuleConfig], read: &[RuleConfig]) -> Option<String> {
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
fn write_atomically(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    use std::{
        io::Write,
        os::unix::fs::{MetadataExt, OpenOptionsExt},
    };
    let target = std::fs::canonicalize(path)?;
    let meta = std::fs::metadata(&target)?;
    let dir = base_dir(&target);
    let mut tmp_name = target
        .file_name()
        .ok_or_else(|| std::io::Error::other("not a file name"))?
        .to_owned();
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = dir.join(tmp_name);
    let written = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        file.write_all(contents)?;
        // The owner matters when root edits a file someone else owns; only root may change it.
        let _ = std::os::unix::fs::fchown(&file, Some(meta.uid()), Some(meta.gid()));
        file.set_permissions(meta.permissions())?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&tmp, &target)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    std::fs::File::open(dir)?.sync_all()
}

// ---------------------------------------------------------------------------------------------
// Locating TOML errors.

fn syntax_error(src: &Source, e: &toml_edit::TomlError) -> ConfigError {
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

fn one_line(message: &str) -> String {
    message
        .trim()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

#[derive(Debug)]
enum Seg {
    Key(String),
    Index(usize),
}

fn schema_error(src: &Source, root: &toml_edit::Table, e: &toml_edit::de::Error) -> ConfigError {
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
            (rule_section(name, *i), key(2))
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

fn contains(span: Option<Range<usize>>, offset: usize) -> bool {
    // Empty spans (end of input) still claim their start.
    span.is_some_and(|s| s.start <= offset && offset < s.end.max(s.start + 1))
}

/// Finds the path of keys/indices to the deepest item whose key or value span contains `offset`.
/// Tables are searched whole because a `[table]`'s span covers only its header.
fn locate_in_table(table: &toml_edit::Table, offset: usize, path: &mut Vec<Seg>) -> bool {
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

fn locate_in_item(item: &toml_edit::Item, offset: usize, path: &mut Vec<Seg>) -> bool {
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

fn locate_in_value(value: &toml_edit::Value, offset: usize, path: &mut Vec<Seg>) -> bool {
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

#[cfg(test)]
mod tests;
