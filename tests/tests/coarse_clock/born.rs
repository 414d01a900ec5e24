//! Buckets made on the coarse clock: a new one (`BORN_COARSE`), and a full one made again, each
//! marked and settled by its next charge, on one CPU or two at once; and only where the agent
//! sets the flag.

use std::{net::Ipv4Addr, time::Duration};

use crate::{bucket_of, under_a_planted_clock};
use ratelimit::maps::PinnedMaps;
use ratelimit_common::verdict;
use ratelimit_testbed::{
    clock::{coarse_tick_ns, monotonic_ns},
    packet::{ip, udp4},
    require_root,
    xdp::{making_buckets, passes, pin_to_cpu, XDP_PASS},
    TestDataplane,
};

/// Rate and burst of [`born_coarse_rules`]' rule `born`.
pub(crate) const BORN_RATE: u64 = 1_000;
pub(crate) const BORN_BURST: u64 = 200;
/// The interval of [`BORN_RATE`], ns.
pub(crate) const BORN_INTERVAL: u64 = 1_000_000_000 / BORN_RATE;

/// A dataplane with rule `born` (198.18.0.0/16, [`BORN_RATE`], [`BORN_BURST`]: on the coarse
/// clock, not on it alone, its new buckets made on it, `BORN_COARSE`), rule `warm`
/// (198.19.0.0/16) and rule `short` (198.20.0.0/16, burst 99: its new buckets on the precise
/// clock), the flags checked: the dataplane and `born`'s id.
pub(crate) fn born_coarse_rules(tag: &str) -> (TestDataplane, u32) {
    use ratelimit_common::rule_flags;
    let mut dp = TestDataplane::new(tag, 1 << 12).unwrap();
    let set = dp
        .install_toml(&format!(
            r#"[[rule]]
name = "born"
source = "198.18.0.0/16"
rate = {BORN_RATE}
burst = {BORN_BURST}

[[rule]]
name = "short"
source = "198.20.0.0/16"
rate = {BORN_RATE}
burst = 99

[[rule]]
name = "warm"
source = "198.19.0.0/16"
rate = {BORN_RATE}
burst = {BORN_BURST}
"#
        ))
        .unwrap();
    let rule = set.by_name("born").unwrap();
    let flags = rule.rule.flags;
    assert_ne!(flags & rule_flags::BORN_COARSE, 0, "burst 200: born coarse");
    assert_ne!(flags & rule_flags::COARSE_CLOCK, 0);
    assert_eq!(flags & rule_flags::COARSE_ONLY, 0);
    assert_eq!(
        set.by_name("short").unwrap().rule.flags & rule_flags::BORN_COARSE,
        0,
        "burst 99: on the precise clock"
    );
    let id = rule.id;
    (dp, id)
}

/// A new source's bucket of a packet limit whose burst holds 100 packets, on the coarse clock but
/// not on it alone (`rule_flags::BORN_COARSE`), is made from the coarse time without a read of
/// the precise clock, its TAT marked and its coarse birth in its byte TAT, and its next charge
/// settles it (`ratelimit_common::settle_birth`). With this CPU's coarse clock planted most of
/// the lag allowance behind the true time: a fresh source's first packet leaves the mark and
/// the planted birth; a burst right after it admits no more than `burst + rate x t` from the
/// first packet and at most one packet fewer than the burst, and leaves the TAT settled and
/// no earlier than exact GCRA's.
///
/// Fails if the program charges the new bucket from the coarse time unmarked (its second packet
/// reads the precise clock and finds a TAT behind it, so the first packet's charge is lost and
/// 201 pass against a bound of 200) or never settles the mark (the burst after the first packet
/// is dropped whole: 1 of 251).
#[test]
fn a_new_bucket_made_on_the_coarse_clock_is_settled_by_its_next_charge() {
    attempts_under_a_planted_clock("coarse-born", 1, "born", |_, _, _| {});
}

/// Up to 40 attempts of [`made_under_a_planted_clock`] (this CPU's coarse clock planted 7 of the
/// 8 ticks of the lag allowance behind), each from a source of its own, `198.18.<octet>.<attempt>`,
/// that `ready` readies first, under [`born_coarse_rules`]' rule `born` (its first packet makes
/// its bucket): until 4 of them ran within one jiffy, and at least 2 must.
fn attempts_under_a_planted_clock(
    tag: &str,
    octet: u8,
    what: &str,
    ready: impl Fn(&TestDataplane, u8, [u8; 4]),
) {
    use ratelimit_common::coarse_lag_ns;
    require_root();
    const CPU: usize = 0;
    pin_to_cpu(CPU).unwrap();
    let (dp, id) = born_coarse_rules(tag);
    // The account starts at the bucket's birth: the first packet makes it.
    making_buckets(&mut PinnedMaps::open(dp.pin_dir()).unwrap(), id).unwrap();
    let tick = coarse_tick_ns();
    // Most of the allowance: 7 of the 8 ticks (28 ms at HZ=250).
    let lag = coarse_lag_ns(tick) - tick;
    let warm = udp4(ip("198.19.0.1"));
    let mut checked = 0;
    for attempt in 0..40u8 {
        if checked == 4 {
            break;
        }
        let src = [198, 18, octet, attempt];
        ready(&dp, attempt, src);
        if made_under_a_planted_clock(&dp, (CPU, id), (lag, tick), &warm, src, what) {
            checked += 1;
        }
    }
    assert!(
        checked >= 2,
        "only {checked} attempts ({what}) ran within one jiffy"
    );
}

/// One attempt of the tests of buckets made on the coarse clock: a packet from `src` under rule
/// `id` sent with CPU `cpu`'s coarse clock planted `lag` behind the true time (`tick` the clock's
/// resolution) must make its bucket there (`what`: "born", or "made again"): its TAT marked, one
/// interval past its birth, the planted time. A burst right after it admits no more than
/// `burst + rate x t` from that packet and at most one packet fewer than the burst, and leaves
/// the TAT settled and no earlier than exact GCRA's. `false` if the jiffy changed meanwhile (not
/// the case looked for).
pub(crate) fn made_under_a_planted_clock(
    dp: &TestDataplane,
    (cpu, id): (usize, u32),
    (lag, tick): (u64, u64),
    warm: &[u8],
    src: [u8; 4],
    what: &str,
) -> bool {
    use ratelimit_common::TAT_UNSETTLED;
    let runs = usize::try_from(BORN_BURST).unwrap() + 50;
    let frame = udp4(src.into());
    let before = dp.rule(id).pkts[verdict::PASSED];
    let mut made = None;
    let Some((t0, first, t1)) = under_a_planted_clock(
        dp,
        cpu,
        warm,
        || monotonic_ns() - lag,
        || {
            let t0 = monotonic_ns();
            let first = dp.run(&frame);
            made = Some(bucket_of(dp, id, src));
            (t0, first, monotonic_ns())
        },
    ) else {
        return false;
    };
    let b = made.unwrap();
    assert_eq!(first, XDP_PASS, "{src:?}: the packet that makes the bucket");
    assert_ne!(b.tat_ns & TAT_UNSETTLED, 0, "{src:?}: {what}, marked");
    let birth = b.byte_tat_ns;
    assert!(
        birth + lag <= t1 && birth + lag + tick >= t0,
        "{src:?}: {what} at the planted time ({} ns before the packet)",
        t0.saturating_sub(birth)
    );
    assert_eq!(b.tat_ns & !TAT_UNSETTLED, birth + BORN_INTERVAL);
    // The burst right after, on the true clock's jiffy (the program settles on the precise
    // clock whatever the coarse one says).
    let more = passes(dp, &frame, runs) as u64;
    let t2 = monotonic_ns();
    let admitted = dp.rule(id).pkts[verdict::PASSED] - before;
    assert_eq!(admitted, 1 + more);
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let bound = BORN_BURST + ((t2 - t0) as f64 * BORN_RATE as f64 / 1e9).floor() as u64;
    let settled = bucket_of(dp, id, src).tat_ns;
    println!(
        "{src:?}: {what} {:.1} ms behind: {admitted} of {} admitted in {:.3} ms, bound {bound}; \
         settled TAT {} us past the first packet's send",
        (t0 - birth) as f64 / 1e6,
        runs + 1,
        (t2 - t0) as f64 / 1e6,
        settled.saturating_sub(t0) / 1_000,
    );
    assert_eq!(settled & TAT_UNSETTLED, 0, "{src:?}: settled");
    assert!(
        admitted <= bound,
        "{src:?}: admitted {admitted} in {} ns, more than burst + rate x t = {bound}",
        t2 - t0
    );
    assert!(
        admitted + 1 >= BORN_BURST,
        "{src:?}: a bucket {what} admitted {admitted} of its burst of {BORN_BURST}"
    );
    // No earlier than exact GCRA's TAT from the packet's send: every admitted packet charged
    // from it.
    assert!(
        settled >= t0 + admitted * BORN_INTERVAL,
        "{src:?}: settled {} ns before exact's",
        (t0 + admitted * BORN_INTERVAL) - settled
    );
    true
}

/// A source back once its bucket refilled, under a limit whose buckets are born on the coarse
/// clock (`rule_flags::BORN_COARSE`): its bucket, full for certain at the coarse time
/// (`ratelimit_common::full_for_certain`), is made again from it as a new one is, without a read
/// of the precise clock: its TAT marked, the coarse time its birth, and the next charge settles
/// it. With this CPU's coarse clock planted most of the lag allowance behind the true time: the
/// packet leaves the mark and the planted birth; a burst right after it admits no more than
/// `burst + rate x t` from that packet and at most one packet fewer than the burst, and leaves the
/// TAT settled and no earlier than exact GCRA's.
///
/// Fails if the program makes the bucket again from the coarse time unmarked (nothing settles
/// it, and the next charge, on the precise clock, finds its TAT behind and charges from the true
/// time: the packet that made it again is lost, 201 admitted against a bound of 200).
#[test]
fn a_full_bucket_is_made_again_on_the_coarse_clock_and_settled_by_its_next_charge() {
    use ratelimit_common::coarse_lag_ns;
    attempts_under_a_planted_clock("coarse-reborn", 2, "made again", |dp, attempt, src| {
        // The bucket made, then left to refill its burst, and the lag on top: full for certain.
        assert_eq!(
            dp.run(&udp4(src.into())),
            XDP_PASS,
            "attempt {attempt}: the making packet"
        );
        let tick = coarse_tick_ns();
        std::thread::sleep(Duration::from_nanos(
            BORN_BURST * BORN_INTERVAL + coarse_lag_ns(tick) + 2 * tick,
        ));
    });
}

/// A full bucket made again on two CPUs at once (`rule_flags::BORN_COARSE`): one CPU's
/// compare-and-swap makes it, the other's fails and its packet is charged to the bucket just made
/// (settled first). 300 sources, each full for certain, each sent one packet on both CPUs in the
/// same instant and then a burst on one: both packets pass and are charged, and the whole never
/// exceeds `burst + rate x t` from before the two. Rate 50 a second (an interval of 20 ms, more
/// than a tick), burst 100.
///
/// Fails if a CPU whose compare-and-swap lost counts its packet as the bucket's making anyway
/// (that packet uncharged: the burst after gets it on top).
#[test]
fn a_full_bucket_made_again_on_two_cpus_at_once_charges_both_packets() {
    use ratelimit_common::{coarse_lag_ns, rule_flags};
    use ratelimit_testbed::xdp::on_two_cpus_at_once;
    const RATE: u64 = 50;
    const BURST: u64 = 100;
    require_root();
    let mut dp = TestDataplane::new("coarse-reborn2", 1 << 12).unwrap();
    let set = dp
        .install_toml(&format!(
            "[[rule]]\nname = \"slow\"\nsource = \"198.18.0.0/16\"\nrate = {RATE}\nburst = {BURST}\n"
        ))
        .unwrap();
    let rule = set.by_name("slow").unwrap();
    assert_eq!(
        rule.rule.flags
            & (rule_flags::BORN_COARSE | rule_flags::COARSE_CLOCK | rule_flags::COARSE_ONLY),
        rule_flags::BORN_COARSE | rule_flags::COARSE_CLOCK,
        "rate 50, burst 100: born on the coarse clock, not on it alone"
    );
    let id = rule.id;
    making_buckets(&mut PinnedMaps::open(dp.pin_dir()).unwrap(), id).unwrap();
    let frames: Vec<Vec<u8>> = (0..300u32)
        .map(|i| udp4(Ipv4Addr::from([198, 18, (i / 250) as u8, (i % 250) as u8])))
        .collect();
    for f in &frames {
        assert_eq!(dp.run(f), XDP_PASS, "the bucket made");
    }
    // Every bucket refilled, and the lag on top: full for certain.
    std::thread::sleep(Duration::from_nanos(
        BURST * 1_000_000_000 / RATE + coarse_lag_ns(coarse_tick_ns()) + 10_000_000,
    ));
    let runs = usize::try_from(BURST).unwrap() + 20;
    let mut most = 0;
    for (i, f) in frames.iter().enumerate() {
        let before = dp.rule(id).pkts[verdict::PASSED];
        let t0 = monotonic_ns();
        let both = on_two_cpus_at_once(&dp, std::slice::from_ref(f));
        assert_eq!(
            both,
            [[XDP_PASS, XDP_PASS]],
            "source {i}: both packets of a full bucket"
        );
        let more = passes(&dp, f, runs) as u64;
        let t2 = monotonic_ns();
        let admitted = dp.rule(id).pkts[verdict::PASSED] - before;
        assert_eq!(admitted, 2 + more, "source {i}");
        let bound = BURST + (t2 - t0) * RATE / 1_000_000_000;
        assert!(
            admitted <= bound,
            "source {i}: {admitted} admitted in {} ns, more than burst + rate x t = {bound}",
            t2 - t0
        );
        most = most.max(admitted);
    }
    assert!(
        most >= BURST - 1,
        "the burst admitted whole or one short: {most}"
    );
}

/// The one packet a bucket made on the coarse clock may cost: a source's first packet, then its
/// whole burst 10 ms later (the bucket full again by the true time, but settled to at most a
/// packet short of full, as the coarse clock at its birth may have been up to the lag behind).
/// It gets its burst or one packet fewer, and no more than the refill since allows. Both where
/// the first packet makes the bucket and where it passes without one (the time owed in its slot
/// capped at the second packet's precise time plus an interval: without the cap, stamped from
/// the coarse time plus the whole lag allowance, 183 of 200).
#[test]
fn a_new_buckets_burst_after_its_first_packet_loses_at_most_one() {
    require_root();
    let (dp, id) = born_coarse_rules("coarse-born-one");
    let runs = usize::try_from(BORN_BURST).unwrap() + 50;
    for attempt in 0..6u8 {
        if attempt == 3 {
            // The first three with the first packet passing without a bucket (its slot stamped
            // from the coarse time plus the lag allowance, the time owed capped at the second
            // packet's precise time plus an interval); these with the first packet making it.
            making_buckets(&mut PinnedMaps::open(dp.pin_dir()).unwrap(), id).unwrap();
        }
        let frame = udp4(Ipv4Addr::new(198, 18, 2, attempt));
        let before = dp.rule(id).pkts[verdict::PASSED];
        assert_eq!(dp.run(&frame), XDP_PASS);
        std::thread::sleep(Duration::from_millis(10));
        let got = passes(&dp, &frame, runs) as u64;
        println!("attempt {attempt}: {got} of {runs} 10 ms after the first packet");
        assert_eq!(dp.rule(id).pkts[verdict::PASSED] - before, 1 + got);
        assert!(
            got + 1 >= BORN_BURST && got <= BORN_BURST + 2,
            "attempt {attempt}: {got} of a burst of {BORN_BURST} 10 ms after the first packet"
        );
    }
}

/// `BORN_COARSE` is a new bucket's birth on the coarse clock only beside the flags the agent sets
/// it with (`rule_flags::born_coarse_in_force`): set by hand on a cluster-scoped limit (whose
/// share arithmetic reads the TAT), a byte limit (whose byte TAT the birth would take: the first
/// packet's bytes uncharged) or a rule on the coarse clock alone, the program makes the bucket as
/// without it: the TAT unmarked, the byte TAT charged from no earlier than the packet's send.
///
/// Fails if the program trusts the bit alone (each bucket marked, the byte TAT the coarse birth).
#[test]
fn born_coarse_where_the_agent_never_sets_it_makes_buckets_as_without_it() {
    use ratelimit_common::{rule_flags, TAT_UNSETTLED};
    require_root();
    let mut dp = TestDataplane::new("coarse-born-misset", 1 << 12).unwrap();
    let set = dp
        .install_toml(
            r#"[[rule]]
name = "cluster"
source = "198.18.0.0/16"
rate = 1000
burst = 200

[[rule]]
name = "bytes"
source = "198.19.0.0/16"
rate = 1000
burst = 200
bytes_rate = 1000000
bytes_burst = 100000

[[rule]]
name = "coarse-only"
source = "198.20.0.0/16"
rate = 1000
burst = 1000000
"#,
        )
        .unwrap();
    let mut maps = PinnedMaps::open(dp.pin_dir()).unwrap();
    // The cluster-scoped and byte limits below keep `FIRST_FREE` as compiled, and make their
    // bucket at the first packet all the same (`rule_flags::first_free_in_force`): a flag set by
    // hand beside it hides no cluster-scoped source from the sync, gives no byte limit's first
    // packet its bytes free. The rule on the coarse clock alone makes its bucket so by request.
    making_buckets(&mut maps, set.by_name("coarse-only").unwrap().id).unwrap();
    let cases = [
        ("cluster", [198, 18, 0, 1], rule_flags::CLUSTER),
        ("bytes", [198, 19, 0, 1], rule_flags::BYTE_LIMIT),
        ("coarse-only", [198, 20, 0, 1], rule_flags::COARSE_ONLY),
    ];
    let mut wrong = Vec::new();
    for (name, src, beside) in cases {
        let id = set.by_name(name).unwrap().id;
        let mut rule = maps.rule(id).unwrap();
        assert_ne!(
            rule.flags & rule_flags::COARSE_CLOCK,
            0,
            "{name}: on the coarse clock"
        );
        rule.flags |= rule_flags::BORN_COARSE | beside;
        maps.set_rule(id, rule).unwrap();
        let t0 = monotonic_ns();
        assert_eq!(
            dp.run(&udp4(src.into())),
            XDP_PASS,
            "{name}: the first packet"
        );
        let b = bucket_of(&dp, id, src);
        println!(
            "{name}: TAT {} ns past the send, byte TAT {}",
            b.tat_ns.wrapping_sub(t0),
            b.byte_tat_ns.wrapping_sub(t0) as i64
        );
        if b.tat_ns & TAT_UNSETTLED != 0 {
            wrong.push(format!("{name}: the new bucket's TAT marked"));
        }
        if beside == rule_flags::BYTE_LIMIT && b.byte_tat_ns <= t0 {
            wrong.push(format!(
                "{name}: the first packet's bytes charged from {} ns before its send",
                t0 - b.byte_tat_ns
            ));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}
