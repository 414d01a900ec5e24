//! What the parser accepts: every key, its default and its spellings, the design's example, the
//! rule limits, TCP flags and the Redis backend, and rules serialized and parsed back.

use super::*;

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
