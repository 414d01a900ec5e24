//! A cluster-scoped limit's bucket at a share of the cluster's rate: the arithmetic the XDP
//! program charges with, the agent converts with when it changes a share, and the cluster
//! simulator (`ratelimit-userspace`'s `cluster::sim`) runs.
//!
//! # What a share does
//! A bucket whose share word is `w` (see [`crate::Bucket::created_share`]; `s = w / SHARE_ONE`)
//! among `h` holders of the key refills at `s x rate` and holds the whole burst, or `h x s`
//! bursts if `h x s` is at least 1.5 ([`HEAVY`]: a heavy holder): its packets cost `cost / s` ([`crate::share_cost`]) and its tolerance is
//! `tolerance / s`, or `h x tolerance` if more, so the bucket runs on a clock slowed by `s`.
//! Together the holders' buckets refill at `rate` (the shares add up to at most 1).
//!
//! The whole burst at any share lets each holder bank its share's refill over the gaps between
//! its bursts, up to a burst, and never refuse every packet, however small its share. The `h x
//! s` bursts of a heavy holder are what bursty demand spread over hosts needs: one bucket fed by
//! `h` hosts whose bursts are `g` apart at each sees them about `g / h` apart and wastes no
//! refill while `g / h <= burst / rate`; a host at share `s` must then bank `s x rate x g <= h
//! x s x burst` of its own refill between its bursts. So the holders hold at most
//! `sum(max(1, h x s_i))` bursts: `h` with an even split, at most `2h - 1`.
//!
//! # The TAT's time, marked in its lowest bit
//! A TAT kept at a share (`tat - now` stretched by `1 / s`) has bit 0 set ([`STRETCHED`]); one
//! kept at the whole rate has it clear. Every write of a cluster-scoped limit's TAT sets that
//! bit (rounding the TAT up by at most 1 ns: a packet may cost 1 ns more, never less), and its
//! costs are even, so a fetch-and-add keeps the bit. A charge first brings the TAT it read into
//! the time it charges in (`tat - now` scaled by `from / to`, rounded up), inside the same
//! compare-and-swap that writes the charge: so when the shares lapse (the agent stopped,
//! `Config::shares_until_ns` passed), a stretched TAT is read back at the whole rate with the
//! debt it held, never as a debt of `1 / s` times its time (fail open), and a TAT is never
//! converted twice. Which share stretched a TAT is the bucket's word now: the agent changes word
//! and TATs in the order that makes every state in between read as fewer tokens than the state
//! before or after (see `MappedStore::set_share`).
//!
//! # What a conversion keeps
//! When the agent changes a bucket's field it keeps the bucket's tokens, at most what the new
//! field holds ([`interim`], [`settle`]): a share that grows gives room, never tokens the refill
//! did not bring, so what a bucket admits over any interval is at most what it held at the start
//! plus its refill meanwhile. When the shares lapse or come back, the program's charge keeps the
//! debt in the whole rate's time instead, `(tat - now) x s` ([`base`]): it has no capacities to
//! compare, and at the whole rate it fails open.

use crate::{share_cost, HOLDERS_MASK, HOLDERS_SHIFT, SHARE_FIELD_MASK, SHARE_MASK, SHARE_ONE};

/// Bit 0 of a cluster-scoped limit's TAT: set when the TAT is kept in its share's time (see the
/// module docs), clear when in the whole rate's.
pub const STRETCHED: u64 = 1;

/// The domain of one charge of a limit's bucket, in one word (few registers: the program's
/// frame has no stack to spare): bits 0..22 the bucket's share field (its word in bits 0..16,
/// its holders in 16..22, where [`crate::Bucket::created_share`] keeps them), bit 22 whether
/// shares are in force, bit 23 whether the limit is cluster-scoped. 0: not cluster-scoped (plain
/// GCRA).
pub type Domain = u64;

const IN_FORCE: u64 = 1 << 22;
const CLUSTER: u64 = 1 << 23;

/// The [`Domain`] of a charge: `cluster` (the limit has `rule_flags::CLUSTER`), the bucket's
/// share field `field` (the low bits of its `created_share`: word and holders), `in_force`
/// (`now < Config::shares_until_ns`).
#[inline(always)]
#[must_use]
pub const fn domain(cluster: bool, field: u64, in_force: bool) -> Domain {
    if !cluster {
        return 0;
    }
    CLUSTER | (field & SHARE_FIELD_MASK) | if in_force { IN_FORCE } else { 0 }
}

/// The share field (word and holders) of share word `word` among `holders` hosts, as
/// [`crate::Bucket::created_share`] keeps it (holders capped at [`crate::HOLDERS_MAX`]); 0 for
/// word 0 (no share: the whole rate, whatever the holders).
#[inline(always)]
#[must_use]
pub const fn field(word: u64, holders: u64) -> u64 {
    if word & SHARE_MASK == 0 {
        return 0;
    }
    let h = if holders > crate::HOLDERS_MAX {
        crate::HOLDERS_MAX
    } else {
        holders
    };
    (word & SHARE_MASK) | h << HOLDERS_SHIFT
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

/// The holders a bucket in `dom` counts its capacity by: its field's, at least 1.
#[inline(always)]
#[must_use]
pub const fn holders(dom: Domain) -> u64 {
    let h = (dom & HOLDERS_MASK) >> HOLDERS_SHIFT;
    if h == 0 {
        1
    } else {
        h
    }
}

/// The mark ([`STRETCHED`] or 0) a charge in `dom` writes into a TAT: 1 at a share in force, 0
/// at the whole rate (and for a limit that is not cluster-scoped). Arithmetic, no branch: the
/// program computes it once per charge.
#[inline(always)]
#[must_use]
pub const fn mark(dom: Domain) -> u64 {
    // (word + 0xffff) >> 16 is 1 for a word of 1..=0xffff, 0 for 0.
    ((dom >> 22) & marked(dom)) & (((dom & SHARE_MASK) + SHARE_MASK) >> 16)
}

/// 1 when a charge in `dom` is of a cluster-scoped limit (its TATs carry the mark), else 0.
#[inline(always)]
#[must_use]
pub const fn marked(dom: Domain) -> u64 {
    (dom >> 23) & 1
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
/// `burst x cost`, the whole burst at any share, or at a share `holders x tolerance` if more (a
/// bucket at share `s` holds `holders x s` bursts); plus [`slack`] for the TAT's mark and
/// conversions.
#[inline(always)]
#[must_use]
pub const fn pkt_tolerance(tolerance: u64, interval: u64, cost: u64, dom: Domain) -> u64 {
    if dom & CLUSTER == 0 || interval == 0 {
        return tolerance;
    }
    held(mul_sat(tolerance / interval, cost), tolerance, dom).saturating_add(slack(cost))
}

/// The byte tolerance in `dom` of a limit whose whole-rate byte tolerance is `tolerance`, for a
/// packet whose bytes cost `cost` ([`cost`]): as [`pkt_tolerance`], the whole bytes burst
/// stretched by the share, or `holders x tolerance` if more, plus [`slack`].
#[inline(always)]
#[must_use]
pub const fn byte_tolerance(tolerance: u64, cost: u64, dom: Domain) -> u64 {
    if dom & CLUSTER == 0 {
        return tolerance;
    }
    held(share_cost(tolerance, charged_word(dom)), tolerance, dom).saturating_add(slack(cost))
}

/// `holders x word` from which a holder is heavy (1.5 times an even share, in units of
/// [`SHARE_ONE`]): it holds `holders x s` bursts.
pub const HEAVY: u64 = SHARE_ONE * 3 / 2;

/// What a cluster-scoped bucket in `dom` holds, in its time: the burst (`burst`, stretched by
/// the share at a share) and, for a heavy holder at a share, `holders x tolerance` if more.
#[inline(always)]
const fn held(burst: u64, tolerance: u64, dom: Domain) -> u64 {
    let word = charged_word(dom);
    // Only a heavy holder, at least HEAVY times an even share (`holders x s >= HEAVY`), holds
    // more than the burst: an even split's shares, computed from figures a round old, wobble
    // around `1 / holders`, and a bucket that grew with the wobble banked its excess refill (2
    // hosts with interleaved bursts admitted 1.07 of one bucket on a loaded machine).
    if word == 0 || holders(dom) * word < HEAVY {
        return burst;
    }
    let h = mul_sat(holders(dom), tolerance);
    if h > burst {
        h
    } else {
        burst
    }
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

/// One GCRA step: a packet of cost `cost` (in `dom`'s time: [`cost`]) charged to a TAT read as
/// `old`, already in the time the charge writes ([`base`]), judged at `now` against `tolerance`
/// (in `dom`'s time) from no earlier than `floor` (`now` on the precise clock; an upper bound of
/// the true time on the coarse one). `Ok(new TAT)`, marked for `dom` ([`seal`], by arithmetic),
/// when it conforms; else `Err(until)`: no packet of this cost conforms before `until`.
///
/// The program (`ratelimit-ebpf`'s `gcra`) takes this step inside its compare-and-swap loop in a
/// copy of its own: calling this function there, inlined, took the verifier from 392k to 490k
/// instructions (the same source, shaped differently by LLVM). `cluster_shares.rs`'s
/// `the_program_charges_a_cluster_bucket_as_the_shared_arithmetic_says` holds the two to one
/// result, through [`admit`].
#[inline(always)]
pub const fn step(
    old: u64,
    (now, floor): (u64, u64),
    cost: u64,
    tolerance: u64,
    dom: Domain,
) -> Result<u64, u64> {
    let base = if old > floor { old } else { floor };
    let new = base + cost;
    // seal(new, dom) for the costs a charge in `dom` pays (even for a cluster-scoped limit).
    let new = new + ((new & marked(dom)) ^ mark(dom));
    if new - now > tolerance {
        Err(new - tolerance)
    } else {
        Ok(new)
    }
}

/// `k` packets of whole-rate cost `interval` arriving together at `now` at a bucket whose TAT is
/// `*tat`, of a limit whose whole-rate tolerance is `tolerance`, charged in `dom` as the program
/// charges each ([`base`], then [`step`] per packet on the precise clock): the number that
/// conform, the TAT moved past them. In one step rather than `k`, for the cluster simulator
/// (`ratelimit-userspace`'s `cluster::sim`); a test holds it to `k` calls of [`step`].
#[must_use]
pub fn admit(tat: &mut u64, now: u64, k: u64, interval: u64, tolerance: u64, dom: Domain) -> u64 {
    let cost = self::cost(interval, dom);
    let tol = pkt_tolerance(tolerance, interval, cost, dom);
    let from = base(*tat, now, dom);
    let from = if from > now { from } else { now };
    let room = (now + tol).saturating_sub(from) / cost.max(1);
    let mut n = if k < room { k } else { room };
    // The mark may round the last TAT up by 1 ns past the tolerance (the step refuses it then);
    // below the last, a whole cost (at least 2 for a cluster-scoped limit) is to spare.
    if n > 0 && seal(from + n * cost, dom) - now > tol {
        n -= 1;
    }
    if n > 0 {
        *tat = seal(from + n * cost, dom);
    }
    n
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

/// `d x num / den` rounded down and saturating, without 128-bit arithmetic; `num` and `den` in
/// 1..=[`SHARE_ONE`].
#[inline(always)]
const fn scale_down(d: u64, num: u64, den: u64) -> u64 {
    if num == den || den == 0 {
        return d;
    }
    mul_sat(d / den, num).saturating_add((d % den) * num / den)
}

/// The share a field's word stands for, in units of 1 / [`SHARE_ONE`]: [`SHARE_ONE`] for none.
#[inline(always)]
const fn share_of(field: u64) -> u64 {
    effective(field & SHARE_MASK)
}

/// The debt, in the whole rate's ns, the program reads in `tat` at `now` for a bucket whose
/// share field is `field` (shares in force): a stretched TAT's lead in its word's time, scaled
/// back by the share (rounded up), or an unmarked TAT's lead as it is; 0 for a full bucket.
#[inline(always)]
#[must_use]
pub const fn debt(tat: u64, now: u64, field: u64) -> u64 {
    if tat <= now {
        return 0;
    }
    if tat & STRETCHED != 0 {
        rescale(tat - now, share_of(field), SHARE_ONE)
    } else {
        tat - now
    }
}

/// The TAT that reads as `debt` (whole-rate ns, see [`debt`]) at `now` under `field`, marked for
/// its time: stretched by the share (rounded up: never less debt).
#[inline(always)]
#[must_use]
pub const fn tat_of(debt: u64, now: u64, field: u64) -> u64 {
    let dom = domain(true, field, true);
    seal(
        now.saturating_add(rescale(debt, SHARE_ONE, share_of(field))),
        dom,
    )
}

/// What a bucket of a limit with whole-rate tolerance `tolerance` and packet interval `cost`
/// (0 for a byte limit) holds under `field`, in the whole rate's ns (rounded down): its
/// tolerance in the field's time ([`pkt_tolerance`], [`byte_tolerance`] without slack) scaled
/// back by the share. Its tokens are this less its [`debt`].
#[must_use]
pub const fn capacity(tolerance: u64, cost: u64, field: u64) -> u64 {
    if field & SHARE_MASK == 0 {
        return tolerance;
    }
    let dom = domain(true, field, true);
    let c = self::cost(cost, dom);
    let burst_cost = match tolerance.checked_div(cost) {
        Some(burst) => mul_sat(burst, c),
        None => share_cost(tolerance, field & SHARE_MASK),
    };
    scale_down(held(burst_cost, tolerance, dom), share_of(field), SHARE_ONE)
}

/// The first of the agent's three writes when a bucket's share field changes from `from` to
/// `to` (capacities `k_from`, `k_to`: [`capacity`]), its TAT read as `tat` at `now`. The bucket
/// keeps its tokens, at most what it holds under `to`: a share that grows gives room, not
/// tokens (keeping the debt instead, a flooded heavy host, empty at 1 burst, would find 6
/// bursts of tokens when its share grew sevenfold). Returns a TAT, kept in `from`'s time, that
/// reads as no more than those tokens under either field, so that the program, reading it
/// before the field is written or after, admits no more than the bucket keeps; and the tokens
/// (whole-rate ns) it withholds under `to`, which [`settle`] gives back once the field is.
#[must_use]
pub const fn interim(tat: u64, now: u64, from: u64, to: u64, k_from: u64, k_to: u64) -> (u64, u64) {
    // The debt that keeps the tokens under `to`: max(k_to - (k_from - debt), 0).
    let keep = (k_to.saturating_add(debt(tat, now, from))).saturating_sub(k_from);
    // Under `from`, the same tokens are a debt of k_from - (k_to - keep).
    let need_from = (k_from.saturating_add(keep)).saturating_sub(k_to);
    // Under `to`, a lead kept in `from`'s time reads scaled by to / from when stretched.
    let via_to = if from & SHARE_MASK != 0 {
        rescale(keep, share_of(from), share_of(to))
    } else {
        keep
    };
    let d = if via_to > need_from {
        via_to
    } else {
        need_from
    };
    let t = tat_of(d, now, from);
    (t, debt(t, now, to).saturating_sub(keep))
}

/// The last of the agent's writes (see [`interim`]): the TAT that gives back the `withheld`
/// tokens (whole-rate ns) to a bucket under `to` whose TAT reads `tat` at `now` (the interim,
/// less what the program charged since, more what refilled).
#[must_use]
pub const fn settle(tat: u64, now: u64, to: u64, withheld: u64) -> u64 {
    tat_of(debt(tat, now, to).saturating_sub(withheld), now, to)
}

/// The TAT a bucket's share field change from `from` to `to` leaves when nothing charges it in
/// between: [`interim`], then [`settle`] (the cluster simulator's and the tests' one step).
#[must_use]
pub const fn rewrite(tat: u64, now: u64, from: u64, to: u64, k_from: u64, k_to: u64) -> u64 {
    let (t, withheld) = interim(tat, now, from, to, k_from, k_to);
    settle(t, now, to, withheld)
}

/// Tokens (in units of the whole-rate cost `cost`) a bucket holds at `now` whose TAT is `tat`,
/// tolerance `tolerance` (whole rate), share field `field` (word and holders, see [`field`]):
/// `(tolerance - (tat - now)) / cost` for a TAT at the whole rate, its [`capacity`] less its
/// [`debt`] over `cost` for a stretched one; negative: in debt.
#[cfg(any(feature = "user", test))]
#[must_use]
#[expect(clippy::cast_precision_loss, reason = "display")]
pub fn tokens(tat: u64, now: u64, tolerance: u64, cost: f64, field: u64) -> f64 {
    if tat & STRETCHED == 0 {
        return (tolerance as f64 - tat.saturating_sub(now) as f64) / cost;
    }
    (capacity(tolerance, 0, field) as f64 - debt(tat, now, field) as f64) / cost
}

#[cfg(test)]
mod tests;
