//! [`CompileError`]: why a rule set cannot be compiled, each message naming the rules involved
//! and their config lines. Its own room because every stage of the compiler returns it.

use std::fmt;

use ipnet::IpNet;
use ratelimit_common::{MAX_CANDIDATES, MAX_PREFIXES, MAX_RULES};

use crate::config::{Protocol, RuleError, TcpFlags};

/// Why a rule set cannot be compiled. Messages name the rules involved and their config lines.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompileError {
    /// A rule fails [`RuleConfig::validate`](crate::config::RuleConfig::validate) (only possible
    /// for rules not parsed from a file).
    #[error("rule {name:?}{}: {error}", Line(*line))]
    InvalidRule {
        /// Rule name.
        name: String,
        /// Its config line.
        line: usize,
        /// What is wrong.
        #[source]
        error: RuleError,
    },
    /// Two rules have the same name.
    #[error(
        "rule {name:?}{}: duplicate name{}",
        Line(*line),
        if *first_line > 0 { format!(" (first used at line {first_line})") } else { String::new() }
    )]
    DuplicateName {
        /// The name.
        name: String,
        /// Line of the first rule with the name.
        first_line: usize,
        /// Line of the second.
        line: usize,
    },
    /// Two rules have the same source, protocol, port and TCP flags, so one of them could never
    /// apply.
    #[error(
        "rules {first:?}{} and {second:?}{} both match source {prefix}, protocol {protocol}{}{}: \
         one of them would never apply",
        Line(*first_line), Line(*second_line), dst_port.map(|p| format!(", dst_port {p}")).unwrap_or_default(),
        tcp_flags.map(|f| format!(", tcp_flags {f}")).unwrap_or_default()
    )]
    Conflict {
        /// First rule's name.
        first: String,
        /// First rule's line.
        first_line: usize,
        /// Second rule's name.
        second: String,
        /// Second rule's line.
        second_line: usize,
        /// The shared source prefix.
        prefix: IpNet,
        /// The shared protocol.
        protocol: Protocol,
        /// The shared port.
        dst_port: Option<u16>,
        /// The shared TCP flags.
        tcp_flags: Option<TcpFlags>,
    },
    /// A prefix would list more candidate rules than the XDP program scans.
    #[error(
        "sources in {prefix} could match {} rules, more than the {MAX_CANDIDATES} the XDP program \
         can try per packet: {}; give these rules fewer distinct protocol/port combinations",
        rules.len(), rules.iter().map(|(n, l)| format!("{n:?}{}", Line(*l))).collect::<Vec<_>>().join(", ")
    )]
    TooManyCandidates {
        /// The prefix.
        prefix: IpNet,
        /// Names and lines of the rules it would list, in precedence order.
        rules: Vec<(String, usize)>,
    },
    /// More distinct prefixes than one generation's half of the prefix trie holds.
    #[error(
        "{count} distinct source prefixes: at most {} fit (the trie holds two rule sets during a swap)",
        MAX_PREFIXES / 2
    )]
    TooManyPrefixes {
        /// Number of distinct prefixes.
        count: usize,
    },
    /// More rules than rule ids.
    #[error("{count} rules: at most {MAX_RULES} are supported")]
    TooManyRules {
        /// Number of rules.
        count: usize,
    },
    /// Not enough ids are free for the new and changed rules while the installed rules keep
    /// theirs until the swap.
    #[error(
        "{needed} new or changed rules need fresh ids but only {available} are free while the \
         {installed} installed rules keep theirs until the swap; apply the change in smaller steps"
    )]
    OutOfIds {
        /// Fresh ids needed.
        needed: usize,
        /// Fresh ids available.
        available: usize,
        /// Rules currently installed.
        installed: usize,
    },
    /// The installed rules given to [`RuleIds::from_installed`](super::RuleIds::from_installed)
    /// are inconsistent.
    #[error("installed rule {name:?} (id {id}): {reason}")]
    BadInstalled {
        /// Rule name.
        name: String,
        /// Its id.
        id: u32,
        /// What is wrong.
        reason: String,
    },
    /// [`RuleIds::commit`](super::RuleIds::commit) got a rule set compiled against an older
    /// state of the ids.
    #[error("the rule set was compiled before the last commit of rule ids; compile it again")]
    StaleCompile,
}

/// Formats " (line N)", or nothing for rules that did not come from a file.
struct Line(usize);

impl fmt::Display for Line {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            0 => Ok(()),
            n => write!(f, " (line {n})"),
        }
    }
}
