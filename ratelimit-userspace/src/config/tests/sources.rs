//! Sources given inline, as arrays or in list files: what is read, what is refused, the bounds.

use super::*;

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
