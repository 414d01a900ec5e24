//! The config as the agent uses it: [`Config`] with its `[agent]`, `[cluster]` and `[[rule]]`
//! tables, the limits and defaults of every setting, and the checks of one rule
//! ([`RuleConfig::validate`]) that rules from a file and from the control API both go through.

use std::{
    fmt,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    str::FromStr,
};

use ipnet::{IpNet, Ipv6Net};
use serde::{Deserialize, Serialize};

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

/// Default of `[cluster] max_keys`: most keys each agent publishes, and reads from each peer, per
/// sync, the heaviest first. Bounds message size, memory and CPU however many sources there are.
pub const MAX_KEYS: usize = 1000;

pub(super) const NS_PER_SEC: u64 = 1_000_000_000;

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
    /// What a part of the cluster enforces while it cannot hear the rest.
    pub on_partition: OnPartition,
    /// Under `share`, how long a host no longer heard still counts among the hosts last known
    /// alive, in seconds (1..=86400, default 600).
    pub partition_memory_s: u64,
}

/// Default of `[cluster] partition_memory_s`: ten minutes, as long as the gossip library keeps a
/// dead member's state.
pub const DEFAULT_PARTITION_MEMORY_S: u64 = 600;

/// `[cluster] on_partition`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnPartition {
    /// Each side of a partition enforces the whole budget on its own.
    #[default]
    FailOpen,
    /// Each side enforces `budget x hosts it hears / hosts last known alive`.
    Share,
}

impl OnPartition {
    /// The spelling in the config file and the status.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::FailOpen => "fail_open",
            Self::Share => "share",
        }
    }
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

/// The TCP flag set a `protocol = "tcp"` rule matches (`tcp_flags`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum TcpFlags {
    /// SYN set and ACK clear: a connection attempt (not the server's SYN-ACK).
    #[default]
    Syn,
}

impl TcpFlags {
    /// The flag bits the set looks at and the values they must have, as the XDP program
    /// compares them (`flags & mask == value`; see `ratelimit_common::tcp_flags`).
    pub const fn mask_value(self) -> (u8, u8) {
        use ratelimit_common::tcp_flags::{ACK, SYN};
        match self {
            Self::Syn => (SYN | ACK, SYN),
        }
    }

    /// In words, for `explain`.
    pub const fn describe(self) -> &'static str {
        match self {
            Self::Syn => "SYN set, ACK clear",
        }
    }
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
keyword_enum!(TcpFlags, "tcp_flags", Syn => "syn");

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

    /// Checks the limit alone, for a rule whose sources are of families `(v4, v6)`. The error
    /// names the limit's own key (`rate`, `per`...).
    pub fn validate(&self, families: (bool, bool)) -> Result<(), RuleError> {
        check_rates(
            (self.rate, self.burst),
            (self.bytes_rate, self.bytes_burst),
            "a limit",
        )?;
        check_per(self.per, families)
    }
}

/// Checks `per = "/N"` against the rule's source families.
fn check_per(per: Per, families: (bool, bool)) -> Result<(), RuleError> {
    if let Per::Prefix(len) = per {
        let (width, family) = match families {
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

/// Why a [`RuleConfig`] is invalid: the key at fault and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("field `{field}`: {message}")]
pub struct RuleError {
    /// The config key at fault.
    pub field: &'static str,
    /// What is wrong, for a human.
    pub message: String,
}

pub(super) fn rule_error(field: &'static str, message: impl Into<String>) -> RuleError {
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
            tcp_flags: None,
            scope: Scope::Local,
            dry_run: false,
            limits: Vec::new(),
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
        if self.tcp_flags.is_some() && self.protocol != Protocol::Tcp {
            return Err(rule_error(
                "tcp_flags",
                format!(
                    "only valid with protocol tcp (this rule has protocol {})",
                    self.protocol
                ),
            ));
        }
        if self.action != Action::Limit {
            let stray = [
                ("rate", self.rate.is_some()),
                ("burst", self.burst.is_some()),
                ("bytes_rate", self.bytes_rate.is_some()),
                ("bytes_burst", self.bytes_burst.is_some()),
                ("per", self.per != Per::Source),
                ("scope", self.scope != Scope::Local),
                ("limit", !self.limits.is_empty()),
            ];
            if let Some((field, _)) = stray.iter().find(|(_, set)| *set) {
                return Err(no_meaning(field, self.action));
            }
            return Ok(());
        }
        check_rates(
            (self.rate, self.burst),
            (self.bytes_rate, self.bytes_burst),
            "a limit rule",
        )?;
        check_per(self.per, self.families())?;
        if self.limits.len() > MAX_EXTRA_LIMITS {
            return Err(rule_error(
                "limit",
                format!(
                    "{} `[[rule.limit]]` tables; a rule may have at most {} limits, its own and \
                     {MAX_EXTRA_LIMITS} more",
                    self.limits.len(),
                    MAX_EXTRA_LIMITS + 1
                ),
            ));
        }
        for (i, l) in self.limits.iter().enumerate() {
            l.validate(self.families()).map_err(|e| {
                rule_error(
                    "limit",
                    format!(
                        "limit {} ([[rule.limit]] #{}{}): `{}` {}",
                        i + 2,
                        i + 1,
                        if l.line > 0 {
                            format!(", line {}", l.line)
                        } else {
                            String::new()
                        },
                        e.field,
                        e.message
                    ),
                )
            })?;
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

/// Checks a limit's packet and byte pairs, `(rate, burst)` and `(bytes_rate, bytes_burst)`: at
/// least one rate, each pair in its bounds. `what` names the limit in the error ("a limit rule",
/// "a limit").
fn check_rates(
    (rate, burst): (Option<u64>, Option<u64>),
    (bytes_rate, bytes_burst): (Option<u64>, Option<u64>),
    what: &str,
) -> Result<(), RuleError> {
    if rate.is_none() && bytes_rate.is_none() {
        return Err(rule_error(
            "rate",
            format!("{what} needs `rate` (packets/s) or `bytes_rate` (bytes/s), or both"),
        ));
    }
    check_limit(
        ("rate", rate),
        ("burst", burst),
        (1, MAX_RATE, 1),
        "packets",
    )?;
    check_limit(
        ("bytes_rate", bytes_rate),
        ("bytes_burst", bytes_burst),
        (1, MAX_BYTES_RATE, MIN_BYTES_BURST),
        "bytes",
    )
}

/// Checks one rate/burst pair. `bounds` is (min rate, max rate, min burst).
pub(super) fn check_limit(
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

pub(super) fn validate_name(name: &str) -> Result<(), String> {
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

pub(super) fn validate_source(net: &IpNet) -> Result<(), String> {
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
pub(super) fn parse_source(text: &str) -> Result<IpNet, String> {
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
