//! The agent run the way `ratelimit.service` runs it: with only the capabilities the packaged
//! unit grants (`CapabilityBoundingSet=` of packaging/debian/ratelimit.service, applied with
//! `setpriv`), and with `$NOTIFY_SOCKET` pointing at a datagram socket this test owns, as systemd's
//! `Type=notify` does. It must enforce (real packets over a veth pair are limited), say `READY=1`
//! once it does, `RELOADING=1` then `READY=1` around a SIGHUP (the unit's `ExecReload`), and
//! `STOPPING=1` on SIGTERM; SIGUSR2 (the package upgrade's restart) must leave it attached.

use std::fs;
use std::net::SocketAddr;
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ratelimit_testbed::agent_proc::{rule_packets, xdp_attachment};
use ratelimit_testbed::{
    add_addr, agent_binary, neigh_to_peer, require_root, send_udp_from, veth_pair, AgentProcess,
    Netns, Receiver,
};

const RECEIVER: &str = "198.18.9.254";
const SOURCE: &str = "198.18.9.1";
const RATE: u64 = 200;
const BURST: u64 = 100;
/// A hang guard for READY=1 (loading runs the verifier), not a speed requirement.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// The packaged unit file.
fn unit_file() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../packaging/debian/ratelimit.service")
}

/// `CapabilityBoundingSet=` of the unit, e.g. `["CAP_BPF", "CAP_NET_ADMIN"]`.
fn unit_capabilities() -> Vec<String> {
    let text = fs::read_to_string(unit_file()).unwrap();
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("the unit sets CapabilityBoundingSet=");
    line.split_whitespace().map(str::to_owned).collect()
}

/// Bit numbers (capability.h) of the capabilities the unit may name.
fn cap_bit(name: &str) -> u32 {
    match name {
        "CAP_NET_ADMIN" => 12,
        "CAP_SYS_ADMIN" => 21,
        "CAP_PERFMON" => 38,
        "CAP_BPF" => 39,
        other => panic!("capability {other} not known to this test"),
    }
}

/// The agent, started like the unit starts it (see the module docs), in `ns` with the host's
/// bpffs (the same launch as `AgentProcess`, with `setpriv` last before the agent).
struct ServiceAgent {
    child: Child,
    dir: PathBuf,
    pin: PathBuf,
    notify: UnixDatagram,
}

const LAUNCH: &str = r#"ns=$1; mnt=$2; shift 2
mount --bind /sys/fs/bpf "$mnt" || exit 125
exec ip netns exec "$ns" sh -c 'mount --bind "$0" /sys/fs/bpf || exit 125; exec "$@"' "$mnt" "$@"
"#;

impl ServiceAgent {
    fn start(ns: &Netns, iface: &str, tag: &str) -> ServiceAgent {
        let pin = AgentProcess::unique_pin_path();
        let dir = std::env::temp_dir().join(format!(
            "rl-e2e-svc-{tag}-{}",
            pin.file_name().unwrap().to_string_lossy()
        ));
        fs::create_dir_all(dir.join("bpffs")).unwrap();
        let config = dir.join("ratelimit.toml");
        fs::write(
            &config,
            format!(
                "[agent]\ninterfaces = [\"{iface}\"]\npin_path = \"{}\"\nsocket = \"{}\"\n\n\
                 [[rule]]\nname = \"clients\"\nsource = \"198.18.9.0/24\"\nrate = {RATE}\nburst = {BURST}\n",
                pin.display(),
                dir.join("agent.sock").display()
            ),
        )
        .unwrap();
        let notify_path = dir.join("notify.sock");
        let notify = UnixDatagram::bind(&notify_path).unwrap();
        notify.set_read_timeout(Some(READY_TIMEOUT)).unwrap();

        let caps: Vec<String> = unit_capabilities()
            .iter()
            .map(|c| format!("+{}", c.trim_start_matches("CAP_").to_lowercase()))
            .collect();
        let caps = format!("-all,{}", caps.join(","));
        let log = fs::File::create(dir.join("agent.log")).unwrap();
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
        .arg(dir.join("bpffs"))
        .arg("setpriv")
        .arg(format!("--bounding-set={caps}"))
        .arg(format!("--inh-caps={caps}"))
        .arg(format!("--ambient-caps={caps}"))
        .arg(agent_binary())
        .arg("agent")
        .arg("-c")
        .arg(&config)
        .env("NOTIFY_SOCKET", &notify_path)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
        // SAFETY: only prctl, async-signal-safe, between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        ServiceAgent {
            child,
            dir,
            pin,
            notify,
        }
    }

    fn log(&self) -> String {
        fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }

    /// The next notification datagram (panics with the agent's log after the timeout).
    fn next_notification(&self) -> String {
        let mut buf = [0u8; 4096];
        match self.notify.recv(&mut buf) {
            Ok(n) => String::from_utf8_lossy(&buf[..n]).into_owned(),
            Err(e) => panic!(
                "no notification on $NOTIFY_SOCKET ({e}); agent log:\n{}",
                self.log()
            ),
        }
    }

    /// Waits for a datagram holding `line` (e.g. `READY=1`), returning everything received.
    fn wait_for(&self, line: &str) -> Vec<String> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut seen = Vec::new();
        while Instant::now() < deadline {
            let msg = self.next_notification();
            let hit = msg.lines().any(|l| l == line);
            seen.push(msg);
            if hit {
                return seen;
            }
        }
        panic!(
            "no {line} within {READY_TIMEOUT:?}; got {seen:?}; log:\n{}",
            self.log()
        );
    }

    fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).unwrap()
    }

    /// `CapEff` and `CapBnd` of the agent process, from /proc.
    fn caps(&self) -> (u64, u64) {
        let status = fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let field = |name: &str| {
            let hex = status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .unwrap()
                .trim();
            u64::from_str_radix(hex, 16).unwrap()
        };
        (field("CapEff:"), field("CapBnd:"))
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(self.pid(), sig) }, 0);
    }

    fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "agent did not exit; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stats(&self) -> serde_json::Value {
        let out = Command::new(agent_binary())
            .args(["stats", "--json", "--pin-path"])
            .arg(&self.pin)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

impl Drop for ServiceAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if self.pin.exists() {
            let _ = ratelimit::dataplane::remove_pin_dir(&self.pin);
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

struct Bed {
    tx: Netns,
    rx: Netns,
    rx_if: String,
}

fn bed(tag: &str) -> Bed {
    require_root();
    let tx = Netns::new(&format!("rl-e2e-{tag}-tx")).unwrap();
    let rx = Netns::new(&format!("rl-e2e-{tag}-rx")).unwrap();
    let (tx_if, rx_if) = veth_pair(&tx, &rx, "es").unwrap();
    add_addr(&tx, &tx_if, &format!("{SOURCE}/24")).unwrap();
    add_addr(&rx, &rx_if, &format!("{RECEIVER}/24")).unwrap();
    neigh_to_peer(&tx, &tx_if, RECEIVER.parse().unwrap(), &rx, &rx_if).unwrap();
    Bed { tx, rx, rx_if }
}

#[test]
fn runs_with_the_units_capabilities_notifies_ready_and_enforces() {
    let bed = bed("svc");
    let caps = unit_capabilities();
    let mut agent = ServiceAgent::start(&bed.rx, &bed.rx_if, "ready");
    let before_ready = agent.wait_for("READY=1");
    assert!(
        before_ready.iter().all(|m| !m.contains("STOPPING=1")),
        "{before_ready:?}"
    );

    // It runs with exactly the unit's capabilities, no more.
    let want: u64 = caps.iter().map(|c| 1u64 << cap_bit(c)).sum();
    let (eff, bnd) = agent.caps();
    assert_eq!(
        eff, want,
        "CapEff {eff:#x}, unit grants {caps:?} = {want:#x}"
    );
    assert_eq!(
        bnd, want,
        "CapBnd {bnd:#x}, unit grants {caps:?} = {want:#x}"
    );

    // READY=1 means enforcing: attached, and a flood from one source is cut to its bucket.
    assert!(
        xdp_attachment(&bed.rx, &bed.rx_if).unwrap().is_some(),
        "READY=1 but no XDP program on {}; log:\n{}",
        bed.rx_if,
        agent.log()
    );
    let receiver = Receiver::bind(&bed.rx, SocketAddr::new(RECEIVER.parse().unwrap(), 0)).unwrap();
    let sent = send_udp_from(
        &bed.tx,
        SocketAddr::new(SOURCE.parse().unwrap(), 0),
        receiver.local_addr(),
        2_000,
        Duration::from_secs(2),
        64,
    )
    .unwrap();
    receiver.wait_idle(Duration::from_millis(200), Duration::from_secs(5));
    let report = receiver.stop().unwrap();
    let got = report.total();
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let allowed = BURST as f64 + RATE as f64 * (sent.last - sent.first).as_secs_f64();
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let got_f = got as f64;
    assert!(
        got_f <= allowed + 1.0,
        "received {got} of {} sent, bucket allows {allowed:.0}",
        sent.sent
    );
    assert!(got >= BURST, "received {got}: less than the burst");
    let stats = agent.stats();
    assert!(
        rule_packets(&stats, "clients", "dropped_rate") + got >= sent.sent,
        "dropped + received < sent: {stats}"
    );

    // ExecReload= sends SIGHUP: RELOADING=1, then READY=1 again.
    agent.signal(libc::SIGHUP);
    let reload = agent.wait_for("READY=1");
    assert!(
        reload.iter().any(|m| m.lines().any(|l| l == "RELOADING=1")),
        "{reload:?}"
    );

    // systemctl stop sends SIGTERM: STOPPING=1, a clean exit, and nothing left attached.
    agent.signal(libc::SIGTERM);
    agent.wait_for("STOPPING=1");
    let status = agent.wait_exit();
    assert!(status.success(), "{status}; log:\n{}", agent.log());
    assert!(!agent.pin.exists(), "pins left after stop");
    assert_eq!(xdp_attachment(&bed.rx, &bed.rx_if).unwrap(), None);
}

#[test]
fn sigusr2_exits_leaving_the_limiter_attached_for_the_upgraded_agent() {
    let bed = bed("svcup");
    let mut agent = ServiceAgent::start(&bed.rx, &bed.rx_if, "usr2");
    agent.wait_for("READY=1");
    let attached = xdp_attachment(&bed.rx, &bed.rx_if).unwrap();
    assert!(attached.is_some(), "log:\n{}", agent.log());

    agent.signal(libc::SIGUSR2);
    let status = agent.wait_exit();
    assert!(status.success(), "{status}; log:\n{}", agent.log());
    assert!(
        agent.pin.exists(),
        "SIGUSR2 removed the pins; log:\n{}",
        agent.log()
    );
    assert_eq!(
        xdp_attachment(&bed.rx, &bed.rx_if).unwrap(),
        attached,
        "SIGUSR2 detached; log:\n{}",
        agent.log()
    );
}
