//! The config's unit tests: the helpers and the examples they share here, the tests by what
//! they try in the modules below.

use std::path::{Path, PathBuf};

use ipnet::IpNet;
use serde::Serialize;

use super::*;

mod errors;
mod keys;
mod sources;
mod write;

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
