//! The control API's HTTP layer against a live agent, attacked the way a careless or hostile
//! client on the socket would: a wrong method to every route, unknown routes, bodies that are
//! not JSON, of the wrong shape or larger than any rule, malformed request lines and headers,
//! seeded random bytes, header floods, lying `Content-Length`s, broken chunked encoding, and
//! connections that never finish their request. After each, the agent must answer a well-formed
//! request, and at the end nothing in force may have changed: the same rules, rule-set
//! generation, reload counts, attachment and config file.

use std::fs;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use ratelimit_testbed::agent_proc::xdp_attachment;
use ratelimit_testbed::{in_netns, require_root, veth_pair, AgentProcess, Netns};
use serde_json::Value;

/// How long one exchange may take before the agent counts as stalled (a hang guard, not a
/// speed test).
const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// Sends `request` whole, then reads until the agent closes (or the timeout). Returns the
/// response's status code (`None`: closed without a response) and the whole response.
fn exchange(socket: &Path, request: &[u8]) -> (Option<u16>, String) {
    exchange_with(socket, request, false)
}

/// [`exchange`] for a request that may be incomplete or unparseable: the write side is closed
/// after it, so that the agent sees its end (it then answers 400 or closes the connection).
fn exchange_broken(socket: &Path, request: &[u8]) -> (Option<u16>, String) {
    exchange_with(socket, request, true)
}

fn exchange_with(socket: &Path, request: &[u8], half_close: bool) -> (Option<u16>, String) {
    let mut stream = UnixStream::connect(socket).expect("connecting to the control socket");
    stream.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    stream.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
    // The agent may answer (and close) before taking all of a large body: a failed write is
    // fine, the response is what counts.
    let _ = stream.write_all(request);
    if half_close {
        let _ = stream.shutdown(std::net::Shutdown::Write);
    }
    let mut bytes = Vec::new();
    let started = Instant::now();
    match stream.read_to_end(&mut bytes) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!(
            "no answer within {IO_TIMEOUT:?} ({:?}) to {:?}: {e}",
            started.elapsed(),
            String::from_utf8_lossy(&request[..request.len().min(200)])
        ),
    }
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok());
    (status, text)
}

fn request(method: &str, path: &str, body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "{method} {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\nContent-Type: \
         application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

/// The body of a response, parsed as JSON.
fn json_body(response: &str) -> Value {
    let body = response.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {response:?}"))
}

/// What is in force, as a client sees it.
#[derive(Debug, PartialEq)]
struct InForce {
    rules: Value,
    generation: Value,
    reloads_ok: Value,
    reloads_failed: Value,
    interfaces: Value,
    dry_run: Value,
}

fn in_force(socket: &Path) -> InForce {
    let (status, text) = exchange(socket, &request("GET", "/v1/status", b""));
    assert_eq!(status, Some(200), "status: {text}");
    let st = json_body(&text);
    let (status, text) = exchange(socket, &request("GET", "/v1/rules", b""));
    assert_eq!(status, Some(200), "rules: {text}");
    InForce {
        rules: json_body(&text),
        generation: st["generation"].clone(),
        reloads_ok: st["reloads"]["ok"].clone(),
        reloads_failed: st["reloads"]["failed"].clone(),
        interfaces: st["interfaces"].clone(),
        dry_run: st["dry_run"].clone(),
    }
}

/// xorshift64*: a seeded generator, so a failing case can be replayed from the printed seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n as u64).unwrap()
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next().to_le_bytes()[0]).collect()
    }
}

/// Routes and the methods they take; every other method must be refused with 405.
const ROUTES: [(&str, &[&str]); 10] = [
    ("/v1/status", &["GET", "HEAD"]),
    ("/v1/rules", &["GET", "HEAD", "POST"]),
    ("/v1/rules/flood", &["DELETE"]),
    ("/v1/reload", &["POST"]),
    ("/v1/stats", &["GET", "HEAD"]),
    ("/v1/top?interval_ms=10", &["GET", "HEAD"]),
    ("/v1/explain?ip=198.18.0.1", &["GET", "HEAD"]),
    ("/v1/detach", &["POST"]),
    ("/v1/cluster", &["GET", "HEAD"]),
    ("/v1/nothing-here", &[]),
];
const METHODS: [&str; 7] = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"];

#[test]
fn malformed_requests_are_refused_the_agent_keeps_answering_and_nothing_in_force_changes() {
    require_root();
    let tx = Netns::new("rl-http-tx").unwrap();
    let rx = Netns::new("rl-http-rx").unwrap();
    let (_tx_if, rx_if) = veth_pair(&tx, &rx, "htp").unwrap();
    let config = format!(
        "[agent]\ninterfaces = [\"{rx_if}\"]\n\n[[rule]]\nname = \"flood\"\nsource = \
         \"198.18.0.0/24\"\nrate = 100\nburst = 10\n"
    );
    let agent = AgentProcess::start(&rx, &config, &[]).unwrap();
    let socket = agent.socket_path().to_owned();
    let file_before = fs::read(agent.config_path()).unwrap();
    let before = in_force(&socket);
    let attached = xdp_attachment(&rx, &rx_if).unwrap();
    assert!(attached.is_some());

    wrong_methods_are_refused(&socket);
    bodies_and_queries_that_mean_nothing_are_refused(&socket);
    broken_http_is_refused(&socket);
    connections_left_halfway_block_nobody(&socket, &before);

    // Nothing in force changed, the file was not written, the program is still attached.
    let after = in_force(&socket);
    assert_eq!(after, before, "what is in force changed");
    assert_eq!(
        fs::read(agent.config_path()).unwrap(),
        file_before,
        "the config file was written"
    );
    assert_eq!(xdp_attachment(&rx, &rx_if).unwrap(), attached);
    assert!(agent.stop().unwrap().success());
}

/// The agent still answers a well-formed request, after `what`.
fn assert_alive(socket: &Path, what: &str) {
    let (status, text) = exchange(socket, &request("GET", "/v1/status", b""));
    assert_eq!(status, Some(200), "after {what}, status answers {text:?}");
}

/// Every route with every method it does not take: 405 (404 for no route), with a JSON error.
fn wrong_methods_are_refused(socket: &Path) {
    for (path, allowed) in ROUTES {
        for method in METHODS.iter().filter(|m| !allowed.contains(m)) {
            let (status, text) = exchange(socket, &request(method, path, b""));
            let want = if allowed.is_empty() { 404 } else { 405 };
            assert_eq!(status, Some(want), "{method} {path}: {text}");
            assert!(
                json_body(&text)["error"].is_string(),
                "{method} {path}: {text}"
            );
        }
    }
    assert_alive(socket, "wrong methods");
}

/// Bodies that are not a rule (empty, not JSON, the wrong shape, 3 MiB, nested 100,000 deep, a
/// list file): each refused with a 4xx, no rule added; a rule that is not there: 404; queries
/// that mean nothing: 400.
fn bodies_and_queries_that_mean_nothing_are_refused(socket: &Path) {
    let big_name = format!(
        "{{\"name\": \"{}\", \"source\": \"198.18.1.0/24\", \"rate\": 1}}",
        "a".repeat(3 << 20)
    );
    let bodies: Vec<(&str, Vec<u8>)> = vec![
        ("empty", b"".to_vec()),
        ("not JSON", b"rate = 5".to_vec()),
        (
            "truncated JSON",
            b"{\"name\": \"x\", \"source\": \"198.18".to_vec(),
        ),
        ("an array", b"[1, 2, 3]".to_vec()),
        (
            "wrong types",
            br#"{"name": 5, "source": true, "rate": "fast"}"#.to_vec(),
        ),
        (
            "unknown key",
            br#"{"name": "x", "source": "198.18.1.0/24", "rate": 1, "brust": 2}"#.to_vec(),
        ),
        (
            "invalid UTF-8",
            b"{\"name\": \"\xff\xfe\", \"source\": \"198.18.1.0/24\", \"rate\": 1}".to_vec(),
        ),
        (
            "deep nesting",
            format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes(),
        ),
        ("3 MiB name", big_name.into_bytes()),
        (
            "a huge number",
            br#"{"name": "x", "source": "198.18.1.0/24", "rate": 1e999}"#.to_vec(),
        ),
        (
            "a list file",
            br#"{"name": "x", "source_file": "/etc/passwd", "rate": 1}"#.to_vec(),
        ),
    ];
    for (what, body) in &bodies {
        let (status, text) = exchange(socket, &request("POST", "/v1/rules", body));
        let code = status.unwrap_or_else(|| panic!("{what}: closed without a response"));
        assert!((400..500).contains(&code), "{what}: {code} {text}");
        assert_alive(socket, what);
    }
    let (status, text) = exchange(socket, &request("DELETE", "/v1/rules/no-such-rule", b""));
    assert_eq!(status, Some(404), "{text}");
    for path in [
        "/v1/top?n=abc",
        "/v1/top?interval_ms=0",
        "/v1/top?interval_ms=99999999999999999999",
        "/v1/explain?ip=not-an-ip",
        "/v1/explain?ip=198.18.0.1&dst_port=70000",
        "/v1/explain",
    ] {
        let (status, text) = exchange(socket, &request("GET", path, b""));
        assert_eq!(status, Some(400), "GET {path}: {text}");
    }
    assert_alive(socket, "bad queries");
}

/// Broken HTTP (hand-made, and 200 seeded random requests): each gets a 4xx or the connection
/// closed, never a hang or a crash, and nothing a request says is applied.
fn broken_http_is_refused(socket: &Path) {
    let mut broken = broken_requests();
    // Seeded random requests: random bytes, and real requests with random bytes spliced in.
    let seed = 0x5eed_1234_u64 ^ u64::from(std::process::id());
    println!("random requests from seed {seed:#x}");
    let mut rng = Rng(seed | 1);
    for _ in 0..200 {
        let mut r = if rng.below(2) == 0 {
            let n = 1 + rng.below(512);
            rng.bytes(n)
        } else {
            let (path, allowed) = ROUTES[rng.below(ROUTES.len())];
            let method = allowed.first().copied().unwrap_or("GET");
            // No rule of that name: a DELETE that parses anyway removes nothing.
            let path = if method == "DELETE" {
                "/v1/rules/absent"
            } else {
                path
            };
            let mut r = request(method, path, b"{\"name\": \"r\"}");
            let at = rng.below(r.len());
            let n = 1 + rng.below(16);
            let junk = rng.bytes(n);
            r.splice(at..at, junk);
            r
        };
        // Never a POST that could be valid by chance: reload and detach change what is in force.
        if r.starts_with(b"POST /v1/reload") || r.starts_with(b"POST /v1/detach") {
            r.insert(0, b'X');
        }
        broken.push(("random", r));
    }
    for (what, r) in &broken {
        let (status, text) = exchange_broken(socket, r);
        if let Some(code) = status {
            // A spliced request may still parse: then it is answered as any request is, and
            // must be refused (nothing a random request says may be applied).
            assert!(
                (400..500).contains(&code) || (code == 200 && !r.starts_with(b"POST")),
                "{what}: {code} for {:?}: {text}",
                String::from_utf8_lossy(&r[..r.len().min(200)])
            );
        }
        assert_alive(socket, what);
    }
}

/// Requests that break HTTP by hand: request lines, headers, lengths, chunks, sizes.
fn broken_requests() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("no version", b"GET /v1/status\r\n\r\n".to_vec()),
        ("bad request line", b"GARBAGE\r\n\r\n".to_vec()),
        ("LF only", b"GET /v1/status HTTP/1.1\nHost: a\n\n".to_vec()),
        ("HTTP/9.9", b"GET /v1/status HTTP/9.9\r\nHost: a\r\n\r\n".to_vec()),
        ("NUL in path", b"GET /v1/\0status HTTP/1.1\r\nHost: a\r\n\r\n".to_vec()),
        ("header without colon", b"GET /v1/status HTTP/1.1\r\nHost a\r\n\r\n".to_vec()),
        (
            "Content-Length larger than the body",
            b"POST /v1/rules HTTP/1.1\r\nHost: a\r\nContent-Length: 1000\r\n\r\n{\"na".to_vec(),
        ),
        (
            "two Content-Lengths",
            b"POST /v1/rules HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nContent-Length: 9\r\n\r\n{}".to_vec(),
        ),
        (
            "negative Content-Length",
            b"POST /v1/rules HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n{}".to_vec(),
        ),
        (
            "bad chunk size",
            b"POST /v1/rules HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"
                .to_vec(),
        ),
        (
            "endless chunk",
            b"POST /v1/rules HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffff\r\n{}".to_vec(),
        ),
        ("a 1 MiB header", {
            let mut r = b"GET /v1/status HTTP/1.1\r\nHost: a\r\nX-Big: ".to_vec();
            r.extend(std::iter::repeat_n(b'x', 1 << 20));
            r.extend_from_slice(b"\r\n\r\n");
            r
        }),
        ("10,000 headers", {
            let mut r = b"GET /v1/status HTTP/1.1\r\nHost: a\r\n".to_vec();
            for i in 0..10_000 {
                r.extend_from_slice(format!("X-H{i}: v\r\n").as_bytes());
            }
            r.extend_from_slice(b"\r\n");
            r
        }),
        ("a 64 KiB path", {
            let mut r = b"GET /v1/".to_vec();
            r.extend(std::iter::repeat_n(b'a', 64 << 10));
            r.extend_from_slice(b" HTTP/1.1\r\nHost: a\r\n\r\n");
            r
        }),
    ]
}

/// 64 connections that never finish their request do not block the others, nor change what is
/// in force (`before`); closed all at once, and clients that hang up before their answer (the
/// agent's writes fail, EPIPE), do not kill the agent (SIGPIPE's default action).
fn connections_left_halfway_block_nobody(socket: &Path, before: &InForce) {
    let mut held = Vec::new();
    for i in 0..64 {
        let mut s = UnixStream::connect(socket).unwrap();
        let partial: &[u8] = match i % 3 {
            0 => b"GET /v1/sta",
            1 => b"POST /v1/rules HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n{\"name\"",
            _ => b"",
        };
        s.write_all(partial).unwrap();
        held.push(s);
    }
    assert_alive(socket, "64 connections left halfway");
    assert_eq!(in_force(socket), *before, "in force while connections hang");
    // Closed all at once, and clients that hang up before their answer: the agent's writes to
    // them fail (EPIPE); they must not kill it (SIGPIPE's default action).
    drop(held);
    for _ in 0..32 {
        let mut s = UnixStream::connect(socket).unwrap();
        s.write_all(&request("GET", "/v1/stats", b"")).unwrap();
    }
    assert_alive(socket, "clients that hung up early");
}

/// What an attacker sends on each connection: a request announcing a large body, then a few
/// bytes of it, then nothing more (a body trickled slower than any timeout notices).
fn slow_body(method: &str, path: &str) -> Vec<u8> {
    format!(
        "{method} {path} HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nContent-Length: \
         1000000\r\n\r\n{{\"name\": "
    )
    .into_bytes()
}

/// `GET /metrics` at `addr` in `ns`: the status code, `None` when closed without an answer.
fn scrape_status(ns: &Netns, addr: SocketAddr) -> Option<u16> {
    in_netns(ns, || -> std::io::Result<Option<u16>> {
        let mut s = TcpStream::connect_timeout(&addr, IO_TIMEOUT)?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")?;
        let mut bytes = Vec::new();
        match s.read_to_end(&mut bytes) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            Err(e) => return Err(e),
        }
        let text = String::from_utf8_lossy(&bytes).into_owned();
        Ok(text
            .strip_prefix("HTTP/1.1 ")
            .and_then(|rest| rest.get(..3))
            .and_then(|code| code.parse().ok()))
    })
    .unwrap()
}

/// 64 connections (the cap) each sending a request with a slowly trickled body must not lock
/// scrapers out of the metrics endpoint, nor clients out of the control socket: a body where
/// none is taken (`POST /metrics`) is refused unread, and a connection still sending its body
/// is evicted like an idle one when a new connection needs its slot. (They used to count as
/// busy from their headers on, for the whole 10 s body timeout, renewed by reconnecting.)
#[test]
fn slow_bodies_do_not_hold_the_connection_slots() {
    require_root();
    let tx = Netns::new("rl-http-slow-tx").unwrap();
    let rx = Netns::new("rl-http-slow-rx").unwrap();
    let (_tx_if, rx_if) = veth_pair(&tx, &rx, "hsl").unwrap();
    let port = in_netns(&rx, || {
        TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr())
    })
    .unwrap()
    .port();
    let metrics = SocketAddr::from(([127, 0, 0, 1], port));
    let config = format!(
        "[agent]\ninterfaces = [\"{rx_if}\"]\nmetrics = \"{metrics}\"\n\n[[rule]]\nname = \
         \"flood\"\nsource = \"198.18.0.0/24\"\nrate = 100\nburst = 10\n"
    );
    let agent = AgentProcess::start(&rx, &config, &[]).unwrap();
    let socket = agent.socket_path().to_owned();
    assert_eq!(scrape_status(&rx, metrics), Some(200));

    // The metrics endpoint: 64 slow `POST /metrics` bodies, then a scrape.
    let mut held = Vec::new();
    for _ in 0..64 {
        let mut s = in_netns(&rx, || TcpStream::connect(metrics)).unwrap();
        s.write_all(&slow_body("POST", "/metrics")).unwrap();
        held.push(s);
    }
    // Give the agent time to read every request's headers (so each is in its body phase).
    std::thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    let status = scrape_status(&rx, metrics);
    println!(
        "scrape with 64 slow bodies held: {status:?} after {:?}",
        started.elapsed()
    );
    assert_eq!(status, Some(200), "a scrape with 64 slow bodies held");
    // They were answered and closed without their bodies being read.
    let mut first = held.swap_remove(0);
    first.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    let mut answer = String::new();
    let _ = first.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer:?}");
    drop(held);

    // The control socket: 64 slow `POST /v1/rules` (which does take a body), then a request.
    let mut held = Vec::new();
    for _ in 0..64 {
        let mut s = UnixStream::connect(&socket).unwrap();
        s.write_all(&slow_body("POST", "/v1/rules")).unwrap();
        held.push(s);
    }
    // Give the agent time to read every request's headers (so each is in its body phase).
    std::thread::sleep(Duration::from_millis(500));
    let (status, text) = exchange(&socket, &request("GET", "/v1/status", b""));
    assert_eq!(
        status,
        Some(200),
        "status with 64 slow bodies held: {text:?}"
    );
    // And a scrape again, with bodies trickling on the metrics port while it runs.
    let mut trickling = Vec::new();
    for _ in 0..64 {
        let mut s = in_netns(&rx, || TcpStream::connect(metrics)).unwrap();
        let _ = s.write_all(&slow_body("POST", "/metrics"));
        let _ = s.write_all(b"\"x");
        trickling.push(s);
    }
    std::thread::sleep(Duration::from_millis(500));
    for s in &mut trickling {
        let _ = s.write_all(b"x");
    }
    assert_eq!(scrape_status(&rx, metrics), Some(200));
    drop((held, trickling));
    assert!(agent.stop().unwrap().success());
}
