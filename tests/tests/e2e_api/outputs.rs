//! The CLI's own contracts: what it says with no agent to talk to, every field the docs show in
//! `stats --json` (from the agent and from the pinned maps), and `check` without an agent.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::{bed, config, RemoveDir, FLOODER};
use ratelimit_testbed::agent_proc::rule_packets;
use ratelimit_testbed::{agent_binary, cli, AgentProcess};
use serde_json::Value;

#[test]
fn without_an_agent_the_cli_says_how_to_start_one() {
    let socket = std::env::temp_dir().join(format!("rl-api-nobody-{}.sock", std::process::id()));
    for args in [
        &["status"][..],
        &["rules", "list", "--json"],
        &["top"],
        &["stats"],
        &["explain", "198.18.0.1"],
        &["detach"],
    ] {
        let out = cli(&socket, args);
        assert!(
            !out.status.success(),
            "`{}` succeeded without an agent",
            args.join(" ")
        );
        assert!(out.stdout.is_empty());
        assert_eq!(
            out.stderr,
            format!(
                "error: cannot reach the agent at {} (No such file or directory): is it running? \
                 start it with `ratelimit agent -c /etc/ratelimit/ratelimit.toml`\n",
                socket.display()
            ),
            "`ratelimit {}`",
            args.join(" ")
        );
    }
}

/// Every key path of `readme` (the documented example) is in `actual` with the same JSON type; in
/// arrays, every element of `actual` has the shape of the example's first. Returns what is missing.
pub(crate) fn missing_fields(readme: &Value, actual: &Value, path: &str, out: &mut Vec<String>) {
    let kind = |v: &Value| match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    };
    if kind(readme) != kind(actual) {
        out.push(format!(
            "{path}: {} in docs/operations.md, {} now",
            kind(readme),
            kind(actual)
        ));
        return;
    }
    match (readme, actual) {
        (Value::Object(want), Value::Object(got)) => {
            for (k, v) in want {
                match got.get(k) {
                    Some(g) => missing_fields(v, g, &format!("{path}.{k}"), out),
                    None => out.push(format!("{path}.{k}: gone")),
                }
            }
        }
        (Value::Array(want), Value::Array(got)) => {
            if let Some(first) = want.first() {
                assert!(!got.is_empty(), "{path}: an empty array cannot be compared");
                for (i, g) in got.iter().enumerate() {
                    missing_fields(first, g, &format!("{path}[{i}]"), out);
                }
            }
        }
        _ => {}
    }
}

/// docs/operations.md, "Counters": "`ratelimit stats --json` prints one object ... Fields may be
/// added; none will be renamed or removed." The documented example is the contract: the agent's
/// answer and the offline read of the pinned maps have every one of its fields, with its type.
#[test]
fn stats_json_has_every_field_the_readme_shows() {
    let readme = include_str!("../../../docs/operations.md");
    let start = readme
        .find("`ratelimit stats --json` prints one object:")
        .expect("docs/operations.md's stats --json section");
    let block = &readme[start..];
    let json_start = block.find("```json\n").expect("its example") + "```json\n".len();
    let json_end = json_start + block[json_start..].find("```").unwrap();
    let example: Value = serde_json::from_str(&block[json_start..json_end])
        .unwrap_or_else(|e| panic!("the documented stats example is not JSON: {e}"));

    let bed = bed("fields");
    let rules = "[[rule]]\nname = \"flood\"\nsource = \"198.18.0.0/24\"\nrate = 100\nburst = 10\n";
    let agent = AgentProcess::start(&bed.rx, &config(&bed.rx_if, rules), &[]).unwrap();
    let (sent, got) = bed.flood(FLOODER, 1000, Duration::from_millis(300));
    assert!(got < sent.sent, "the rule dropped nothing");
    let online = agent.cli_json(&["stats"]);
    let offline = agent.stats();
    for (what, actual) in [
        ("stats --json", &online),
        ("stats --json --pin-path", &offline),
    ] {
        let mut missing = Vec::new();
        missing_fields(&example, actual, "", &mut missing);
        assert!(
            missing.is_empty(),
            "`{what}` lost fields docs/operations.md promises: {missing:?}\n{actual}"
        );
    }
    assert_eq!(
        rule_packets(&online, "flood", "dropped_rate"),
        sent.sent - got,
        "{online}"
    );
    assert!(agent.stop().unwrap().success());
}

/// `ratelimit check -c FILE` validates a config without an agent: a good one is summarised
/// (exit 0), a bad one refused naming the file, line and field (exit non-zero); the file is left
/// as it was either way.
#[test]
fn check_validates_a_config_without_an_agent() {
    let dir = RemoveDir(std::env::temp_dir().join(format!("rl-api-check-{}", std::process::id())));
    fs::create_dir_all(&dir.0).unwrap();
    let good = dir.0.join("good.toml");
    let bad = dir.0.join("bad.toml");
    let good_text = "[agent]\ninterfaces = [\"rlnosuch0\"]\n\n[[rule]]\nname = \"a\"\n\
                     source = \"198.18.0.0/24\"\nrate = 10\n\n[[rule]]\nname = \"b\"\n\
                     source = [\"198.18.1.0/24\", \"2001:db8::/32\"]\naction = \"deny\"\n";
    let bad_text = "[agent]\ninterfaces = [\"rlnosuch0\"]\n\n[[rule]]\nname = \"a\"\n\
                    source = \"198.18.0.0/24\"\nrate = 10\ndst_port = 53\n";
    fs::write(&good, good_text).unwrap();
    fs::write(&bad, bad_text).unwrap();
    let run = |path: &Path| {
        Command::new(agent_binary())
            .args(["check", "-c"])
            .arg(path)
            .output()
            .unwrap()
    };
    let out = run(&good);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("{}: ok: 2 rules, 3 prefixes\n", good.display()),
        "a good config (its interface need not exist: check changes nothing and attaches nothing)"
    );
    let out = run(&bad);
    assert!(!out.status.success(), "a bad config passed: {out:?}");
    assert!(out.stdout.is_empty());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("{}:8:", bad.display())) && stderr.contains("field `dst_port`"),
        "{stderr}"
    );
    assert_eq!(fs::read_to_string(&good).unwrap(), good_text);
    assert_eq!(fs::read_to_string(&bad).unwrap(), bad_text);
}
