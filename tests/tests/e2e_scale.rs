//! The agent with millions of tracked buckets, and clients of its endpoints that try to stall it:
//! `status` stays quick however many buckets are tracked and however often `/metrics` is scraped,
//! idle connections neither hold the agent's descriptors nor keep a real client out, and `top`
//! over millions of buckets keeps the agent's memory flat.
//!
//! The store is filled from user space: the test maps the agent's pinned bucket store and writes
//! live records (a key of the agent's rule, of its generation) straight into it, four million in
//! about a second, as the XDP program would for four million sources. The sources `top` must
//! find busy are real frames the program charges.
//!
//! The timing bounds are the (status under 50 ms, not delayed by more than ~100 ms by
//! scrapes) with generous margins: they guard against a stall (a walk of the store under the
//! agent's lock takes hundreds of milliseconds here), they do not benchmark.

use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use ratelimit::maps::PinnedMaps;
use ratelimit_testbed::fill::fill_store;
use ratelimit_testbed::packet::eth;
use ratelimit_testbed::{
    ifindex, in_netns, mac_bytes, require_root, veth_pair, AgentProcess, Netns, RawSocket,
};
use serde_json::Value;

/// Tracked buckets (the figure for `top`).
const BUCKETS: u32 = 4 << 20;
const RULE: &str = "many";

fn config(iface: &str, metrics: SocketAddr, buckets: u32, rules: &str) -> String {
    format!(
        "[agent]\ninterfaces = [\"{iface}\"]\nmetrics = \"{metrics}\"\nmax_buckets = {buckets}\n\n{rules}"
    )
}

/// The one rule the store is filled under.
fn one_rule() -> String {
    format!("[[rule]]\nname = \"{RULE}\"\nsource = \"0.0.0.0/0\"\nrate = 1000\nburst = 1000\n")
}

struct Bed {
    ns: Netns,
    peer: Netns,
    /// The veth end in `peer`, facing the agent's interface.
    peer_if: String,
    /// The agent's interface.
    iface: String,
    agent: AgentProcess,
    metrics: SocketAddr,
}

fn bed(tag: &str) -> Bed {
    bed_with(tag, BUCKETS, &one_rule())
}

fn bed_with(tag: &str, buckets: u32, rules: &str) -> Bed {
    require_root();
    let ns = Netns::new(&format!("rl-scale-{tag}")).unwrap();
    let peer = Netns::new(&format!("rl-scale-{tag}-p")).unwrap();
    let (peer_if, iface) = veth_pair(&peer, &ns, "sc").unwrap();
    let port = in_netns(&ns, || {
        TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
    })
    .unwrap();
    let metrics: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let agent = AgentProcess::start(&ns, &config(&iface, metrics, buckets, rules), &[]).unwrap();
    Bed {
        ns,
        peer,
        peer_if,
        iface,
        agent,
        metrics,
    }
}

/// Writes `n` live buckets of the agent's rule into records `0..n` of its store.
fn fill(pin: &Path, n: u32) {
    assert_eq!(fill_store(pin, RULE, n, 100).unwrap(), n);
}

/// One request over the control socket; the answer's JSON and how long it took.
fn api(socket: &Path, path: &str) -> (Value, Duration) {
    let began = Instant::now();
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let took = began.elapsed();
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{path}: {text}");
    (serde_json::from_str(body).unwrap(), took)
}

/// `GET /metrics` from inside the agent's namespace; the body.
fn scrape(ns: &Netns, addr: SocketAddr) -> std::io::Result<String> {
    in_netns(ns, || {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )?;
        let mut text = String::new();
        s.read_to_string(&mut text)?;
        if !text.starts_with("HTTP/1.1 200") || !text.ends_with("# EOF\n") {
            return Err(std::io::Error::other(format!("bad scrape: {text:.200}")));
        }
        Ok(text)
    })
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// A field of `/proc/PID/status`, in kB.
fn proc_kb(pid: libc::pid_t, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"))
}

fn open_fds(pid: libc::pid_t) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

#[test]
fn status_stays_quick_with_millions_of_buckets_while_metrics_are_scraped() {
    let bed = bed("status");
    let socket = bed.agent.socket_path().to_path_buf();
    fill(bed.agent.pin_path(), BUCKETS);
    // The census counts them all (within a few of its walks).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (st, _) = api(&socket, "/v1/status");
        if st["buckets_tracked"] == u64::from(BUCKETS) {
            break;
        }
        assert!(Instant::now() < deadline, "census never counted: {st}");
        thread::sleep(Duration::from_millis(200));
    }
    let alone = median(
        (0..15)
            .map(|_| {
                thread::sleep(Duration::from_millis(20));
                api(&socket, "/v1/status").1
            })
            .collect(),
    );
    eprintln!("status alone, median of 15: {alone:?}");
    assert!(
        alone < Duration::from_millis(50),
        "status takes {alone:?} with {BUCKETS} buckets tracked"
    );

    // Four clients scraping in a loop.
    let stop = AtomicBool::new(false);
    let (during, scrapes) = thread::scope(|scope| {
        let scrapers: Vec<_> = (0..4)
            .map(|_| {
                scope.spawn(|| {
                    let mut n = 0u32;
                    while !stop.load(Ordering::Relaxed) {
                        let text = scrape(&bed.ns, bed.metrics).unwrap();
                        assert!(text.contains(&format!("ratelimit_buckets_tracked {BUCKETS}")));
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        thread::sleep(Duration::from_millis(300));
        let during: Vec<Duration> = (0..15)
            .map(|_| {
                thread::sleep(Duration::from_millis(50));
                api(&socket, "/v1/status").1
            })
            .collect();
        stop.store(true, Ordering::Relaxed);
        let scrapes: u32 = scrapers.into_iter().map(|t| t.join().unwrap()).sum();
        (during, scrapes)
    });
    let (slowest, during) = (*during.iter().max().unwrap(), median(during));
    eprintln!("status during {scrapes} scrapes: median {during:?}, slowest {slowest:?}");
    assert!(scrapes >= 4, "the scrapers did not run: {scrapes}");
    assert!(
        during < alone + Duration::from_millis(100),
        "scrapes delay status: {during:?} (median) against {alone:?} alone"
    );
    assert!(
        slowest < Duration::from_secs(1),
        "a status call stalled for {slowest:?} during scrapes"
    );
    bed.agent.stop().unwrap();
}

#[test]
fn top_over_millions_of_buckets_keeps_memory_flat_and_finds_the_busy_ones() {
    let bed = bed("top");
    let socket = bed.agent.socket_path().to_path_buf();
    let pid = bed.agent.pid().unwrap();
    fill(bed.agent.pin_path(), BUCKETS);
    // Three sources the XDP program sees busy during `top`: real frames from the peer, so their
    // buckets are the program's, created where it puts them (evicting filled ones if the store
    // is full) and then charged as it charges a known source.
    let busy = [
        Ipv4Addr::new(10, 200, 0, 1),
        Ipv4Addr::new(10, 200, 0, 2),
        Ipv4Addr::new(10, 200, 0, 3),
    ];
    let macs = (
        mac_bytes(&bed.peer, &bed.peer_if).unwrap(),
        mac_bytes(&bed.ns, &bed.iface).unwrap(),
    );
    let raw =
        RawSocket::open_in(&bed.peer, ifindex(&bed.peer, &bed.peer_if).unwrap(), macs.1).unwrap();
    let frame = |src| {
        eth()
            .macs(macs.0, macs.1)
            .ipv4(src, Ipv4Addr::new(198, 18, 0, 1))
            .udp(40000, 9)
            .data(&[0x5a; 32])
            .ipv4_checksum()
            .build()
    };
    // 8 : 3 : 1 of 2,400 frames a second: 1,600, 600 and 200 (the first over the rule's 1,000,
    // its excess dropped; `top` ranks by packets passed and dropped). Each `top` window of a
    // million records is measured over its own interval, so the sources in different windows
    // are measured at different times: ranks this far apart hold whatever the sender's pace.
    let round: Vec<Vec<u8>> = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 2]
        .map(|k| frame(busy[k]))
        .to_vec();
    // Their buckets exist before `top` begins, so that its walks see no bucket created or
    // evicted: what they count is then exact. Twice: a source's first packet passes without a
    // bucket, its next makes it.
    for f in round.iter().chain(&round) {
        raw.send(f).unwrap();
    }
    let maps = PinnedMaps::open(bed.agent.pin_path()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let tracked = loop {
        let (mut tracked, mut found) = (0u64, 0);
        maps.for_each_bucket(|_, b| {
            tracked += 1;
            found += usize::from(busy.iter().any(|a| b.key().addr[..4] == a.octets()));
        })
        .unwrap();
        if found == busy.len() {
            break tracked;
        }
        assert!(
            Instant::now() < deadline,
            "{found} of the busy sources' buckets"
        );
        thread::sleep(Duration::from_millis(50));
    };
    let stop = Arc::new(AtomicBool::new(false));
    let sender = {
        let stop = stop.clone();
        thread::spawn(move || {
            // Paced by the clock, late frames sent back to back: a stalled sender catches up.
            let (start, mut n) = (Instant::now(), 0u32);
            while !stop.load(Ordering::Relaxed) {
                let due = start + Duration::from_secs(1) * n / 2_400;
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    thread::sleep(wait.min(Duration::from_millis(5)));
                    continue;
                }
                raw.send(&round[n as usize % round.len()]).unwrap();
                n += 1;
            }
        })
    };
    let anon_before = proc_kb(pid, "RssAnon");
    let top = {
        let socket = socket.clone();
        thread::spawn(move || api(&socket, "/v1/top?n=5&interval_ms=300").0)
    };
    let mut anon_max = anon_before;
    while !top.is_finished() {
        anon_max = anon_max.max(proc_kb(pid, "RssAnon"));
        thread::sleep(Duration::from_millis(10));
    }
    let top = top.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    sender.join().unwrap();
    let grew_mib = (anon_max.saturating_sub(anon_before)) / 1024;
    eprintln!(
        "RssAnon {anon_before} kB before top, {anon_max} kB at most during it (+{grew_mib} MiB); \
         windows {}, tracked {}, active {}",
        top["windows"], top["buckets_tracked"], top["active"]
    );
    // The old `top` held two full copies (88 bytes a bucket and more): 700 MiB and up here.
    assert!(
        grew_mib < 64,
        "top grew the agent's anonymous memory by {grew_mib} MiB"
    );
    assert!(
        tracked >= u64::from(BUCKETS),
        "{tracked} buckets after the busy ones came"
    );
    assert_eq!(top["buckets_tracked"], tracked, "{top}");
    assert_eq!(top["active"], 3, "{top}");
    assert!(top["windows"].as_u64().unwrap() >= 4, "{top}");
    let sources: Vec<&str> = top["top"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["source"].as_str().unwrap())
        .collect();
    let addr = |a: Ipv4Addr| a.to_string() + "/32";
    assert_eq!(
        sources,
        [addr(busy[0]), addr(busy[1]), addr(busy[2])],
        "{top}"
    );
    bed.agent.stop().unwrap();
}

#[test]
fn idle_connections_neither_hold_descriptors_nor_keep_clients_out() {
    let bed = bed("idle");
    let socket = bed.agent.socket_path().to_path_buf();
    let pid = bed.agent.pid().unwrap();
    let before = open_fds(pid);
    const IDLE: usize = 400;
    // Connections that send nothing, to the metrics port and to the control socket.
    let tcp: Vec<TcpStream> = in_netns(&bed.ns, || {
        (0..IDLE)
            .map(|_| TcpStream::connect(bed.metrics))
            .collect::<std::io::Result<Vec<_>>>()
    })
    .unwrap();
    let unix: Vec<UnixStream> = (0..IDLE)
        .map(|_| UnixStream::connect(&socket).unwrap())
        .collect();
    thread::sleep(Duration::from_millis(500));
    let held = open_fds(pid);
    eprintln!(
        "agent descriptors: {before} before, {held} with {IDLE} idle connections to each server"
    );
    // A real client still gets through to both, at once.
    let began = Instant::now();
    let text = scrape(&bed.ns, bed.metrics).expect("a scrape past the idle connections");
    assert!(text.contains("ratelimit_buckets_capacity"));
    let (st, _) = api(&socket, "/v1/status");
    assert!(st["pid"].is_u64(), "{st}");
    eprintln!("scrape and status past them: {:?}", began.elapsed());
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "the idle connections kept clients waiting {:?}",
        began.elapsed()
    );
    // At most 64 per server (and what a client just opened).
    assert!(
        held < before + 2 * 64 + 8,
        "{IDLE} idle connections to each server hold {} descriptors",
        held - before
    );
    // The oldest idle connections were closed.
    let mut first = &tcp[0];
    first
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    assert_eq!(first.read(&mut [0u8; 16]).unwrap_or(0), 0, "still open");
    drop((tcp, unix));
    bed.agent.stop().unwrap();
}

/// The rule cap's worth of rules (each `/metrics` reply names every rule in 14-22 series), 64
/// clients scraping in a loop, the most the endpoint serves at once: the replies are encoded one
/// at a time and shared, so encodings stay at about one a second however many scrapes are
/// served, the agent's memory grows by a few replies, not one per scraper, and a real scraper,
/// arriving in the middle, is served.
#[test]
fn scrapes_of_every_rule_by_many_clients_are_encoded_once_and_shared() {
    const RULES: u32 = ratelimit_common::MAX_RULES;
    const SCRAPERS: usize = 64;
    const STORM: Duration = Duration::from_secs(6);
    let rules: String = (0..RULES)
        .map(|i| {
            format!(
                "[[rule]]\nname = \"r{i}\"\nsource = \"10.{}.{}.0/24\"\nrate = 100\n\n",
                i >> 8,
                i & 0xff
            )
        })
        .collect();
    let bed = bed_with("scrapes", 1 << 16, &rules);
    let pid = bed.agent.pid().unwrap();
    let encodings = |text: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix("ratelimit_metrics_encodings_total "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no encodings counter in {:.300}", text))
    };
    let first = scrape(&bed.ns, bed.metrics).unwrap();
    let reply = first.len() as u64;
    assert!(
        first.contains(&format!("rule=\"r{}\"", RULES - 1)),
        "every rule is in the reply"
    );
    let rss_before = proc_kb(pid, "VmRSS");
    let cpu = || -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let fields: Vec<&str> = stat.rsplit_once(") ").unwrap().1.split(' ').collect();
        let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        #[expect(clippy::cast_precision_loss, reason = "small counts")]
        let secs = ticks as f64 / 100.0;
        secs
    };
    let (cpu0, began) = (cpu(), Instant::now());
    let e0 = encodings(&scrape(&bed.ns, bed.metrics).unwrap());
    let stop = AtomicBool::new(false);
    let (served, seen, real) = thread::scope(|scope| {
        let scrapers: Vec<_> = (0..SCRAPERS)
            .map(|_| {
                scope.spawn(|| {
                    let (mut n, mut most) = (0u64, 0u64);
                    while !stop.load(Ordering::Relaxed) {
                        if let Ok(text) = scrape(&bed.ns, bed.metrics) {
                            most = most.max(encodings(&text));
                            n += 1;
                        }
                    }
                    (n, most)
                })
            })
            .collect();
        thread::sleep(STORM / 2);
        // A real scraper, in the middle of the storm.
        let t = Instant::now();
        let real = scrape(&bed.ns, bed.metrics).map(|text| (t.elapsed(), text.len()));
        thread::sleep(STORM / 2);
        stop.store(true, Ordering::Relaxed);
        let results: Vec<(u64, u64)> = scrapers.into_iter().map(|t| t.join().unwrap()).collect();
        (
            results.iter().map(|r| r.0).sum::<u64>(),
            results.iter().map(|r| r.1).max().unwrap_or(0),
            real,
        )
    });
    let secs = began.elapsed().as_secs_f64();
    let (cpu_secs, rss_peak) = (cpu() - cpu0, proc_kb(pid, "VmHWM"));
    let made = seen - e0;
    eprintln!(
        "{RULES} rules, reply {:.1} MB; {SCRAPERS} scrapers for {secs:.1} s: {served} replies \
         from {made} encodings; agent CPU {cpu_secs:.2} s ({:.0}% of a core), RSS {} MB before, \
         peak {} MB; the real scraper: {real:?}",
        reply as f64 / 1e6,
        100.0 * cpu_secs / secs,
        rss_before / 1024,
        rss_peak / 1024,
    );
    let (took, len) = real.expect("the real scraper was served during the storm");
    assert!(len as u64 > reply / 2, "the real scraper got {len} bytes");
    assert!(
        took < Duration::from_secs(10),
        "the real scraper waited {took:?}"
    );
    assert!(
        served >= SCRAPERS as u64,
        "the scrapers did not run: {served} replies"
    );
    // One encoding a second at most (the share), however many replies: each reply shares one.
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "small"
    )]
    let most = secs.ceil() as u64 + 1;
    assert!(
        made <= most && made < served,
        "{made} encodings for {served} replies over {secs:.1} s (at most {most})"
    );
    // Memory: a few replies (the shared one, the one being made, their parts), not one per scraper.
    let grew = rss_peak.saturating_sub(rss_before) * 1024;
    assert!(
        grew < 8 * reply + (64 << 20),
        "the agent grew by {} MB serving {SCRAPERS} scrapers a reply of {} MB",
        grew >> 20,
        reply >> 20
    );
    bed.agent.stop().unwrap();
}
