//! Fragments through the real XDP program (BPF_PROG_TEST_RUN): the fragments of a limited
//! datagram charge its source's bucket like whole packets, in whatever order they come.

use std::net::{Ipv4Addr, Ipv6Addr};

use ratelimit_common::{global, verdict};
use ratelimit_testbed::{
    packet::{eth, ip},
    require_root,
    xdp::{XDP_DROP, XDP_PASS},
    TestDataplane,
};

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
    let (dns, rest) = (
        set.by_name("dns").unwrap().id,
        set.by_name("rest").unwrap().id,
    );
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
    let (rest, rest6) = (
        set.by_name("rest").unwrap().id,
        set.by_name("rest6").unwrap().id,
    );
    let (src, dst) = (ip("198.18.0.1"), Ipv4Addr::new(198, 18, 0, 254));
    let (src6, dst6) = (
        "2001:db8::1".parse::<Ipv6Addr>().unwrap(),
        "2001:db8::fe".parse::<Ipv6Addr>().unwrap(),
    );
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
