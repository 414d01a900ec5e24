//! What the agent shows of itself: `status` (interfaces, rules, buckets, reloads) and `explain`
//! (which rule a packet falls under, why, and its bucket). Read under the agent's lock, and cheap:
//! a few system calls, never a walk of the bucket store (the bucket count comes from the census,
//! [`crate::census`], read before the lock is taken). The cluster's part of `status` is added by
//! the control API, which holds the cluster handle.

use std::net::IpAddr;

use ratelimit_common::global;
use serde::Serialize;

use super::{Agent, AgentError, ReloadState};
use crate::{
    census::{CensusAge, Reading},
    compile::{CompiledPrefix, CompiledRule},
    config::RuleConfig,
    maps::bucket::{bucket_key, key_source, limit_bucket_key, monotonic_ns, BucketView},
};

impl Agent {
    /// What `ratelimit status` shows, with the bucket count of `census`.
    pub fn status(&self, census: &Reading) -> Result<Status, AgentError> {
        let maps = self.dp.maps();
        let generation = maps.config()?.generation;
        Ok(Status {
            version: env!("CARGO_PKG_VERSION"),
            pid: std::process::id(),
            uptime_secs: self.started.elapsed().as_secs(),
            config: self.opts.config_path.display().to_string(),
            pin_path: self.config.agent.pin_path.display().to_string(),
            socket: self.config.agent.socket.display().to_string(),
            interfaces: self.interface_status(),
            rules: self.set.rules.len(),
            prefixes: self.set.prefixes.len(),
            generation,
            dry_run: self.config.agent.dry_run,
            buckets_tracked: census.tracked,
            buckets_census: CensusAge::from(census),
            buckets_capacity: u64::from(maps.bucket_capacity()?),
            buckets_evicted: {
                let g = maps.global_stats()?;
                Evictions {
                    full: g.counters[global::EVICTED_FULL],
                    lost: g.counters[global::EVICTED_LOST],
                }
            },
            reloads: self.reload.clone(),
        })
    }

    /// The attached interfaces, and the configured ones that are missing.
    fn interface_status(&self) -> Vec<InterfaceStatus> {
        let state = |iface: &str| {
            if self.missing.contains(iface) {
                "missing"
            } else {
                "attached"
            }
        };
        let mut out: Vec<InterfaceStatus> = self
            .dp
            .attachments()
            .iter()
            .map(|a| InterfaceStatus {
                iface: a.iface.clone(),
                mode: a.mode.to_string(),
                state: state(&a.iface),
            })
            .collect();
        for iface in &self.missing {
            if !out.iter().any(|i| &i.iface == iface) {
                out.push(InterfaceStatus {
                    iface: iface.clone(),
                    mode: "-".to_string(),
                    state: "missing",
                });
            }
        }
        out
    }

    /// What happens to packets from `ip` whose protocol and port the program cannot know.
    fn cut_packets(&self, ip: IpAddr) -> CutPackets {
        use crate::compile::WithoutL4;
        let (verdict, rule) = match self.set.classify_without_l4(ip) {
            WithoutL4::Dependent => ("dropped", None),
            WithoutL4::NoRule => ("passed", None),
            WithoutL4::Rule(r) => ("rule", Some(r.name.clone())),
        };
        CutPackets {
            verdict,
            rule,
            why: match verdict {
                "dropped" => {
                    "a rule for this source looks at the protocol or port, which such a \
                              packet hides: tiny first fragments (and their datagrams), fragments \
                              whose first fragment was not seen and IPv6 chains of more than 8 \
                              extension headers are dropped (dropped_tiny_fragments, \
                              dropped_unmatched_fragments, dropped_long_chains)"
                }
                "passed" => "no rule's source prefix contains this address",
                _ => {
                    "no rule for this source looks at the protocol or port: such packets fall \
                      under its first rule"
                }
            }
            .to_string(),
        }
    }

    /// Which rule a packet from `ip` (with `protocol`/`dst_port`/`tcp_flags`) falls under, why,
    /// and its bucket. Without `tcp_flags`, a TCP packet is taken to carry none (which no flag
    /// rule matches).
    pub fn explain(
        &self,
        ip: IpAddr,
        protocol: u8,
        dst_port: Option<u16>,
        tcp_flags: Option<u8>,
    ) -> Result<Explain, AgentError> {
        let prefix = self.set.lookup(ip);
        let candidates = self.candidate_names(prefix);
        let cut = self.cut_packets(ip);
        let flags = tcp_flags.unwrap_or(0);
        let Some(rule) = self.set.classify(ip, protocol, dst_port, flags) else {
            let why = why_no_rule(prefix, &candidates, protocol, dst_port, flags);
            return Ok(Explain {
                ip,
                protocol,
                dst_port,
                tcp_flags,
                rule: None,
                prefix: prefix.map(|p| p.net().to_string()),
                candidates,
                why,
                bucket: None,
                limits: Vec::new(),
                cut,
            });
        };
        let net = prefix.map(|p| p.net().to_string());
        let config = self
            .config
            .rules
            .iter()
            .find(|r| r.name == rule.name)
            .cloned();
        let passed_over = self.passed_over(prefix, rule, protocol, dst_port);
        let flags_why = flags_why(config.as_ref(), flags, &passed_over);
        let why = format!(
            "longest matching prefix {} ; candidates in order [{}] ; first matching protocol/port/flags: {:?}{flags_why}",
            net.as_deref().unwrap_or("?"),
            candidates.join(", "),
            rule.name
        );
        let key = bucket_key(rule.id, &rule.rule, ip);
        let bucket = self
            .dp
            .maps()
            .bucket(&key)?
            .map(|b| BucketView::new(&b, &rule.rule, monotonic_ns()));
        let limits = self.explain_limits(rule, ip)?;
        Ok(Explain {
            ip,
            protocol,
            dst_port,
            tcp_flags,
            rule: Some(ExplainRule {
                name: rule.name.clone(),
                id: rule.id,
                line: rule.line,
                config,
            }),
            prefix: net,
            candidates,
            why,
            bucket,
            limits,
            cut,
        })
    }

    /// The names of the rules listed for `prefix`, in the order they are tried.
    fn candidate_names(&self, prefix: Option<&CompiledPrefix>) -> Vec<String> {
        prefix
            .map(|p| {
                p.candidates()
                    .iter()
                    .filter_map(|&id| self.set.rule(id))
                    .map(|r| r.name.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The flag rules of `prefix` tried before `rule`, the one that matched, which this packet's
    /// flags did not fit.
    fn passed_over<'a>(
        &'a self,
        prefix: Option<&'a CompiledPrefix>,
        rule: &CompiledRule,
        protocol: u8,
        dst_port: Option<u16>,
    ) -> Vec<&'a str> {
        prefix
            .map(|p| {
                p.candidates()
                    .iter()
                    .filter_map(|&id| self.set.rule(id))
                    .take_while(|r| r.id != rule.id)
                    .filter(|r| {
                        r.rule.tcp_mask != 0
                            && r.rule.protocol == protocol
                            && (r.rule.dst_port == 0 || dst_port == Some(r.rule.dst_port))
                    })
                    .map(|r| r.name.as_str())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Every limit of a limit rule, in order, with the bucket the packets from `ip` are charged
    /// to under it; none for another action.
    fn explain_limits(
        &self,
        rule: &CompiledRule,
        ip: IpAddr,
    ) -> Result<Vec<ExplainLimit>, AgentError> {
        let mut limits = Vec::new();
        if rule.rule.action == ratelimit_common::action::LIMIT {
            for k in 0..rule.rule.limits() {
                let mask = rule.rule.limit(k).unwrap_or_default().src_mask;
                let key = limit_bucket_key(rule.id, &rule.rule, k, ip);
                limits.push(ExplainLimit {
                    limit: k + 1,
                    per: crate::stats::per_of(&mask),
                    key: key_source(&key, &mask),
                    bucket: self
                        .dp
                        .maps()
                        .bucket(&key)?
                        .map(|b| BucketView::new(&b, &rule.rule, monotonic_ns())),
                });
            }
        }
        Ok(limits)
    }
}

/// Why a packet that no rule matches passes: no rule's prefix holds its source, or none of the
/// rules of the longest prefix that does (`candidates`) matches its protocol, port and flags.
fn why_no_rule(
    prefix: Option<&CompiledPrefix>,
    candidates: &[String],
    protocol: u8,
    dst_port: Option<u16>,
    flags: u8,
) -> String {
    match prefix {
        None => "no rule's source prefix contains this address: the packet passes".to_string(),
        Some(p) => format!(
            "the longest matching prefix {} has rules [{}], none of which matches protocol {protocol} port {}{}: the packet passes",
            p.net(),
            candidates.join(", "),
            dst_port.map_or_else(|| "-".to_string(), |p| p.to_string()),
            if protocol == 6 { format!(" tcp flags {}", flag_names(flags)) } else { String::new() }
        ),
    }
}

/// The part of `explain`'s answer that says how the packet's TCP `flags` chose the rule: the
/// flags the rule (`config`) matches, or the flag rules tried before it that they did not fit.
fn flags_why(config: Option<&RuleConfig>, flags: u8, passed_over: &[&str]) -> String {
    match config.and_then(|c| c.tcp_flags) {
        Some(f) => format!(
            " ; it matches TCP flags {} ({f}: {}) before the same prefix's rules without flags",
            flag_names(flags),
            f.describe()
        ),
        None if !passed_over.is_empty() => format!(
            " ; TCP flags {} do not fit the flag rule(s) [{}] tried before it",
            flag_names(flags),
            passed_over.join(", ")
        ),
        None => String::new(),
    }
}

/// Buckets whose record a new source took (the program's own counters).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Evictions {
    /// The bucket had refilled: nothing lost.
    pub full: u64,
    /// The bucket had not refilled: its source starts full again if it comes back.
    pub lost: u64,
}

/// `status` output.
#[derive(Clone, Debug, Serialize)]
pub struct Status {
    /// Agent version.
    pub version: &'static str,
    /// Agent process id.
    pub pid: u32,
    /// Seconds since the agent started.
    pub uptime_secs: u64,
    /// Config file.
    pub config: String,
    /// Pin directory.
    pub pin_path: String,
    /// Control socket.
    pub socket: String,
    /// Attached interfaces.
    pub interfaces: Vec<InterfaceStatus>,
    /// Rules in force.
    pub rules: usize,
    /// Distinct source prefixes in force.
    pub prefixes: usize,
    /// Rule-set epoch: counts installs; its low bit is the prefix-trie half in force.
    pub generation: u32,
    /// Whole-agent dry run.
    pub dry_run: bool,
    /// Buckets tracked, as the latest census counted them.
    pub buckets_tracked: u64,
    /// How old that count is.
    pub buckets_census: CensusAge,
    /// Bucket capacity.
    pub buckets_capacity: u64,
    /// Buckets evicted for new sources, by what the eviction lost.
    pub buckets_evicted: Evictions,
    /// Reload bookkeeping.
    pub reloads: ReloadState,
}

/// One attached interface.
#[derive(Clone, Debug, Serialize)]
pub struct InterfaceStatus {
    /// Interface name.
    pub iface: String,
    /// native, skb or adopted ("-" while missing and not attached).
    pub mode: String,
    /// `attached`, or `missing`: the interface was deleted (the program went with it) and is
    /// attached again when an interface of that name appears.
    pub state: &'static str,
}

/// `explain` output.
#[derive(Clone, Debug, Serialize)]
pub struct Explain {
    /// The address asked about.
    pub ip: IpAddr,
    /// IP protocol number asked about (0: unspecified).
    pub protocol: u8,
    /// Destination port asked about.
    pub dst_port: Option<u16>,
    /// TCP flags byte asked about (`None`: not given, explained as no flag set).
    pub tcp_flags: Option<u8>,
    /// The matching rule, if any.
    pub rule: Option<ExplainRule>,
    /// The longest rule prefix containing the address.
    pub prefix: Option<String>,
    /// Rules listed for that prefix, in the order they are tried.
    pub candidates: Vec<String>,
    /// The decision in words.
    pub why: String,
    /// The source's bucket (of the rule's first limit), if one is tracked.
    pub bucket: Option<BucketView>,
    /// Every limit of the rule (limit rules), in order, with the bucket the source's packets
    /// are charged to under it.
    pub limits: Vec<ExplainLimit>,
    /// What happens to the source's packets that hide their protocol or port (tiny first
    /// fragments, over-long IPv6 header chains). Fragments other than the first follow their
    /// datagram's first fragment.
    pub cut: CutPackets,
}

/// One limit of the rule `explain` found, and the source's bucket under it.
#[derive(Clone, Debug, Serialize)]
pub struct ExplainLimit {
    /// 1: the rule's own limit; 2..: its `[[rule.limit]]`s in order.
    pub limit: usize,
    /// The limit's `per` (`source`, `/24`, `rule`).
    pub per: String,
    /// The bucket's key: the source masked to the limit's `per`, as a prefix.
    pub key: String,
    /// The bucket, if tracked (none: a full bucket).
    pub bucket: Option<BucketView>,
}

/// `explain`'s account of a source's packets whose protocol and port cannot be known.
#[derive(Clone, Debug, Serialize)]
pub struct CutPackets {
    /// `dropped`, `passed` (no rule), or `rule` (classified by [`CutPackets::rule`]).
    pub verdict: &'static str,
    /// The rule that applies when `verdict` is `rule`.
    pub rule: Option<String>,
    /// Why, in words.
    pub why: String,
}

/// The rule `explain` found.
#[derive(Clone, Debug, Serialize)]
pub struct ExplainRule {
    /// Rule name.
    pub name: String,
    /// Rule id.
    pub id: u32,
    /// Config line.
    pub line: usize,
    /// The rule's settings.
    pub config: Option<RuleConfig>,
}

/// A TCP flags byte as names (`SYN+ACK`), or `none`.
pub fn flag_names(flags: u8) -> String {
    const NAMES: [&str; 8] = ["FIN", "SYN", "RST", "PSH", "ACK", "URG", "ECE", "CWR"];
    let names: Vec<&str> = NAMES
        .iter()
        .enumerate()
        .filter(|&(bit, _)| flags & (1 << bit) != 0)
        .map(|(_, n)| *n)
        .collect();
    if names.is_empty() {
        "none".to_string()
    } else {
        names.join("+")
    }
}
