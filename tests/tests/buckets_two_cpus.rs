//! Exactness when two CPUs share a bucket, through BPF_PROG_TEST_RUN on both CPUs at once: two
//! CPUs on one bucket admit what one would (the charge's compare-and-swap and its fallback), and
//! a source never holds two buckets when its first packets reach two CPUs, or the cluster's share
//! and a packet make its bucket, at the same instant.

use std::{
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use ratelimit::maps::store::Slot;
use ratelimit_common::{bucket_header, family, global, verdict, BucketKey};
use ratelimit_testbed::{
    clock::monotonic_ns,
    packet::{ip, udp4},
    require_root,
    xdp::{making_buckets, on_two_cpus_at_once, pin_to_cpu, Lockstep, XDP_PASS},
    TestDataplane,
};

/// Two CPUs hammering one bucket admit what one CPU would: the CAS makes the bucket exact.
#[test]
fn two_cpus_on_one_bucket_admit_no_more_than_one() {
    require_root();
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    assert!(cpus >= 2, "needs two CPUs");
    let mut dp = TestDataplane::new("cas", 1024).unwrap();
    let set = dp
        .install_toml(
            r#"[[rule]]
name = "l"
source = "198.18.0.0/16"
rate = 1000
burst = 20000
"#,
        )
        .unwrap();
    let frame = udp4(ip("198.18.0.1"));
    const REPEAT: u32 = 400_000;
    let start = Instant::now();
    std::thread::scope(|s| {
        for cpu in 0..2 {
            let (dp, frame) = (&dp, &frame);
            s.spawn(move || {
                pin_to_cpu(cpu).unwrap_or_else(|e| panic!("pin to CPU {cpu}: {e}"));
                let _ = dp.run_repeat(frame, REPEAT);
            });
        }
    });
    let elapsed = start.elapsed().as_secs_f64();
    let s = dp.rule(set.by_name("l").unwrap().id);
    let passed = s.pkts[verdict::PASSED];
    let dropped = s.pkts[verdict::DROPPED_RATE];
    // The source's first packets on the two CPUs may race to create its bucket: the CPU that
    // loses the claim of a record, or finds the other's record once its own is published, passes
    // its packet uncharged (`NO_BUCKET`, fail open), one packet per CPU per race (see the
    // program's `create`); CI saw it once in a full run. Every other run is charged, and the
    // uncharged ones, admitted too, count against the bound below.
    let uncharged = s.pkts[verdict::NO_BUCKET];
    assert_eq!(
        passed + dropped + uncharged,
        2 * u64::from(REPEAT),
        "every run counted: {:?}",
        s.pkts
    );
    // What one CPU would admit over the same time: the burst plus the refill.
    let bound = 20_000.0 + 1000.0 * elapsed;
    // A burst of 20,000 at 1,000/s holds 100 times what the coarse clock's lag allowance `L`
    // refills: the rule runs on the coarse clock alone (`COARSE_ONLY`), whose full bucket
    // withholds up to `ceil(rate x L)` (32 at HZ=250; see the coarse-only test below).
    let rule = dp.maps().rule(set.by_name("l").unwrap().id).unwrap();
    assert_ne!(rule.flags & ratelimit_common::rule_flags::COARSE_ONLY, 0);
    let withheld = (1000 * ratelimit::compile::coarse_lag_ns()).div_ceil(1_000_000_000);
    let fallbacks = dp.global().counters[global::CONTENDED_FALLBACKS];
    println!(
        "two CPUs: passed {passed} (and {uncharged} uncharged), one-CPU bound {bound:.0} over \
         {elapsed:.3} s; {fallbacks} contended fallbacks; the coarse clock withholds up to \
         {withheld}"
    );
    assert!(
        (passed + uncharged) as f64 <= bound + 4.0,
        "passed {passed} and {uncharged} uncharged > bound {bound:.0}: tokens were spent twice"
    );
    assert!(
        passed + withheld >= 20_000,
        "passed {passed}: the burst itself, but for the {withheld} the coarse clock may withhold, \
         must be admitted"
    );
}

/// Exact under forced contention: two CPUs run one source's packets while a third thread keeps
/// moving the bucket's TAT through the mapped store (the agent's in-place cluster charge, 1 ns
/// each), so that compare-and-swaps fail again and again and `bucket.rs` falls back to its
/// fetch-and-add. Whichever path admitted a packet, the bucket's own clock must show that every
/// admitted packet paid its interval and that the bucket never went past its burst:
///   created + passed x interval + hammer_ns <= TAT_final <= end + tolerance + hammer_ns,
/// an exact account (no timing tolerance: `end` is read after the last packet; the left side is
/// an equality unless both CPUs stall longer than the bucket is ahead), which gives
/// passed <= (end - created + tolerance) / interval = burst + rate x t.
///
/// On this 2-CPU machine 8 failures in a row are rare (`contended_fallbacks`, none in 4M
/// packets), so the real program's fallback runs here only as often as contention makes it; the
/// next test runs the same on the program built with one attempt (`test-cas-once`), where the
/// fallback judges a large share of the packets. A plain store instead of the CAS (lost charges)
/// fails this one.
#[test]
fn contended_buckets_pay_for_every_admitted_packet_on_any_path() {
    require_root();
    let dp = TestDataplane::new("casfall", 1024).unwrap();
    let fallbacks = contend_for_one_bucket(dp);
    println!("the real program: {fallbacks} contended fallbacks");
}

/// The same contention on the program built with one compare-and-swap per charge
/// (ratelimit-ebpf's test-only feature `test-cas-once`), so that the fetch-and-add fallback of
/// `bucket.rs` judges many of the packets (counted: `contended_fallbacks`) and must keep the
/// exact account: it fails if the fallback admits a packet without charging it, or keeps a
/// dropped packet's charge.
#[test]
fn the_contended_fallback_admits_nothing_it_does_not_charge() {
    require_root();
    let object = ratelimit_testbed::xdp::variant_object("test-cas-once").unwrap();
    let dp = TestDataplane::with_object("casonce", 1024, Some(object)).unwrap();
    let fallbacks = contend_for_one_bucket(dp);
    println!("one compare-and-swap per charge: {fallbacks} contended fallbacks");
    assert!(
        fallbacks > 1000,
        "only {fallbacks} charges reached the fallback: the test did not drive it"
    );
}

/// Both CPUs (and the agent's in-place charge) on one bucket; asserts the exact account and
/// returns the `contended_fallbacks` counter.
fn contend_for_one_bucket(mut dp: TestDataplane) -> u64 {
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    assert!(cpus >= 2, "needs two CPUs");
    // 1 us per token and a burst of 100k: the burst is spent by both CPUs at once (every packet
    // conforms, every packet is a compare-and-swap), then each token is raced for.
    let set = dp
        .install_toml(
            "[[rule]]\nname = \"l\"\nsource = \"198.18.0.0/16\"\nrate = 1000000\nburst = 100000\n",
        )
        .unwrap();
    let rid = set.by_name("l").unwrap().id;
    // The account below starts at the bucket's creation: the source's first packet makes it
    // (rather than passing without one, charged from its own time when the second makes it).
    let rule = making_buckets(
        &mut ratelimit::maps::PinnedMaps::open(dp.pin_dir()).unwrap(),
        rid,
    )
    .unwrap();
    let (interval, tolerance) = (rule.pkt_interval_ns, rule.pkt_tolerance_ns);
    assert_eq!((interval, tolerance), (1000, 100_000_000));
    let src = ip("198.18.0.1");
    let frame = udp4(src);
    let mut addr = [0u8; 16];
    addr[..4].copy_from_slice(&src.octets());
    let key = BucketKey {
        rule: rid,
        family: family::V4,
        _pad: [0; 3],
        addr,
    };
    // The record the source's bucket will take (the store is empty: the first record of its
    // less occupied set), so the hammer can start before the first packet and no time passes
    // between the bucket's creation and the contention.
    let (Slot::Vacant { index: record, .. }, gen) =
        dp.maps().locate_bucket(&key, monotonic_ns()).unwrap()
    else {
        panic!("the source already has a bucket");
    };
    let header = bucket_header(rid, family::V4, gen);
    let store = dp.maps().store();

    const REPEAT: u32 = 2_000_000;
    let nr: u64 = 2;
    let done = std::sync::atomic::AtomicBool::new(false);
    let hammer_ns = std::thread::scope(|s| {
        let hammer = s.spawn(|| {
            let mut n = 0u64;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                // `false` until the first packet has created the bucket. At `now` 0: a charge
                // added to the TAT as it is, never lifting it to a clock the program's coarse
                // one lags (which would blur the account below by up to a jiffy).
                if store.advance(record, header, 0, 1, 0) {
                    n += 1;
                }
            }
            n
        });
        let runners: Vec<_> = (0..nr as usize)
            .map(|cpu| {
                let (dp, frame) = (&dp, &frame);
                s.spawn(move || {
                    pin_to_cpu(cpu).unwrap_or_else(|e| panic!("pin to CPU {cpu}: {e}"));
                    let _ = dp.run_repeat(frame, REPEAT);
                })
            })
            .collect();
        for r in runners {
            r.join().unwrap();
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        hammer.join().unwrap()
    });
    let end = monotonic_ns();
    assert!(
        matches!(dp.maps().locate_bucket(&key, 0).unwrap().0, Slot::Found(r) if r == record),
        "the bucket is not in the record foreseen"
    );
    let (tat, created) = (store.get(record).tat_ns, store.get(record).created_ns());
    let s = dp.rule(rid);
    let (passed, dropped) = (s.pkts[verdict::PASSED], s.pkts[verdict::DROPPED_RATE]);
    // Both CPUs' first packets may create the source's bucket at the same instant: the creator
    // that finds the other's record gives its own back and its packet passes uncharged, counted
    // `no_bucket` (see `a_new_source_on_two_cpus_at_once_gets_one_bucket`): at most one a CPU.
    let uncharged = s.pkts[verdict::NO_BUCKET];
    assert!(uncharged <= nr, "{uncharged} packets passed uncharged");
    assert_eq!(
        passed + dropped + uncharged,
        nr * u64::from(REPEAT),
        "every run counted"
    );
    let bound = (end - created + tolerance) / interval;
    println!(
        "contended: passed {passed} of {}, bound {bound} over {:.3} s; hammer moved the TAT \
         {hammer_ns} times; TAT - created {} ns, passed x interval {} ns, unaccounted {} ns",
        nr * u64::from(REPEAT),
        (end - created) as f64 / 1e9,
        tat - created,
        passed * interval,
        (tat - created).saturating_sub(passed * interval + hammer_ns)
    );
    assert!(
        hammer_ns > 0,
        "the hammer never ran: no contention was forced"
    );
    assert!(
        created + passed * interval + hammer_ns <= tat,
        "{passed} admitted packets and {hammer_ns} charges should have moved the TAT by {} ns, \
         it moved {} ns: a packet passed without paying, or a charge was lost",
        passed * interval + hammer_ns,
        tat - created
    );
    assert!(
        tat <= end + tolerance + hammer_ns,
        "TAT {} ns past the end, beyond the tolerance {tolerance} (+{hammer_ns} ns charged): \
         the bucket was overdrawn",
        tat - end
    );
    assert!(
        passed <= bound,
        "passed {passed} > burst + rate x t = {bound}"
    );
    assert!(
        passed >= 100_000 / 2,
        "passed {passed}: the burst (less the hammer's charges) was not admitted"
    );
    dp.global().counters[global::CONTENDED_FALLBACKS]
}

/// `n` consecutive IPv4 sources from 198.18.0.0.
fn new_sources(n: u32) -> Vec<Ipv4Addr> {
    (0..n)
        .map(|i| Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 0)) + i))
        .collect()
}

/// The records holding a bucket of rule `rid`, and the distinct keys among them.
fn records_and_keys(dp: &TestDataplane, rid: u32) -> (usize, usize) {
    let mut keys: Vec<BucketKey> = dp
        .maps()
        .buckets()
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .filter(|k| k.rule == rid)
        .collect();
    let held = keys.len();
    keys.sort_by_key(|k| k.addr);
    keys.dedup_by(|a, b| a.addr == b.addr);
    (held, keys.len())
}

/// A new source's first packets on two CPUs at the same instant make one bucket, not two (two
/// records of one key would give the source two bursts). Both CPUs run the same list of new
/// sources in lockstep (a spin barrier before each source), so their creations overlap again and
/// again; then each source sends one more packet from one CPU. Afterwards every source has
/// exactly one record. (If two creators see each other's record, both give theirs back and the
/// source's next packet creates it anew: `new_buckets` may exceed the sources by those.) A
/// packet that loses the race passes uncharged (`bucket_errors`, the store's one fail-open
/// case), never with a second bucket.
#[test]
fn a_new_source_on_two_cpus_at_once_gets_one_bucket() {
    require_root();
    const SOURCES: u32 = 30_000;
    let mut dp = TestDataplane::new("newrace", 1 << 18).unwrap();
    let set = dp
        .install_toml("[[rule]]\nname = \"l\"\nsource = \"198.18.0.0/15\"\nrate = 1\nburst = 10\n")
        .unwrap();
    let rid = set.by_name("l").unwrap().id;
    let frames: Vec<Vec<u8>> = new_sources(SOURCES).into_iter().map(udp4).collect();
    for (i, actions) in on_two_cpus_at_once(&dp, &frames).iter().enumerate() {
        for (cpu, &action) in actions.iter().enumerate() {
            assert_eq!(action, XDP_PASS, "source {i} on CPU {cpu}");
        }
    }
    // One more packet each, from this thread alone.
    for frame in &frames {
        assert_eq!(dp.run(frame), XDP_PASS);
    }
    let (held, keys) = records_and_keys(&dp, rid);
    let g = dp.global();
    // Evictions are printed, not asserted: one run of the suite saw 1 in a store of 2^18
    // records holding 30,000 sources (not explained yet; see the session note).
    let (created, errors, evicted) = (
        g.counters[global::NEW_BUCKETS],
        g.counters[global::BUCKET_ERRORS],
        g.counters[global::EVICTED_FULL] + g.counters[global::EVICTED_LOST],
    );
    println!(
        "{SOURCES} sources on two CPUs in lockstep: {held} records for {} keys, new_buckets \
         {created}, bucket_errors {errors}, evicted {evicted}",
        keys
    );
    assert_eq!(
        held,
        keys,
        "{} keys are held by two records: their sources got two buckets",
        held - keys
    );
    assert_eq!(keys, SOURCES as usize, "every source has its bucket");
    assert!(
        created >= u64::from(SOURCES),
        "new_buckets {created} < {SOURCES} sources"
    );
    let s = dp.rule(rid);
    assert_eq!(
        s.pkts[verdict::PASSED] + s.pkts[verdict::NO_BUCKET],
        3 * u64::from(SOURCES),
        "every packet passed (within its burst) or, losing the race, uncharged"
    );
}

/// Of two CPUs creating a new source's bucket at the same instant, the one whose chosen record
/// the other took meanwhile (for this very source) does not take it again: it re-judges the
/// record it chose once it reads it again, and passes its packet uncharged (`bucket_errors`,
/// the documented allowance) rather than writing the source a second, full bucket over the
/// first. Under `burst = 1`, 5,000 sources in lockstep on two CPUs: every source that passed on
/// both CPUs is one such counted packet, and every bucket counted as made still stands. Before
/// the re-judging, 92-195 sources a run passed twice uncounted, their first charge overwritten
/// (`new_buckets` 5,092-5,195 for 5,000 records, and as many passes missing from the records).
#[test]
fn a_bucket_made_on_one_cpu_is_not_made_again_over_it_on_the_other() {
    require_root();
    const SOURCES: u32 = 5_000;
    let mut dp = TestDataplane::new("remade", 1 << 16).unwrap();
    let set = dp
        .install_toml("[[rule]]\nname = \"l\"\nsource = \"198.18.0.0/15\"\nrate = 1\nburst = 1\n")
        .unwrap();
    let rid = set.by_name("l").unwrap().id;
    let frames: Vec<Vec<u8>> = new_sources(SOURCES).into_iter().map(udp4).collect();
    let passes: Vec<usize> = on_two_cpus_at_once(&dp, &frames)
        .iter()
        .map(|actions| actions.iter().filter(|&&a| a == XDP_PASS).count())
        .collect();
    let twice = passes.iter().filter(|&&p| p > 1).count() as u64;
    let (held, keys) = records_and_keys(&dp, rid);
    let g = dp.global();
    let (made, uncharged) = (
        g.counters[global::NEW_BUCKETS],
        g.counters[global::BUCKET_ERRORS],
    );
    println!(
        "{SOURCES} sources under burst 1 on two CPUs at once: {twice} passed twice, {uncharged} \
         uncharged, {made} buckets made, {held} records for {keys} keys"
    );
    assert_eq!(held, keys, "a source holds two records");
    assert_eq!(made, held as u64, "a bucket counted as made does not stand");
    assert!(
        twice <= uncharged,
        "{twice} sources passed twice under burst 1, {uncharged} of them uncharged and counted"
    );
}

/// The cluster's share is written into a source's bucket from user space, which never creates
/// one (a source not seen here has nothing to share): when the program creates the source's
/// bucket while the agent looks it up, the source still ends with one bucket. One CPU runs each
/// new source's first packet while the other writes the same source's share word through
/// `cluster::shares::set_share`, in lockstep, the packet delayed by a varying few microseconds so
/// that it lands inside the lookup-and-write.
#[test]
fn the_clusters_share_and_a_packet_creating_one_source_at_once_make_one_bucket() {
    require_root();
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    assert!(cpus >= 2, "needs two CPUs");
    const SOURCES: u32 = 20_000;
    let mut dp = TestDataplane::new("chgrace", 1 << 18).unwrap();
    let set = dp
        .install_toml("[[rule]]\nname = \"l\"\nsource = \"198.18.0.0/15\"\nrate = 1\nburst = 10\n")
        .unwrap();
    let rid = set.by_name("l").unwrap().id;
    let record = dp.maps().rule(rid).unwrap();
    let sources = new_sources(SOURCES);
    let frames: Vec<Vec<u8>> = sources.iter().map(|&s| udp4(s)).collect();
    let step = Lockstep::new();
    std::thread::scope(|s| {
        let (frames, runner, step) = (&frames, dp.runner(), &step);
        s.spawn(move || {
            pin_to_cpu(0).unwrap();
            for (i, frame) in (0u32..).zip(frames) {
                assert_eq!(runner.run_repeat(frame, 1), XDP_PASS);
                step.wait(i);
                // 0 to ~16 us: the charge's map lookups take a few microseconds.
                let until = Instant::now() + Duration::from_nanos(u64::from(i % 64) * 250);
                while Instant::now() < until {
                    std::hint::spin_loop();
                }
                // The second packet makes the bucket: the first passes without one (the
                // key's slot of its line of `RL_BUCKET_TAGS`), and is run before the step.
                assert_eq!(runner.run_repeat(frame, 1), XDP_PASS);
            }
        });
        let (maps, sources, record) = (dp.maps(), &sources, &record);
        s.spawn(move || {
            pin_to_cpu(1).unwrap();
            for (i, &src) in (0u32..).zip(sources) {
                step.wait(i);
                // What the agent's round does to a bucket: its share word (a half here; in
                // turn the quarter, so that every write changes the word).
                let word = if i % 2 == 0 { 1 << 15 } else { 1 << 14 };
                ratelimit::cluster::shares::set_share(
                    &ratelimit::maps::locator::Locator::new(maps).unwrap(),
                    &ratelimit::maps::bucket::bucket_key(rid, record, src.into()),
                    (word, 2),
                    &record.limit(0).unwrap(),
                    monotonic_ns(),
                    ratelimit::maps::bucket::monotonic_coarse_ns(),
                )
                .unwrap();
            }
        });
    });
    let (held, keys) = records_and_keys(&dp, rid);
    let g = dp.global();
    println!(
        "{SOURCES} sources created by a packet while the cluster's share slowed them: {held} \
         records for {} keys; the program made {} buckets and gave {} back",
        keys,
        g.counters[global::NEW_BUCKETS],
        g.counters[global::BUCKET_ERRORS],
    );
    assert_eq!(
        held,
        keys,
        "{} keys are held by two records: their sources got two buckets",
        held - keys
    );
    assert_eq!(keys, SOURCES as usize, "every source has its bucket");
}
