//! A source's first packet without a bucket: what the program writes in a first-packet slot
//! (the words of a line of [`map_names::BUCKET_TAGS`] after its tags: [`crate::tags`]), and
//! which limits it does it for.
//!
//! Making a bucket costs a new key its whole creation (choosing a victim among its 8 candidate
//! records, claiming and writing one, checking no other CPU made the same key's bucket), and a
//! spoofed flood sends nothing but new keys, one packet each. Exact GCRA admits a key's packet
//! whenever its bucket is full, and a key with no bucket (never seen, or evicted once full) has
//! a full one. So a key that has no record passes without one, and the program writes in a slot
//! of the key's line (the line of its sets' tags, which it has just read to learn it has no
//! record) when its bucket would be full again: `t + interval`, `t` no earlier than the packet's
//! true time. The key's next packet, if it comes before then, makes its bucket owing that time
//! ([`first_owed`]): the first packet is charged, late but in full, so the bucket holds no more
//! than exact GCRA's would. If it comes later, it makes the bucket full: a key passes free once,
//! and a source that keeps sending has a bucket from its second packet on.
//!
//! A slot is one word: that time, exact (modulo [`FIRST_TIME_MASK`]), and in the top bits a
//! fingerprint of the key's hash. Another key may take a slot only once its time has passed (a
//! compare-and-swap); a key whose line's slots all hold other keys' times still ahead makes its
//! bucket as any new key does (full: it has had no free packet there since its own time passed).
//! A fingerprint that matches by chance only makes a bucket owe what it did not: fewer tokens,
//! never more.
//!
//! A line has [`FIRST_LINE_WORDS`] slots for the keys of its [`crate::TAG_LINE_RECORDS`] records'
//! group ([`crate::first_line`]): 2^17 at the default 2^20 records, and as many in a smaller
//! store ([`crate::FIRST_MIN_LINES`]). A flood of new keys at `n` a second under a limit whose
//! slot is held `T` (its interval, and on the coarse clock the lag allowance) holds about `n x T`
//! slots at once: a quarter of them at 0.9 Mpps and 35 ms, and a key finds its line's 4 slots all
//! held about as often as a quarter to the fourth, 0.4% (arithmetic, not measured). Past that, more
//! new keys find their line full and make buckets as without the slots.

#[cfg(doc)]
use crate::map_names;
use crate::{rule_flags, FIRST_LINE_WORDS};

/// The low bits of a slot: the time, in ns, modulo 2^40 (18 minutes); the top 24 hold the key's
/// fingerprint. A time is read as the nearest one ahead of the reader's `now` within the
/// longest a key's bucket can be from full ([`FIRST_MAX_INTERVAL_NS`] and the clock's lag), else
/// as past: a slot left for 18 minutes may read as ahead again, which only makes a bucket owe (its
/// own key's: at most its interval) or be made full (another key's).
pub const FIRST_TIME_MASK: u64 = (1 << 40) - 1;

/// The longest interval between packets (`1 / rate`) of a limit whose keys' first packets pass
/// without a bucket (about 68 s; rates are whole packets a second): a slower limit's keys make
/// their buckets at once.
pub const FIRST_MAX_INTERVAL_NS: u64 = 1 << 36;

/// The fingerprint of a key whose bucket hash is `hash`, in a slot word's top bits: 23 bits
/// (20..43), which the choice of its line (its page, the top bits; its group of sets, bits 0..4)
/// does not depend on; never 0, so an empty slot (0) holds no key's.
#[inline(always)]
#[must_use]
pub const fn first_fingerprint(hash: u64) -> u64 {
    ((hash >> 20) & 0x7f_ffff | 1 << 23) << 40
}

/// The slot word of a key with fingerprint `fp` whose bucket is full again at `until`.
#[inline(always)]
#[must_use]
pub const fn first_stamp(until: u64, fp: u64) -> u64 {
    until & FIRST_TIME_MASK | fp
}

/// What a key with fingerprint `fp` and no record, under a limit whose bucket is at most `span`
/// ns from full after one packet (its interval and the clock's lag), reads in its slot word `word`
/// at `now` (no later than the true time): 0 if the slot is free to take (empty, or another key's
/// whose time has passed), so the packet passes without a bucket; 1 for a bucket as any new
/// key's, full: another key's time is still ahead there, or the key's own has passed (the key
/// is back: a source that keeps sending gets its bucket at its second packet, and with it the
/// per-CPU cache of its record, rather than a lookup of its 8 candidates every packet); else
/// the time this key's bucket owes until, its first packet's charge (a bucket made now starts
/// from it).
#[inline(always)]
#[must_use]
pub const fn first_owed(word: u64, fp: u64, now: u64, span: u64) -> u64 {
    let ahead = word.wrapping_sub(now) & FIRST_TIME_MASK;
    let own = word & !FIRST_TIME_MASK == fp;
    // How far ahead a time can be: its own key's span, or any limit's interval and lag.
    let most = if own {
        span
    } else {
        FIRST_MAX_INTERVAL_NS << 1
    };
    let past = ahead == 0 || ahead > most;
    if word == 0 || past && !own {
        0
    } else if own && !past {
        now + ahead
    } else {
        1
    }
}

/// What a key with fingerprint `fp` and no record does with its line's slots ([`first_pick`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FirstPick {
    /// Its first packet passed in this line before, and its bucket would not be full yet: a
    /// bucket made now owes until then ([`first_owed`]).
    Owed(u64),
    /// A bucket as any new key's, full: its own time there has passed (it is back), or every
    /// slot of the line holds another key's time still ahead.
    Make,
    /// Slot `k` (holding `old`) is free to take with a compare-and-swap: the packet passes
    /// without a bucket.
    Take {
        /// The slot.
        k: u32,
        /// What it holds.
        old: u64,
    },
}

/// [`first_owed`] over a line, whose slot `k` reads `read(k)`: the key's own time ahead wins
/// (the latest, if a race left two), then its own time passed, then the first free slot.
#[inline(always)]
pub fn first_pick(read: impl Fn(u32) -> u64, fp: u64, now: u64, span: u64) -> FirstPick {
    let mut owed = 0;
    let mut back = false;
    let mut take = None;
    for k in 0..FIRST_LINE_WORDS {
        let word = read(k);
        match first_owed(word, fp, now, span) {
            0 => {
                if take.is_none() {
                    take = Some((k, word));
                }
            }
            1 => back |= word & !FIRST_TIME_MASK == fp,
            t => owed = if t > owed { t } else { owed },
        }
    }
    if owed != 0 {
        FirstPick::Owed(owed)
    } else if back {
        FirstPick::Make
    } else if let Some((k, old)) = take {
        FirstPick::Take { k, old }
    } else {
        FirstPick::Make
    }
}

/// Whether a slot of the line other than `mine` holds the key's own time still ahead: after
/// taking slot `mine`, a packet that finds one passes not free but makes the key's bucket (two
/// CPUs that took two slots of the line for one key at once: the later one's look sees the
/// earlier's, so at most one passes free).
#[inline(always)]
pub fn first_owed_elsewhere(
    read: impl Fn(u32) -> u64,
    fp: u64,
    now: u64,
    span: u64,
    mine: u32,
) -> bool {
    let mut found = false;
    for k in 0..FIRST_LINE_WORDS {
        if k != mine && first_owed(read(k), fp, now, span) > 1 {
            found = true;
        }
    }
    found
}

/// Whether a limit with flags `flags` and packet interval `interval` (ns) lets a key's first
/// packet pass without a bucket ([`rule_flags::FIRST_FREE`]): a packet limit alone, not
/// cluster-scoped, of an interval the slot's time can span. A byte limit's first charge depends
/// on the packet's size, which the slot does not keep; a cluster-scoped bucket is what the agent
/// reads a host's demand from (a key that sends one packet to each host would be seen by none).
#[inline(always)]
#[must_use]
pub const fn first_packet_free(flags: u32, interval: u64) -> bool {
    flags & (rule_flags::PKT_LIMIT | rule_flags::BYTE_LIMIT | rule_flags::CLUSTER)
        == rule_flags::PKT_LIMIT
        && interval <= FIRST_MAX_INTERVAL_NS
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::{vec, vec::Vec};

    use super::*;

    const T: u64 = 10_000_000;

    /// A line's slots.
    type Line = [u64; FIRST_LINE_WORDS as usize];

    /// Free once another key's time has passed; owed until exactly the time stamped by its own
    /// key before; another key's time ahead, or its own passed, makes a full bucket.
    #[test]
    fn a_slot_is_free_owed_or_another_keys() {
        let (mine, other) = (first_fingerprint(1 << 20), first_fingerprint(2 << 20));
        assert_ne!(mine, other);
        for now in [
            0,
            1,
            5 << 47,
            FIRST_TIME_MASK - 3,
            FIRST_TIME_MASK + 7,
            u64::MAX / 2,
        ] {
            let until = now + T;
            let w = first_stamp(until, mine);
            assert_eq!(first_owed(0, mine, now, T), 0, "an empty slot");
            assert_eq!(first_owed(w, mine, until, T), 1, "{now}: back, a bucket");
            assert_eq!(first_owed(w, other, until, T), 0, "{now}");
            assert_eq!(first_owed(w, mine, until + 5, T), 1, "{now}");
            assert_eq!(first_owed(w, other, until + 5, T), 0, "{now}");
            assert_eq!(first_owed(w, mine, now, T), until, "{now}");
            assert_eq!(first_owed(w, mine, until - 1, T), until, "{now}");
            assert_eq!(first_owed(w, other, now, T), 1, "{now}");
            // Read 18 minutes on: a full bucket, or owing at most the key's span.
            let later = now + (1 << 40);
            assert!(first_owed(w, mine, later, T) <= later + T);
            assert_ne!(first_owed(w, mine, later, T), 0);
        }
    }

    /// A stamp made by a key's own packet never reads as further ahead than that key's span, so
    /// a slot of another time (a wrapped one) is never owed for longer.
    #[test]
    fn a_key_never_owes_more_than_its_span() {
        let fp = first_fingerprint(7 << 20);
        for word_time in [0u64, 1, 1 << 40, 1 << 47, FIRST_TIME_MASK] {
            for now in [0u64, 3, 1 << 30, 1 << 47, 1 << 50] {
                let owed = first_owed(first_stamp(word_time, fp), fp, now, T);
                assert!(
                    owed == 1 || (owed > now && owed <= now + T),
                    "{word_time} {now}"
                );
            }
        }
    }

    /// A tiny deterministic generator (splitmix64) for the simulations below.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// Exact GCRA: `tat` moves to `max(tat, t) + interval` when that is at most `tolerance`
    /// ahead of `t`.
    fn gcra(tat: &mut u64, t: u64, interval: u64, tolerance: u64) -> bool {
        let new = (*tat).max(t) + interval;
        if new - t > tolerance {
            return false;
        }
        *tat = new;
        true
    }

    /// The program's decision for one packet of key `k` at true time `t`, as `first::owed` and
    /// `bucket::charge_new` make it: the key's line read at `judge` (no later than `t`), a slot
    /// taken stamped from `start` (no earlier than `t`) plus the interval, a bucket made owing
    /// its own time there (on a lagging clock, no later than `t` plus an interval); the store's
    /// buckets (in `buckets`) charged by exact GCRA at `t`.
    fn program(
        (buckets, lines): (&mut [Option<u64>], &mut [Line]),
        (k, line, fp): (usize, usize, u64),
        (t, judge, start, lag): (u64, u64, u64, u64),
        (interval, tolerance): (u64, u64),
    ) -> bool {
        if let Some(tat) = buckets[k].as_mut() {
            return gcra(tat, t, interval, tolerance);
        }
        let l = &mut lines[line];
        let span = interval + lag;
        match first_pick(|i| l[i as usize], fp, judge, span) {
            FirstPick::Take { k: i, old } => {
                assert_eq!(l[i as usize], old);
                l[i as usize] = first_stamp(start + interval, fp);
                assert!(!first_owed_elsewhere(|i| l[i as usize], fp, judge, span, i));
                true
            }
            FirstPick::Make => {
                let mut tat = 0;
                let ok = gcra(&mut tat, t, interval, tolerance);
                buckets[k] = Some(tat);
                ok
            }
            FirstPick::Owed(owed) => {
                assert!(
                    owed > judge && owed <= judge + span,
                    "owed {owed} at {judge}"
                );
                // Stamped on the lagging clock: capped at this packet's true time plus an
                // interval, as the program caps it on a limit born on the coarse clock.
                let owed = if lag > 0 {
                    owed.min(t + interval)
                } else {
                    owed
                };
                let mut tat = owed;
                let ok = gcra(&mut tat, t, interval, tolerance);
                buckets[k] = Some(tat);
                ok
            }
        }
    }

    /// Bursty arrivals (back to back runs of 1 to 3 x burst, then gaps of up to 3 intervals) for
    /// `keys` keys on lines of 4 slots, buckets evicted at random once full (as the store evicts a
    /// refilled one first). On the precise clock with a line for each key, the program admits
    /// exactly what exact GCRA admits, packet for packet; with up to 24 keys sharing one line (so
    /// that it fills), and on a clock that lags the true time by up to its allowance (the line
    /// judged on the lagging time, a slot stamped from it plus the allowance), no key ever gets
    /// more than `burst + rate x t` in any interval. 3,000 cases of 600 packets.
    #[test]
    fn first_packets_admit_what_exact_gcra_admits_and_never_more() {
        for case in 0..3_000u64 {
            let mut rng = Rng(case);
            let shared = case % 3 == 1;
            let lagging = case % 3 == 2;
            let keys = if shared {
                5 + rng.below(20) as usize
            } else {
                1 + rng.below(8) as usize
            };
            let n_lines = if shared { 1 } else { keys };
            let interval = 1_000 + rng.below(50_000_000);
            let burst = 1 + rng.below(6);
            let tolerance = burst * interval;
            let lag = if lagging { rng.below(4 * interval) } else { 0 };
            let fps: Vec<u64> = (0..keys)
                .map(|k| first_fingerprint((k as u64 + 1) << 20))
                .collect();
            let mut buckets = vec![None; keys];
            let mut lines = vec![[0u64; FIRST_LINE_WORDS as usize]; n_lines];
            let mut exact = vec![0u64; keys];
            let mut admitted: Vec<Vec<u64>> = vec![Vec::new(); keys];
            let mut t = 1_000_000_000 + rng.below(1 << 40);
            let mut left = 0u64;
            let mut k = 0;
            let mut judged = 0;
            for _ in 0..600 {
                if left == 0 {
                    t += rng.below(3 * interval + 1);
                    k = rng.below(keys as u64) as usize;
                    left = 1 + rng.below(3 * burst);
                }
                left -= 1;
                t += rng.below(interval / 8 + 1);
                // A full bucket may be evicted at any time: nothing is lost.
                let j = rng.below(keys as u64) as usize;
                if buckets[j].is_some_and(|tat| tat <= t) && rng.below(4) == 0 {
                    buckets[j] = None;
                }
                // The lagging clock never goes back.
                judged = (t - rng.below(lag + 1)).max(judged);
                let ours = program(
                    (&mut buckets, &mut lines),
                    (k, k % n_lines, fps[k]),
                    (t, judged, judged + lag, lag),
                    (interval, tolerance),
                );
                let theirs = gcra(&mut exact[k], t, interval, tolerance);
                if !shared && !lagging {
                    assert_eq!(ours, theirs, "case {case}: key {k} at {t}");
                }
                if ours {
                    admitted[k].push(t);
                }
            }
            for (k, times) in admitted.iter().enumerate() {
                for (i, &a) in times.iter().enumerate() {
                    for (j, &b) in times.iter().enumerate().skip(i) {
                        let allowed = burst + (b - a) / interval;
                        assert!(
                            (j - i + 1) as u64 <= allowed,
                            "case {case}: key {k} passed {} in {} ns (burst {burst}, interval \
                             {interval}, lag {lag})",
                            j - i + 1,
                            b - a
                        );
                    }
                }
            }
        }
    }

    /// A line: the key's own time ahead is owed (the latest of two), its own time passed makes a
    /// bucket, else the first free slot is taken, and a full line makes a bucket.
    #[test]
    fn a_line_picks_owed_then_back_then_free() {
        let (mine, other) = (first_fingerprint(1 << 20), first_fingerprint(2 << 20));
        let now = 5_000_000_000;
        let ahead = |fp| first_stamp(now + T / 2, fp);
        let passed = |fp| first_stamp(now - 1, fp);
        let pick = |l: Line| first_pick(|i| l[i as usize], mine, now, T);
        assert_eq!(pick([0; 4]), FirstPick::Take { k: 0, old: 0 });
        let mut l = [ahead(other); 4];
        assert_eq!(pick(l), FirstPick::Make, "a full line");
        l[2] = passed(other);
        assert_eq!(pick(l), FirstPick::Take { k: 2, old: l[2] });
        l[1] = passed(mine);
        assert_eq!(pick(l), FirstPick::Make, "back: its own time passed");
        l[3] = ahead(mine);
        l[0] = first_stamp(now + T / 4, mine);
        assert_eq!(pick(l), FirstPick::Owed(now + T / 2), "the latest own time");
        assert!(first_owed_elsewhere(|i| l[i as usize], mine, now, T, 3));
        l[0] = 0;
        assert!(!first_owed_elsewhere(|i| l[i as usize], mine, now, T, 3));
    }

    #[test]
    fn only_a_packet_limit_alone_and_not_cluster_scoped() {
        use rule_flags::{BYTE_LIMIT, CLUSTER, COARSE_CLOCK, PKT_LIMIT};
        assert!(first_packet_free(PKT_LIMIT, T));
        assert!(first_packet_free(PKT_LIMIT | COARSE_CLOCK, T));
        assert!(!first_packet_free(PKT_LIMIT, FIRST_MAX_INTERVAL_NS + 1));
        assert!(!first_packet_free(PKT_LIMIT | BYTE_LIMIT, T));
        assert!(!first_packet_free(BYTE_LIMIT, T));
        assert!(!first_packet_free(PKT_LIMIT | CLUSTER, T));
        assert!(!first_packet_free(0, T));
        // The program's reading of the flag agrees, and refuses it beside what the agent never
        // sets it with.
        use rule_flags::{first_free_in_force, FIRST_FREE};
        for flags in [PKT_LIMIT, PKT_LIMIT | COARSE_CLOCK] {
            assert!(first_packet_free(flags, T) && first_free_in_force(flags | FIRST_FREE));
        }
        for flags in [PKT_LIMIT | BYTE_LIMIT, PKT_LIMIT | CLUSTER, BYTE_LIMIT, 0] {
            assert!(!first_free_in_force(flags | FIRST_FREE), "{flags:#x}");
        }
        assert!(!first_free_in_force(PKT_LIMIT));
    }
}
