//! What a packet costs a bucket, rounded alike by the XDP program and user space.

#[cfg(doc)]
use crate::{Bucket, Rule};
use crate::{SHARE_BITS, SHARE_ONE};

/// What a packet (or its bytes) costs a bucket whose share is `share` (see
/// [`Bucket::created_share`]) when its whole-rate cost is `cost` ns: `cost x SHARE_ONE / share`
/// rounded up, so the bucket refills at no more than `share / SHARE_ONE` of the rate; `cost`
/// itself for share 0 (none). A cost of 2^47 ns or more (39 hours a packet) is left as it is.
#[inline(always)]
#[must_use]
pub const fn share_cost(cost: u64, share: u64) -> u64 {
    if share == 0 || share >= SHARE_ONE || cost >= 1 << 47 {
        cost
    } else {
        (cost << SHARE_BITS).div_ceil(share)
    }
}

/// Nanoseconds of byte TAT that a frame of `len` bytes costs under a rule with `byte_interval_fp`
/// ([`Rule::byte_interval_fp`]); shared so the XDP program and user space round alike.
#[inline(always)]
#[must_use]
pub const fn byte_cost_ns(len: u64, byte_interval_fp: u64) -> u64 {
    // Rounded up: never less than the bytes' share of the rate. Rounded to nearest, a sender
    // choosing frame sizes whose cost fell just short of a half ns admitted 0.8% more bytes at
    // 10 Gbit/s (the error did not average out: the sender picks it).
    (len * byte_interval_fp).div_ceil(1 << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_round_up_so_that_no_sender_gets_more_than_the_rate() {
        // Byte costs: every frame length, at rates that divide 1e9 and rates that do not (the
        // fixed-point interval as the agent compiles it, rounded up). Rounded to nearest, a
        // sender picking lengths whose cost fell just short of half a ns paid less than its bytes.
        for rate in [
            1_250_000_000u128,
            1_000_000_000,
            333_333_333,
            123_456_789,
            1_000_000,
            7,
        ] {
            let fp = ((1_000_000_000u128 << 16).div_ceil(rate)) as u64;
            for len in 1..=9_216u64 {
                let cost = byte_cost_ns(len, fp);
                assert!(
                    u128::from(cost) * rate >= u128::from(len) * 1_000_000_000,
                    "{len} bytes at {rate} B/s cost {cost} ns: less than their time"
                );
                assert!(cost <= ((len * fp) >> 16) + 1, "rounded up by at most 1 ns");
            }
        }
        // Shares: the scaled cost is never below `cost x SHARE_ONE / share`.
        for share in [1u64, 3, 1_000, 21_845, 32_768, 65_535] {
            for cost in [1u64, 7, 999, 1_000_000, 333_333_334, (1 << 47) - 1] {
                let c = share_cost(cost, share);
                assert!(
                    u128::from(c) * u128::from(share) >= u128::from(cost) << SHARE_BITS,
                    "cost {cost} at share {share}: {c}"
                );
                assert!(u128::from(c - 1) * u128::from(share) < u128::from(cost) << SHARE_BITS);
            }
        }
    }
}
