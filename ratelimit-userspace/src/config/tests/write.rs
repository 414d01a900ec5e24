//! `write_rules`: the config file written back in place, comments and spellings kept, atomic,
//! refused where it would not read back or where another user owns the file.

use super::*;

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
