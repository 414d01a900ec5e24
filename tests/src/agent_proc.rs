//! The real `ratelimit agent` as a child process inside a test namespace: started with its own
//! config file and pin directory, waited for until it has attached, stopped with SIGTERM, and
//! killed (its pins removed) when a test fails halfway.
//!
//! # Why not plain `ip netns exec`
//! `ip netns exec` gives the command a private mount namespace with a fresh sysfs on `/sys` (so
//! `/sys/class/net` shows the namespace's interfaces), which also hides the host's bpffs at
//! `/sys/fs/bpf`: the agent would mount a private bpffs of its own, invisible to the test (and to
//! `ratelimit stats`) and gone when the agent exits, taking the pinned XDP link with it. So the agent runs the way a containerised agent does: its own
//! network namespace and sysfs, with the host's bpffs mounted in. `unshare --mount` makes a
//! private mount namespace (a slave of the host's, so nothing leaks back), the host's bpffs is
//! bind-mounted at a temporary directory there, `ip netns exec` switches namespace and sysfs, and
//! the bpffs goes back on `/sys/fs/bpf` before the agent is exec'd. Every step execs the next, so
//! the child's pid ends up being the agent's own.

use std::fs::{self, File};
use std::io::Read as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::agent::agent_binary;
use crate::netns::{next_id, Netns};

/// How long an agent may take to attach (loading the program runs the verifier).
const ATTACH_TIMEOUT: Duration = Duration::from_secs(20);
/// How long an agent may take to exit after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the log file and the process are looked at while waiting.
const POLL: Duration = Duration::from_millis(20);
/// The host's bpffs, where every test's pin directory lives.
const BPFFS: &str = "/sys/fs/bpf";

/// Runs the agent's command line with the host's bpffs at `/sys/fs/bpf` (see the module docs).
/// `$1` namespace, `$2` mount point for the bpffs in between, then the agent's argv.
const LAUNCH: &str = r#"ns=$1; mnt=$2; shift 2
mount --bind /sys/fs/bpf "$mnt" || exit 125
exec ip netns exec "$ns" sh -c 'mount --bind "$0" /sys/fs/bpf || exit 125; exec "$@"' "$mnt" "$@"
"#;

/// A running (or exited) `ratelimit agent` child process with its own temp directory (config,
/// log) and pin directory `/sys/fs/bpf/rl-e2e-<pid>-<n>`.
///
/// Dropping it kills the agent (SIGKILL) if it still runs and removes the pin directory (pinned
/// links first, which detaches the program) and the temp directory, so a failed test leaves
/// nothing behind.
pub struct AgentProcess {
    child: Option<Child>,
    ns_name: String,
    dir: PathBuf,
    config: PathBuf,
    log: PathBuf,
    pin_path: PathBuf,
    socket: PathBuf,
    interfaces: Vec<String>,
    /// Set by [`AgentProcess::stop_keeping_pins`]: drop leaves the pin directory alone.
    keep_pins: bool,
    /// Set by [`AgentProcess::crash`]: its exit status is SIGKILL's, not checked on stop.
    crashed: bool,
}

impl AgentProcess {
    /// Starts `ratelimit agent -c FILE extra_args...` in `ns` and waits (up to 20 s) until it has
    /// logged "attached" for every interface (the config's `interfaces`, or the `--iface`
    /// arguments). Fails with the agent's log if it exits or times out first.
    ///
    /// `config_toml` is written to a fresh temp file. Unless it sets them itself (see
    /// [`AgentProcess::unique_pin_path`]), `pin_path = "/sys/fs/bpf/rl-e2e-<pid>-<n>"` and
    /// `socket = "<temp dir>/agent.sock"` are inserted on the lines after `[agent]`, which moves
    /// every later line down.
    pub fn start(ns: &Netns, config_toml: &str, extra_args: &[&str]) -> Result<AgentProcess> {
        let mut agent = Self::spawn(ns, config_toml, extra_args)?;
        agent.wait_attached()?;
        Ok(agent)
    }

    /// Starts the agent like [`AgentProcess::start`] but does not wait for anything: for configs
    /// the agent is expected to refuse (see [`AgentProcess::wait_exit`]).
    pub fn spawn(ns: &Netns, config_toml: &str, extra_args: &[&str]) -> Result<AgentProcess> {
        Self::spawn_logging(ns, config_toml, extra_args, "info")
    }

    /// Like [`AgentProcess::start`], with the agent's `RUST_LOG` set to `rust_log` instead of
    /// `info` (`"debug"` shows the XDP program's records when `ebpf_log` is on).
    pub fn start_logging(
        ns: &Netns,
        config_toml: &str,
        extra_args: &[&str],
        rust_log: &str,
    ) -> Result<AgentProcess> {
        let mut agent = Self::spawn_logging(ns, config_toml, extra_args, rust_log)?;
        agent.wait_attached()?;
        Ok(agent)
    }

    fn spawn_logging(
        ns: &Netns,
        config_toml: &str,
        extra_args: &[&str],
        rust_log: &str,
    ) -> Result<AgentProcess> {
        ensure_host_bpffs()?;
        let id = format!("{}-{}", std::process::id(), next_id());
        let dir = std::env::temp_dir().join(format!("rl-e2e-{id}"));
        let (text, pin_path, socket) = with_own_paths(config_toml, &id, &dir)?;
        let interfaces = expected_interfaces(&text, extra_args);
        fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
        // From here on, `agent` owns the directory and removes it on drop, even on error.
        let mut agent = AgentProcess {
            child: None,
            ns_name: ns.name().to_owned(),
            config: dir.join("ratelimit.toml"),
            log: dir.join("agent.log"),
            dir,
            pin_path,
            socket,
            interfaces,
            keep_pins: false,
            crashed: false,
        };
        let bpffs_mnt = agent.dir.join("bpffs");
        fs::create_dir(&bpffs_mnt)?;
        fs::write(&agent.config, text)
            .with_context(|| format!("writing {}", agent.config.display()))?;
        let log = File::create(&agent.log)
            .with_context(|| format!("creating {}", agent.log.display()))?;

        let binary = agent_binary();
        let mut cmd = Command::new("unshare");
        cmd.args([
            "--mount",
            "--propagation",
            "slave",
            "--",
            "sh",
            "-c",
            LAUNCH,
            "sh",
        ])
        .arg(ns.name())
        .arg(&bpffs_mnt)
        .arg(&binary)
        .arg("agent")
        .arg("-c")
        .arg(&agent.config)
        .args(extra_args)
        // What it learns goes to its own directory (unless the test names one), not the host's
        // /var/lib/ratelimit; removed with the rest.
        .args(
            (setting(config_toml, "state_dir").is_none() && !extra_args.contains(&"--state-dir"))
                .then(|| {
                    [
                        std::ffi::OsString::from("--state-dir"),
                        agent.dir.join("state").into_os_string(),
                    ]
                })
                .into_iter()
                .flatten()
                .collect::<Vec<std::ffi::OsString>>(),
        )
        .env("RUST_LOG", rust_log)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
        let parent = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
        // SAFETY: the closure only makes async-signal-safe system calls (prctl, getppid).
        unsafe {
            cmd.pre_exec(move || {
                // If the test process dies (Ctrl-C, a killed runner), the agent dies with it
                // instead of enforcing forever. (Tied to the spawning thread: a test's agent lives
                // on its test's thread.)
                // No allocation here (this runs between fork and exec): raw OS errors only.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
        agent.child = Some(cmd.spawn().with_context(|| {
            format!(
                "starting {} agent in namespace {}",
                binary.display(),
                ns.name()
            )
        })?);
        Ok(agent)
    }

    /// A pin directory no other test uses, for a config that sets `pin_path` (and `socket`)
    /// itself, so that [`AgentProcess::start`] inserts nothing and line numbers stay as written.
    #[must_use]
    pub fn unique_pin_path() -> PathBuf {
        PathBuf::from(format!(
            "{BPFFS}/rl-e2e-{}-{}",
            std::process::id(),
            next_id()
        ))
    }

    /// The agent's pin directory.
    #[must_use]
    pub fn pin_path(&self) -> &Path {
        &self.pin_path
    }

    /// The agent's control socket (for `ratelimit --socket P ...`).
    #[must_use]
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    /// The config file the agent was started with.
    #[must_use]
    pub fn config_path(&self) -> &Path {
        &self.config
    }

    /// Everything the agent has written to stdout and stderr so far (ANSI colours stripped).
    #[must_use]
    pub fn log(&self) -> String {
        let mut text = String::new();
        if let Ok(mut f) = File::open(&self.log) {
            let mut bytes = Vec::new();
            let _ = f.read_to_end(&mut bytes);
            text = strip_ansi(&String::from_utf8_lossy(&bytes));
        }
        text
    }

    /// `ratelimit stats --json --pin-path P`, parsed.
    ///
    /// # Panics
    /// If the command fails or prints something that is not JSON, with its output and the
    /// agent's log.
    #[must_use]
    pub fn stats(&self) -> Value {
        let out = Command::new(agent_binary())
            .args(["stats", "--json", "--pin-path"])
            .arg(&self.pin_path)
            .output()
            .expect("running ratelimit stats");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "`ratelimit stats --json --pin-path {}` failed ({}): {}\nagent log:\n{}",
            self.pin_path.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr),
            self.log()
        );
        serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("`ratelimit stats --json` printed {stdout:?}: {e}"))
    }

    /// Sends SIGTERM and waits (up to 10 s) for the agent to exit; then checks that it removed its
    /// pin directory. Fails with the log if it does not exit (it is then killed), exits with a
    /// status other than 0 when it was running (not [`AgentProcess::crash`]ed, not exited on its
    /// own before), or leaves the pin directory behind (which is then removed).
    pub fn stop(self) -> Result<ExitStatus> {
        self.stop_with(libc::SIGTERM)
    }

    /// Like [`AgentProcess::stop`], for an agent run with `--keep-attached`: its pins (maps, XDP
    /// links) are left for the next agent started with the same `pin_path` to adopt. The returned
    /// [`KeptPins`] removes them when dropped, if they are still there then: keep it alive for
    /// the rest of the test, declared before the next agent so that it is dropped after it.
    pub fn stop_keeping_pins(mut self) -> Result<(ExitStatus, KeptPins)> {
        self.keep_pins = true;
        let kept = KeptPins {
            path: self.pin_path.clone(),
        };
        Ok((self.terminate()?, kept))
    }

    /// Like [`AgentProcess::stop`], with `signal` (SIGINT) instead of SIGTERM.
    pub fn stop_with(mut self, signal: libc::c_int) -> Result<ExitStatus> {
        let status = self.terminate_with(signal)?;
        if self.pin_path.exists() {
            let listing = list_dir(&self.pin_path);
            self.remove_pins();
            bail!(
                "agent exited ({status}) but left its pin directory {} behind ({listing}); \
                 removed it. Log:\n{}",
                self.pin_path.display(),
                self.log()
            );
        }
        Ok(status)
    }

    /// Sends `signal` to the agent (SIGHUP: reload) if it still runs.
    pub fn signal(&mut self, signal: libc::c_int) -> Result<()> {
        let pid = self.pid().context("the agent was never started")?;
        if self.try_wait()?.is_none() {
            // SAFETY: kill has no memory-safety preconditions; `pid` is our unreaped child.
            if unsafe { libc::kill(pid, signal) } != 0 {
                return Err(std::io::Error::last_os_error())
                    .with_context(|| format!("kill({pid}, {signal})"));
            }
        }
        Ok(())
    }

    /// SIGTERM, then waits up to [`STOP_TIMEOUT`]; kills the agent and fails if it is still
    /// running then.
    fn terminate(&mut self) -> Result<ExitStatus> {
        self.terminate_with(libc::SIGTERM)
    }

    /// `signal`, then as [`AgentProcess::terminate`].
    /// Fails if the agent was running when signalled and exited with a status other than 0.
    fn terminate_with(&mut self, signal: libc::c_int) -> Result<ExitStatus> {
        let pid = self.pid().context("the agent was never started")?;
        let running = self.try_wait()?.is_none();
        self.signal(signal)?;
        match self.wait_timeout(STOP_TIMEOUT)? {
            Some(status) if running && !status.success() && !self.crashed => bail!(
                "agent exited with {status} after signal {signal}, not 0. Log:\n{}",
                self.log()
            ),
            Some(status) => Ok(status),
            None => {
                self.kill();
                bail!(
                    "agent (pid {pid}) still running {STOP_TIMEOUT:?} after signal {signal}; killed it. \
                     Log:\n{}",
                    self.log()
                )
            }
        }
    }

    /// Waits (up to `timeout`) for the agent to exit on its own and returns its status and log;
    /// kills it and fails if it is still running then.
    pub fn wait_exit(mut self, timeout: Duration) -> Result<(ExitStatus, String)> {
        match self.wait_timeout(timeout)? {
            Some(status) => Ok((status, self.log())),
            None => {
                self.kill();
                bail!(
                    "agent still running after {timeout:?}; killed it. Log:\n{}",
                    self.log()
                )
            }
        }
    }

    /// Kills the agent with SIGKILL, as a crash would, and reaps it: what it pinned (maps, the
    /// XDP links) stays until [`Drop`] removes it.
    pub fn crash(&mut self) -> Result<ExitStatus> {
        self.crashed = true;
        match self.child.as_mut() {
            Some(child) => {
                if matches!(child.try_wait(), Ok(None)) {
                    child.kill()?;
                }
                Ok(child.wait()?)
            }
            None => bail!("the agent was never started"),
        }
    }

    /// Whether the agent process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.try_wait(), Ok(None))
    }

    /// The agent's process id (the launcher execs into the agent).
    #[must_use]
    pub fn pid(&self) -> Option<libc::pid_t> {
        self.child
            .as_ref()
            .and_then(|c| libc::pid_t::try_from(c.id()).ok())
    }

    fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        match self.child.as_mut() {
            Some(child) => Ok(child.try_wait()?),
            None => bail!("the agent was never started"),
        }
    }

    fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait()? {
                return Ok(Some(status));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            thread::sleep(POLL);
        }
    }

    fn wait_attached(&mut self) -> Result<()> {
        let deadline = Instant::now() + ATTACH_TIMEOUT;
        loop {
            let log = self.log();
            // "running" comes after the control socket, the metrics endpoint and the cluster
            // sync are up: a test may use any of them as soon as this returns.
            let done =
                log.contains(": running;") && self.interfaces.iter().all(|i| attached(&log, i));
            if done {
                return Ok(());
            }
            if let Some(status) = self.try_wait()? {
                bail!(
                    "agent in namespace {} exited ({status}) before attaching to {:?}. Log:\n{log}",
                    self.ns_name,
                    self.interfaces
                );
            }
            if Instant::now() >= deadline {
                self.kill();
                bail!(
                    "agent in namespace {} did not attach to {:?} within {ATTACH_TIMEOUT:?}; \
                     killed it. Log:\n{log}",
                    self.ns_name,
                    self.interfaces
                );
            }
            thread::sleep(POLL);
        }
    }

    fn kill(&mut self) {
        if let Some(child) = self.child.as_mut() {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }

    /// Removes what the agent pinned: its links (which detaches the program from the
    /// interfaces) and its maps.
    fn remove_pins(&self) {
        if self.pin_path.exists() {
            if let Err(e) = ratelimit::dataplane::remove_pin_dir(&self.pin_path) {
                eprintln!(
                    "ratelimit-testbed: removing {}: {e}",
                    self.pin_path.display()
                );
            }
        }
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        self.kill();
        if !self.keep_pins {
            self.remove_pins();
        }
        // The bpffs bind mount lived in the agent's private mount namespace, gone with it.
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            eprintln!("ratelimit-testbed: removing {}: {e}", self.dir.display());
        }
    }
}

/// A pin directory an agent left behind on purpose (`--keep-attached`), removed (links first,
/// which detaches the program) when this is dropped, so a failed test leaves nothing behind.
#[must_use = "dropping it removes the pins at once"]
pub struct KeptPins {
    path: PathBuf,
}

impl KeptPins {
    /// The pin directory.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for KeptPins {
    fn drop(&mut self) {
        if self.path.exists() {
            if let Err(e) = ratelimit::dataplane::remove_pin_dir(&self.path) {
                eprintln!("ratelimit-testbed: removing {}: {e}", self.path.display());
            }
        }
    }
}

/// The XDP attachment of `ifname` in `ns`, as `ip -j link show` reports it: `None` when no
/// program is attached, else the mode (`"native"`, `"skb"`, `"hw"` or `"multi"`) and the program
/// name.
pub fn xdp_attachment(ns: &Netns, ifname: &str) -> Result<Option<(String, String)>> {
    let out = ns.ip(&["-j", "link", "show", "dev", ifname])?;
    let parsed: Value = serde_json::from_str(&out)
        .with_context(|| format!("parsing `ip -j link show dev {ifname}`: {out}"))?;
    let Some(xdp) = parsed.get(0).and_then(|l| l.get("xdp")) else {
        return Ok(None);
    };
    // XDP_ATTACHED_* from linux/if_link.h.
    let mode = match xdp["mode"].as_u64() {
        Some(0) => return Ok(None),
        Some(1) => "native",
        Some(2) => "skb",
        Some(3) => "hw",
        Some(4) => "multi",
        _ => "unknown",
    };
    let prog = xdp["prog"]["name"].as_str().unwrap_or("").to_owned();
    Ok(Some((mode.to_owned(), prog)))
}

/// Packets of rule `name` with `verdict` ("passed", "dropped_rate", "dry_run", ...) in a
/// `ratelimit stats --json` report.
///
/// # Panics
/// If the report has no such rule or counter.
#[must_use]
pub fn rule_packets(stats: &Value, name: &str, verdict: &str) -> u64 {
    let rule = stats["rules"]
        .as_array()
        .and_then(|rules| rules.iter().find(|r| r["name"] == name))
        .unwrap_or_else(|| panic!("no rule {name:?} in stats: {stats}"));
    rule["packets"][verdict]
        .as_u64()
        .unwrap_or_else(|| panic!("no packets.{verdict} for rule {name:?} in stats: {stats}"))
}

/// Global counter `name` in a `ratelimit stats --json` report.
///
/// # Panics
/// If the report has no such counter.
#[must_use]
pub fn global_counter(stats: &Value, name: &str) -> u64 {
    stats["global"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("no global.{name} in stats: {stats}"))
}

/// Whether the log has the agent's `attached iface=NAME` line.
fn attached(log: &str, iface: &str) -> bool {
    log.lines().any(|line| {
        line.contains(": attached ")
            && line
                .split_whitespace()
                .any(|w| w.strip_prefix("iface=") == Some(iface))
    })
}

/// The config with `pin_path` and `socket` set (inserted after `[agent]`, or in a new `[agent]`
/// table first) unless it sets them itself, and the pin path and socket in force.
fn with_own_paths(config: &str, id: &str, dir: &Path) -> Result<(String, PathBuf, PathBuf)> {
    let pin = match setting(config, "pin_path") {
        Some(value) if value.starts_with(BPFFS) && value.len() > BPFFS.len() + 1 => {
            Some(PathBuf::from(value))
        }
        Some(value) => bail!("config sets pin_path = {value:?}: want \"{BPFFS}/<unique name>\""),
        None => None,
    };
    let socket = setting(config, "socket").map(PathBuf::from);
    let mut lines = Vec::new();
    if pin.is_none() {
        lines.push(format!("pin_path = \"{BPFFS}/rl-e2e-{id}\""));
    }
    if socket.is_none() {
        lines.push(format!("socket = \"{}\"", dir.join("agent.sock").display()));
    }
    let pin = pin.unwrap_or_else(|| PathBuf::from(format!("{BPFFS}/rl-e2e-{id}")));
    let socket = socket.unwrap_or_else(|| dir.join("agent.sock"));
    if lines.is_empty() {
        return Ok((config.to_owned(), pin, socket));
    }
    let insert = lines.join("\n");
    let mut out = String::with_capacity(config.len() + insert.len() + 16);
    let mut inserted = false;
    for l in config.lines() {
        out.push_str(l);
        out.push('\n');
        if !inserted && l.trim() == "[agent]" {
            out.push_str(&insert);
            out.push('\n');
            inserted = true;
        }
    }
    if !inserted {
        out = format!("[agent]\n{insert}\n\n{out}");
    }
    Ok((out, pin, socket))
}

/// The string value of `key = "..."` if some line sets it (good enough for the test configs).
fn setting<'a>(config: &'a str, key: &str) -> Option<&'a str> {
    config.lines().find_map(|l| {
        let (k, v) = l.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

/// The interfaces the agent will attach to: the `--iface` arguments, else the config's (none if
/// the config does not parse: the agent will refuse it).
fn expected_interfaces(config: &str, extra_args: &[&str]) -> Vec<String> {
    let mut from_args = Vec::new();
    let mut args = extra_args.iter();
    while let Some(arg) = args.next() {
        if *arg == "--iface" {
            from_args.extend(args.next().map(|s| (*s).to_owned()));
        } else if let Some(name) = arg.strip_prefix("--iface=") {
            from_args.push(name.to_owned());
        }
    }
    if !from_args.is_empty() {
        return from_args;
    }
    ratelimit::config::Config::parse(config, "agent config")
        .map(|c| c.agent.interfaces)
        .unwrap_or_default()
}

/// Mounts bpffs at `/sys/fs/bpf` in the host's mount namespace if it is not there (as the agent
/// itself would).
fn ensure_host_bpffs() -> Result<()> {
    let mounted = fs::read_to_string("/proc/self/mounts")?.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.get(1) == Some(&BPFFS) && f.get(2) == Some(&"bpf")
    });
    if !mounted {
        crate::cmd::run("mount", &["-t", "bpf", "-o", "mode=0700", "bpf", BPFFS])?;
    }
    Ok(())
}

fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            // CSI: ESC [ parameters... final byte in 0x40..=0x7e.
            if chars.next() == Some('[') {
                for c in chars.by_ref() {
                    if ('\x40'..='\x7e').contains(&c) {
                        break;
                    }
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn list_dir(dir: &Path) -> String {
    fs::read_dir(dir).map_or_else(
        |e| format!("unreadable: {e}"),
        |entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                .collect::<Vec<_>>()
                .join(", ")
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_paths_go_after_the_agent_table() {
        let dir = Path::new("/tmp/d");
        let (text, pin, socket) =
            with_own_paths("[agent]\ninterfaces = [\"x\"]\n", "t-1", dir).unwrap();
        assert_eq!(pin, PathBuf::from("/sys/fs/bpf/rl-e2e-t-1"));
        assert_eq!(socket, PathBuf::from("/tmp/d/agent.sock"));
        assert_eq!(
            text,
            "[agent]\npin_path = \"/sys/fs/bpf/rl-e2e-t-1\"\nsocket = \"/tmp/d/agent.sock\"\n\
             interfaces = [\"x\"]\n"
        );
        let (text, _, _) = with_own_paths("[[rule]]\nname = \"a\"\n", "t-2", dir).unwrap();
        assert!(text.starts_with("[agent]\npin_path = "), "{text}");
        let own = "[agent]\npin_path = \"/sys/fs/bpf/rl-e2e-own\"\nsocket = \"/tmp/s\"\n";
        let (text, pin, socket) = with_own_paths(own, "t-3", dir).unwrap();
        assert_eq!(
            (text.as_str(), pin, socket),
            (
                own,
                PathBuf::from("/sys/fs/bpf/rl-e2e-own"),
                PathBuf::from("/tmp/s")
            )
        );
        assert!(with_own_paths("[agent]\npin_path = \"/tmp/x\"\n", "t-4", dir).is_err());
    }

    #[test]
    fn attached_lines_and_colours() {
        let log = strip_ansi(
            "\x1b[2m2026\x1b[0m \x1b[32m INFO\x1b[0m ratelimit::agent: attached \x1b[3miface\x1b[0m=vb1 mode=\"native\"\n\
             INFO ratelimit::agent: detached and removed pinned maps\n",
        );
        assert!(attached(&log, "vb1"));
        assert!(!attached(&log, "vb"));
        assert_eq!(
            expected_interfaces("", &["--iface", "a", "--iface=b", "--mode", "skb"]),
            ["a", "b"]
        );
    }
}
