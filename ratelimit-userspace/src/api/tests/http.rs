//! The API over HTTP: the real `http::serve` and `router` over `harness::Recorder`, fed crafted byte
//! streams; `harness::check` holds every exchange to the properties the `api_http` fuzz target
//! checks (fuzz/README.md).

use super::*;
use harness::{Call, Close};

fn get(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: agent\r\n\r\n")
}

fn send(method: &str, path: &str, body: &str) -> String {
    format!(
        "{method} {path} HTTP/1.1\r\nHost: agent\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Sends `input`, checks the exchange, and answers the responses and the backend calls.
async fn over_http(input: &[u8], close: Close) -> (Vec<harness::Response>, Vec<Call>) {
    let x = harness::exchange(input, close).await;
    let responses = harness::check(&x).unwrap_or_else(|e| {
        panic!(
            "{e}\ninput: {:?}\noutput: {:?}",
            String::from_utf8_lossy(&x.input),
            String::from_utf8_lossy(&x.output)
        )
    });
    (responses, x.calls.into_iter().map(|(c, _)| c).collect())
}

fn statuses(responses: &[harness::Response]) -> Vec<u16> {
    responses.iter().map(|r| r.status).collect()
}

/// The message of the API's `{"error": ...}`.
fn error_message(r: &harness::Response) -> String {
    let body = r.body.as_deref().expect("a body");
    let v: Value = serde_json::from_slice(body).expect("a JSON error");
    v["error"].as_str().expect("an error message").to_string()
}

#[tokio::test(start_paused = true)]
async fn every_route_over_http_calls_the_backend_with_what_the_request_said() {
    let dns =
        r#"{"name": "dns", "source": "::/0", "protocol": "udp", "dst_port": 53, "rate": 100}"#;
    let input = [
        get("/v1/status"),
        get("/v1/rules"),
        send("POST", "/v1/rules?force=1", dns),
        send("DELETE", "/v1/rules/default", ""),
        send("POST", "/v1/reload", ""),
        get("/v1/stats"),
        get("/v1/cluster"),
        get("/v1/top?n=5&interval_ms=500&limit=2"),
        get("/v1/explain?ip=198.51.100.7&protocol=tcp&dst_port=443&tcp_flags=syn,ack"),
        send("POST", "/v1/detach", r#"{"iface": "eth1"}"#),
        send("POST", "/v1/detach", " \n"),
        get("/v1/nope"),
        send("PUT", "/v1/status", ""),
        send("DELETE", "/v1/rules/default?force", ""),
        send("POST", "/v1/rules", dns),
        send("POST", "/v1/detach", r#"{"iface": "eth9"}"#),
    ]
    .concat();
    // All pipelined on one keep-alive connection.
    let (responses, calls) = over_http(input.as_bytes(), Close::WhenIdle).await;
    assert_eq!(
        statuses(&responses),
        [200, 200, 201, 200, 200, 200, 200, 200, 200, 200, 200, 404, 405, 404, 409, 400]
    );
    let rule = rule_from_json(&serde_json::from_str(dns).unwrap()).unwrap();
    let detach = |iface: Option<&str>| Call::Detach {
        iface: iface.map(String::from),
    };
    let remove = |force| Call::RemoveRule {
        name: "default".into(),
        force,
    };
    let add = |force| Call::AddRule {
        rule: Box::new(rule.clone()),
        force,
    };
    assert_eq!(
        calls,
        [
            Call::Status,
            Call::Rules,
            add(true),
            remove(false),
            Call::Reload,
            Call::Stats,
            Call::Cluster,
            Call::Top {
                n: 5,
                interval: Duration::from_millis(500),
                limit: Some(2)
            },
            Call::Explain {
                ip: "198.51.100.7".parse().unwrap(),
                protocol: 6,
                dst_port: Some(443),
                tcp_flags: Some(0x12),
            },
            detach(Some("eth1")),
            detach(None),
            remove(true),
            add(false),
            detach(Some("eth9")),
        ]
    );
    assert!(error_message(&responses[11]).starts_with("no route GET /v1/nope"));
    assert_eq!(
        error_message(&responses[12]),
        "/v1/status does not take PUT"
    );
    assert_eq!(error_message(&responses[13]), "no rule named \"default\"");
    assert_eq!(
        error_message(&responses[14]),
        "a rule named \"dns\" already exists"
    );
    // Defaults: n 10, interval 1 s, no limit; HEAD is answered as GET, without a body.
    let (responses, calls) = over_http(
        format!("HEAD /v1/top HTTP/1.1\r\n\r\n{}", get("/v1/top")).as_bytes(),
        Close::WhenIdle,
    )
    .await;
    let top = Call::Top {
        n: 10,
        interval: Duration::from_secs(1),
        limit: None,
    };
    assert_eq!(calls, [top.clone(), top]);
    assert_eq!(statuses(&responses), [200, 200]);
    assert!(responses[0].body.is_none() && responses[1].body.is_some());
}

#[tokio::test(start_paused = true)]
async fn bad_queries_paths_and_bodies_are_refused_as_json_before_the_backend_is_called() {
    let max_n = TOP_N.1;
    let cases = [
        (get("/v1/top?n=0"), "n: \"0\" is not a number between 1"),
        (get(&format!("/v1/top?n={}", max_n + 1)), "n: "),
        (get("/v1/top?n=-1"), "n: "),
        (get("/v1/top?n=five"), "n: "),
        (
            get("/v1/top?interval_ms=9"),
            "interval_ms: \"9\" is not a number between 10 and 60000",
        ),
        (get("/v1/top?interval_ms=60001"), "interval_ms: "),
        (
            get("/v1/top?limit=0"),
            "limit: \"0\" is not a number between 1 and 4",
        ),
        (get("/v1/top?limit=5"), "limit: "),
        (
            get("/v1/top?n=1&n=2"),
            "Failed to deserialize query string: duplicate field `n`",
        ),
        (get("/v1/explain"), "ip: missing"),
        (get("/v1/explain?ip=300.1.1.1"), "ip: \"300.1.1.1\" is not"),
        (
            get("/v1/explain?ip=10.0.0.1&dst_port=53"),
            "dst_port: only meaningful with protocol tcp or udp",
        ),
        (
            get("/v1/explain?ip=10.0.0.1&protocol=icmp&dst_port=53"),
            "dst_port: only meaningful",
        ),
        (
            get("/v1/explain?ip=10.0.0.1&protocol=udp&dst_port=0"),
            "dst_port: \"0\" is not a port",
        ),
        (
            get("/v1/explain?ip=10.0.0.1&protocol=udp&tcp_flags=syn"),
            "tcp_flags: only meaningful with protocol tcp",
        ),
        (
            get("/v1/explain?ip=10.0.0.1&protocol=tcp&tcp_flags=sin"),
            "tcp_flags: unknown flag \"sin\"",
        ),
        (get("/v1/explain?ip=10.0.0.1&protocol=sctp"), "protocol: "),
        (
            send("DELETE", "/v1/rules/default?force=maybe", ""),
            "force: expected true or false, got \"maybe\"",
        ),
        (
            send("DELETE", "/v1/rules/default?force=1&force=0", ""),
            "Failed to deserialize query string: duplicate field `force`",
        ),
        (
            send("DELETE", "/v1/rules/%FF", ""),
            "Invalid URL: Invalid UTF-8 in `name`",
        ),
        (send("POST", "/v1/rules?force=2", "{}"), "force: "),
        (
            send("POST", "/v1/rules", "{"),
            "the request body is not JSON",
        ),
        (
            send(
                "POST",
                "/v1/rules",
                r#"{"name": "a", "source": "10.0.0.0/8", "rate": 5, "dst_port": 53}"#,
            ),
            "rule \"a\": field `dst_port`",
        ),
        (
            send("POST", "/v1/detach", r#"{"iface": 5}"#),
            "iface: expected a string, got 5",
        ),
        (
            send("POST", "/v1/detach", "eth0"),
            "the request body is not JSON",
        ),
    ];
    for (request, want) in cases {
        let (responses, calls) = over_http(request.as_bytes(), Close::WhenIdle).await;
        assert_eq!(statuses(&responses), [400], "{request:?}");
        let message = error_message(&responses[0]);
        assert!(
            message.starts_with(want),
            "{request:?}: {message:?}, want {want:?}..."
        );
        assert_eq!(calls, [], "{request:?} reached the backend");
    }
}

#[tokio::test(start_paused = true)]
async fn chunked_bodies_expect_continue_and_the_body_limit() {
    let chunked = |chunks: &str| {
        format!(
            "POST /v1/rules HTTP/1.1\r\nHost: agent\r\nTransfer-Encoding: chunked\r\n\
             Expect: 100-continue\r\n\r\n{chunks}"
        )
    };
    // A rule in two chunks, then another request on the same connection.
    let (a, b) = (r#"{"name": "x", "sour"#, r#"ce": "10.0.0.0/8", "rate": 5}"#);
    let input = chunked(&format!(
        "{:x}\r\n{a}\r\n{:x};ext=1\r\n{b}\r\n0\r\n\r\n",
        a.len(),
        b.len()
    )) + &get("/v1/status");
    let (responses, calls) = over_http(input.as_bytes(), Close::WhenIdle).await;
    assert_eq!(statuses(&responses), [100, 201, 200]);
    assert!(
        matches!(&calls[..], [Call::AddRule { rule, force: false }, Call::Status] if rule.name == "x")
    );
    // A chunk size that is not hex: http::serve's 400, and the connection is over.
    let input = chunked("zz\r\n{}\r\n0\r\n\r\n") + &get("/v1/status");
    let (responses, calls) = over_http(input.as_bytes(), Close::WhenIdle).await;
    assert_eq!(statuses(&responses), [100, 400]);
    let body = String::from_utf8_lossy(responses[1].body.as_deref().unwrap()).into_owned();
    assert!(body.starts_with("reading the request body: "), "{body}");
    assert_eq!(calls, []);
    // A body over the limit, chunked or not: 413.
    let big = "x".repeat(harness::LIMITS.max_body + 1);
    for input in [
        send("POST", "/v1/rules", &big),
        chunked(&format!("{:x}\r\n{big}\r\n0\r\n\r\n", big.len())),
    ] {
        let (responses, calls) = over_http(input.as_bytes(), Close::WhenIdle).await;
        assert_eq!(responses.last().map(|r| r.status), Some(413), "{input:.80}");
        assert_eq!(calls, []);
    }
}

/// A body on a request that takes none is refused (413) before it is read, the connection is
/// closed (nothing after it is answered), and the backend is not called: nobody can hold a
/// connection by trickling a body no route reads.
#[tokio::test(start_paused = true)]
async fn a_body_where_none_is_taken_is_refused_unread_and_the_connection_closed() {
    for (method, path) in [
        ("GET", "/v1/status"),
        ("POST", "/v1/reload"),
        ("DELETE", "/v1/rules/x"),
        ("GET", "/v1/nowhere"),
    ] {
        // The body announced is far longer than what follows: it is never waited for.
        let input = format!(
            "{method} {path} HTTP/1.1\r\nHost: agent\r\nContent-Length: 1000000\r\n\r\n{{\"a\""
        ) + &get("/v1/status");
        let (responses, calls) = over_http(input.as_bytes(), Close::WhenIdle).await;
        assert_eq!(statuses(&responses), [413], "{method} {path}");
        let body = String::from_utf8_lossy(responses[0].body.as_deref().unwrap()).into_owned();
        assert!(body.starts_with("the request body is refused: "), "{body}");
        assert_eq!(responses[0].header("connection"), Some("close"));
        assert_eq!(calls, [], "{method} {path}");
    }
    // Where a body is taken, an empty one still reaches the handler.
    let (responses, calls) =
        over_http(send("POST", "/v1/detach", "").as_bytes(), Close::WhenIdle).await;
    assert_eq!(statuses(&responses), [200]);
    assert_eq!(calls.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn what_the_parser_refuses_gets_hypers_400_and_nothing_after_it() {
    let many_headers = format!(
        "GET /v1/status HTTP/1.1\r\n{}\r\n",
        "X-A: b\r\n".repeat(101)
    );
    let cases: [(&[u8], u16); 4] = [
        (
            b"GET /v1/status HTTP/1.1\r\nno colon here\r\n\r\nGET /v1/status HTTP/1.1\r\n\r\n",
            400,
        ),
        (b"G\0T /v1/status HTTP/1.1\r\n\r\n", 400),
        (b"GET /v1/status HTTP/9.9\r\n\r\n", 400),
        (many_headers.as_bytes(), 431),
    ];
    for (input, want) in cases {
        let (responses, calls) = over_http(input, Close::WhenIdle).await;
        assert_eq!(
            statuses(&responses),
            [want],
            "{:?}",
            String::from_utf8_lossy(input)
        );
        assert_eq!(responses[0].body.as_deref(), Some(&b""[..]));
        assert_eq!(calls, []);
    }
}

#[tokio::test(start_paused = true)]
async fn a_truncated_request_is_not_answered_and_calls_nothing() {
    for input in [
        &b"GET /v1/sta"[..],
        b"GET /v1/status HTTP/1.1\r\nHost: a\r\n",
    ] {
        for close in [Close::WhenIdle, Close::AtOnce] {
            let (responses, calls) = over_http(input, close).await;
            assert_eq!(statuses(&responses), [0u16; 0], "{input:?}");
            assert_eq!(calls, []);
        }
    }
    // A body shorter than its length: refused once the client gives up.
    let input = "POST /v1/rules HTTP/1.1\r\nContent-Length: 10\r\n\r\n{}";
    let (responses, calls) = over_http(input.as_bytes(), Close::WhenIdle).await;
    assert_eq!(statuses(&responses), [400]);
    assert_eq!(calls, []);
}

/// A client that half-closes right after sending (`nc -N`) still gets every answer: one
/// request, and pipelined ones (with hyper's default, the last went unanswered).
#[tokio::test(start_paused = true)]
async fn a_client_that_half_closes_after_sending_gets_every_answer() {
    let (responses, calls) = over_http(get("/v1/status").as_bytes(), Close::AtOnce).await;
    assert_eq!(statuses(&responses), [200]);
    assert_eq!(calls, [Call::Status]);
    let input = get("/v1/status") + &get("/v1/rules");
    let (responses, calls) = over_http(input.as_bytes(), Close::AtOnce).await;
    assert_eq!(statuses(&responses), [200, 200]);
    assert_eq!(calls, [Call::Status, Call::Rules]);
}

/// `harness::check` refuses each kind of violation: the tests above would pass without it.
#[test]
fn the_harness_check_catches_what_a_broken_api_would_do() {
    let ok = |body: &str| {
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let status_answer = json!({"rules": 1});
    let exchange =
        |input: &str, output: String, calls: Vec<(Call, harness::Answer)>| harness::Exchange {
            input: input.as_bytes().to_vec(),
            output: output.into_bytes(),
            calls,
            stalled: false,
        };
    let one = get("/v1/status");
    // The well-behaved exchange passes: the cases below each break one thing of it.
    let good = exchange(
        &one,
        ok(r#"{"rules": 1}"#),
        vec![(Call::Status, Ok(status_answer.clone()))],
    );
    harness::check(&good).unwrap();
    let top = |n, ms| Call::Top {
        n,
        interval: Duration::from_millis(ms),
        limit: None,
    };
    let explain = |protocol, dst_port, tcp_flags| Call::Explain {
        ip: "10.0.0.1".parse().unwrap(),
        protocol,
        dst_port,
        tcp_flags,
    };
    let mut invalid =
        rule_from_json(&json!({"name": "r", "source": "10.0.0.0/8", "rate": 5})).unwrap();
    invalid.rate = Some(0);
    let cases: Vec<(&str, harness::Exchange)> = vec![
        ("top called with n = 0", exchange(&one, String::new(), vec![(top(0, 1000), Ok(json!({})))])),
        ("top called with n = 100001", exchange(&one, String::new(), vec![(top(TOP_N.1 + 1, 1000), Ok(json!({})))])),
        ("top called with an interval of 9ms", exchange(&one, String::new(), vec![(top(1, 9), Ok(json!({})))])),
        ("explain called with a dst_port and protocol 1", exchange(&one, String::new(), vec![(explain(1, Some(53), None), Ok(json!({})))])),
        ("explain called with dst_port 0", exchange(&one, String::new(), vec![(explain(6, Some(0), None), Ok(json!({})))])),
        ("explain called with tcp_flags and protocol 17", exchange(&one, String::new(), vec![(explain(17, None, Some(2)), Ok(json!({})))])),
        ("rules add called with an invalid rule", exchange(&one, String::new(), vec![(Call::AddRule { rule: Box::new(invalid), force: false }, Ok(json!({})))])),
        ("status 500 is not one of", exchange(&one, "HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n".into(), vec![])),
        ("neither the API's", exchange(&one, "HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\ncontent-length: 7\r\n\r\nrefused".into(), vec![])),
        ("not {\"error\": MESSAGE}", exchange(&one, "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 13\r\n\r\n{\"error\": \"\"}".into(), vec![])),
        ("a success the backend did not answer next", exchange(&one, ok(r#"{"rules": 2}"#), vec![(Call::Status, Ok(status_answer.clone()))])),
        ("a success the backend did not answer next", exchange(&one, ok(r#"{"rules": 1}"#), vec![])),
        ("2 responses (0 hyper's own) to an input with 1 request heads", exchange(&one, ok(r#"{"rules": 1}"#).repeat(2), vec![(Call::Status, Ok(status_answer.clone())), (Call::Status, Ok(status_answer.clone()))])),
        ("2 backend calls from an input with 1 request heads", exchange(&one, ok(r#"{"rules": 1}"#), vec![(Call::Status, Ok(status_answer.clone())), (Call::Status, Ok(status_answer.clone()))])),
        ("2 backend answers the client never got", exchange(&one.repeat(2), String::new(), vec![(Call::Status, Ok(status_answer.clone())), (Call::Status, Ok(status_answer.clone()))])),
        ("follows a response with connection: close", exchange(&one.repeat(2), format!("HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: 12\r\n\r\n{{\"rules\": 1}}{}", ok(r#"{"rules": 1}"#)), vec![(Call::Status, Ok(status_answer.clone())), (Call::Status, Ok(status_answer.clone()))])),
        ("not an HTTP response", exchange(&one, "garbage".into(), vec![])),
        ("content-length 50, 12 bytes follow", exchange(&one, ok(r#"{"rules": 1}"#).replace("12", "50"), vec![(Call::Status, Ok(status_answer.clone()))])),
        ("stalled", harness::Exchange { stalled: true, ..exchange(&one, String::new(), vec![]) }),
    ];
    for (want, x) in cases {
        let got = harness::check(&x).expect_err(want);
        assert!(got.contains(want), "got {got:?}, want {want:?}");
    }
}

#[test]
fn complete_heads_counts_each_empty_line_once() {
    assert_eq!(harness::complete_heads(b""), 0);
    assert_eq!(harness::complete_heads(b"GET / HTTP/1.1\r\n"), 0);
    assert_eq!(harness::complete_heads(b"GET / HTTP/1.1\r\n\r\n"), 1);
    assert_eq!(harness::complete_heads(b"GET / HTTP/1.1\n\n"), 1);
    assert_eq!(harness::complete_heads(b"\n\n\n"), 1);
    assert_eq!(harness::complete_heads(b"\n\n\n\n"), 2);
    assert_eq!(harness::complete_heads(b"a\r\n\r\nb\n\nc\n\r\n"), 3);
}
