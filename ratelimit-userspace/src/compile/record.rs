//! One rule's kernel record ([`rule_record`]): action, match fields and the limits' masks,
//! intervals, tolerances and flags. Its own room because it is the one place that turns config
//! units (packets/s, bytes, `per`) into what the XDP program computes with.

use ratelimit_common::{action, rule_flags, Limit, Rule};

use super::mask;
use crate::config::{Action, Per, Protocol, RuleConfig, Scope, MIN_BYTES_BURST};

const NS_PER_SEC: u128 = 1_000_000_000;
/// The shortest tolerance a rule on the coarse clock may have: 20 ms, five ticks at HZ=250.
/// Below it, nearly every charge would be within the lag the program allows that clock
/// (`ratelimit_common::COARSE_LAG_TICKS` ticks) of a full or an empty bucket, where the program
/// reads the precise clock anyway. A matter of cost only: a charge is exact on either clock.
const COARSE_CLOCK_MIN_TOLERANCE_NS: u64 = 20_000_000;

/// The IP protocol number of `protocol` for a rule whose sources are all IPv6 (`v6_only`) or
/// not (validation keeps `icmp` rules to one family).
fn ip_protocol(protocol: Protocol, v6_only: bool) -> u8 {
    match (protocol, v6_only) {
        (Protocol::Tcp, _) => 6,
        (Protocol::Udp, _) => 17,
        (Protocol::Icmp, false) => 1,
        (Protocol::Icmp, true) => 58,
        (Protocol::Any, _) => 0,
    }
}

/// The kernel record of a valid rule.
pub fn rule_record(r: &RuleConfig) -> Rule {
    let (has_v4, has_v6) = r.families();
    let mut rule = Rule {
        action: match r.action {
            Action::Limit => action::LIMIT,
            Action::Allow => action::ALLOW,
            Action::Deny => action::DENY,
        },
        protocol: ip_protocol(r.protocol, has_v6 && !has_v4),
        dst_port: r.dst_port.unwrap_or(0),
        flags: if r.dry_run { rule_flags::DRY_RUN } else { 0 },
        ..Rule::default()
    };
    if let Some(f) = r.tcp_flags {
        (rule.tcp_mask, rule.tcp_flags) = f.mask_value();
    }
    if r.action != Action::Limit {
        return rule;
    }
    let (first, mut coarse) = limit_record(
        (r.per, r.scope),
        (r.rate, r.burst),
        (r.bytes_rate, r.bytes_burst),
        has_v6,
    );
    let mut only = coarse_only(&first);
    rule.set_limit(0, first);
    for (k, l) in r.limits.iter().enumerate() {
        let (mut limit, c) = limit_record(
            (l.per, l.scope),
            (l.rate, l.burst),
            (l.bytes_rate, l.bytes_burst),
            has_v6,
        );
        // The rule's own limit only: the extra limits' path (`one_limit`, a BPF call of its own)
        // has no stack left for the first-packet slots' look (ratelimit-ebpf/CONSTRAINTS.md,
        // "Stack"), so their keys make buckets at their first packet.
        limit.flags &= !rule_flags::FIRST_FREE;
        coarse &= c;
        only &= coarse_only(&limit);
        rule.set_limit(k + 1, limit);
    }
    if coarse {
        let mut clock = rule_flags::COARSE_CLOCK;
        if only {
            clock |= rule_flags::COARSE_ONLY;
        }
        rule.flags |= clock;
        for l in &mut rule.extra[..r.limits.len()] {
            l.flags |= clock;
        }
        if !only {
            for k in 0..rule.limits() {
                if let Some(mut l) = rule.limit(k).filter(born_coarse) {
                    l.flags |= rule_flags::BORN_COARSE;
                    rule.set_limit(k, l);
                }
            }
        }
        let per_source = r.per == Per::Source && r.limits.iter().all(|l| l.per == Per::Source);
        if per_source && (0..rule.limits()).all(|k| rule.limit(k).is_some_and(|l| holds_window(&l)))
        {
            rule.flags |= rule_flags::HOLD_WINDOW;
        }
    }
    // A `per = "rule"` packet limit gates the others: while its one bucket is empty, the program
    // drops the rule's packets from a per-CPU window before charging any other limit (a flood of
    // new sources then makes no bucket per source).
    let gate = (0..rule.limits()).find(|&k| {
        rule.limit(k)
            .is_some_and(|l| l.src_mask == [0; 4] && l.flags & rule_flags::PKT_LIMIT != 0)
    });
    if let Some(k) = gate {
        rule.flags |= rule_flags::gate(k as u32);
        // Its window held on the coarse clock as a source's is (`holds_window`): one bucket for
        // the whole rule, so every source of it waits alike.
        if coarse && rule.limit(k).is_some_and(|l| holds_window(&l)) {
            rule.flags |= rule_flags::HOLD_GATE;
        }
    }
    rule
}

/// The running kernel's coarse-clock lag allowance, as the loader gives it to the program
/// (`dataplane::attach`): the same tick, read once.
pub fn coarse_lag_ns() -> u64 {
    static LAG: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *LAG.get_or_init(|| ratelimit_common::coarse_lag_ns(crate::maps::bucket::coarse_tick_ns()))
}

/// Whether `l`'s packet and byte limits may run on the coarse clock alone
/// (`ratelimit_common::coarse_only`). A byte limit is counted in full Ethernet frames: a burst
/// of frames loses whole ones, so its burst must hold 100 times the frames the lag refills.
fn coarse_only(l: &Limit) -> bool {
    let lag = coarse_lag_ns();
    let frame_ns = (u128::from(MIN_BYTES_BURST) * u128::from(l.byte_interval_fp)) >> 16;
    (l.flags & rule_flags::PKT_LIMIT == 0
        || ratelimit_common::coarse_only(l.pkt_tolerance_ns, l.pkt_interval_ns, lag))
        && (l.flags & rule_flags::BYTE_LIMIT == 0
            || ratelimit_common::coarse_only(
                l.byte_tolerance_ns,
                u64::try_from(frame_ns).unwrap_or(u64::MAX),
                lag,
            ))
}

/// Whether limit `l` (of a rule on the coarse clock, not on it alone) may make its new buckets
/// from the coarse clock, settled at their next charge (`rule_flags::BORN_COARSE`): a packet
/// limit alone, neither cluster-scoped (the share arithmetic keeps TATs of its own) nor `per =
/// "rule"` (the per-rule window reads its one bucket's TAT), whose burst holds 100 packets, so
/// that the one packet a bucket so made may hold less than exact GCRA's is at most 1% of it.
/// The flags are judged as the XDP program judges them (`rule_flags::born_coarse_in_force`), so
/// the agent sets the flag exactly where the program takes it; the mask is the agent's to judge.
fn born_coarse(l: &Limit) -> bool {
    rule_flags::born_coarse_in_force(l.flags | rule_flags::BORN_COARSE)
        && l.src_mask != [0; 4]
        && ratelimit_common::born_coarse(l.pkt_tolerance_ns, l.pkt_interval_ns)
}

/// Whether a drop window of limit `l` (a source's own bucket, or a per-rule limit's) may hold up
/// to the coarse clock's lag past its end and lose nothing (`rule_flags::HOLD_WINDOW`,
/// `HOLD_GATE`): the window opens when a packet of cost `c` does not conform, so its bucket is
/// full only `tolerance - c` after its end; a tolerance of at least the lag plus the largest cost
/// keeps every token its sources wait for. A byte limit's largest cost is a 64 KiB frame's,
/// `byte_interval_fp` ns. Not for a cluster-scoped limit, whose window is capped so its drops
/// reach the demand the agent reads.
fn holds_window(l: &Limit) -> bool {
    let lag = coarse_lag_ns();
    l.flags & rule_flags::CLUSTER == 0
        && (l.flags & rule_flags::PKT_LIMIT == 0
            || l.pkt_tolerance_ns >= lag.saturating_add(l.pkt_interval_ns))
        && (l.flags & rule_flags::BYTE_LIMIT == 0
            || l.byte_tolerance_ns >= lag.saturating_add(l.byte_interval_fp))
}

/// The kernel form of one limit of a valid rule (whose sources include IPv6 ones if `has_v6`),
/// and whether its tolerances allow the coarse clock.
fn limit_record(
    (per, scope): (Per, Scope),
    (rate, burst): (Option<u64>, Option<u64>),
    (bytes_rate, bytes_burst): (Option<u64>, Option<u64>),
    has_v6: bool,
) -> (Limit, bool) {
    let mut l = Limit::default();
    let per_len = match per {
        // An IPv4 address fills the first word of the key and the rest is zero, so a rule
        // with IPv6 sources (IPv4 too or not) can mask every word.
        Per::Source if has_v6 => 128,
        Per::Source => 32,
        Per::Rule => 0,
        Per::Prefix(len) => len,
    };
    // Read as the XDP program reads the packet's address: 4-byte chunks in memory order.
    let mask_bytes = mask(per_len).to_be_bytes();
    for (word, chunk) in l.src_mask.iter_mut().zip(mask_bytes.chunks_exact(4)) {
        *word = u32::from_ne_bytes(chunk.try_into().expect("4 bytes"));
    }
    if scope == Scope::Cluster {
        l.flags |= rule_flags::CLUSTER;
    }
    // Validation bounds rate, burst and the refill time (one hour), so none of this overflows.
    let mut coarse = true;
    if let (Some(rate), Some(burst)) = (rate, burst) {
        l.flags |= rule_flags::PKT_LIMIT;
        // Rounded up: the effective rate is 1e9 / ceil(1e9 / rate), slightly below `rate` when
        // it does not divide 1e9 (by under 0.1% up to 1e6 packets/s), never above it (rounded
        // down, 30,000,000/s admitted 1% more over any interval).
        l.pkt_interval_ns = 1_000_000_000u64.div_ceil(rate);
        l.pkt_tolerance_ns = burst * l.pkt_interval_ns;
        coarse &= l.pkt_tolerance_ns >= COARSE_CLOCK_MIN_TOLERANCE_NS;
    }
    if let (Some(rate), Some(burst)) = (bytes_rate, bytes_burst) {
        l.flags |= rule_flags::BYTE_LIMIT;
        // Rounded up, as every byte cost is (`byte_cost_ns`): never above `bytes_rate`.
        l.byte_interval_fp = (NS_PER_SEC << 16).div_ceil(u128::from(rate)) as u64;
        l.byte_tolerance_ns = (u128::from(burst) * NS_PER_SEC / u128::from(rate)) as u64;
        coarse &= l.byte_tolerance_ns >= COARSE_CLOCK_MIN_TOLERANCE_NS;
    }
    if ratelimit_common::first_packet_free(l.flags, l.pkt_interval_ns) {
        l.flags |= rule_flags::FIRST_FREE;
    }
    let limits = l.flags & (rule_flags::PKT_LIMIT | rule_flags::BYTE_LIMIT) != 0;
    (l, coarse && limits)
}
