//! The agent against a local user and against its own failures (issue #14), end to end with the
//! real agent in a fresh namespace and the real CLI:
//! - the config write-back never follows a file planted in the config's directory, and never
//!   writes into a config that another user owns;
//! - `rules add`/`remove` never drop an edit of the file that is not loaded yet (unless --force);
//! - a reload whose attach fails changes nothing: rules, interfaces, the program on the
//!   interfaces, one record per interface afterwards.

use std::fs;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use ratelimit_testbed::agent_proc::xdp_attachment;
use ratelimit_testbed::{agent_binary, require_root, veth_pair, AgentProcess, Netns};
use serde_json::Value;

mod pins;
mod planted;

/// One namespace pair joined by a veth; the agent runs in `rx` on `rx_if`.
struct Bed {
    _tx: Netns,
    rx: Netns,
    rx_if: String,
}

fn bed(tag: &str) -> Bed {
    require_root();
    let tx = Netns::new(&format!("rl-hard-{tag}-tx")).unwrap();
    let rx = Netns::new(&format!("rl-hard-{tag}-rx")).unwrap();
    let (_, rx_if) = veth_pair(&tx, &rx, "hd").unwrap();
    Bed { _tx: tx, rx, rx_if }
}

const RULE_A: &str = "[[rule]]\nname = \"a\"\nsource = \"198.18.0.0/24\"\nrate = 100\n";
/// `rules add` of a second rule beside [`RULE_A`], as the tests that write the config run it.
const ADD_RULE_B: &[&str] = &[
    "rules",
    "add",
    "--name",
    "b",
    "--source",
    "198.19.0.0/24",
    "--rate",
    "10",
];

fn config(interfaces: &[&str], mode: &str, rules: &str) -> String {
    let list: Vec<String> = interfaces.iter().map(|i| format!("\"{i}\"")).collect();
    format!(
        "[agent]\ninterfaces = [{}]\nmode = \"{mode}\"\n\n{rules}",
        list.join(", ")
    )
}

fn rule_names(agent: &AgentProcess) -> Vec<String> {
    agent.cli_json(&["rules", "list"])["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap().to_owned())
        .collect()
}

fn interfaces(status: &Value) -> Vec<String> {
    status["interfaces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["iface"].as_str().unwrap().to_owned())
        .collect()
}

/// Replaces the config file whole (by rename, as editors do), so the watcher never reads half.
fn rewrite(path: &Path, text: &str) {
    let tmp = path.with_extension("edit");
    fs::write(&tmp, text).unwrap();
    fs::rename(&tmp, path).unwrap();
}

/// Polls `f` every 20 ms until it holds; fails after `timeout` (a hang guard).
fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "{what}: not within {timeout:?}");
        thread::sleep(Duration::from_millis(20));
    }
}

fn reloads(agent: &AgentProcess) -> (u64, u64) {
    let st = agent.cli_json(&["status"]);
    (
        st["reloads"]["ok"].as_u64().unwrap(),
        st["reloads"]["failed"].as_u64().unwrap(),
    )
}

/// A local user who can write the config's directory plants a symlink at the name the write-back
/// used to open (`<config>.tmp-<pid>`), pointing at a file of root's: `rules add` must neither
/// truncate nor hand over that file, nor leave the config a symlink; the rule is written to the
/// config itself and nothing else is left in the directory.
#[test]
fn the_write_back_never_follows_a_planted_file() {
    let bed = bed("plant");
    let agent = AgentProcess::start(&bed.rx, &config(&[&bed.rx_if], "auto", RULE_A), &[]).unwrap();
    let pid = agent.cli_json(&["status"])["pid"].as_u64().unwrap();
    let dir = agent.config_path().parent().unwrap().to_owned();
    let victim_dir = tempfile_dir("rl-hard-victim");
    let victim = victim_dir.join("shadow");
    fs::write(&victim, "root:secret\n").unwrap();
    let name = agent.config_path().file_name().unwrap().to_string_lossy();
    let planted = dir.join(format!("{name}.tmp-{pid}"));
    std::os::unix::fs::symlink(&victim, &planted).unwrap();

    let added = agent.cli_json(ADD_RULE_B);
    assert_eq!(added["added"]["name"], "b");

    assert_eq!(
        fs::read_to_string(&victim).unwrap(),
        "root:secret\n",
        "the planted symlink was followed: the victim file was overwritten"
    );
    assert_eq!(
        fs::metadata(&victim).unwrap().uid(),
        0,
        "the victim changed hands"
    );
    let meta = fs::symlink_metadata(agent.config_path()).unwrap();
    assert!(
        meta.file_type().is_file(),
        "the config is no longer a regular file"
    );
    let text = fs::read_to_string(agent.config_path()).unwrap();
    assert!(text.contains("name = \"b\""), "rule b not written: {text}");
    // Only what the test and the agent's harness put there: no temporary file left behind.
    let mut left: Vec<String> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp"))
        .collect();
    left.sort();
    assert_eq!(left, [format!("{name}.tmp-{pid}")], "temporary files left");
    assert!(fs::symlink_metadata(&planted)
        .unwrap()
        .file_type()
        .is_symlink());

    agent.stop().unwrap();
    fs::remove_dir_all(victim_dir).unwrap();
}

/// A config file owned by another user is never written: `rules add` is refused naming the owner,
/// and the rules in force stay as they were.
#[test]
fn a_config_owned_by_another_user_is_not_written() {
    let bed = bed("owner");
    let agent = AgentProcess::start(&bed.rx, &config(&[&bed.rx_if], "auto", RULE_A), &[]).unwrap();
    let before = fs::read_to_string(agent.config_path()).unwrap();
    std::os::unix::fs::chown(agent.config_path(), Some(65534), Some(65534)).unwrap();

    let err = agent.cli_refused(ADD_RULE_B).stderr;
    assert!(err.contains("owned by uid 65534"), "{err}");
    assert_eq!(
        rule_names(&agent),
        ["a"],
        "a refused change left a rule in force"
    );
    assert_eq!(fs::read_to_string(agent.config_path()).unwrap(), before);
    assert_eq!(fs::metadata(agent.config_path()).unwrap().uid(), 65534);

    std::os::unix::fs::chown(agent.config_path(), Some(0), Some(0)).unwrap();
    agent.stop().unwrap();
}

/// An operator's edit that the agent has not loaded (here: refused, because it also names an
/// interface that does not exist) must not be overwritten by `rules add` or `rules remove`: both
/// are refused naming the rule that differs and `--force`; with `--force` the change is written.
#[test]
fn rules_add_and_remove_keep_an_edit_that_is_not_loaded() {
    let bed = bed("edit");
    let agent = AgentProcess::start(&bed.rx, &config(&[&bed.rx_if], "auto", RULE_A), &[]).unwrap();
    let text = fs::read_to_string(agent.config_path()).unwrap();
    let (_, failed0) = reloads(&agent);
    let edited = text.replace(
        &format!("interfaces = [\"{}\"]", bed.rx_if),
        &format!("interfaces = [\"{}\", \"rl-nosuch0\"]", bed.rx_if),
    ) + "\n[[rule]]\nname = \"edited\"\nsource = \"198.20.0.0/24\"\nrate = 5\n";
    assert_ne!(edited, text);
    rewrite(agent.config_path(), &edited);
    wait_until(
        "the edit refused by a reload",
        Duration::from_secs(10),
        || reloads(&agent).1 > failed0,
    );
    assert_eq!(rule_names(&agent), ["a"]);

    let err = agent.cli_refused(ADD_RULE_B).stderr;
    assert!(
        err.contains("rule \"edited\" added") && err.contains("--force"),
        "{err}"
    );
    let err = agent.cli_refused(&["rules", "remove", "a"]).stderr;
    assert!(
        err.contains("rule \"edited\" added") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(
        fs::read_to_string(agent.config_path()).unwrap(),
        edited,
        "a refused change touched the file"
    );
    assert_eq!(
        rule_names(&agent),
        ["a"],
        "a refused change touched the rules in force"
    );

    let mut forced = ADD_RULE_B.to_vec();
    forced.push("--force");
    agent.cli_json(&forced);
    assert_eq!(rule_names(&agent), ["a", "b"]);
    let now = fs::read_to_string(agent.config_path()).unwrap();
    assert!(
        now.contains("name = \"b\"") && !now.contains("name = \"edited\""),
        "{now}"
    );
    // The rest of the file as the operator wrote it: the interface list is not the agent's.
    assert!(now.contains("rl-nosuch0"), "{now}");

    // Put back a file the agent can load, so it stops cleanly with its rules.
    rewrite(agent.config_path(), &config(&[&bed.rx_if], "auto", RULE_A));
    agent.stop().unwrap();
}

/// A reload that adds a rule and two interfaces, the second of which cannot take the program
/// (a bridge in native mode), is refused whole: the rule is not in force, the first new
/// interface is left without the program, `status` and `config.agent` are as before. Fixed, the
/// next reload attaches once: one record per interface, and `detach` of it takes XDP off.
#[test]
fn a_reload_whose_attach_fails_changes_nothing() {
    let bed = bed("attach");
    bed.rx
        .ip(&[
            "link", "add", "rl-va", "type", "veth", "peer", "name", "rl-vb",
        ])
        .unwrap();
    bed.rx
        .ip(&["link", "add", "rl-br", "type", "bridge"])
        .unwrap();
    for dev in ["rl-va", "rl-vb", "rl-br"] {
        bed.rx.ip(&["link", "set", dev, "up"]).unwrap();
    }
    let agent =
        AgentProcess::start(&bed.rx, &config(&[&bed.rx_if], "native", RULE_A), &[]).unwrap();
    let text = fs::read_to_string(agent.config_path()).unwrap();
    let (ok0, failed0) = reloads(&agent);
    let with = |ifaces: &str, rule: bool| {
        let mut t = text.replace(&format!("interfaces = [\"{}\"]", bed.rx_if), ifaces);
        if rule {
            t.push_str("\n[[rule]]\nname = \"b\"\nsource = \"198.19.0.0/24\"\nrate = 10\n");
        }
        t
    };
    rewrite(
        agent.config_path(),
        &with(
            &format!("interfaces = [\"{}\", \"rl-va\", \"rl-br\"]", bed.rx_if),
            true,
        ),
    );
    wait_until("the reload refused", Duration::from_secs(10), || {
        reloads(&agent).1 > failed0
    });
    let st = agent.cli_json(&["status"]);
    assert!(
        st["reloads"]["last_error"]
            .as_str()
            .unwrap()
            .contains("rl-br"),
        "{}",
        st["reloads"]["last_error"]
    );
    assert_eq!(
        rule_names(&agent),
        ["a"],
        "the refused reload's rule is in force"
    );
    assert_eq!(interfaces(&st), std::slice::from_ref(&bed.rx_if));
    assert_eq!(
        xdp_attachment(&bed.rx, "rl-va").unwrap(),
        None,
        "rl-va kept the program"
    );
    assert_eq!(xdp_attachment(&bed.rx, "rl-br").unwrap(), None);
    assert_eq!(st["reloads"]["ok"].as_u64().unwrap(), ok0);

    rewrite(
        agent.config_path(),
        &with(
            &format!("interfaces = [\"{}\", \"rl-va\"]", bed.rx_if),
            true,
        ),
    );
    wait_until("the fixed reload applied", Duration::from_secs(10), || {
        reloads(&agent).0 > ok0
    });
    let st = agent.cli_json(&["status"]);
    assert_eq!(interfaces(&st), [bed.rx_if.clone(), "rl-va".to_owned()]);
    assert_eq!(rule_names(&agent), ["a", "b"]);
    assert!(xdp_attachment(&bed.rx, "rl-va").unwrap().is_some());
    // Once more with the same interfaces: nothing is attached (or recorded) twice.
    let (ok1, _) = reloads(&agent);
    agent.cli_json(&["rules", "reload"]);
    assert_eq!(reloads(&agent).0, ok1 + 1);
    let st = agent.cli_json(&["status"]);
    assert_eq!(interfaces(&st), [bed.rx_if.clone(), "rl-va".to_owned()]);

    agent.cli_json(&["detach", "--iface", "rl-va"]);
    assert_eq!(
        xdp_attachment(&bed.rx, "rl-va").unwrap(),
        None,
        "detach left the program on rl-va"
    );
    agent.stop().unwrap();
}

/// A fresh directory under the system temp dir, removed by the caller.
fn tempfile_dir(prefix: &str) -> std::path::PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = std::env::temp_dir().join(format!("{prefix}-{}-{nanos}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    dir
}

/// `ratelimit status --json`, failing if the agent does not answer within 5 s.
fn status_within_5s(agent: &AgentProcess) -> Value {
    let out = Command::new("timeout")
        .arg("5")
        .arg(agent_binary())
        .arg("--socket")
        .arg(agent.socket_path())
        .args(["status", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the agent did not answer `status` within 5 s ({}): {}\nagent log:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        agent.log()
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A `source_file` (or the config itself) that is a FIFO, a device such as /dev/zero, or larger
/// than 64 MiB is refused at once, naming the file and what it is; the agent keeps answering
/// and the rules in force stay.
#[test]
fn a_fifo_or_device_as_a_list_file_is_refused_quickly_and_the_agent_keeps_answering() {
    let bed = bed("fifo");
    let dir = tempfile_dir("rl-hard-fifo");
    let list = dir.join("list.txt");
    fs::write(&list, "198.18.5.0/24\n").unwrap();
    let with_list = |file: &Path| {
        format!(
            "[agent]\ninterfaces = [\"{}\"]\n\n[[rule]]\nname = \"listed\"\nsource_file = \"{}\"\nrate = 10\n",
            bed.rx_if,
            file.display()
        )
    };
    let agent = AgentProcess::start(&bed.rx, &with_list(&list), &[]).unwrap();
    let failed = |st: &Value| st["reloads"]["failed"].as_u64().unwrap();
    // The failed-reload count is read before the config is rewritten: read after, it could
    // already hold the refusal (the agent watches the file), and the wait would never end.
    let refused_with = |what: &str, config: &str, expect: &[&str]| {
        let before = failed(&status_within_5s(&agent));
        rewrite(agent.config_path(), config);
        let t0 = Instant::now();
        let st = loop {
            let st = status_within_5s(&agent);
            if failed(&st) > before {
                break st;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "{what}: no refused reload"
            );
            thread::sleep(Duration::from_millis(50));
        };
        let err = st["reloads"]["last_error"].as_str().unwrap().to_owned();
        for e in expect {
            assert!(err.contains(e), "{what}: {err:?} does not say {e:?}");
        }
        assert_eq!(rule_names(&agent), ["listed"]);
        println!("{what}: refused in {:?}: {err}", t0.elapsed());
    };

    // The list replaced by a FIFO nobody writes to (opening it would block).
    let fifo = dir.join("fifo.txt");
    let ok = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(ok.success());
    let text = fs::read_to_string(agent.config_path()).unwrap();
    refused_with(
        "a FIFO as the list",
        &text.replace(&list.display().to_string(), &fifo.display().to_string()),
        &["fifo.txt", "a FIFO"],
    );

    // The list pointing at /dev/zero (reading it whole would never end).
    refused_with(
        "/dev/zero as the list",
        &text.replace(&list.display().to_string(), "/dev/zero"),
        &["/dev/zero", "a device"],
    );

    // A list over the limit (sparse: no disk used).
    let big = dir.join("big.txt");
    fs::File::create(&big)
        .unwrap()
        .set_len((64 << 20) + 1)
        .unwrap();
    refused_with(
        "a list over 64 MiB",
        &text.replace(&list.display().to_string(), &big.display().to_string()),
        &["big.txt", "larger than 64 MiB"],
    );

    rewrite(agent.config_path(), &text);
    agent.stop().unwrap();
    fs::remove_dir_all(&dir).unwrap();
}
