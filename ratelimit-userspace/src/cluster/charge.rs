//! Charging a local bucket for what peers admitted, from user space (the XDP program is not
//! involved): the bucket's theoretical arrival time moves forward by the cost of the packets and
//! bytes, so a source whose burst slipped through on every host at once goes into debt here and
//! is paid back at the rate over the following seconds. A bucket belongs to one limit of a rule
//! (its own, or a `[[rule.limit]]`): costs, tolerances and ceilings are that limit's.
//!
//! The debt is capped: a charge never moves a TAT past `now + tolerance + peers x allowance`,
//! where `allowance` is the depth of one peer's allowance ([`Limits::pkt_allowance_ns`]: the
//! burst plus the lag allowance of rate) and `peers` the peers counted in the round. So a
//! bucket's debt beyond its burst is at most `peers x (burst + rate x lag allowance)`, and it
//! admits again at most that long (`peers x (burst / rate + lag allowance)`) after the charges
//! stop.

use ratelimit_common::{bucket_header, rule_flags, Bucket, BucketKey, Limit};

use super::remote::Limits;
use crate::maps::{
    store::{advance_tat, Slot},
    MapsError, PinnedMaps,
};

/// The ceilings of the packet and byte TATs of a bucket of limit `limit` at `now` with `peers`
/// peers counted and a lag allowance of `lag_ns`: `now + tolerance + peers x allowance depth`.
#[must_use]
pub fn ceilings(limit: &Limit, peers: u64, lag_ns: u64, now: u64) -> (u64, u64) {
    let l = Limits::of(limit);
    let ceiling = |tolerance: u64, depth: u64| {
        now.saturating_add(tolerance)
            .saturating_add(peers.saturating_mul(depth))
    };
    (
        ceiling(limit.pkt_tolerance_ns, l.pkt_allowance_ns(lag_ns)),
        ceiling(limit.byte_tolerance_ns, l.byte_allowance_ns(lag_ns)),
    )
}

/// The TAT costs (packets, bytes) of `pkts` packets and `bytes` bytes under `rule` (one limit).
#[must_use]
pub fn costs(rule: &Limit, pkts: u64, bytes: u64) -> (u64, u64) {
    let pkt = if rule.flags & rule_flags::PKT_LIMIT != 0 {
        pkts.saturating_mul(rule.pkt_interval_ns)
    } else {
        0
    };
    let byte = if rule.flags & rule_flags::BYTE_LIMIT != 0 {
        // `byte_cost_ns` in 128 bits: a sync's worth of bytes can overflow its 64-bit product.
        u64::try_from((u128::from(bytes) * u128::from(rule.byte_interval_fp) + (1 << 15)) >> 16)
            .unwrap_or(u64::MAX)
    } else {
        0
    };
    (pkt, byte)
}

/// Adds the cost of `pkts` packets and `bytes` bytes to `b` at `now` (`CLOCK_MONOTONIC` ns), up
/// to `ceilings` (packet, byte; see [`ceilings`]). Whether a ceiling cut a cost short.
pub fn apply(
    b: &mut Bucket,
    rule: &Limit,
    pkts: u64,
    bytes: u64,
    now: u64,
    ceilings: (u64, u64),
) -> bool {
    let (pkt, byte) = costs(rule, pkts, bytes);
    let mut capped = false;
    if pkt > 0 {
        let (tat, cut) = advance_tat(b.tat_ns, now, pkt, ceilings.0);
        b.tat_ns = tat;
        capped |= cut;
    }
    if byte > 0 {
        let (tat, cut) = advance_tat(b.byte_tat_ns, now, byte, ceilings.1);
        b.byte_tat_ns = tat;
        capped |= cut;
    }
    capped
}

/// Charges the bucket under `key` (of limit `rule`) in place in the bucket store, with the XDP program's
/// compare-and-swap (no packet admitted meanwhile is lost from the TAT), creating it (as the
/// program would, a full bucket, in the record the program would choose) if the source has not
/// been seen here. `coarse_now` is `CLOCK_MONOTONIC_COARSE`, which judges what eviction loses.
/// No TAT moves past its ceiling (`(packet, byte)`, see [`ceilings`]); `Ok(true)` when one cut
/// the charge short.
#[expect(
    clippy::too_many_arguments,
    reason = "the bucket, the charge, two clocks and the ceilings"
)]
pub fn charge(
    maps: &PinnedMaps,
    key: &BucketKey,
    rule: &Limit,
    pkts: u64,
    bytes: u64,
    now: u64,
    coarse_now: u64,
    ceilings: (u64, u64),
) -> Result<bool, MapsError> {
    let (pkt_cost, byte_cost) = costs(rule, pkts, bytes);
    // Three tries: the record may be taken by a packet between the scan and the write, and a
    // bucket given back for the program's own (see below) is charged on the next.
    for _ in 0..3 {
        let (slot, gen) = maps.locate_bucket(key, coarse_now)?;
        if gen == 0 {
            // The rule left the set meanwhile: nothing to charge.
            return Ok(false);
        }
        let header = bucket_header(key.rule, key.family, gen);
        match slot {
            Slot::Found(i) => {
                if let Some(capped) = maps.store().advance_capped(
                    i,
                    header,
                    now,
                    (pkt_cost, ceilings.0),
                    (byte_cost, ceilings.1),
                ) {
                    return Ok(capped);
                }
            }
            Slot::Vacant {
                index, header: old, ..
            } => {
                let mut fresh = Bucket {
                    addr: key.addr,
                    rule: u16::try_from(key.rule).unwrap_or(u16::MAX),
                    family: key.family,
                    rule_gen: gen,
                    created_ns: now,
                    ..Bucket::default()
                };
                let capped = apply(&mut fresh, rule, pkts, bytes, now, ceilings);
                if maps.store().install(index, old, &fresh) {
                    // The program may have created the same key's bucket at the same instant:
                    // a source never holds two. The program gives its own back when it sees
                    // this one (its packet passes uncharged, counted `bucket_errors`), so this
                    // one stays: giving it back too could leave the source with none (both
                    // writers seeing the other). One the program kept (it looked before this
                    // one was published) is taken out here, its packets charged to this one.
                    if let Some(o) = maps.other_bucket(key, gen, index)? {
                        if let Some(taken) = maps.store().take(o, header) {
                            let (p, b) =
                                costs(rule, u64::from(taken.passed_pkts), taken.passed_bytes);
                            let _ = maps.store().advance(index, header, now, p, b);
                            maps.store().add_counts(index, header, &taken);
                        }
                    }
                    return Ok(capped);
                }
            }
            Slot::Busy => {}
        }
    }
    Err(MapsError::Op {
        map: ratelimit_common::map_names::BUCKETS,
        reason: "bucket kept changing while being charged".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn charges_advance_from_now_and_go_into_debt() {
        let rule = Limit {
            flags: rule_flags::PKT_LIMIT | rule_flags::BYTE_LIMIT,
            pkt_interval_ns: MS,
            pkt_tolerance_ns: 500 * MS,
            byte_interval_fp: 1 << 16, // 1 ns per byte
            byte_tolerance_ns: 1000,
            ..Limit::default()
        };
        let now = 1_000_000 * MS;
        // An idle bucket (TAT in the past) is charged from now.
        let mut b = Bucket {
            tat_ns: now - 10_000 * MS,
            byte_tat_ns: 0,
            ..Bucket::default()
        };
        apply(&mut b, &rule, 100, 5000, now, (u64::MAX, u64::MAX));
        assert_eq!(b.tat_ns, now + 100 * MS);
        assert_eq!(b.byte_tat_ns, now + 5000);
        // A busy one from its TAT, past the tolerance (debt).
        apply(&mut b, &rule, 1000, 0, now, (u64::MAX, u64::MAX));
        assert_eq!(b.tat_ns, now + 1100 * MS);
        // No packet limit: packets are not charged.
        let mut b2 = Bucket::default();
        apply(
            &mut b2,
            &Limit {
                flags: rule_flags::BYTE_LIMIT,
                byte_interval_fp: 1 << 16,
                ..Limit::default()
            },
            10,
            10,
            now,
            (u64::MAX, u64::MAX),
        );
        assert_eq!((b2.tat_ns, b2.byte_tat_ns), (0, now + 10));
    }

    /// The XDP program's packet check: conforms if the TAT after it is within the tolerance.
    fn admit(b: &mut Bucket, rule: &Limit, now: u64) -> bool {
        let new = b.tat_ns.max(now) + rule.pkt_interval_ns;
        if new - now > rule.pkt_tolerance_ns {
            return false;
        }
        b.tat_ns = new;
        true
    }

    /// A peer with the key claims, every 100 ms sync for 60 s, that a victim source sent a
    /// million packets through it; the victim sends here at the rule's rate. With bounded trust
    /// the bucket's debt never exceeds `peers x (burst + rate x lag allowance)` beyond the
    /// burst, and once the claims stop the victim is admitted again within that time (0.8 s,
    /// inside one 3 s peer timeout), at its full rate.
    #[test]
    fn an_inflating_peer_leaves_a_bounded_debt_that_is_repaid_within_a_peer_timeout() {
        use crate::cluster::{
            publish::{Count, KeyName},
            remote::{lag_allowance_ns, ClusterLimits, PeerView, RemoteTracker},
        };

        const S: u64 = 1_000_000_000;
        let rule = Limit {
            flags: rule_flags::PKT_LIMIT,
            pkt_interval_ns: MS,        // 1000 pps
            pkt_tolerance_ns: 500 * MS, // burst 500
            ..Limit::default()
        };
        let interval = 100 * MS;
        let lag = lag_allowance_ns(interval);
        let timeout = 3 * S;
        let limits = ClusterLimits::default().with("flood", 0, Limits::of(&rule));
        let name = KeyName {
            rule: "flood".into(),
            limit: 0,
            addr: std::net::IpAddr::from([198, 18, 0, 100]),
        };
        let view = |hb: u64, pkts: u64| PeerView {
            id: "evil".to_string(),
            live: true,
            verified: true,
            heartbeat: hb,
            sync: Some((hb, 0, 2)),
            keys: vec![(
                name.clone(),
                Count {
                    epoch: 2,
                    pkts,
                    bytes: 0,
                },
            )],
        };
        let mut tracker = RemoteTracker::new(timeout, lag);
        let mut b = Bucket::default();
        let start = 1000 * S;
        let attack_end = start + 60 * S;
        let (bound_ns, mut worst_debt, mut last_drop) = (500 * MS + lag, 0, 0);
        let mut admitted_after = 0u64;
        // One packet a millisecond (the rate), a sync every 100 ms.
        for ms in 0..70_000u64 {
            let now = start + ms * MS;
            if ms % 100 == 0 {
                let hb = ms / 100 + 1;
                let claim = if now <= attack_end { hb * 1_000_000 } else { 0 };
                let mut v = view(hb, claim);
                if now > attack_end {
                    v.keys.clear();
                }
                let r = tracker.round(now, &[v], &limits);
                if let Some(&(p, bytes)) = r.charges.get(&name) {
                    let c = ceilings(&rule, r.counted_peers, lag, now);
                    apply(&mut b, &rule, p, bytes, now, c);
                }
                let debt = b.tat_ns.saturating_sub(now + rule.pkt_tolerance_ns);
                worst_debt = worst_debt.max(debt);
            }
            if admit(&mut b, &rule, now) {
                if now > attack_end {
                    admitted_after += 1;
                }
            } else {
                last_drop = now;
            }
        }
        assert!(
            worst_debt <= bound_ns,
            "debt {worst_debt} ns over the bound {bound_ns} ns"
        );
        let recovered_in = last_drop.saturating_sub(attack_end);
        assert!(
            recovered_in <= bound_ns && recovered_in < timeout,
            "victim still dropped {recovered_in} ns after the claims stopped"
        );
        // After that, every packet at the rate passes.
        assert!(
            admitted_after >= (10 * S - bound_ns) / MS,
            "{admitted_after}"
        );
    }

    /// The ceiling holds whatever a charge asks, never moves a TAT back, and is reported.
    #[test]
    fn charges_stop_at_the_ceiling() {
        let rule = Limit {
            flags: rule_flags::PKT_LIMIT,
            pkt_interval_ns: MS,
            pkt_tolerance_ns: 500 * MS,
            ..Limit::default()
        };
        let now = 1_000_000 * MS;
        // Two peers, 300 ms of lag: 500 ms + 2 x 800 ms.
        let c = ceilings(&rule, 2, 300 * MS, now);
        assert_eq!(c.0, now + 2100 * MS);
        let mut b = Bucket::default();
        assert!(!apply(&mut b, &rule, 2100, 0, now, c));
        assert_eq!(b.tat_ns, now + 2100 * MS);
        assert!(apply(&mut b, &rule, 1, 0, now, c));
        assert_eq!(b.tat_ns, now + 2100 * MS);
        // A TAT already past a (lower) ceiling stays.
        assert_eq!(
            advance_tat(now + 5 * MS, now, 10 * MS, now),
            (now + 5 * MS, true)
        );
    }

    /// Two limits of one rule charged for the same peer report: each bucket moves by its own
    /// limit's cost and stops at its own limit's ceiling (tolerance and allowance depth).
    #[test]
    fn each_limit_is_charged_and_capped_by_its_own_rates() {
        let rule = {
            let mut r = ratelimit_common::Rule::default();
            // Limit 0: 1000 pps, burst 500; limit 1: 10,000 pps, burst 2,000.
            r.set_limit(
                0,
                Limit {
                    flags: rule_flags::PKT_LIMIT,
                    pkt_interval_ns: MS,
                    pkt_tolerance_ns: 500 * MS,
                    ..Limit::default()
                },
            );
            r.set_limit(
                1,
                Limit {
                    flags: rule_flags::PKT_LIMIT | rule_flags::CLUSTER,
                    pkt_interval_ns: MS / 10,
                    pkt_tolerance_ns: 200 * MS,
                    ..Limit::default()
                },
            );
            r
        };
        let (own, agg) = (rule.limit(0).unwrap(), rule.limit(1).unwrap());
        let now = 1_000_000 * MS;
        let lag = 300 * MS;
        // One peer: 500 ms + 800 ms for limit 0, 200 ms + 500 ms for limit 1.
        assert_eq!(ceilings(&own, 1, lag, now).0, now + 1300 * MS);
        assert_eq!(ceilings(&agg, 1, lag, now).0, now + 700 * MS);
        let (mut b0, mut b1) = (Bucket::default(), Bucket::default());
        assert!(!apply(
            &mut b0,
            &own,
            1000,
            0,
            now,
            ceilings(&own, 1, lag, now)
        ));
        assert!(!apply(
            &mut b1,
            &agg,
            1000,
            0,
            now,
            ceilings(&agg, 1, lag, now)
        ));
        assert_eq!((b0.tat_ns, b1.tat_ns), (now + 1000 * MS, now + 100 * MS));
        // 10,000 more packets: limit 0 stops at its ceiling, limit 1 at its own.
        assert!(apply(
            &mut b0,
            &own,
            10_000,
            0,
            now,
            ceilings(&own, 1, lag, now)
        ));
        assert!(apply(
            &mut b1,
            &agg,
            10_000,
            0,
            now,
            ceilings(&agg, 1, lag, now)
        ));
        assert_eq!((b0.tat_ns, b1.tat_ns), (now + 1300 * MS, now + 700 * MS));
    }
}
