//! The clocks the XDP program reads, from user space: `CLOCK_MONOTONIC` (`bpf_ktime_get_ns`) and
//! `CLOCK_MONOTONIC_COARSE` (`bpf_ktime_get_coarse_ns`, which moves only when the kernel's
//! timekeeping tick runs), for tests that place packets against a bucket's times.

/// `CLOCK_MONOTONIC` in ns: the clock of `bpf_ktime_get_ns` (and, a tick behind, of the coarse
/// clock the program may use).
#[must_use]
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC, libc::clock_gettime)
}

/// `CLOCK_MONOTONIC_COARSE` in ns: the clock of `bpf_ktime_get_coarse_ns`.
#[must_use]
pub fn coarse_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC_COARSE, libc::clock_gettime)
}

/// The tick of the coarse clock (`clock_getres` of `CLOCK_MONOTONIC_COARSE`: one jiffy).
#[must_use]
pub fn coarse_tick_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC_COARSE, libc::clock_getres)
}

/// The coarse clock's next step after `from`: spins until it moves and returns its new value.
#[must_use]
pub fn next_tick(from: u64) -> u64 {
    loop {
        let c = coarse_ns();
        if c != from {
            return c;
        }
        std::hint::spin_loop();
    }
}

/// Clock `clock` in ns, as `read` (`clock_gettime`, or `clock_getres` for its resolution) gives it.
fn clock_ns(
    clock: libc::clockid_t,
    read: unsafe extern "C" fn(libc::clockid_t, *mut libc::timespec) -> libc::c_int,
) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to write to.
    assert_eq!(unsafe { read(clock, &mut ts) }, 0);
    u64::try_from(ts.tv_sec).unwrap() * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap()
}
