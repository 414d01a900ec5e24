//! A cluster-scoped limit's bucket at a share of the cluster's rate: the arithmetic the XDP
//! program charges with, the agent converts with when it changes a share, and the cluster
//! simulator (`ratelimit-userspace`'s `cluster::sim`) runs.
//!
//! # What a share does
//! A bucket whose share word is `w` (see [`crate::Bucket::created_share`]; `s = w / SHARE_ONE`)
//! refills at `s x rate` and holds up to the limit's **whole burst**: its packets cost
//! `cost / s` and its tolerance is `tolerance / s` (both [`crate::share_cost`]), so the bucket
//! runs on a clock slowed by `s`. Each holder can so bank its own share's refill over the gaps
//! between its bursts, up to one burst, and always at least one packet (a share of a packet's
//! cost cannot refuse every packet, however small it is). The cluster's buckets refill at `rate`
//! together (the shares add up to at most 1) and hold at most `hosts x burst`.
//!
//! # The TAT's time, marked in its lowest bit
//! A TAT kept at a share (`tat - now` stretched by `1 / s`) has bit 0 set ([`STRETCHED`]); one
//! kept at the whole rate has it clear. Every write of a cluster-scoped limit's TAT sets that
//! bit (rounding the TAT up by at most 1 ns: a packet may cost 1 ns more, never less), and its
//! costs are even, so a fetch-and-add keeps the bit. A charge first brings the TAT it read into
//! the time it charges in (`tat - now` scaled by `from / to`, rounded up), inside the same
//! compare-and-swap that writes the charge: so when the shares lapse (the agent stopped,
//! `Config::shares_until_ns` passed), a stretched TAT is read back at the whole rate with the
//! tokens it held, never as a debt of `1 / s` times their time (fail open), and a TAT is never
//! converted twice. Which share stretched a TAT is the bucket's word now: the agent changes word
//! and TATs in the order that makes every state in between read as fewer tokens, never more
//! (see `MappedStore::set_share`).

use crate::{share_cost, SHARE_MASK, SHARE_ONE};

/// Bit 0 of a cluster-scoped limit's TAT: set when the TAT is kept in its share's time (see the
/// module docs), clear when in the whole rate's.
pub const STRETCHED: u64 = 1;

/// The domain of one charge of a limit's bucket, in one word (few registers: the program's
/// frame has no stack to spare): bits 0..16 the bucket's share word, bit 16 whether shares are
/// in force, bit 17 whether the limit is cluster-scoped. 0: not cluster-scoped (plain GCRA).
pub type Domain = u64;

const IN_FORCE: u64 = 1 << 16;
const CLUSTER: u64 = 1 << 17;

/// The [`Domain`] of a charge: `cluster` (the limit has `rule_flags::CLUSTER`), the bucket's
/// share word `word` (its low 16 bits), `in_force` (`now < Config::shares_until_ns`).
#[inline(always)]
#[must_use]
pub const fn domain(cluster: bool, word: u64, in_force: bool) -> Domain {
    if !cluster {
        return 0;
    }
    CLUSTER | (word & SHARE_MASK) | if in_force { IN_FORCE } else { 0 }
}

/// The share word a charge in `dom` pays at: the bucket's word while shares are in force, else
/// 0 (the whole rate).
#[inline(always)]
#[must_use]
pub const fn charged_word(dom: Domain) -> u64 {
    if dom & IN_FORCE != 0 {
        dom & SHARE_MASK
    } else {
        0
    }
}

/// The mark ([`STRETCHED`] or 0) a charge in `dom` writes into a TAT: 1 at a share in force, 0
/// at the whole rate (and for a limit that is not cluster-scoped). Arithmetic, no branch: the
/// program computes it once per charge.
#[inline(always)]
#[must_use]
pub const fn mark(dom: Domain) -> u64 {
    // (word + 0xffff) >> 16 is 1 for a word of 1..=0xffff, 0 for 0.
    ((dom >> 16) & (dom >> 17) & 1) & (((dom & SHARE_MASK) + SHARE_MASK) >> 16)
}

/// A share word's share of [`SHARE_ONE`]: the word itself, or [`SHARE_ONE`] for 0 (none).
#[inline(always)]
#[must_use]
pub const fn effective(word: u64) -> u64 {
    if word == 0 || word >= SHARE_ONE {
        SHARE_ONE
    } else {
        word
    }
}

/// `d x from / to` rounded up and saturating, without 128-bit arithmetic (the BPF target has
/// none); `from` and `to` in 1..=[`SHARE_ONE`].
#[inline(always)]
#[must_use]
pub const fn rescale(d: u64, from: u64, to: u64) -> u64 {
    if from == to || to == 0 {
        return d;
    }
    let q = d / to;
    let r = d % to;
    // r < to <= 2^16 and from <= 2^16: no overflow.
    mul_sat(q, from).saturating_add((r * from).div_ceil(to))
}

/// What a packet of whole-rate cost `cost` costs in `dom`: [`share_cost`] at the charged word,
/// even for a cluster-scoped limit (so that adding it keeps the TAT's [`STRETCHED`] bit).
#[inline(always)]
#[must_use]
pub const fn cost(cost: u64, dom: Domain) -> u64 {
    let c = share_cost(cost, charged_word(dom));
    if dom & CLUSTER != 0 {
        c + (c & 1)
    } else {
        c
    }
}

/// The packet tolerance in `dom` of a limit whose whole-rate tolerance is `tolerance` (`burst x
/// interval`, as compiled) and packet interval `interval`, when a packet costs `cost` ([`cost`]):
/// `burst x cost`, so the bucket holds exactly the whole burst at any share, plus [`slack`] for
/// the TAT's mark and conversions.
#[inline(always)]
#[must_use]
pub const fn pkt_tolerance(tolerance: u64, interval: u64, cost: u64, dom: Domain) -> u64 {
    if dom & CLUSTER == 0 || interval == 0 {
        return tolerance;
    }
    mul_sat(tolerance / interval, cost).saturating_add(slack(cost))
}

/// The byte tolerance in `dom` of a limit whose whole-rate byte tolerance is `tolerance`, for a
/// packet whose bytes cost `cost` ([`cost`]): stretched as the costs are, plus [`slack`].
#[inline(always)]
#[must_use]
pub const fn byte_tolerance(tolerance: u64, cost: u64, dom: Domain) -> u64 {
    if dom & CLUSTER == 0 {
        return tolerance;
    }
    share_cost(tolerance, charged_word(dom)) + slack(cost)
}

/// `a x b`, saturating, in 32-bit halves: `saturating_mul` (and a test against `MAX / b`, which
/// LLVM turns back into one) is a 128-bit multiply, which the BPF target does not have.
#[inline(always)]
const fn mul_sat(a: u64, b: u64) -> u64 {
    let (a, b) = if a < b { (b, a) } else { (a, b) };
    if b >> 32 != 0 {
        return u64::MAX;
    }
    // b < 2^32: each partial product fits.
    let hi = (a >> 32) * b;
    if hi >> 32 != 0 {
        return u64::MAX;
    }
    (hi << 32).saturating_add((a & 0xffff_ffff) * b)
}

/// The nanoseconds a cluster-scoped tolerance allows beyond its burst: the TAT's mark (1 ns) and
/// a conversion's rounding up (up to 2), so that rounding never costs a packet of the burst;
/// always below one packet's cost, so it never admits one more.
#[inline(always)]
#[must_use]
pub const fn slack(cost: u64) -> u64 {
    if cost > 3 {
        3
    } else {
        cost.saturating_sub(1)
    }
}

/// Whether a TAT read as `tat` is kept in the time a charge in `dom` writes (always, for a limit
/// that is not cluster-scoped).
#[inline(always)]
#[must_use]
pub const fn same_time(tat: u64, dom: Domain) -> bool {
    dom & CLUSTER == 0 || ((tat & STRETCHED != 0) == (charged_word(dom) != 0))
}

/// The TAT `tat`, read at `now`, in the time a charge in `dom` writes: a stretched one (by the
/// bucket's word) or a whole-rate one brought to the charged word, its tokens kept (the time
/// ahead of `now` scaled, rounded up). Past TATs (a full bucket) are full in any time.
#[inline(always)]
#[must_use]
pub const fn base(tat: u64, now: u64, dom: Domain) -> u64 {
    if dom & CLUSTER == 0 || tat <= now {
        return tat;
    }
    let from = if tat & STRETCHED != 0 {
        effective(dom & SHARE_MASK)
    } else {
        SHARE_ONE
    };
    let to = effective(charged_word(dom));
    if from == to {
        tat
    } else {
        now.saturating_add(rescale(tat - now, from, to))
    }
}

/// `tat` marked for the time a charge in `dom` writes: [`STRETCHED`] set at a share, clear at the
/// whole rate (rounded up, by at most 1 ns).
#[inline(always)]
#[must_use]
pub const fn seal(tat: u64, dom: Domain) -> u64 {
    if dom & CLUSTER == 0 {
        tat
    } else if charged_word(dom) != 0 {
        tat | STRETCHED
    } else {
        tat + (tat & STRETCHED)
    }
}

/// The TAT that keeps a bucket's tokens at `now` when its share word changes from `from` to `to`
/// (words: 0 is the whole rate): `tat - now` brought from the time `tat` is kept in (its bit: a
/// stretched TAT by `from`) to `to`'s, marked for it. `None` when nothing changes.
#[must_use]
pub const fn convert(tat: u64, now: u64, from: u64, to: u64) -> Option<u64> {
    let src = if tat & STRETCHED != 0 {
        effective(from)
    } else {
        SHARE_ONE
    };
    let dst = effective(to);
    let stretched = dst != SHARE_ONE;
    let ahead = if tat > now {
        rescale(tat - now, src, dst)
    } else {
        0
    };
    // A past TAT stays where it is (full in any time); only its mark changes.
    let t = if tat > now { now + ahead } else { tat };
    let t = if stretched {
        t | STRETCHED
    } else {
        t + (t & STRETCHED)
    };
    if t == tat {
        None
    } else {
        Some(t)
    }
}

/// Tokens (in units of the whole-rate cost `cost`) a bucket holds at `now` whose TAT is `tat`,
/// tolerance `tolerance` (whole rate), share word `word`: `(tolerance - (tat - now) x s) / cost`
/// for a stretched TAT; negative: in debt.
#[cfg(any(feature = "user", test))]
#[must_use]
#[expect(clippy::cast_precision_loss, reason = "display")]
pub fn tokens(tat: u64, now: u64, tolerance: u64, cost: f64, word: u64) -> f64 {
    let ahead = tat.saturating_sub(now) as f64;
    let s = if tat & STRETCHED != 0 {
        effective(word) as f64 / SHARE_ONE as f64
    } else {
        1.0
    };
    (tolerance as f64 - ahead * s) / cost
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// One GCRA step as the program takes it (its `normalize` and `gcra`): a packet of cost `cost`
    /// (in `dom`'s time) charged to the TAT read as `old`, judged at `now` against `tolerance` (in
    /// `dom`'s time). `Ok(new TAT)` when it conforms, else `Err(until)`.
    fn step(
        old: u64,
        (now, floor): (u64, u64),
        cost: u64,
        tolerance: u64,
        dom: Domain,
    ) -> Result<u64, u64> {
        let b = base(old, now, dom);
        let b = if b > floor { b } else { floor };
        let new = seal(b + cost, dom);
        if new - now > tolerance {
            Err(new - tolerance)
        } else {
            Ok(new)
        }
    }

    #[test]
    fn the_mark_is_set_only_at_a_share_in_force() {
        for word in [0u64, 1, 2, 0xffff] {
            for in_force in [false, true] {
                for cluster in [false, true] {
                    let dom = domain(cluster, word, in_force);
                    assert_eq!(mark(dom), u64::from(charged_word(dom) != 0), "{dom:#x}");
                    assert_eq!(
                        seal(10, dom) & STRETCHED,
                        if cluster { mark(dom) } else { 0 }
                    );
                }
            }
        }
    }

    #[test]
    fn mul_sat_saturates_and_is_exact_below() {
        for (a, b) in [
            (0u64, 5u64),
            (3, 1 << 40),
            (1 << 31, 1 << 33),
            (u64::MAX, 1),
            (1 << 33, 1 << 33),
            (12_345_678_901, 65_536),
        ] {
            let want = u128::from(a) * u128::from(b);
            let got = mul_sat(a, b);
            if want > u128::from(u64::MAX) {
                assert_eq!(got, u64::MAX, "{a} x {b}");
            } else {
                assert_eq!(u128::from(got), want, "{a} x {b}");
            }
        }
    }

    #[test]
    fn rescale_is_the_exact_ratio_rounded_up() {
        for d in [0u64, 1, 7, 999_999, 3_600_000_000_000, 1 << 40] {
            for (from, to) in [
                (1u64, 65_536u64),
                (65_536, 1),
                (3, 7),
                (32_768, 65_535),
                (5, 5),
            ] {
                let want = (u128::from(d) * u128::from(from)).div_ceil(u128::from(to));
                assert_eq!(
                    u128::from(rescale(d, from, to)),
                    want,
                    "{d} x {from} / {to}"
                );
            }
        }
    }

    /// A bucket at any share holds the whole burst: `burst` packets conform from full, the next
    /// does not; and refills at its share.
    #[test]
    fn a_share_holds_the_whole_burst_and_refills_at_its_share() {
        let (interval, burst) = (MS, 100u64);
        for word in [1u64, 3, 655, 32_768, 65_535] {
            let dom = domain(true, word, true);
            let c = cost(interval, dom);
            let tol = pkt_tolerance(burst * interval, interval, c, dom);
            let now = 10_000_000 * MS;
            let mut tat = 0;
            let mut admitted = 0;
            while let Ok(t) = step(tat, (now, now), c, tol, dom) {
                tat = t;
                admitted += 1;
                assert!(admitted <= burst, "word {word}");
            }
            assert_eq!(admitted, burst, "word {word}");
            // Refill: one packet after a share's cost.
            let later = now + c;
            assert!(
                step(tat, (later, later), c, tol, dom).is_ok(),
                "word {word}"
            );
        }
    }

    /// A stretched TAT read once the shares lapse keeps its tokens at the whole rate: a bucket
    /// at 1/65,536 with one token left is not a debt of hours.
    #[test]
    fn a_lapsed_share_reads_a_stretched_tat_with_its_tokens() {
        let (interval, burst) = (MS, 10u64);
        let word = 1;
        let dom = domain(true, word, true);
        let c = cost(interval, dom);
        let tol = pkt_tolerance(burst * interval, interval, c, dom);
        let now = 10_000_000 * MS;
        let mut tat = 0;
        for _ in 0..9 {
            tat = step(tat, (now, now), c, tol, dom).unwrap();
        }
        assert_ne!(tat & STRETCHED, 0);
        let lapsed = domain(true, word, false);
        let c1 = cost(interval, lapsed);
        let t1 = pkt_tolerance(burst * interval, interval, c1, lapsed);
        // One token left: one packet conforms at the whole rate, the next not.
        let t = step(tat, (now, now), c1, t1, lapsed).unwrap();
        assert_eq!(t & STRETCHED, 0);
        assert!(step(t, (now, now), c1, t1, lapsed).is_err());
        // And the refill is the whole rate's from then on.
        assert!(step(t, (now + c1, now + c1), c1, t1, lapsed).is_ok());
    }

    #[test]
    fn convert_keeps_tokens_and_marks_the_time() {
        let now = 1_000_000 * MS;
        let tol = 100 * MS;
        let word = 16_384; // a quarter
                           // Whole rate, 40 ms ahead (60 of 100 tokens) -> a quarter: 160 ms ahead, stretched.
        let t = convert(now + 40 * MS, now, 0, word).unwrap();
        assert_eq!(t & STRETCHED, 1);
        assert_eq!(t - now, 160 * MS + 1);
        let tokens_then = tokens(t, now, tol, MS as f64, word);
        assert!((tokens_then - 60.0).abs() < 1e-3, "{tokens_then}");
        // Back to the whole rate.
        let back = convert(t, now, word, 0).unwrap();
        assert_eq!(back & STRETCHED, 0);
        assert!((back - now).abs_diff(40 * MS) <= 2);
        // A full bucket stays full, only its mark changes.
        assert_eq!(convert(now - 4, now, 0, word), Some((now - 4) | 1));
        assert_eq!(convert(now - 4, now, 0, 0), None);
    }

    /// Reading a TAT in another share's time than it was kept in errs to fewer tokens in the
    /// orders the agent writes (word first when the share grows, TAT first when it shrinks).
    #[test]
    fn the_agents_write_orders_read_as_fewer_tokens_in_between() {
        let (interval, burst) = (MS, 100u64);
        let tol = burst * interval;
        let now = 1_000_000 * MS;
        for (w1, w2) in [(1_000u64, 30_000u64), (30_000, 1_000), (0, 500), (500, 0)] {
            // 40 tokens held at w1.
            let d1 = domain(true, w1, true);
            let tat = seal(now + rescale(60 * MS, SHARE_ONE, effective(w1)), d1);
            let held = tokens(tat, now, tol, MS as f64, w1);
            assert!((held - 40.0).abs() < 0.01, "{held}");
            let grows = effective(w2) > effective(w1);
            // In between: the word already w2 with the TAT of w1 (grows), or the word still w1
            // with the TAT of w2 (shrinks).
            let (tat_between, word_between) = if grows {
                (tat, w2)
            } else {
                (convert(tat, now, w1, w2).unwrap_or(tat), w1)
            };
            let dom = domain(true, word_between, true);
            let b = base(tat_between, now, dom);
            let c = cost(interval, dom);
            let seen = (pkt_tolerance(tol, interval, c, dom) as f64 - (b - now) as f64) / c as f64;
            assert!(seen <= held + 1e-6, "{w1}->{w2}: {seen} > {held}");
        }
    }
}
