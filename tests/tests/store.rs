//! The bucket store under attack, through BPF_PROG_TEST_RUN: sources chosen to collide (under a
//! known seed, as an attacker who knew it would choose them), alternating so that each one's packet
//! meets the other's record. Whatever they do, each source is held to its own bucket: `burst +
//! rate x t`, plus at most one burst each time its bucket is evicted while not full (counted as
//! `evicted_lost`); and a source in debt is not pushed out by one-packet sources.

use std::{net::Ipv4Addr, time::Instant};

use ratelimit_common::{global, verdict, GlobalStats};
use ratelimit_testbed::{
    collide::{
        colliding_v4, colliding_with_v4, densest_v4, key_v4 as key, old_first_seen_pair,
        old_first_seen_slot, set_seed, sets_of_v4, store_params, TEST_SEED,
    },
    packet::eth,
    require_root,
    xdp::{XDP_DROP, XDP_PASS},
    TestDataplane,
};

const RATE: u64 = 1;
const BURST: u64 = 5;
const BASE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 0);

fn rules() -> String {
    format!(
        "[[rule]]\nname = \"l\"\nsource = \"198.18.0.0/15\"\nrate = {RATE}\nburst = {BURST}\n\
         per = \"source\"\n"
    )
}

fn udp4(src: Ipv4Addr) -> Vec<u8> {
    eth()
        .ipv4(src, Ipv4Addr::new(198, 19, 255, 254))
        .udp(1000, 9)
        .build()
}

/// A data plane with a store of `max_buckets` under [`TEST_SEED`] and the one rule; its id.
fn setup(name: &str, max_buckets: u32) -> (TestDataplane, u32) {
    require_root();
    let mut dp = TestDataplane::new(name, max_buckets).unwrap();
    dp.make_buckets_at_first_packet();
    set_seed(dp.pin_dir(), TEST_SEED).unwrap();
    let set = dp.install_toml(&rules()).unwrap();
    let id = set.by_name("l").unwrap().id;
    (dp, id)
}

/// Sends `rounds` rounds of one packet from each source in turn; returns the passes per source
/// and the seconds it took.
fn alternate(dp: &TestDataplane, sources: &[Ipv4Addr], rounds: usize) -> (Vec<u64>, f64) {
    let frames: Vec<Vec<u8>> = sources.iter().map(|&s| udp4(s)).collect();
    let mut passed = vec![0u64; sources.len()];
    let start = Instant::now();
    for _ in 0..rounds {
        for (i, f) in frames.iter().enumerate() {
            if dp.run(f) == XDP_PASS {
                passed[i] += 1;
            }
        }
    }
    (passed, start.elapsed().as_secs_f64())
}

/// Most a bucket may admit over `secs`: its burst and the tokens earned meanwhile (one more
/// for a token that came due inside the interval's first and last packet).
#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss,
    reason = "small positive counts"
)]
fn bucket_bound(secs: f64) -> u64 {
    BURST + (RATE as f64 * secs).ceil() as u64
}

fn delta(after: &GlobalStats, before: &GlobalStats, i: usize) -> u64 {
    after.counters[i] - before.counters[i]
}

/// The attack of issue #10 against the old store: two sources sharing a slot of the old,
/// unkeyed first-seen table, alternating, each passed 200 of 200. Each is held to its bucket.
#[test]
fn a_pair_that_collided_in_the_old_first_seen_table_is_limited() {
    let (dp, id) = setup("oldpair", 65_536);
    let (a, b) = old_first_seen_pair(id, BASE, 17).unwrap();
    assert_eq!(old_first_seen_slot(id, a).0, old_first_seen_slot(id, b).0);
    let g0 = dp.global();
    let (passed, secs) = alternate(&dp, &[a, b], 200);
    for (ip, p) in [a, b].iter().zip(&passed) {
        assert!(
            (BURST..=bucket_bound(secs)).contains(p),
            "{ip} passed {p} of 200 in {secs:.2} s (bucket: {BURST} + {RATE}/s)"
        );
        let bucket = dp.maps().bucket(&key(id, *ip)).unwrap().expect("tracked");
        assert_eq!(u64::from(bucket.passed_pkts), *p);
    }
    let g1 = dp.global();
    assert_eq!(delta(&g1, &g0, global::NEW_BUCKETS), 2);
    assert_eq!(delta(&g1, &g0, global::EVICTED_LOST), 0);
}

/// Two, then eight sources that share both sets of the store under a known seed (eight is what
/// the two sets hold), alternating: every one keeps its own bucket, nothing is evicted.
#[test]
fn sources_sharing_both_sets_each_keep_their_bucket() {
    for n in [2, 8] {
        // A small store (16 sets) so that eight sources on one set pair are quick to find; its
        // other records stay empty.
        let (dp, id) = setup(&format!("share{n}"), 64);
        let (seed, sets) = store_params(dp.pin_dir()).unwrap();
        assert_eq!((seed, sets), (TEST_SEED, 16));
        let sources = colliding_v4(seed, sets, id, BASE, 17, n, &[]).unwrap();
        let g0 = dp.global();
        let (passed, secs) = alternate(&dp, &sources, 100);
        let g1 = dp.global();
        for (ip, p) in sources.iter().zip(&passed) {
            assert!(
                (BURST..=bucket_bound(secs)).contains(p),
                "{n} colliding: {ip} passed {p} of 100 in {secs:.2} s"
            );
        }
        assert_eq!(delta(&g1, &g0, global::NEW_BUCKETS), n as u64, "{n}");
        assert_eq!(delta(&g1, &g0, global::EVICTED_LOST), 0, "{n}");
        assert_eq!(delta(&g1, &g0, global::EVICTED_FULL), 0, "{n}");
        assert_eq!(dp.maps().bucket_count().unwrap(), n as u64);
    }
}

/// The attacker's best pick under a known seed: the sources whose keys have the fewest candidate
/// records of all (a key whose two sets were the same set had 4, not 8: one key in 16 before
/// the layout epoch 4). Eight of them, alternating, each keep their own bucket: every key has
/// 8 candidates, so no 8 sources can push one another out.
#[test]
fn the_densest_colliding_sources_an_attacker_can_find_each_keep_their_bucket() {
    let (dp, id) = setup("dense", 64);
    let (seed, sets) = store_params(dp.pin_dir()).unwrap();
    let (sources, records) = densest_v4(seed, sets, id, BASE, 17, 8).unwrap();
    let g0 = dp.global();
    let (passed, secs) = alternate(&dp, &sources, 100);
    let g1 = dp.global();
    println!("8 sources on {records} records: passed {passed:?} of 100 in {secs:.2} s");
    for (ip, p) in sources.iter().zip(&passed) {
        assert!(
            (BURST..=bucket_bound(secs)).contains(p),
            "8 sources on {records} records: {ip} passed {p} of 100 in {secs:.2} s"
        );
    }
    assert_eq!(records, 8, "a key with fewer than 8 candidate records");
    assert_eq!(delta(&g1, &g0, global::EVICTED_LOST), 0);
    assert_eq!(delta(&g1, &g0, global::NEW_BUCKETS), 8);
}

/// More sources on one set pair than its eight records, all over their limit: buckets in debt
/// must be evicted, and each such eviction may give its source one burst again, no more. The
/// allowance is exact: all admitted <= each source's `burst + rate x t` + `burst` per
/// `evicted_lost`, and the count is there for the operator to see.
#[test]
fn more_colliding_sources_than_records_are_held_to_the_eviction_allowance() {
    let (dp, id) = setup("thrash", 64);
    let (seed, sets) = store_params(dp.pin_dir()).unwrap();
    let n = 12;
    let sources = colliding_v4(seed, sets, id, BASE, 17, n, &[]).unwrap();
    let rounds = 200;
    let g0 = dp.global();
    let (passed, secs) = alternate(&dp, &sources, rounds);
    let g1 = dp.global();
    let lost = delta(&g1, &g0, global::EVICTED_LOST);
    let total: u64 = passed.iter().sum();
    let allowance = n as u64 * bucket_bound(secs) + BURST * lost;
    println!(
        "{n} sources on 8 records, {rounds} rounds in {secs:.2} s: passed {passed:?} = {total}, \
         evicted_lost {lost}, allowance {allowance}"
    );
    assert!(lost > 0, "12 sources in debt fit in 8 records?");
    assert!(total <= allowance, "{total} admitted > {allowance}");
    assert!(
        passed.iter().all(|&p| p >= BURST),
        "every source gets at least its burst: {passed:?}"
    );
    let rule = dp.rule(id);
    assert_eq!(rule.pkts[verdict::PASSED], total);
    assert_eq!(
        rule.pkts[verdict::DROPPED_RATE],
        (n * rounds) as u64 - total
    );
}

/// A source in debt (it has been dropped) shares its sets with a stream of one-packet sources
/// (a spoofed flood aimed at it, had the attacker known the seed): the newcomers evict one another,
/// never it, so it stays limited.
#[test]
fn a_dropped_source_is_not_pushed_out_by_one_packet_sources() {
    let (dp, id) = setup("debt", 64);
    let (seed, sets) = store_params(dp.pin_dir()).unwrap();
    let victim = Ipv4Addr::new(198, 18, 0, 1);
    let flood = colliding_with_v4(
        seed,
        sets,
        id,
        victim,
        Ipv4Addr::new(198, 19, 0, 0),
        16,
        200,
    )
    .unwrap();
    let start = Instant::now();
    let own = udp4(victim);
    let first: Vec<u32> = (0..2 * BURST).map(|_| dp.run(&own)).collect();
    assert_eq!(
        first.iter().filter(|&&a| a == XDP_PASS).count() as u64,
        BURST,
        "{first:?}"
    );
    let g0 = dp.global();
    for src in &flood {
        assert_eq!(dp.run(&udp4(*src)), XDP_PASS, "a new source's first packet");
    }
    let g1 = dp.global();
    assert_eq!(delta(&g1, &g0, global::NEW_BUCKETS), flood.len() as u64);
    // Still in debt: every packet dropped until its next token.
    let after: Vec<u32> = (0..20).map(|_| dp.run(&own)).collect();
    let secs = start.elapsed().as_secs_f64();
    let passed_after = after.iter().filter(|&&a| a == XDP_PASS).count() as u64;
    assert!(
        BURST + passed_after <= bucket_bound(secs),
        "the victim got {passed_after} more after the flood ({secs:.2} s): its bucket was lost"
    );
    if secs < 0.9 {
        assert!(after.iter().all(|&a| a == XDP_DROP), "{after:?}");
    }
    let b = dp
        .maps()
        .bucket(&key(id, victim))
        .unwrap()
        .expect("still tracked");
    assert_eq!(u64::from(b.passed_pkts), BURST + passed_after);
}

/// A bucket evicted while in debt loses its state, and only that: its source comes back to a
/// full bucket, exactly one burst (the allowance docs/design.md, "When the store is full", states), and
/// the eviction is counted as `evicted_lost`. Nine sources on one set pair (eight records): the
/// first spends 4 of its 5 tokens, seven others all 5, so the first is the least in debt and the
/// ninth takes its record.
#[test]
fn a_bucket_evicted_in_debt_restarts_full_and_is_counted_lost() {
    let (dp, id) = setup("restart", 64);
    let (seed, sets) = store_params(dp.pin_dir()).unwrap();
    let sources = colliding_v4(seed, sets, id, BASE, 17, 9, &[]).unwrap();
    let (first, others, ninth) = (sources[0], &sources[1..8], sources[8]);
    let runs = |ip: Ipv4Addr, n: u64| -> u64 {
        let f = udp4(ip);
        (0..n).filter(|_| dp.run(&f) == XDP_PASS).count() as u64
    };
    let g0 = dp.global();
    assert_eq!(runs(first, BURST - 1), BURST - 1);
    for &ip in others {
        assert_eq!(runs(ip, BURST), BURST, "{ip}: a new source's burst");
    }
    let g1 = dp.global();
    assert_eq!(delta(&g1, &g0, global::NEW_BUCKETS), 8);
    assert_eq!(delta(&g1, &g0, global::EVICTED_LOST), 0);
    assert!(dp.maps().bucket(&key(id, first)).unwrap().is_some());

    assert_eq!(runs(ninth, 1), 1, "the ninth source's first packet");
    let g2 = dp.global();
    assert_eq!(delta(&g2, &g1, global::NEW_BUCKETS), 1);
    assert_eq!(
        delta(&g2, &g1, global::EVICTED_LOST),
        1,
        "the least indebted bucket was taken"
    );
    assert_eq!(delta(&g2, &g1, global::EVICTED_FULL), 0);
    assert!(
        dp.maps().bucket(&key(id, first)).unwrap().is_none(),
        "the first source (least in debt) was the one evicted"
    );
    for &ip in others {
        assert!(dp.maps().bucket(&key(id, ip)).unwrap().is_some(), "{ip}");
    }

    // Back: a full bucket, one burst, where its old bucket had one token left. It takes the
    // record of the ninth source (one token spent: the least in debt now).
    let start = Instant::now();
    let back = runs(first, 2 * BURST);
    let secs = start.elapsed().as_secs_f64();
    assert!(
        (BURST..=bucket_bound(secs)).contains(&back),
        "came back to {back} passes in {secs:.3} s; a full bucket gives {BURST}"
    );
    if secs < 0.9 {
        // No token can come due within 0.9 s of the new bucket's creation (1 per second).
        assert_eq!(back, BURST);
    }
    let g3 = dp.global();
    assert_eq!(delta(&g3, &g2, global::NEW_BUCKETS), 1);
    assert_eq!(delta(&g3, &g2, global::EVICTED_LOST), 1);
    let b = dp
        .maps()
        .bucket(&key(id, first))
        .unwrap()
        .expect("tracked again");
    assert_eq!(u64::from(b.passed_pkts), back, "a new bucket's own count");
    assert!(dp.maps().bucket(&key(id, ninth)).unwrap().is_none());
}

/// Debt is weighed in time, alike under every rule: one packet under a `burst = 1` rule of 1 pps
/// (1 s to refill, its whole burst spent) does not outrank a source 4 s in debt under another
/// rule (4 of its 5 tokens spent). Eight records on one set pair: the indebted source and seven
/// one-packet sources of the `burst = 1` rule; a ninth source takes a one-packet source's record.
/// Weighed as a fraction of each rule's burst (100% against 80%), the indebted one went.
#[test]
fn one_packet_sources_of_a_burst_1_rule_do_not_push_out_a_source_in_debt() {
    require_root();
    let mut dp = TestDataplane::new("debttime", 64).unwrap();
    dp.make_buckets_at_first_packet();
    set_seed(dp.pin_dir(), TEST_SEED).unwrap();
    let set = dp
        .install_toml(
            "[[rule]]\nname = \"deep\"\nsource = \"198.18.0.0/16\"\nrate = 1\nburst = 5\n\n\
             [[rule]]\nname = \"one\"\nsource = \"198.19.0.0/16\"\nrate = 1\nburst = 1\n",
        )
        .unwrap();
    let (deep, one) = (
        set.by_name("deep").unwrap().id,
        set.by_name("one").unwrap().id,
    );
    let (seed, sets) = store_params(dp.pin_dir()).unwrap();
    let indebted = Ipv4Addr::new(198, 18, 0, 1);
    let want = sets_of_v4(seed, sets, deep, indebted);
    let others: Vec<Ipv4Addr> = (0..1u32 << 16)
        .map(|i| Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 0, 0)) + i))
        .filter(|&ip| sets_of_v4(seed, sets, one, ip) == want)
        .take(8)
        .collect();
    assert_eq!(
        others.len(),
        8,
        "sources of the burst-1 rule on the same set pair"
    );
    let runs = |ip: Ipv4Addr, n: u64| -> u64 {
        let f = udp4(ip);
        (0..n).filter(|_| dp.run(&f) == XDP_PASS).count() as u64
    };
    assert_eq!(runs(indebted, 4), 4, "4 of its 5 tokens");
    for &ip in &others[..7] {
        assert_eq!(runs(ip, 1), 1, "{ip}: one packet");
    }
    let g0 = dp.global();
    assert_eq!(runs(others[7], 1), 1, "the ninth source's first packet");
    let g1 = dp.global();
    assert_eq!(delta(&g1, &g0, global::EVICTED_LOST), 1);
    assert!(
        dp.maps().bucket(&key(deep, indebted)).unwrap().is_some(),
        "the source 4 s in debt kept its bucket"
    );
    let kept = others[..7]
        .iter()
        .filter(|&&ip| dp.maps().bucket(&key(one, ip)).unwrap().is_some())
        .count();
    assert_eq!(
        kept, 6,
        "a one-packet source (1 s to refill) gave its record"
    );
    // And the indebted source is still held to its bucket: its fifth token, then nothing.
    assert_eq!(runs(indebted, 3), 1);
}

/// A bucket that has refilled is taken first and nothing is lost: counted as `evicted_full`, not
/// `evicted_lost`, and its source, coming back, gets the burst it had anyway.
#[test]
fn a_refilled_bucket_is_evicted_first_counted_full() {
    require_root();
    let mut dp = TestDataplane::new("refilled", 64).unwrap();
    dp.make_buckets_at_first_packet();
    set_seed(dp.pin_dir(), TEST_SEED).unwrap();
    // Refills in burst / rate = 5 ms.
    let set = dp
        .install_toml(
            "[[rule]]\nname = \"fast\"\nsource = \"198.18.0.0/15\"\nrate = 1000\nburst = 5\n",
        )
        .unwrap();
    let id = set.by_name("fast").unwrap().id;
    let (seed, sets) = store_params(dp.pin_dir()).unwrap();
    let sources = colliding_v4(seed, sets, id, BASE, 17, 9, &[]).unwrap();
    let g0 = dp.global();
    for &ip in &sources[..8] {
        assert_eq!(dp.run(&udp4(ip)), XDP_PASS);
    }
    // Long past the 5 ms refill (and the coarse clock's tick): a sleep here cannot hide a
    // failure, a longer one only makes the buckets fuller.
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(dp.run(&udp4(sources[8])), XDP_PASS);
    let g1 = dp.global();
    assert_eq!(delta(&g1, &g0, global::NEW_BUCKETS), 9);
    assert_eq!(delta(&g1, &g0, global::EVICTED_FULL), 1);
    assert_eq!(delta(&g1, &g0, global::EVICTED_LOST), 0);
    let tracked = sources[..8]
        .iter()
        .filter(|&&ip| dp.maps().bucket(&key(id, ip)).unwrap().is_some())
        .count();
    assert_eq!(
        tracked, 7,
        "one of the eight refilled buckets gave its record"
    );
}

/// A store that is not set up (no sets: what the program sees before the agent writes its
/// config) cannot create buckets: packets under a limit rule pass (fail open), each counted as
/// `no_bucket` under its rule (packets and frame bytes) and as `bucket_errors` globally.
#[test]
fn without_a_store_packets_pass_counted_as_no_bucket() {
    let (dp, id) = setup("nostore", 64);
    let mut maps = ratelimit::maps::PinnedMaps::open(dp.pin_dir()).unwrap();
    let config = maps.config().unwrap();
    maps.set_config(ratelimit_common::Config {
        bucket_sets: 0,
        ..config
    })
    .unwrap();
    let frame = eth()
        .ipv4(
            Ipv4Addr::new(198, 18, 0, 1),
            Ipv4Addr::new(198, 19, 255, 254),
        )
        .udp(1000, 9)
        .pad_to(321)
        .build();
    let n = 3 * BURST;
    let g0 = dp.global();
    for i in 0..n {
        assert_eq!(dp.run(&frame), XDP_PASS, "packet {i} passes: fail open");
    }
    let g1 = dp.global();
    let r = dp.rule(id);
    assert_eq!(r.pkts[verdict::NO_BUCKET], n);
    assert_eq!(r.bytes[verdict::NO_BUCKET], n * 321);
    assert_eq!(r.pkts[verdict::PASSED] + r.pkts[verdict::DROPPED_RATE], 0);
    assert_eq!(delta(&g1, &g0, global::BUCKET_ERRORS), n);
    assert_eq!(delta(&g1, &g0, global::NEW_BUCKETS), 0);
    assert_eq!(delta(&g1, &g0, global::INTERNAL), 0);
    // Set up again, the same source gets a bucket and is limited.
    maps.set_config(config).unwrap();
    let passed = (0..2 * BURST)
        .filter(|_| dp.run(&frame) == XDP_PASS)
        .count() as u64;
    assert_eq!(passed, BURST);
    assert_eq!(delta(&dp.global(), &g1, global::BUCKET_ERRORS), 0);
}
