//! A cluster-scoped limit's bucket in the real XDP program (BPF_PROG_TEST_RUN): the share word
//! the agent's sync writes sets its refill and its bursts until the shares lapse, charged as the
//! shared arithmetic (`ratelimit_common::share`) says.

use std::{
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use ratelimit::maps::store::Slot;
use ratelimit_testbed::{
    packet::{ip, udp4},
    require_root,
    xdp::{make_cluster_scoped, passes, XDP_PASS},
    TestDataplane,
};

/// Checks the packets admitted after sleeping `ms` with the bucket drained (`what` says how it
/// stands) against the bounds a refill at `per_s` tokens a second allows for that: at least the time slept, at most the time from the
/// end of the drain to the end of the count, plus the fraction of a token the drained bucket
/// held; below, the tokens of one tick of the coarse clock (4 ms, which the rule's 1 s tolerance
/// selects) and one more.
fn assert_refill(dp: &TestDataplane, frame: &[u8], ms: u64, per_s: f64, what: &str) {
    // Drained: what accrued since the last count (a token or so) spent, up to the first drop.
    // Not 50 packets and then one that must drop: a coarse tick (4 tokens at 1000/s) between
    // the two made that check fail on a loaded machine.
    let spent = (0..51).take_while(|_| dp.run(frame) == XDP_PASS).count();
    assert!(
        spent <= 50,
        "the bucket is drained: {spent} of 51 packets passed"
    );
    let drained = Instant::now();
    std::thread::sleep(Duration::from_millis(ms));
    let slept = drained.elapsed();
    let got = passes(dp, frame, 2_000);
    let span = drained.elapsed();
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "a few hundred tokens"
    )]
    let tick = (0.004 * per_s).ceil() as usize + 1;
    // Above, exact: the bucket held under one token at the drain's drop, and refills at `per_s`
    // from then (the program charges a full or nearly empty bucket on the precise clock: see
    // `a_tick_of_the_coarse_clock_admits_nothing_beyond_the_bound`). Below, a tick: a drop
    // window, on the coarse clock, can close up to a tick late.
    let (min, max) = (
        ((slept.as_secs_f64() * per_s).floor() as usize).saturating_sub(tick),
        (span.as_secs_f64() * per_s).ceil() as usize + 1,
    );
    println!("{what}: {got} tokens in {ms} ms (bounds {min}..={max})");
    assert!(
        (min..=max).contains(&got),
        "{what}: refilled {got}, want {min}..={max} at {per_s}/s"
    );
}

/// A cluster-scoped bucket at share `s` among `h` holders refills at its share of the rate and
/// holds `h x s` bursts: a host can bank its share's refill over the gaps between its bursts
/// (holding `s x burst`, below `1 / burst` it admitted nothing at all), and a heavy holder more
/// than one burst, as the bursts of all holders spread over one bucket would need; and when the
/// shares lapse (the agent stopped), a bucket drained at a small share is read at the whole rate
/// with the debt it had, not as the debt of its share's slowed time (fail open).
#[test]
fn a_bucket_at_a_share_holds_its_holders_share_of_bursts_and_its_debt_when_the_shares_lapse() {
    use ratelimit::maps::PinnedMaps;
    use ratelimit_common::SHARE_ONE;
    require_root();
    let mut dp = TestDataplane::new("sharecap", 1024).unwrap();
    let set = dp
        .install_toml(
            "[[rule]]\nname = \"c\"\nsource = \"198.18.0.0/16\"\nrate = 1000\nburst = 100\n",
        )
        .unwrap();
    let rid = set.by_name("c").unwrap().id;
    let mut maps = PinnedMaps::open(dp.pin_dir()).unwrap();
    let cluster = make_cluster_scoped(&mut maps, rid).unwrap();
    let src = ip("198.18.0.2");
    let frame = udp4(src);
    let key = ratelimit::maps::bucket::bucket_key(rid, &cluster, src.into());
    assert!(
        passes(&dp, &frame, 200) >= 100,
        "a fresh bucket admits its burst"
    );
    let set_word = |maps: &PinnedMaps, word: u16, holders: u32| {
        ratelimit::cluster::shares::set_share(
            &ratelimit::maps::locator::Locator::new(maps).unwrap(),
            &key,
            (word, holders),
            &cluster.limit(0).unwrap(),
            ratelimit::maps::bucket::monotonic_ns(),
            ratelimit::maps::bucket::monotonic_coarse_ns(),
        )
        .unwrap()
    };
    let until = ratelimit::maps::bucket::monotonic_ns() + 60_000_000_000;
    maps.update_config(|c| c.shares_until_ns = until).unwrap();

    // A half of 2 holders: refills at 500/s, and after 400 ms (200 tokens' worth) holds the
    // whole burst, 100, not half of it.
    let half = u16::try_from(SHARE_ONE / 2).unwrap();
    set_word(&maps, half, 2);
    let drained = passes(&dp, &frame, 200);
    assert!(drained <= 100, "drained: {drained}");
    assert_eq!(passes(&dp, &frame, 10), 0, "empty");
    std::thread::sleep(Duration::from_millis(400));
    let held = passes(&dp, &frame, 300);
    println!("at a share of 1/2, after 400 ms: {held} (burst 100)");
    assert!(
        (96..=102).contains(&held),
        "a bucket at a half holds the whole burst: {held} of 100 (at most a coarse tick less)"
    );

    // 1/64 of 63 holders (98 packets): drained (100 ms of debt at the whole rate, 1.6 packets
    // over its capacity), 200 ms of its refill (3 tokens at 15.6/s); then the shares lapse.
    // Read in its share's time, it is 6.2 s from full: at the whole rate, with its debt, the
    // packets of those 3 tokens pass at once, and the refill is the whole rate's from then on.
    set_word(&maps, u16::try_from(SHARE_ONE / 64).unwrap(), 63);
    assert_eq!(passes(&dp, &frame, 10), 0, "empty at 1/64");
    std::thread::sleep(Duration::from_millis(200));
    maps.update_config(|c| c.shares_until_ns = 0).unwrap();
    // Past a tick of the coarse clock, on which the rule may be.
    std::thread::sleep(Duration::from_millis(10));
    let after = passes(&dp, &frame, 50);
    println!("lapsed at 1/64 after 200 ms: {after} at once");
    assert!(
        (3..=30).contains(&after),
        "the tokens held at 1/64 pass once the shares lapse: {after}"
    );
    std::thread::sleep(Duration::from_millis(50));
    let refill = passes(&dp, &frame, 200);
    assert!(
        (40..=70).contains(&refill),
        "the whole rate after the lapse: {refill} in 50 ms"
    );

    // The heavy holder of 3 at a half (of a rate split 50/25/25): 1.5 bursts. Drained (a
    // burst's debt), in force again: 50 tokens of room at once, and after 400 ms of its refill
    // (200 tokens' worth) it holds 150, more than one burst.
    let _ = passes(&dp, &frame, 300);
    let drained_at = std::time::Instant::now();
    let more = passes(&dp, &frame, 5);
    // At the whole rate (1,000/s) a token refills every ms: what refilled since the drain.
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "ms"
    )]
    let refilled = (drained_at.elapsed().as_secs_f64() * 1000.0).ceil() as usize;
    assert!(
        more <= refilled,
        "drained at the whole rate: {more} passed, {refilled} refilled"
    );
    let until = ratelimit::maps::bucket::monotonic_ns() + 60_000_000_000;
    maps.update_config(|c| c.shares_until_ns = until).unwrap();
    set_word(&maps, half, 3);
    std::thread::sleep(Duration::from_millis(400));
    let held = passes(&dp, &frame, 400);
    println!("at a share of 1/2 of 3 holders, after 400 ms: {held} (burst 100)");
    assert!(
        (146..=152).contains(&held),
        "a bucket at a half of 3 holders holds 1.5 bursts: {held} of 150"
    );
}

/// The program charges a cluster-scoped bucket as `ratelimit_common::share::admit` says (the
/// arithmetic the cluster simulator and the agent's conversions run; the program keeps its own
/// copy of the step, shaped for the verifier): at every share word and holder count, shares in
/// force or lapsed, a bucket full or in debt after the agent converted it, `k` packets sent back
/// to back admit what `admit` computes for them at the instant before or after. At 1 packet a
/// second nothing refills meanwhile unless a boundary falls between the two instants.
#[test]
fn the_program_charges_a_cluster_bucket_as_the_shared_arithmetic_says() {
    use ratelimit::maps::{bucket::monotonic_ns, PinnedMaps};
    use ratelimit_common::{rule_flags, share, SHARE_FIELD_MASK, SHARE_ONE};
    require_root();
    let mut dp = TestDataplane::new("sharesame", 1024).unwrap();
    let set = dp
        .install_toml("[[rule]]\nname = \"c\"\nsource = \"198.18.0.0/16\"\nrate = 1\nburst = 20\n")
        .unwrap();
    let rid = set.by_name("c").unwrap().id;
    let mut maps = PinnedMaps::open(dp.pin_dir()).unwrap();
    let mut cluster = make_cluster_scoped(&mut maps, rid).unwrap();
    // The precise clock: the coarse one lags by up to a few ticks, which the step judges by.
    cluster.flags &= !rule_flags::COARSE_CLOCK;
    maps.set_rule(rid, cluster).unwrap();
    let limit = cluster.limit(0).unwrap();
    let words = [SHARE_ONE / 2, SHARE_ONE / 3, SHARE_ONE / 64, 0xabcd, 1];
    let mut case = 0u32;
    let mut admitted_some = 0;
    for word in words {
        for holders in [1u32, 2, 3, 63] {
            for in_force in [true, false] {
                for spent in [0usize, 7, 30] {
                    case += 1;
                    let src = Ipv4Addr::from(0xc612_0000 + case);
                    let frame = udp4(src);
                    let key = ratelimit::maps::bucket::bucket_key(rid, &cluster, src.into());
                    let until = if in_force {
                        monotonic_ns() + 60_000_000_000
                    } else {
                        0
                    };
                    maps.update_config(|c| c.shares_until_ns = until).unwrap();
                    let _ = passes(&dp, &frame, spent.max(1));
                    ratelimit::cluster::shares::set_share(
                        &ratelimit::maps::locator::Locator::new(&maps).unwrap(),
                        &key,
                        (u16::try_from(word).unwrap(), holders),
                        &limit,
                        monotonic_ns(),
                        ratelimit::maps::bucket::monotonic_coarse_ns(),
                    )
                    .unwrap();
                    let Slot::Found(i) = maps
                        .locate_bucket(&key, ratelimit::maps::bucket::monotonic_coarse_ns())
                        .unwrap()
                        .0
                    else {
                        panic!("case {case}: the source's bucket is gone");
                    };
                    let b = maps.store().get(i);
                    let dom = share::domain(true, b.created_share & SHARE_FIELD_MASK, in_force);
                    let k = 40;
                    let expect = |now: u64| {
                        let mut tat = b.tat_ns;
                        share::admit(
                            &mut tat,
                            now,
                            k,
                            limit.pkt_interval_ns,
                            limit.pkt_tolerance_ns,
                            dom,
                        )
                    };
                    let before = expect(monotonic_ns());
                    let got = passes(&dp, &frame, 40) as u64;
                    let after = expect(monotonic_ns());
                    admitted_some += got;
                    assert!(
                        got == before || got == after,
                        "case {case} (word {word:#x}, holders {holders}, in force {in_force}, \
                         {spent} spent, tat {} {}): the program admitted {got} of {k}, the \
                         shared arithmetic {before} (before) or {after} (after)",
                        b.tat_ns,
                        if b.tat_ns & share::STRETCHED != 0 {
                            "stretched"
                        } else {
                            "whole"
                        }
                    );
                }
            }
        }
    }
    assert!(admitted_some > 0, "no case admitted anything");
}

/// The share word the agent's cluster sync writes into a bucket (issue #15) is what the program
/// refills it at: a cluster-scoped bucket with a word of a quarter refills at a quarter of the
/// rate, between any two rounds, while `Config::shares_until_ns` is ahead; once that lapses (the
/// agent stopped) it refills at the whole rate again (fail open); a bucket of a limit without
/// the cluster flag ignores any word. Before share words, the program always refilled at the
/// whole rate (the agent took the refill back at each round).
#[test]
fn a_share_word_sets_a_cluster_buckets_refill_until_the_shares_lapse() {
    use ratelimit::maps::PinnedMaps;
    use ratelimit_common::SHARE_ONE;
    require_root();
    let mut dp = TestDataplane::new("share", 1024).unwrap();
    let set = dp
        .install_toml(
            "[[rule]]\nname = \"c\"\nsource = \"198.18.0.0/16\"\nrate = 1000\nburst = 1000\n",
        )
        .unwrap();
    let rid = set.by_name("c").unwrap().id;
    let mut maps = PinnedMaps::open(dp.pin_dir()).unwrap();
    let plain = maps.rule(rid).unwrap();
    let cluster = make_cluster_scoped(&mut maps, rid).unwrap();
    let src = ip("198.18.0.1");
    let frame = udp4(src);
    let key = ratelimit::maps::bucket::bucket_key(rid, &cluster, src.into());
    let sent = Instant::now();
    let first = passes(&dp, &frame, 3_000);
    // Its burst, and what refills while the packets go (at 1000/s: a loaded machine takes
    // tens of ms for them), a coarse tick (4 ms) and one more of slack.
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "a few thousand tokens"
    )]
    let most = 1_000 + (sent.elapsed().as_secs_f64() * 1_000.0).ceil() as usize + 5;
    assert!(
        (1_000..=most).contains(&first),
        "a fresh bucket admits its burst: {first} (at most {most})"
    );
    let quarter = u16::try_from(SHARE_ONE / 4).unwrap();
    let coarse = ratelimit::maps::bucket::monotonic_coarse_ns();
    assert_eq!(
        ratelimit::cluster::shares::set_share(
            &ratelimit::maps::locator::Locator::new(&maps).unwrap(),
            &key,
            (quarter, 4),
            &cluster.limit(0).unwrap(),
            ratelimit::maps::bucket::monotonic_ns(),
            coarse
        )
        .unwrap(),
        Some(0),
        "the bucket had no share"
    );
    let hold = |maps: &mut PinnedMaps, for_ns: u64| {
        let until = ratelimit::maps::bucket::monotonic_ns() + for_ns;
        maps.update_config(|c| c.shares_until_ns = until).unwrap();
        // The rule is on the coarse clock, up to a tick (4 ms) behind the one `until` is set
        // on: until it passes `until`, the program still sees the shares in force. Without
        // this wait, the drain of "shares lapsed" could be charged at the share's cost, leaving
        // up to 3 tokens' worth at the whole rate beyond the bounds' tick of slack.
        std::thread::sleep(Duration::from_millis(10));
    };

    // Shares in force: a quarter of the rate.
    hold(&mut maps, 60_000_000_000);
    assert_refill(&dp, &frame, 300, 250.0, "share 1/4 in force");

    // The shares lapsed: the whole rate (fail open).
    hold(&mut maps, 0);
    assert_refill(&dp, &frame, 300, 1_000.0, "shares lapsed");

    // In force again, then a limit without the cluster flag: the word is ignored. (Its TAT is
    // brought back to the whole rate's time first, as the lapse does: a rule the agent changes
    // gets a new id and new buckets, so no bucket of a local limit holds a TAT kept at a share.)
    hold(&mut maps, 60_000_000_000);
    assert_refill(&dp, &frame, 300, 250.0, "share 1/4 in force again");
    hold(&mut maps, 0);
    assert_refill(&dp, &frame, 300, 1_000.0, "shares lapsed again");
    maps.set_rule(rid, plain).unwrap();
    assert_refill(&dp, &frame, 300, 1_000.0, "no cluster flag, word in place");
    let Slot::Found(i) = maps
        .locate_bucket(&key, ratelimit::maps::bucket::monotonic_coarse_ns())
        .unwrap()
        .0
    else {
        panic!("the source's bucket is gone");
    };
    assert_eq!(
        maps.store().get(i).share(),
        quarter,
        "the word stayed in place"
    );
}
