//! The agent's life cycle under the CLI: `detach` (also of an agent that was killed), SIGHUP and
//! `rules reload` applying what the file watcher cannot see, SIGINT, and the control socket's
//! permissions, reuse and removal.

use std::fs;
use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::Duration;

use crate::{assert_unlimited, bed, config, refused, RemoveDir, EXIT_TIMEOUT, FLOODER};
use ratelimit_testbed::agent_proc::rule_packets;
use ratelimit_testbed::{assert_limited, cli, AgentProcess};
use serde_json::Value;

#[test]
fn detach_takes_xdp_off_and_traffic_flows_unlimited() {
    let bed = bed("det");
    let rules = "[[rule]]\nname = \"flood\"\nsource = \"198.18.0.0/24\"\nrate = 100\nburst = 10\n";
    let agent = AgentProcess::start(&bed.rx, &config(&bed.rx_if, rules), &[]).unwrap();
    let (sent, got) = bed.flood(FLOODER, 1000, Duration::from_secs(1));
    assert_limited("attached", &sent, got, 100, 10);

    let stderr = refused(&agent, &["detach", "--iface", "eth99"]);
    assert_eq!(stderr, "error: not attached to \"eth99\"\n");
    assert!(bed.xdp().is_some());
    assert_eq!(
        agent.cli_json(&["detach", "--iface", &bed.rx_if]),
        serde_json::json!({"detached": [bed.rx_if]})
    );
    assert_eq!(bed.xdp(), None, "XDP still attached after detach");
    assert_eq!(
        agent.cli_json(&["status"])["interfaces"],
        serde_json::json!([])
    );
    let (sent, got) = bed.flood(FLOODER, 1000, Duration::from_secs(1));
    assert_unlimited("detached", &sent, got);
    assert_eq!(
        agent.cli_ok(&["detach"]),
        "was not attached to any interface\n"
    );

    // Until the next reload, which attaches to the config's interfaces again.
    let reloaded = agent.cli_json(&["rules", "reload"]);
    assert_eq!(reloaded["reloaded"], true, "{reloaded}");
    assert_eq!(
        bed.xdp().map(|(mode, _)| mode).as_deref(),
        Some("native"),
        "the reload attached again"
    );
    assert_eq!(
        agent.cli_json(&["status"])["interfaces"],
        serde_json::json!([{"iface": bed.rx_if, "mode": "native", "state": "attached"}])
    );
    let (sent, got) = bed.flood(FLOODER, 1000, Duration::from_secs(1));
    assert_limited("attached again by the reload", &sent, got, 100, 10);

    let status = agent.stop().unwrap();
    assert!(status.success(), "agent exited with {status}");
}

/// The config file's identity as the agent's watcher sees it: (inode, size, mtime).
pub(crate) fn file_stamp(path: &Path) -> (u64, u64, i64, i64) {
    use std::os::unix::fs::MetadataExt as _;
    let m = fs::metadata(path).unwrap();
    (m.ino(), m.size(), m.mtime(), m.mtime_nsec())
}

/// Rewrites `path` in place with `from` replaced by `to` (of the same length) and its mtime put
/// back: inode, size and mtime unchanged, an edit the agent's watcher cannot see (as a config
/// manager that keeps timestamps makes), so only SIGHUP or `rules reload` can apply it.
pub(crate) fn edit_unseen(path: &Path, from: &str, to: &str) {
    assert_eq!(from.len(), to.len(), "{from:?} -> {to:?}");
    let before = file_stamp(path);
    let modified = fs::metadata(path).unwrap().modified().unwrap();
    let text = fs::read_to_string(path).unwrap();
    assert!(text.contains(from), "{from:?} not in {text}");
    fs::write(path, text.replacen(from, to, 1)).unwrap();
    fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_times(fs::FileTimes::new().set_modified(modified))
        .unwrap();
    assert_eq!(
        file_stamp(path),
        before,
        "the edit changed what the watcher sees"
    );
}

/// Polls `f` every 20 ms until it holds; fails after `timeout` (a hang guard).
pub(crate) fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + timeout;
    while !f() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within {timeout:?}"
        );
        thread::sleep(Duration::from_millis(20));
    }
}

/// SIGHUP and `ratelimit rules reload` re-read the config file: each applies an edit the file
/// watcher cannot see (`dry_run` on, then off, which change live) and counts one reload; a
/// setting that needs a restart (`max_buckets`) is listed by `status` and not applied; SIGINT
/// stops the agent with status 0, detached and its pins removed.
#[test]
fn sighup_and_rules_reload_apply_the_file_and_sigint_stops_cleanly() {
    let bed = bed("hup");
    let rules = "[[rule]]\nname = \"flood\"\nsource = \"198.18.0.0/24\"\nrate = 100\nburst = 10\n";
    let cfg = format!(
        "[agent]\ninterfaces = [\"{}\"]\nmode = \"auto\"\ndry_run = false\nmax_buckets = 1024\n\n{rules}",
        bed.rx_if
    );
    let mut agent = AgentProcess::start(&bed.rx, &cfg, &[]).unwrap();
    let status = |a: &AgentProcess| a.cli_json(&["status"]);
    let reloads = |a: &AgentProcess| status(a)["reloads"]["ok"].as_u64().unwrap();
    let flood_counts = |a: &AgentProcess| {
        let s = a.cli_json(&["stats"]);
        ["passed", "dropped_rate", "dry_run"].map(|v| rule_packets(&s, "flood", v))
    };
    let r0 = reloads(&agent);
    let capacity = status(&agent)["buckets_capacity"].clone();
    let (sent, got) = bed.flood(FLOODER, 1000, Duration::from_secs(1));
    assert_limited("before", &sent, got, 100, 10);

    edit_unseen(agent.config_path(), "dry_run = false", "dry_run = true ");
    // Three of the watcher's 250 ms polls: it must not have reloaded (else this test would not
    // tell SIGHUP from the watcher).
    thread::sleep(Duration::from_millis(750));
    assert_eq!(
        reloads(&agent),
        r0,
        "the watcher reloaded an edit it cannot see"
    );
    assert_eq!(status(&agent)["dry_run"], false);
    agent.signal(libc::SIGHUP).unwrap();
    wait_until("a reload after SIGHUP", Duration::from_secs(10), || {
        reloads(&agent) == r0 + 1
    });
    assert_eq!(status(&agent)["dry_run"], true);
    assert!(agent.log().contains("SIGHUP: reloading"), "{}", agent.log());
    let c0 = flood_counts(&agent);
    let (sent, got) = bed.flood(FLOODER, 1000, Duration::from_secs(1));
    assert_unlimited("dry run after SIGHUP", &sent, got);
    let c1 = flood_counts(&agent);
    assert_eq!(c1[1], c0[1], "nothing dropped in dry run");
    assert_eq!(
        (c1[0] - c0[0]) + (c1[2] - c0[2]),
        sent.sent,
        "every packet passed or counted as dry_run"
    );
    assert!(
        c1[2] - c0[2] > sent.sent / 2,
        "would-be drops counted: {c0:?} -> {c1:?}"
    );

    edit_unseen(agent.config_path(), "dry_run = true ", "dry_run = false");
    edit_unseen(
        agent.config_path(),
        "max_buckets = 1024",
        "max_buckets = 2048",
    );
    assert_eq!(reloads(&agent), r0 + 1);
    let reloaded = agent.cli_json(&["rules", "reload"]);
    assert_eq!(
        reloaded,
        serde_json::json!({"reloaded": true, "rules": 1, "restart_needed": ["max_buckets"]})
    );
    let st = status(&agent);
    assert_eq!(st["reloads"]["ok"], r0 + 2);
    assert_eq!(st["dry_run"], false);
    assert_eq!(
        st["reloads"]["restart_needed"],
        serde_json::json!(["max_buckets"])
    );
    assert_eq!(
        st["buckets_capacity"], capacity,
        "max_buckets waits for a restart"
    );
    let human = agent.cli_ok(&["status"]);
    assert!(human.contains("max_buckets"), "{human}");
    let (sent, got) = bed.flood(FLOODER, 1000, Duration::from_secs(1));
    assert_limited("after rules reload", &sent, got, 100, 10);

    // SIGINT's default action would kill the agent (no exit status 0, pins left behind).
    let pin = agent.pin_path().to_owned();
    let exit = agent.stop_with(libc::SIGINT).unwrap();
    assert!(exit.success(), "{exit}");
    assert_eq!(bed.xdp(), None, "XDP left attached after SIGINT");
    assert!(!pin.exists(), "{} left behind after SIGINT", pin.display());
    let (sent, got) = bed.flood(FLOODER, 1000, Duration::from_secs(1));
    assert_unlimited("after SIGINT", &sent, got);
}

#[test]
fn socket_life_cycle_and_detach_of_a_killed_agent() {
    let bed = bed("sock");
    let dir = RemoveDir(PathBuf::from(format!(
        "/run/ratelimit-test-api-{}",
        std::process::id()
    )));
    let socket = dir.0.join("sub/agent.sock");
    let rules = "[[rule]]\nname = \"flood\"\nsource = \"198.18.0.0/24\"\nrate = 100\nburst = 10\n";
    let with_socket = format!(
        "[agent]\ninterfaces = [\"{}\"]\nsocket = \"{}\"\n\n{rules}",
        bed.rx_if,
        socket.display()
    );

    // The agent creates the socket's directory and makes the socket root-only.
    let mut agent = AgentProcess::start(&bed.rx, &with_socket, &[]).unwrap();
    assert_eq!(agent.socket_path(), socket);
    let meta = fs::symlink_metadata(&socket).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(
        meta.permissions().mode() & 0o777,
        0o600,
        "socket permissions"
    );
    assert_eq!(
        fs::metadata(socket.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o755
    );

    // A second agent on the same socket refuses to start and leaves the first one alone.
    let second = AgentProcess::spawn(&bed.rx, &with_socket, &[]).unwrap();
    let (status, log) = second.wait_exit(EXIT_TIMEOUT).unwrap();
    assert!(!status.success());
    assert!(
        log.contains(&format!("another agent is running on {}", socket.display())),
        "{log}"
    );
    assert_eq!(agent.cli_json(&["status"])["rules"], 1);
    assert!(bed.xdp().is_some());

    // Killed, the agent leaves its socket (stale) and its limiter (pinned) behind.
    let pin = agent.pin_path().to_owned();
    agent.crash().unwrap();
    let stderr = refused(&agent, &["status"]);
    assert_eq!(
        stderr,
        format!(
            "error: cannot reach the agent at {} (Connection refused): is it running? start it with \
             `ratelimit agent -c /etc/ratelimit/ratelimit.toml`\n",
            socket.display()
        )
    );
    assert!(bed.xdp().is_some(), "the pinned link keeps XDP attached");
    let (sent, got) = bed.flood(FLOODER, 1000, Duration::from_secs(1));
    assert_limited("after the crash", &sent, got, 100, 10);
    // Offline stats read the pinned maps.
    let offline = cli(
        &socket,
        &["stats", "--json", "--pin-path", pin.to_str().unwrap()],
    );
    assert!(offline.success());
    let stats: Value = serde_json::from_str(&offline.stdout).unwrap();
    assert_eq!(
        stats["rules"][0]["packets"]["dropped_rate"].as_u64(),
        Some(sent.sent - got),
        "the flood was the rule's only traffic: {stats}"
    );

    let out = cli(&socket, &["detach", "--pin-path", pin.to_str().unwrap()]);
    let (stdout, stderr) = (&out.stdout, &out.stderr);
    assert!(out.status.success(), "detach --pin-path failed: {stderr}");
    println!("{stderr}{stdout}");
    assert!(stdout.contains("XDP detached"), "{stdout}");
    assert_eq!(
        bed.xdp(),
        None,
        "XDP still attached after detach --pin-path"
    );
    assert!(!pin.exists(), "{} left behind", pin.display());
    let (sent, got) = bed.flood(FLOODER, 1000, Duration::from_secs(1));
    assert_unlimited("after detach --pin-path", &sent, got);
    drop(agent);

    // A new agent replaces the stale socket.
    let agent = AgentProcess::start(&bed.rx, &with_socket, &[]).unwrap();
    assert!(
        agent.log().contains("removing a stale control socket"),
        "{}",
        agent.log()
    );
    assert_eq!(agent.cli_json(&["status"])["rules"], 1);
    let status = agent.stop().unwrap();
    assert!(status.success());
    assert!(!socket.exists(), "the agent left its socket behind");
}
