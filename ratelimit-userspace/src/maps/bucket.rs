//! Buckets in user terms: the key the XDP program gives a source under a rule, the address a key
//! stands for, the clocks bucket times are kept in, and a bucket's tokens as `top` and `explain`
//! show them.

use std::net::IpAddr;

use ratelimit_common::{family, Bucket, BucketKey};
use serde::Serialize;

/// The bucket key the XDP program uses for `ip` under `rule`'s first limit.
#[must_use]
pub fn bucket_key(id: u32, rule: &ratelimit_common::Rule, ip: IpAddr) -> BucketKey {
    limit_bucket_key(id, rule, 0, ip)
}

/// The bucket key the XDP program uses for `ip` under limit `limit` of `rule` (0: its own;
/// past its last limit, the first's mask).
#[must_use]
pub fn limit_bucket_key(
    id: u32,
    rule: &ratelimit_common::Rule,
    limit: usize,
    ip: IpAddr,
) -> BucketKey {
    let mask = rule.limit(limit).unwrap_or_default().src_mask;
    let (fam, bytes) = match ip {
        IpAddr::V4(a) => {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&a.octets());
            (family::V4, b)
        }
        IpAddr::V6(a) => (family::V6, a.octets()),
    };
    let mut addr = [0u8; 16];
    for w in 0..4 {
        let word =
            u32::from_ne_bytes(bytes[w * 4..w * 4 + 4].try_into().expect("4 bytes")) & mask[w];
        addr[w * 4..w * 4 + 4].copy_from_slice(&word.to_ne_bytes());
    }
    BucketKey {
        rule: ratelimit_common::bucket_rule(id, u32::try_from(limit).unwrap_or(0)),
        family: family::of_key(fam, mask[0]),
        _pad: [0; 3],
        addr,
    }
}

/// What sources a bucket of a limit whose source mask is `mask` stands for, as `top` and
/// `explain` show it: the masked source as a prefix of the limit's granularity
/// (`198.18.1.0/24`), or `*` under a mask of all zero (`per = "rule"`: one bucket for every
/// source of the rule, of both families).
#[must_use]
pub fn key_source(key: &BucketKey, mask: &[u32; 4]) -> String {
    key_net(key, mask).map_or_else(|| "*".to_owned(), |n| n.to_string())
}

/// The prefix [`key_source`] shows, `None` for `*` (a mask of all zero).
#[must_use]
pub fn key_net(key: &BucketKey, mask: &[u32; 4]) -> Option<ipnet::IpNet> {
    if *mask == [0; 4] {
        return None;
    }
    let bits = mask.iter().map(|w| w.count_ones()).sum::<u32>();
    let len = if key.family == family::V4 {
        bits.min(32)
    } else {
        bits.min(128)
    };
    let addr = bucket_addr(key);
    Some(
        ipnet::IpNet::new(addr, u8::try_from(len).unwrap_or(0))
            .map_or_else(|_| ipnet::IpNet::from(addr), |n| n.trunc()),
    )
}

/// The address (masked source) a bucket key stands for.
#[must_use]
pub fn bucket_addr(key: &BucketKey) -> IpAddr {
    if key.family == family::V4 {
        IpAddr::from([key.addr[0], key.addr[1], key.addr[2], key.addr[3]])
    } else {
        IpAddr::from(key.addr)
    }
}

/// What `f` (`clock_gettime` or `clock_getres` of one clock) writes, in nanoseconds, or `None` if
/// it fails.
fn timespec_ns(f: impl FnOnce(&mut libc::timespec) -> libc::c_int) -> Option<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    (f(&mut ts) == 0).then(|| {
        u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000
            + u64::try_from(ts.tv_nsec).unwrap_or(0)
    })
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock `bpf_ktime_get_ns` reads.
#[must_use]
pub fn monotonic_ns() -> u64 {
    // SAFETY: valid pointer to a timespec; CLOCK_MONOTONIC always exists.
    timespec_ns(|ts| unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, ts) }).unwrap_or(0)
}

/// `CLOCK_MONOTONIC_COARSE` in nanoseconds: the clock `bpf_ktime_get_coarse_ns` reads, never
/// ahead of [`monotonic_ns`].
#[must_use]
pub fn monotonic_coarse_ns() -> u64 {
    // SAFETY: valid pointer to a timespec; CLOCK_MONOTONIC_COARSE exists since Linux 2.6.32.
    timespec_ns(|ts| unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, ts) }).unwrap_or(0)
}

/// The tick of the coarse clock (`clock_getres` of `CLOCK_MONOTONIC_COARSE`: one jiffy, 4 ms at
/// HZ=250), or 0 if the kernel does not say.
#[must_use]
pub fn coarse_tick_ns() -> u64 {
    // SAFETY: valid pointer to a timespec.
    timespec_ns(|ts| unsafe { libc::clock_getres(libc::CLOCK_MONOTONIC_COARSE, ts) }).unwrap_or(0)
}

/// A bucket's state in user terms.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct BucketView {
    /// Packet tokens available now (negative: in debt); `None` without a packet limit.
    pub tokens: Option<f64>,
    /// Byte tokens available now; `None` without a byte limit.
    pub byte_tokens: Option<f64>,
    /// Packets passed under this bucket since it was created.
    pub passed: u64,
    /// Packets dropped (or counted as dry-run drops) by this bucket.
    pub dropped: u64,
    /// Seconds since the bucket was created.
    pub age_secs: f64,
}

impl BucketView {
    /// Reads `b` under `rule` (the limit its key names) at `now` (`CLOCK_MONOTONIC` ns).
    #[must_use]
    pub fn new(b: &Bucket, rule: &ratelimit_common::Rule, now: u64) -> Self {
        use ratelimit_common::rule_flags;
        let rule = &rule
            .limit(ratelimit_common::split_bucket_rule(u32::from(b.rule)).1)
            .unwrap_or_default();
        // A cluster-scoped bucket's TAT may be kept in its share's time (its mark: see
        // `ratelimit_common::share`); its tokens are the same in either, and what it holds
        // depends on its holders as well as its word (a heavy holder holds more than a burst).
        let field = if rule.flags & rule_flags::CLUSTER != 0 {
            b.created_share & ratelimit_common::SHARE_FIELD_MASK
        } else {
            0
        };
        let level = |tat: u64, tolerance: u64, unit: f64| {
            ratelimit_common::share::tokens(tat, now, tolerance, unit, field)
        };
        #[expect(clippy::cast_precision_loss, reason = "display only")]
        Self {
            tokens: (rule.flags & rule_flags::PKT_LIMIT != 0 && rule.pkt_interval_ns > 0).then(
                || {
                    level(
                        ratelimit_common::tat_as_charged(b.tat_ns),
                        rule.pkt_tolerance_ns,
                        rule.pkt_interval_ns as f64,
                    )
                },
            ),
            byte_tokens: (rule.flags & rule_flags::BYTE_LIMIT != 0 && rule.byte_interval_fp > 0)
                .then(|| {
                    level(
                        b.byte_tat_ns,
                        rule.byte_tolerance_ns,
                        rule.byte_interval_fp as f64 / 65536.0,
                    )
                }),
            passed: u64::from(b.passed_pkts),
            dropped: u64::from(b.dropped_pkts),
            age_secs: now.saturating_sub(b.created_ns()) as f64 / 1e9,
        }
    }
}

#[cfg(test)]
mod tests {
    use ratelimit_common::{rule_flags, share, Bucket, Rule, SHARE_ONE};

    use super::BucketView;

    /// A heavy holder's full bucket (a share of 70% among 3 holders: 2.1 bursts) shows the
    /// tokens it holds, not one burst: the view reads the holders with the word.
    #[test]
    fn a_heavy_holders_bucket_shows_what_it_holds() {
        const MS: u64 = 1_000_000;
        let rule = Rule {
            flags: rule_flags::PKT_LIMIT | rule_flags::CLUSTER,
            pkt_interval_ns: MS,
            pkt_tolerance_ns: 100 * MS,
            ..Rule::default()
        };
        let now = 1_000_000 * MS;
        let field = share::field(SHARE_ONE * 7 / 10, 3);
        let b = Bucket {
            family: ratelimit_common::family::V4,
            tat_ns: share::tat_of(0, now, field),
            created_share: Bucket::created_at(now - 1_000 * MS) | field,
            ..Bucket::default()
        };
        let tokens = BucketView::new(&b, &rule, now)
            .tokens
            .expect("a packet limit");
        assert!((tokens - 210.0).abs() < 0.5, "{tokens} tokens, want 210");
    }
}
