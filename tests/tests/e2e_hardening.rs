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

/// Pins whose layout stamp is not this version's (as a release that reorders a pinned record's
/// fields at the same size would leave, or one without a map this version pins: the IPv4 table's
/// pin is removed too) are refused by the agent, by `stats --pin-path` and by anything that
/// opens them, with a message that says how to move on; nothing pinned changes and the program
/// left attached keeps running until `detach --pin-path` removes it.
#[test]
fn pins_of_another_layout_are_refused_not_misread() {
    let bed = bed("layout");
    let first = AgentProcess::start(
        &bed.rx,
        &config(&[&bed.rx_if], "auto", RULE_A),
        &["--keep-attached"],
    )
    .unwrap();
    let (status, kept) = first.stop_keeping_pins().unwrap();
    assert!(status.success());
    let dir = kept.path().to_owned();
    let stamp = {
        let mut maps = ratelimit::maps::PinnedMaps::open(&dir).unwrap();
        let config = maps.config().unwrap();
        assert_eq!(
            config.layout,
            ratelimit_common::layout::STAMP,
            "new pins carry the stamp"
        );
        maps.set_config(ratelimit_common::Config {
            layout: config.layout ^ 0x5a5a,
            ..config
        })
        .unwrap();
        config.layout ^ 0x5a5a
    };
    fs::remove_file(dir.join(ratelimit_common::map_names::V4_TABLE)).unwrap();
    let expect_refusal = |what: &str, text: &str| {
        assert!(
            text.contains(&format!("layout stamp {stamp:08x}"))
                && text.contains(&format!("ratelimit detach --pin-path {}", dir.display())),
            "{what} did not refuse the pins of another layout: {text}"
        );
    };
    assert!(matches!(
        ratelimit::maps::PinnedMaps::open(&dir),
        Err(ratelimit::maps::MapsError::Mismatch { .. })
    ));

    let out = Command::new(agent_binary())
        .args(["stats", "--pin-path"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    expect_refusal("stats --pin-path", &String::from_utf8_lossy(&out.stderr));

    // An agent told to use them, in the namespace of the interface.
    let (status, log) = agent_on_pins(&bed, &dir, "an agent given pins of another layout");
    assert!(
        !status.success(),
        "an agent adopted pins of another layout: {log}"
    );
    expect_refusal("the agent", &log);

    // Nothing changed: the program the first agent left still runs on the interface.
    assert!(xdp_attachment(&bed.rx, &bed.rx_if).unwrap().is_some());
    let out = Command::new(agent_binary())
        .args([
            "--socket",
            "/nonexistent/rl-hard.sock",
            "detach",
            "--pin-path",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "detach --pin-path: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(xdp_attachment(&bed.rx, &bed.rx_if).unwrap(), None);
    assert!(!dir.exists());
    drop(kept);
}

/// Runs an agent on the pins in `dir` for `bed`'s interface until it exits (it is expected to
/// refuse them): in the interface's network namespace by `nsenter`, which keeps the host's bpffs
/// where the pins are (the testbed's `AgentProcess` would remove them when it is dropped).
fn agent_on_pins(bed: &Bed, dir: &Path, what: &str) -> (std::process::ExitStatus, String) {
    let tmp = tempfile_dir("rl-hard-pins");
    let cfg = tmp.join("ratelimit.toml");
    fs::write(
        &cfg,
        format!(
            "[agent]\ninterfaces = [\"{}\"]\npin_path = \"{}\"\nsocket = \"{}\"\n\n{RULE_A}",
            bed.rx_if,
            dir.display(),
            tmp.join("agent.sock").display()
        ),
    )
    .unwrap();
    let child = Command::new("nsenter")
        .arg(format!("--net={}", bed.rx.path().display()))
        .arg(agent_binary())
        .args(["agent", "-c"])
        .arg(&cfg)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait_child(child, what);
    fs::remove_dir_all(&tmp).unwrap();
    out
}

/// Waits for `child` to exit (a hang guard), returning its status and what it wrote to stderr.
fn wait_child(mut child: std::process::Child, what: &str) -> (std::process::ExitStatus, String) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("{what} did not exit");
        }
        thread::sleep(Duration::from_millis(20));
    };
    let mut log = String::new();
    if let Some(mut err) = child.stderr.take() {
        std::io::Read::read_to_string(&mut err, &mut log).unwrap();
    }
    (status, log)
}

/// The entries the agent moved aside from `pin` (`NAME_quarantine_*` beside it).
fn quarantined(pin: &Path) -> Vec<std::path::PathBuf> {
    let prefix = format!("{}_quarantine_", pin.file_name().unwrap().to_string_lossy());
    let mut found: Vec<_> = fs::read_dir(pin.parent().unwrap())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect();
    found.sort();
    found
}

/// Removes what the agent moved aside from `pin`, pins included.
fn remove_quarantined(pin: &Path) {
    for q in quarantined(pin) {
        if fs::symlink_metadata(&q).unwrap().is_dir() {
            ratelimit::dataplane::remove_pin_dir(&q).unwrap();
            let _ = fs::remove_dir_all(&q);
        } else {
            fs::remove_file(&q).unwrap();
        }
    }
}

/// Another user created the pin directory before the agent (possible wherever bpffs has the
/// kernel's default mode, 1777) and holds a lock on it: the agent is not blocked. A directory
/// holding none of ratelimit's pins is not trusted either: it is moved aside and replaced by one
/// of the agent's own, mode 0700, that no other user can open (so no other user can take its
/// lock).
#[test]
fn a_planted_locked_pin_directory_neither_blocks_nor_is_trusted() {
    use std::os::fd::AsRawFd as _;
    let bed = bed("plantdir");
    let pin = AgentProcess::unique_pin_path();
    fs::create_dir(&pin).unwrap();
    std::os::unix::fs::chown(&pin, Some(65534), Some(65534)).unwrap();
    let planted = fs::File::open(&pin).unwrap();
    // SAFETY: flock on a descriptor we own.
    assert_eq!(
        unsafe { libc::flock(planted.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
        0
    );
    let cfg = format!(
        "[agent]\ninterfaces = [\"{}\"]\npin_path = \"{}\"\n\n{RULE_A}",
        bed.rx_if,
        pin.display()
    );
    let agent = AgentProcess::start(&bed.rx, &cfg, &[]);
    let aside = quarantined(&pin);
    remove_quarantined(&pin);
    let agent = agent.unwrap();
    let meta = fs::symlink_metadata(&pin).unwrap();
    assert!(meta.is_dir());
    assert_eq!(
        meta.uid(),
        0,
        "the agent uses a pin directory another user owns"
    );
    assert_eq!(
        meta.mode() & 0o7777,
        0o700,
        "pin directory mode {:o}",
        meta.mode()
    );
    assert!(
        agent.log().contains("moved it aside") && agent.log().contains("uid 65534"),
        "{}",
        agent.log()
    );
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert_eq!(rule_names(&agent), ["a"]);
    agent.stop().unwrap();
    drop(planted);
}

/// A pin directory of another user is never used, even one that holds real pins (which no user
/// without CAP_BPF can create: root made them, and the directory changed hands): it is moved
/// aside, pins and all, and the agent starts on fresh pins of its own.
#[test]
fn a_pin_directory_of_another_user_is_moved_aside_even_with_pins() {
    use std::os::unix::fs::MetadataExt as _;
    let bed = bed("foreign");
    let first = AgentProcess::start(
        &bed.rx,
        &config(&[&bed.rx_if], "auto", RULE_A),
        &["--keep-attached"],
    )
    .unwrap();
    let (_, kept) = first.stop_keeping_pins().unwrap();
    let dir = kept.path().to_owned();
    // Without its links: the program leaves the interface, for the next agent to attach.
    ratelimit::dataplane::remove_link_pins(&dir).unwrap();
    let old_config = fs::metadata(dir.join("RL_CONFIG")).unwrap().ino();
    std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();

    let cfg = format!(
        "[agent]\ninterfaces = [\"{}\"]\npin_path = \"{}\"\n\n{RULE_A}",
        bed.rx_if,
        dir.display()
    );
    let agent = AgentProcess::start(&bed.rx, &cfg, &[]);
    let aside = quarantined(&dir);
    let aside_config = aside
        .first()
        .and_then(|q| fs::metadata(q.join("RL_CONFIG")).ok())
        .map(|m| m.ino());
    remove_quarantined(&dir);
    let agent = agent.unwrap();
    let log = agent.log();
    assert!(log.contains("moved it aside"), "{log}");
    let meta = fs::symlink_metadata(&dir).unwrap();
    assert_eq!((meta.uid(), meta.mode() & 0o7777), (0, 0o700));
    assert_eq!(
        aside_config,
        Some(old_config),
        "the old pins were not moved aside"
    );
    assert_ne!(
        fs::metadata(dir.join("RL_CONFIG")).unwrap().ino(),
        old_config,
        "the agent used the pins of a directory another user owns"
    );
    assert_eq!(rule_names(&agent), ["a"]);
    agent.stop().unwrap();
    drop(kept);
}

/// A bpffs of the test's own with the kernel's default mode (1777: anyone may create directories
/// and symlinks in it), mounted in the host's mount namespace on a fresh temp directory, so no
/// test touches the host's /sys/fs/bpf. Unmounted, with everything pinned in it, on drop.
struct OpenBpffs {
    dir: std::path::PathBuf,
    mnt: std::path::PathBuf,
}

impl OpenBpffs {
    fn new(tag: &str) -> Self {
        let dir = tempfile_dir(&format!("rl-hard-bpffs-{tag}"));
        let mnt = dir.join("bpf");
        fs::create_dir(&mnt).unwrap();
        let status = Command::new("mount")
            .args(["-t", "bpf", "-o", "mode=1777", "bpf"])
            .arg(&mnt)
            .status()
            .unwrap();
        assert!(status.success(), "mount -t bpf {}", mnt.display());
        assert_eq!(fs::metadata(&mnt).unwrap().mode() & 0o7777, 0o1777);
        Self { dir, mnt }
    }
}

impl Drop for OpenBpffs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Runs `script` with `sh` as uid/gid 65534 (nobody), without supplementary groups: what any
/// local user can do.
fn as_nobody(script: &str) {
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "sh",
            "-ec",
            script,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "as nobody: {script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// An agent on `bed`'s interface with its pins at `pin`, in the host's mount namespace (it sees
/// the test's bpffs) and with only the capabilities the shipped systemd unit gives it (so not
/// CAP_DAC_OVERRIDE nor CAP_FOWNER). Stopped (SIGTERM) and waited for on drop.
struct Agent {
    child: std::process::Child,
    tmp: std::path::PathBuf,
    log: std::path::PathBuf,
}

impl Agent {
    fn start(bed: &Bed, pin: &Path) -> Self {
        let tmp = tempfile_dir("rl-hard-agent");
        let cfg = tmp.join("ratelimit.toml");
        fs::write(
            &cfg,
            format!(
                "[agent]\ninterfaces = [\"{}\"]\npin_path = \"{}\"\nsocket = \"{}\"\n\n{RULE_A}",
                bed.rx_if,
                pin.display(),
                tmp.join("agent.sock").display()
            ),
        )
        .unwrap();
        let log = tmp.join("agent.log");
        let child = Command::new("nsenter")
            .arg(format!("--net={}", bed.rx.path().display()))
            .args([
                "setpriv",
                "--inh-caps=-all",
                "--bounding-set=-all,+bpf,+net_admin,+perfmon",
            ])
            .arg(agent_binary())
            .args(["agent", "-c"])
            .arg(&cfg)
            .env("NO_COLOR", "1")
            .stdout(std::process::Stdio::null())
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut agent = Self { child, tmp, log };
        wait_until("the agent running", Duration::from_secs(20), || {
            if let Some(status) = agent.child.try_wait().unwrap() {
                panic!("the agent exited ({status}): {}", agent.log());
            }
            agent.log().contains("running;")
        });
        agent
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, and the exit status must be success.
    fn stop(mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(i32::try_from(self.child.id()).unwrap(), libc::SIGTERM) };
        let status = self.child.wait().unwrap();
        assert!(status.success(), "agent exit {status}: {}", self.log());
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(i32::try_from(self.child.id()).unwrap(), libc::SIGTERM) };
            let _ = self.child.wait();
        }
        let _ = fs::remove_dir_all(&self.tmp);
    }
}

/// The pin directory is the agent's own (root's, mode 0700, a real directory), it holds the
/// agent's pins and its link for `bed`'s interface, and the program is on the interface.
fn assert_owned_and_enforcing(bed: &Bed, pin: &Path, agent: &Agent) {
    let meta = fs::symlink_metadata(pin).unwrap();
    assert!(meta.is_dir(), "{}: {:?}", pin.display(), meta.file_type());
    assert_eq!(
        (meta.uid(), meta.mode() & 0o7777),
        (0, 0o700),
        "pin directory owner and mode: {}",
        agent.log()
    );
    for name in ["RL_CONFIG".to_owned(), format!("link_{}", bed.rx_if)] {
        let m = fs::symlink_metadata(pin.join(&name)).unwrap();
        assert!(m.is_file() && m.uid() == 0, "{name}: {m:?}");
    }
    assert!(
        xdp_attachment(&bed.rx, &bed.rx_if).unwrap().is_some(),
        "no program on the interface: {}",
        agent.log()
    );
}

/// A victim directory of root's, outside the bpffs, for planted symlinks to point at: it must
/// keep its mode and stay empty.
fn victim(bpffs: &OpenBpffs) -> std::path::PathBuf {
    let victim = bpffs.dir.join("victim");
    fs::create_dir(&victim).unwrap();
    fs::set_permissions(&victim, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    victim
}

fn assert_untouched(victim: &Path) {
    let meta = fs::symlink_metadata(victim).unwrap();
    assert_eq!(
        (meta.uid(), meta.mode() & 0o7777),
        (0, 0o755),
        "victim changed"
    );
    assert_eq!(fs::read_dir(victim).unwrap().count(), 0, "victim written");
}

/// A symlink another user planted at the pin path, on a bpffs anyone may write to, neither
/// blocks the agent nor is followed: it is moved aside, and the agent pins into a directory of
/// its own.
#[test]
fn a_symlink_at_the_pin_path_neither_blocks_nor_is_followed() {
    let bed = bed("pinlink");
    let bpffs = OpenBpffs::new("pinlink");
    let victim = victim(&bpffs);
    let pin = bpffs.mnt.join("ratelimit");
    as_nobody(&format!("ln -s {} {}", victim.display(), pin.display()));
    let agent = Agent::start(&bed, &pin);
    assert_owned_and_enforcing(&bed, &pin, &agent);
    assert_untouched(&victim);
    let aside = quarantined(&pin);
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert!(fs::symlink_metadata(&aside[0]).unwrap().is_symlink());
    let log = agent.log();
    assert!(
        log.contains("moved it aside") && log.contains("symlink of uid 65534"),
        "{log}"
    );
    agent.stop();
    assert_untouched(&victim);
}

/// A directory another user planted at the pin path with entries named like the agent's pins
/// (directories: no user without CAP_BPF can create pins), nested and not readable by root
/// without CAP_DAC_OVERRIDE, neither blocks the agent (which runs with the systemd unit's
/// capabilities) nor is obeyed: it is moved aside whole.
#[test]
fn a_planted_pin_directory_with_pin_names_is_moved_aside_not_obeyed() {
    let bed = bed("pinnames");
    let bpffs = OpenBpffs::new("pinnames");
    let pin = bpffs.mnt.join("ratelimit");
    as_nobody(&format!(
        "mkdir -p {p}/RL_CONFIG/x {p}/link_{i}/y && chmod 0700 {p}/RL_CONFIG && chmod 0755 {p}",
        p = pin.display(),
        i = bed.rx_if
    ));
    let agent = Agent::start(&bed, &pin);
    assert_owned_and_enforcing(&bed, &pin, &agent);
    let aside = quarantined(&pin);
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert!(
        aside[0].join("RL_CONFIG/x").is_dir(),
        "the planted tree moved whole"
    );
    assert!(agent.log().contains("moved it aside"), "{}", agent.log());
    agent.stop();

    // The same, in a directory of root's that others may write to (an operator's `mkdir` with
    // mode 1777): the planted entries, not the directory's owner, get it moved aside.
    fs::create_dir(&pin).unwrap();
    fs::set_permissions(&pin, std::os::unix::fs::PermissionsExt::from_mode(0o1777)).unwrap();
    as_nobody(&format!("mkdir {}/RL_CONFIG", pin.display()));
    let agent = Agent::start(&bed, &pin);
    assert_owned_and_enforcing(&bed, &pin, &agent);
    assert_eq!(quarantined(&pin).len(), 2);
    assert!(
        agent
            .log()
            .contains("\"RL_CONFIG\", a directory of uid 65534"),
        "{}",
        agent.log()
    );
    agent.stop();
}

/// Another user racing the agent for the pin path (a directory or a symlink planted there and
/// created again as fast as possible whenever the name is free, or created and removed in turn)
/// never gets the agent to use a directory that is not its own, to follow a symlink, or to give
/// up: after each of many starts the pin directory is root's, mode 0700, and the agent enforces.
#[test]
fn a_pin_path_raced_by_another_user_ends_as_the_agents_own() {
    use std::ffi::CString;
    let bed = bed("pinrace");
    let bpffs = OpenBpffs::new("pinrace");
    let victim = victim(&bpffs);
    let pin = bpffs.mnt.join("ratelimit");
    let c_pin = CString::new(pin.to_str().unwrap()).unwrap();
    let c_victim = CString::new(victim.to_str().unwrap()).unwrap();
    for round in 0..16 {
        let churn = round % 2 == 1;
        // SAFETY: getpid has no preconditions.
        let parent = unsafe { libc::getpid() };
        // SAFETY: the child makes only async-signal-safe system calls and never returns.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: plain system calls on NUL-terminated strings made before the fork.
            unsafe {
                // After setuid, which clears the parent-death signal: the racer dies with the
                // test's thread (a failed assertion included).
                if libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setgid(65534) != 0
                    || libc::setuid(65534) != 0
                    || libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0
                    || libc::getppid() != parent
                {
                    libc::_exit(1);
                }
                loop {
                    libc::mkdir(c_pin.as_ptr(), 0o777);
                    if churn {
                        libc::rmdir(c_pin.as_ptr());
                    }
                    libc::symlink(c_victim.as_ptr(), c_pin.as_ptr());
                    if churn {
                        libc::unlink(c_pin.as_ptr());
                    }
                }
            }
        }
        // Let the racer plant something first.
        thread::sleep(Duration::from_millis(20));
        let agent = Agent::start(&bed, &pin);
        let check = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            assert_owned_and_enforcing(&bed, &pin, &agent);
            assert_untouched(&victim);
        }));
        // SAFETY: killing and reaping our own child.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
        if let Err(e) = check {
            std::panic::resume_unwind(e);
        }
        agent.stop();
        assert_untouched(&victim);
        // What the racer left: gone before the next round.
        let _ = fs::remove_file(&pin);
        let _ = fs::remove_dir(&pin);
    }
    // The racer did get in the agent's way (else this tested nothing).
    let aside = quarantined(&pin);
    eprintln!("{} entries moved aside in 16 starts", aside.len());
    assert!(aside.len() >= 8, "{aside:?}");
}

/// An agent whose /sys/fs/bpf is a bpffs of its own mount namespace (a container with its own
/// bpffs; `ip netns exec`) says at start that its pins, and enforcement after it exits, end with
/// that namespace.
#[test]
fn a_private_bpffs_is_warned_about() {
    let bed = bed("private");
    let tmp = tempfile_dir("rl-hard-private");
    let cfg = tmp.join("ratelimit.toml");
    fs::write(
        &cfg,
        format!(
            "[agent]\ninterfaces = [\"{}\"]\npin_path = \"/sys/fs/bpf/rl-hard-private\"\nsocket = \"{}\"\n\n{RULE_A}",
            bed.rx_if,
            tmp.join("agent.sock").display()
        ),
    )
    .unwrap();
    let log_path = tmp.join("agent.log");
    let log = fs::File::create(&log_path).unwrap();
    let launch =
        r#"mount -t bpf -o mode=0700 bpf /sys/fs/bpf || exit 125; exec nsenter --net="$0" "$@""#;
    let mut child = Command::new("unshare")
        .args([
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            launch,
        ])
        .arg(bed.rx.path())
        .arg(agent_binary())
        .args(["agent", "-c"])
        .arg(&cfg)
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    wait_until("the agent running", Duration::from_secs(20), || {
        assert!(
            child.try_wait().unwrap().is_none(),
            "{}",
            fs::read_to_string(&log_path).unwrap()
        );
        fs::read_to_string(&log_path).unwrap().contains("running;")
    });
    // SAFETY: signalling our own child.
    unsafe { libc::kill(i32::try_from(child.id()).unwrap(), libc::SIGTERM) };
    let status = child.wait().unwrap();
    let text = fs::read_to_string(&log_path).unwrap();
    assert!(status.success(), "{text}");
    assert!(
        text.contains("private to this agent's mount namespace") && text.contains("nsenter --net"),
        "no warning about the private bpffs: {text}"
    );
    assert!(!Path::new("/sys/fs/bpf/rl-hard-private").exists());
    fs::remove_dir_all(&tmp).unwrap();
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

/// A directory of root's at the pin path that another user opened while its mode let them (an
/// operator's `mkdir`, mode 0755) and keeps locked after it became 0700 does not block the agent:
/// the lock's holder runs as another user, so it is no agent, and the directory is moved aside.
#[test]
fn a_pin_directory_locked_by_another_user_does_not_block() {
    use std::os::fd::AsRawFd as _;
    use std::os::unix::process::CommandExt as _;
    let bed = bed("pinlock");
    let bpffs = OpenBpffs::new("pinlock");
    let pin = bpffs.mnt.join("ratelimit");
    fs::create_dir(&pin).unwrap();
    fs::set_permissions(&pin, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut holder = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .args(["flock", "--nonblock", "--close"])
        .arg(&pin)
        .args(["sleep", "60"])
        .process_group(0)
        .spawn()
        .unwrap();
    let kill_holder = |holder: &mut std::process::Child| {
        // SAFETY: killing the process group of our own child.
        unsafe { libc::kill(-i32::try_from(holder.id()).unwrap(), libc::SIGKILL) };
        let _ = holder.wait();
    };
    let probe = fs::File::open(&pin).unwrap();
    wait_until("the other user's lock", Duration::from_secs(5), || {
        // SAFETY: flock on a descriptor we own.
        let held = unsafe { libc::flock(probe.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0;
        if !held {
            // SAFETY: as above.
            unsafe { libc::flock(probe.as_raw_fd(), libc::LOCK_UN) };
        }
        held
    });
    drop(probe);
    fs::set_permissions(&pin, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let agent = std::panic::catch_unwind(|| Agent::start(&bed, &pin));
    kill_holder(&mut holder);
    let agent = agent.unwrap_or_else(|e| std::panic::resume_unwind(e));
    assert_owned_and_enforcing(&bed, &pin, &agent);
    assert_eq!(quarantined(&pin).len(), 1);
    let log = agent.log();
    assert!(
        log.contains("locked by process") && log.contains("of uid 65534"),
        "{log}"
    );
    agent.stop();
}

/// `ratelimit detach --pin-path` follows no symlink and removes nothing from another user's
/// directory: a symlink planted at a pin path (anyone may, on a bpffs of mode 1777) that points at
/// a directory holding files named like pins leaves them in place, as does a directory another
/// user made there. The command says why, naming the path.
#[test]
fn detach_follows_no_planted_symlink_and_leaves_another_users_directory_alone() {
    require_root();
    /// Removes the test's directory however the test ends.
    struct Removed(std::path::PathBuf);
    impl Drop for Removed {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }
    let guard = Removed(tempfile_dir("rl-hard-detach"));
    let base = guard.0.clone();
    let victim = base.join("victim");
    fs::create_dir(&victim).unwrap();
    for name in ["RL_CONFIG", "RL_BUCKETS", "link_eth0"] {
        fs::write(victim.join(name), b"precious").unwrap();
    }
    let planted = base.join("planted");
    std::os::unix::fs::symlink(&victim, &planted).unwrap();
    let foreign = base.join("foreign");
    fs::create_dir(&foreign).unwrap();
    fs::write(foreign.join("RL_CONFIG"), b"theirs").unwrap();
    std::os::unix::fs::chown(&foreign, Some(65534), Some(65534)).unwrap();

    let detach = |dir: &Path| {
        let out = Command::new(agent_binary())
            .args(["detach", "--pin-path"])
            .arg(dir)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, err) = detach(&planted);
    assert!(!ok, "detach followed a symlink");
    assert!(
        err.contains("symlink") && err.contains(&planted.display().to_string()),
        "{err}"
    );
    for name in ["RL_CONFIG", "RL_BUCKETS", "link_eth0"] {
        assert!(
            victim.join(name).exists(),
            "{name} removed through the symlink"
        );
    }
    let (ok, err) = detach(&foreign);
    assert!(!ok, "detach emptied another user's directory");
    assert!(err.contains("uid 65534"), "{err}");
    assert!(foreign.join("RL_CONFIG").exists());
    drop(guard);
}
