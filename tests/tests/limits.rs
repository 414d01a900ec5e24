//! Several limits per rule (`[[rule.limit]]`), run through the real XDP program with
//! BPF_PROG_TEST_RUN: a packet passes only if it conforms to every limit of its rule; a packet one
//! limit drops spends no token of the others (the limits before it are refunded exactly: their
//! buckets' TATs are what they were before the packet); the rule's counters say which limit
//! dropped; every limit keeps its own buckets (the limit's index in the key).
//!
//! Rates of 1 packet/s with bursts of a few packets: nothing refills measurably while a test
//! runs, so every count below is exact.

use std::{net::Ipv4Addr, time::Duration};

use ratelimit::maps::store::Slot;
use ratelimit_common::{
    bucket_rule, family, global, split_bucket_rule, verdict, Bucket, BucketKey,
};
use ratelimit_testbed::{
    packet::eth,
    require_root,
    xdp::{XDP_DROP, XDP_PASS},
    TestDataplane,
};

fn udp4(src: Ipv4Addr, len: usize) -> Vec<u8> {
    eth()
        .ipv4(src, Ipv4Addr::new(198, 18, 0, 254))
        .udp(1000, 9)
        .payload(len)
        .build()
}

fn ip(s: &str) -> Ipv4Addr {
    s.parse().unwrap()
}

/// The bucket of limit `limit` (0: the rule's own) of rule `id` whose masked address starts with
/// `prefix`.
fn bucket(dp: &TestDataplane, id: u32, limit: u32, addr: Ipv4Addr) -> Option<Bucket> {
    let mut a = [0u8; 16];
    a[..4].copy_from_slice(&addr.octets());
    let want = BucketKey {
        rule: bucket_rule(id, limit),
        family: family::V4,
        _pad: [0; 3],
        addr: a,
    };
    dp.maps()
        .buckets()
        .unwrap()
        .into_iter()
        .find(|(k, _)| *k == want)
        .map(|(_, b)| b)
}

#[test]
fn a_packet_passes_only_within_every_limit_and_a_drop_spends_no_token_of_the_others() {
    require_root();
    let mut dp = TestDataplane::new("limits2", 1024).unwrap();
    dp.make_buckets_at_first_packet();
    let set = dp
        .install_toml(
            r#"
[[rule]]
name = "web"
source = "198.18.0.0/16"
rate = 1
burst = 5
[[rule.limit]]
per = "/24"
rate = 1
burst = 8
"#,
        )
        .unwrap();
    let id = set.by_name("web").unwrap().id;
    let rule = dp.maps().rule(id).unwrap();
    assert_eq!(rule.limits(), 2);
    let (a, b, c) = (ip("198.18.0.1"), ip("198.18.0.2"), ip("198.18.1.1"));
    let fa = udp4(a, 10);
    let fb = udp4(b, 10);
    // A: its own 5, then dropped by its own limit (limit 0), which the /24 never sees.
    for i in 0..5 {
        assert_eq!(dp.run(&fa), XDP_PASS, "A's packet {i}");
    }
    assert_eq!(dp.run(&fa), XDP_DROP, "A over its own burst");
    let s = dp.rule(id);
    assert_eq!(s.pkts[verdict::PASSED], 5);
    assert_eq!(s.limit_dropped_rate, [1, 0, 0, 0]);
    let net = bucket(&dp, id, 1, ip("198.18.0.0")).expect("the /24's bucket");
    assert_eq!(net.passed_pkts, 5);
    assert_eq!(net.dropped_pkts, 0);
    // B: 3 more fill the /24's 8; B's 4th conforms to B's own limit but not to the /24's.
    for i in 0..3 {
        assert_eq!(dp.run(&fb), XDP_PASS, "B's packet {i}");
    }
    let before = bucket(&dp, id, 0, b).expect("B's bucket");
    assert_eq!(before.passed_pkts, 3);
    assert_eq!(dp.run(&fb), XDP_DROP, "B over the /24's burst");
    let after = bucket(&dp, id, 0, b).unwrap();
    // No token of B's own limit was spent on the packet the /24 dropped: the same TAT.
    assert_eq!(
        after.tat_ns, before.tat_ns,
        "B's own bucket was refunded exactly"
    );
    assert_eq!((after.passed_pkts, after.dropped_pkts), (3, 0));
    let net = bucket(&dp, id, 1, ip("198.18.0.0")).unwrap();
    assert_eq!((net.passed_pkts, net.dropped_pkts), (8, 1));
    let s = dp.rule(id);
    assert_eq!(s.pkts[verdict::PASSED], 8);
    assert_eq!(s.pkts[verdict::DROPPED_RATE], 2);
    assert_eq!(s.limit_dropped_rate, [1, 1, 0, 0]);
    // More of B, now from the CPU's drop window of the /24's limit: still the /24's drops, and
    // still no token of B's own.
    for _ in 0..10 {
        assert_eq!(dp.run(&fb), XDP_DROP);
    }
    assert_eq!(bucket(&dp, id, 0, b).unwrap().tat_ns, before.tat_ns);
    assert_eq!(dp.rule(id).limit_dropped_rate, [1, 11, 0, 0]);
    // C in another /24: its own limit and its own /24.
    for i in 0..5 {
        assert_eq!(dp.run(&udp4(c, 10)), XDP_PASS, "C's packet {i}");
    }
    assert!(bucket(&dp, id, 1, ip("198.18.1.0")).is_some());
    // Every bucket of the rule is one of its two limits, keyed by the limit's mask.
    for (k, _) in dp.maps().buckets().unwrap() {
        let (rid, limit) = split_bucket_rule(k.rule);
        assert_eq!(rid, id);
        match limit {
            0 => assert!([a, b, c].iter().any(|x| k.addr[..4] == x.octets())),
            1 => assert_eq!(k.addr[3], 0, "a /24 key"),
            _ => panic!("limit {limit}"),
        }
    }
}

#[test]
fn a_drop_by_the_third_limit_refunds_the_first_two() {
    require_root();
    let mut dp = TestDataplane::new("limits3", 1024).unwrap();
    dp.make_buckets_at_first_packet();
    let set = dp
        .install_toml(
            r#"
[[rule]]
name = "svc"
source = "198.18.0.0/16"
rate = 1
burst = 4
[[rule.limit]]
per = "/24"
rate = 1
burst = 6
[[rule.limit]]
per = "rule"
rate = 1
burst = 7
"#,
        )
        .unwrap();
    let id = set.by_name("svc").unwrap().id;
    let (a, b, c) = (ip("198.18.0.1"), ip("198.18.0.2"), ip("198.18.1.1"));
    // 4 from A, 2 from B: the /24 is full (6), the rule has 6 of 7.
    for _ in 0..4 {
        assert_eq!(dp.run(&udp4(a, 10)), XDP_PASS);
    }
    for _ in 0..2 {
        assert_eq!(dp.run(&udp4(b, 10)), XDP_PASS);
    }
    // B again: its own limit has room, the /24 has not: dropped by limit 1 (the second).
    assert_eq!(dp.run(&udp4(b, 10)), XDP_DROP);
    // C (another /24): one fits the rule's 7th token, the next is dropped by the rule's limit.
    assert_eq!(dp.run(&udp4(c, 10)), XDP_PASS);
    let own = bucket(&dp, id, 0, c).unwrap();
    let net = bucket(&dp, id, 1, ip("198.18.1.0")).unwrap();
    assert_eq!(dp.run(&udp4(c, 10)), XDP_DROP, "over the rule's 7");
    assert_eq!(bucket(&dp, id, 0, c).unwrap().tat_ns, own.tat_ns);
    assert_eq!(
        bucket(&dp, id, 1, ip("198.18.1.0")).unwrap().tat_ns,
        net.tat_ns
    );
    let all = bucket(&dp, id, 2, ip("0.0.0.0")).expect("the rule's one bucket");
    assert_eq!((all.passed_pkts, all.dropped_pkts), (7, 1));
    let s = dp.rule(id);
    assert_eq!(s.pkts[verdict::PASSED], 7);
    assert_eq!(s.limit_dropped_rate, [0, 1, 1, 0]);
    assert_eq!(s.limit_dropped_bytes, [0; 4]);
}

#[test]
fn a_byte_limit_among_the_limits_drops_for_bytes_and_refunds_the_packet_limits() {
    require_root();
    let mut dp = TestDataplane::new("limitsb", 1024).unwrap();
    dp.make_buckets_at_first_packet();
    // Per source 1 pps burst 100; the whole rule 1 byte/s with a burst of 3,000 bytes.
    let set = dp
        .install_toml(
            r#"
[[rule]]
name = "b"
source = "198.18.0.0/16"
rate = 1
burst = 100
[[rule.limit]]
per = "rule"
bytes_rate = 1
bytes_burst = 3000
"#,
        )
        .unwrap();
    let id = set.by_name("b").unwrap().id;
    let a = ip("198.18.0.1");
    let big = udp4(a, 1000 - 42);
    assert_eq!(big.len(), 1000);
    for i in 0..3 {
        assert_eq!(dp.run(&big), XDP_PASS, "packet {i}");
    }
    let before = bucket(&dp, id, 0, a).unwrap();
    assert_eq!(dp.run(&big), XDP_DROP);
    assert_eq!(bucket(&dp, id, 0, a).unwrap().tat_ns, before.tat_ns);
    let s = dp.rule(id);
    assert_eq!(s.pkts[verdict::DROPPED_BYTES], 1);
    assert_eq!(s.limit_dropped_bytes, [0, 1, 0, 0]);
    assert_eq!(s.limit_dropped_rate, [0; 4]);
}

/// A one-limit rule's buckets are keyed as before: the rule id alone (limit 0).
#[test]
fn a_one_limit_rule_keys_its_buckets_by_the_rule_id_alone() {
    require_root();
    let mut dp = TestDataplane::new("limits1", 1024).unwrap();
    dp.make_buckets_at_first_packet();
    let set = dp
        .install_toml("[[rule]]\nname = \"one\"\nsource = \"198.18.0.0/16\"\nrate = 1\nburst = 2\n")
        .unwrap();
    let id = set.by_name("one").unwrap().id;
    assert_eq!(dp.maps().rule(id).unwrap().limits(), 1);
    let a = ip("198.18.0.1");
    assert_eq!(dp.run(&udp4(a, 10)), XDP_PASS);
    assert_eq!(dp.run(&udp4(a, 10)), XDP_PASS);
    assert_eq!(dp.run(&udp4(a, 10)), XDP_DROP);
    let all = dp.maps().buckets().unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].0.rule, id);
    assert_eq!(dp.rule(id).limit_dropped_rate, [1, 0, 0, 0]);
}

/// A known source's extra limits are charged through the records its classification slot
/// remembers (inline, without the program's BPF call), but only while a record still holds the
/// limit's key: a record given to another key meanwhile is not charged, and the packet finds (here,
/// creates) its own bucket. The record is handed over by hand here, to another /24 of the rule and
/// deep in debt: charging it would drop the packet.
#[test]
fn an_extra_limit_charges_its_remembered_record_only_while_it_holds_the_key() {
    require_root();
    let mut dp = TestDataplane::new("limits-recheck", 1024).unwrap();
    dp.make_buckets_at_first_packet();
    let set = dp
        .install_toml(
            r#"
[[rule]]
name = "web"
source = "198.18.0.0/16"
rate = 1
burst = 5
[[rule.limit]]
per = "/24"
rate = 1
burst = 5
"#,
        )
        .unwrap();
    let id = set.by_name("web").unwrap().id;
    let fa = udp4(ip("198.18.0.1"), 10);
    // The first packet creates both buckets (the slot remembers their records), the second goes
    // through the remembered ones.
    assert_eq!(dp.run(&fa), XDP_PASS);
    assert_eq!(dp.run(&fa), XDP_PASS);
    let mut addr = [0u8; 16];
    addr[..4].copy_from_slice(&[198, 18, 0, 0]);
    let key = BucketKey {
        rule: bucket_rule(id, 1),
        family: family::V4,
        _pad: [0; 3],
        addr,
    };
    let (Slot::Found(i), _) = dp.maps().locate_bucket(&key, 0).unwrap() else {
        panic!("the /24's bucket is not in the store");
    };
    let old = dp.maps().store().get(i);
    assert_eq!((old.passed_pkts, old.dropped_pkts), (2, 0));
    // Record i now holds the bucket of 198.18.9.0/24 (same rule, same limit), far in debt.
    let mut other = old;
    other.addr[2] = 9;
    other.tat_ns = u64::MAX / 2;
    other.passed_pkts = 0;
    assert!(dp.maps().store().install(i, old.header(), &other));
    assert_eq!(
        dp.run(&fa),
        XDP_PASS,
        "the packet was judged by the bucket of the key now in its remembered record"
    );
    let now = dp.maps().store().get(i);
    assert_eq!(
        now.tat_ns, other.tat_ns,
        "the other key's bucket was charged"
    );
    assert_eq!((now.passed_pkts, now.dropped_pkts), (0, 0));
    let own = bucket(&dp, id, 1, ip("198.18.0.0")).expect("the /24's bucket, created again");
    assert_eq!((own.passed_pkts, own.dropped_pkts), (1, 0));
    // And the slot now remembers the new record: the next packet is charged there.
    assert_eq!(dp.run(&fa), XDP_PASS);
    let own = bucket(&dp, id, 1, ip("198.18.0.0")).unwrap();
    assert_eq!((own.passed_pkts, own.dropped_pkts), (2, 0));
    assert_eq!(dp.maps().store().get(i).tat_ns, other.tat_ns);
}

/// The `n`th source of a spoofed flood: spread over 10.0.0.0/8 (a multiplicative hash of `n`).
fn flood_source(n: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0a00_0000 | n.wrapping_mul(2_654_435_761) >> 8)
}

/// Pins the calling thread to the CPU it runs on, so that every BPF_PROG_TEST_RUN of a test sees
/// the same per-CPU scratch state (the drop windows are per CPU).
fn pin_to_this_cpu() {
    // SAFETY: plain syscalls on this thread's own affinity, with a zeroed, sized CPU set.
    unsafe {
        let cpu = libc::sched_getcpu();
        assert!(cpu >= 0, "sched_getcpu");
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu as usize, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &raw const set),
            0,
            "sched_setaffinity"
        );
    }
}

/// A spoofed flood (every packet from a new source) under a per-source limit and a per-rule
/// aggregate, in either order: once the aggregate has no token, its drop window (kept per CPU by
/// rule, not by source) drops the flood before any per-source bucket is made, blamed on the
/// aggregate; the totals stay exact (the aggregate's TAT is not moved by a drop, every packet is
/// in the rule's counters, the aggregate's bucket gets the window's drops when it is looked at
/// again), and once a token comes back the next packet passes.
#[test]
fn a_random_source_flood_under_an_empty_aggregate_makes_no_bucket_per_source() {
    require_root();
    pin_to_this_cpu();
    // (case, rules, the aggregate's limit, the per-source limit, buckets an admitted new source
    // makes: its own, and its /24's where a /24 limit comes before the aggregate).
    for (order, toml, agg, own, per_pass) in [
        (
            "per source first",
            r#"
[[rule]]
name = "flood"
source = "10.0.0.0/8"
rate = 1
burst = 2
[[rule.limit]]
per = "rule"
rate = 1
burst = 5
"#,
            1u32,
            0u32,
            1u64,
        ),
        (
            "aggregate first",
            r#"
[[rule]]
name = "flood"
source = "10.0.0.0/8"
per = "rule"
rate = 1
burst = 5
[[rule.limit]]
per = "source"
rate = 1
burst = 2
"#,
            0,
            1,
            1,
        ),
        // The aggregate as the third limit: its window must keep the third limit's record (a
        // mask took limit 2 to limit 1's entry: the window closed after one batch, and the
        // flood made a bucket per source from then on).
        (
            "aggregate third",
            r#"
[[rule]]
name = "flood"
source = "10.0.0.0/8"
rate = 1
burst = 2
[[rule.limit]]
per = "/24"
rate = 1000
burst = 1000
[[rule.limit]]
per = "rule"
rate = 1
burst = 5
"#,
            2,
            0,
            2,
        ),
    ] {
        let mut dp = TestDataplane::new("limits-flood", 4096).unwrap();
        dp.make_buckets_at_first_packet();
        let set = dp.install_toml(toml).unwrap();
        let id = set.by_name("flood").unwrap().id;
        let start = std::time::Instant::now();
        // Five sources take the aggregate's five tokens; the sixth is dropped by it (a bucket
        // of its own made and refunded on the way when the per-source limit is charged first).
        for n in 0..5 {
            assert_eq!(
                dp.run(&udp4(flood_source(n), 10)),
                XDP_PASS,
                "{order}: source {n}"
            );
        }
        assert_eq!(
            dp.run(&udp4(flood_source(5), 10)),
            XDP_DROP,
            "{order}: over the aggregate"
        );
        let all = bucket(&dp, id, agg, ip("0.0.0.0")).expect("the rule's one bucket");
        let made = dp.global().counters[global::NEW_BUCKETS];
        // The flood: 200 new sources, each dropped, none with a bucket of its own.
        const FLOOD: u32 = 200;
        for n in 6..6 + FLOOD {
            assert_eq!(
                dp.run(&udp4(flood_source(n), 10)),
                XDP_DROP,
                "{order}: source {n}"
            );
        }
        assert_eq!(
            dp.global().counters[global::NEW_BUCKETS],
            made,
            "{order}: the flood made no bucket"
        );
        for n in 6..6 + FLOOD {
            assert!(
                bucket(&dp, id, own, flood_source(n)).is_none(),
                "{order}: source {n} has a bucket"
            );
        }
        let after = bucket(&dp, id, agg, ip("0.0.0.0")).unwrap();
        assert_eq!(after.tat_ns, all.tat_ns, "{order}: a drop spends no token");
        assert_eq!(after.passed_pkts, 5, "{order}");
        // Every drop is in the rule's counters and blamed on the aggregate; its bucket has the
        // drops up to its last look (the window's batches), never more.
        let s = dp.rule(id);
        assert_eq!(s.pkts[verdict::PASSED], 5, "{order}");
        assert_eq!(
            s.pkts[verdict::DROPPED_RATE],
            u64::from(FLOOD) + 1,
            "{order}"
        );
        let mut blamed = [0; 4];
        blamed[agg as usize] = u64::from(FLOOD) + 1;
        assert_eq!(s.limit_dropped_rate, blamed, "{order}");
        assert!(
            (FLOOD + 1 - 64..=FLOOD + 1).contains(&after.dropped_pkts),
            "{order}: the aggregate's bucket counted {} drops",
            after.dropped_pkts
        );
        // A token comes back a second after the first packet: the window is over and the
        // next source passes (made a bucket: the only one since the flood began); the one after
        // it is dropped again, before any limit is charged: in either order it makes no bucket
        // of its own (charged per source first, it would make one and have its charge given
        // back). At most burst + rate x t in all.
        std::thread::sleep(Duration::from_millis(1_100).saturating_sub(start.elapsed()));
        let made = dp.global().counters[global::NEW_BUCKETS];
        let mut passed = 0;
        for n in 1_000..1_010 {
            if dp.run(&udp4(flood_source(n), 10)) == XDP_PASS {
                passed += 1;
            }
        }
        let bound = 5 + start.elapsed().as_secs();
        assert!(passed >= 1, "{order}: the returned token admitted nothing");
        assert_eq!(
            dp.global().counters[global::NEW_BUCKETS] - made,
            passed * per_pass,
            "{order}: a bucket for each source admitted (and its /24), none for those dropped \
             after it"
        );
        assert!(
            5 + passed <= bound,
            "{order}: {} passed in {:?}",
            5 + passed,
            start.elapsed()
        );
        assert_eq!(dp.rule(id).pkts[verdict::PASSED], 5 + passed, "{order}");
    }
}

/// The classification cache slot the program gives an IPv4 source (`scratch::slot_index` in
/// ratelimit-ebpf: 256 slots, direct-mapped by a multiplicative hash of the address words).
fn class_slot(addr: Ipv4Addr) -> u32 {
    u32::from_ne_bytes(addr.octets()).wrapping_mul(0x9e37_79b1) >> 24
}

/// A spoofed flood that an exhausted aggregate drops takes no classification cache slot: the
/// drop window of a source over its own limit, in another rule, stays in its slot through the
/// flood, and so do the drops it counted (they reach the source's bucket at its next look, every
/// one of them). Before, each flood frame read and rewrote the slot of its source (each frame a
/// random one of 256): one colliding frame and the window was gone, with its uncounted drops.
#[test]
fn a_flood_dropped_by_an_aggregate_leaves_other_sources_slots_alone() {
    require_root();
    pin_to_this_cpu();
    let mut dp = TestDataplane::new("limits-slots", 4096).unwrap();
    dp.make_buckets_at_first_packet();
    let set = dp
        .install_toml(
            r#"
[[rule]]
name = "known"
source = "198.18.0.0/24"
rate = 1
burst = 1

[[rule]]
name = "flood"
source = "10.0.0.0/8"
rate = 1
burst = 2
[[rule.limit]]
per = "rule"
rate = 1
burst = 1
"#,
        )
        .unwrap();
    let known = set.by_name("known").unwrap().id;
    let flood = set.by_name("flood").unwrap().id;
    let k = ip("198.18.0.1");
    // The known source: its token, then a drop that opens its window, then 9 drops from the
    // window (counted in its slot, not yet in its bucket).
    assert_eq!(dp.run(&udp4(k, 10)), XDP_PASS);
    for i in 0..10 {
        assert_eq!(dp.run(&udp4(k, 10)), XDP_DROP, "known source, drop {i}");
    }
    let b = bucket(&dp, known, 0, k).expect("the known source's bucket");
    assert_eq!((b.passed_pkts, b.dropped_pkts), (1, 1));
    // The flood: the aggregate's token, its first drop (which opens the rule's window), both
    // from sources away from the known source's slot; then 2,000 sources that the window drops,
    // among them sources of every slot, the known source's included.
    let mut sources = (0..)
        .map(flood_source)
        .filter(|s| class_slot(*s) != class_slot(k));
    let (first, second) = (sources.next().unwrap(), sources.next().unwrap());
    assert_eq!(dp.run(&udp4(first, 10)), XDP_PASS);
    assert_eq!(dp.run(&udp4(second, 10)), XDP_DROP);
    let colliding = (10_000..12_000)
        .map(flood_source)
        .filter(|s| class_slot(*s) == class_slot(k))
        .count();
    assert!(
        colliding > 0,
        "no flood source shares the known source's slot"
    );
    for n in 10_000..12_000 {
        assert_eq!(
            dp.run(&udp4(flood_source(n), 10)),
            XDP_DROP,
            "flood source {n}"
        );
    }
    assert_eq!(dp.rule(flood).pkts[verdict::DROPPED_RATE], 2_001);
    // The known source again: the window's batch (64 drops) is spent after 55 more, and the
    // packet after them looks at the bucket, which then gets the batch and its own drop. A slot
    // lost to the flood would have started over (a look, a new window): 2 drops in the bucket.
    for i in 0..56 {
        assert_eq!(
            dp.run(&udp4(k, 10)),
            XDP_DROP,
            "known source, drop {}",
            10 + i
        );
    }
    let b = bucket(&dp, known, 0, k).unwrap();
    assert_eq!(
        (b.passed_pkts, b.dropped_pkts),
        (1, 66),
        "the known source's drops, through a flood with {colliding} frames in its slot"
    );
    assert_eq!(dp.rule(known).pkts[verdict::DROPPED_RATE], 66);
}

/// A drop by a later limit gives the limits before it their charge back only in records that
/// still hold their keys, as for the rule's own limit (8cb7cb9): a record may be recycled
/// between the charge and the refund, by another CPU or by the packet itself, and the refund
/// would give the record's new key what it was never charged. Here the packet recycles it: the
/// store is small and its sets known (a test seed); seven sources of another rule fill 7 of the
/// 8 candidate records of source S's second and third limits (S chosen so that those two keys
/// share their set pair, and its own limit's key lies elsewhere). S's first frame creates its
/// second limit's bucket in the one free record; its third limit's, created next, takes that
/// record (the least in debt of its candidates) and drops the frame, longer than its
/// `bytes_burst`. Refunded without the check, the second limit's interval was taken from the
/// third's new bucket, whose TAT was 0: it wrapped to ~584 years of debt, and S's next frame,
/// which fits every limit, was dropped by the third limit for its rate (as would every later
/// one: the record, deepest in debt of its set, is the last a new key takes).
#[test]
fn a_refund_never_reaches_a_record_the_packet_itself_recycled() {
    use ratelimit_testbed::collide::{set_seed, sets_of_v4, store_params, TEST_SEED};
    require_root();
    let mut dp = TestDataplane::new("refund-recycled", 64).unwrap();
    dp.make_buckets_at_first_packet();
    set_seed(dp.pin_dir(), TEST_SEED).unwrap();
    let set = dp
        .install_toml(
            r#"
[[rule]]
name = "svc"
source = "198.18.0.0/16"
rate = 1000
burst = 1000
[[rule.limit]]
per = "source"
rate = 1000
burst = 1000
[[rule.limit]]
per = "source"
rate = 1000
burst = 1000
bytes_rate = 1000000
bytes_burst = 1514

[[rule]]
name = "fill"
source = "198.19.0.0/16"
rate = 1
burst = 1
"#,
        )
        .unwrap();
    let id = set.by_name("svc").unwrap().id;
    let fill = set.by_name("fill").unwrap().id;
    let (seed, sets) = store_params(dp.pin_dir()).unwrap();
    let pair = |rule: u32, limit: u32, ip: Ipv4Addr| {
        sets_of_v4(seed, sets, bucket_rule(rule, limit) & 0xffff, ip)
    };
    let s = (1..u32::from(u16::MAX))
        .map(|i| Ipv4Addr::from(u32::from(ip("198.18.0.0")) + i))
        .find(|&a| {
            let p = pair(id, 1, a);
            p == pair(id, 2, a) && pair(id, 0, a).iter().all(|x| !p.contains(x))
        })
        .expect("a source whose second and third limits' keys share their set pair");
    let target = pair(id, 1, s);
    let fillers: Vec<Ipv4Addr> = (1..u32::from(u16::MAX))
        .map(|i| Ipv4Addr::from(u32::from(ip("198.19.0.0")) + i))
        .filter(|&a| pair(fill, 0, a) == target)
        .take(7)
        .collect();
    assert_eq!(fillers.len(), 7, "{sets} sets: 7 sources of the pair");
    for &f in &fillers {
        // Each one's bucket, with its one token spent, is in debt for a second.
        assert_eq!(dp.run(&udp4(f, 10)), XDP_PASS);
    }
    // 2,000 bytes (a frame the kernel's test run takes, longer than the wire's).
    assert_eq!(
        dp.run(&udp4(s, 1958)),
        XDP_DROP,
        "over the third limit's bytes"
    );
    let st = dp.rule(id);
    assert_eq!(st.limit_dropped_bytes, [0, 0, 1, 0]);
    assert_eq!(
        dp.global().counters[global::EVICTED_LOST],
        1,
        "the third limit's bucket took the second's record"
    );
    let third = bucket(&dp, id, 2, s).expect("the third limit's bucket");
    assert_eq!(
        dp.run(&udp4(s, 10)),
        XDP_PASS,
        "a frame that fits every limit (the third limit's TAT {}): dropped for rate by limits {:?}",
        third.tat_ns,
        dp.rule(id).limit_dropped_rate
    );
    assert!(
        third.tat_ns < 1 << 62,
        "the third limit's bucket got the second's refund: TAT {}",
        third.tat_ns
    );
}

/// The same flood under a `scope = "cluster"` aggregate whose bucket has a share in force (its
/// arrival time kept in the share's slowed time, `ratelimit_common::share`): the aggregate's
/// window still drops the flood before any per-source bucket is made. (Left to the charge in
/// order, a share's time made the per-source limit, charged first, make a bucket for every
/// spoofed source and give its charge back.)
#[test]
fn a_random_source_flood_under_an_empty_cluster_aggregate_at_a_share_makes_no_bucket_per_source() {
    use ratelimit::maps::PinnedMaps;
    use ratelimit_common::{rule_flags, SHARE_ONE};
    require_root();
    pin_to_this_cpu();
    let mut dp = TestDataplane::new("limits-share", 4096).unwrap();
    dp.make_buckets_at_first_packet();
    let set = dp
        .install_toml(
            r#"
[[rule]]
name = "flood"
source = "10.0.0.0/8"
rate = 1
burst = 2
[[rule.limit]]
per = "rule"
rate = 1
burst = 5
"#,
        )
        .unwrap();
    let id = set.by_name("flood").unwrap().id;
    let mut maps = PinnedMaps::open(dp.pin_dir()).unwrap();
    let mut record = maps.rule(id).unwrap();
    record.extra[0].flags |= rule_flags::CLUSTER;
    maps.set_rule(id, record).unwrap();
    let until = ratelimit::maps::bucket::monotonic_ns() + 60_000_000_000;
    maps.update_config(|c| c.shares_until_ns = until).unwrap();
    // The aggregate's bucket, made by the first source, at a share of a half.
    assert_eq!(dp.run(&udp4(flood_source(0), 10)), XDP_PASS);
    let key = ratelimit::maps::bucket::limit_bucket_key(id, &record, 1, ip("0.0.0.0").into());
    assert_eq!(
        ratelimit::cluster::shares::set_share(
            &ratelimit::maps::locator::Locator::new(&maps).unwrap(),
            &key,
            (u16::try_from(SHARE_ONE / 2).unwrap(), 2),
            &record.limit(1).unwrap(),
            ratelimit::maps::bucket::monotonic_ns(),
            ratelimit::maps::bucket::monotonic_coarse_ns(),
        )
        .unwrap(),
        Some(0)
    );
    // Four more take the aggregate's tokens (a half of 2 holders: its whole burst); the sixth
    // is dropped by it.
    for n in 1..5 {
        assert_eq!(dp.run(&udp4(flood_source(n), 10)), XDP_PASS, "source {n}");
    }
    assert_eq!(
        dp.run(&udp4(flood_source(5), 10)),
        XDP_DROP,
        "over the aggregate"
    );
    let agg = bucket(&dp, id, 1, ip("0.0.0.0")).expect("the rule's one bucket");
    assert_ne!(
        agg.tat_ns & ratelimit_common::share::STRETCHED,
        0,
        "kept in the share's time"
    );
    let made = dp.global().counters[global::NEW_BUCKETS];
    for n in 6..206 {
        assert_eq!(dp.run(&udp4(flood_source(n), 10)), XDP_DROP, "source {n}");
    }
    assert_eq!(
        dp.global().counters[global::NEW_BUCKETS],
        made,
        "the flood made no bucket"
    );
    for n in 6..206 {
        assert!(
            bucket(&dp, id, 0, flood_source(n)).is_none(),
            "source {n} has a bucket"
        );
    }
}
