use ratelimit_common::Bucket;
use serde_json::json;

use super::*;
use crate::{
    compile::{compile, RuleIds},
    config::{Action, Config},
    maps::bucket::bucket_key,
};

mod http;

fn err(v: Value) -> String {
    rule_from_json(&v).expect_err("refused")
}

#[test]
fn rule_from_json_takes_the_config_keys_and_defaults() {
    let rule = rule_from_json(&json!({
        "name": "web", "source": "198.18.0.0/15", "rate": 100, "per": "/24",
        "protocol": "tcp", "dst_port": 443, "bytes_rate": 1_000_000,
    }))
    .unwrap();
    // The same rule written in a config file.
    let file = Config::parse(
        "[[rule]]\nname = \"web\"\nsource = \"198.18.0.0/15\"\nrate = 100\nper = \"/24\"\n\
         protocol = \"tcp\"\ndst_port = 443\nbytes_rate = 1000000\n",
        "test",
    )
    .unwrap();
    let mut from_file = file.rules[0].clone();
    from_file.line = 0;
    assert_eq!(rule, from_file);
    assert_eq!(rule.burst, Some(100));

    let allow = rule_from_json(
        &json!({"name": "office", "source": ["198.51.100.7", "2001:db8::/32"], "action": "allow"}),
    )
    .unwrap();
    assert_eq!(allow.action, Action::Allow);
    assert_eq!(allow.sources.len(), 2);
    let twice = rule_from_json(
        &json!({"name": "t", "source": ["10.0.0.0/8", "10.0.0.0/8"], "action": "deny"}),
    )
    .unwrap();
    assert_eq!(twice.sources.len(), 1);
    assert_eq!(allow.sources[0].to_string(), "198.51.100.7/32");
    // Its JSON form parses back as the same rule.
    assert_eq!(
        rule_from_json(&serde_json::to_value(&allow).unwrap()).unwrap(),
        allow
    );
    assert_eq!(
        rule_from_json(&serde_json::to_value(&rule).unwrap()).unwrap(),
        rule
    );
}

/// One parser for rules: a bad rule sent to the API gets the message the config file gets for
/// the same rule, after the file's name and line, naming the rule and the key at fault.
#[test]
fn a_bad_rule_gets_the_same_message_from_the_api_and_from_the_file() {
    let cases = [
        (
            json!({"name": "a", "source": "10.0.0.0/8", "rate": 5, "dst_port": 53}),
            "name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 5\ndst_port = 53",
            "rule \"a\": field `dst_port`: only valid with protocol tcp or udp",
        ),
        (
            json!({"name": "a", "source": "10.0.0.300/8", "rate": 5}),
            "name = \"a\"\nsource = \"10.0.0.300/8\"\nrate = 5",
            "rule \"a\": field `source`: \"10.0.0.300/8\" is not an IPv4 or IPv6 CIDR",
        ),
        (
            json!({"name": "a", "source": ["10.0.0.0/8", "10.0.0.1/8"], "rate": 5}),
            "name = \"a\"\nsource = [\"10.0.0.0/8\", \"10.0.0.1/8\"]\nrate = 5",
            "rule \"a\": field `source`: 10.0.0.1/8 has host bits set",
        ),
        (
            json!({"name": "a", "source": "10.0.0.0/8"}),
            "name = \"a\"\nsource = \"10.0.0.0/8\"",
            "rule \"a\": field `rate`: a limit rule needs",
        ),
        (
            json!({"name": "a", "source": "10.0.0.0/8", "rate": -1}),
            "name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = -1",
            "rule \"a\": field `rate`: must not be negative (got -1)",
        ),
        (
            json!({"name": "a", "source": "10.0.0.0/8", "rate": "fast"}),
            "name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = \"fast\"",
            "rule \"a\": field `rate`: invalid type",
        ),
        (
            json!({"name": "a", "source": "10.0.0.0/8", "rate": 5, "protocol": "sctp"}),
            "name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 5\nprotocol = \"sctp\"",
            "rule \"a\": field `protocol`: unknown variant `sctp`",
        ),
        (
            json!({"name": "a", "source": "10.0.0.0/8", "rate": 5, "per": "/33"}),
            "name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 5\nper = \"/33\"",
            "rule \"a\": field `per`: /33 is longer than an IPv4 address",
        ),
        (
            json!({"name": "a", "source": "10.0.0.0/8", "action": "deny", "per": "source"}),
            "name = \"a\"\nsource = \"10.0.0.0/8\"\naction = \"deny\"\nper = \"source\"",
            "rule \"a\": field `per`: has no meaning for a deny rule",
        ),
        (
            json!({"name": "a", "source": "10.0.0.0/8", "rate": 5, "protocol": "udp", "dst_port": 70000}),
            "name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 5\nprotocol = \"udp\"\ndst_port = 70000",
            "rule \"a\": field `dst_port`: must be between 1 and 65535 (got 70000)",
        ),
        (
            json!({"name": "a", "source": "10.0.0.0/8", "rate": 5, "colour": "red"}),
            "name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 5\ncolour = \"red\"",
            "rule \"a\": field `colour`: unknown field `colour`",
        ),
        (
            json!({"name": "a b", "source": "10.0.0.0/8", "rate": 5}),
            "name = \"a b\"\nsource = \"10.0.0.0/8\"\nrate = 5",
            "rule \"a b\": field `name`: \"a b\" contains ' '",
        ),
        (
            json!({"source": "10.0.0.0/8"}),
            "source = \"10.0.0.0/8\"",
            "rule #1: field `name`: required, but missing",
        ),
        (
            json!({"name": "a", "rate": 5}),
            "name = \"a\"\nrate = 5",
            "rule \"a\": field `source`: required",
        ),
        (
            json!({"name": "w", "source": "0.0.0.0/0", "rate": 1, "limit": [{"rate": 5}]}),
            "name = \"w\"\nsource = \"0.0.0.0/0\"\nrate = 1\n[[rule.limit]]\nrate = 5",
            "rule \"w\" limit 2 ([[rule.limit]] #1): field `per`: required",
        ),
        (
            json!({"name": "w", "source": "0.0.0.0/0", "rate": 1, "bytes_rate": 5,
                   "bytes_burst": 10_000_000_000_000_u64}),
            "name = \"w\"\nsource = \"0.0.0.0/0\"\nrate = 1\nbytes_rate = 5\nbytes_burst = 10000000000000",
            "rule \"w\": field `bytes_burst`: ",
        ),
    ];
    for (body, toml, want) in cases {
        let api = err(body.clone());
        let file = Config::parse(&format!("[[rule]]\n{toml}\n"), "rules.toml")
            .expect_err("the file refuses it too")
            .without_place();
        assert_eq!(
            api, file,
            "{body}: the API and the file say different things"
        );
        assert!(
            api.starts_with(want),
            "{body}: got {api:?}, want {want:?}..."
        );
    }
    // What only the API refuses: list files (no file to resolve them against), numbers TOML
    // cannot hold, a body that is not an object.
    for (body, want) in [
        (
            json!({"name": "a", "source_file": "/etc/x"}),
            "rule \"a\": field `source_file`: list files can only be named in the config file",
        ),
        (
            json!({"name": "a", "source": "10.0.0.0/8", "rate": u64::MAX}),
            "field `rate`: 18446744073709551615 is out of range",
        ),
        (json!(["a"]), "a rule must be a JSON object"),
    ] {
        let got = err(body.clone());
        assert!(
            got.starts_with(want),
            "{body}: got {got:?}, want {want:?}..."
        );
    }
}

#[test]
fn explain_args_parse() {
    let ip4: IpAddr = "198.18.0.1".parse().unwrap();
    assert_eq!(
        explain_args(Some("198.18.0.1"), None, None),
        Ok((ip4, 0, None))
    );
    assert_eq!(
        explain_args(Some("198.18.0.1"), Some("udp"), Some("53")),
        Ok((ip4, 17, Some(53)))
    );
    assert_eq!(
        explain_args(Some("198.18.0.1"), Some("icmp"), None),
        Ok((ip4, 1, None))
    );
    assert_eq!(
        explain_args(Some("2001:db8::1"), Some("icmp"), None)
            .unwrap()
            .1,
        58
    );
    assert_eq!(
        explain_args(Some("198.18.0.1"), Some("47"), None)
            .unwrap()
            .1,
        47
    );
    assert!(explain_args(None, None, None)
        .unwrap_err()
        .starts_with("ip: missing"));
    assert!(explain_args(Some("x"), None, None)
        .unwrap_err()
        .starts_with("ip: \"x\" is not"));
    assert!(explain_args(Some("198.18.0.1"), Some("sctp"), None)
        .unwrap_err()
        .starts_with("protocol: unknown protocol"));
    assert!(explain_args(Some("198.18.0.1"), None, Some("53"))
        .unwrap_err()
        .starts_with("dst_port: only"));
    assert!(explain_args(Some("198.18.0.1"), Some("udp"), Some("0"))
        .unwrap_err()
        .starts_with("dst_port: \"0\""));
}

#[test]
fn top_ranks_buckets_by_use_over_the_interval() {
    let config = Config::parse(
        "[[rule]]\nname = \"nets\"\nsource = \"198.18.0.0/15\"\nrate = 1000\nper = \"/24\"\n\
         [[rule]]\nname = \"hosts\"\nsource = \"2001:db8::/32\"\nrate = 10\n",
        "test",
    )
    .unwrap();
    let set = compile(&config.rules, &RuleIds::new()).unwrap();
    let nets = set.by_name("nets").unwrap();
    let hosts = set.by_name("hosts").unwrap();
    let key =
        |r: &crate::compile::CompiledRule, ip: &str| bucket_key(r.id, &r.rule, ip.parse().unwrap());
    let b = |k: ratelimit_common::BucketKey, passed, dropped, created_ns| Bucket {
        addr: k.addr,
        rule: u16::try_from(k.rule).unwrap(),
        family: k.family,
        passed_pkts: passed,
        dropped_pkts: dropped,
        created_share: Bucket::created_at(created_ns),
        ..Bucket::default()
    };
    let (t0, t1) = (10_000_000_000, 12_000_000_000); // two seconds apart
    let mut first = TopBaseline::default();
    first.push(3, &b(key(nets, "198.18.1.7"), 100, 0, 1));
    first.push(5, &b(key(hosts, "2001:db8::5"), 50, 10, 1));
    first.push(8, &b(key(nets, "198.18.9.1"), 10, 0, 1));
    first.push(9, &b(key(hosts, "2001:db8::6"), 40, 0, 1));
    let second = vec![
        (3, b(key(nets, "198.18.1.9"), 2100, 20_000, 1)), // same /24 bucket as .7
        (5, b(key(hosts, "2001:db8::5"), 70, 30, 1)),
        (8, b(key(nets, "198.18.9.1"), 10, 0, 1)), // idle: left out
        (2, b(key(nets, "198.18.2.1"), 4, 0, t0 + 1)), // new since the first read
        // Record 9 taken by a new bucket since (another life): counts from 0.
        (9, b(key(hosts, "2001:db8::6"), 9, 0, t0 + 2)),
    ];
    let (active, top) = top_entries(&first, t0, &second, t1, &set, 10);
    assert_eq!(active, 4);
    let got: Vec<(&str, &str, f64, f64)> = top
        .iter()
        .map(|e| (e.rule.as_str(), e.source.as_str(), e.pps, e.drops_per_sec))
        .collect();
    assert_eq!(
        got,
        [
            ("nets", "198.18.1.0/24", 1000.0, 10_000.0),
            ("hosts", "2001:db8::5/128", 10.0, 10.0),
            ("hosts", "2001:db8::6/128", 4.5, 0.0),
            ("nets", "198.18.2.0/24", 2.0, 0.0),
        ]
    );
    assert_eq!((top[0].passed, top[0].dropped), (2100, 20_000));
    assert!(top[0].tokens.is_some() && top[0].byte_tokens.is_none());
    // Only the busiest n are rendered, still busiest first; the count covers all.
    let (active, top2) = top_entries(&first, t0, &second, t1, &set, 2);
    assert_eq!(active, 4);
    assert_eq!(
        top2.iter().map(|e| e.source.as_str()).collect::<Vec<_>>(),
        ["198.18.1.0/24", "2001:db8::5/128"]
    );
}

/// A bucket emptied by a packet admitted after the walk began (its TAT that packet's time plus
/// the tolerance: no token left, no debt) shows no fewer than 0 tokens: they are computed as of
/// when it is offered, after it was read, not as of the walk's start (which showed -5 or less
/// here).
#[test]
fn top_shows_a_bucket_emptied_during_the_walk_with_no_debt() {
    let config = Config::parse(
        "[[rule]]\nname = \"flood\"\nsource = \"198.18.0.0/24\"\nrate = 1000\nburst = 10\n",
        "test",
    )
    .unwrap();
    let set = compile(&config.rules, &RuleIds::new()).unwrap();
    let r = set.by_name("flood").unwrap();
    let k = bucket_key(r.id, &r.rule, "198.18.0.1".parse().unwrap());
    let t0 = crate::maps::bucket::monotonic_ns();
    let t1 = t0;
    std::thread::sleep(std::time::Duration::from_millis(5));
    let packet = crate::maps::bucket::monotonic_ns();
    let b = Bucket {
        addr: k.addr,
        rule: u16::try_from(k.rule).unwrap(),
        family: k.family,
        passed_pkts: 10,
        created_share: Bucket::created_at(t0),
        tat_ns: packet + r.rule.pkt_tolerance_ns,
        ..Bucket::default()
    };
    let mut ranker = TopRanker::new(1);
    ranker.offer(&TopBaseline::default(), t0, 0, &b, t1, &set);
    let (_, _, top) = ranker.finish(&set);
    let since = crate::maps::bucket::monotonic_ns() - packet;
    let tokens = top[0].tokens.unwrap();
    #[expect(clippy::cast_precision_loss, reason = "a few ms")]
    let refilled = since as f64 / 1e6;
    assert!(
        (0.0..=refilled).contains(&tokens),
        "tokens {tokens} (refilled at most {refilled} since the packet)"
    );
}

#[test]
fn rule_from_json_takes_tcp_flags() {
    let rule = rule_from_json(&json!({
        "name": "syn", "source": "0.0.0.0/0", "rate": 10, "protocol": "tcp", "tcp_flags": "syn",
    }))
    .unwrap();
    assert_eq!(rule.tcp_flags, Some(crate::config::TcpFlags::Syn));
    let e = err(json!({"name": "syn", "source": "0.0.0.0/0", "rate": 10, "tcp_flags": "syn"}));
    assert!(
        e.contains("tcp_flags") && e.contains("only valid with protocol tcp"),
        "{e}"
    );
    let e = err(json!({
        "name": "syn", "source": "0.0.0.0/0", "rate": 10, "protocol": "tcp", "tcp_flags": "fin",
    }));
    assert!(e.contains("tcp_flags") && e.contains("syn"), "{e}");
}

#[test]
fn explain_tcp_flags_parse() {
    assert_eq!(explain_tcp_flags("syn", 6), Ok(0x02));
    assert_eq!(explain_tcp_flags("syn,ack", 6), Ok(0x12));
    assert_eq!(explain_tcp_flags("ACK+PSH", 6), Ok(0x18));
    assert_eq!(explain_tcp_flags("none", 6), Ok(0));
    assert_eq!(explain_tcp_flags("0x12", 6), Ok(0x12));
    assert_eq!(explain_tcp_flags("2", 6), Ok(0x02));
    assert!(explain_tcp_flags("syn", 17)
        .unwrap_err()
        .contains("only meaningful with protocol tcp"));
    assert!(explain_tcp_flags("syn,bogus", 6)
        .unwrap_err()
        .contains("unknown flag \"bogus\""));
}

#[test]
fn rule_from_json_takes_limits_and_names_the_one_at_fault() {
    let rule = rule_from_json(&json!({
        "name": "web", "source": "0.0.0.0/0", "rate": 1000,
        "limit": [{"per": "/24", "rate": 3000}, {"per": "rule", "bytes_rate": 1_000_000}],
    }))
    .unwrap();
    assert_eq!(rule.limits.len(), 2);
    assert_eq!(rule.limits[0].per, crate::config::Per::Prefix(24));
    assert_eq!(rule.limits[0].burst, Some(3000));
    assert_eq!(rule.limits[1].bytes_burst, Some(1_000_000));
    // What the API answers with parses back as the same rule.
    assert_eq!(
        rule_from_json(&serde_json::to_value(&rule).unwrap()).unwrap(),
        rule
    );
    let e = err(json!({"name": "w", "source": "0.0.0.0/0", "rate": 1, "limit": [{"rate": 5}]}));
    assert!(
        e.contains("limit 2") && e.contains("`per`: required"),
        "{e}"
    );
    let e = err(json!({"name": "w", "source": "0.0.0.0/0", "rate": 1,
        "limit": [{"per": "rule", "rate": 0}]}));
    assert!(e.contains("limit 2") && e.contains("`rate`"), "{e}");
    let e = err(json!({"name": "w", "source": "0.0.0.0/0", "rate": 1,
        "limit": [{"per": "rule", "rate": 5, "protocol": "tcp"}]}));
    assert!(e.contains("unknown field `protocol`"), "{e}");
    let four = json!({"per": "rule", "rate": 5});
    let e = err(json!({"name": "w", "source": "0.0.0.0/0", "rate": 1,
        "limit": [four, four, four, four]}));
    assert!(
        e.contains("too many limits: a rule may have at most 4"),
        "{e}"
    );
    let e = err(json!({"name": "w", "source": "0.0.0.0/0", "action": "deny",
        "limit": [{"per": "rule", "rate": 5}]}));
    assert!(e.contains("limit") && e.contains("no meaning"), "{e}");
}
