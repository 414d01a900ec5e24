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
    net::{IpAddr, SocketAddr, TcpListener, TcpStream},
    thread,
    time::{Duration, Instant},
};

use ratelimit_testbed::{
    add_addr, agent_binary, agent_proc::rule_packets, in_netns, neigh_to_peer, require_root,
    veth_pair, AgentProcess, Netns,
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

/// The Internet checksum (RFC 1071) of `data`.
fn checksum(data: &[u8]) -> u16 {
    let mut sum = 0u32;
    for chunk in data.chunks(2) {
        sum += u32::from(u16::from_be_bytes([chunk[0], *chunk.get(1).unwrap_or(&0)]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !u16::try_from(sum).expect("folded")
}

/// An Ethernet frame with a TCP SYN from `src`:`sport` to `dst`:`PORT`, checksums included.
fn syn_frame(macs: ([u8; 6], [u8; 6]), src: [u8; 4], dst: [u8; 4], sport: u16) -> Vec<u8> {
    let mut t = [0u8; 20];
    t[0..2].copy_from_slice(&sport.to_be_bytes());
    t[2..4].copy_from_slice(&PORT.to_be_bytes());
    t[4..8].copy_from_slice(&(u32::from(sport) * 7919).to_be_bytes());
    t[12] = 5 << 4;
    t[13] = 0x02; // SYN
    t[14..16].copy_from_slice(&64_240u16.to_be_bytes());
    let mut pseudo = Vec::new();
    pseudo.extend_from_slice(&src);
    pseudo.extend_from_slice(&dst);
    pseudo.extend_from_slice(&[0, 6, 0, 20]);
    pseudo.extend_from_slice(&t);
    let sum = checksum(&pseudo);
    t[16..18].copy_from_slice(&sum.to_be_bytes());
    let mut ip = [0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&40u16.to_be_bytes());
    ip[4..6].copy_from_slice(&sport.to_be_bytes());
    ip[8] = 64;
    ip[9] = 6;
    ip[12..16].copy_from_slice(&src);
    ip[16..20].copy_from_slice(&dst);
    let sum = checksum(&ip);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    let mut f = Vec::with_capacity(54);
    f.extend_from_slice(&macs.1);
    f.extend_from_slice(&macs.0);
    f.extend_from_slice(&[0x08, 0x00]);
    f.extend_from_slice(&ip);
    f.extend_from_slice(&t);
    f
}

fn parse_mac(s: &str) -> [u8; 6] {
    let v: Vec<u8> = s
        .split(':')
        .map(|b| u8::from_str_radix(b, 16).unwrap())
        .collect();
    v.try_into().unwrap()
}

/// Sends SYN frames from `src` at `pps` for `DURATION` on `ifindex` (in the calling thread's
/// namespace); returns how many were sent and the time from the first to the last.
fn flood(
    ifindex: u32,
    macs: ([u8; 6], [u8; 6]),
    src: [u8; 4],
    dst: [u8; 4],
    pps: u64,
) -> (u64, Duration) {
    let frames: Vec<Vec<u8>> = (0..4096u16)
        .map(|i| syn_frame(macs, src, dst, 20_000 + i))
        .collect();
    // SAFETY: plain socket calls on a descriptor owned here and closed below.
    unsafe {
        let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0);
        assert!(
            fd >= 0,
            "AF_PACKET socket: {}",
            std::io::Error::last_os_error()
        );
        let mut addr: libc::sockaddr_ll = std::mem::zeroed();
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_ifindex = i32::try_from(ifindex).unwrap();
        addr.sll_halen = 6;
        addr.sll_addr[..6].copy_from_slice(&macs.1);
        let start = Instant::now();
        let mut sent = 0u64;
        let mut last = start;
        while start.elapsed() < DURATION {
            // Paced: the n-th frame goes at n / pps seconds.
            let due = start + Duration::from_secs_f64(sent as f64 / pps as f64);
            let now = Instant::now();
            if now < due {
                thread::sleep(due - now);
            }
            let f = &frames[usize::try_from(sent % 4096).unwrap()];
            let n = libc::sendto(
                fd,
                f.as_ptr().cast(),
                f.len(),
                0,
                (&raw const addr).cast(),
                u32::try_from(size_of::<libc::sockaddr_ll>()).unwrap(),
            );
            if n == isize::try_from(f.len()).unwrap() {
                sent += 1;
                last = Instant::now();
            }
        }
        libc::close(fd);
        (sent, last - start)
    }
}

#[test]
#[expect(clippy::cast_precision_loss, reason = "packet counts far below 2^52")]
fn a_syn_flood_is_limited_while_the_same_sources_connection_flows() {
    require_root();
    let tx = Netns::new("rl-e2e-syn-tx").unwrap();
    let rx = Netns::new("rl-e2e-syn-rx").unwrap();
    let (tx_if, rx_if) = veth_pair(&tx, &rx, "sy").unwrap();
    let (src, dst) = ([198, 18, 10, 1], [198, 18, 10, 254]);
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
        parse_mac(&ratelimit_testbed::mac(&tx, &tx_if).unwrap()),
        parse_mac(&ratelimit_testbed::mac(&rx, &rx_if).unwrap()),
    );
    let ifindex = ratelimit_testbed::ifindex(&tx, &tx_if).unwrap();
    let ((sent, span), written) = thread::scope(|s| {
        let flooder = s.spawn(|| in_netns(&tx, || flood(ifindex, macs, src, dst, FLOOD_PPS)));
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
    let t = span.as_secs_f64();
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

/// Runs the CLI against `agent`; returns (success, stdout, stderr).
fn cli(agent: &AgentProcess, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(agent_binary())
        .arg("--socket")
        .arg(agent.socket_path())
        .args(args)
        .output()
        .expect("running the ratelimit CLI");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(agent: &AgentProcess, args: &[&str]) -> serde_json::Value {
    let mut args = args.to_vec();
    args.push("--json");
    let (ok, out, err) = cli(agent, &args);
    assert!(ok, "`ratelimit {}` failed: {err}", args.join(" "));
    serde_json::from_str(&out).unwrap()
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
    let (ok, _, err) = cli(&agent, &add);
    assert!(ok, "rules add: {err}");
    // Written back to the config file.
    let file = std::fs::read_to_string(agent.config_path()).unwrap();
    assert!(file.contains("tcp_flags = \"syn\""), "{file}");
    // Listed.
    let list = json(&agent, &["rules", "list"]);
    let syn = list["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "syn")
        .unwrap_or_else(|| panic!("{list}"));
    assert_eq!(syn["tcp_flags"], "syn", "{list}");
    // Explained: a SYN meets the SYN rule, a SYN-ACK or an ACK the general one, and why.
    let e = json(
        &agent,
        &[
            "explain",
            "198.18.11.5",
            "--protocol",
            "tcp",
            "--dst-port",
            "443",
            "--tcp-flags",
            "syn",
        ],
    );
    assert_eq!(e["rule"]["name"], "syn", "{e}");
    assert_eq!(e["tcp_flags"], 2, "{e}");
    let why = e["why"].as_str().unwrap();
    assert!(why.contains("SYN set, ACK clear"), "{why}");
    for flags in ["syn,ack", "ack"] {
        let e = json(
            &agent,
            &[
                "explain",
                "198.18.11.5",
                "--protocol",
                "tcp",
                "--tcp-flags",
                flags,
            ],
        );
        assert_eq!(e["rule"]["name"], "tcp", "{flags}: {e}");
        let why = e["why"].as_str().unwrap();
        assert!(why.contains("do not fit") && why.contains("syn"), "{why}");
    }
    let (ok, human, err) = cli(
        &agent,
        &[
            "explain",
            "198.18.11.5",
            "--protocol",
            "tcp",
            "--tcp-flags",
            "syn",
        ],
    );
    assert!(ok, "{err}");
    assert!(human.contains("tcp_flags SYN"), "{human}");
    assert!(human.contains("tcp_flags=syn"), "{human}");
    // Refused, and nothing changes: a second SYN rule for the same prefix, flags without tcp,
    // flags on a packet that is not TCP.
    let (ok, _, err) = cli(
        &agent,
        &[
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
        ],
    );
    assert!(!ok && err.contains("tcp_flags syn"), "{err}");
    let (ok, _, err) = cli(
        &agent,
        &[
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
        ],
    );
    assert!(
        !ok && err.contains("tcp_flags") && err.contains("only valid with protocol tcp"),
        "{err}"
    );
    let (ok, _, err) = cli(
        &agent,
        &[
            "explain",
            "198.18.11.5",
            "--protocol",
            "udp",
            "--tcp-flags",
            "syn",
        ],
    );
    assert!(
        !ok && err.contains("only meaningful with protocol tcp"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(agent.config_path()).unwrap(), file);
    assert!(agent.stop().unwrap().success());
}
