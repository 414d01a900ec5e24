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
}
