//! Fragments end to end: the real agent on a veth whose far end has a small MTU, so that the
//! sending kernel cuts real UDP datagrams into real fragments. A datagram to a denied port never
//! reaches the socket listening on it (no fragment of it gets through to be reassembled), while
//! the same datagram to an allowed port arrives whole; for IPv4 and IPv6.

use std::{
    io::ErrorKind,
    net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket},
    time::Duration,
};

use ratelimit_testbed::{
    add_addr,
    agent_proc::global_counter,
    agent_proc::rule_packets,
    bind_udp, ifindex, in_netns, mac_bytes, neigh_to_peer,
    packet::{eth, from_hex, PINNED_MACS},
    require_root, veth_pair, AgentProcess, Netns, RawSocket,
};

/// Bytes of UDP payload: three fragments at an MTU of 1280.
const DATAGRAM: usize = 3000;
const DENIED_PORT: u16 = 5353;
const ALLOWED_PORT: u16 = 5354;

struct Family {
    tag: &'static str,
    src: &'static str,
    dst: &'static str,
    plen: u8,
    prefix: &'static str,
}

fn listen(rx: &Netns, addr: SocketAddr) -> UdpSocket {
    let socket = in_netns(rx, || UdpSocket::bind(addr)).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    socket
}

/// Datagrams (and their lengths) that arrive on `socket` until it has been quiet for 500 ms.
fn drain(socket: &UdpSocket) -> Vec<usize> {
    let mut got = Vec::new();
    let mut buf = vec![0u8; 65_536];
    loop {
        match socket.recv_from(&mut buf) {
            Ok((n, _)) => got.push(n),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return got
            }
            Err(e) => panic!("receiving: {e}"),
        }
    }
}

fn fragmented_datagrams(f: &Family) {
    require_root();
    let tx = Netns::new(&format!("rl-e2e-frag{}-tx", f.tag)).unwrap();
    let rx = Netns::new(&format!("rl-e2e-frag{}-rx", f.tag)).unwrap();
    let (tx_if, rx_if) = veth_pair(&tx, &rx, &format!("f{}", f.tag)).unwrap();
    add_addr(&tx, &tx_if, &format!("{}/{}", f.src, f.plen)).unwrap();
    add_addr(&rx, &rx_if, &format!("{}/{}", f.dst, f.plen)).unwrap();
    let dst: IpAddr = f.dst.parse().unwrap();
    neigh_to_peer(&tx, &tx_if, dst, &rx, &rx_if).unwrap();
    // The sender's link is small: the kernel fragments what it sends.
    tx.ip(&["link", "set", "dev", &tx_if, "mtu", "1280"])
        .unwrap();
    let config = format!(
        "[agent]\ninterfaces = [\"{rx_if}\"]\n\n\
         [[rule]]\nname = \"deny\"\nsource = \"{prefix}\"\nprotocol = \"udp\"\n\
         dst_port = {DENIED_PORT}\naction = \"deny\"\n\n\
         [[rule]]\nname = \"rest\"\nsource = \"{prefix}\"\naction = \"allow\"\n",
        prefix = f.prefix
    );
    let agent = AgentProcess::start(&rx, &config, &[]).unwrap();
    let denied = listen(&rx, SocketAddr::new(dst, DENIED_PORT));
    let allowed = listen(&rx, SocketAddr::new(dst, ALLOWED_PORT));
    let sender = bind_udp(&tx, SocketAddr::new(f.src.parse().unwrap(), 0)).unwrap();
    let payload = vec![0x5au8; DATAGRAM];
    let before = agent.stats();
    for _ in 0..3 {
        sender
            .send_to(&payload, SocketAddr::new(dst, DENIED_PORT))
            .unwrap();
        sender
            .send_to(&payload, SocketAddr::new(dst, ALLOWED_PORT))
            .unwrap();
    }
    let (got_denied, got_allowed) = (drain(&denied), drain(&allowed));
    let after = agent.stats();
    let delta = |rule: &str, verdict: &str| {
        rule_packets(&after, rule, verdict) - rule_packets(&before, rule, verdict)
    };
    let fragments = global_counter(&after, "fragments") - global_counter(&before, "fragments");
    println!(
        "IPv{}: denied port got {got_denied:?}, allowed port got {got_allowed:?}; rule deny: \
         {} denied; rule rest: {} allowed; {fragments} non-first fragments",
        f.tag,
        delta("deny", "denied"),
        delta("rest", "allowed")
    );
    assert_eq!(
        got_allowed,
        vec![DATAGRAM; 3],
        "the allowed datagrams arrive whole"
    );
    assert!(
        got_denied.is_empty(),
        "a denied datagram got through: {got_denied:?}"
    );
    // Three datagrams each way, each in three fragments: the fragments were really cut, and every
    // one of the denied datagrams' was denied (two of each three followed their first).
    assert_eq!(fragments, 12, "non-first fragments seen");
    assert_eq!(delta("deny", "denied"), 9);
    assert_eq!(delta("rest", "allowed"), 9);
    assert_eq!(
        global_counter(&after, "fragments_unmatched")
            - global_counter(&before, "fragments_unmatched"),
        0
    );
    assert!(agent.stop().unwrap().success());
}

#[test]
fn fragmented_ipv4_datagrams_to_a_denied_port_never_arrive() {
    fragmented_datagrams(&Family {
        tag: "4",
        src: "198.18.7.1",
        dst: "198.18.7.254",
        plen: 24,
        prefix: "198.18.7.0/24",
    });
}

#[test]
fn fragmented_ipv6_datagrams_to_a_denied_port_never_arrive() {
    fragmented_datagrams(&Family {
        tag: "6",
        src: "2001:db8:7::1",
        dst: "2001:db8:7::fe",
        plen: 64,
        prefix: "2001:db8:7::/64",
    });
}

/// An Ethernet frame carrying an IPv4 fragment (of a TCP segment) holding `payload`, at byte
/// `offset` of the datagram.
fn ipv4_fragment(
    macs: ([u8; 6], [u8; 6]),
    ips: (Ipv4Addr, Ipv4Addr),
    id: u16,
    offset: usize,
    more: bool,
    payload: &[u8],
) -> Vec<u8> {
    ip_fragment(6, macs, ips, id, offset, more, payload)
}

/// [`ipv4_fragment`] of a datagram of IP protocol `proto`.
fn ip_fragment(
    proto: u8,
    macs: ([u8; 6], [u8; 6]),
    (src, dst): (Ipv4Addr, Ipv4Addr),
    id: u16,
    offset: usize,
    more: bool,
    payload: &[u8],
) -> Vec<u8> {
    eth()
        .macs(macs.0, macs.1)
        .ipv4(src, dst)
        .proto(proto)
        .data(payload)
        .frag(u16::try_from(offset / 8).unwrap(), more)
        .ident(u32::from(id))
        .ipv4_checksum()
        .build()
}

/// A TCP SYN from `src`:`sport` to `dst`:`dport` carrying `data` zero bytes, checksum included:
/// the segment alone, to be cut into fragments.
fn tcp_syn((src, dst): (Ipv4Addr, Ipv4Addr), sport: u16, dport: u16, data: usize) -> Vec<u8> {
    let frame = eth()
        .ipv4(src, dst)
        .tcp(sport, dport)
        .tcp_seq(0x1234_5678)
        .tcp_window(64_240)
        .data(&vec![0; data])
        .checksums();
    frame.build()[frame.l4_offset().unwrap()..].to_vec()
}

/// `tcp_syn` and `ipv4_fragment` give the bytes the functions they replaced built by hand (at
/// fa91d4f, for the SYNs and fragments the test sends): the test puts the same packets on the
/// wire.
#[test]
fn syns_and_fragments_are_the_bytes_they_were_built_by_hand() {
    let ips = (Ipv4Addr::new(198, 18, 8, 1), Ipv4Addr::new(198, 18, 8, 254));
    let syn22 = tcp_syn(ips, 40_022, 22, 0);
    assert_eq!(syn22, from_hex("9c56001612345678000000005002faf012b50000"));
    assert_eq!(
        ipv4_fragment(PINNED_MACS, ips, 0x4242, 0, true, &syn22[..8]),
        from_hex(
            "0266778899aa02112233445508004500001c4242200040067b76c6120801c61208fe9c56001612345678"
        )
    );
    assert_eq!(
        ipv4_fragment(PINNED_MACS, ips, 0x4242, 8, false, &syn22[8..]),
        from_hex(concat!(
            "0266778899aa0211223344550800450000204242000140069b71c6120801c61208fe",
            "000000005002faf012b50000"
        ))
    );
    let syn23 = tcp_syn(ips, 40_023, 23, 16);
    assert_eq!(
        syn23,
        from_hex("9c57001712345678000000005002faf012a3000000000000000000000000000000000000")
    );
    assert_eq!(
        ipv4_fragment(PINNED_MACS, ips, 0x4343, 0, true, &syn23[..24]),
        from_hex(concat!(
            "0266778899aa02112233445508004500002c4343200040067a65c6120801c61208fe",
            "9c57001712345678000000005002faf012a3000000000000"
        ))
    );
    assert_eq!(
        ipv4_fragment(PINNED_MACS, ips, 0x4343, 24, false, &syn23[24..]),
        from_hex(concat!(
            "0266778899aa0211223344550800450000204343000340069a6ec6120801c61208fe",
            "000000000000000000000000"
        ))
    );
}

/// `Tcp: InSegs` of the namespace `ns`: TCP segments its stack received (a SYN counts once
/// reassembled and checksummed).
fn tcp_in_segments(ns: &Netns) -> u64 {
    let snmp = in_netns(ns, || std::fs::read_to_string("/proc/thread-self/net/snmp")).unwrap();
    let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
    let (names, values) = (tcp.next().unwrap(), tcp.next().unwrap());
    let i = names
        .split_whitespace()
        .position(|n| n == "InSegs")
        .unwrap();
    values.split_whitespace().nth(i).unwrap().parse().unwrap()
}

/// Two namespaces joined by a veth (`tag` names them, `veth` the pair), the sender at
/// `198.18.{net}.1/24` and the receiver at `.254`, each knowing the other's MAC; the agent on
/// the receiver's end with `rules` (TOML, after the `[agent]` table); a raw socket on the
/// sender's end for crafted frames; and both MACs, for the frames it sends.
struct Wire {
    _tx: Netns,
    rx: Netns,
    src: Ipv4Addr,
    dst: Ipv4Addr,
    macs: ([u8; 6], [u8; 6]),
    raw: RawSocket,
    agent: AgentProcess,
}

fn wire(tag: &str, veth: &str, net: u8, rules: &str) -> Wire {
    let tx = Netns::new(&format!("rl-e2e-{tag}-tx")).unwrap();
    let rx = Netns::new(&format!("rl-e2e-{tag}-rx")).unwrap();
    let (tx_if, rx_if) = veth_pair(&tx, &rx, veth).unwrap();
    let (src, dst) = (
        Ipv4Addr::new(198, 18, net, 1),
        Ipv4Addr::new(198, 18, net, 254),
    );
    add_addr(&tx, &tx_if, &format!("{src}/24")).unwrap();
    add_addr(&rx, &rx_if, &format!("{dst}/24")).unwrap();
    neigh_to_peer(&tx, &tx_if, IpAddr::from(dst), &rx, &rx_if).unwrap();
    neigh_to_peer(&rx, &rx_if, IpAddr::from(src), &tx, &tx_if).unwrap();
    let config = format!("[agent]\ninterfaces = [\"{rx_if}\"]\n\n{rules}");
    let agent = AgentProcess::start(&rx, &config, &[]).unwrap();
    let macs = (
        mac_bytes(&tx, &tx_if).unwrap(),
        mac_bytes(&rx, &rx_if).unwrap(),
    );
    let raw = RawSocket::open_in(&tx, ifindex(&tx, &tx_if).unwrap(), macs.1).unwrap();
    Wire {
        _tx: tx,
        rx,
        src,
        dst,
        macs,
        raw,
        agent,
    }
}

/// RFC 1858's tiny-fragment attack, end to end: a TCP SYN to a denied port cut so that its first
/// fragment holds only 8 bytes of the TCP header, the rest in a second fragment, sent as crafted
/// frames on the wire. The receiving kernel would reassemble it into a SYN; the limiter drops
/// both fragments, so the listener never sees it, while the same SYN to an allowed port (in
/// ordinary fragments) does reach its listener.
#[test]
fn a_tcp_syn_in_tiny_fragments_does_not_walk_past_a_deny_rule() {
    require_root();
    let Wire {
        _tx,
        rx,
        src,
        dst,
        macs,
        raw,
        agent,
    } = wire(
        "tiny",
        "ft",
        8,
        "[[rule]]\nname = \"ssh\"\nsource = \"198.18.8.0/24\"\nprotocol = \"tcp\"\n\
         dst_port = 22\naction = \"deny\"\n\n\
         [[rule]]\nname = \"rest\"\nsource = \"198.18.8.0/24\"\naction = \"allow\"\n",
    );
    let dst_ip = IpAddr::from(dst);
    let listeners: Vec<_> = [22u16, 23]
        .iter()
        .map(|&p| {
            in_netns(&rx, || {
                std::net::TcpListener::bind(SocketAddr::new(dst_ip, p))
            })
            .unwrap()
        })
        .collect();
    let send = |frames: &[Vec<u8>]| {
        for f in frames {
            raw.send(f).unwrap();
        }
    };
    let tiny = |dport: u16, id: u16| {
        let syn = tcp_syn((src, dst), 40_000 + dport, dport, 0);
        vec![
            ipv4_fragment(macs, (src, dst), id, 0, true, &syn[..8]),
            ipv4_fragment(macs, (src, dst), id, 8, false, &syn[8..]),
        ]
    };
    let stats0 = agent.stats();
    // The tiny SYN to the denied port: the receiving stack must not see a TCP segment.
    let seen0 = tcp_in_segments(&rx);
    send(&tiny(22, 0x4242));
    std::thread::sleep(Duration::from_millis(300));
    let tiny_seen = tcp_in_segments(&rx) - seen0;
    // Control: an ordinarily fragmented SYN (its first fragment holds the whole TCP header and 4
    // bytes of data, the second 12 bytes) to the allowed port is reassembled and received, so the
    // crafted frames are right and the first count can only be 0 because the limiter dropped them.
    let seen1 = tcp_in_segments(&rx);
    let syn23 = tcp_syn((src, dst), 40_023, 23, 16);
    send(&[
        ipv4_fragment(macs, (src, dst), 0x4343, 0, true, &syn23[..24]),
        ipv4_fragment(macs, (src, dst), 0x4343, 24, false, &syn23[24..]),
    ]);
    std::thread::sleep(Duration::from_millis(300));
    let control_seen = tcp_in_segments(&rx) - seen1;
    let stats = agent.stats();
    let tiny_drops = global_counter(&stats, "dropped_tiny_fragments")
        - global_counter(&stats0, "dropped_tiny_fragments");
    println!(
        "segments received: tiny SYN to 22: {tiny_seen}, control SYN to 23: {control_seen}; \
         tiny fragments dropped {tiny_drops}"
    );
    assert_eq!(tiny_seen, 0, "the tiny SYN to port 22 reached the stack");
    assert!(
        control_seen >= 1,
        "the control SYN to port 23 was not received"
    );
    assert_eq!(tiny_drops, 2, "both fragments of the tiny SYN are dropped");
    drop(listeners);
    assert!(agent.stop().unwrap().success());
}

/// Priority tags end to end: the receiving kernel strips any number of VLAN tags with id 0 and
/// delivers what is inside to the interface itself, so a UDP datagram to a denied port wrapped in
/// three of them (or nine, past the program's walk of 8) would reach the socket listening on it
/// unless the limiter drops it. The same three tags around a datagram to an allowed port arrive
/// (so the kernel does deliver such frames, and the drops are the limiter's).
#[test]
fn priority_tags_do_not_walk_past_a_deny_rule() {
    require_root();
    let Wire {
        _tx,
        rx,
        src,
        dst,
        macs,
        raw,
        agent,
    } = wire(
        "pvlan",
        "pv",
        9,
        &format!(
            "[[rule]]\nname = \"dns\"\nsource = \"198.18.9.0/24\"\nprotocol = \"udp\"\n\
             dst_port = {DENIED_PORT}\naction = \"deny\"\n\n\
             [[rule]]\nname = \"rest\"\nsource = \"198.18.9.0/24\"\naction = \"allow\"\n"
        ),
    );
    let dst_ip = IpAddr::from(dst);
    let denied = listen(&rx, SocketAddr::new(dst_ip, DENIED_PORT));
    let allowed = listen(&rx, SocketAddr::new(dst_ip, ALLOWED_PORT));
    let tagged = |tags: usize, port: u16| {
        let mut f = eth().macs(macs.0, macs.1).qinq(0);
        for _ in 1..tags {
            f = f.vlan(0);
        }
        f.ipv4(src, dst)
            .udp(40_000, port)
            .data(b"priority-tagged")
            .checksums()
            .build()
    };
    let stats0 = agent.stats();
    for frame in [
        tagged(3, DENIED_PORT),
        tagged(9, DENIED_PORT),
        tagged(9, ALLOWED_PORT),
    ] {
        raw.send(&frame).unwrap();
    }
    let denied_got = drain(&denied);
    let past_walk_allowed = drain(&allowed);
    // Control: three priority tags around a datagram to the allowed port are delivered.
    raw.send(&tagged(3, ALLOWED_PORT)).unwrap();
    let control = drain(&allowed);
    let stats = agent.stats();
    let moved = |name: &str| global_counter(&stats, name) - global_counter(&stats0, name);
    let denied_by_rule =
        rule_packets(&stats, "dns", "denied") - rule_packets(&stats0, "dns", "denied");
    println!(
        "to the denied port: {denied_got:?}; 9 tags to the allowed port: {past_walk_allowed:?}; \
         control (3 tags, allowed port): {control:?}; denied by the rule {denied_by_rule}, \
         dropped_vlan_chains {}",
        moved("dropped_vlan_chains")
    );
    assert!(
        denied_got.is_empty(),
        "a tagged datagram reached the denied port"
    );
    assert!(
        past_walk_allowed.is_empty(),
        "a frame past the VLAN walk passed while a deny rule is in force"
    );
    assert_eq!(control, vec![15], "the control datagram was not delivered");
    assert_eq!(
        denied_by_rule, 1,
        "three tags: classified, denied by the rule"
    );
    assert_eq!(
        moved("dropped_vlan_chains"),
        2,
        "nine tags: dropped, counted"
    );
    drop((denied, allowed));
    assert!(agent.stop().unwrap().success());
}

/// RFC 1858's SYN as the wire delivers it: the first fragment holds 8 bytes of the TCP header
/// (ports, no flags) and is padded with zeros to Ethernet's 60 bytes, the second holds the rest
/// (the SYN flag). The receiving kernel trims the padding and reassembles a SYN. Under a
/// `tcp_flags = "syn"` deny rule the padding must not be read as the flags (no SYN: the general
/// rule's, and the second fragment with it): both fragments are dropped as a tiny fragment's
/// datagram. From a source no rule covers, the same frames are reassembled and received (so they
/// are right, and the count of 0 is the limiter's doing).
#[test]
fn a_padded_tiny_syn_does_not_walk_past_a_syn_rule() {
    require_root();
    let Wire {
        _tx,
        rx,
        src,
        dst,
        macs,
        raw,
        agent,
    } = wire(
        "padsyn",
        "ps",
        10,
        "[[rule]]\nname = \"syn\"\nsource = \"198.18.10.0/24\"\nprotocol = \"tcp\"\n\
         tcp_flags = \"syn\"\naction = \"deny\"\n\n\
         [[rule]]\nname = \"rest\"\nsource = \"198.18.10.0/24\"\naction = \"allow\"\n",
    );
    let dst_ip = IpAddr::from(dst);
    let outsider = Ipv4Addr::new(198, 51, 100, 7);
    let listener = in_netns(&rx, || {
        std::net::TcpListener::bind(SocketAddr::new(dst_ip, 80))
    })
    .unwrap();
    let padded_syn = |from: Ipv4Addr, id: u16| {
        let syn = tcp_syn((from, dst), 40_080, 80, 0);
        let mut first = ipv4_fragment(macs, (from, dst), id, 0, true, &syn[..8]);
        first.resize(60, 0);
        vec![
            first,
            ipv4_fragment(macs, (from, dst), id, 8, false, &syn[8..]),
        ]
    };
    let stats0 = agent.stats();
    let seen0 = tcp_in_segments(&rx);
    for f in padded_syn(src, 0x5151) {
        raw.send(&f).unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));
    let ruled_seen = tcp_in_segments(&rx) - seen0;
    let seen1 = tcp_in_segments(&rx);
    for f in padded_syn(outsider, 0x5152) {
        raw.send(&f).unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));
    let control_seen = tcp_in_segments(&rx) - seen1;
    let stats = agent.stats();
    let tiny_drops = global_counter(&stats, "dropped_tiny_fragments")
        - global_counter(&stats0, "dropped_tiny_fragments");
    println!(
        "segments received: padded tiny SYN under the SYN rule: {ruled_seen}, from an uncovered \
         source: {control_seen}; tiny fragments dropped {tiny_drops}"
    );
    assert_eq!(ruled_seen, 0, "the padded tiny SYN reached the stack");
    assert!(control_seen >= 1, "the control SYN was not reassembled");
    assert_eq!(
        tiny_drops, 2,
        "both fragments of the padded tiny SYN are dropped"
    );
    drop(listener);
    assert!(agent.stop().unwrap().success());
}

/// A limited datagram sent last fragment first, end to end. The receiving kernel reassembles a
/// datagram's fragments in whatever order they come, and only the first holds the ports: sent
/// last, it used to be the only fragment the port's limit saw (the others, their first not yet
/// seen, fell to the rule without ports), so each datagram cost one token however many fragments
/// it had. Under a UDP limit with a burst of 3, three datagrams of three fragments each are sent
/// that way: the limit admits 3 packets (4 should a token come while the test runs), at most one
/// such datagram; all three were received. From a source no rule covers, the same frames are
/// reassembled and received (so the kernel does take them in that order, and the limited
/// datagrams' absence is the limiter's doing).
#[test]
fn a_limited_datagram_sent_last_fragment_first_is_held_to_its_limit() {
    require_root();
    let Wire {
        _tx,
        rx,
        src,
        dst,
        macs,
        raw,
        agent,
    } = wire(
        "fragrev",
        "fr",
        11,
        &format!(
            "[[rule]]\nname = \"dns\"\nsource = \"198.18.11.0/24\"\nprotocol = \"udp\"\n\
             dst_port = {DENIED_PORT}\nrate = 1\nburst = 3\n\n\
             [[rule]]\nname = \"rest\"\nsource = \"198.18.11.0/24\"\naction = \"allow\"\n"
        ),
    );
    let socket = listen(&rx, SocketAddr::new(IpAddr::from(dst), DENIED_PORT));
    let outsider = Ipv4Addr::new(198, 51, 100, 8);
    // A UDP datagram of 40 bytes of data (48 with its header), checksummed, cut into three
    // fragments of 16 bytes, sent last first.
    let reversed = |from: Ipv4Addr, id: u16| {
        let frame = eth()
            .ipv4(from, dst)
            .udp(40_000, DENIED_PORT)
            .data(&[0x5a; 40])
            .checksums();
        let udp = frame.build()[frame.l4_offset().unwrap()..].to_vec();
        let cut = |at: usize, more: bool| {
            ip_fragment(
                17,
                macs,
                (from, dst),
                id,
                at,
                more,
                &udp[at..(at + 16).min(udp.len())],
            )
        };
        [cut(32, false), cut(16, true), cut(0, true)]
    };
    let stats0 = agent.stats();
    for id in 0..3 {
        for f in reversed(src, 0x6100 + id) {
            raw.send(&f).unwrap();
        }
    }
    let limited = drain(&socket);
    for id in 0..3 {
        for f in reversed(outsider, 0x6200 + id) {
            raw.send(&f).unwrap();
        }
    }
    let control = drain(&socket);
    let stats = agent.stats();
    let moved = |name: &str| global_counter(&stats, name) - global_counter(&stats0, name);
    let rest = rule_packets(&stats, "rest", "allowed") - rule_packets(&stats0, "rest", "allowed");
    println!(
        "reversed datagrams under a burst of 3: {limited:?} received; from an uncovered source: \
         {control:?}; rule rest allowed {rest}; dropped_unmatched_fragments {}",
        moved("dropped_unmatched_fragments")
    );
    assert_eq!(
        control,
        vec![40; 3],
        "the control datagrams were not reassembled"
    );
    assert!(
        limited.len() <= 1,
        "{} datagrams of 3 fragments passed a limit of burst 3: {limited:?}",
        limited.len()
    );
    assert_eq!(
        rest, 0,
        "a fragment of the limited datagrams fell to the rule without ports"
    );
    drop(socket);
    assert!(agent.stop().unwrap().success());
}
