//! The XDP program's coarse clock: how far it may lag the true time.

/// How far, in ticks of the coarse clock, the XDP program's coarse clock (`bpf_ktime_get_coarse_ns`,
/// cached per jiffy per CPU) is taken to lag the true time at most: 8.
///
/// The coarse clock is the time of the kernel's last timekeeping update, accumulated in whole
/// intervals of about a tick (up to a tick of remainder left out), and the update comes once a
/// tick. When the CPU that does it is held up (a vCPU the host preempted, a long section with
/// interrupts off), jiffies and the coarse clock stall until another CPU's tick forces an update,
/// after `MAX_STALLED_JIFFIES` (5) of its own ticks without one (kernel/time/tick-sched.c): the
/// remainder, the tick it took to notice, the 5 stalled ones and the update's own delay stay
/// under 8. A fixed 10 ms (one tick at HZ=100) did not hold: on a 2-vCPU VM at HZ=250 (4 ms
/// ticks) the coarse clock was seen 13.7 ms behind within 30 s under load.
///
/// A charge on the coarse clock is exact as long as the lag stays under
/// [`coarse_lag_ns`]`(tick)`: wherever the lag could change a verdict or a bucket's state (a
/// bucket that may be full, a packet the coarse clock would drop, a drop window that may be
/// over), the program reads the precise clock (see its `bucket::clock`).
pub const COARSE_LAG_TICKS: u64 = 8;

/// The lag the program allows its coarse clock on a kernel whose tick is `tick_ns` (the
/// resolution of `CLOCK_MONOTONIC_COARSE`): [`COARSE_LAG_TICKS`] ticks, of at least 1 ms (the
/// shortest tick Linux has, HZ=1000: a smaller resolution is not a tick), or
/// [`COARSE_LAG_DEFAULT_NS`] for a tick of 0 (unknown). The agent gives it to the program when
/// it loads it (the global [`COARSE_LAG_GLOBAL`]).
#[must_use]
pub const fn coarse_lag_ns(tick_ns: u64) -> u64 {
    const MIN_TICK_NS: u64 = 1_000_000;
    if tick_ns == 0 {
        COARSE_LAG_DEFAULT_NS
    } else if tick_ns < MIN_TICK_NS {
        COARSE_LAG_TICKS * MIN_TICK_NS
    } else {
        COARSE_LAG_TICKS.saturating_mul(tick_ns)
    }
}

/// How many times what the coarse clock's lag allowance refills a limit's burst must be for the
/// limit to run on the coarse clock alone ([`crate::rule_flags::COARSE_ONLY`]): a full bucket
/// then withholds at most `1 / COARSE_ONLY_FACTOR` (1%) of its burst.
pub const COARSE_ONLY_FACTOR: u64 = 100;

/// Whether a limit of tolerance `tolerance_ns`, charged in whole units of `unit_ns` (a packet's
/// interval; a full frame's cost for a byte limit), may run on the coarse clock alone where its lag allowance is
/// `lag_ns` ([`coarse_lag_ns`]): a back-to-back burst on a full bucket then loses the units the
/// allowance refills, rounded up to a whole one (`rate = 1, burst = 5` would lose a packet of
/// its 5), so the burst must hold [`COARSE_ONLY_FACTOR`] times that many.
#[must_use]
pub const fn coarse_only(tolerance_ns: u64, unit_ns: u64, lag_ns: u64) -> bool {
    let unit = if unit_ns == 0 { 1 } else { unit_ns };
    tolerance_ns / unit >= COARSE_ONLY_FACTOR.saturating_mul(lag_ns.div_ceil(unit))
}

/// Bit 63 of a packet TAT ([`crate::Bucket::tat_ns`]) of a limit with
/// [`crate::rule_flags::BORN_COARSE`]: the bucket was made on the coarse clock and its first
/// packet's true time is not settled yet. The other bits are the TAT as charged from the coarse
/// time `birth`, which the bucket's `byte_tat_ns` holds (such a limit has no byte limit); its
/// next charge settles it ([`settle_birth`]). CLOCK_MONOTONIC reaches bit 63 after 292 years.
pub const TAT_UNSETTLED: u64 = 1 << 63;

/// A packet TAT marked [`TAT_UNSETTLED`], settled by a charge at `now` (the precise clock) of
/// its bucket born at coarse time `birth`, where the coarse clock lags the true time by at most
/// `lag`: the TAT plus `min(lag, now - birth)`.
///
/// The first packet came at a true time `t1` in `[birth, birth + lag]`, and no later than `now`:
/// exact GCRA's TAT is `t1 + c`, the marked one `birth + c`. Settled to
/// `min(birth + lag, now) + c`, it is never below exact's (no interval admits more than
/// `burst + rate x t`), and it is at most `now + c`: the bucket then holds at least one token
/// fewer than full, and exact's at most full, so it admits at most one packet fewer than exact
/// GCRA until it is next full
/// (`rule_flags::BORN_COARSE` asks for a burst of at least [`COARSE_ONLY_FACTOR`] packets, so
/// that packet is at most 1% of it). A refund of the first packet (a later limit of its rule
/// dropped it) leaves `birth` marked, which settles to a full bucket. An unmarked TAT is
/// returned as it is.
#[must_use]
pub const fn settle_birth(tat: u64, birth: u64, now: u64, lag: u64) -> u64 {
    if tat & TAT_UNSETTLED == 0 {
        return tat;
    }
    let since = now.saturating_sub(birth);
    (tat & !TAT_UNSETTLED) + if since < lag { since } else { lag }
}

/// Whether a bucket whose packet TAT is `tat` (marked [`TAT_UNSETTLED`] or not) is full at the
/// true time for certain, judged at coarse time `now`, which lags the true time by at most
/// `lag`: its TAT, settled at most `lag` later if marked ([`settle_birth`]), is no later than
/// `now`. Such a bucket of a limit whose buckets are born on the coarse clock
/// ([`crate::rule_flags::BORN_COARSE`]) is as a new one: the program makes it again from `now`,
/// its TAT marked and `now` its birth, and the next charge settles it, so a source that comes
/// back once its bucket refilled reads no precise clock (34 ns in the kernel).
#[must_use]
pub const fn full_for_certain(tat: u64, now: u64, lag: u64) -> bool {
    let settled_at_most = if tat & TAT_UNSETTLED != 0 {
        (tat & !TAT_UNSETTLED).saturating_add(lag)
    } else {
        tat
    };
    settled_at_most <= now
}

/// A packet TAT as the readers that do not charge it take it (victim scoring, the agent's
/// `top` and `explain`): without [`TAT_UNSETTLED`], the TAT as charged from the coarse time, up
/// to the lag earlier than it will settle.
#[must_use]
pub const fn tat_as_charged(tat: u64) -> u64 {
    tat & !TAT_UNSETTLED
}

/// Whether a packet limit of tolerance `tolerance_ns` and interval `interval_ns` may make new
/// buckets on the coarse clock ([`crate::rule_flags::BORN_COARSE`]): one packet, what a bucket
/// so made may hold less than exact GCRA's ([`settle_birth`]), is then at most 1% of its burst.
#[must_use]
pub const fn born_coarse(tolerance_ns: u64, interval_ns: u64) -> bool {
    interval_ns > 0 && tolerance_ns / interval_ns >= COARSE_ONLY_FACTOR
}

/// The program's coarse-clock lag allowance where its loader does not set one: 8 ticks of the
/// slowest tick Linux has (HZ=100).
pub const COARSE_LAG_DEFAULT_NS: u64 = COARSE_LAG_TICKS * 10_000_000;

/// The name of the XDP program's global (a `u64`, ns) that holds its coarse-clock lag allowance
/// ([`coarse_lag_ns`] of the running kernel's tick), set by the loader.
pub const COARSE_LAG_GLOBAL: &str = "COARSE_LAG_NS";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_coarse_clocks_allowance_is_eight_ticks_of_at_least_a_ms() {
        assert_eq!(coarse_lag_ns(4_000_000), 32_000_000, "HZ=250");
        assert_eq!(coarse_lag_ns(10_000_000), 80_000_000, "HZ=100");
        assert_eq!(coarse_lag_ns(1_000_000), 8_000_000, "HZ=1000");
        assert_eq!(coarse_lag_ns(1), 8_000_000, "a resolution below any tick");
        assert_eq!(coarse_lag_ns(0), COARSE_LAG_DEFAULT_NS, "unknown");
        assert_eq!(COARSE_LAG_DEFAULT_NS, 80_000_000);
        let lag = 32_000_000; // HZ=250
        assert!(
            coarse_only(3_200_000_000, 1, lag),
            "units of 1 ns: 100 x the lag"
        );
        assert!(
            !coarse_only(3_199_999_999, 1, lag),
            "units of 1 ns: just under"
        );
        // Packets at 100/s: the lag refills 3.2 of them, 4 lost whole: a burst of 400 at least.
        assert!(coarse_only(400 * 10_000_000, 10_000_000, lag), "burst 400");
        assert!(!coarse_only(399 * 10_000_000, 10_000_000, lag), "burst 399");
        // rate 1, burst 5: 5 s of tolerance, but a packet of 5 lost.
        assert!(!coarse_only(5_000_000_000, 1_000_000_000, lag));
        assert!(
            coarse_only(100_000_000_000, 1_000_000_000, lag),
            "rate 1, burst 100"
        );
    }

    /// A GCRA charge at `now` of cost `c` under tolerance `tol` on the precise clock, the step
    /// the program and the cluster simulator take (`share::step`, not cluster-scoped): whether it
    /// conforms.
    /// A xorshift generator from `seed`: each call draws a number below its argument (0 for 0).
    fn draws(mut seed: u64) -> impl FnMut(u64) -> u64 {
        move |n| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n.max(1)
        }
    }

    /// One drawn source of the clock's property tests: the lag allowance (by `case`: 8, 32 or
    /// 80 ms), a packet's cost `c`, the burst and its tolerance, the first packet's true time
    /// `t1` and the coarse time its bucket was made at, up to the lag earlier.
    struct Case {
        lag: u64,
        c: u64,
        burst: u64,
        tol: u64,
        t1: u64,
        birth: u64,
    }

    impl Case {
        fn draw(case: usize, next: &mut impl FnMut(u64) -> u64) -> Self {
            let lag = [8_000_000, 32_000_000, 80_000_000][case % 3];
            let c = 1_000 + next(20_000_000);
            let burst = 1 + next(300);
            let t1 = 1_000_000_000 + next(1_000_000_000);
            let birth = t1 - next(lag + 1);
            Self {
                lag,
                c,
                burst,
                tol: burst * c,
                t1,
                birth,
            }
        }
    }

    /// Bursty arrivals after the first packet at `t1`: 1 to 40 runs of 1 to twice the burst's
    /// packets a few ns apart, each after a gap of nothing, up to the lag or up to three
    /// tolerances. `packet(next, t)` at each packet's true time, given the generator.
    fn arrivals<N: FnMut(u64) -> u64>(
        next: &mut N,
        t1: u64,
        (lag, tol, burst): (u64, u64, u64),
        mut packet: impl FnMut(&mut N, u64),
    ) {
        let mut t = t1;
        for _ in 0..(1 + next(40)) {
            t += match next(4) {
                0 => next(lag),
                1 => next(tol.saturating_mul(3)),
                _ => 0,
            };
            for _ in 0..(1 + next(burst * 2)) {
                t += next(50);
                packet(next, t);
            }
        }
    }

    fn gcra(tat: &mut u64, now: u64, c: u64, tol: u64) -> bool {
        crate::share::step(*tat, (now, now), c, tol, 0)
            .map(|new| *tat = new)
            .is_ok()
    }

    /// Bursty arrivals (runs of back-to-back packets, a few ns apart, with gaps from nothing to
    /// several refills of the burst), each source's bucket made at its first packet from a
    /// coarse time up to the lag behind: over every prefix of every sequence, the bucket made
    /// on the coarse clock and settled at its next charge ([`settle_birth`]) admits no more than
    /// exact GCRA from the true time, and at most one packet fewer. Fails if the settle is left
    /// out (the coarse-born bucket admits one packet more: 233 against 232) or takes the lag
    /// whole (a burst soon after the first packet loses more: 264 against 266).
    #[test]
    fn a_bucket_born_on_the_coarse_clock_admits_what_exact_gcra_does_less_at_most_one() {
        let mut next = draws(0x9e37_79b9_7f4a_7c15);
        let mut least = u64::MAX;
        for case in 0..3_000 {
            let Case {
                lag,
                c,
                burst,
                tol,
                t1,
                birth,
            } = Case::draw(case, &mut next);
            let (mut exact, mut ours) = (t1 + c, (birth + c) | TAT_UNSETTLED);
            let (mut n_exact, mut n_ours) = (1u64, 1u64);
            arrivals(&mut next, t1, (lag, tol, burst), |_, t| {
                n_exact += u64::from(gcra(&mut exact, t, c, tol));
                ours = settle_birth(ours, birth, t, lag);
                assert_eq!(ours & TAT_UNSETTLED, 0);
                n_ours += u64::from(gcra(&mut ours, t, c, tol));
                assert!(
                    n_ours <= n_exact && n_ours + 1 >= n_exact,
                    "case {case}: exact {n_exact}, born coarse {n_ours} (c {c}, burst {burst}, \
                     lag {lag}, born {} ns early, at {} ns)",
                    t1 - birth,
                    t - t1
                );
            });
            least = least.min(n_exact - n_ours);
        }
        assert_eq!(
            least, 0,
            "some sequence admits exactly what exact GCRA does"
        );
        // Unmarked TATs pass through; a refunded first packet settles to a full bucket.
        assert_eq!(settle_birth(5_000, 1_000, 9_000, 100), 5_000);
        let refunded = 1_000 | TAT_UNSETTLED;
        assert_eq!(settle_birth(refunded, 1_000, 1_050, 100), 1_050);
        assert_eq!(settle_birth(refunded, 1_000, 9_000, 100), 1_100);
        assert_eq!(tat_as_charged(refunded), 1_000);
        assert!(born_coarse(100 * 7, 7) && !born_coarse(99 * 7, 7) && !born_coarse(1, 0));
    }

    /// A source that keeps coming back to a bucket born on the coarse clock: bursty arrivals,
    /// gaps from nothing to several refills of the burst, each packet judged at a coarse time up
    /// to the lag behind its true time, as the program does: a bucket full for certain at that
    /// time ([`full_for_certain`]) is made again from it, marked (as the program's `reborn`),
    /// any other settled on the true time and charged. Over every prefix, never more than exact
    /// GCRA from the true time; exact's bucket is full whenever ours is made again; and between
    /// two makings ours admits at most one packet fewer than exact. Fails if a bucket is made
    /// again from the coarse time unmarked (one packet more than exact: 111 against 110 in the
    /// first case), or where a marked TAT is taken as settled without the lag (made again where
    /// exact's bucket is not full).
    #[test]
    fn a_bucket_made_again_once_full_admits_what_exact_gcra_does_less_at_most_one() {
        let mut next = draws(0x2545_f491_4f6c_dd1d);
        let mut remade = 0;
        for case in 0..3_000 {
            let Case {
                lag,
                c,
                burst,
                tol,
                t1,
                mut birth,
            } = Case::draw(case, &mut next);
            let (mut exact, mut ours) = (t1 + c, (birth + c) | TAT_UNSETTLED);
            let (mut n_exact, mut n_ours) = (1u64, 1u64);
            let mut base = 0;
            arrivals(&mut next, t1, (lag, tol, burst), |next, t| {
                let coarse = t - next(lag + 1);
                n_exact += u64::from(gcra(&mut exact, t, c, tol));
                if full_for_certain(ours, coarse, lag) {
                    assert!(exact <= t + c, "case {case}: made again, exact not full");
                    base = n_exact - 1 - n_ours;
                    ours = (coarse + c) | TAT_UNSETTLED;
                    birth = coarse;
                    n_ours += 1;
                    remade += 1;
                } else {
                    ours = settle_birth(ours, birth, t, lag);
                    n_ours += u64::from(gcra(&mut ours, t, c, tol));
                }
                assert!(
                    n_ours <= n_exact && n_ours + base + 1 >= n_exact,
                    "case {case}: exact {n_exact}, ours {n_ours} ({base} short before the last \
                     making; c {c}, burst {burst}, lag {lag})"
                );
            });
        }
        assert!(remade > 10_000, "buckets made again: {remade}");
        assert!(full_for_certain(1_000, 1_000, 50) && !full_for_certain(1_001, 1_000, 50));
        assert!(full_for_certain(950 | TAT_UNSETTLED, 1_000, 50));
        assert!(!full_for_certain(951 | TAT_UNSETTLED, 1_000, 50));
    }
}
