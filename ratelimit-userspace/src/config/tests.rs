use std::path::{Path, PathBuf};

use ipnet::IpNet;
use serde::Serialize;

use super::*;

const ORIGIN: &str = "/etc/ratelimit/ratelimit.toml";

fn parse(text: &str) -> Config {
    Config::parse(text, ORIGIN).unwrap_or_else(|e| panic!("unexpected error: {e}"))
}

/// Parses `text`, expects an error, and checks that its message has `file:line` and `field`.
#[track_caller]
fn assert_error(text: &str, line: usize, field: &str, contains: &str) -> ConfigError {
    let err = Config::parse(text, ORIGIN).expect_err("config should be rejected");
    let msg = err.to_string();
    let at = format!("{ORIGIN}:{line}:");
    assert!(msg.starts_with(&at), "{msg:?} does not start with {at:?}");
    if !field.is_empty() {
        let f = format!("field `{field}`");
        assert!(msg.contains(&f), "{msg:?} does not name {f}");
    }
    assert!(
        msg.contains(contains),
        "{msg:?} does not contain {contains:?}"
    );
    assert_eq!(err.line(), Some(line));
    err
}

fn rule(body: &str) -> String {
    format!("[agent]\ninterfaces = [\"eth0\"]\n\n[[rule]]\n{body}\n")
}
/// Line of the first body line in `rule(body)`.
const BODY: usize = 5;

const EXAMPLE: &str = r#"
[agent]
interfaces = ["eth0"]            # where XDP attaches
mode = "auto"                    # auto (native, else generic) | native | skb
socket = "/run/ratelimit/agent.sock"
metrics = "127.0.0.1:9477"       # optional Prometheus endpoint
max_buckets = 1048576            # tracked sources (bucket store capacity)

[[rule]]
name = "default"
source = "0.0.0.0/0"             # IPv4 or IPv6 CIDR; longest prefix wins
rate = 1000                      # packets per second
burst = 2000                     # packets
per = "source"                   # source | "/24" (group by prefix length) | rule (one shared bucket)

[[rule]]
name = "dns"
source = "::/0"
protocol = "udp"                 # tcp | udp | icmp | any (default)
dst_port = 53
rate = 100
burst = 100
bytes_rate = 1000000             # optional bytes/s limit, on top of or instead of packets/s
scope = "cluster"                # local (default) | cluster: one budget shared by all peers

[[rule]]
name = "office"
source = "198.51.100.0/24"
action = "allow"                 # limit (default) | allow | deny

[cluster]                        # optional
listen = "0.0.0.0:7946"
seeds = ["192.0.2.10:7946"]
key_file = "/etc/ratelimit/cluster.key"
sync_interval_ms = 100
"#;

const CLUSTER: &str = "[cluster]\nlisten = \"0.0.0.0:7946\"\nkey_file = \"/k\"\n";

#[test]
fn design_example_parses() {
    let c = parse(EXAMPLE);
    assert_eq!(c.agent.interfaces, ["eth0"]);
    assert_eq!(c.agent.mode, AttachMode::Auto);
    assert_eq!(c.agent.metrics, Some("127.0.0.1:9477".parse().unwrap()));
    assert_eq!(c.agent.max_buckets, 1_048_576);
    assert_eq!(c.rules.len(), 3);

    let d = &c.rules[0];
    assert_eq!((d.name.as_str(), d.line), ("default", 9));
    assert_eq!(d.sources, ["0.0.0.0/0".parse::<IpNet>().unwrap()]);
    assert_eq!(
        (d.rate, d.burst, d.per),
        (Some(1000), Some(2000), Per::Source)
    );

    let dns = &c.rules[1];
    assert_eq!(dns.line, 16);
    assert_eq!(
        (dns.protocol, dns.dst_port, dns.scope),
        (Protocol::Udp, Some(53), Scope::Cluster)
    );
    assert_eq!(
        (dns.bytes_rate, dns.bytes_burst),
        (Some(1_000_000), Some(1_000_000))
    );

    let office = &c.rules[2];
    assert_eq!(office.action, Action::Allow);
    assert_eq!(
        (office.rate, office.burst, office.bytes_rate),
        (None, None, None)
    );

    let cl = c.cluster.unwrap();
    assert_eq!(cl.listen, Some("0.0.0.0:7946".parse().unwrap()));
    assert_eq!(cl.seeds, ["192.0.2.10:7946".parse().unwrap()]);
    assert_eq!(
        cl.key_file,
        Some(PathBuf::from("/etc/ratelimit/cluster.key"))
    );
    assert_eq!(
        (cl.sync_interval_ms, cl.cluster_id.as_str()),
        (100, "ratelimit")
    );
}

#[test]
fn empty_file_is_all_defaults() {
    for text in ["", "# nothing\n", "[agent]\n"] {
        let c = parse(text);
        assert_eq!(c.agent, AgentConfig::default());
        assert!(c.rules.is_empty());
        assert!(c.cluster.is_none());
    }
    let a = AgentConfig::default();
    assert_eq!(a.socket, PathBuf::from("/run/ratelimit/agent.sock"));
    assert_eq!(a.pin_path, PathBuf::from("/sys/fs/bpf/ratelimit"));
    assert_eq!(a.max_buckets, ratelimit_common::DEFAULT_MAX_BUCKETS);
    assert!(!a.dry_run && !a.ebpf_log && a.metrics.is_none() && a.interfaces.is_empty());
    assert!(a.learn, "the agent learns unless told not to");
}

#[test]
fn agent_keys() {
    let c = parse(
        "[agent]\ninterfaces = [\"eth0\", \"veth-a.10\"]\nmode = \"skb\"\nsocket = \"/tmp/x.sock\"\n\
         max_buckets = 16\npin_path = \"/sys/fs/bpf/rl2\"\ndry_run = true\nebpf_log = true\n\
         learn = false\n",
    );
    assert!(!c.agent.learn);
    assert_eq!(c.agent.interfaces, ["eth0", "veth-a.10"]);
    assert_eq!(c.agent.mode, AttachMode::Skb);
    assert_eq!(c.agent.socket, PathBuf::from("/tmp/x.sock"));
    assert_eq!(c.agent.max_buckets, 16);
    assert_eq!(c.agent.pin_path, PathBuf::from("/sys/fs/bpf/rl2"));
    assert!(c.agent.dry_run && c.agent.ebpf_log);
    assert_eq!(
        parse("[agent]\nmode = \"native\"\n").agent.mode,
        AttachMode::Native
    );
}

#[test]
fn rule_defaults() {
    let c = parse(&rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 50"));
    let r = &c.rules[0];
    assert_eq!(r.line, 4);
    assert_eq!(
        (r.action, r.rate, r.burst),
        (Action::Limit, Some(50), Some(50))
    );
    assert_eq!((r.bytes_rate, r.bytes_burst), (None, None));
    assert_eq!(
        (r.per, r.protocol, r.dst_port, r.scope, r.dry_run),
        (Per::Source, Protocol::Any, None, Scope::Local, false)
    );

    // bytes_burst defaults to max(bytes_rate, 65536)...
    let r = &parse(&rule(
        "name = \"a\"\nsource = \"10.0.0.0/8\"\nbytes_rate = 1000",
    ))
    .rules[0];
    assert_eq!(
        (r.rate, r.burst, r.bytes_rate, r.bytes_burst),
        (None, None, Some(1000), Some(65_536))
    );
    let r = &parse(&rule(
        "name = \"a\"\nsource = \"10.0.0.0/8\"\nbytes_rate = 100000",
    ))
    .rules[0];
    assert_eq!(r.bytes_burst, Some(100_000));
    // ...capped at one hour's worth, so a tiny rate does not make the default invalid.
    let r = &parse(&rule(
        "name = \"a\"\nsource = \"10.0.0.0/8\"\nbytes_rate = 10",
    ))
    .rules[0];
    assert_eq!(r.bytes_burst, Some(36_000));
}

#[test]
fn bare_address_is_a_host_prefix() {
    let c = parse(&rule("name = \"a\"\nsource = \"192.0.2.7\"\nrate = 1\n[[rule]]\nname = \"b\"\nsource = \"2001:db8::1\"\nrate = 1"));
    assert_eq!(
        c.rules[0].source(),
        Some("192.0.2.7/32".parse::<IpNet>().unwrap())
    );
    assert_eq!(
        c.rules[1].source(),
        Some("2001:db8::1/128".parse::<IpNet>().unwrap())
    );
}

#[test]
fn per_values() {
    let per = |src: &str, per: &str| {
        parse(&rule(&format!(
            "name = \"a\"\nsource = \"{src}\"\nrate = 5\nper = \"{per}\""
        )))
        .rules[0]
            .per
    };
    assert_eq!(per("10.0.0.0/8", "rule"), Per::Rule);
    assert_eq!(per("10.0.0.0/8", "/24"), Per::Prefix(24));
    assert_eq!(per("10.0.0.0/8", "/0"), Per::Prefix(0));
    assert_eq!(per("10.0.0.0/8", "/32"), Per::Prefix(32));
    assert_eq!(per("2001:db8::/32", "/64"), Per::Prefix(64));
    assert_eq!(per("::/0", "/128"), Per::Prefix(128));
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 5\nper = \"/33\""),
        BODY + 3,
        "per",
        "IPv4",
    );
    assert_error(
        &rule("name = \"a\"\nsource = \"::/0\"\nrate = 5\nper = \"/129\""),
        BODY + 3,
        "per",
        "0..=128",
    );
    for bad in ["/", "/x", "24", "/+24", "/ 24", "sources", "/1000"] {
        assert_error(
            &rule(&format!(
                "name = \"a\"\nsource = \"::/0\"\nrate = 5\nper = \"{bad}\""
            )),
            BODY + 3,
            "per",
            "",
        );
    }
}

#[test]
fn all_rule_keys() {
    let c = parse(&rule(
        "name = \"web\"\nsource = \"2001:db8::/32\"\naction = \"limit\"\nrate = 10\nburst = 20\nbytes_rate = 3000\n\
         bytes_burst = 1514\nper = \"/64\"\nprotocol = \"tcp\"\ndst_port = 443\nscope = \"cluster\"\ndry_run = true\n\
         [cluster]\nlisten = \"0.0.0.0:7946\"\nkey_file = \"/k\"",
    ));
    let r = &c.rules[0];
    assert_eq!(
        (r.rate, r.burst, r.bytes_rate, r.bytes_burst),
        (Some(10), Some(20), Some(3000), Some(1514))
    );
    assert_eq!(
        (r.per, r.protocol, r.dst_port, r.scope, r.dry_run),
        (
            Per::Prefix(64),
            Protocol::Tcp,
            Some(443),
            Scope::Cluster,
            true
        )
    );
    let r = &parse(&rule("name = \"d\"\nsource = \"10.0.0.0/8\"\naction = \"deny\"\nprotocol = \"icmp\"\ndry_run = true")).rules[0];
    assert_eq!(
        (r.action, r.protocol, r.dry_run),
        (Action::Deny, Protocol::Icmp, true)
    );
}

#[test]
fn unknown_keys_are_named() {
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nrtae = 5"),
        BODY + 2,
        "rtae",
        "unknown field",
    );
    assert_error(
        "[agent]\ninterface = [\"eth0\"]\n",
        2,
        "interface",
        "unknown field",
    );
    assert_error("\n[agnet]\nmode = \"auto\"\n", 2, "agnet", "unknown field");
    assert_error(
        "[cluster]\nlisten = \"0.0.0.0:1\"\nkey_file = \"/k\"\npeers = []\n",
        4,
        "peers",
        "unknown field",
    );
    // The rule is named in the message when it has a name.
    let e = assert_error(
        &rule("name = \"dns\"\nsource = \"10.0.0.0/8\"\nrate = 1\nport = 53"),
        BODY + 3,
        "port",
        "rule \"dns\"",
    );
    assert!(matches!(e, ConfigError::Schema { .. }));
}

#[test]
fn type_errors_are_named() {
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = \"fast\""),
        BODY + 2,
        "rate",
        "invalid type",
    );
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 1.5"),
        BODY + 2,
        "rate",
        "invalid type",
    );
    assert_error(
        &rule("name = \"a\"\nsource = 10\nrate = 1"),
        BODY + 1,
        "source",
        "invalid type",
    );
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 1\ndry_run = \"yes\""),
        BODY + 3,
        "dry_run",
        "invalid type",
    );
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 1\nprotocol = \"sctp\""),
        BODY + 3,
        "protocol",
        "unknown variant",
    );
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\naction = \"drop\""),
        BODY + 2,
        "action",
        "unknown variant",
    );
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 1\nscope = \"global\""),
        BODY + 3,
        "scope",
        "unknown variant",
    );
    assert_error("[agent]\nmode = \"fast\"\n", 2, "mode", "unknown variant");
    assert_error(
        "[agent]\nmetrics = \"localhost\"\n",
        2,
        "metrics",
        "socket address",
    );
    assert_error("[agent]\ndry_run = 1\n", 2, "dry_run", "invalid type");
    assert_error(
        "[agent]\ninterfaces = \"eth0\"\n",
        2,
        "interfaces",
        "invalid type",
    );
    assert_error(
        "[agent]\ninterfaces = [\n  \"eth0\",\n  7,\n]\n",
        4,
        "interfaces",
        "invalid type",
    );
    assert_error("rule = 5\n", 1, "rule", "invalid type");
    assert_error(
        "[cluster]\nlisten = \"nowhere\"\nkey_file = \"/k\"\n",
        2,
        "listen",
        "socket address",
    );
    assert_error(
        "[cluster]\nlisten = \"0.0.0.0:1\"\nkey_file = \"/k\"\nseeds = [\"1.2.3.4\"]\n",
        4,
        "seeds",
        "socket address",
    );
}

#[test]
fn missing_required_keys() {
    let text = "[[rule]]\nname = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 1\n\n[[rule]]\nsource = \"10.0.0.0/8\"\nrate = 1\n";
    assert_error(text, 6, "name", "rule #2");
    assert_error(&rule("name = \"a\"\nrate = 1"), 4, "source", "missing");
    assert_error(
        "[cluster]\nlisten = \"0.0.0.0:1\"\n",
        1,
        "key_file",
        "missing",
    );
    assert_error("[cluster]\nkey_file = \"/k\"\n", 1, "listen", "missing");
}

#[test]
fn syntax_errors_have_line_and_column() {
    let e = assert_error("[agent]\nmode = \"auto\n", 2, "mode", "TOML syntax error");
    assert!(
        matches!(e, ConfigError::Syntax { column, .. } if column > 1),
        "{e:?}"
    );
    assert_error(
        "[[rule]]\nname = \"a\"\nname = \"b\"\n",
        3,
        "",
        "duplicate key",
    );
    assert_error("[agent\n", 1, "", "TOML syntax error");
}

#[test]
fn source_errors() {
    let e = assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.1/8\"\nrate = 1"),
        BODY + 1,
        "source",
        "\"10.0.0.0/8\"",
    );
    assert!(e.to_string().contains("host bits"), "{e}");
    assert_error(
        &rule("name = \"a\"\nsource = \"2001:db8::1/32\"\nrate = 1"),
        BODY + 1,
        "source",
        "\"2001:db8::/32\"",
    );
    for bad in ["10.0.0.0/33", "10.0.0/8", "example.com", "", "::/129"] {
        assert_error(
            &rule(&format!("name = \"a\"\nsource = \"{bad}\"\nrate = 1")),
            BODY + 1,
            "source",
            "CIDR",
        );
    }
    assert_error(
        &rule("name = \"a\"\nsource = \"::ffff:10.0.0.0/104\"\nrate = 1"),
        BODY + 1,
        "source",
        "\"10.0.0.0/8\"",
    );
}

#[test]
fn name_errors() {
    assert_error(
        &rule("name = \"\"\nsource = \"10.0.0.0/8\"\nrate = 1"),
        BODY,
        "name",
        "empty",
    );
    assert_error(
        &rule("name = \"a b\"\nsource = \"10.0.0.0/8\"\nrate = 1"),
        BODY,
        "name",
        "' '",
    );
    assert_error(
        &rule(&format!(
            "name = \"{}\"\nsource = \"10.0.0.0/8\"\nrate = 1",
            "x".repeat(65)
        )),
        BODY,
        "name",
        "64",
    );
    let text = "[[rule]]\nname = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 1\n\n[[rule]]\nname = \"a\"\nsource = \"11.0.0.0/8\"\nrate = 1\n";
    assert_error(text, 7, "name", "line 1");
}

#[test]
fn conflicting_rules() {
    let text = "[[rule]]\nname = \"a\"\nsource = \"10.0.0.0/8\"\nprotocol = \"udp\"\ndst_port = 53\nrate = 1\n\n\
                [[rule]]\nname = \"b\"\nsource = \"10.0.0.0/8\"\nprotocol = \"udp\"\ndst_port = 53\naction = \"deny\"\n";
    let e = assert_error(text, 10, "source", "rule \"a\" (line 1)");
    assert!(e.to_string().contains("rule \"b\""), "{e}");
    // Same source, different port or protocol: fine.
    let ok = text.replace("dst_port = 53\naction", "dst_port = 54\naction");
    assert_eq!(parse(&ok).rules.len(), 2);
}

#[test]
fn dst_port_errors() {
    assert_error(
        &rule("name = \"dns\"\nsource = \"10.0.0.0/8\"\nrate = 1\ndst_port = 53"),
        BODY + 3,
        "dst_port",
        "only valid with protocol tcp or udp",
    );
    assert_error(
        &rule(
            "name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 1\nprotocol = \"icmp\"\ndst_port = 53",
        ),
        BODY + 4,
        "dst_port",
        "tcp or udp",
    );
    for bad in ["0", "65536", "-1"] {
        assert_error(&rule(&format!("name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 1\nprotocol = \"tcp\"\ndst_port = {bad}")), BODY + 4, "dst_port", "65535");
    }
    let msg = Config::parse(
        &rule("name = \"dns\"\nsource = \"10.0.0.0/8\"\nrate = 1\ndst_port = 53"),
        ORIGIN,
    )
    .unwrap_err()
    .to_string();
    assert!(
        msg.starts_with(&format!(
            "{ORIGIN}:8: rule \"dns\": field `dst_port`: only valid with protocol tcp or udp"
        )),
        "{msg}"
    );
}

#[test]
fn limit_errors() {
    // A limit rule without any limit is reported at the rule's table.
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\""),
        4,
        "rate",
        "needs",
    );
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 0"),
        BODY + 2,
        "rate",
        "between 1 and 1000000000",
    );
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = -5"),
        BODY + 2,
        "rate",
        "negative",
    );
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 1000000001"),
        BODY + 2,
        "rate",
        "1000000000",
    );
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 5\nburst = 0"),
        BODY + 3,
        "burst",
        "at least 1",
    );
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 1\nburst = 3601"),
        BODY + 3,
        "burst",
        "one hour",
    );
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 1\nburst = 9223372036854775807"),
        BODY + 3,
        "burst",
        "one hour",
    );
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nbytes_rate = 1000\nburst = 5"),
        BODY + 3,
        "burst",
        "`rate` is not",
    );
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 1\nbytes_burst = 5000"),
        BODY + 3,
        "bytes_burst",
        "`bytes_rate` is not",
    );
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nbytes_rate = 0"),
        BODY + 2,
        "bytes_rate",
        "between 1",
    );
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nbytes_rate = 1000000000001"),
        BODY + 2,
        "bytes_rate",
        "1000000000000",
    );
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nbytes_rate = 1000\nbytes_burst = 1513"),
        BODY + 3,
        "bytes_burst",
        "1514",
    );
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nbytes_rate = 1\nbytes_burst = 3601"),
        BODY + 3,
        "bytes_burst",
        "one hour",
    );
    // Right at the bounds is fine.
    parse(&rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 1000000000\nburst = 3600000000000\nbytes_rate = 1000000000000\nbytes_burst = 1514"));
    parse(&rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 1\nburst = 3600\nbytes_rate = 1\nbytes_burst = 3600"));
}

#[test]
fn allow_and_deny_take_no_limits() {
    for (key, value) in [
        ("rate", "1"),
        ("burst", "1"),
        ("bytes_rate", "1"),
        ("bytes_burst", "2000"),
        ("per", "\"source\""),
        ("scope", "\"local\""),
    ] {
        for action in ["allow", "deny"] {
            let text = rule(&format!(
                "name = \"a\"\nsource = \"10.0.0.0/8\"\naction = \"{action}\"\n{key} = {value}"
            ));
            assert_error(
                &text,
                BODY + 3,
                key,
                &format!(
                    "no meaning for {} {action} rule",
                    if action == "allow" { "an" } else { "a" }
                ),
            );
        }
    }
}

#[test]
fn agent_errors() {
    assert_error(
        "[agent]\ninterfaces = [\"eth0\", \"eth0/1\"]\n",
        2,
        "interfaces",
        "eth0/1",
    );
    assert_error(
        "[agent]\ninterfaces = [\n  \"eth0\",\n  \"a-very-long-name0\",\n]\n",
        4,
        "interfaces",
        "15 bytes",
    );
    for bad in ["", ".", "..", "eth 0", "eth0:1"] {
        assert_error(
            &format!("[agent]\ninterfaces = [\"{bad}\"]\n"),
            2,
            "interfaces",
            "interface name",
        );
    }
    assert_error(
        "[agent]\ninterfaces = [\"eth0\", \"eth0\"]\n",
        2,
        "interfaces",
        "twice",
    );
    assert_error(
        "[agent]\nmax_buckets = 8\n",
        2,
        "max_buckets",
        "between 16 and 67108864",
    );
    assert_error(
        "[agent]\nmax_buckets = 67108865\n",
        2,
        "max_buckets",
        "between",
    );
    assert_error("[agent]\nmax_buckets = -1\n", 2, "max_buckets", "between");
    assert_error(
        "[agent]\npin_path = \"bpf/ratelimit\"\n",
        2,
        "pin_path",
        "absolute",
    );
    assert_error("[agent]\nsocket = \"\"\n", 2, "socket", "empty");
}

#[test]
fn cluster_errors() {
    let base = "[cluster]\nlisten = \"0.0.0.0:7946\"\nkey_file = \"/k\"\n";
    assert_error(
        &format!("{base}sync_interval_ms = 5\n"),
        4,
        "sync_interval_ms",
        "between 10 and 10000",
    );
    assert_error(
        &format!("{base}sync_interval_ms = 10001\n"),
        4,
        "sync_interval_ms",
        "between 10 and 10000",
    );
    assert_error(
        &format!("{base}max_keys = 0\n"),
        4,
        "max_keys",
        "between 1 and 100000",
    );
    assert_error(
        &format!("{base}max_keys = 100001\n"),
        4,
        "max_keys",
        "between 1 and 100000",
    );
    assert_eq!(
        parse(&format!("{base}max_keys = 50\n"))
            .cluster
            .unwrap()
            .max_keys,
        50
    );
    assert_eq!(parse(base).cluster.unwrap().max_keys, 1000);
    assert_error(
        &format!("{base}on_partition = \"fail_closed\"\n"),
        4,
        "on_partition",
        "must be \"fail_open\" or \"share\" (got \"fail_closed\")",
    );
    assert_error(
        &format!("{base}on_partition = 1\n"),
        4,
        "on_partition",
        "string",
    );
    assert_error(
        &format!("{base}partition_memory_s = 0\n"),
        4,
        "partition_memory_s",
        "between 1 and 86400",
    );
    let c = parse(base).cluster.unwrap();
    assert_eq!(
        (c.on_partition, c.partition_memory_s),
        (OnPartition::FailOpen, 600)
    );
    let c = parse(&format!(
        "{base}on_partition = \"share\"\npartition_memory_s = 30\n"
    ))
    .cluster
    .unwrap();
    assert_eq!(
        (c.on_partition, c.partition_memory_s),
        (OnPartition::Share, 30)
    );
    assert_error(
        &format!("{base}cluster_id = \"\"\n"),
        4,
        "cluster_id",
        "empty",
    );
    assert_error(
        "[cluster]\nlisten = \"0.0.0.0:7946\"\nkey_file = \"\"\n",
        3,
        "key_file",
        "empty",
    );
    let c = parse(&format!(
        "{base}sync_interval_ms = 10\ncluster_id = \"prod-eu\"\n"
    ))
    .cluster
    .unwrap();
    assert_eq!(
        (c.sync_interval_ms, c.cluster_id.as_str(), c.seeds.len()),
        (10, "prod-eu", 0)
    );
}

#[test]
fn inline_rule_tables_are_located() {
    let text = "rule = [\n  { name = \"a\", source = \"10.0.0.0/8\", rate = 1 },\n  { name = \"b\", source = \"10.0.0.0/8\", rate = \"x\" },\n]\n";
    assert_error(text, 3, "rate", "rule \"b\"");
    let text = "rule = [\n  { name = \"a\", source = \"10.0.0.0/8\", rate = 1 },\n  { name = \"b\", source = \"10.0.0.0/8\" },\n]\n";
    assert_error(text, 3, "rate", "needs");
}

#[test]
fn load_errors_name_the_file() {
    let dir = std::env::temp_dir().join(format!("ratelimit-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    let missing = dir.join("missing.toml");
    let e = Config::load(&missing).unwrap_err();
    assert!(matches!(e, ConfigError::Read { .. }));
    assert!(
        e.to_string().starts_with(&missing.display().to_string()),
        "{e}"
    );

    let e = Config::load(&dir).unwrap_err();
    assert!(matches!(e, ConfigError::IsDirectory { .. }), "{e}");
    assert!(e.to_string().contains("is a directory"), "{e}");

    let latin1 = dir.join("latin1.toml");
    std::fs::write(&latin1, b"[agent]\n# caf\xe9\n").unwrap();
    let e = Config::load(&latin1).unwrap_err();
    assert!(
        e.to_string()
            .starts_with(&format!("{}:2: not valid UTF-8", latin1.display())),
        "{e}"
    );

    let good = dir.join("good.toml");
    std::fs::write(&good, EXAMPLE).unwrap();
    assert_eq!(Config::load(&good).unwrap().rules.len(), 3);

    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        rule("name = \"a\"\nsource = \"10.0.0.1/8\"\nrate = 1"),
    )
    .unwrap();
    let e = Config::load(&bad).unwrap_err();
    assert!(
        e.to_string()
            .starts_with(&format!("{}:6: rule \"a\": field `source`", bad.display())),
        "{e}"
    );

    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn rules_serialize_with_config_spellings() {
    let c = parse(EXAMPLE);
    let json = serde_json::to_value(&c.rules).unwrap();
    assert_eq!(
        json[1],
        serde_json::json!({
            "name": "dns", "source": "::/0", "action": "limit", "rate": 100, "burst": 100,
            "bytes_rate": 1000000, "bytes_burst": 1000000, "per": "source", "protocol": "udp",
            "dst_port": 53, "scope": "cluster", "dry_run": false
        })
    );
    // Allow rules leave out the keys they may not have.
    assert_eq!(
        json[2],
        serde_json::json!({
            "name": "office", "source": "198.51.100.0/24", "action": "allow", "protocol": "any", "dry_run": false
        })
    );
    let per24 = parse(&rule(
        "name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 1\nper = \"/24\"",
    ));
    assert_eq!(serde_json::to_value(&per24.rules[0]).unwrap()["per"], "/24");
}

#[test]
fn serialized_rules_parse_back() {
    #[derive(Serialize)]
    struct Doc<'a> {
        rule: &'a [RuleConfig],
    }
    let c = parse(EXAMPLE);
    let text = toml::to_string(&Doc { rule: &c.rules }).unwrap();
    let again = parse(&format!("{text}\n{CLUSTER}"));
    assert_eq!(again.rules.len(), c.rules.len());
    for (a, b) in again.rules.iter().zip(&c.rules) {
        assert_eq!(
            RuleConfig {
                line: 0,
                ..a.clone()
            },
            RuleConfig {
                line: 0,
                ..b.clone()
            }
        );
    }
}

#[test]
fn keyword_from_str() {
    assert_eq!("udp".parse::<Protocol>(), Ok(Protocol::Udp));
    assert_eq!("deny".parse::<Action>(), Ok(Action::Deny));
    assert_eq!("cluster".parse::<Scope>(), Ok(Scope::Cluster));
    assert_eq!("skb".parse::<AttachMode>(), Ok(AttachMode::Skb));
    assert!("UDP"
        .parse::<Protocol>()
        .unwrap_err()
        .contains("tcp udp icmp any"));
    assert_eq!("/24".parse::<Per>(), Ok(Per::Prefix(24)));
    assert_eq!(Per::Prefix(64).to_string(), "/64");
}

#[test]
fn validate_checks_programmatic_rules() {
    let mut r = RuleConfig::new("x", "10.0.0.0/8".parse().unwrap());
    assert_eq!(r.validate().unwrap_err().field, "rate");
    r.rate = Some(10);
    assert_eq!(r.validate().unwrap_err().field, "burst");
    r.burst = Some(10);
    r.validate().unwrap();
    r.per = Per::Prefix(40);
    assert_eq!(r.validate().unwrap_err().field, "per");
    r.per = Per::Rule;
    r.action = Action::Allow;
    assert_eq!(r.validate().unwrap_err().field, "rate");
}

/// A fresh scratch directory for one test.
fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ratelimit-config-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn nets(list: &[&str]) -> Vec<IpNet> {
    list.iter().map(|s| net(s)).collect()
}

#[test]
fn source_arrays() {
    let c = parse(&rule(
        "name = \"a\"\nsource = [\"10.0.0.0/8\", \"2001:db8::/32\", \"10.0.0.0/8\", \"192.0.2.7\"]\naction = \"deny\"",
    ));
    let r = &c.rules[0];
    // Duplicates merged, order kept, bare addresses are host prefixes.
    assert_eq!(
        r.sources,
        nets(&["10.0.0.0/8", "2001:db8::/32", "192.0.2.7/32"])
    );
    assert_eq!((r.source(), r.source_file.as_ref()), (None, None));
    assert_eq!(r.families(), (true, true));
    // A limit rule may mix families with per = "source" or "rule".
    for per in ["source", "rule"] {
        parse(&rule(&format!(
            "name = \"a\"\nsource = [\"10.0.0.0/8\", \"::/0\"]\nrate = 5\nper = \"{per}\""
        )));
    }

    // Errors point at the element's line.
    let multi_line = |bad: &str| {
        rule(&format!(
            "name = \"a\"\nsource = [\n  \"10.0.0.0/8\",\n  {bad},\n]\naction = \"deny\""
        ))
    };
    let e = assert_error(
        &multi_line("\"10.0.0.1/8\""),
        BODY + 3,
        "source",
        "host bits",
    );
    assert!(e.to_string().contains("\"10.0.0.0/8\""), "{e}");
    assert_error(&multi_line("\"10.0.0.300/8\""), BODY + 3, "source", "CIDR");
    assert_error(&multi_line("7"), BODY + 3, "source", "invalid type");
    assert_error(
        &rule("name = \"a\"\nsource = []\naction = \"deny\""),
        BODY + 1,
        "source",
        "at least one prefix",
    );
    assert_error(
        &rule("name = \"a\"\nsource = { net = \"10.0.0.0/8\" }\naction = \"deny\""),
        BODY + 1,
        "source",
        "a CIDR string or an array of CIDR strings",
    );
    // Family-specific keys need one family.
    assert_error(
        &rule("name = \"a\"\nsource = [\"10.0.0.0/8\", \"::/0\"]\nrate = 5\nper = \"/24\""),
        BODY + 3,
        "per",
        "mix IPv4 and IPv6",
    );
    assert_error(
        &rule("name = \"a\"\nsource = [\"10.0.0.0/8\", \"::/0\"]\nprotocol = \"icmp\"\naction = \"deny\""),
        BODY + 2,
        "protocol",
        "one rule per family",
    );
    let v6 = parse(&rule(
        "name = \"a\"\nsource = [\"2001:db8::/32\", \"2001:db9::/32\"]\nrate = 5\nper = \"/64\"",
    ));
    assert_eq!(v6.rules[0].per, Per::Prefix(64));
    assert_error(
        &rule("name = \"a\"\nsource = [\"2001:db8::/32\", \"2001:db9::/32\"]\nrate = 5\nper = \"/129\""),
        BODY + 3,
        "per",
        "",
    );
}

#[test]
fn source_and_source_file_are_exclusive() {
    assert_error(
        &rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nsource_file = \"x.txt\"\naction = \"deny\""),
        BODY + 2,
        "source_file",
        "not both",
    );
    let e = assert_error(
        &rule("name = \"a\"\naction = \"deny\""),
        4,
        "source",
        "missing",
    );
    assert!(e.to_string().contains("source_file"), "{e}");
    assert_error(
        &rule("name = \"a\"\nsource_file = \"\"\naction = \"deny\""),
        BODY + 1,
        "source_file",
        "empty",
    );
    assert_error(
        &rule("name = \"a\"\nsource_file = 5\naction = \"deny\""),
        BODY + 1,
        "source_file",
        "invalid type",
    );
}

const LIST: &str = "# office and partners\n\
    10.0.0.0/8\n\
    \n\
      192.0.2.7   # a bare address is a /32\n\
    2001:db8::/32\t\r\n\
    #10.9.9.9/32 commented out\n\
    10.0.0.0/8 # listed twice\n\
    \t198.51.100.0/24#no space before the comment\n";

#[test]
fn source_file_lists() {
    let dir = scratch("lists");
    std::fs::write(dir.join("allow.txt"), LIST).unwrap();
    std::fs::create_dir(dir.join("sub")).unwrap();
    let deny_list = dir.join("sub/deny.txt");
    std::fs::write(&deny_list, "203.0.113.0/24\n").unwrap();
    let cfg = dir.join("ratelimit.toml");
    let text = format!(
        "[[rule]]\nname = \"office\"\nsource_file = \"allow.txt\"\naction = \"allow\"\n\n\
         [[rule]]\nname = \"deny\"\nsource_file = \"sub/deny.txt\"\naction = \"deny\"\n\n\
         [[rule]]\nname = \"abs\"\nsource_file = \"{}\"\nrate = 5\nprotocol = \"udp\"\n",
        deny_list.display()
    );
    std::fs::write(&cfg, &text).unwrap();
    let c = Config::load(&cfg).unwrap();
    let office = &c.rules[0];
    assert_eq!(
        office.sources,
        nets(&[
            "10.0.0.0/8",
            "192.0.2.7/32",
            "2001:db8::/32",
            "198.51.100.0/24"
        ])
    );
    assert_eq!(office.source_file, Some(dir.join("allow.txt")));
    assert_eq!(
        office.source_summary(),
        format!("{} (4 prefixes)", dir.join("allow.txt").display())
    );
    assert_eq!(c.rules[1].source_file.as_ref(), Some(&deny_list));
    assert_eq!(c.rules[1].sources, nets(&["203.0.113.0/24"]));
    assert_eq!(c.rules[2].source_file.as_ref(), Some(&deny_list));
    // `parse` resolves against the directory of `origin` too.
    let again = Config::parse(&text, &cfg.display().to_string()).unwrap();
    assert_eq!(again, c);

    // An empty list (all comments) is a rule that matches nothing yet.
    std::fs::write(dir.join("allow.txt"), "# nothing yet\n\n").unwrap();
    let c = Config::load(&cfg).unwrap();
    assert!(c.rules[0].sources.is_empty());

    // Rules sharing list entries: a conflict with the same protocol and port, reported at the
    // line of the later rule's list...
    std::fs::write(dir.join("allow.txt"), "# header\n203.0.113.0/24\n").unwrap();
    let e = Config::load(&cfg).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}:1: rule \"office\" (line 1) already matches source 203.0.113.0/24, protocol any; \
             two rules cannot match the same traffic (rule \"deny\", {}:8)",
            deny_list.display(),
            cfg.display()
        )
    );
    assert_eq!(e.line(), Some(1));
    // ...and fine with different protocols.
    let tcp = text.replace(
        "action = \"allow\"",
        "action = \"allow\"\nprotocol = \"tcp\"",
    );
    std::fs::write(&cfg, tcp).unwrap();
    assert_eq!(Config::load(&cfg).unwrap().rules.len(), 3);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn source_file_errors() {
    let dir = scratch("list-errors");
    let cfg = dir.join("ratelimit.toml");
    let list = dir.join("deny.txt");
    std::fs::write(
        &cfg,
        "[agent]\ninterfaces = [\"eth0\"]\n\n[[rule]]\nname = \"blocklist\"\naction = \"deny\"\nsource_file = \"deny.txt\"\n",
    )
    .unwrap();
    let load_err = |list_text: &[u8]| {
        std::fs::write(&list, list_text).unwrap();
        let e = Config::load(&cfg).unwrap_err();
        assert!(matches!(e, ConfigError::List { .. }), "{e:?}");
        e.to_string()
    };
    let at = |line: usize, message: &str| {
        format!(
            "{}:{line}: {message} (rule \"blocklist\", {}:7)",
            list.display(),
            cfg.display()
        )
    };
    assert_eq!(
        load_err(b"10.0.0.0/8\n# comment\n10.0.0.300/8\n"),
        at(3, "invalid CIDR \"10.0.0.300/8\"")
    );
    assert_eq!(
        load_err(b"10.0.0.1/8   # oops\n"),
        at(
            1,
            "10.0.0.1/8 has host bits set; did you mean \"10.0.0.0/8\" (or \"10.0.0.1/32\" for the single address)?"
        )
    );
    assert!(load_err(b"::ffff:10.0.0.0/104\n").contains("IPv4-mapped"));
    assert_eq!(
        load_err(b"10.0.0.0/8\n\n10.1.0.0/16 # caf\xe9\n10.2.0.0/16 caf\xe9\n"),
        at(4, "not valid UTF-8 text")
    );
    assert_eq!(
        load_err(b"10.0.0.0/8 11.0.0.0/8\n"),
        at(1, "invalid CIDR \"10.0.0.0/8 11.0.0.0/8\"")
    );

    // Missing, a directory: named, with the rule.
    std::fs::remove_file(&list).unwrap();
    let e = Config::load(&cfg).unwrap_err();
    assert!(matches!(e, ConfigError::ListRead { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!("{}: cannot read source list: ", list.display()))
            && msg.ends_with(&format!("(rule \"blocklist\", {}:7)", cfg.display())),
        "{msg}"
    );
    std::fs::create_dir(&list).unwrap();
    let msg = Config::load(&cfg).unwrap_err().to_string();
    assert!(msg.contains("is a directory"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn scope_cluster_needs_a_cluster_table() {
    let text = rule("name = \"dns\"\nsource = \"::/0\"\nrate = 5\nscope = \"cluster\"");
    let e = assert_error(&text, BODY + 3, "scope", "needs a [cluster] table");
    assert!(
        e.to_string().contains("rule \"dns\"") && e.to_string().contains("scope = \"cluster\""),
        "{e}"
    );
    assert_eq!(
        parse(&format!("{text}\n{CLUSTER}")).rules[0].scope,
        Scope::Cluster
    );
}

/// Writes `count` distinct prefixes, one per line, with some comments and blank lines.
fn write_list(path: &Path, count: u32, first: u32) {
    let mut text = String::with_capacity(count as usize * 20);
    for i in first..first + count {
        use std::fmt::Write;
        if i % 1000 == 0 {
            text.push_str("# a comment line\n\n");
        }
        match i % 4 {
            0 => writeln!(text, "{}/32", Ipv4Addr::from(i)),
            1 => writeln!(text, "  {}   # trailing comment", Ipv4Addr::from(i)),
            2 => writeln!(text, "2001:db8:{:x}:{:x}::/64", i >> 16, i & 0xffff),
            _ => writeln!(text, "{}/31", Ipv4Addr::from(i & !1)),
        }
        .unwrap();
    }
    std::fs::write(path, text).unwrap();
}

use std::net::Ipv4Addr;

/// Parses a 100 000-line list and compiles it. Prints the time both take (run with
/// `--release --nocapture` to measure); asserts only correctness.
#[test]
fn hundred_thousand_line_list() {
    let dir = scratch("100k");
    let cfg = dir.join("ratelimit.toml");
    write_list(&dir.join("deny.txt"), 100_000, 1 << 24);
    std::fs::write(
        &cfg,
        "[[rule]]\nname = \"default\"\nsource = [\"0.0.0.0/0\", \"::/0\"]\nrate = 1000\n\n\
         [[rule]]\nname = \"blocklist\"\nsource_file = \"deny.txt\"\naction = \"deny\"\n",
    )
    .unwrap();
    let start = std::time::Instant::now();
    let c = Config::load(&cfg).unwrap();
    let parsed = start.elapsed();
    let start = std::time::Instant::now();
    let set = crate::compile::compile(&c.rules, &crate::compile::RuleIds::new()).unwrap();
    let compiled = start.elapsed();
    println!(
        "100 000-line list: parsed in {parsed:?}, compiled in {compiled:?} ({} prefixes)",
        set.prefixes.len()
    );
    assert_eq!(c.rules[1].sources.len(), 100_000);
    assert_eq!(set.prefixes.len(), 100_002);
    let hit = |ip: &str| {
        set.classify(ip.parse().unwrap(), 6, Some(80), 0)
            .map(|r| r.name.as_str())
    };
    assert_eq!(hit("1.0.0.0"), Some("blocklist"));
    assert_eq!(hit("1.0.0.1"), Some("blocklist"));
    assert_eq!(hit("1.0.0.2"), Some("blocklist"));
    assert_eq!(hit("1.0.0.3"), Some("blocklist"));
    assert_eq!(hit("9.9.9.9"), Some("default"));
    assert_eq!(hit("2001:db8:100:2::1"), Some("blocklist"));
    assert_eq!(hit("2001:db8:100:3::1"), Some("default"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn prefix_count_bounds() {
    let dir = scratch("bounds");
    let cfg = dir.join("ratelimit.toml");
    let big = dir.join("big.txt");
    write_list(&big, MAX_RULE_PREFIXES as u32 + 1, 1 << 24);
    std::fs::write(
        &cfg,
        "[[rule]]\nname = \"big\"\nsource_file = \"big.txt\"\naction = \"deny\"\n\n\
         [[rule]]\nname = \"more\"\nsource_file = \"more.txt\"\naction = \"deny\"\n",
    )
    .unwrap();
    let e = Config::load(&cfg).unwrap_err();
    let msg = e.to_string();
    // 250 comment lines and 250 blank lines come before the 250 001st prefix.
    assert!(
        msg.starts_with(&format!(
            "{}:250501: more than 250000 prefixes",
            big.display()
        )),
        "{msg}"
    );
    // 250 000 + 12 145 distinct prefixes: one more than the 262 144 that fit.
    write_list(&big, MAX_RULE_PREFIXES as u32, 1 << 24);
    write_list(
        &dir.join("more.txt"),
        (MAX_TOTAL_PREFIXES - MAX_RULE_PREFIXES) as u32 + 1,
        1 << 25,
    );
    let msg = Config::load(&cfg).unwrap_err().to_string();
    assert_eq!(
        msg,
        format!(
            "{}:8: rule \"more\": field `source_file`: the rules up to this one list 262145 \
             distinct source prefixes; at most 262144 fit over all rules (the prefix trie holds \
             two rule sets during a swap)",
            cfg.display()
        )
    );
    write_list(
        &dir.join("more.txt"),
        (MAX_TOTAL_PREFIXES - MAX_RULE_PREFIXES) as u32,
        1 << 25,
    );
    assert_eq!(Config::load(&cfg).unwrap().rules[1].sources.len(), 12_144);
    std::fs::remove_dir_all(&dir).unwrap();
}

const COMMENTED: &str = r#"# ratelimit config for host A
# maintained by ops

[agent]
interfaces = ["eth0"]   # uplink
mode = "auto"

# --- rules ---

# Everyone.
[[rule]]
name = "default"          # catch-all
source = "0.0.0.0/0"
# packets per second
rate = 1000
burst = 2000              # twice the rate

[cluster]                 # peers
listen = "0.0.0.0:7946"
key_file = "/etc/ratelimit/cluster.key"

# DNS resolvers
[[rule]]
name = "dns"
source = [
    "192.0.2.53",      # resolver 1
    "192.0.2.54/32",   # resolver 2
]
protocol = "udp"
dst_port = 53
rate = 100
scope = "cluster"         # shared

# Blocklist, fed by automation.
[[rule]]
name = "blocklist"
source_file = "deny.txt"  # relative to this file
action = "deny"

# trailing comment at the end
"#;

/// Every comment in [`COMMENTED`] but those of the `[[rule]]` tables named in `except` (the
/// comment lines above a table belong to it).
fn comments_kept(text: &str, except: &[&str]) {
    let owned: &[(&str, &[&str])] = &[
        (
            "default",
            &[
                "# --- rules ---",
                "# Everyone.",
                "# catch-all",
                "# packets per second",
            ],
        ),
        (
            "dns",
            &[
                "# DNS resolvers",
                "# resolver 1",
                "# resolver 2",
                "# shared",
            ],
        ),
        (
            "blocklist",
            &["# Blocklist, fed by automation.", "# relative to this file"],
        ),
    ];
    for c in [
        "# ratelimit config for host A\n# maintained by ops\n\n[agent]\n",
        "interfaces = [\"eth0\"]   # uplink",
        "[cluster]                 # peers",
        "# trailing comment at the end\n",
    ] {
        assert!(text.contains(c), "lost {c:?}:\n{text}");
    }
    for (rule, comments) in owned {
        for c in *comments {
            assert_eq!(
                text.contains(c),
                !except.contains(rule),
                "{c:?} of rule {rule}:\n{text}"
            );
        }
    }
}

/// Rules equal but for their config lines.
#[track_caller]
fn same_rules(a: &[RuleConfig], b: &[RuleConfig]) {
    let strip = |rules: &[RuleConfig]| {
        rules
            .iter()
            .map(|r| RuleConfig {
                line: 0,
                ..r.clone()
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(strip(a), strip(b));
}

fn commented_config(tag: &str) -> (PathBuf, PathBuf, Config) {
    let dir = scratch(tag);
    std::fs::write(dir.join("deny.txt"), "203.0.113.0/24\n198.51.100.7\n").unwrap();
    let path = dir.join("ratelimit.toml");
    std::fs::write(&path, COMMENTED).unwrap();
    let config = Config::load(&path).unwrap();
    (dir, path, config)
}

#[test]
fn write_rules_unchanged_is_byte_identical() {
    let (dir, path, c) = commented_config("write-same");
    assert_eq!(c.rules.len(), 3);
    write_rules(&path, &c.rules).unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), COMMENTED);
    // Also when the list's content changed: the list is not the config's business.
    std::fs::write(dir.join("deny.txt"), "10.0.0.0/8\n").unwrap();
    write_rules(&path, &c.rules).unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), COMMENTED);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn write_rules_updates_in_place() {
    let (dir, path, c) = commented_config("write-update");
    let mut rules = c.rules.clone();
    rules[0].burst = Some(3000);
    rules[1].rate = Some(50);
    rules[1].burst = Some(50);
    rules[1].sources.push(net("2001:db8::53/128"));
    rules.push(RuleConfig {
        action: Action::Allow,
        ..RuleConfig::with_sources("office", nets(&["198.18.0.0/15", "2001:db8:1::/48"]))
    });
    write_rules(&path, &rules).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    same_rules(&Config::load(&path).unwrap().rules, &rules);
    // The changed value keeps its comment; the array was rewritten (its comments with it).
    assert!(
        text.contains("\nburst = 3000              # twice the rate\n"),
        "{text}"
    );
    assert!(text.contains("\nrate = 50\n"), "{text}");
    assert!(
        text.contains(
            "source = [\"192.0.2.53/32\", \"192.0.2.54/32\", \"2001:db8::53/128\"]\nprotocol"
        ),
        "{text}"
    );
    // New tables come last, before the comments that end the file.
    assert!(
        text.ends_with(
            "\n\n[[rule]]\nname = \"office\"\n\
             source = [\"198.18.0.0/15\", \"2001:db8:1::/48\"]\naction = \"allow\"\n\
             \n# trailing comment at the end\n"
        ),
        "{text}"
    );
    assert!(!text.contains("resolver 1"), "{text}");
    for c in ["# DNS resolvers", "# shared", "# Everyone.", "# catch-all"] {
        assert!(text.contains(c), "lost {c:?}:\n{text}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn write_rules_removes_reorders_and_switches_kinds() {
    let (dir, path, c) = commented_config("write-remove");
    // dns removed; blocklist moved before default.
    let rules = vec![c.rules[2].clone(), c.rules[0].clone()];
    write_rules(&path, &rules).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    same_rules(&Config::load(&path).unwrap().rules, &rules);
    comments_kept(&text, &["dns"]);
    assert!(
        text.find("name = \"blocklist\"").unwrap() < text.find("name = \"default\"").unwrap(),
        "{text}"
    );
    assert!(
        text.contains("source_file = \"deny.txt\"  # relative to this file"),
        "{text}"
    );

    // default becomes a deny rule reading a list (its limit keys go, `source` gives way to
    // `source_file`); blocklist becomes an inline limit rule.
    std::fs::write(dir.join("more.txt"), "192.0.2.0/24\n").unwrap();
    let mut default = c.rules[0].clone();
    default.action = Action::Deny;
    (default.rate, default.burst) = (None, None);
    default.source_file = Some(dir.join("more.txt"));
    default.sources = nets(&["192.0.2.0/24"]);
    let mut block = c.rules[2].clone();
    block.source_file = None;
    block.sources = nets(&["10.0.0.0/8"]);
    block.action = Action::Limit;
    (block.rate, block.burst, block.per) = (Some(5), Some(5), Per::Prefix(24));
    let rules = vec![block, default];
    write_rules(&path, &rules).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    same_rules(&Config::load(&path).unwrap().rules, &rules);
    assert!(
        !text.contains("rate = 1000") && !text.contains("burst"),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "source_file = \"{}\"\n",
            dir.join("more.txt").display()
        )),
        "{text}"
    );

    // No rules at all: the rest of the file stays.
    write_rules(&path, &[]).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(Config::load(&path).unwrap().rules.is_empty());
    assert!(!text.contains("[[rule]]"), "{text}");
    comments_kept(&text, &["default", "dns", "blocklist"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn write_rules_new_tables_have_only_non_default_keys() {
    let dir = scratch("write-new");
    let path = dir.join("ratelimit.toml");
    std::fs::write(&path, "[agent]\ninterfaces = [\"eth0\"]\n").unwrap();
    std::fs::write(dir.join("deny.txt"), "203.0.113.0/24\n").unwrap();
    let web = RuleConfig {
        rate: Some(10),
        burst: Some(10),
        per: Per::Prefix(24),
        protocol: Protocol::Tcp,
        dst_port: Some(80),
        ..RuleConfig::new("web", net("10.0.0.0/8"))
    };
    let office = RuleConfig {
        action: Action::Allow,
        dry_run: true,
        ..RuleConfig::with_sources(
            "office",
            nets(&[
                "192.0.2.0/24",
                "198.51.100.0/24",
                "203.0.113.8/29",
                "2001:db8::/32",
            ]),
        )
    };
    let bytes = RuleConfig {
        bytes_rate: Some(1000),
        bytes_burst: default_bytes_burst(Some(1000)),
        ..RuleConfig::new("bytes", net("::/0"))
    };
    let deny = RuleConfig {
        action: Action::Deny,
        source_file: Some(dir.join("deny.txt")),
        ..RuleConfig::with_sources("deny", nets(&["203.0.113.0/24"]))
    };
    let rules = vec![web, office, bytes, deny];
    write_rules(&path, &rules).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(
        text,
        format!(
            r#"[agent]
interfaces = ["eth0"]

[[rule]]
name = "web"
source = "10.0.0.0/8"
protocol = "tcp"
dst_port = 80
rate = 10
per = "/24"

[[rule]]
name = "office"
source = [
    "192.0.2.0/24",
    "198.51.100.0/24",
    "203.0.113.8/29",
    "2001:db8::/32",
]
action = "allow"
dry_run = true

[[rule]]
name = "bytes"
source = "::/0"
bytes_rate = 1000

[[rule]]
name = "deny"
source_file = "{}"
action = "deny"
"#,
            dir.join("deny.txt").display()
        )
    );
    same_rules(&Config::load(&path).unwrap().rules, &rules);

    // The same text, one rule at a time.
    assert_eq!(
        rules[0].to_toml(),
        "[[rule]]\nname = \"web\"\nsource = \"10.0.0.0/8\"\nprotocol = \"tcp\"\ndst_port = 80\nrate = 10\nper = \"/24\"\n"
    );
    let shown: String = rules
        .iter()
        .map(|r| r.to_toml())
        .collect::<Vec<_>>()
        .join("\n");
    same_rules(&parse(&shown).rules, &rules);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn write_rules_is_atomic_and_keeps_the_file_mode() {
    use std::os::unix::fs::PermissionsExt;
    let (dir, path, c) = commented_config("write-atomic");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
    let link = dir.join("link.toml");
    std::os::unix::fs::symlink("ratelimit.toml", &link).unwrap();
    let rules = &c.rules[..2];
    write_rules(&link, rules).unwrap();
    // Written through the symlink, which stays one.
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    same_rules(&Config::load(&path).unwrap().rules, rules);
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(meta.permissions().mode() & 0o7777, 0o640);
    // Nothing left behind.
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["deny.txt", "link.toml", "ratelimit.toml"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn write_rules_refuses_what_would_not_read_back() {
    let dir = scratch("write-refuse");
    let path = dir.join("ratelimit.toml");
    let original = "# no cluster here\n[agent]\ninterfaces = [\"eth0\"]\n";
    std::fs::write(&path, original).unwrap();
    let cluster = RuleConfig {
        rate: Some(5),
        burst: Some(5),
        scope: Scope::Cluster,
        ..RuleConfig::new("dns", net("::/0"))
    };
    let e = write_rules(&path, &[cluster]).unwrap_err();
    assert!(matches!(e, ConfigError::NotWritten { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!("{}: not written: ", path.display()))
            && msg.contains("needs a [cluster] table"),
        "{msg}"
    );
    let dup = RuleConfig {
        action: Action::Deny,
        ..RuleConfig::with_sources("dup", nets(&["10.0.0.0/8", "10.0.0.0/8"]))
    };
    let msg = write_rules(&path, &[dup]).unwrap_err().to_string();
    assert!(
        msg.contains("rule \"dup\" would read back differently"),
        "{msg}"
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), original);

    // Unreadable or broken files are reported as by `Config::load`.
    let e = write_rules(&dir.join("missing.toml"), &[]).unwrap_err();
    assert!(matches!(e, ConfigError::Read { .. }), "{e:?}");
    std::fs::write(&path, "[agent\n").unwrap();
    let e = write_rules(&path, &[]).unwrap_err();
    assert!(matches!(e, ConfigError::Syntax { line: 1, .. }), "{e:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn write_rules_converts_inline_rule_arrays() {
    let dir = scratch("write-inline");
    let path = dir.join("ratelimit.toml");
    std::fs::write(
        &path,
        "# inline rules\nrule = [\n  { name = \"a\", source = \"10.0.0.0/8\", rate = 1 },\n  { name = \"b\", source = \"11.0.0.0/8\", action = \"deny\" },\n]\n\n[agent]\ninterfaces = [\"eth0\"]\n",
    )
    .unwrap();
    let c = Config::load(&path).unwrap();
    let mut rules = c.rules.clone();
    rules[0].rate = Some(2);
    rules[0].burst = Some(2);
    write_rules(&path, &rules).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    same_rules(&Config::load(&path).unwrap().rules, &rules);
    assert!(
        text.starts_with(
            "# inline rules\n[[rule]]\nname = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 2\n\n[[rule]]\n"
        ),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn serialized_source_forms() {
    let dir = scratch("serialize");
    std::fs::write(dir.join("deny.txt"), "10.0.0.0/8\n").unwrap();
    let path = dir.join("ratelimit.toml");
    std::fs::write(
        &path,
        "[[rule]]\nname = \"a\"\nsource = [\"11.0.0.0/8\", \"::/0\"]\naction = \"deny\"\n\n\
         [[rule]]\nname = \"b\"\nsource_file = \"deny.txt\"\naction = \"deny\"\n",
    )
    .unwrap();
    let c = Config::load(&path).unwrap();
    let json = serde_json::to_value(&c.rules).unwrap();
    assert_eq!(json[0]["source"], serde_json::json!(["11.0.0.0/8", "::/0"]));
    assert_eq!(
        json[1],
        serde_json::json!({
            "name": "b", "source_file": dir.join("deny.txt"), "action": "deny",
            "protocol": "any", "dry_run": false
        })
    );
    assert_eq!(c.rules[0].source_summary(), "11.0.0.0/8, ::/0");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tcp_flags_parse() {
    let c = parse(&rule(
        "name = \"syn\"\nsource = \"0.0.0.0/0\"\nprotocol = \"tcp\"\ntcp_flags = \"syn\"\nrate = 10",
    ));
    assert_eq!(c.rules[0].tcp_flags, Some(TcpFlags::Syn));
    // Without the key: no flags.
    let c = parse(&rule(
        "name = \"tcp\"\nsource = \"0.0.0.0/0\"\nprotocol = \"tcp\"\nrate = 10",
    ));
    assert_eq!(c.rules[0].tcp_flags, None);
}

#[test]
fn tcp_flags_errors() {
    // Only with protocol tcp: the error points at the key.
    assert_error(
        &rule("name = \"syn\"\nsource = \"0.0.0.0/0\"\ntcp_flags = \"syn\"\nrate = 10"),
        BODY + 2,
        "tcp_flags",
        "only valid with protocol tcp (this rule has protocol any)",
    );
    assert_error(
        &rule(
            "name = \"syn\"\nsource = \"0.0.0.0/0\"\nprotocol = \"udp\"\nrate = 10\ntcp_flags = \"syn\"",
        ),
        BODY + 4,
        "tcp_flags",
        "protocol udp",
    );
    // Only "syn".
    let e = Config::parse(
        &rule(
            "name = \"syn\"\nsource = \"0.0.0.0/0\"\nprotocol = \"tcp\"\ntcp_flags = \"ack\"\nrate = 10",
        ),
        ORIGIN,
    )
    .unwrap_err();
    assert_eq!(e.line(), Some(BODY + 3), "{e}");
    assert!(e.to_string().contains("syn"), "{e}");
    // Two SYN rules for one source conflict; a SYN rule beside a TCP rule does not.
    let text = "[[rule]]\nname = \"a\"\nsource = \"10.0.0.0/8\"\nprotocol = \"tcp\"\ntcp_flags = \"syn\"\nrate = 1\n\n\
                [[rule]]\nname = \"b\"\nsource = \"10.0.0.0/8\"\nprotocol = \"tcp\"\ntcp_flags = \"syn\"\nrate = 2\n";
    let e = assert_error(text, 10, "source", "tcp_flags syn");
    assert!(e.to_string().contains("rule \"a\" (line 1)"), "{e}");
    let ok = text.replace("tcp_flags = \"syn\"\nrate = 2", "rate = 2");
    assert_eq!(parse(&ok).rules.len(), 2);
}

#[test]
fn tcp_flags_write_back_and_serialize() {
    let dir = scratch("write-syn");
    let path = dir.join("ratelimit.toml");
    std::fs::write(&path, "[agent]\ninterfaces = [\"eth0\"]\n").unwrap();
    let syn = RuleConfig {
        rate: Some(10),
        burst: Some(10),
        protocol: Protocol::Tcp,
        tcp_flags: Some(TcpFlags::Syn),
        ..RuleConfig::new("syn", net("0.0.0.0/0"))
    };
    write_rules(&path, std::slice::from_ref(&syn)).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(
        text.contains("protocol = \"tcp\"\ntcp_flags = \"syn\"\nrate = 10\n"),
        "{text}"
    );
    let back = Config::load(&path).unwrap();
    assert_eq!(
        RuleConfig {
            line: 0,
            ..back.rules[0].clone()
        },
        syn
    );
    // Unchanged: byte for byte; and removing the flags removes the key.
    write_rules(&path, &back.rules).unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
    let plain = RuleConfig {
        tcp_flags: None,
        ..syn.clone()
    };
    write_rules(&path, &[plain]).unwrap();
    assert!(!std::fs::read_to_string(&path)
        .unwrap()
        .contains("tcp_flags"));
    // JSON (the API's form) keeps it too.
    let v = serde_json::to_value(&syn).unwrap();
    assert_eq!(v["tcp_flags"], "syn");
    assert!(syn.to_toml().contains("tcp_flags = \"syn\""));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `[[rule.limit]]`: a rule's further limits, in order, with defaults filled in as for the
/// rule's own.
#[test]
fn rule_limits_parse() {
    let c = parse(
        "[[rule]]\nname = \"web\"\nsource = \"0.0.0.0/0\"\nrate = 1000\nburst = 2000\n\
         [[rule.limit]]\nper = \"/24\"\nrate = 20000\n\
         [[rule.limit]]\nper = \"rule\"\nrate = 500000\nbytes_rate = 1000000\n",
    );
    let r = &c.rules[0];
    assert_eq!(r.limits.len(), 2);
    assert_eq!(r.limits[0].per, Per::Prefix(24));
    assert_eq!(
        (r.limits[0].rate, r.limits[0].burst),
        (Some(20000), Some(20000))
    );
    assert_eq!(r.limits[0].line, 6);
    assert_eq!(r.limits[1].per, Per::Rule);
    assert_eq!(r.limits[1].bytes_burst, Some(1_000_000));
    assert_eq!(r.limits[1].scope, Scope::Local);
    assert_eq!(r.limits[1].line, 9);
    // A rule without any keeps none.
    assert!(
        parse(&rule("name = \"a\"\nsource = \"10.0.0.0/8\"\nrate = 1")).rules[0]
            .limits
            .is_empty()
    );
}

#[test]
fn rule_limit_errors_name_the_file_line_and_key() {
    let head = "[[rule]]\nname = \"web\"\nsource = \"10.0.0.0/8\"\nrate = 10\n";
    // Five limits: the fourth [[rule.limit]] (line 13) is one too many.
    let five = format!(
        "{head}{}",
        "[[rule.limit]]\nper = \"rule\"\nrate = 5\n".repeat(4)
    );
    assert_error(&five, 14, "limit", "at most 4");
    // `per` is required in a [[rule.limit]].
    assert_error(
        &format!("{head}[[rule.limit]]\nrate = 5\n"),
        5,
        "per",
        "required",
    );
    // Bad values point at the key.
    assert_error(
        &format!("{head}[[rule.limit]]\nper = \"rule\"\nrate = 0\n"),
        7,
        "rate",
        "between 1 and",
    );
    assert_error(
        &format!("{head}[[rule.limit]]\nper = \"rule\"\nrate = 1\nburst = 3601\n"),
        8,
        "burst",
        "one hour",
    );
    assert_error(
        &format!("{head}[[rule.limit]]\nper = \"/33\"\nrate = 5\n"),
        6,
        "per",
        "longer than an IPv4 address",
    );
    assert_error(
        &format!("{head}[[rule.limit]]\nper = \"rule\"\n"),
        5,
        "rate",
        "needs `rate`",
    );
    assert_error(
        &format!("{head}[[rule.limit]]\nper = \"rule\"\nrate = 5\nscope = \"cluster\"\n"),
        8,
        "scope",
        "[cluster]",
    );
    // With a [cluster], a cluster-wide [[rule.limit]] is taken, each limit with its own scope
    // (the sync shares every cluster-scoped limit's buckets on their own).
    let c = Config::parse(
        &format!(
            "{CLUSTER}{head}[[rule.limit]]\nper = \"/24\"\nrate = 50\n\
             [[rule.limit]]\nper = \"rule\"\nrate = 5\nscope = \"cluster\"\n"
        ),
        ORIGIN,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let scopes: Vec<Scope> = c.rules[0].limits.iter().map(|l| l.scope).collect();
    assert_eq!(
        (c.rules[0].scope, scopes),
        (Scope::Local, vec![Scope::Local, Scope::Cluster])
    );
    // ... and its bad values still point at their key, line and file.
    assert_error(
        &format!("{CLUSTER}{head}[[rule.limit]]\nper = \"rule\"\nrate = 0\nscope = \"cluster\"\n"),
        10,
        "rate",
        "between 1 and",
    );
    assert_error(
        &format!("{CLUSTER}{head}[[rule.limit]]\nper = \"/33\"\nrate = 5\nscope = \"cluster\"\n"),
        9,
        "per",
        "longer than an IPv4 address",
    );
    let e = assert_error(
        &format!("{CLUSTER}{head}[[rule.limit]]\nper = \"rule\"\nrate = 5\nscope = \"global\"\n"),
        11,
        "scope",
        "unknown variant `global`, expected `local` or `cluster`",
    );
    assert!(e.to_string().contains("[[rule.limit]] #1"), "{e}");
    assert_error(
        &format!("{head}[[rule.limit]]\nper = \"rule\"\nrate = 5\nbytes_burst = 100\n"),
        8,
        "bytes_burst",
        "`bytes_rate` is not",
    );
    // Unknown keys are named.
    let e = Config::parse(
        &format!("{head}[[rule.limit]]\nper = \"rule\"\nrate = 5\nprotocol = \"tcp\"\n"),
        ORIGIN,
    )
    .unwrap_err();
    assert_eq!(e.line(), Some(8), "{e}");
    assert!(e.to_string().contains("protocol"), "{e}");
    // Only limit rules take limits.
    assert_error(
        "[[rule]]\nname = \"ok\"\nsource = \"10.0.0.0/8\"\naction = \"allow\"\n\
         [[rule.limit]]\nper = \"rule\"\nrate = 5\n",
        5,
        "limit",
        "no meaning for an allow rule",
    );
    // The same checks on a rule that did not come from a file (the API's `rules add`).
    let mut r = RuleConfig {
        rate: Some(10),
        burst: Some(10),
        ..RuleConfig::new("api", net("10.0.0.0/8"))
    };
    r.limits = vec![LimitConfig::new(Per::Rule); 4];
    for l in &mut r.limits {
        l.rate = Some(1);
        l.burst = Some(1);
    }
    let e = r.validate().unwrap_err();
    assert_eq!(e.field, "limit");
    assert!(e.message.contains("at most 4 limits"), "{e}");
    r.limits.truncate(1);
    r.limits[0].rate = Some(0);
    let e = r.validate().unwrap_err();
    assert!(
        e.message.contains("limit 2") && e.message.contains("`rate`"),
        "{e}"
    );
    r.limits[0].rate = Some(1);
    r.validate().unwrap();
}

#[test]
fn rule_limits_write_back_and_serialize() {
    let dir = scratch("write-limits");
    let path = dir.join("ratelimit.toml");
    std::fs::write(&path, "[agent]\ninterfaces = [\"eth0\"]\n").unwrap();
    let mut net24 = LimitConfig::new(Per::Prefix(24));
    net24.rate = Some(3000);
    net24.burst = Some(3000);
    let mut all = LimitConfig::new(Per::Rule);
    all.rate = Some(10_000);
    all.burst = Some(20_000);
    let web = RuleConfig {
        rate: Some(1000),
        burst: Some(1000),
        limits: vec![net24, all],
        ..RuleConfig::new("web", net("0.0.0.0/0"))
    };
    write_rules(&path, std::slice::from_ref(&web)).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(
        text.contains("[[rule.limit]]\nper = \"/24\"\nrate = 3000\n\n[[rule.limit]]\nper = \"rule\"\nrate = 10000\nburst = 20000\n"),
        "{text}"
    );
    let back = Config::load(&path).unwrap();
    let mut got = back.rules[0].clone();
    got.line = 0;
    for l in &mut got.limits {
        l.line = 0;
    }
    assert_eq!(got, web);
    // Unchanged: byte for byte; one limit fewer removes its table.
    write_rules(&path, &back.rules).unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
    let fewer = RuleConfig {
        limits: web.limits[..1].to_vec(),
        ..web.clone()
    };
    write_rules(&path, &[fewer]).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(text.matches("[[rule.limit]]").count(), 1, "{text}");
    // JSON (the API's form) keeps them.
    let v = serde_json::to_value(&web).unwrap();
    assert_eq!(v["limit"][0]["per"], "/24");
    assert_eq!(v["limit"][1]["burst"], 20000);
    assert!(
        web.to_toml().contains("[[rule.limit]]"),
        "{}",
        web.to_toml()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The column is the error's own (1-based, in characters), and only a line that reads as
/// `key = ...` with a plain key names a field.
#[test]
fn syntax_errors_name_the_exact_column_and_only_plain_keys() {
    let column = |text: &str| match Config::parse(text, ORIGIN).expect_err("rejected") {
        ConfigError::Syntax { column, field, .. } => (column, field),
        e => panic!("not a syntax error: {e:?}"),
    };
    // `mode = "auto` : the string opened at column 8 never ends.
    let (c, f) = column("[agent]\nmode = \"auto\n");
    assert_eq!(f.as_deref(), Some("mode"));
    let (c2, _) = column("[agent]\nmode    = \"auto\n");
    assert_eq!(c2, c + 3, "three more spaces move the error three columns");
    // A key with a space in it, or none at all, is not named as a field.
    let (_, f) = column("[agent]\nbad key = 1\n");
    assert_eq!(f, None);
    let (_, f) = column("[agent]\n = 1\n");
    assert_eq!(f, None);
}

/// A list file of exactly `MAX_FILE_BYTES` is read whole; one byte more is refused, naming the
/// bound, also when the file grew after its size was looked at (found missed by cargo-mutants:
/// `>` as `>=`). Sparse files: nothing is written to disk.
#[test]
fn a_list_file_of_the_largest_size_is_read_and_one_byte_more_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.list");
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(lists::MAX_FILE_BYTES).unwrap();
    let bytes = lists::read_bounded(&path).unwrap();
    assert_eq!(bytes.len() as u64, lists::MAX_FILE_BYTES);
    file.set_len(lists::MAX_FILE_BYTES + 1).unwrap();
    let e = lists::read_bounded(&path).unwrap_err();
    assert!(e.to_string().contains("larger than 64 MiB"), "{e}");
}

/// Values written in other spellings than the writer's own (literal strings, underscores, hex)
/// that already say what the rule has are left as written, key by key: rewriting the same rules
/// gives the same bytes. A changed `bytes_burst` is written (found missed by cargo-mutants: the
/// check of `action`, `per`, and of a limit rule's numbers, removed or turned around).
#[test]
fn values_in_other_spellings_are_kept_and_a_changed_bytes_burst_is_written() {
    let text = "[[rule]]\nname = 'web'\nsource = '198.18.0.0/15'\naction = 'limit'   # a limit\n\
                rate = 1_000\nburst = 0x7d0\nbytes_rate = 1_000_000\nbytes_burst = 2_000_000\n\
                per = '/24'\n";
    let c = parse(text);
    assert_eq!(
        (c.rules[0].rate, c.rules[0].burst, c.rules[0].bytes_burst),
        (Some(1000), Some(2000), Some(2_000_000))
    );
    assert_eq!(render_rules(text, "test.toml", &c.rules).unwrap(), text);
    let mut rules = c.rules.clone();
    rules[0].bytes_burst = Some(3_000_000);
    let written = render_rules(text, "test.toml", &rules).unwrap();
    assert_eq!(
        parse(&written).rules[0].bytes_burst,
        Some(3_000_000),
        "{written}"
    );
    assert!(written.contains("\nrate = 1_000\n"), "{written}");
}

/// The agent writes rules only into a file owned by root or by its own user: a file another
/// user owns is refused, naming its owner, and left as it was (found missed by cargo-mutants:
/// the owner check turned around). Needs root to give the file away.
#[test]
fn a_config_file_another_user_owns_is_not_written() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to chown");
        return;
    }
    let (dir, path, c) = commented_config("write-owner");
    std::os::unix::fs::chown(&path, Some(4242), None).unwrap();
    let e = write_rules(&path, &c.rules[..1]).unwrap_err().to_string();
    assert!(e.contains("owned by uid 4242"), "{e}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), COMMENTED);
    // Root's own file is written.
    std::os::unix::fs::chown(&path, Some(0), None).unwrap();
    write_rules(&path, &c.rules[..1]).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A password file for the Redis tests: `mode`, in a directory of its own (removed on drop).
struct PasswordFile(PathBuf);

impl PasswordFile {
    fn new(tag: &str, text: &str, mode: u32) -> Self {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("rl-redis-pw-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("password");
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        Self(path)
    }
}

impl Drop for PasswordFile {
    fn drop(&mut self) {
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// `backend = "redis"`: the store's keys parsed with their defaults, the gossip keys not
/// required; every bad value refused naming its key and line.
#[test]
fn cluster_backend_redis() {
    let base = "[cluster]\nbackend = \"redis\"\nredis = [\"redis://198.51.100.7:6379\"]\n";
    let c = parse(base).cluster.unwrap();
    assert_eq!(c.backend, ClusterBackend::Redis);
    assert_eq!((c.listen, c.key_file.as_ref()), (None, None));
    let r = c.redis.unwrap();
    assert_eq!(r.urls, ["redis://198.51.100.7:6379"]);
    assert_eq!(
        (
            r.user.as_deref(),
            r.password_file.as_ref(),
            r.connect_timeout_ms,
            r.command_timeout_ms
        ),
        (None, None, 1000, 250)
    );
    // The default backend is gossip, which has no store.
    let g = parse("[cluster]\nlisten = \"0.0.0.0:7946\"\nkey_file = \"/k\"\n")
        .cluster
        .unwrap();
    assert_eq!((g.backend, g.redis), (ClusterBackend::Gossip, None));

    let pw = PasswordFile::new("ok", "s3cret\n", 0o600);
    let c = parse(&format!(
        "[cluster]\nbackend = \"redis\"\nredis = [\"rediss://[2001:db8::7]:7000\", \"rediss://redis-a.example:7001/0\"]\n\
         redis_user = \"ratelimit\"\nredis_password_file = \"{}\"\nredis_connect_timeout_ms = 500\nredis_command_timeout_ms = 60000\n",
        pw.0.display()
    ))
    .cluster
    .unwrap()
    .redis
    .unwrap();
    assert_eq!(c.urls.len(), 2);
    assert_eq!(c.user.as_deref(), Some("ratelimit"));
    assert_eq!(c.password_file.as_deref(), Some(pw.0.as_path()));
    assert_eq!((c.connect_timeout_ms, c.command_timeout_ms), (500, 60_000));
    assert_eq!(crate::config::read_redis_password(&pw.0).unwrap(), "s3cret");

    // Bad URLs, each naming `redis` and its line.
    for (url, why) in [
        (
            "http://198.51.100.7:6379",
            "not a redis:// or rediss:// URL",
        ),
        ("redis://user:pw@198.51.100.7", "holds credentials"),
        ("redis://", "names no host"),
        ("redis://198.51.100.7:0", "port must be 1 to 65535"),
        ("redis://198.51.100.7:99999", "port must be 1 to 65535"),
        ("redis://198.51.100.7:6379/x", "database"),
        ("redis://[2001:db8::7", "ends with ']'"),
        ("redis://bad host", "spaces"),
        ("redis://198.51.100.7?db=1", "no query"),
    ] {
        assert_error(
            &format!("[cluster]\nbackend = \"redis\"\nredis = [\n  \"{url}\",\n]\n"),
            4,
            "redis",
            why,
        );
    }
    assert_error(
        "[cluster]\nbackend = \"redis\"\nredis = [\"redis://a:1\", \"rediss://b:1\"]\n",
        3,
        "redis",
        "mixes",
    );
    assert_error(
        "[cluster]\nbackend = \"redis\"\nredis = []\n",
        3,
        "redis",
        "1 to 64 URLs",
    );
    assert_error("[cluster]\nbackend = \"redis\"\n", 2, "redis", "missing");
    assert_error(
        "[cluster]\nbackend = \"memcached\"\n",
        2,
        "backend",
        "must be \"gossip\" or \"redis\"",
    );
    // Timeouts out of range.
    for (key, v) in [
        ("redis_connect_timeout_ms", 9),
        ("redis_connect_timeout_ms", 60_001),
        ("redis_command_timeout_ms", 0),
        ("redis_command_timeout_ms", -5),
    ] {
        assert_error(
            &format!("{base}{key} = {v}\n"),
            4,
            key,
            "between 10 and 60000 milliseconds",
        );
    }
    assert_error(
        &format!("{base}redis_user = \"a b\"\n"),
        4,
        "redis_user",
        "space",
    );
    assert_error(
        &format!("{base}redis_user = \"\"\n"),
        4,
        "redis_user",
        "1 to 128",
    );
    // The password file: missing, readable by others, empty; each names the key and the path.
    let missing = std::env::temp_dir().join("rl-redis-pw-none/password");
    let e = assert_error(
        &format!("{base}redis_password_file = \"{}\"\n", missing.display()),
        4,
        "redis_password_file",
        "No such file",
    );
    assert!(
        e.to_string().contains(&missing.display().to_string()),
        "{e}"
    );
    let open = PasswordFile::new("open", "s3cret\n", 0o644);
    assert_error(
        &format!("{base}redis_password_file = \"{}\"\n", open.0.display()),
        4,
        "redis_password_file",
        "mode 644 lets other users read or change the secret",
    );
    let empty = PasswordFile::new("empty", "\n", 0o600);
    assert_error(
        &format!("{base}redis_password_file = \"{}\"\n", empty.0.display()),
        4,
        "redis_password_file",
        "holds no password",
    );
    assert_error(
        &format!("{base}redis_password_file = \"/dev/zero\"\n"),
        4,
        "redis_password_file",
        "device",
    );
    // The CA file: only with rediss://; PEM with a certificate; writable by no one else.
    let tls = "[cluster]\nbackend = \"redis\"\nredis = [\"rediss://198.51.100.7:6379\"]\n";
    let pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
    let ca = PasswordFile::new("ca", pem, 0o644);
    let c = parse(&format!("{tls}redis_ca_file = \"{}\"\n", ca.0.display()))
        .cluster
        .unwrap()
        .redis
        .unwrap();
    assert_eq!(c.ca_file.as_deref(), Some(ca.0.as_path()));
    assert_error(
        &format!("{base}redis_ca_file = \"{}\"\n", ca.0.display()),
        4,
        "redis_ca_file",
        "only with rediss:// URLs",
    );
    let writable = PasswordFile::new("ca-w", pem, 0o666);
    assert_error(
        &format!("{tls}redis_ca_file = \"{}\"\n", writable.0.display()),
        4,
        "redis_ca_file",
        "mode 666 lets other users change the certificates",
    );
    let not_pem = PasswordFile::new("ca-x", "hello\n", 0o644);
    assert_error(
        &format!("{tls}redis_ca_file = \"{}\"\n", not_pem.0.display()),
        4,
        "redis_ca_file",
        "holds no PEM certificate",
    );
    assert_error(
        "[cluster]\nlisten = \"0.0.0.0:7946\"\nkey_file = \"/k\"\nredis_ca_file = \"/x\"\n",
        4,
        "redis_ca_file",
        "only under backend = \"redis\"",
    );
    // The Redis keys under gossip are refused, not ignored; on_partition = "share" needs gossip.
    assert_error(
        "[cluster]\nlisten = \"0.0.0.0:7946\"\nkey_file = \"/k\"\nredis = [\"redis://a:1\"]\n",
        4,
        "redis",
        "only under backend = \"redis\"",
    );
    assert_error(
        &format!("{base}on_partition = \"share\"\n"),
        4,
        "on_partition",
        "needs backend = \"gossip\"",
    );
}
