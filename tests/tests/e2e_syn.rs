//! A SYN flood from one source, end to end: the real agent on a veth with a per-source SYN rule
//! (`tcp_flags = "syn"`) beside a general TCP rule for the same prefix. One address opens a real
//! TCP connection and keeps sending data over it while it also floods the listener's port with
//! crafted SYNs (an AF_PACKET socket, many times the SYN rule's rate). The SYN rule must admit
//! exactly its bucket's worth of SYNs and count every SYN (and nothing else); the established
//! connection's segments, from the very same source, fall under the general rule and every byte
//! arrives. And the SYN rule through the CLI: `rules add --tcp-flags syn`, written back to the
//! config file, listed, and `explain --tcp-flags`.

use std::{
    io::{Read, Write},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    thread,
    time::{Duration, Instant},
};

use ratelimit_testbed::{
    add_addr,
    agent_proc::rule_packets,
    ifindex, in_netns, mac_bytes, neigh_to_peer,
    packet::{eth, from_hex, PINNED_MACS},
    require_root, veth_pair, AgentProcess, Netns, RawSocket,
};

/// The SYN rule: SYNs per second and burst, per source.
const SYN_RATE: u64 = 100;
const SYN_BURST: u64 = 20;
/// The flood: SYNs per second, and for how long.
const FLOOD_PPS: u64 = 4000;
const DURATION: Duration = Duration::from_secs(2);
/// The established connection writes this much every `WRITE_EVERY` during the flood.
const CHUNK: usize = 1000;
const WRITE_EVERY: Duration = Duration::from_millis(2);
const PORT: u16 = 8080;

/// An Ethernet frame with a TCP SYN from `src`:`sport` to `dst`:`PORT`, checksums included.
fn syn_frame(macs: ([u8; 6], [u8; 6]), src: Ipv4Addr, dst: Ipv4Addr, sport: u16) -> Vec<u8> {
    eth()
        .macs(macs.0, macs.1)
        .ipv4(src, dst)
        .ident(u32::from(sport))
        .tcp(sport, PORT)
        .tcp_seq(u32::from(sport) * 7919)
        .tcp_window(64_240)
        .checksums()
        .build()
}

/// `syn_frame` gives the bytes the function it replaced built by hand (at fa91d4f, for the first
/// and the last source port of the flood): the test puts the same packets on the wire.
#[test]
fn syn_frames_are_the_bytes_they_were_built_by_hand() {
    let (src, dst) = (
        Ipv4Addr::new(198, 18, 10, 1),
        Ipv4Addr::new(198, 18, 10, 254),
    );
    assert_eq!(syn_frame(PINNED_MACS, src, dst, 20_000), from_hex("0266778899aa0211223344550800450000284e20000040068b8cc6120a01c6120afe4e201f900970afe0000000005002faf0eccc0000"));
    assert_eq!(syn_frame(PINNED_MACS, src, dst, 24_095), from_hex("0266778899aa0211223344550800450000285e1f000040067b8dc6120a01c6120afe5e1f1f900b5f80f1000000005002faf009ce0000"));
}

#[test]
#[expect(clippy::cast_precision_loss, reason = "packet counts far below 2^52")]
fn a_syn_flood_is_limited_while_the_same_sources_connection_flows() {
    require_root();
    let tx = Netns::new("rl-e2e-syn-tx").unwrap();
    let rx = Netns::new("rl-e2e-syn-rx").unwrap();
    let (tx_if, rx_if) = veth_pair(&tx, &rx, "sy").unwrap();
    let (src, dst) = (
        Ipv4Addr::new(198, 18, 10, 1),
        Ipv4Addr::new(198, 18, 10, 254),
    );
    add_addr(&tx, &tx_if, "198.18.10.1/24").unwrap();
    add_addr(&rx, &rx_if, "198.18.10.254/24").unwrap();
    let (src_ip, dst_ip) = (IpAddr::from(src), IpAddr::from(dst));
    neigh_to_peer(&tx, &tx_if, dst_ip, &rx, &rx_if).unwrap();
    neigh_to_peer(&rx, &rx_if, src_ip, &tx, &tx_if).unwrap();
    let config = format!(
        "[agent]\ninterfaces = [\"{rx_if}\"]\n\n\
         [[rule]]\nname = \"syn\"\nsource = \"198.18.10.0/24\"\nprotocol = \"tcp\"\n\
         tcp_flags = \"syn\"\nrate = {SYN_RATE}\nburst = {SYN_BURST}\n\n\
         [[rule]]\nname = \"tcp\"\nsource = \"198.18.10.0/24\"\nprotocol = \"tcp\"\n\
         rate = 100000\nburst = 100000\n"
    );
    let agent = AgentProcess::start(&rx, &config, &[]).unwrap();

    // The listener: accepts the one real connection and counts its bytes. (The flood's SYNs fill
    // its backlog, answered with SYN cookies; nothing accepts them.)
    let listener = in_netns(&rx, || TcpListener::bind(SocketAddr::new(dst_ip, PORT))).unwrap();
    let reader = thread::spawn(move || {
        let (mut conn, peer) = listener.accept().unwrap();
        let mut buf = vec![0u8; 65536];
        let mut total = 0usize;
        loop {
            match conn.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => total += n,
                Err(e) => panic!("reading the connection: {e}"),
            }
        }
        (peer, total)
    });
    let mut conn = in_netns(&tx, || {
        TcpStream::connect_timeout(&SocketAddr::new(dst_ip, PORT), Duration::from_secs(3))
    })
    .unwrap();
    conn.set_nodelay(true).unwrap();
    conn.write_all(&[0x5a; CHUNK]).unwrap();
    // The connection's own SYN took one token; let the bucket fill again.
    thread::sleep(Duration::from_millis(400));
    let before = agent.stats();

    let macs = (
        mac_bytes(&tx, &tx_if).unwrap(),
        mac_bytes(&rx, &rx_if).unwrap(),
    );
    let raw = RawSocket::open_in(&tx, ifindex(&tx, &tx_if).unwrap(), macs.1).unwrap();
    let frames: Vec<Vec<u8>> = (0..4096u16)
        .map(|i| syn_frame(macs, src, dst, 20_000 + i))
        .collect();
    let (flood, written) = thread::scope(|s| {
        let flooder = s.spawn(|| raw.send_paced(&frames, FLOOD_PPS, DURATION).unwrap());
        let writer = s.spawn(|| {
            let start = Instant::now();
            let mut written = CHUNK;
            while start.elapsed() < DURATION {
                conn.write_all(&[0x5a; CHUNK]).unwrap();
                written += CHUNK;
                thread::sleep(WRITE_EVERY);
            }
            written
        });
        (flooder.join().unwrap(), writer.join().unwrap())
    });
    conn.shutdown(std::net::Shutdown::Write).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !reader.is_finished() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    assert!(
        reader.is_finished(),
        "the established connection did not finish within 10 s of the flood's end"
    );
    let (peer, received) = reader.join().unwrap();
    thread::sleep(Duration::from_millis(200));
    let after = agent.stats();
    let delta =
        |rule: &str, v: &str| rule_packets(&after, rule, v) - rule_packets(&before, rule, v);
    let (syn_passed, syn_dropped) = (delta("syn", "passed"), delta("syn", "dropped_rate"));
    let (tcp_passed, tcp_dropped) = (delta("tcp", "passed"), delta("tcp", "dropped_rate"));
    let (sent, t) = (flood.sent, (flood.last - flood.first).as_secs_f64());
    let expected = SYN_BURST as f64 + SYN_RATE as f64 * t;
    println!(
        "flood: {sent} SYNs in {t:.3} s ({:.0}/s); syn rule passed {syn_passed} (expected \
         {expected:.0} = burst {SYN_BURST} + {SYN_RATE}/s x {t:.3} s), dropped {syn_dropped}; \
         connection from {peer}: wrote {written} bytes, received {received}; tcp rule passed \
         {tcp_passed}, dropped {tcp_dropped}",
        sent as f64 / t
    );
    assert_eq!(
        peer.ip(),
        src_ip,
        "the connection comes from the flooding source"
    );
    // The flood really was one: many times the SYN rule's bucket.
    assert!(
        sent as f64 >= 5.0 * expected,
        "only {sent} SYNs sent against a bucket of {expected:.0} (CPU starved?)"
    );
    // Every SYN, and nothing else, was counted by the SYN rule.
    assert_eq!(
        syn_passed + syn_dropped,
        sent,
        "the SYN rule counted other packets than the flood's SYNs, or missed some"
    );
    // Exactly its bucket's worth, but for the flood's timing on the veth (50 ms either way) and
    // one coarse-clock jiffy.
    let slack = SYN_RATE as f64 * 0.05 + 2.0;
    assert!(
        (syn_passed as f64 - expected).abs() <= slack,
        "the SYN rule admitted {syn_passed} SYNs, expected {expected:.0} +- {slack:.0}"
    );
    // The same source's established connection is under the general rule and loses nothing.
    assert_eq!(received, written, "the connection lost data");
    assert_eq!(tcp_dropped, 0, "the general rule dropped packets");
    assert!(
        tcp_passed >= u64::try_from(written / CHUNK).unwrap() / 2,
        "the connection's segments were not counted under the general rule: {tcp_passed}"
    );
    assert!(agent.stop().unwrap().success());
}

#[test]
fn syn_rules_through_the_cli_add_list_write_back_and_explain() {
    require_root();
    let tx = Netns::new("rl-e2e-syncli-tx").unwrap();
    let rx = Netns::new("rl-e2e-syncli-rx").unwrap();
    let (_tx_if, rx_if) = veth_pair(&tx, &rx, "sc").unwrap();
    let config = format!(
        "[agent]\ninterfaces = [\"{rx_if}\"]\n\n\
         [[rule]]\nname = \"tcp\"\nsource = \"198.18.11.0/24\"\nprotocol = \"tcp\"\n\
         rate = 1000\n"
    );
    let agent = AgentProcess::start(&rx, &config, &[]).unwrap();
    let add = [
        "rules",
        "add",
        "--name",
        "syn",
        "--source",
        "198.18.11.0/24",
        "--protocol",
        "tcp",
        "--tcp-flags",
        "syn",
        "--rate",
        "10",
    ];
    agent.cli_ok(&add);
    // Written back to the config file.
    let file = std::fs::read_to_string(agent.config_path()).unwrap();
    assert!(file.contains("tcp_flags = \"syn\""), "{file}");
    // Listed.
    let list = agent.cli_json(&["rules", "list"]);
    let syn = list["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "syn")
        .unwrap_or_else(|| panic!("{list}"));
    assert_eq!(syn["tcp_flags"], "syn", "{list}");
    // Explained: a SYN meets the SYN rule, a SYN-ACK or an ACK the general one, and why.
    let e = agent.cli_json(&[
        "explain",
        "198.18.11.5",
        "--protocol",
        "tcp",
        "--dst-port",
        "443",
        "--tcp-flags",
        "syn",
    ]);
    assert_eq!(e["rule"]["name"], "syn", "{e}");
    assert_eq!(e["tcp_flags"], 2, "{e}");
    let why = e["why"].as_str().unwrap();
    assert!(why.contains("SYN set, ACK clear"), "{why}");
    for flags in ["syn,ack", "ack"] {
        let e = agent.cli_json(&[
            "explain",
            "198.18.11.5",
            "--protocol",
            "tcp",
            "--tcp-flags",
            flags,
        ]);
        assert_eq!(e["rule"]["name"], "tcp", "{flags}: {e}");
        let why = e["why"].as_str().unwrap();
        assert!(why.contains("do not fit") && why.contains("syn"), "{why}");
    }
    let human = agent.cli_ok(&[
        "explain",
        "198.18.11.5",
        "--protocol",
        "tcp",
        "--tcp-flags",
        "syn",
    ]);
    assert!(human.contains("tcp_flags SYN"), "{human}");
    assert!(human.contains("tcp_flags=syn"), "{human}");
    // Refused, and nothing changes: a second SYN rule for the same prefix, flags without tcp,
    // flags on a packet that is not TCP.
    let err = agent
        .cli_refused(&[
            "rules",
            "add",
            "--name",
            "syn2",
            "--source",
            "198.18.11.0/24",
            "--protocol",
            "tcp",
            "--tcp-flags",
            "syn",
            "--rate",
            "5",
        ])
        .stderr;
    assert!(err.contains("tcp_flags syn"), "{err}");
    let err = agent
        .cli_refused(&[
            "rules",
            "add",
            "--name",
            "syn3",
            "--source",
            "198.18.12.0/24",
            "--protocol",
            "udp",
            "--tcp-flags",
            "syn",
            "--rate",
            "5",
        ])
        .stderr;
    assert!(
        err.contains("tcp_flags") && err.contains("only valid with protocol tcp"),
        "{err}"
    );
    let err = agent
        .cli_refused(&[
            "explain",
            "198.18.11.5",
            "--protocol",
            "udp",
            "--tcp-flags",
            "syn",
        ])
        .stderr;
    assert!(err.contains("only meaningful with protocol tcp"), "{err}");
    assert_eq!(std::fs::read_to_string(agent.config_path()).unwrap(), file);
    assert!(agent.stop().unwrap().success());
}
