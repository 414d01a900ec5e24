//! Pin directories the agent does not own: another layout's pins, a directory planted or locked
//! by another user, with or without pins in it, and `detach` past planted symlinks.

use std::fs;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use crate::planted::{assert_owned_and_enforcing, Agent, OpenBpffs};
use crate::{bed, config, rule_names, tempfile_dir, wait_until, Bed, RULE_A};
use ratelimit_testbed::agent_proc::xdp_attachment;
use ratelimit_testbed::{agent_binary, require_root, AgentProcess};

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
pub(crate) fn agent_on_pins(
    bed: &Bed,
    dir: &Path,
    what: &str,
) -> (std::process::ExitStatus, String) {
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
pub(crate) fn wait_child(
    mut child: std::process::Child,
    what: &str,
) -> (std::process::ExitStatus, String) {
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
pub(crate) fn quarantined(pin: &Path) -> Vec<std::path::PathBuf> {
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
pub(crate) fn remove_quarantined(pin: &Path) {
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
