//! The local limits a peer's keys are charged to: the cluster-scoped ones, by rule name and
//! limit index.

use std::collections::HashMap;

use crate::cluster::publish::KeyName;

/// The local limit a remote key is charged to (one limit of a rule: its own or a
/// `[[rule.limit]]`), as far as rates go.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Nanoseconds of TAT per packet (0: no packet limit).
    pub pkt_interval_ns: u64,
    /// Packet tolerance, ns.
    pub pkt_tolerance_ns: u64,
    /// Nanoseconds of TAT per byte, 48.16 fixed point (0: no byte limit).
    pub byte_interval_fp: u64,
    /// Byte tolerance, ns.
    pub byte_tolerance_ns: u64,
}

impl Limits {
    /// The rates of limit `l` (a zero interval for a rate the limit does not set); a rule's limit
    /// `k` is [`ratelimit_common::Rule::limit`]`(k)`.
    #[must_use]
    pub fn of(l: &ratelimit_common::Limit) -> Self {
        use ratelimit_common::rule_flags;
        let pkt = l.flags & rule_flags::PKT_LIMIT != 0;
        let byte = l.flags & rule_flags::BYTE_LIMIT != 0;
        Self {
            pkt_interval_ns: if pkt { l.pkt_interval_ns } else { 0 },
            pkt_tolerance_ns: l.pkt_tolerance_ns,
            byte_interval_fp: if byte { l.byte_interval_fp } else { 0 },
            byte_tolerance_ns: l.byte_tolerance_ns,
        }
    }
}

/// The cluster-scoped limits here, by rule name and limit index: the keys a peer's consumption is
/// charged to. A key of a rule, or of a limit of it, that is not cluster-scoped here is not
/// charged.
#[derive(Clone, Debug, Default)]
pub struct ClusterLimits(HashMap<String, [Option<Limits>; ratelimit_common::MAX_LIMITS]>);

impl ClusterLimits {
    /// Marks limit `limit` of rule `rule` cluster-scoped, with rates `l` (an index past
    /// [`ratelimit_common::MAX_LIMITS`] is ignored).
    pub fn insert(&mut self, rule: &str, limit: u8, l: Limits) {
        if let Some(slot) = self
            .0
            .entry(rule.to_string())
            .or_default()
            .get_mut(usize::from(limit))
        {
            *slot = Some(l);
        }
    }

    /// [`ClusterLimits::insert`], chained.
    #[must_use]
    pub fn with(mut self, rule: &str, limit: u8, l: Limits) -> Self {
        self.insert(rule, limit, l);
        self
    }

    /// The limit `name` is charged to, if it is cluster-scoped here.
    #[must_use]
    pub fn get(&self, name: &KeyName) -> Option<&Limits> {
        self.0
            .get(&name.rule)?
            .get(usize::from(name.limit))?
            .as_ref()
    }

    /// Whether no limit is cluster-scoped here.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.0.values().all(|l| l.iter().all(Option::is_none))
    }
}
