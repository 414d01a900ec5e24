//! Token-bucket semantics of the real XDP program, through BPF_PROG_TEST_RUN: burst admitted,
//! excess dropped, refill at the configured rate, per-prefix and per-rule grouping, allow/deny,
//! longest-prefix precedence, byte limits, dry run, and exactness when two CPUs share a bucket.

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    time::{Duration, Instant},
};

use ratelimit::maps::store::Slot;
use ratelimit_common::{bucket_header, family, global, verdict, BucketKey};
use ratelimit_testbed::{
    clock::monotonic_ns,
    packet::{eth, ip, udp4},
    require_root,
    xdp::{
        make_cluster_scoped, making_buckets, on_two_cpus_at_once, passes, pin_to_cpu, Lockstep,
        XDP_DROP, XDP_PASS,
    },
    TestDataplane,
};

fn udp6(src: Ipv6Addr) -> Vec<u8> {
    eth()
        .ipv6(src, "2001:db8::fe".parse().unwrap())
        .udp(1000, 9)
        .build()
}
fn ip6(s: &str) -> Ipv6Addr {
    s.parse().unwrap()
}

fn id(set: &ratelimit::compile::CompiledRuleSet, name: &str) -> u32 {
    set.by_name(name).expect("rule").id
}

#[test]
fn burst_is_admitted_and_the_excess_dropped() {
    require_root();
    let mut dp = TestDataplane::new("burst", 1024).unwrap();
    let set = dp
        .install_toml(
            r#"[[rule]]
name = "l"
source = "198.18.0.0/16"
rate = 1
burst = 5
"#,
        )
        .unwrap();
    let frame = udp4(ip("198.18.0.1"));
    let actions: Vec<u32> = (0..10).map(|_| dp.run(&frame)).collect();
    assert_eq!(
        &actions[..5],
        &[XDP_PASS; 5],
        "the burst passes: {actions:?}"
    );
    assert_eq!(
        &actions[5..],
        &[XDP_DROP; 5],
        "the excess is dropped: {actions:?}"
    );
    let s = dp.rule(id(&set, "l"));
    assert_eq!(s.pkts[verdict::PASSED], 5);
    assert_eq!(s.pkts[verdict::DROPPED_RATE], 5);
    // A second source has a bucket of its own.
    assert_eq!(passes(&dp, &udp4(ip("198.18.0.2")), 10), 5);
}

#[test]
fn bucket_refills_at_the_configured_rate() {
    require_root();
    let mut dp = TestDataplane::new("refill", 1024).unwrap();
    // Tolerance 0.5 s: the agent picks the coarse clock for it, so this also checks that clock.
    dp.install_toml(
        r#"[[rule]]
name = "l"
source = "198.18.0.0/16"
rate = 100
burst = 50
"#,
    )
    .unwrap();
    let frame = udp4(ip("198.18.0.1"));
    let start = Instant::now();
    assert_eq!(
        passes(&dp, &frame, 200),
        50,
        "a fresh bucket admits exactly its burst"
    );
    let drained = Instant::now();
    std::thread::sleep(Duration::from_millis(300));
    let before_second = Instant::now();
    let refilled = passes(&dp, &frame, 200);
    let end = Instant::now();
    // Tokens that can have accrued: at least the 300 ms slept (less one for clock granularity:
    // the coarse clock ticks in 4 ms, 0.4 token at 100/s, and a drop window on it can close that
    // late), at most what the whole span since the first packet refilled (the bound `burst +
    // rate x t`, exact on the coarse clock too).
    let min = ((before_second - drained).as_secs_f64() * 100.0).floor() as usize - 1;
    let max = ((end - start).as_secs_f64() * 100.0).floor() as usize;
    assert!(
        (min..=max).contains(&refilled),
        "refilled {refilled} tokens, expected {min}..={max} at 100/s"
    );
}

#[test]
fn per_prefix_and_per_rule_grouping() {
    require_root();
    let mut dp = TestDataplane::new("group", 1024).unwrap();
    dp.install_toml(
        r#"[[rule]]
name = "per24"
source = "198.18.0.0/16"
rate = 1
burst = 3
per = "/24"

[[rule]]
name = "shared"
source = "198.19.0.0/16"
rate = 1
burst = 4
per = "rule"

[[rule]]
name = "per64"
source = "2001:db8::/32"
rate = 1
burst = 2
per = "/64"
"#,
    )
    .unwrap();
    // Two hosts in one /24 share three tokens; a host in another /24 has its own.
    let a = udp4(ip("198.18.1.1"));
    let b = udp4(ip("198.18.1.200"));
    assert_eq!(passes(&dp, &a, 2) + passes(&dp, &b, 2), 3);
    assert_eq!(passes(&dp, &udp4(ip("198.18.2.1")), 5), 3);
    // One bucket for the whole rule.
    let total: usize = (1..=8)
        .map(|i| passes(&dp, &udp4(Ipv4Addr::new(198, 19, i, i)), 1))
        .sum();
    assert_eq!(total, 4);
    // IPv6: two addresses in one /64 share; another /64 is separate.
    let x = udp6(ip6("2001:db8:0:1::1"));
    let y = udp6(ip6("2001:db8:0:1:ffff::2"));
    assert_eq!(passes(&dp, &x, 2) + passes(&dp, &y, 2), 2);
    assert_eq!(passes(&dp, &udp6(ip6("2001:db8:0:2::1")), 3), 2);
}

/// `per = "rule"` is one bucket for the rule whatever the family: IPv4 and IPv6 sources of a
/// rule over both families (and of a `[[rule.limit]]` with `per = "rule"`) draw on one burst,
/// in one record, that `explain`'s key names for either family. Keyed by family, each family
/// had a bucket and a burst of its own (twice the budget).
#[test]
fn per_rule_is_one_bucket_across_families() {
    require_root();
    let mut dp = TestDataplane::new("rule46", 1024).unwrap();
    let set = dp
        .install_toml(
            r#"[[rule]]
name = "both"
source = ["198.18.0.0/15", "2001:db8::/32"]
protocol = "udp"
rate = 1
burst = 6
per = "rule"

[[rule]]
name = "layered"
source = ["198.20.0.0/16", "2001:db8:1::/48"]
protocol = "tcp"
rate = 1000
burst = 1000

[[rule.limit]]
rate = 1
burst = 4
per = "rule"
"#,
        )
        .unwrap();
    let v4 = |i: u8| udp4(Ipv4Addr::new(198, 18, i, 1));
    let v6 = |i: u16| udp6(Ipv6Addr::new(0x2001, 0xdb8, i, 0, 0, 0, 0, 1));
    // Alternating families, 10 of each: the one burst of 6, no more.
    let passed: usize = (0..10u8)
        .map(|i| passes(&dp, &v4(i), 1) + passes(&dp, &v6(u16::from(i)), 1))
        .sum();
    assert_eq!(passed, 6, "20 frames of both families under one burst of 6");
    // The gate's drop window (a per-rule limit's) holds for both families alike.
    assert_eq!(passes(&dp, &v6(99), 50) + passes(&dp, &v4(99), 50), 0);
    let both = id(&set, "both");
    let records: Vec<_> = dp
        .maps()
        .buckets()
        .unwrap()
        .into_iter()
        .filter(|(k, _)| ratelimit_common::split_bucket_rule(k.rule).0 == both)
        .collect();
    assert_eq!(records.len(), 1, "one record for the rule: {records:?}");
    let rule = &set.by_name("both").unwrap().rule;
    for ip in [
        "198.19.7.7".parse().unwrap(),
        "2001:db8:9::9".parse().unwrap(),
    ] {
        let key = ratelimit::maps::bucket::bucket_key(both, rule, ip);
        assert_eq!(key, records[0].0, "the key explain and top read for {ip}");
        assert_eq!(
            ratelimit::maps::bucket::key_source(&key, &rule.src_mask),
            "*"
        );
    }

    // A `[[rule.limit]]` with per = "rule": 4 of both families together.
    let tcp4 = |i: u8| {
        eth()
            .ipv4(Ipv4Addr::new(198, 20, i, 1), Ipv4Addr::new(198, 18, 0, 254))
            .tcp(1000, 80)
            .build()
    };
    let tcp6 = |i: u16| {
        eth()
            .ipv6(
                Ipv6Addr::new(0x2001, 0xdb8, 1, i, 0, 0, 0, 1),
                "2001:db8::fe".parse().unwrap(),
            )
            .tcp(1000, 80)
            .build()
    };
    let passed: usize = (0..6u8)
        .map(|i| passes(&dp, &tcp6(u16::from(i)), 1) + passes(&dp, &tcp4(i), 1))
        .sum();
    assert_eq!(
        passed, 4,
        "12 frames of both families under the limit's one burst of 4"
    );
}

#[test]
fn allow_deny_and_longest_prefix_precedence() {
    require_root();
    let mut dp = TestDataplane::new("lpm", 1024).unwrap();
    let set = dp
        .install_toml(
            r#"[[rule]]
name = "deny-wide"
source = "198.18.0.0/16"
action = "deny"

[[rule]]
name = "allow-office"
source = "198.18.5.0/24"
action = "allow"

[[rule]]
name = "limit-host"
source = "198.18.5.7/32"
rate = 1
burst = 2

[[rule]]
name = "v6-deny"
source = "2001:db8::/32"
action = "deny"

[[rule]]
name = "v6-allow"
source = "2001:db8:1::/48"
action = "allow"
"#,
        )
        .unwrap();
    assert_eq!(dp.run(&udp4(ip("198.18.6.1"))), XDP_DROP, "/16 deny");
    assert_eq!(
        passes(&dp, &udp4(ip("198.18.5.1")), 10),
        10,
        "/24 allow beats /16 deny"
    );
    assert_eq!(
        passes(&dp, &udp4(ip("198.18.5.7")), 10),
        2,
        "/32 limit beats /24 allow"
    );
    assert_eq!(dp.run(&udp6(ip6("2001:db8:2::1"))), XDP_DROP);
    assert_eq!(dp.run(&udp6(ip6("2001:db8:1::1"))), XDP_PASS);
    assert_eq!(dp.rule(id(&set, "deny-wide")).pkts[verdict::DENIED], 1);
    assert_eq!(dp.rule(id(&set, "allow-office")).pkts[verdict::ALLOWED], 10);
    assert_eq!(
        dp.rule(id(&set, "limit-host")).pkts[verdict::DROPPED_RATE],
        8
    );
}

#[test]
fn byte_limits() {
    require_root();
    let mut dp = TestDataplane::new("bytes", 1024).unwrap();
    let set = dp
        .install_toml(
            r#"[[rule]]
name = "bytes"
source = "198.18.0.0/16"
bytes_rate = 1000
bytes_burst = 3000

[[rule]]
name = "both"
source = "198.19.0.0/16"
rate = 1
burst = 100
bytes_rate = 1000
bytes_burst = 2000
"#,
        )
        .unwrap();
    let big = eth()
        .ipv4(ip("198.18.0.1"), ip("198.18.0.254"))
        .udp(1, 9)
        .pad_to(1000)
        .build();
    assert_eq!(
        passes(&dp, &big, 5),
        3,
        "3000 bytes of burst admit three 1000-byte frames"
    );
    let s = dp.rule(id(&set, "bytes"));
    assert_eq!(s.pkts[verdict::DROPPED_BYTES], 2);
    assert_eq!(s.bytes[verdict::PASSED], 3000);
    // With both limits, a frame dropped for bytes gives its packet token back: after two big
    // frames (2000 bytes) and three byte-drops, 98 packet tokens remain for frames that fit.
    let big2 = eth()
        .ipv4(ip("198.19.0.1"), ip("198.19.0.254"))
        .udp(1, 9)
        .pad_to(1000)
        .build();
    assert_eq!(passes(&dp, &big2, 5), 2);
    let s = dp.rule(id(&set, "both"));
    assert_eq!(s.pkts[verdict::DROPPED_BYTES], 3);
    assert_eq!(s.pkts[verdict::DROPPED_RATE], 0);
}

#[test]
fn dry_run_counts_would_be_drops_and_passes_them() {
    require_root();
    let mut dp = TestDataplane::new("dryrun", 1024).unwrap();
    let set = dp
        .install_toml(
            r#"[[rule]]
name = "l"
source = "198.18.0.0/16"
rate = 1
burst = 2
dry_run = true

[[rule]]
name = "d"
source = "198.19.0.0/16"
action = "deny"
dry_run = true
"#,
        )
        .unwrap();
    assert_eq!(passes(&dp, &udp4(ip("198.18.0.1")), 6), 6);
    let s = dp.rule(id(&set, "l"));
    assert_eq!((s.pkts[verdict::PASSED], s.pkts[verdict::DRY_RUN]), (2, 4));
    assert_eq!(passes(&dp, &udp4(ip("198.19.0.1")), 3), 3);
    assert_eq!(dp.rule(id(&set, "d")).pkts[verdict::DRY_RUN], 3);
}

#[test]
fn unchanged_rules_keep_their_buckets_across_a_swap() {
    require_root();
    let mut dp = TestDataplane::new("swap", 1024).unwrap();
    let rule = r#"[[rule]]
name = "l"
source = "198.18.0.0/16"
rate = 1
burst = 3
"#;
    let first = dp.install_toml(rule).unwrap();
    let frame = udp4(ip("198.18.0.1"));
    assert_eq!(passes(&dp, &frame, 5), 3);
    // Same rule plus a new one: "l" keeps its id and its (empty) bucket.
    let second = dp
        .install_toml(&format!(
            "{rule}\n[[rule]]\nname = \"other\"\nsource = \"198.19.0.0/16\"\naction = \"deny\"\n"
        ))
        .unwrap();
    assert_eq!(id(&first, "l"), id(&second, "l"));
    assert_eq!(
        passes(&dp, &frame, 5),
        0,
        "the exhausted bucket survived the swap"
    );
    assert_eq!(
        dp.run(&udp4(ip("198.19.0.1"))),
        XDP_DROP,
        "the new rule is in force"
    );
    // Changing the rule gives it a fresh id and a fresh bucket.
    let third = dp
        .install_toml(&rule.replace("burst = 3", "burst = 4"))
        .unwrap();
    assert_ne!(id(&first, "l"), id(&third, "l"));
    assert_eq!(passes(&dp, &frame, 6), 4);
    assert_eq!(
        dp.run(&udp4(ip("198.19.0.1"))),
        XDP_PASS,
        "the removed rule no longer matches"
    );
}

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
    let s = dp.rule(id(&set, "l"));
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
    let rule = dp.maps().rule(id(&set, "l")).unwrap();
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
    let rid = id(&set, "l");
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

/// Every verdict counts its packets and their frame bytes under the rule, exactly: `passed`,
/// `allowed`, `dropped_rate`, `dropped_bytes`, `denied`, `dry_run` (`no_bucket`: store.rs), one
/// rule per verdict pair, each with frames of its own length, every other slot zero.
#[test]
fn every_verdict_counts_packets_and_frame_bytes() {
    require_root();
    let mut dp = TestDataplane::new("vbytes", 1024).unwrap();
    let set = dp
        .install_toml(
            r#"[[rule]]
name = "lim"
source = "198.18.1.0/24"
rate = 1
burst = 2

[[rule]]
name = "bytes"
source = "198.18.2.0/24"
bytes_rate = 1
bytes_burst = 1514

[[rule]]
name = "allow"
source = "198.18.3.0/24"
action = "allow"

[[rule]]
name = "deny"
source = "198.18.4.0/24"
action = "deny"

[[rule]]
name = "dry"
source = "198.18.5.0/24"
rate = 1
burst = 1
dry_run = true
"#,
        )
        .unwrap();
    // (rule, source, frame length, packets sent, [(verdict, packets)])
    type Case = (
        &'static str,
        &'static str,
        usize,
        u64,
        &'static [(usize, u64)],
    );
    let cases: [Case; 5] = [
        (
            "lim",
            "198.18.1.1",
            100,
            5,
            &[(verdict::PASSED, 2), (verdict::DROPPED_RATE, 3)],
        ),
        (
            "bytes",
            "198.18.2.1",
            1000,
            3,
            &[(verdict::PASSED, 1), (verdict::DROPPED_BYTES, 2)],
        ),
        ("allow", "198.18.3.1", 150, 4, &[(verdict::ALLOWED, 4)]),
        ("deny", "198.18.4.1", 170, 2, &[(verdict::DENIED, 2)]),
        (
            "dry",
            "198.18.5.1",
            130,
            3,
            &[(verdict::PASSED, 1), (verdict::DRY_RUN, 2)],
        ),
    ];
    for (name, src, len, n, want) in cases {
        let frame = eth()
            .ipv4(ip(src), ip("198.18.0.254"))
            .udp(1000, 9)
            .pad_to(len)
            .build();
        assert_eq!(frame.len(), len);
        let delivered = passes(&dp, &frame, usize::try_from(n).unwrap()) as u64;
        let dropped: u64 = want
            .iter()
            .filter(|(v, _)| {
                [
                    verdict::DROPPED_RATE,
                    verdict::DROPPED_BYTES,
                    verdict::DENIED,
                ]
                .contains(v)
            })
            .map(|(_, k)| k)
            .sum();
        assert_eq!(delivered, n - dropped, "{name}: delivered");
        let mut pkts = [0u64; verdict::COUNT];
        for &(v, k) in want {
            pkts[v] = k;
        }
        let bytes = pkts.map(|k| k * len as u64);
        let got = dp.rule(id(&set, name));
        assert_eq!(
            got.pkts,
            pkts,
            "{name}: packets by verdict {:?}",
            verdict::NAMES
        );
        assert_eq!(
            got.bytes,
            bytes,
            "{name}: bytes by verdict {:?}",
            verdict::NAMES
        );
    }
}

/// A source over its limit is dropped from a per-CPU window without the bucket lookup (until its
/// next token is due, at most `DROP_BATCH` = 64 packets in a row): every packet is still dropped
/// and counted under its rule, the bucket's own counter catches up at each batch, and the next
/// token is admitted when it is due.
#[test]
fn drops_from_the_window_are_counted_and_end_with_the_next_token() {
    require_root();
    // One CPU: the window is per CPU, and this is about one CPU's window.
    pin_to_cpu(0).unwrap();
    let mut dp = TestDataplane::new("dropwin", 1024).unwrap();
    // One packet every 500 ms, no burst beyond one.
    let set = dp
        .install_toml(
            r#"[[rule]]
name = "l"
source = "198.18.0.0/16"
rate = 2
burst = 1
"#,
        )
        .unwrap();
    let rule = id(&set, "l");
    // The drops must all fall inside the first token's 500 ms. If the machine stalls this
    // thread past that (it did not run, not the limiter), the attempt says nothing: again, with a
    // source of its own (a fresh bucket). Three tries.
    for attempt in 1..=3u8 {
        let src = Ipv4Addr::new(198, 18, 0, attempt);
        let frame = udp4(src);
        let before = dp.rule(rule).pkts[verdict::DROPPED_RATE];
        let start = Instant::now();
        assert_eq!(dp.run(&frame), XDP_PASS, "the burst of one");
        let drops = 200u32;
        assert_eq!(
            passes(&dp, &frame, drops as usize),
            0,
            "no token is due yet"
        );
        if start.elapsed() >= Duration::from_millis(450) {
            eprintln!(
                "attempt {attempt}: {:?} for 201 packets, past one token's interval (the machine \
                 stalled this thread); again with another source",
                start.elapsed()
            );
            continue;
        }
        let s = dp.rule(rule);
        assert_eq!(s.pkts[verdict::DROPPED_RATE] - before, u64::from(drops));
        let mut addr = [0u8; 16];
        addr[..4].copy_from_slice(&src.octets());
        let key = ratelimit_common::BucketKey {
            rule,
            family: ratelimit_common::family::V4,
            _pad: [0; 3],
            addr,
        };
        let b = dp.maps().bucket(&key).unwrap().expect("bucket");
        assert!(
            (drops - 64..=drops).contains(&b.dropped_pkts),
            "the bucket's counter lags the rule's by less than one batch: {} of {drops}",
            b.dropped_pkts
        );
        assert_eq!(b.passed_pkts, 1);
        // The next token comes 500 ms after the first packet (plus a coarse tick or two).
        std::thread::sleep(Duration::from_millis(520).saturating_sub(start.elapsed()));
        assert_eq!(dp.run(&frame), XDP_PASS, "the next token is admitted");
        assert_eq!(dp.run(&frame), XDP_DROP);
        return;
    }
    panic!("three attempts in a row stalled past one token's interval; rerun on a quieter machine");
}

/// The agent reads the whole bucket store: every bucket is seen exactly once, the count agrees,
/// and removing a rule takes exactly its buckets out of every reader's view (their generation
/// ends; nothing is walked or deleted), while the other rule's stay.
#[test]
fn the_bucket_store_is_read_whole_and_a_removed_rules_buckets_go_stale() {
    require_root();
    let mut dp = TestDataplane::new("batches", 65_536).unwrap();
    let two_rules = r#"[[rule]]
name = "a"
source = "198.18.0.0/16"
rate = 10

[[rule]]
name = "b"
source = "198.19.0.0/16"
rate = 10
"#;
    let set = dp.install_toml(two_rules).unwrap();
    let (a, b) = (id(&set, "a"), id(&set, "b"));
    let (na, nb) = (20_000u32, 3_000u32);
    let send = |first: [u8; 2], n: u32| {
        for i in 0..n {
            let [_, _, hi, lo] = i.to_be_bytes();
            let frame = udp4(Ipv4Addr::new(first[0], first[1], hi, lo));
            assert_eq!(dp.run(&frame), XDP_PASS);
            assert_eq!(dp.run(&frame), XDP_PASS);
        }
    };
    send([198, 18], na);
    send([198, 19], nb);
    // Each source's first packet passes without a bucket and its second, a tenth of a second
    // before that bucket would be full again, makes it. At a third of the store's capacity a few
    // sources may find both their sets full and take one's record: counted, so the count is
    // still exact.
    let g = dp.global();
    assert_eq!(g.counters[global::NEW_BUCKETS], u64::from(na + nb));
    let evicted = g.counters[global::EVICTED_FULL] + g.counters[global::EVICTED_LOST];
    assert!(
        evicted * 100 < u64::from(na + nb),
        "{evicted} evicted at a third of capacity"
    );
    let all = dp.maps().buckets().unwrap();
    let mut keys: Vec<_> = all.iter().map(|(k, _)| (k.rule, k.addr)).collect();
    keys.sort_unstable();
    keys.dedup();
    assert_eq!(keys.len(), all.len(), "a bucket seen twice");
    assert_eq!(all.len() as u64, u64::from(na + nb) - evicted);
    let of_a = all.iter().filter(|(k, _)| k.rule == a).count() as u64;
    assert!(of_a <= u64::from(na) && of_a + evicted >= u64::from(na));
    let odd: Vec<_> = all.iter().filter(|(_, v)| v.passed_pkts != 2).collect();
    assert!(
        odd.is_empty(),
        "buckets not counting their 2 packets: {odd:?}"
    );
    assert!(
        odd.is_empty(),
        "{} odd: {:?}",
        odd.len(),
        &odd[..odd.len().min(10)]
    );
    assert_eq!(dp.maps().bucket_count().unwrap(), all.len() as u64);

    // Rule "b" goes: its buckets with it, "a"'s stay.
    dp.install_toml(two_rules.split("\n[[rule]]\nname = \"b\"").next().unwrap())
        .unwrap();
    let left = dp.maps().buckets().unwrap();
    assert_eq!(left.len() as u64, of_a);
    assert!(left.iter().all(|(k, _)| k.rule == a && k.rule != b));
    assert_eq!(dp.maps().bucket_count().unwrap(), of_a);
}

/// The fragments of a limited datagram charge its source's bucket like whole packets: a first
/// fragment and the fragments that follow it each take a token, and once the burst is spent the
/// next fragment is dropped for its rate like any packet.
#[test]
fn fragments_of_a_limited_datagram_charge_the_same_bucket() {
    require_root();
    let mut dp = TestDataplane::new("fragbucket", 1024).unwrap();
    let set = dp
        .install_toml(
            r#"[[rule]]
name = "dns"
source = "198.18.0.0/16"
protocol = "udp"
dst_port = 53
rate = 1
burst = 3

[[rule]]
name = "rest"
source = "198.18.0.0/16"
action = "allow"
"#,
        )
        .unwrap();
    let (dns, rest) = (id(&set, "dns"), id(&set, "rest"));
    let src = ip("198.18.0.1");
    let dst = Ipv4Addr::new(198, 18, 0, 254);
    let first = |ident| {
        eth()
            .ipv4(src, dst)
            .udp(1000, 53)
            .payload(16)
            .frag(0, true)
            .ident(ident)
            .build()
    };
    let later = |ident| {
        eth()
            .ipv4(src, dst)
            .proto(17)
            .payload(16)
            .frag(3, false)
            .ident(ident)
            .build()
    };
    // Datagram 1: both fragments pass and take a token each; datagram 2's first takes the last.
    assert_eq!(dp.run(&first(1)), XDP_PASS);
    assert_eq!(dp.run(&later(1)), XDP_PASS);
    assert_eq!(dp.run(&first(2)), XDP_PASS);
    // Its second fragment finds the bucket empty: dropped for the rate, not passed as "no port".
    assert_eq!(dp.run(&later(2)), XDP_DROP);
    let s = dp.rule(dns);
    assert_eq!(
        (s.pkts[verdict::PASSED], s.pkts[verdict::DROPPED_RATE]),
        (3, 1)
    );
    assert_eq!(
        dp.rule(rest).pkts[verdict::ALLOWED],
        0,
        "a fragment fell to the rule without ports"
    );
    let mut addr = [0u8; 16];
    addr[..4].copy_from_slice(&src.octets());
    let b = dp
        .maps()
        .bucket(&ratelimit_common::BucketKey {
            rule: dns,
            family: ratelimit_common::family::V4,
            _pad: [0; 3],
            addr,
        })
        .unwrap()
        .expect("one bucket for the source");
    assert_eq!((b.passed_pkts, b.dropped_pkts), (3, 1));
    // A fragment of a datagram whose first fragment was not seen: its datagram's rule is
    // unknown, and a port rule could apply, so it is dropped, not charged to the rule without one
    // (`a_datagram_sent_last_fragment_first_is_held_to_its_limit`).
    assert_eq!(dp.run(&later(3)), XDP_DROP);
    assert_eq!(dp.rule(rest).pkts[verdict::ALLOWED], 0);
    let g = dp.global();
    assert_eq!(g.counters[global::FRAGMENTS_UNMATCHED], 1);
    assert_eq!(g.counters[global::DROPPED_UNMATCHED_FRAGMENTS], 1);
}

/// A limited datagram sent last fragment first is held to its limit like one sent in order. The
/// receiving kernel reassembles fragments in any order, so a sender that puts its first fragment
/// (the only one with the ports) last would otherwise have every other fragment classified
/// without ports, by the rule without one (here `allow`), and spend one token of its port's
/// limit for a whole datagram: with a burst of 3, three datagrams of three fragments, nine
/// packets, all reached the stack (and, IPv6, the same with the later fragments naming any next
/// header). Each such fragment is dropped while a rule that looks at the protocol or port could
/// apply (`dropped_unmatched_fragments`), so that its datagram never completes; the first
/// fragments, judged by their ports, take the burst.
#[test]
fn a_datagram_sent_last_fragment_first_is_held_to_its_limit() {
    require_root();
    let mut dp = TestDataplane::new("fragrev", 1024).unwrap();
    let set = dp
        .install_toml(
            r#"[[rule]]
name = "dns"
source = "198.18.0.0/16"
protocol = "udp"
dst_port = 53
rate = 1
burst = 3

[[rule]]
name = "rest"
source = "198.18.0.0/16"
action = "allow"

[[rule]]
name = "dns6"
source = "2001:db8::/32"
protocol = "udp"
dst_port = 53
rate = 1
burst = 3

[[rule]]
name = "rest6"
source = "2001:db8::/32"
action = "allow"
"#,
        )
        .unwrap();
    let (rest, rest6) = (id(&set, "rest"), id(&set, "rest6"));
    let (src, dst) = (ip("198.18.0.1"), Ipv4Addr::new(198, 18, 0, 254));
    let (src6, dst6) = (ip6("2001:db8::1"), ip6("2001:db8::fe"));
    // Datagram `ident` in three fragments, the first last: two later fragments (offsets 16 and
    // 32 bytes, the last one without MF), then the first, with the UDP header to port 53.
    let reversed4 = |ident: u32| {
        [
            eth()
                .ipv4(src, dst)
                .proto(17)
                .payload(16)
                .frag(4, false)
                .ident(ident)
                .build(),
            eth()
                .ipv4(src, dst)
                .proto(17)
                .payload(16)
                .frag(2, true)
                .ident(ident)
                .build(),
            eth()
                .ipv4(src, dst)
                .udp(1000, 53)
                .payload(8)
                .frag(0, true)
                .ident(ident)
                .build(),
        ]
    };
    // IPv6: the later fragments name No Next Header (the kernel takes the first fragment's).
    let reversed6 = |ident: u32| {
        [
            eth()
                .ipv6(src6, dst6)
                .frag6(4, false)
                .ident(ident)
                .proto(59)
                .payload(16)
                .build(),
            eth()
                .ipv6(src6, dst6)
                .frag6(2, true)
                .ident(ident)
                .proto(59)
                .payload(16)
                .build(),
            eth()
                .ipv6(src6, dst6)
                .frag6(0, true)
                .ident(ident)
                .udp(1000, 53)
                .payload(8)
                .build(),
        ]
    };
    let g0 = dp.global();
    let mut passed = [0usize; 2];
    for ident in 1..=3 {
        for (k, frames) in [reversed4(ident).to_vec(), reversed6(ident).to_vec()]
            .into_iter()
            .enumerate()
        {
            passed[k] += frames.iter().filter(|f| dp.run(f) == XDP_PASS).count();
        }
    }
    let g = dp.global();
    let moved = |c: usize| g.counters[c] - g0.counters[c];
    println!(
        "reversed datagrams (3 of 3 fragments each, burst 3): IPv4 {} fragments passed, IPv6 {}; \
         under the rule without ports: {} and {}; dropped_unmatched_fragments {}",
        passed[0],
        passed[1],
        dp.rule(rest).pkts[verdict::ALLOWED],
        dp.rule(rest6).pkts[verdict::ALLOWED],
        moved(global::DROPPED_UNMATCHED_FRAGMENTS),
    );
    // `burst + rate x t`: 3, and 1 more should a second pass while the test runs.
    assert!(
        passed[0] <= 4,
        "IPv4: {} fragments of the limited datagrams passed",
        passed[0]
    );
    assert!(
        passed[1] <= 4,
        "IPv6: {} fragments of the limited datagrams passed",
        passed[1]
    );
    assert_eq!(
        (
            dp.rule(rest).pkts[verdict::ALLOWED],
            dp.rule(rest6).pkts[verdict::ALLOWED]
        ),
        (0, 0),
        "a fragment of a limited datagram fell to the rule without ports"
    );
    // Each datagram's two later fragments (the first fragments take the burst).
    assert_eq!(moved(global::DROPPED_UNMATCHED_FRAGMENTS), 12);
    assert_eq!(passed, [3, 3], "the first fragments, charged to the limit");
}

/// No packet sees half a rule set: while one CPU runs a source's packets without pause, the
/// other swaps 100 times between a set that allows its prefix and one that denies it (plus a UDP
/// rule on a longer prefix). Every packet is counted under a rule of the set in force with that
/// rule's verdict: none falls through to "no rule", an internal error or a failed bucket, which
/// is what a trie of one set read against the rule records of the other would give. (The
/// rules' ids change with every swap, so the count per rule is not kept across them.)
#[test]
fn a_rule_set_swap_is_seen_whole_by_every_packet() {
    require_root();
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    assert!(cpus >= 2, "needs two CPUs");
    let mut dp = TestDataplane::new("swap", 1024).unwrap();
    let a = "[[rule]]\nname = \"open\"\nsource = \"198.18.0.0/16\"\naction = \"allow\"\n";
    let b = "[[rule]]\nname = \"shut\"\nsource = \"198.18.0.0/16\"\naction = \"deny\"\n\n\
             [[rule]]\nname = \"dns\"\nsource = \"198.18.0.0/24\"\nprotocol = \"udp\"\n\
             dst_port = 53\naction = \"allow\"\n";
    dp.install_toml(a).unwrap();
    let frame = udp4(ip("198.18.0.1"));
    let g0 = dp.global();
    let runner = dp.runner();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (runs, passes, drops) = std::thread::scope(|s| {
        let run = s.spawn(|| {
            pin_to_cpu(1).unwrap();
            let (mut runs, mut passes, mut drops) = (0u64, 0u64, 0u64);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match runner.run_repeat(&frame, 1) {
                    XDP_PASS => passes += 1,
                    XDP_DROP => drops += 1,
                    other => panic!("XDP action {other}"),
                }
                runs += 1;
            }
            (runs, passes, drops)
        });
        pin_to_cpu(0).unwrap();
        for i in 0..100 {
            dp.install_toml(if i % 2 == 0 { b } else { a }).unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        run.join().unwrap()
    });
    let g = dp.global();
    println!("{runs} packets during 100 swaps: {passes} passed, {drops} dropped");
    assert_eq!(
        g.counters[global::PACKETS] - g0.counters[global::PACKETS],
        runs
    );
    assert!(passes > 0 && drops > 0, "the runs did not span the swaps");
    for c in [global::NO_MATCH, global::INTERNAL, global::BUCKET_ERRORS] {
        assert_eq!(
            g.counters[c] - g0.counters[c],
            0,
            "packets counted as {} during the swaps",
            global::NAMES[c]
        );
    }
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
    let rid = id(&set, "l");
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
    let rid = id(&set, "l");
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
    let rid = id(&set, "l");
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
                // key's slot of `RL_FIRST_PACKETS`), and is run before the step.
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
    let rid = id(&set, "c");
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
    let rid = id(&set, "c");
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
    let rid = id(&set, "c");
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

/// The program loads well inside the verifier's budget: at most half of the 1,000,000
/// instructions the kernel processes at most to verify a program. The program was at 974,468
/// (e9ca2cf): removing one `memset` call took it past the limit, and any change to the creation
/// path risked the same. `one_limit` as a global BPF function, verified once on its own rather
/// than once per caller state, brought it to 162,548 (c4667b4). A change that nears the limit
/// again fails here, with the count, before the program stops loading.
#[test]
fn the_program_loads_with_half_the_verifiers_budget_to_spare() {
    require_root();
    let dp = TestDataplane::new("verifier", 1024).unwrap();
    let n = dp
        .program()
        .info()
        .unwrap()
        .verified_instruction_count()
        .expect("the kernel reports the instructions it verified (5.16 and later)");
    println!("the verifier processed {n} instructions to load the program (limit 1,000,000)");
    assert!(
        n <= 500_000,
        "the verifier processed {n} instructions: over half its limit of 1,000,000"
    );
}

/// Every call chain of the program leaves a quarter of a frame's worth of the verifier's stack
/// spare: at most 448 of the 512 bytes (`MAX_BPF_STACK`) the verifier allows a chain, each
/// function's frame rounded to 16 bytes as it rounds them under the JIT. Read from the object the
/// tests load (`bpf_stack`: each function's deepest `r10` offset, and its BPF-to-BPF calls), and
/// every chain printed. Two chains were at 512 (`ratelimit` → `decide_cut`, 336 + 176, and
/// `ratelimit` → `one_limit` → `other_holder`, 336 + 160 + 16): one more spilled value in any of
/// those frames and the program no longer loaded. Fails naming the chains over.
#[test]
fn every_call_chain_leaves_64_bytes_of_the_verifiers_stack() {
    const MAX_CHAIN: u32 = 448;
    let object = ratelimit::dataplane::object();
    assert!(!object.is_empty(), "built without the XDP object");
    let (frames, chains) = ratelimit_testbed::bpf_stack::chains_of(object, "ratelimit").unwrap();
    let mut by_frame: Vec<_> = frames.functions.iter().filter(|f| f.depth > 0).collect();
    by_frame.sort_by_key(|f| std::cmp::Reverse(f.frame()));
    for f in by_frame {
        println!("frame {:4} B ({:3} deepest) {}", f.frame(), f.depth, f.name);
    }
    for c in &chains {
        println!("chain {}", frames.describe(c));
    }
    assert!(
        chains.len() > 1,
        "the program makes no BPF call: {chains:?}"
    );
    let over: Vec<String> = chains
        .iter()
        .filter(|c| c.stack > MAX_CHAIN)
        .map(|c| frames.describe(c))
        .collect();
    assert!(
        over.is_empty(),
        "call chains over {MAX_CHAIN} bytes of stack (the verifier refuses 512+): {over:#?}"
    );
}

/// The rule a packet from `src` (UDP to port 9) was counted under: the one whose allowed or
/// denied count moved by one over the run, with the run's action.
fn counted_under(
    dp: &TestDataplane,
    set: &ratelimit::compile::CompiledRuleSet,
    src: &str,
) -> (Option<String>, u32) {
    let before: Vec<_> = set.rules.iter().map(|r| dp.rule(r.id).pkts).collect();
    let action = dp.run(&udp4(ip(src)));
    let moved: Vec<String> = set
        .rules
        .iter()
        .zip(before)
        .filter(|(r, b)| dp.rule(r.id).pkts != *b)
        .map(|(r, _)| r.name.clone())
        .collect();
    assert!(moved.len() <= 1, "{src} counted under {moved:?}");
    (moved.into_iter().next(), action)
}

/// The IPv4 table's half the rule set in force lives in.
fn half_in_force(dp: &TestDataplane) -> u8 {
    ratelimit_common::prefix_generation(dp.maps().config().unwrap().generation)
}

/// Where the word of the /16 of `src` is in a half of the IPv4 table.
fn slot_of(src: &str) -> usize {
    let [a, b, _, _] = ip(src).octets();
    ratelimit_common::v4_table::index(0, [a, b]) as usize
}

/// The word of the IPv4 table's half in force for the /16 of `src`.
fn table_word(dp: &TestDataplane, src: &str) -> u32 {
    dp.maps().v4_table().half(half_in_force(dp))[slot_of(src)]
}

/// The IPv4 table (one word per /16, read before the trie) gives each packet the rule the trie's
/// walk gives it, and follows every install: sources in /16s whose word holds the outcome
/// (covered by a /0, a /8 or a /16 with nothing longer inside) and in /16s that fall back to the
/// trie (a /24 inside, a port rule first), checked against the reference walk and by the rule
/// counters, before and after a swap that turns words both ways.
#[test]
fn the_ipv4_table_classifies_as_the_trie_across_installs() {
    use ratelimit_common::v4_table::{direct, TRIE};
    require_root();
    let mut dp = TestDataplane::new("v4table", 1024).unwrap();
    let allow = |name: &str, source: &str| {
        format!("[[rule]]\nname = \"{name}\"\nsource = \"{source}\"\naction = \"allow\"\n\n")
    };
    let deny = |name: &str, source: &str| {
        format!("[[rule]]\nname = \"{name}\"\nsource = \"{source}\"\naction = \"deny\"\n\n")
    };
    let dns = "[[rule]]\nname = \"dns\"\nsource = \"10.2.0.0/16\"\nprotocol = \"udp\"\n\
               dst_port = 9\naction = \"deny\"\n\n";
    let first = [
        allow("all", "0.0.0.0/0"),
        allow("ten", "10.0.0.0/8"),
        deny("ten-one", "10.1.0.0/16"),
        allow("ten-one-two", "10.1.2.0/24"),
        dns.to_string(),
    ]
    .concat();
    let second = [
        deny("all", "0.0.0.0/0"),
        deny("ten-one", "10.1.0.0/16"),
        allow("ten-three", "10.3.0.0/24"),
    ]
    .concat();
    // (source, the rule it falls under, whether its /16's word holds the outcome)
    type Source<'a> = (&'a str, &'a str, bool);
    let cases: [(&str, &[Source]); 2] = [
        (
            &first,
            &[
                ("192.0.2.1", "all", true),
                ("10.200.0.1", "ten", true),
                ("10.3.0.1", "ten", true),
                ("10.1.0.1", "ten-one", false),
                ("10.1.2.1", "ten-one-two", false),
                ("10.2.0.1", "dns", false),
            ],
        ),
        (
            &second,
            &[
                ("192.0.2.2", "all", true),
                ("10.200.0.2", "all", true),
                ("10.1.2.2", "ten-one", true),
                ("10.2.0.2", "all", true),
                ("10.3.0.2", "ten-three", false),
                ("10.3.1.2", "all", false),
            ],
        ),
    ];
    for (rules, sources) in cases {
        let set = dp.install_toml(rules).unwrap();
        for &(src, rule, held) in sources {
            let want = set.by_name(rule).unwrap();
            let walk = set.classify(ip(src).into(), 17, Some(9), 0).map(|r| r.id);
            assert_eq!(
                walk,
                Some(want.id),
                "the reference walk puts {src} under {rule}"
            );
            let word = table_word(&dp, src);
            if held {
                assert_eq!(word, direct(Some(want.id)), "{src}'s /16 holds its outcome");
            } else {
                assert_eq!(word, TRIE, "{src}'s /16 falls back to the trie");
            }
            let action = if want.rule.action == ratelimit_common::action::DENY {
                XDP_DROP
            } else {
                XDP_PASS
            };
            assert_eq!(
                counted_under(&dp, &set, src),
                (Some(rule.to_string()), action),
                "{src}"
            );
        }
        // Both halves hold the set in force once the install is over.
        let maps = dp.maps();
        assert_eq!(maps.v4_table().half(0), maps.v4_table().half(1));
        assert_eq!(maps.v4_table().half(0), set.v4_table());
    }
}

/// The program reads the IPv4 table before the trie: a word planted in the half in force sends
/// its /16's new sources to the planted rule (so the table, not the trie, decided), and the next
/// install, of the same rules, finds and repairs it.
#[test]
fn a_planted_ipv4_table_word_is_followed_and_repaired_by_the_next_install() {
    use ratelimit_common::v4_table::direct;
    require_root();
    let mut dp = TestDataplane::new("v4plant", 1024).unwrap();
    let rules = "[[rule]]\nname = \"all\"\nsource = \"0.0.0.0/0\"\naction = \"allow\"\n\n\
                 [[rule]]\nname = \"ten\"\nsource = \"10.0.0.0/8\"\naction = \"deny\"\n";
    let set = dp.install_toml(rules).unwrap();
    assert_eq!(
        counted_under(&dp, &set, "10.200.0.1"),
        (Some("ten".into()), XDP_DROP)
    );
    {
        let half = half_in_force(&dp);
        let table = dp.maps().v4_table();
        let mut words = table.half(half);
        words[slot_of("10.200.0.0")] = direct(Some(id(&set, "all")));
        assert_eq!(table.write_half(half, &words), 1);
    }
    assert_eq!(
        counted_under(&dp, &set, "10.200.0.2"),
        (Some("all".into()), XDP_PASS),
        "the planted word decides"
    );
    assert_eq!(
        counted_under(&dp, &set, "10.201.0.2"),
        (Some("ten".into()), XDP_DROP)
    );
    let again = dp.install_toml(rules).unwrap();
    assert_eq!(id(&again, "ten"), id(&set, "ten"));
    assert_eq!(table_word(&dp, "10.200.0.3"), direct(Some(id(&set, "ten"))));
    assert_eq!(
        counted_under(&dp, &again, "10.200.0.3"),
        (Some("ten".into()), XDP_DROP)
    );
}
