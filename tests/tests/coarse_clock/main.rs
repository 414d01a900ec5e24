//! The coarse clock through the real XDP program (BPF_PROG_TEST_RUN): a rule on it admits no more
//! than `burst + rate x t` however late in a tick a burst comes and however far (within the lag
//! allowance) the clock lags; a rule on it alone withholds at most the lag's refill; a new
//! bucket made on it is settled by its next charge (and only made so where the agent would
//! make it so); and a drop window held on it past its end loses its source no token. Some tests
//! plant this CPU's cached coarse time behind the true time (`TestDataplane::set_coarse_cache`),
//! as a vCPU held up by its host leaves it.

use std::{net::Ipv4Addr, time::Duration};

use ratelimit_common::verdict;
use ratelimit_testbed::{
    clock::{coarse_ns, coarse_tick_ns, monotonic_ns, next_tick},
    packet::{ip, udp4},
    require_root,
    xdp::{passes, pin_to_cpu, XDP_DROP, XDP_PASS},
    TestDataplane,
};

mod born;

/// Runs `run` at the start of a jiffy with CPU `cpu`'s cached coarse clock planted at
/// `planted()` (read once `warm`, a packet of another rule, has brought the cache up to the
/// jiffy): what `run` returns, or `None` if the jiffy changed during it (the program then read
/// the clock again: not the case looked for).
fn under_a_planted_clock<T>(
    dp: &TestDataplane,
    cpu: usize,
    warm: &[u8],
    planted: impl FnOnce() -> u64,
    run: impl FnOnce() -> T,
) -> Option<T> {
    let began = next_tick(coarse_ns());
    let _ = dp.run(warm);
    let (jiffies, _) = dp.coarse_cache(cpu);
    let planted = planted();
    dp.set_coarse_cache(cpu, jiffies, planted);
    let out = run();
    (dp.coarse_cache(cpu) == (jiffies, planted) && coarse_ns() == began).then_some(out)
}

/// One burst of `runs` frames of `frame` with CPU `cpu`'s cached coarse clock planted `lag`
/// behind the true time ([`under_a_planted_clock`]): what rule `id` admitted and how long the
/// burst took (ns), or `None` if the jiffy changed during it.
fn burst_under_a_planted_clock(
    dp: &TestDataplane,
    (cpu, id): (usize, u32),
    warm: &[u8],
    frame: &[u8],
    runs: usize,
    lag: u64,
) -> Option<(u64, u64)> {
    let before = dp.rule(id).pkts[verdict::PASSED];
    let (first, took) = under_a_planted_clock(
        dp,
        cpu,
        warm,
        || monotonic_ns() - lag,
        || {
            let t0 = monotonic_ns();
            let first = passes(dp, frame, runs) as u64;
            (first, monotonic_ns() - t0)
        },
    )?;
    let admitted = dp.rule(id).pkts[verdict::PASSED] - before;
    assert_eq!(admitted, first);
    Some((admitted, took))
}

/// Rules on the coarse clock admit no more than `burst + rate x t` over an interval that starts
/// late in one tick and ends early in a later one, where that clock is furthest from the true
/// time at the start and nearest at the end: a fresh source's burst from late in a tick, then
/// more right after a later tick. Two rules on the coarse clock: one whose charges are all within
/// `ratelimit_common::COARSE_LAG_NS` of a full or an empty bucket (on the precise clock), one
/// with most of its charges in between (on the coarse clock).
///
/// With the bucket charged from the coarse `now` (the time of the last tick), a burst was charged
/// from a time up to a tick before it was sent: what it spent refilled from then, and the bucket
/// admitted up to a tick's refill beyond the bound (7 packets at 2,500/s and HZ=250). And the
/// whole burst must still pass, however late in its tick it comes.
#[test]
fn a_tick_of_the_coarse_clock_admits_nothing_beyond_the_bound() {
    require_root();
    const RATE: u64 = 2_500;
    let mut dp = TestDataplane::new("coarse-edge", 1 << 14).unwrap();
    let set = dp
        .install_toml(&format!(
            r#"[[rule]]
name = "near"
source = "198.18.0.0/16"
rate = {RATE}
burst = 100

[[rule]]
name = "deep"
source = "198.19.0.0/16"
rate = {RATE}
burst = 500
"#
        ))
        .unwrap();
    let tick = coarse_tick_ns();
    for (name, net, burst) in [("near", 18, 100u64), ("deep", 19, 500)] {
        let rule = set.by_name(name).unwrap();
        assert_ne!(
            rule.rule.flags & ratelimit_common::rule_flags::COARSE_CLOCK,
            0,
            "{name}: a tolerance of 20 ms or more is on the coarse clock"
        );
        let id = rule.id;
        // The burst's runs, one at a time (a test run with `repeat` waits milliseconds for the
        // kernel to switch its XDP dispatcher), start `late` into a tick.
        let runs = usize::try_from(burst).unwrap() + 200;
        let late = tick * 3 / 4;
        let mut checked = 0;
        for attempt in 0..40u8 {
            if checked == 4 {
                break;
            }
            let frame = udp4(Ipv4Addr::new(198, net, 1, attempt));
            let began = next_tick(coarse_ns());
            while monotonic_ns() < began + late {
                std::hint::spin_loop();
            }
            let before = dp.rule(id).pkts[verdict::PASSED];
            let t0 = monotonic_ns();
            if coarse_ns() != began {
                continue; // a stall took the thread past the tick: not the case looked for
            }
            let first = passes(&dp, &frame, runs) as u64;
            // Right after the next tick.
            let edge = next_tick(coarse_ns());
            let more = passes(&dp, &frame, 20) as u64;
            let t1 = monotonic_ns();
            if coarse_ns() != edge {
                continue;
            }
            let admitted = dp.rule(id).pkts[verdict::PASSED] - before;
            assert_eq!(admitted, first + more);
            #[expect(clippy::cast_precision_loss, reason = "small counts")]
            let bound = burst + ((t1 - t0) as f64 * RATE as f64 / 1e9).floor() as u64;
            #[expect(clippy::cast_precision_loss, reason = "small counts")]
            let ms = |ns: u64| ns as f64 / 1e6;
            println!(
                "{name} attempt {attempt}: from {:.2} ms into a tick of {:.0} ms: {first} of {runs} \
                 then {more} of 20 after the next tick, {admitted} in {:.3} ms, bound {bound}",
                ms(t0 - began),
                ms(tick),
                ms(t1 - t0),
            );
            assert!(
                first >= burst,
                "{name} attempt {attempt}: a fresh bucket admitted {first} of its burst of {burst}"
            );
            assert!(
                admitted <= bound,
                "{name} attempt {attempt}: admitted {admitted} over {:.3} ms: more than burst + rate x t = {bound}",
                ms(t1 - t0)
            );
            checked += 1;
        }
        assert!(
            checked >= 2,
            "{name}: only {checked} attempts ran without a stall past a tick"
        );
    }
}

/// The coarse clock can lag the true time by several ticks: the kernel's coarse time is its last
/// timekeeping update, and when the CPU that does it is held up (a vCPU the host preempted, a
/// long section with interrupts off), no update comes until another CPU's tick forces one, after
/// `MAX_STALLED_JIFFIES` (5) of its own ticks (kernel/time/tick-sched.c): up to about 7 ticks
/// behind in all (the update's own remainder, the stall, the tick that sees it). On this 2-vCPU
/// machine at HZ=250, `CLOCK_MONOTONIC_COARSE` read right between two `CLOCK_MONOTONIC` reads
/// 20 us apart was 13.7 ms behind within 30 s of a build running.
///
/// A bucket charged on the coarse clock must hold `burst + rate x t` all the same. The test
/// plants a coarse clock 7 ticks behind in this CPU's scratch record (the program reads it for
/// every packet until the jiffy changes), on a bucket that is full at the true time but whose TAT
/// is only a few ms old. With the program's allowance for the lag a fixed 10 ms (before
/// `ratelimit_common::COARSE_LAG_TICKS`), that TAT looked at least 10 ms past the clock, so the
/// bucket was charged from its old TAT rather than from the true time, and its burst took the
/// ms that TAT was behind on top of it: 110 admitted in 0.28 ms against a bound of 100. Now the
/// allowance is 8 ticks of the running kernel (set by the loader): 100.
#[test]
fn a_coarse_clock_lagging_ticks_behind_admits_nothing_beyond_the_bound() {
    require_root();
    const CPU: usize = 0;
    const RATE: u64 = 1_000;
    const BURST: u64 = 100;
    pin_to_cpu(CPU).unwrap();
    let mut dp = TestDataplane::new("coarse-lag", 1 << 12).unwrap();
    let set = dp
        .install_toml(&format!(
            r#"[[rule]]
name = "lag"
source = "198.18.0.0/16"
rate = {RATE}
burst = {BURST}

[[rule]]
name = "warm"
source = "198.19.0.0/16"
rate = {RATE}
burst = {BURST}
"#
        ))
        .unwrap();
    let rule = set.by_name("lag").unwrap();
    assert_ne!(
        rule.rule.flags & ratelimit_common::rule_flags::COARSE_CLOCK,
        0,
        "a tolerance of 100 ms is on the coarse clock"
    );
    let id = rule.id;
    let tick = coarse_tick_ns();
    let lag = 7 * tick;
    let warm = udp4(ip("198.19.0.1"));
    let mut checked = 0;
    for attempt in 0..40u8 {
        if checked == 4 {
            break;
        }
        let frame = udp4(Ipv4Addr::new(198, 18, 1, attempt));
        // A new bucket, one token spent (made on the coarse clock, `BORN_COARSE`, and settled
        // by its second packet: a test of its own below), its TAT a ms or two ahead.
        assert_eq!(passes(&dp, &frame, 2), 2, "a new source's first packets");
        // Full again a few ms later, its TAT a few ms behind the true time.
        std::thread::sleep(Duration::from_millis(10));
        let runs = usize::try_from(BURST).unwrap() + 50;
        let Some((admitted, took)) =
            burst_under_a_planted_clock(&dp, (CPU, id), &warm, &frame, runs, lag)
        else {
            continue;
        };
        #[expect(clippy::cast_precision_loss, reason = "small counts")]
        let bound = BURST + (took as f64 * RATE as f64 / 1e9).floor() as u64;
        #[expect(clippy::cast_precision_loss, reason = "small counts")]
        let ms = |ns: u64| ns as f64 / 1e6;
        println!(
            "attempt {attempt}: coarse clock {:.1} ms behind: {admitted} of {runs} admitted in {:.3} ms, bound {bound}",
            ms(lag),
            ms(took),
        );
        assert!(
            admitted >= BURST,
            "attempt {attempt}: a full bucket admitted {admitted} of its burst of {BURST}"
        );
        assert!(
            admitted <= bound,
            "attempt {attempt}: a coarse clock {:.1} ms behind: admitted {admitted} in {:.3} ms, more than burst + rate x t = {bound}",
            ms(lag),
            ms(took)
        );
        checked += 1;
    }
    assert!(
        checked >= 2,
        "only {checked} attempts ran their burst within one jiffy"
    );
}

/// The IPv4 source `addr`'s bucket of rule `rule`, keyed as the program keys it.
fn bucket_of(dp: &TestDataplane, rule: u32, addr: [u8; 4]) -> ratelimit_common::Bucket {
    let maps = dp.maps();
    let record = maps.rule(rule).unwrap();
    let key = ratelimit::maps::bucket::bucket_key(rule, &record, Ipv4Addr::from(addr).into());
    maps.bucket(&key).unwrap().expect("the source's bucket")
}

/// A limit whose burst is at least 100 times what the coarse clock's lag allowance `L` refills
/// (in whole packets) runs on the coarse clock alone (`rule_flags::COARSE_ONLY`), and holds both
/// sides of its contract: a full bucket's burst admits at least `burst - ceil(rate x L)` (at most
/// 1% withheld), and no interval admits
/// more than `burst + rate x t`, even with the coarse clock planted 7 ticks behind the true time
/// (a bucket full at the true time whose TAT is a few ms old, as in the test above). A rule whose
/// burst is one packet short keeps the precise clock where it matters (no flag).
#[test]
fn a_coarse_only_limit_withholds_at_most_the_lag_and_admits_nothing_beyond_the_bound() {
    use ratelimit_common::{coarse_lag_ns, rule_flags, COARSE_ONLY_FACTOR};
    require_root();
    const CPU: usize = 0;
    const RATE: u64 = 100;
    pin_to_cpu(CPU).unwrap();
    let tick = coarse_tick_ns();
    let lag_allowance = coarse_lag_ns(tick);
    // 100 times the packets L refills, rounded up: burst 400 at HZ=250 (L = 32 ms, 3.2 packets).
    let burst = COARSE_ONLY_FACTOR * (lag_allowance * RATE).div_ceil(1_000_000_000);
    let short = burst - 1;
    let mut dp = TestDataplane::new("coarse-only", 1 << 12).unwrap();
    let set = dp
        .install_toml(&format!(
            r#"[[rule]]
name = "only"
source = "198.18.0.0/16"
rate = {RATE}
burst = {burst}

[[rule]]
name = "short"
source = "198.20.0.0/16"
rate = {RATE}
burst = {short}

[[rule]]
name = "warm"
source = "198.19.0.0/16"
rate = 1000
burst = 100
"#
        ))
        .unwrap();
    let flags = |name: &str| set.by_name(name).unwrap().rule.flags;
    assert_ne!(
        flags("only") & rule_flags::COARSE_ONLY,
        0,
        "tolerance >= 100 x L"
    );
    assert_ne!(flags("only") & rule_flags::COARSE_CLOCK, 0);
    assert_eq!(
        flags("short") & rule_flags::COARSE_ONLY,
        0,
        "a packet short"
    );
    assert_ne!(flags("short") & rule_flags::COARSE_CLOCK, 0);
    let id = set.by_name("only").unwrap().id;
    let withheld_at_most = (lag_allowance * RATE).div_ceil(1_000_000_000);
    let runs = usize::try_from(burst).unwrap() + 50;
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let ms = |ns: u64| ns as f64 / 1e6;
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let refill = |ns: u64| (ns as f64 * RATE as f64 / 1e9).floor() as u64;

    // A new source's bucket: full, charged from `coarse + L`.
    let fresh = udp4(ip("198.18.2.1"));
    let t0 = monotonic_ns();
    let first = passes(&dp, &fresh, runs) as u64;
    let t1 = monotonic_ns();
    println!(
        "a new bucket: {first} of {runs} admitted in {:.3} ms; burst {burst}, at most \
         {withheld_at_most} withheld, bound {}",
        ms(t1 - t0),
        burst + refill(t1 - t0)
    );
    assert!(
        first + withheld_at_most >= burst,
        "a new bucket admitted {first} of its burst of {burst}: more than rate x L withheld"
    );
    assert!(
        first <= burst + refill(t1 - t0),
        "a new bucket admitted {first}"
    );

    // A full bucket whose TAT is a few ms behind the true time, under a coarse clock planted 7
    // ticks behind it.
    let warm = udp4(ip("198.19.0.1"));
    let mut checked = 0;
    for attempt in 0..40u8 {
        if checked == 3 {
            break;
        }
        let frame = udp4(Ipv4Addr::new(198, 18, 1, attempt));
        assert_eq!(dp.run(&frame), XDP_PASS, "a new source's first packet");
        std::thread::sleep(Duration::from_millis(8) + Duration::from_nanos(1_000_000_000 / RATE));
        let Some((admitted, took)) =
            burst_under_a_planted_clock(&dp, (CPU, id), &warm, &frame, runs, 7 * tick)
        else {
            continue;
        };
        // At most full (a coarse-only bucket starts `L` short of it): burst plus the refill.
        let bound = burst + refill(took);
        println!(
            "attempt {attempt}: coarse clock {:.1} ms behind: {admitted} of {runs} admitted in \
             {:.3} ms, bound {bound}, at least {}",
            ms(7 * tick),
            ms(took),
            burst - withheld_at_most
        );
        assert!(
            admitted <= bound,
            "attempt {attempt}: admitted {admitted}, more than burst + rate x t = {bound}"
        );
        checked += 1;
    }
    assert!(
        checked >= 2,
        "only {checked} attempts ran their burst within one jiffy"
    );
}

/// The end of the drop window that source `addr`'s bucket of rule `rule` opened with its last
/// drop: when its next packet conforms (`TAT - tolerance + interval`), by the precise clock.
fn window_end(dp: &TestDataplane, rule: u32, addr: [u8; 4], tolerance: u64, interval: u64) -> u64 {
    bucket_of(dp, rule, addr).tat_ns - tolerance + interval
}

/// A drop window held on the coarse clock (`rule_flags::HOLD_WINDOW` for a source's own bucket,
/// `HOLD_GATE` for a per-rule limit's; a tolerance of the lag allowance and a packet or more)
/// holds until that clock passes its end, without a read of the precise clock, and loses its
/// sources no token: a packet sent 1-5 ms after the window's end by the true time, with this
/// CPU's coarse clock planted 1 ms before it, is dropped (the precise clock would admit it);
/// once the coarse clock is past the end, the tokens that came meanwhile all pass, and no more.
/// Without the flag the precise clock decides at the window's end and the same packet passes:
/// the same limit per /24 (a shared bucket), and a per-rule limit whose burst holds the lag but
/// not a packet more.
#[test]
fn a_held_drop_window_loses_its_sources_no_token() {
    use ratelimit_common::{coarse_lag_ns, rule_flags};
    require_root();
    const CPU: usize = 0;
    const RATE: u64 = 100;
    const INTERVAL: u64 = 1_000_000_000 / RATE;
    pin_to_cpu(CPU).unwrap();
    let lag = coarse_lag_ns(coarse_tick_ns());
    // The lag's refill and two packets more: burst 6 at HZ=250 (L = 32 ms), far under the 400
    // of the coarse clock alone; and the lag's refill alone (4: 40 ms, under L + 10 ms).
    let burst = lag.div_ceil(INTERVAL) + 2;
    let short = lag.div_ceil(INTERVAL);
    let mut dp = TestDataplane::new("held-window", 1 << 12).unwrap();
    let set = dp
        .install_toml(&format!(
            r#"[[rule]]
name = "own"
source = "198.18.0.0/16"
rate = {RATE}
burst = {burst}

[[rule]]
name = "shared"
source = "198.19.0.0/16"
per = "/24"
rate = {RATE}
burst = {burst}

[[rule]]
name = "gated"
source = "198.21.0.0/16"
per = "rule"
rate = {RATE}
burst = {burst}

[[rule]]
name = "gated-short"
source = "198.22.0.0/16"
per = "rule"
rate = {RATE}
burst = {short}

[[rule]]
name = "warm"
source = "198.20.0.0/16"
rate = 1000
burst = 100
"#
        ))
        .unwrap();
    let flags = |name: &str| {
        set.by_name(name).unwrap().rule.flags
            & (rule_flags::HOLD_WINDOW | rule_flags::HOLD_GATE | rule_flags::COARSE_ONLY)
    };
    let coarse = |name: &str| set.by_name(name).unwrap().rule.flags & rule_flags::COARSE_CLOCK;
    assert_eq!(flags("own"), rule_flags::HOLD_WINDOW, "lag {lag} ns");
    assert_eq!(flags("shared"), 0, "a shared bucket");
    assert_eq!(flags("gated"), rule_flags::HOLD_GATE, "lag {lag} ns");
    assert_eq!(flags("gated-short"), 0, "burst {short}, lag {lag} ns");
    for name in ["own", "shared", "gated"] {
        assert_ne!(coarse(name), 0, "{name}: on the coarse clock");
    }
    // (name, its second octet, the key's address from the source's, held, its burst); a
    // per-rule bucket is the same from one attempt to the next, the others fresh.
    type KeyOf = fn([u8; 4]) -> [u8; 4];
    let cases: [(&str, u8, KeyOf, bool, u64); 4] = [
        ("own", 18, |a| a, true, burst),
        ("shared", 19, |a| [a[0], a[1], a[2], 0], false, burst),
        ("gated", 21, |_| [0; 4], true, burst),
        ("gated-short", 22, |_| [0; 4], false, short),
    ];
    let warm = udp4(ip("198.20.0.1"));
    let mut checked = [0u32; 4];
    for attempt in 0..60u8 {
        if checked.iter().all(|&c| c >= 2) {
            break;
        }
        let k = usize::from(attempt) % cases.len();
        let (name, net, key_addr, held, holds) = cases[k];
        let rule = set.by_name(name).unwrap();
        let tolerance = rule.rule.pkt_tolerance_ns;
        let addr = [198, net, attempt, 1];
        let frame = udp4(Ipv4Addr::from(addr));
        // Spent (a per-rule bucket may have refilled only in part since the last attempt), and a
        // window opened by the first drop.
        let first = monotonic_ns();
        let spent = (0..=burst)
            .map(|_| dp.run(&frame))
            .take_while(|&a| a == XDP_PASS)
            .count() as u64;
        assert!(
            spent <= burst,
            "{name}: {spent} passed of a burst of {burst}"
        );
        let end = window_end(&dp, rule.id, key_addr(addr), tolerance, INTERVAL);
        // Past the end by the true time, then at the start of a tick (so none comes during the
        // packet), the coarse clock planted 1 ms before the end.
        while monotonic_ns() < end + 1_000_000 {
            std::thread::sleep(Duration::from_micros(200));
        }
        let Some((sent, action)) = under_a_planted_clock(
            &dp,
            CPU,
            &warm,
            || end - 1_000_000,
            || (monotonic_ns(), dp.run(&frame)),
        ) else {
            continue;
        };
        assert!(sent >= end, "{name}: sent before the window's end");
        assert_eq!(
            action,
            if held { XDP_DROP } else { XDP_PASS },
            "{name}: a packet {:.1} ms past its window's end, the coarse clock 1 ms before it",
            (sent - end) as f64 / 1e6
        );
        // The coarse clock past the end: every token due since it passes (the one due at the
        // end, one each interval since, up to the burst: a sleep that overran on a busy machine
        // finds the bucket full), and no more; judged on the coarse clock, up to a tick late, so
        // one fewer at most.
        std::thread::sleep(Duration::from_millis(35));
        let t0 = monotonic_ns();
        let more = passes(&dp, &frame, 20) as u64;
        let t1 = monotonic_ns();
        let already = u64::from(action == XDP_PASS);
        let due = |t: u64| (t - end) / INTERVAL + 1 - already;
        println!(
            "{name}, attempt {attempt}: the packet past the end {}, then {more} of 20 at {:.1} ms \
             past it (due {}..={})",
            if action == XDP_PASS {
                "passed"
            } else {
                "dropped"
            },
            (t0 - end) as f64 / 1e6,
            due(t0),
            due(t1)
        );
        assert!(
            more <= due(t1),
            "{name}: {more} admitted, more than the {} tokens due",
            due(t1)
        );
        assert!(
            more + 1 >= due(t0).min(holds),
            "{name}: {more} admitted of the {} tokens due (a burst of {holds}): the held window \
             lost some",
            due(t0)
        );
        if key_addr(addr) != [0; 4] {
            // A fresh bucket: over the whole attempt, within the bound.
            let admitted = spent + already + more;
            let bound = burst + (t1 - first) / INTERVAL;
            assert!(
                admitted <= bound,
                "{name}: {admitted} admitted, bound {bound}"
            );
        }
        checked[k] += 1;
    }
    assert!(
        checked.iter().all(|&c| c >= 2),
        "attempts that ran without a tick in the way: {checked:?}"
    );
}
