//! Faults around the real agent, end to end: what happens to enforcement (real packets over a veth
//! pair) and what the agent reports when its config file goes bad under it, its socket path is
//! taken, a second agent is started on its interface, its interface is deleted and created again,
//! bpffs is not mounted, or it is killed in the middle of a reload.

use std::{
    fs,
    net::{IpAddr, SocketAddr},
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use ratelimit_testbed::{
    add_addr, agent_binary, agent_proc::xdp_attachment, bind_udp_transparent, cli, neigh_to_peer,
    require_root, send_udp, AgentProcess, Netns, Receiver,
};
use serde_json::Value;

mod reload_kill;

const RECEIVER: &str = "198.18.0.254";
/// Every limit rule here: one packet per second, so nothing refills while a test sends (its
/// bursts take milliseconds) and each fresh source gets exactly `burst` packets through.
const BURST: u64 = 3;
/// How long the agent may take to notice and act on a change (polls every 250 ms or 1 s).
const NOTICE: Duration = Duration::from_secs(15);
const EXIT_TIMEOUT: Duration = Duration::from_secs(15);

/// Two namespaces joined by a veth pair: `tx` sends (as any address in 198.18.0.0/24), `rx` holds
/// the receiver 198.18.0.254 and the agent.
struct Bed {
    tx: Netns,
    rx: Netns,
    tx_if: String,
    rx_if: String,
}

/// Interface names of a bed, fixed so that a test can delete and create them again.
fn if_names(tag: &str) -> (String, String) {
    let id = std::process::id() % 100_000;
    (format!("f{tag}t{id}"), format!("f{tag}r{id}"))
}

fn bed(tag: &str) -> Bed {
    require_root();
    let tx = Netns::new(&format!("rl-flt-{tag}-tx")).unwrap();
    let rx = Netns::new(&format!("rl-flt-{tag}-rx")).unwrap();
    let (tx_if, rx_if) = if_names(tag);
    let bed = Bed {
        tx,
        rx,
        tx_if,
        rx_if,
    };
    bed.create_link();
    bed
}

impl Bed {
    /// Creates the veth pair (again), with addresses and the static neighbour.
    fn create_link(&self) {
        run(
            "ip",
            &[
                "link",
                "add",
                &self.tx_if,
                "netns",
                self.tx.name(),
                "type",
                "veth",
                "peer",
                "name",
                &self.rx_if,
                "netns",
                self.rx.name(),
            ],
        );
        for (ns, name) in [(&self.tx, &self.tx_if), (&self.rx, &self.rx_if)] {
            ns.sysctl(&format!("net/ipv6/conf/{name}/disable_ipv6"), "1")
                .unwrap();
            ns.ip(&["link", "set", name, "up"]).unwrap();
        }
        add_addr(&self.tx, &self.tx_if, "198.18.0.1/24").unwrap();
        add_addr(&self.rx, &self.rx_if, &format!("{RECEIVER}/24")).unwrap();
        neigh_to_peer(
            &self.tx,
            &self.tx_if,
            RECEIVER.parse().unwrap(),
            &self.rx,
            &self.rx_if,
        )
        .unwrap();
    }

    /// Sends 40 datagrams from `src` (any address of 198.18.0.0/24) within about 100 ms and
    /// returns how many arrived. (Paced, not a burst: a sender descheduled on a loaded machine
    /// catches up rather than skipping most of them.)
    fn delivered(&self, src: &str) -> u64 {
        let receiver =
            Receiver::bind(&self.rx, SocketAddr::new(RECEIVER.parse().unwrap(), 0)).unwrap();
        let ip: IpAddr = src.parse().unwrap();
        let socket = bind_udp_transparent(&self.tx, SocketAddr::new(ip, 0)).unwrap();
        let sent = send_udp(
            &socket,
            receiver.local_addr(),
            400,
            Duration::from_millis(100),
            64,
        )
        .unwrap();
        assert!(sent.sent >= 10, "sent only {}", sent.sent);
        receiver.wait_idle(Duration::from_millis(100), Duration::from_secs(2));
        let report = receiver.stop().unwrap();
        report.counts().get(&ip).copied().unwrap_or(0)
    }

    /// Asserts that the limit rule of [`limit_rules`] is enforced: a fresh source gets exactly
    /// `burst` datagrams through.
    fn assert_limited(&self, src: &str, burst: u64, context: &str, agent: &AgentProcess) {
        let got = self.delivered(src);
        assert_eq!(
            got,
            burst,
            "{context}: {src} got {got} datagrams through, want the burst {burst}. Log:\n{}",
            agent.log()
        );
    }

    fn xdp(&self) -> Option<(String, String)> {
        xdp_attachment(&self.rx, &self.rx_if).unwrap()
    }
}

fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(program).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "`{program} {}` failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A limit rule for 198.18.0.0/24: rate 1, burst `burst`, per source.
fn limit_rules(burst: u64) -> String {
    format!("[[rule]]\nname = \"lim\"\nsource = \"198.18.0.0/24\"\nrate = 1\nburst = {burst}\n")
}

/// An `[agent]` table naming its own pin path and socket (so that other agents can share them).
fn agent_table(iface: &str, pin: &Path, socket: &Path) -> String {
    format!(
        "[agent]\ninterfaces = [\"{iface}\"]\npin_path = \"{}\"\nsocket = \"{}\"\n\n",
        pin.display(),
        socket.display()
    )
}

/// A directory for a test's sockets, configs and lists, removed (with what is in it) on drop,
/// also when the test fails.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("rl-flt-{tag}-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// `ratelimit --socket S ARGS --json`, parsed; `Err` with stderr when it fails.
fn status(agent: &AgentProcess) -> Value {
    agent.cli_json(&["status"])
}

/// Polls `f` every 100 ms until it returns `Some`, for at most `timeout`.
fn wait_for<T>(timeout: Duration, what: &str, f: impl FnMut() -> Option<T>) -> T {
    wait_for_every(timeout, Duration::from_millis(100), what, f)
}

/// [`wait_for`], polling every `period`.
fn wait_for_every<T>(
    timeout: Duration,
    period: Duration,
    what: &str,
    mut f: impl FnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        thread::sleep(period);
    }
}

/// Replaces the file at `path` by `contents` the way editors and config managers do: a new file
/// renamed over it.
fn replace_file(path: &Path, contents: &str) {
    let tmp = path.with_extension("new");
    fs::write(&tmp, contents).unwrap();
    fs::rename(&tmp, path).unwrap();
}

/// Waits until the agent has counted at least `n` refused reloads, the last refused for an error
/// holding every one of `words`, and returns its status. (At least: a file replaced in two steps,
/// say removed and then made a directory, may be seen, and refused, in between.)
fn wait_failed_reloads(agent: &AgentProcess, n: u64, words: &[String]) -> Value {
    wait_for(
        NOTICE,
        &format!("{n} failed reloads, the last for {words:?}"),
        || {
            let s = status(agent);
            let error = s["reloads"]["last_error"].as_str().unwrap_or_default();
            (s["reloads"]["failed"].as_u64() >= Some(n)
                && words.iter().all(|w| error.contains(w.as_str())))
            .then_some(s)
        },
    )
}

#[test]
fn config_replaced_by_garbage_an_empty_file_or_a_directory_is_refused_and_the_rules_stay() {
    let bed = bed("cfg");
    let config = format!(
        "[agent]\ninterfaces = [\"{}\"]\n\n{}",
        bed.rx_if,
        limit_rules(BURST)
    );
    let agent = AgentProcess::start(&bed.rx, &config, &[]).unwrap();
    let path = agent.config_path().to_owned();
    let good = fs::read_to_string(&path).unwrap();
    bed.assert_limited("198.18.0.10", BURST, "at start", &agent);

    // What the file becomes, how, and words the error must contain.
    type Fault<'a> = (&'a str, Box<dyn Fn() + 'a>, Vec<String>);
    let origin = path.display().to_string();
    let faults: [Fault; 3] = [
        (
            "garbage",
            Box::new(|| replace_file(&path, "this is [not TOML\n\u{1}\u{2}\n")),
            vec![format!("{origin}:1:"), "TOML syntax error".into()],
        ),
        (
            "an empty file",
            Box::new(|| replace_file(&path, "")),
            vec![origin.clone(), "no interfaces".into()],
        ),
        (
            "a directory",
            Box::new(|| {
                fs::remove_file(&path).unwrap();
                fs::create_dir(&path).unwrap();
            }),
            vec![origin.clone(), "is a directory".into()],
        ),
    ];
    let mut failed = 0;
    for (i, (what, make, words)) in faults.iter().enumerate() {
        if path.is_dir() {
            fs::remove_dir(&path).unwrap();
        }
        make();
        let s = wait_failed_reloads(&agent, failed + 1, words);
        failed = s["reloads"]["failed"].as_u64().unwrap();
        let error = s["reloads"]["last_error"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        for w in words {
            assert!(
                error.contains(w.as_str()),
                "config replaced by {what}: last_error {error:?} lacks {w:?}"
            );
        }
        assert_eq!(
            s["rules"], 1,
            "config replaced by {what}: rules in force changed: {s}"
        );
        assert_eq!(
            s["interfaces"].as_array().map(Vec::len),
            Some(1),
            "config replaced by {what}: {s}"
        );
        assert!(
            bed.xdp().is_some(),
            "config replaced by {what}: XDP detached"
        );
        bed.assert_limited(
            &format!("198.18.0.{}", 11 + i),
            BURST,
            &format!("config replaced by {what}"),
            &agent,
        );
        println!("config replaced by {what}: refused with {error:?}; the rule is still enforced");
    }

    // A good file again: it is applied (a visible change: burst 3 -> 5) and the error clears.
    // The directory goes first, so the watcher may see (and refuse) a missing file in between:
    // at most one more refusal.
    let tmp = path.with_extension("new");
    fs::write(&tmp, good.replace(&format!("burst = {BURST}"), "burst = 5")).unwrap();
    fs::remove_dir(&path).unwrap();
    fs::rename(&tmp, &path).unwrap();
    let s = wait_for(NOTICE, "a successful reload", || {
        let s = status(&agent);
        (s["reloads"]["ok"].as_u64() >= Some(1)).then_some(s)
    });
    assert_eq!(s["reloads"]["last_error"], Value::Null, "{s}");
    let after = s["reloads"]["failed"].as_u64().unwrap();
    assert!(
        after == failed || after == failed + 1,
        "{} refusals after the good file came back: {s}",
        after - failed
    );
    bed.assert_limited("198.18.0.20", 5, "after a good file came back", &agent);
    agent.stop().unwrap();
}

#[test]
fn a_dead_socket_is_replaced_and_a_regular_file_at_the_socket_path_is_refused() {
    let bed = bed("sock");
    let tmp = Scratch::new("sock");
    // A socket file nobody listens on: what a crashed agent leaves.
    let dead = tmp.path("dead.sock");
    drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
    assert!(dead.exists());
    let pin = AgentProcess::unique_pin_path();
    let config = format!(
        "{}{}",
        agent_table(&bed.rx_if, &pin, &dead),
        limit_rules(BURST)
    );
    let agent = AgentProcess::start(&bed.rx, &config, &[]).unwrap();
    assert!(
        agent.log().contains("removing a stale control socket"),
        "{}",
        agent.log()
    );
    assert_eq!(status(&agent)["rules"], 1);
    bed.assert_limited(
        "198.18.0.10",
        BURST,
        "after replacing a dead socket",
        &agent,
    );
    agent.stop().unwrap();
    assert!(!dead.exists(), "{} left behind", dead.display());

    // A regular file: not ours to remove.
    let file = tmp.path("file.sock");
    fs::write(&file, "precious\n").unwrap();
    let pin = AgentProcess::unique_pin_path();
    let config = format!(
        "{}{}",
        agent_table(&bed.rx_if, &pin, &file),
        limit_rules(BURST)
    );
    let agent = AgentProcess::spawn(&bed.rx, &config, &[]).unwrap();
    let (status, log) = agent.wait_exit(EXIT_TIMEOUT).unwrap();
    assert!(!status.success(), "{log}");
    assert!(
        log.contains(&format!(
            "control socket {} exists and is not a socket",
            file.display()
        )),
        "unclear message: {log}"
    );
    assert_eq!(
        fs::read_to_string(&file).unwrap(),
        "precious\n",
        "the file was touched"
    );
    assert!(!pin.exists(), "a refused agent created {}", pin.display());
    assert_eq!(bed.xdp(), None, "a refused agent attached");
}

/// Starts an agent that must refuse to run, without letting the testbed remove a pin directory it
/// shares with a running agent; returns its exit status and log.
fn refused_sharing_pins(bed: &Bed, config: &str) -> (std::process::ExitStatus, String) {
    let mut agent = AgentProcess::spawn(&bed.rx, config, &[]).unwrap();
    let deadline = Instant::now() + EXIT_TIMEOUT;
    while agent.is_running() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    let log = agent.log();
    let running = agent.is_running();
    // Whatever it did, the pins are the first agent's: leave them to it.
    let (status, kept) = agent.stop_keeping_pins().unwrap();
    std::mem::forget(kept);
    assert!(
        !running,
        "the second agent is still running after {EXIT_TIMEOUT:?}: {log}"
    );
    (status, log)
}

#[test]
fn a_second_agent_on_the_same_interface_is_refused_and_the_first_keeps_enforcing() {
    let bed = bed("two");
    let tmp = Scratch::new("two");
    let (pin, socket) = (AgentProcess::unique_pin_path(), tmp.path("first.sock"));
    let config = format!(
        "{}{}",
        agent_table(&bed.rx_if, &pin, &socket),
        limit_rules(BURST)
    );
    let first = AgentProcess::start(&bed.rx, &config, &[]).unwrap();
    bed.assert_limited("198.18.0.10", BURST, "first agent", &first);
    let other_pin = AgentProcess::unique_pin_path();
    let other_socket = tmp.path("second.sock");
    // The second agent's rule would let more through: a hijack would show.
    let cases = [
        (
            "the same socket and pin path",
            &pin,
            &socket,
            "another agent is running on",
        ),
        (
            "another socket, the same pin path",
            &pin,
            &other_socket,
            "is in use by another running agent",
        ),
        (
            "another socket and pin path",
            &other_pin,
            &other_socket,
            "already has an XDP program",
        ),
    ];
    for (i, (what, pin2, socket2, words)) in cases.into_iter().enumerate() {
        let config2 = format!(
            "{}{}",
            agent_table(&bed.rx_if, pin2, socket2),
            limit_rules(50)
        );
        let (exit, log) = refused_sharing_pins(&bed, &config2);
        println!("second agent with {what}: exit {exit}; log:\n{log}");
        assert!(!exit.success(), "second agent with {what} ran: {log}");
        assert!(
            log.contains(words),
            "second agent with {what}: message lacks {words:?}: {log}"
        );
        assert!(
            !socket2.exists() || socket2 == &socket,
            "{} left behind",
            socket2.display()
        );
        assert!(!other_pin.exists(), "{} left behind", other_pin.display());
        // The first agent is untouched: same program attached, its rules, its API.
        assert_eq!(
            bed.xdp().map(|x| x.1),
            Some("ratelimit".to_owned()),
            "{what}"
        );
        let s = status(&first);
        assert_eq!(s["reloads"]["failed"], 0, "{what}: {s}");
        bed.assert_limited(
            &format!("198.18.0.{}", 11 + i),
            BURST,
            &format!("after a second agent with {what}"),
            &first,
        );
    }
    first.stop().unwrap();
    assert_eq!(bed.xdp(), None);
}

#[test]
fn an_interface_deleted_and_created_again_is_reported_and_attached_again() {
    let bed = bed("ifc");
    let config = format!(
        "[agent]\ninterfaces = [\"{}\"]\n\n{}",
        bed.rx_if,
        limit_rules(BURST)
    );
    let agent = AgentProcess::start(&bed.rx, &config, &[]).unwrap();
    bed.assert_limited("198.18.0.10", BURST, "at start", &agent);

    // Deleting one end of a veth pair deletes both.
    bed.rx.ip(&["link", "del", &bed.rx_if]).unwrap();
    let s = wait_for(NOTICE, "the agent to report the missing interface", || {
        let s = status(&agent);
        (s["interfaces"][0]["state"] == "missing").then_some(s)
    });
    println!("interface deleted: status {}", s["interfaces"]);
    assert_eq!(s["rules"], 1, "{s}");
    // Rules can still be changed meanwhile (burst 3 -> 4).
    let path = agent.config_path().to_owned();
    let text = fs::read_to_string(&path).unwrap();
    replace_file(
        &path,
        &text.replace(&format!("burst = {BURST}"), "burst = 4"),
    );
    let s = wait_for(NOTICE, "the reload while the interface is missing", || {
        let s = status(&agent);
        (s["reloads"]["ok"] == 1 || s["reloads"]["failed"] == 1).then_some(s)
    });
    assert_eq!(
        s["reloads"]["failed"], 0,
        "reload refused while the interface is missing: {s}"
    );

    bed.create_link();
    let s = wait_for(NOTICE, "the agent to attach to the new interface", || {
        let s = status(&agent);
        (s["interfaces"][0]["state"] == "attached" && bed.xdp().is_some()).then_some(s)
    });
    println!("interface back: status {}", s["interfaces"]);
    assert!(agent.log().contains("attached again"), "{}", agent.log());
    bed.assert_limited(
        "198.18.0.11",
        4,
        "on the new interface, with the rule changed meanwhile",
        &agent,
    );
    agent.stop().unwrap();
    assert_eq!(bed.xdp(), None);
}

/// The agent run with plain `ip netns exec`, which gives it a private mount namespace with a
/// fresh sysfs and so no bpffs at /sys/fs/bpf: it must mount one itself (a private one, with a
/// warning that pins will not outlive it) or fail saying why. Killed on drop.
struct BareAgent {
    child: Child,
    log: PathBuf,
}

impl BareAgent {
    fn spawn(ns: &Netns, config: &Path, path_env: Option<&str>) -> BareAgent {
        let log = config.with_extension("log");
        let out = fs::File::create(&log).unwrap();
        let ip = ["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .expect("ip(8)");
        let mut cmd = Command::new(ip);
        cmd.args(["netns", "exec", ns.name()])
            .arg(agent_binary())
            .args(["agent", "-c"])
            .arg(config)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        if let Some(path) = path_env {
            cmd.env("PATH", path);
        }
        // SAFETY: prctl is async-signal-safe; the agent dies with the test.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        BareAgent {
            child: cmd.spawn().unwrap(),
            log,
        }
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + EXIT_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "agent still running: {}",
                self.log()
            );
            thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for BareAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_file(&self.log);
    }
}

#[test]
fn without_bpffs_the_agent_mounts_its_own_or_fails_saying_why() {
    let bed = bed("bpf");
    let tmp = Scratch::new("bpffs");
    let socket = tmp.path("agent.sock");
    // The pin path is in the agent's private bpffs: nothing of it may show up on the host's.
    let pin = AgentProcess::unique_pin_path();
    let config = tmp.path("ratelimit.toml");
    fs::write(
        &config,
        format!(
            "{}{}",
            agent_table(&bed.rx_if, &pin, &socket),
            limit_rules(BURST)
        ),
    )
    .unwrap();

    let mut agent = BareAgent::spawn(&bed.rx, &config, None);
    wait_for(Duration::from_secs(30), "the agent to attach", || {
        assert!(
            agent.child.try_wait().unwrap().is_none(),
            "agent exited: {}",
            agent.log()
        );
        agent.log().contains(": running;").then_some(())
    });
    let log = agent.log();
    assert!(log.contains("mounted bpffs"), "{log}");
    // (It also warns that the pins are private, where it can tell: it looks for its bpffs among
    // the mounts pid 1 sees, which some sandboxes do not let it read; see e2e_hardening/planted.rs.)
    assert!(
        !pin.exists(),
        "the private pins showed up on the host's bpffs at {}",
        pin.display()
    );
    let s = cli(&socket, &["status", "--json"]).json();
    assert_eq!(s["rules"], 1, "{s}");
    let got = bed.delivered("198.18.0.10");
    assert_eq!(
        got, BURST,
        "not enforced with a private bpffs: {got} arrived. Log:\n{log}"
    );
    // SIGTERM: detaches and exits cleanly.
    // SAFETY: kill on our own child's pid.
    unsafe { libc::kill(i32::try_from(agent.child.id()).unwrap(), libc::SIGTERM) };
    let status = agent.wait_exit();
    assert!(status.success(), "exit {status}: {}", agent.log());
    assert_eq!(bed.xdp(), None, "still attached after SIGTERM");
    assert!(!socket.exists());

    // With no `mount` to run, it cannot mount bpffs: it must say so and change nothing.
    let mut agent = BareAgent::spawn(&bed.rx, &config, Some("/nonexistent"));
    let status = agent.wait_exit();
    let log = agent.log();
    println!("without mount(8): exit {status}; log:\n{log}");
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("bpffs is not mounted at /sys/fs/bpf"),
        "unclear message: {log}"
    );
    assert_eq!(bed.xdp(), None, "attached although it failed");
    assert!(!socket.exists(), "{} left behind", socket.display());
}
