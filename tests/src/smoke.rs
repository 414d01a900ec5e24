//! End-to-end check of the test bed itself: two namespaces, a veth pair, IPv4 and IPv6 sources, no
//! limiter. Everything sent must arrive, and nothing may be left behind.

use std::net::{IpAddr, SocketAddr};
use std::thread;
use std::time::Duration;

use crate::*;

const PREFIX: &str = "rltb-smoke";
const PPS: u64 = 5_000;
const SECS: u64 = 2;

#[test]
fn two_sources_per_family_all_arrive_and_nothing_leaks() {
    if skip_unless_root() {
        return;
    }
    let tx = Netns::new(PREFIX).unwrap();
    let rx = Netns::new(PREFIX).unwrap();
    let names = [tx.name().to_owned(), rx.name().to_owned()];
    let (tx_if, rx_if) = veth_pair(&tx, &rx, "rts").unwrap();
    assert!(tx_if.len() <= 15 && rx_if.len() <= 15, "{tx_if} {rx_if}");
    assert!(ifindex(&rx, &rx_if).unwrap() > 1);

    for cidr in [
        "198.18.0.1/24",
        "198.18.0.2/24",
        "2001:db8::1/64",
        "2001:db8::2/64",
    ] {
        add_addr(&tx, &tx_if, cidr).unwrap();
    }
    for cidr in ["198.18.0.254/24", "2001:db8::fe/64"] {
        add_addr(&rx, &rx_if, cidr).unwrap();
    }
    let dst4: IpAddr = "198.18.0.254".parse().unwrap();
    let dst6: IpAddr = "2001:db8::fe".parse().unwrap();
    neigh_to_peer(&tx, &tx_if, dst4, &rx, &rx_if).unwrap();
    neigh_to_peer(&tx, &tx_if, dst6, &rx, &rx_if).unwrap();

    // One dual-stack socket receives both families; IPv4 sources must come back as IPv4.
    let receiver = Receiver::bind(&rx, "[::]:0".parse().unwrap()).unwrap();
    let port = receiver.local_addr().port();
    let flows: Vec<(IpAddr, IpAddr)> = vec![
        ("198.18.0.1".parse().unwrap(), dst4),
        ("198.18.0.2".parse().unwrap(), dst4),
        ("2001:db8::1".parse().unwrap(), dst6),
        ("2001:db8::2".parse().unwrap(), dst6),
    ];
    let reports: Vec<SendReport> = thread::scope(|s| {
        let handles: Vec<_> = flows
            .iter()
            .map(|&(src, dst)| {
                let tx = &tx;
                s.spawn(move || {
                    send_udp_from(
                        tx,
                        SocketAddr::new(src, 0),
                        SocketAddr::new(dst, port),
                        PPS,
                        Duration::from_secs(SECS),
                        64,
                    )
                    .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    receiver.wait_idle(Duration::from_millis(200), Duration::from_secs(5));
    let got = receiver.stop().unwrap();

    for (&(src, _), report) in flows.iter().zip(&reports) {
        println!(
            "{src}: sent {} (skipped {}, errors {}) at {:.0} pps, received {:?}",
            report.sent,
            report.skipped,
            report.errors,
            report.achieved_pps(),
            got.sources.get(&src)
        );
        let stats = got.sources.get(&src).copied().unwrap_or_default();
        assert!(
            // The pacer skips slots it fell behind on (a busy machine: 12% skipped was seen with
            // other builds beside the suite on 2 cores); what matters below is that everything
            // sent arrives. Half the schedule still shows the sender works.
            report.sent * 100 >= PPS * SECS * 50,
            "{src}: sent only {}",
            report.sent
        );
        assert!(
            stats.packets * 100 >= report.sent * 99,
            "{src}: received {} of {} (socket drops {:?})",
            stats.packets,
            report.sent,
            got.socket_drops
        );
        assert_eq!(stats.duplicates, 0, "{src}");
        assert_eq!(stats.foreign, 0, "{src}");
    }
    assert_eq!(
        got.sources.len(),
        flows.len(),
        "unexpected sources: {:?}",
        got.counts()
    );

    drop((tx, rx));
    for name in &names {
        assert!(!netns_exists(name), "{name} left behind");
    }
}

#[test]
fn transparent_socket_sends_from_unconfigured_addresses() {
    if skip_unless_root() {
        return;
    }
    let tx = Netns::new(PREFIX).unwrap();
    let rx = Netns::new(PREFIX).unwrap();
    let (tx_if, rx_if) = veth_pair(&tx, &rx, "rtt").unwrap();
    add_addr(&tx, &tx_if, "198.19.0.1/24").unwrap();
    add_addr(&tx, &tx_if, "2001:db8:1::1/64").unwrap();
    add_addr(&rx, &rx_if, "198.19.0.254/24").unwrap();
    add_addr(&rx, &rx_if, "2001:db8:1::fe/64").unwrap();
    let dst4: IpAddr = "198.19.0.254".parse().unwrap();
    let dst6: IpAddr = "2001:db8:1::fe".parse().unwrap();
    neigh_to_peer(&tx, &tx_if, dst4, &rx, &rx_if).unwrap();
    neigh_to_peer(&tx, &tx_if, dst6, &rx, &rx_if).unwrap();
    let receiver = Receiver::bind(&rx, "[::]:0".parse().unwrap()).unwrap();
    let port = receiver.local_addr().port();

    let sources: [IpAddr; 4] = [
        "198.19.0.77".parse().unwrap(),
        "198.19.0.78".parse().unwrap(),
        "2001:db8:1::77".parse().unwrap(),
        "2001:db8:1::78".parse().unwrap(),
    ];
    let mut sent = Vec::new();
    for src in sources {
        let dst = if src.is_ipv4() { dst4 } else { dst6 };
        let socket = bind_udp_transparent(&tx, SocketAddr::new(src, 0)).unwrap();
        let report = send_udp(
            &socket,
            SocketAddr::new(dst, port),
            1000,
            Duration::from_millis(100),
            20,
        )
        .unwrap();
        assert!(report.sent >= 90, "{src}: {report:?}");
        sent.push(report.sent);
    }
    receiver.wait_idle(Duration::from_millis(100), Duration::from_secs(5));
    let counts = receiver.stop().unwrap().counts();
    for (src, sent) in sources.iter().zip(sent) {
        assert_eq!(counts.get(src), Some(&sent), "{src}: {counts:?}");
    }
}

#[test]
fn in_netns_is_isolated_and_errors_name_the_command() {
    if skip_unless_root() {
        return;
    }
    let ns = Netns::new(PREFIX).unwrap();
    // A fresh namespace has only loopback, which Netns::new brought up.
    let links = ns.ip(&["-o", "link", "show"]).unwrap();
    assert_eq!(links.lines().count(), 1, "{links}");
    assert!(links.contains("lo") && links.contains("UP"), "{links}");
    let inside = in_netns(&ns, || {
        std::fs::read_link("/proc/thread-self/ns/net").unwrap()
    });
    let outside = std::fs::read_link("/proc/thread-self/ns/net").unwrap();
    assert_ne!(inside, outside);

    let err = ns.ip(&["link", "show", "dev", "nosuchif0"]).unwrap_err();
    let msg = format!("{err:#}");
    assert!(
        msg.contains("nosuchif0") && msg.contains(ns.name()),
        "{msg}"
    );
    assert!(ns.run(&["true"]).is_ok());
    assert!(Netns::new("bad prefix").is_err());

    // Both ends in one namespace; no link-local address, so the pair stays quiet.
    let (a, b) = veth_pair(&ns, &ns, "rti").unwrap();
    assert_ne!(mac(&ns, &a).unwrap(), mac(&ns, &b).unwrap());
    for ifname in [&a, &b] {
        let v6 = ns.ip(&["-6", "addr", "show", "dev", ifname]).unwrap();
        assert!(!v6.contains("inet6"), "{ifname}: {v6}");
    }
    assert!(veth_pair(&ns, &ns, "long").is_err());
}

/// Not a speed test (nothing is asserted about speed): prints the rate one sender thread achieves
/// and checks that the receiver still counts everything. `cargo test -p ratelimit-testbed --
/// --ignored --nocapture rates`.
#[test]
#[ignore = "prints measurements; run by hand"]
fn rates() {
    if skip_unless_root() {
        return;
    }
    let tx = Netns::new(PREFIX).unwrap();
    let rx = Netns::new(PREFIX).unwrap();
    let (tx_if, rx_if) = veth_pair(&tx, &rx, "rtr").unwrap();
    add_addr(&tx, &tx_if, "198.18.0.1/24").unwrap();
    add_addr(&rx, &rx_if, "198.18.0.254/24").unwrap();
    let dst: IpAddr = "198.18.0.254".parse().unwrap();
    neigh_to_peer(&tx, &tx_if, dst, &rx, &rx_if).unwrap();
    for pps in [20_000, 50_000, 100_000, 200_000, 1_000_000] {
        let receiver = Receiver::bind(&rx, SocketAddr::new(dst, 0)).unwrap();
        let socket = bind_udp(&tx, "198.18.0.1:0".parse().unwrap()).unwrap();
        let report = send_udp(
            &socket,
            receiver.local_addr(),
            pps,
            Duration::from_secs(2),
            64,
        )
        .unwrap();
        receiver.wait_idle(Duration::from_millis(200), Duration::from_secs(5));
        let got = receiver.stop().unwrap();
        println!(
            "asked {pps} pps: sent {} skipped {} errors {} achieved {:.0} pps; received {} \
             (socket drops {:?})",
            report.sent,
            report.skipped,
            report.errors,
            report.achieved_pps(),
            got.total(),
            got.socket_drops
        );
        assert_eq!(got.total(), report.sent);
    }
}

/// Frames built by hand ([`crate::packet`]) and sent with [`RawSocket`] reach a socket in the
/// peer namespace: the one with its IPv4 header checksum filled in arrives, the same frame
/// without it (checksum 0) is dropped by the receiving stack; a paced send delivers every frame
/// it counts as sent, in order.
#[test]
fn raw_frames_with_checksums_arrive_and_paced_sends_deliver_what_they_count() {
    use std::net::{Ipv4Addr, UdpSocket};

    if skip_unless_root() {
        return;
    }
    let tx = Netns::new(PREFIX).unwrap();
    let rx = Netns::new(PREFIX).unwrap();
    let (tx_if, rx_if) = veth_pair(&tx, &rx, "rtr").unwrap();
    add_addr(&rx, &rx_if, "198.18.1.254/24").unwrap();
    let (src, dst) = (Ipv4Addr::new(198, 18, 1, 1), Ipv4Addr::new(198, 18, 1, 254));
    let socket = in_netns(&rx, || UdpSocket::bind((dst, 0))).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let port = socket.local_addr().unwrap().port();
    let macs = (
        mac_bytes(&tx, &tx_if).unwrap(),
        mac_bytes(&rx, &rx_if).unwrap(),
    );
    let raw = RawSocket::open_in(&tx, ifindex(&tx, &tx_if).unwrap(), macs.1).unwrap();
    let frame = |tag: u8, ipv4_checksum: bool| {
        let f = crate::packet::eth()
            .macs(macs.0, macs.1)
            .ipv4(src, dst)
            .udp(40_000, port)
            .data(&[tag; 16]);
        if ipv4_checksum { f.checksums() } else { f }.build()
    };
    let received = || {
        let mut got = Vec::new();
        let mut buf = [0u8; 64];
        while let Ok((n, from)) = socket.recv_from(&mut buf) {
            assert_eq!(from, SocketAddr::from((src, 40_000)));
            assert_eq!(n, 16);
            got.push(buf[0]);
        }
        got
    };

    raw.send(&frame(1, false)).unwrap();
    raw.send(&frame(2, true)).unwrap();
    assert_eq!(received(), [2], "only the frame with its checksums arrives");

    let frames: Vec<Vec<u8>> = (3..6).map(|tag| frame(tag, true)).collect();
    let report = raw
        .send_paced(&frames, 500, Duration::from_millis(200))
        .unwrap();
    let got = received();
    println!(
        "paced: sent {} ({} errors, {:.0} pps), received {}",
        report.sent,
        report.errors,
        report.achieved_pps(),
        got.len()
    );
    assert!(report.sent >= 10, "sent only {}", report.sent);
    assert_eq!(report.errors, 0);
    let want: Vec<u8> = (0..report.sent)
        .map(|i| 3 + u8::try_from(i % 3).unwrap())
        .collect();
    assert_eq!(got, want, "every frame sent arrives, round-robin in order");
}
