//! Token-bucket semantics of the real XDP program, through BPF_PROG_TEST_RUN: burst admitted,
//! excess dropped, refill at the configured rate, per-prefix and per-rule grouping, allow/deny,
//! longest-prefix precedence, byte limits, dry run, and exactness when two CPUs share a bucket.

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    time::{Duration, Instant},
};

use ratelimit_common::{global, verdict};
use ratelimit_testbed::{
    packet::eth,
    require_root,
    xdp::{pin_to_cpu, XDP_DROP, XDP_PASS},
    TestDataplane,
};

fn udp4(src: Ipv4Addr) -> Vec<u8> {
    eth()
        .ipv4(src, Ipv4Addr::new(198, 18, 0, 254))
        .udp(1000, 9)
        .build()
}
fn udp6(src: Ipv6Addr) -> Vec<u8> {
    eth()
        .ipv6(src, "2001:db8::fe".parse().unwrap())
        .udp(1000, 9)
        .build()
}
fn ip(s: &str) -> Ipv4Addr {
    s.parse().unwrap()
}
fn ip6(s: &str) -> Ipv6Addr {
    s.parse().unwrap()
}

/// Runs `frame` `n` times (one test run each) and counts the passes.
fn passes(dp: &TestDataplane, frame: &[u8], n: usize) -> usize {
    (0..n).filter(|_| dp.run(frame) == XDP_PASS).count()
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
    // Tokens that can have accrued: at least the 300 ms slept, at most the whole span since the
    // first packet; one token of slack each side for clock granularity (the coarse clock ticks in
    // 4 ms: 0.4 token at 100/s).
    let min = ((before_second - drained).as_secs_f64() * 100.0).floor() as usize - 1;
    let max = ((end - start).as_secs_f64() * 100.0).ceil() as usize + 1;
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
    assert_eq!(passed + dropped, 2 * u64::from(REPEAT), "every run counted");
    // What one CPU would admit over the same time: the burst plus the refill.
    let bound = 20_000.0 + 1000.0 * elapsed;
    println!("two CPUs: passed {passed}, one-CPU bound {bound:.0} over {elapsed:.3} s");
    assert!(
        passed as f64 <= bound + 4.0,
        "passed {passed} > bound {bound:.0}: tokens were spent twice"
    );
    assert!(
        passed >= 20_000,
        "passed {passed}: the burst itself must be admitted"
    );
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
    let src = ip("198.18.0.1");
    let frame = udp4(src);
    let start = Instant::now();
    assert_eq!(dp.run(&frame), XDP_PASS, "the burst of one");
    let drops = 200u32;
    assert_eq!(
        passes(&dp, &frame, drops as usize),
        0,
        "no token is due yet"
    );
    assert!(
        start.elapsed() < Duration::from_millis(450),
        "too slow to stay inside one token's interval; rerun on a quieter machine"
    );
    let s = dp.rule(rule);
    assert_eq!(s.pkts[verdict::DROPPED_RATE], u64::from(drops));
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
rate = 1000

[[rule]]
name = "b"
source = "198.19.0.0/16"
rate = 1000
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
    // At a third of the store's capacity a few sources may find both their sets full (of
    // refilled buckets, at 1000/s) and take one's record: counted, so the count is still exact.
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
    assert!(all.iter().all(|(_, v)| v.passed_pkts == 2));
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
    // A fragment of a datagram whose first fragment never came: no port, so the rule without one.
    assert_eq!(dp.run(&later(3)), XDP_PASS);
    assert_eq!(dp.rule(rest).pkts[verdict::ALLOWED], 1);
    let g = dp.global();
    assert_eq!(g.counters[global::FRAGMENTS_UNMATCHED], 1);
}
