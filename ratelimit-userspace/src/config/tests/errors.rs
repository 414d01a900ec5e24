//! What the parser refuses: every bad input named with the file, line (and column) and key.

use super::*;

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
        "between 10 and 10000 milliseconds (got 10001)",
    );
    assert_error(
        &format!("{base}max_keys = 0\n"),
        4,
        "max_keys",
        "between 1 and 100000 (got 0)",
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
