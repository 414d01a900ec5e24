//! `ratelimit-demo`: the demo behind `cargo xtask demo`, which sets up the toolchain, builds the
//! agent and this driver, and then hands over to it (see xtask/src/demo.rs), with the agent's
//! binary in `RATELIMIT_BIN`. Namespaces, veth pairs, the receiver and the agent as a child
//! process come from the test bed (crate `tests`, `ratelimit_testbed`).
//!
//! What lives where: this file sets the scene and tells the story ([`run`]: namespaces, the
//! agent with [`CONFIG`], the clients, the live table, the summary, cleanup); [`traffic`] holds
//! the clients, paced UDP senders that count what they send; [`live`] reads what arrived and the
//! agent's counters (`ratelimit stats --json`) every second and prints the rows and the summary.
//! Data flows one way: clients -> veth -> XDP (the agent's program) -> receiver, and the counts of
//! all three -> [`live`] -> stdout.
//!
//! Two throwaway namespaces joined by a veth pair: `client`, holding a flooding source
//! (198.18.0.1) and a polite one (198.18.0.2), and `server` (198.18.0.254), where the real agent
//! attaches to the veth with the embedded [`CONFIG`]. Every second it prints what each source has
//! sent and what has arrived, and the agent's counters; then a summary. Every number shown is
//! measured: the clients count what they send, the receiver what arrives, the agent what it passed
//! and dropped. The one computed figure is the limit, burst + rate x the flood's measured duration,
//! from the rate and burst of the config the agent runs.
//!
//! Everything it makes is owned by a guard whose `Drop` removes it (the namespaces; the agent,
//! with its config file and pin directory), so an error cleans up too. SIGINT, SIGTERM and SIGHUP
//! only set a flag that the loops check: Ctrl-C (passed on by `cargo xtask demo`, which keeps this
//! driver and the agent in a process group of their own) ends the run early, the clients stop, and
//! cleanup happens the same way. At the end the driver checks that nothing it made is left.

mod live;
mod traffic;

use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::PathBuf,
    process::ExitCode,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, Context as _, Result};
use clap::Parser;
use ratelimit::config::Config;
use ratelimit_testbed::{
    add_addr, neigh_to_peer, netns_exists, veth_pair, AgentProcess, Netns, Receiver,
};

use crate::{live::Limit, traffic::Client};

/// The config the demo's agent runs; `{interface}` and `{pin_path}` are filled in.
const CONFIG: &str = r#"# The demo's config: every source address gets its own token bucket of 1000 packets/s with a
# burst of 500. The flooding client is cut down to that; the polite one, well under it, is never
# touched. Packets from sources that match no rule would pass.
[agent]
interfaces = ["{interface}"]
pin_path = "{pin_path}"

[[rule]]
name = "default"
source = "0.0.0.0/0"
rate = 1000
burst = 500
per = "source"
"#;

/// The flooding client's address (benchmarking range, RFC 2544).
const FLOOD: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 18, 0, 1));
/// The polite client's address.
const POLITE: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 18, 0, 2));
/// The server's address, where the receiver listens.
const SERVER: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 18, 0, 254));

/// Runs the demo; `cargo xtask demo` builds and starts it (with `RATELIMIT_BIN` set to the agent).
#[derive(Debug, Parser)]
#[command(name = "ratelimit-demo")]
struct Cli {
    /// How long the clients send, in seconds.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=3600))]
    seconds: u64,
    /// Packets per second the flooding client sends.
    #[arg(long, default_value_t = 15_000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    flood_pps: u64,
    /// Packets per second the polite client sends.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    polite_pps: u64,
}

/// The run was cut short by SIGINT or SIGTERM.
#[derive(Debug)]
struct Interrupted;

impl fmt::Display for Interrupted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("interrupted")
    }
}

impl std::error::Error for Interrupted {}

/// What the run made, by name, to check afterwards that none of it is left.
#[derive(Debug, Default)]
struct Made {
    namespaces: Vec<String>,
    agent_dir: Option<PathBuf>,
    pin_path: Option<PathBuf>,
}

impl Made {
    /// What still exists.
    fn leftovers(&self) -> Vec<String> {
        let mut left: Vec<String> = self
            .namespaces
            .iter()
            .filter(|name| netns_exists(name))
            .map(|name| format!("namespace {name}"))
            .collect();
        for path in self.agent_dir.iter().chain(&self.pin_path) {
            if path.exists() {
                left.push(path.display().to_string());
            }
        }
        left
    }

    fn describe(&self) -> String {
        let mut parts = Vec::new();
        if !self.namespaces.is_empty() {
            parts.push(format!("namespaces {}", self.namespaces.join(", ")));
        }
        if let Some(dir) = &self.agent_dir {
            parts.push(format!("agent config and log in {}", dir.display()));
        }
        if let Some(pin) = &self.pin_path {
            parts.push(format!("pin directory {}", pin.display()));
        }
        parts.join("; ")
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let interrupted = Arc::new(AtomicBool::new(false));
    for signal in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ] {
        if let Err(e) = signal_hook::flag::register(signal, Arc::clone(&interrupted)) {
            eprintln!("error: installing a handler for signal {signal}: {e}");
            return ExitCode::FAILURE;
        }
    }
    let mut made = Made::default();
    let result = run(&cli, &interrupted, &mut made);
    // Every guard has been dropped by now: check that nothing is left.
    let leftovers = made.leftovers();
    let what = made.describe();
    if !leftovers.is_empty() {
        eprintln!("error: left behind after cleanup: {}", leftovers.join(", "));
    } else if !what.is_empty() {
        eprintln!("==> demo: cleaned up, none left: {what}");
    }
    let code = match result {
        Err(e) if e.is::<Interrupted>() || interrupted.load(Ordering::SeqCst) => {
            eprintln!(
                "==> demo: interrupted{}",
                if e.is::<Interrupted>() {
                    String::new()
                } else {
                    format!(" ({e:#})")
                }
            );
            ExitCode::from(130)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
        Ok(()) if interrupted.load(Ordering::SeqCst) => {
            eprintln!("==> demo: interrupted");
            ExitCode::from(130)
        }
        Ok(()) => ExitCode::SUCCESS,
    };
    if leftovers.is_empty() {
        code
    } else {
        ExitCode::FAILURE
    }
}

fn announce(what: &str) {
    eprintln!("==> {what}");
}

/// The demo, told in order: the namespaces, the agent, the traffic with its live table and the
/// summary, the agent stopped. What it makes is recorded in `made` as it goes, for the cleanup.
fn run(cli: &Cli, interrupted: &AtomicBool, made: &mut Made) -> Result<()> {
    let check = || {
        if interrupted.load(Ordering::SeqCst) {
            Err(anyhow!(Interrupted))
        } else {
            Ok(())
        }
    };
    let (client, server, server_if) = namespaces(made)?;
    check()?;
    let (agent, limit) = start_agent(&server, &server_if, made)?;
    check()?;
    send_and_watch(cli, interrupted, (&client, &server), &agent, &limit)?;

    announce("Stopping the agent (SIGTERM)");
    let status = agent.stop()?;
    eprintln!("    agent exited ({status}), detached and removed its pin directory");
    Ok(())
}

/// The throwaway namespaces `client` and `server`, joined by a veth pair, addressed, with
/// static neighbours both ways; and the server's end of the pair, where the agent attaches.
fn namespaces(made: &mut Made) -> Result<(Netns, Netns, String)> {
    announce("Creating the throwaway namespaces `client` and `server`, joined by a veth pair");
    let client = Netns::new("rl-demo-client")?;
    made.namespaces.push(client.name().to_owned());
    let server = Netns::new("rl-demo-server")?;
    made.namespaces.push(server.name().to_owned());
    let (client_if, server_if) = veth_pair(&client, &server, "rld")?;
    add_addr(&client, &client_if, &format!("{FLOOD}/24"))?;
    add_addr(&client, &client_if, &format!("{POLITE}/24"))?;
    add_addr(&server, &server_if, &format!("{SERVER}/24"))?;
    // Static neighbours both ways: no ARP, so the only packets on the wire are the demo's.
    neigh_to_peer(&client, &client_if, SERVER, &server, &server_if)?;
    for ip in [FLOOD, POLITE] {
        neigh_to_peer(&server, &server_if, ip, &client, &client_if)?;
    }
    eprintln!(
        "    {} ({client_if}): {FLOOD} floods, {POLITE} is polite\n    {} ({server_if}): {SERVER}, \
         the agent attaches here",
        client.name(),
        server.name()
    );
    Ok((client, server, server_if))
}

/// The agent started in `server` on `server_if` with the demo's config, once it has attached;
/// its config printed as it read it; and the limit in force, for the summary.
fn start_agent(server: &Netns, server_if: &str, made: &mut Made) -> Result<(AgentProcess, Limit)> {
    let pin_path = PathBuf::from(format!("/sys/fs/bpf/rl-demo-{}", std::process::id()));
    let config_text = CONFIG
        .replace("{interface}", server_if)
        .replace("{pin_path}", &pin_path.display().to_string());
    // The agent parses it again; parsing here gives the summary the rate and burst in force.
    let config = Config::parse(&config_text, "the demo's config")?;
    let rule = config
        .rules
        .first()
        .context("the demo's config has no rule")?;
    let limit = Limit {
        rule: rule.name.clone(),
        rate: rule.rate.context("the demo's rule has no rate")?,
        burst: rule.burst.context("the demo's rule has no burst")?,
    };
    announce("Starting the agent in the server namespace and waiting until it has attached");
    made.pin_path = Some(pin_path);
    let agent = AgentProcess::start(server, &config_text, &[])?;
    made.agent_dir = agent.config_path().parent().map(PathBuf::from);
    for line in agent.log().lines() {
        eprintln!("    agent | {line}");
    }
    // As the agent read it: the test bed adds a control socket of its own to the text above.
    let in_force = std::fs::read_to_string(agent.config_path())
        .with_context(|| format!("reading {}", agent.config_path().display()))?;
    println!("The agent's config ({}):", agent.config_path().display());
    for line in in_force.lines() {
        println!("{}", format!("    {line}").trim_end());
    }
    println!();
    Ok((agent, limit))
}

/// The flood and the polite source send from `client` to a receiver in `server` for the demo's
/// seconds while the live table shows what the agent does; then the summary.
fn send_and_watch(
    cli: &Cli,
    interrupted: &AtomicBool,
    (client, server): (&Netns, &Netns),
    agent: &AgentProcess,
    limit: &Limit,
) -> Result<()> {
    let receiver = Receiver::bind(server, SocketAddr::new(SERVER, 0))?;
    let dst = receiver.local_addr();
    let flood = Client::bind(client, "flood", FLOOD, cli.flood_pps)?;
    let polite = Client::bind(client, "polite", POLITE, cli.polite_pps)?;
    let duration = Duration::from_secs(cli.seconds);
    announce(&format!(
        "Sending UDP to {dst} for {} s: {} pps from {FLOOD}, {} pps from {POLITE} (Ctrl-C stops)",
        cli.seconds, cli.flood_pps, cli.polite_pps
    ));

    let clients = [&flood, &polite];
    let stop = AtomicBool::new(false);
    let stopped = || stop.load(Ordering::SeqCst) || interrupted.load(Ordering::SeqCst);
    let start = Instant::now();
    let (last, totals) = thread::scope(|s| {
        let senders = clients.map(|c| s.spawn(|| c.run(dst, duration, &stopped)));
        let last = live::table(
            &clients,
            &receiver,
            agent.pin_path(),
            &limit.rule,
            start,
            interrupted,
        );
        // However the table ended, the senders stop now.
        stop.store(true, Ordering::SeqCst);
        let totals = senders.map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
        (last, totals)
    });
    let [flood_totals, polite_totals] = totals;
    let totals = [flood_totals?, polite_totals?];

    // Packets still in flight when the clients stopped are counted before the summary.
    receiver.wait_idle(Duration::from_millis(300), Duration::from_secs(3));
    let end = live::Sample::take(&clients, &receiver, agent.pin_path(), &limit.rule);
    let socket_drops = receiver.socket_drops().ok();
    drop(receiver);
    live::print_rows(&clients, &end, last.as_ref(), start, true);
    live::summary(
        &clients,
        &totals,
        &end,
        limit,
        socket_drops,
        interrupted.load(Ordering::SeqCst),
    );

    Ok(())
}
