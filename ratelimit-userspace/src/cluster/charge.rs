//! Charging a local bucket for what peers admitted, from user space (the XDP program is not
//! involved): the bucket's theoretical arrival time moves forward by the cost of the packets and
//! bytes, with no cap, so a source whose burst slipped through on every host at once goes into
//! debt here and is paid back at the rule's rate over the following seconds.

use ratelimit_common::{rule_flags, Bucket, BucketKey, Rule};

use crate::maps::{MapsError, PinnedMaps, BPF_EXIST, BPF_NOEXIST};

/// Adds the cost of `pkts` packets and `bytes` bytes to `b` at `now` (`CLOCK_MONOTONIC` ns).
pub fn apply(b: &mut Bucket, rule: &Rule, pkts: u64, bytes: u64, now: u64) {
    if rule.flags & rule_flags::PKT_LIMIT != 0 && pkts > 0 {
        let cost = pkts.saturating_mul(rule.pkt_interval_ns);
        b.tat_ns = b.tat_ns.max(now).saturating_add(cost);
        b.remote_applied_ns = b.remote_applied_ns.wrapping_add(cost);
    }
    if rule.flags & rule_flags::BYTE_LIMIT != 0 && bytes > 0 {
        // `byte_cost_ns` in 128 bits: a sync's worth of bytes can overflow its 64-bit product.
        let cost = u64::try_from(
            (u128::from(bytes) * u128::from(rule.byte_interval_fp) + (1 << 15)) >> 16,
        )
        .unwrap_or(u64::MAX);
        b.byte_tat_ns = b.byte_tat_ns.max(now).saturating_add(cost);
        b.remote_byte_applied_ns = b.remote_byte_applied_ns.wrapping_add(cost);
    }
}

/// Charges the bucket under `key` by read-modify-write of the pinned map, creating it (as the
/// XDP program would, with a full bucket) if the source has not been seen here.
///
/// The write replaces the whole value. A packet that the XDP program admits on this bucket
/// between our read and our write is lost from the TAT and the bucket's counters: at most the
/// packets of those few microseconds go uncharged, negligible next to the sync lag (and an LRU
/// update swaps in a new element, so a program still holding the old one charges that instead,
/// with the same effect).
pub fn charge(
    maps: &mut PinnedMaps,
    key: &BucketKey,
    rule: &Rule,
    pkts: u64,
    bytes: u64,
    now: u64,
) -> Result<(), MapsError> {
    // Two tries: the bucket may appear (a packet) or vanish (LRU eviction) between read and write.
    for _ in 0..2 {
        let (mut b, flags) = match maps.bucket(key)? {
            Some(b) => (b, BPF_EXIST),
            None => (
                Bucket {
                    created_ns: now,
                    ..Bucket::default()
                },
                BPF_NOEXIST,
            ),
        };
        apply(&mut b, rule, pkts, bytes, now);
        if maps.update_bucket(key, &b, flags)? {
            return Ok(());
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
        assert_eq!(b.remote_applied_ns, 1100 * MS);
        assert_eq!(b.remote_byte_applied_ns, 5000);
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
