//! Charging a local bucket for what peers admitted, from user space (the XDP program is not
//! involved): the bucket's theoretical arrival time moves forward by the cost of the packets and
//! bytes, with no cap, so a source whose burst slipped through on every host at once goes into
//! debt here and is paid back at the rule's rate over the following seconds.

use ratelimit_common::{bucket_header, rule_flags, Bucket, BucketKey, Rule};

use crate::maps::{store::Slot, MapsError, PinnedMaps};

/// The TAT costs (packets, bytes) of `pkts` packets and `bytes` bytes under `rule`.
#[must_use]
pub fn costs(rule: &Rule, pkts: u64, bytes: u64) -> (u64, u64) {
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

/// Adds the cost of `pkts` packets and `bytes` bytes to `b` at `now` (`CLOCK_MONOTONIC` ns).
pub fn apply(b: &mut Bucket, rule: &Rule, pkts: u64, bytes: u64, now: u64) {
    let (pkt, byte) = costs(rule, pkts, bytes);
    if pkt > 0 {
        b.tat_ns = b.tat_ns.max(now).saturating_add(pkt);
    }
    if byte > 0 {
        b.byte_tat_ns = b.byte_tat_ns.max(now).saturating_add(byte);
    }
}

/// Charges the bucket under `key` in place in the bucket store, with the XDP program's
/// compare-and-swap (no packet admitted meanwhile is lost from the TAT), creating it (as the
/// program would, a full bucket, in the record the program would choose) if the source has not
/// been seen here. `coarse_now` is `CLOCK_MONOTONIC_COARSE`, which judges what eviction loses.
pub fn charge(
    maps: &PinnedMaps,
    key: &BucketKey,
    rule: &Rule,
    pkts: u64,
    bytes: u64,
    now: u64,
    coarse_now: u64,
) -> Result<(), MapsError> {
    let (pkt_cost, byte_cost) = costs(rule, pkts, bytes);
    // Two tries: the record may be taken by a packet between the scan and the write.
    for _ in 0..2 {
        let (slot, gen) = maps.locate_bucket(key, coarse_now)?;
        if gen == 0 {
            // The rule left the set meanwhile: nothing to charge.
            return Ok(());
        }
        let header = bucket_header(key.rule, key.family, gen);
        match slot {
            Slot::Found(i) => {
                if maps.store().advance(i, header, now, pkt_cost, byte_cost) {
                    return Ok(());
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
                apply(&mut fresh, rule, pkts, bytes, now);
                if maps.store().install(index, old, &fresh) {
                    return Ok(());
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
        let rule = Rule {
            flags: rule_flags::PKT_LIMIT | rule_flags::BYTE_LIMIT,
            pkt_interval_ns: MS,
            pkt_tolerance_ns: 500 * MS,
            byte_interval_fp: 1 << 16, // 1 ns per byte
            byte_tolerance_ns: 1000,
            ..Rule::default()
        };
        let now = 1_000_000 * MS;
        // An idle bucket (TAT in the past) is charged from now.
        let mut b = Bucket {
            tat_ns: now - 10_000 * MS,
            byte_tat_ns: 0,
            ..Bucket::default()
        };
        apply(&mut b, &rule, 100, 5000, now);
        assert_eq!(b.tat_ns, now + 100 * MS);
        assert_eq!(b.byte_tat_ns, now + 5000);
        // A busy one from its TAT, past the tolerance (debt).
        apply(&mut b, &rule, 1000, 0, now);
        assert_eq!(b.tat_ns, now + 1100 * MS);
        // No packet limit: packets are not charged.
        let mut b2 = Bucket::default();
        apply(
            &mut b2,
            &Rule {
                flags: rule_flags::BYTE_LIMIT,
                byte_interval_fp: 1 << 16,
                ..Rule::default()
            },
            10,
            10,
            now,
        );
        assert_eq!((b2.tat_ns, b2.byte_tat_ns), (0, now + 10));
    }
}
