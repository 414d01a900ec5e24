//! Another user on the same bpffs: a symlink or pin names planted at the pin path, a pin path
//! raced while the agent makes it, and a bpffs private to the agent's mount namespace.

use std::fs;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;
use std::process::Command;
use std::thread;
use std::time::Duration;

use crate::pins::quarantined;
use crate::{bed, tempfile_dir, wait_until, Bed, RULE_A};
use ratelimit_testbed::agent_binary;
use ratelimit_testbed::agent_proc::xdp_attachment;

/// A bpffs of the test's own with the kernel's default mode (1777: anyone may create directories
/// and symlinks in it), mounted in the host's mount namespace on a fresh temp directory, so no
/// test touches the host's /sys/fs/bpf. Unmounted, with everything pinned in it, on drop.
pub(crate) struct OpenBpffs {
    pub(crate) dir: std::path::PathBuf,
    pub(crate) mnt: std::path::PathBuf,
}

impl OpenBpffs {
    pub(crate) fn new(tag: &str) -> Self {
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
pub(crate) fn as_nobody(script: &str) {
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
pub(crate) struct Agent {
    pub(crate) child: std::process::Child,
    pub(crate) tmp: std::path::PathBuf,
    pub(crate) log: std::path::PathBuf,
}

impl Agent {
    pub(crate) fn start(bed: &Bed, pin: &Path) -> Self {
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

    pub(crate) fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, and the exit status must be success.
    pub(crate) fn stop(mut self) {
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
pub(crate) fn assert_owned_and_enforcing(bed: &Bed, pin: &Path, agent: &Agent) {
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
pub(crate) fn victim(bpffs: &OpenBpffs) -> std::path::PathBuf {
    let victim = bpffs.dir.join("victim");
    fs::create_dir(&victim).unwrap();
    fs::set_permissions(&victim, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    victim
}

pub(crate) fn assert_untouched(victim: &Path) {
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
