//! A key's first packet without a bucket (the slots of `RL_BUCKET_TAGS`' lines,
//! `ratelimit_common::first_owed`),
//! through BPF_PROG_TEST_RUN: it passes without one, and the key's next packet before its
//! bucket would be full again makes the bucket owing it, so a source gets exactly its burst;
//! under attack (two keys sharing a slot, one key on two CPUs at once, a flood of one-packet
//! keys) no source gets more than exact GCRA gives it.

use std::net::Ipv4Addr;

use ratelimit_common::{global, verdict};
use ratelimit_testbed::{
    collide::{
        first_line_v4, key_v4 as key, set_seed, sharing_first_line_v4, store_params, TEST_SEED,
    },
    packet::eth,
    require_root,
    xdp::{on_two_cpus_at_once, XDP_DROP, XDP_PASS},
    TestDataplane,
};

fn udp4(src: Ipv4Addr) -> Vec<u8> {
    eth()
        .ipv4(src, Ipv4Addr::new(198, 19, 255, 254))
        .udp(1000, 9)
        .build()
}

/// A data plane with a store of `max_buckets` under the test seed and one rule over
/// 198.18.0.0/15 of `rate` and `burst`; the rule's id.
fn setup(name: &str, max_buckets: u32, rate: u32, burst: u32) -> (TestDataplane, u32) {
    require_root();
    let mut dp = TestDataplane::new(name, max_buckets).unwrap();
    set_seed(dp.pin_dir(), TEST_SEED).unwrap();
    let set = dp
        .install_toml(&format!(
            "[[rule]]\nname = \"l\"\nsource = \"198.18.0.0/15\"\nrate = {rate}\nburst = {burst}\n"
        ))
        .unwrap();
    let id = set.by_name("l").unwrap().id;
    (dp, id)
}

/// The sets of `dp`'s store.
fn sets(dp: &TestDataplane) -> u32 {
    store_params(dp.pin_dir()).unwrap().1
}

/// A new source's first packet passes and makes no bucket; its next ones, back to back, make
/// the bucket owing the first: exactly the burst passes in all (not the burst and one), and the
/// bucket counts the first packet. On the coarse clock (rate 1, burst 5) and on the precise one
/// (rate 50, burst 2: a tolerance of a few ticks).
#[test]
fn a_first_packet_passes_without_a_bucket_and_the_next_owe_it() {
    for (rate, burst) in [(1u32, 5u32), (50, 2)] {
        let (dp, id) = setup(&format!("first{rate}"), 4096, rate, burst);
        let src = Ipv4Addr::new(198, 18, 0, 7);
        let frame = udp4(src);
        assert_eq!(dp.run(&frame), XDP_PASS);
        let g = dp.global();
        assert_eq!(
            (
                g.counters[global::FIRST_PACKETS],
                g.counters[global::NEW_BUCKETS]
            ),
            (1, 0),
            "rate {rate}: the first packet passes without a bucket"
        );
        assert!(dp.maps().bucket(&key(id, src)).unwrap().is_none());
        let rest: Vec<u32> = (0..9).map(|_| dp.run(&frame)).collect();
        let passed = 1 + rest.iter().filter(|&&a| a == XDP_PASS).count();
        assert_eq!(passed, burst as usize, "rate {rate}: {rest:?}");
        assert!(rest[burst as usize - 1..].iter().all(|&a| a == XDP_DROP));
        // Its drops reach it in batches (the drop window's): at most those sent.
        let b = dp.maps().bucket(&key(id, src)).unwrap().expect("a bucket");
        assert_eq!(b.passed_pkts, burst, "rate {rate}");
        assert!((1..=10 - burst).contains(&b.dropped_pkts), "rate {rate}");
        let g = dp.global();
        assert_eq!(g.counters[global::NEW_BUCKETS], 1);
        let s = dp.rule(id);
        assert_eq!(s.pkts[verdict::PASSED], u64::from(burst));
    }
}

/// Five keys whose line is the same (4 slots, different fingerprints), in turn, back to back:
/// none takes another's slot while its time is ahead, so the first 4 pass their first packet
/// free and owe it, the fifth finds the line full and makes its bucket full, and each gets its
/// burst and no more. (A table that let a key overwrite another's slot would give both a free
/// packet each time: the first-seen table's hole of issue #10.)
#[test]
fn five_keys_sharing_a_line_each_get_their_burst_and_no_more() {
    const BURST: u32 = 3;
    let (dp, id) = setup("firstline", 4096, 1, BURST);
    let base = Ipv4Addr::new(198, 18, 0, 0);
    let keys = sharing_first_line_v4(TEST_SEED, sets(&dp), id, base, 20, 5).unwrap();
    let frames: Vec<Vec<u8>> = keys.iter().map(|&k| udp4(k)).collect();
    let mut passed = [0u32; 5];
    for _ in 0..20 {
        for (i, f) in frames.iter().enumerate() {
            if dp.run(f) == XDP_PASS {
                passed[i] += 1;
            }
        }
    }
    assert_eq!(passed, [BURST; 5], "{keys:?}, 20 packets each");
    let g = dp.global();
    assert_eq!(
        (
            g.counters[global::FIRST_PACKETS],
            g.counters[global::NEW_BUCKETS]
        ),
        (4, 5),
        "four free first packets, five buckets"
    );
}

/// One new key's first packet on two CPUs at the same instant, for 5,000 keys under a burst of
/// one: the slot is taken by one compare-and-swap, so of two packets that find it free exactly
/// one passes (free) and the other makes the bucket owing it and is dropped, never both. The
/// keys are chosen each with a line of its own (a key whose line other keys' times fill makes
/// its bucket at once: the store's creation race, `buckets_two_cpus.rs`).
#[test]
fn a_first_packet_on_two_cpus_at_once_passes_once() {
    const SOURCES: u32 = 5_000;
    let (dp, id) = setup("firstrace", 1 << 18, 1, 1);
    let n = sets(&dp);
    let mut lines = std::collections::HashSet::new();
    let frames: Vec<Vec<u8>> = (0..)
        .map(|i| Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 0)) + i))
        .filter(|&src| lines.insert(first_line_v4(TEST_SEED, n, id, src).0))
        .take(SOURCES as usize)
        .map(udp4)
        .collect();
    let passes: Vec<usize> = on_two_cpus_at_once(&dp, &frames)
        .iter()
        .map(|actions| actions.iter().filter(|&&a| a == XDP_PASS).count())
        .collect();
    let twice = passes.iter().filter(|&&p| p > 1).count();
    let s = dp.rule(id);
    let g = dp.global();
    println!(
        "{SOURCES} keys on two CPUs at once: passed {:?}, first_packets {}, new_buckets {}, \
         bucket_errors {}",
        s.pkts,
        g.counters[global::FIRST_PACKETS],
        g.counters[global::NEW_BUCKETS],
        g.counters[global::BUCKET_ERRORS]
    );
    assert_eq!(
        twice, 0,
        "{twice} keys passed on both CPUs under a burst of one"
    );
    assert!(
        passes.iter().all(|&p| p == 1),
        "a key passed on neither CPU"
    );
    assert_eq!(
        (
            g.counters[global::FIRST_PACKETS],
            g.counters[global::NEW_BUCKETS]
        ),
        (u64::from(SOURCES), u64::from(SOURCES)),
        "each key's first packet passed free on one CPU and made its bucket on the other"
    );
}

/// A flood of one-packet keys (20,000 spoofed sources, one packet each, under a limit of 1,000 a
/// second) passes without making buckets but where every slot of a key's line held a time still
/// ahead, in a small store as in a large one: a store of 4,096 records has as many slots as one
/// of 2^20 (`ratelimit_common::FIRST_MIN_LINES`, 131,072), so the store is not churned and
/// nothing in it is evicted. (With only its own lines' slots, 512, one key in eight of this flood
/// made a bucket in the store of 4,096 records.)
#[test]
fn a_flood_of_one_packet_keys_makes_few_buckets_whatever_the_stores_size() {
    const SOURCES: u32 = 20_000;
    for records in [4_096u32, 1 << 16] {
        let (dp, _) = setup(&format!("firstflood{records}"), records, 1000, 10);
        for i in 1..=SOURCES {
            let src = Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 0)) + i);
            assert_eq!(dp.run(&udp4(src)), XDP_PASS);
        }
        let g = dp.global();
        let (free, made) = (
            g.counters[global::FIRST_PACKETS],
            g.counters[global::NEW_BUCKETS],
        );
        println!(
            "store of {records}: {SOURCES} one-packet keys, {free} passed without a bucket, \
             {made} made one"
        );
        assert_eq!(free + made, u64::from(SOURCES));
        assert!(
            free * 100 >= u64::from(SOURCES) * 99,
            "store of {records}: {free} of {SOURCES} free"
        );
        assert_eq!(
            g.counters[global::EVICTED_FULL] + g.counters[global::EVICTED_LOST],
            0
        );
    }
}

/// A source that has a bucket is charged by it for every packet, even when its slot of its
/// line is free again for a first packet: the bucket's tag (`RL_BUCKET_TAGS`,
/// written before the record is published) says it has a record, and the slot is never read.
/// The attack: a key `k` spends its burst and is in debt; a key `m` sharing `k`'s slot takes it
/// once `k`'s time there has passed, and `m`'s time passes too; then `k` sends again. A program
/// that judged "no record" without the tags' word would pass `k`'s first packet there free
/// (counted in `first_packets`, missing from `k`'s bucket), once per turn of its slot. Between
/// rounds, 2,048 other sources push `k` out of the CPU's remembered classifications.
#[test]
fn a_source_with_a_bucket_never_passes_free_when_its_slot_frees() {
    const BURST: u32 = 5;
    // 10 packets a second: a slot's time is 100 ms ahead of the packet that took it.
    let (dp, id) = setup("firsttag", 4096, 10, BURST);
    let n = sets(&dp);
    let pair =
        sharing_first_line_v4(TEST_SEED, n, id, Ipv4Addr::new(198, 18, 0, 0), 16, 2).unwrap();
    let (k, m) = (pair[0], pair[1]);
    let (fk, fm) = (udp4(k), udp4(m));
    let began = std::time::Instant::now();
    let mut passed = (0..20).filter(|_| dp.run(&fk) == XDP_PASS).count() as u32;
    assert_eq!(passed, BURST, "{k}: its burst");
    let settle = std::time::Duration::from_millis(250);
    std::thread::sleep(settle);
    let free = |dp: &TestDataplane| dp.global().counters[global::FIRST_PACKETS];
    assert_eq!(free(&dp), 1, "k's first packet");
    assert_eq!(dp.run(&fm), XDP_PASS);
    assert_eq!(free(&dp), 2, "{m} took the slot {k} left");
    std::thread::sleep(settle);
    let before = dp.maps().bucket(&key(id, k)).unwrap().expect("k's bucket");
    // Sources that push k out of this CPU's 256 remembered classifications (so its packets look
    // for its record rather than taking the one remembered), none on k's slot.
    let line = first_line_v4(TEST_SEED, n, id, k).0;
    let fillers: Vec<Vec<u8>> = (1..=4_000u32)
        .map(|i| Ipv4Addr::from(0xc613_0000 | i))
        .filter(|&a| first_line_v4(TEST_SEED, n, id, a).0 != line)
        .take(2_048)
        .map(udp4)
        .collect();
    for round in 0..3 {
        for f in &fillers {
            let _ = dp.run(f);
        }
        let free_before = free(&dp);
        let now = (0..20).filter(|_| dp.run(&fk) == XDP_PASS).count() as u32;
        passed += now;
        assert_eq!(
            free(&dp),
            free_before,
            "round {round}: {k} passed free with a bucket"
        );
        std::thread::sleep(settle);
    }
    let after = dp.maps().bucket(&key(id, k)).unwrap().expect("k's bucket");
    assert_eq!(after.header(), before.header(), "the same bucket");
    assert_eq!(
        after.passed_pkts - before.passed_pkts,
        passed - BURST,
        "every pass of {k} charged to its bucket"
    );
    // And never past the bound: the burst and what the rate refilled since the first packet.
    let bound = BURST + (began.elapsed().as_millis() as u32).div_ceil(100);
    assert!(passed <= bound, "{k} passed {passed}, bound {bound}");
}

/// Every record that holds a key has the key's tag, after a churn of new buckets evicting one
/// another (20,000 sources of two packets each into 4,096 records; the second makes the bucket):
/// the invariant the program's "no record" rests on (`ratelimit_common::tags`).
#[test]
fn every_record_holds_its_keys_tag() {
    let (dp, id) = setup("firsttags", 4096, 1, 5);
    for i in 0..20_000u32 {
        let f = udp4(Ipv4Addr::from(0xc612_0000 | i));
        let _ = dp.run(&f);
        let _ = dp.run(&f);
    }
    let g = dp.global();
    assert!(
        g.counters[global::NEW_BUCKETS] >= 10_000,
        "{} buckets made",
        g.counters[global::NEW_BUCKETS]
    );
    let store = dp.maps().store();
    let (mut live, mut wrong) = (0, Vec::new());
    store.for_each(|i, b| {
        if b.rule != id as u16 {
            return;
        }
        live += 1;
        let want = dp.maps().bucket_tag(&b.key()).unwrap();
        if store.tag(i) != Some(want) {
            wrong.push((i, store.tag(i), want));
        }
    });
    assert!(live >= 3_000, "{live} live records");
    assert!(
        wrong.is_empty(),
        "{} of {live} records without their key's tag: {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(5)]
    );
}
