//! A SYN rule beside a general TCP rule: which flags make a SYN the kernel opens a connection
//! for, and how a SYN cut into fragments is judged.

use ratelimit_common::{global, verdict};
use ratelimit_testbed::{
    packet::eth,
    require_root,
    xdp::{XDP_DROP, XDP_PASS},
    TestDataplane,
};

use crate::{dst4, dst6, v4, v6};

/// `tcp_flags = "syn"`: SYN (ACK clear) packets from one source meet the SYN rule, its SYN-ACKs,
/// ACKs and data the general TCP rule, in any order from one source (the per-CPU classification
/// cache keys on the flag bits the rules look at), a port rule outranks the SYN rule, and cut
/// packets never reach it by their flags.
#[test]
fn syn_rule_takes_syns_and_leaves_the_rest_to_the_general_rule() {
    use global::{DROPPED_TINY_FRAGMENTS as TINY, TRUNCATED_L4};
    require_root();
    let mut dp = TestDataplane::new("pktsyn", 1024).expect("load");
    let set = dp
        .install_toml(
            r#"
[[rule]]
name = "syn"
source = "198.18.0.0/16"
protocol = "tcp"
tcp_flags = "syn"
action = "deny"

[[rule]]
name = "tcp"
source = "198.18.0.0/16"
protocol = "tcp"
action = "allow"

[[rule]]
name = "ssh"
source = "198.18.0.0/16"
protocol = "tcp"
dst_port = 22
action = "allow"

[[rule]]
name = "syn6"
source = "2001:db8::/32"
protocol = "tcp"
tcp_flags = "syn"
action = "deny"

[[rule]]
name = "all6"
source = "2001:db8::/32"
action = "allow"
"#,
        )
        .expect("install");
    let id = |name: &str| set.by_name(name).expect("rule").id;
    const SYN: u8 = 0x02;
    const ACK: u8 = 0x10;
    const PSH: u8 = 0x08;
    const FIN: u8 = 0x01;
    let tcp4 = |port: u16, flags: u8| {
        eth()
            .ipv4(v4(33), dst4())
            .tcp(40000, port)
            .tcp_flags(flags)
            .build()
    };
    let tcp6 = |flags: u8| {
        eth()
            .ipv6(v6(33), dst6())
            .tcp(40000, 443)
            .tcp_flags(flags)
            .build()
    };
    // (what, frame, verdict, rule, rule verdict, global counter that must move too)
    type Case = (
        &'static str,
        Vec<u8>,
        u32,
        &'static str,
        usize,
        Option<usize>,
    );
    let cases: Vec<Case> = vec![
        (
            "SYN",
            tcp4(443, SYN),
            XDP_DROP,
            "syn",
            verdict::DENIED,
            None,
        ),
        (
            "SYN-ACK",
            tcp4(443, SYN | ACK),
            XDP_PASS,
            "tcp",
            verdict::ALLOWED,
            None,
        ),
        (
            "ACK",
            tcp4(443, ACK),
            XDP_PASS,
            "tcp",
            verdict::ALLOWED,
            None,
        ),
        (
            "SYN after ACK (cached source)",
            tcp4(443, SYN),
            XDP_DROP,
            "syn",
            verdict::DENIED,
            None,
        ),
        (
            "PSH-ACK",
            tcp4(443, PSH | ACK),
            XDP_PASS,
            "tcp",
            verdict::ALLOWED,
            None,
        ),
        (
            "FIN-ACK",
            tcp4(443, FIN | ACK),
            XDP_PASS,
            "tcp",
            verdict::ALLOWED,
            None,
        ),
        (
            "no flags",
            tcp4(443, 0),
            XDP_PASS,
            "tcp",
            verdict::ALLOWED,
            None,
        ),
        (
            "SYN+PSH (still a SYN)",
            tcp4(443, SYN | PSH),
            XDP_DROP,
            "syn",
            verdict::DENIED,
            None,
        ),
        (
            "SYN+FIN",
            tcp4(443, SYN | FIN),
            XDP_DROP,
            "syn",
            verdict::DENIED,
            None,
        ),
        // Whatever else is set, the kernel's listener opens a connection for a SYN without ACK
        // (`tcp_rcv_state_process`: ACK answered by a reset, RST and SYN+FIN discarded, then
        // `conn_request`): ECN setup (ECE, CWR), URG, PSH; each is the SYN rule's.
        (
            "SYN+ECE+CWR (ECN setup: a connection request)",
            tcp4(443, SYN | 0x40 | 0x80),
            XDP_DROP,
            "syn",
            verdict::DENIED,
            None,
        ),
        (
            "SYN+URG",
            tcp4(443, SYN | 0x20),
            XDP_DROP,
            "syn",
            verdict::DENIED,
            None,
        ),
        (
            "SYN+RST (the kernel discards it)",
            tcp4(443, SYN | 0x04),
            XDP_DROP,
            "syn",
            verdict::DENIED,
            None,
        ),
        (
            "SYN to the port rule's port",
            tcp4(22, SYN),
            XDP_PASS,
            "ssh",
            verdict::ALLOWED,
            None,
        ),
        (
            "ACK to the port rule's port",
            tcp4(22, ACK),
            XDP_PASS,
            "ssh",
            verdict::ALLOWED,
            None,
        ),
        (
            "SYN again",
            tcp4(443, SYN),
            XDP_DROP,
            "syn",
            verdict::DENIED,
            None,
        ),
        (
            "SYN whose TCP header is cut (no flags read)",
            eth()
                .ipv4(v4(33), dst4())
                .tcp(40000, 443)
                .tcp_flags(SYN)
                .truncate(14 + 20 + 19)
                .build(),
            XDP_PASS,
            "tcp",
            verdict::ALLOWED,
            Some(TRUNCATED_L4),
        ),
        (
            "first fragment with the whole TCP header, SYN",
            eth()
                .ipv4(v4(34), dst4())
                .frag(0, true)
                .ident(0x5151)
                .tcp(40000, 443)
                .tcp_flags(SYN)
                .payload(16)
                .build(),
            XDP_DROP,
            "syn",
            verdict::DENIED,
            None,
        ),
        (
            "its later fragment follows it",
            eth()
                .ipv4(v4(34), dst4())
                .frag(3, false)
                .ident(0x5151)
                .proto(6)
                .payload(16)
                .build(),
            XDP_DROP,
            "syn",
            verdict::DENIED,
            Some(global::FRAGMENTS),
        ),
        (
            "first fragment with the whole TCP header, ACK",
            eth()
                .ipv4(v4(34), dst4())
                .frag(0, true)
                .ident(0x5152)
                .tcp(40000, 443)
                .tcp_flags(ACK)
                .payload(16)
                .build(),
            XDP_PASS,
            "tcp",
            verdict::ALLOWED,
            None,
        ),
        (
            "IPv6 SYN",
            tcp6(SYN),
            XDP_DROP,
            "syn6",
            verdict::DENIED,
            None,
        ),
        (
            "IPv6 ACK",
            tcp6(ACK),
            XDP_PASS,
            "all6",
            verdict::ALLOWED,
            None,
        ),
        (
            "IPv6 SYN-ACK",
            tcp6(SYN | ACK),
            XDP_PASS,
            "all6",
            verdict::ALLOWED,
            None,
        ),
        (
            "IPv6 SYN again",
            tcp6(SYN),
            XDP_DROP,
            "syn6",
            verdict::DENIED,
            None,
        ),
    ];
    for (what, frame, want, rule, v, counter) in cases {
        let (g0, r0) = (dp.global(), dp.rule(id(rule)));
        assert_eq!(dp.run(&frame), want, "{what}");
        assert_eq!(
            dp.rule(id(rule)).pkts[v] - r0.pkts[v],
            1,
            "{what}: rule {rule}"
        );
        if let Some(c) = counter {
            assert_eq!(
                dp.global().counters[c] - g0.counters[c],
                1,
                "{what}: counter {c}"
            );
        }
    }
    // A first fragment too short for the flags: the tiny-fragment case (a rule looks at them).
    let g0 = dp.global();
    let tiny = eth()
        .ipv4(v4(35), dst4())
        .frag(0, true)
        .ident(0x5153)
        .tcp(40000, 443)
        .truncate(14 + 20 + 13)
        .build();
    assert_eq!(dp.run(&tiny), XDP_DROP);
    assert_eq!(dp.global().counters[TINY] - g0.counters[TINY], 1);
    // RFC 1858's SYN in two fragments as the wire delivers the first: 8 bytes of TCP (ports, no
    // flags) padded to 60 bytes with zeros. The zeros are not its flags (which would make it no
    // SYN, under the general TCP rule, and its second fragment, which holds the SYN flag, with
    // it): tiny, dropped.
    let g0 = dp.global();
    let padded = eth()
        .ipv4(v4(36), dst4())
        .tcp(40000, 443)
        .cut_l4(8)
        .frag(0, true)
        .ident(0x5154)
        .trailer(&[0; 18])
        .build();
    assert_eq!(padded.len(), 60);
    assert_eq!(dp.run(&padded), XDP_DROP);
    assert_eq!(dp.global().counters[TINY] - g0.counters[TINY], 1);
}
